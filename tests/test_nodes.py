"""The node classes on the tiny checkpoint, called the way ComfyUI calls them (outside ComfyUI here):
ComfyUI tensor conventions, errors that name the input, interrupts that leave the next run working,
and agreement with the core pipeline they wrap."""

import re
from pathlib import Path

import pytest
import torch
from qwen21_nodes.nodes import NODE_CLASS_MAPPINGS, host
from qwen21_nodes.nodes.encode import Qwen21Encode
from qwen21_nodes.nodes.loader import Qwen21DiffusersLoader, Qwen21ModelLoader
from qwen21_nodes.nodes.sample import Qwen21Sampler
from qwen21_nodes.nodes.vae import Qwen21VAEDecode, Qwen21VAEEncode
from qwen21_nodes.runner.cli import ensure_tiny_models
from qwen21_nodes.runner.core_nodes import load_image_file
from qwen21_nodes.runner.graph import input_specs

SAMPLER_DEFAULTS = {
    name: spec[2]["default"] for name, spec in input_specs(Qwen21Sampler).items() if "default" in spec[2]
}


def load_tiny(weight_dtype="auto", device="cpu"):
    """The tiny model through the loader node (the models folder set by the `model` fixture)."""
    loaded, *_ = Qwen21ModelLoader().load(
        host.list_weight_files("diffusion_models")[0],
        host.list_weight_files("text_encoders")[0],
        host.list_weight_files("vae")[0],
        weight_dtype=weight_dtype,
        device=device,
        offload_text_encoder=True,
    )
    return loaded


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    models = ensure_tiny_models(tmp_path_factory.getbasetemp() / "tiny_models")
    host.set_models_dir(models)
    yield load_tiny()
    host.set_models_dir(None)


def encode(model, prompt="a red apple", resolution=64, **images):
    return Qwen21Encode().encode(model, prompt, "", resolution, **images)


def sample(model, conditioning, **changes):
    inputs = {**SAMPLER_DEFAULTS, "steps": 2, **changes}
    return Qwen21Sampler().sample(model, conditioning, **inputs)


def test_the_loader_gives_the_pipeline_the_hosts_cancel_for_its_warmup_waits(model):
    """A wait for the kernel warm-up (a compile that hangs) must end when the user cancels: the loader passes the
    host's interrupt check down to the pipeline, whose warm-up calls it while waiting (qwen21_core/startup/)."""
    assert model.pipe.check_interrupted is host.check_interrupted


def test_loaders_list_the_tiny_files_and_agree(model):
    (folder,) = [f for f in host.list_diffusers_folders() if "turbo" not in f]
    from_folder, *_ = Qwen21DiffusersLoader().load(folder, "fp32", "cpu", True)
    assert model.pipe.dtype == torch.float32 and model.pipe.device.type == "cpu"  # auto on CPU = fp32
    for ours, theirs in zip(
        model.pipe.transformer.state_dict().values(), from_folder.pipe.transformer.state_dict().values(), strict=True
    ):
        assert torch.equal(ours, theirs)
    assert (
        host.list_weight_files("diffusion_models")[0]
        in Qwen21ModelLoader.INPUT_TYPES()["required"]["diffusion_model"][0]
    )


def test_encode_derives_the_size_from_the_last_image(model):
    cond, width, height, *_ = encode(model, resolution=128)
    assert (width, height) == (128, 128) == (cond.width, cond.height)
    wide = torch.rand(1, 64, 128, 3)
    tall = torch.rand(1, 128, 64, 3)
    cond, width, height, *_ = encode(model, resolution=128, image_1=tall, image_2=wide)
    assert cond.num_images == 2 and width > height and width % 32 == 0 and height % 32 == 0


def test_encode_accepts_loadimage_masks_and_rejects_orphan_masks(model):
    image, mask = load_image_file(str(host_examples() / "rgba_subject.png"))
    cond, _, _, *_ = encode(model, image_1=image, mask_1=mask)
    assert cond.num_images == 1
    _rgb_only, placeholder = load_image_file(str(host_examples() / "reference_1.png"))  # 64x64 "no alpha" mask
    assert encode(model, image_1=_rgb_only, mask_1=placeholder)[0].num_images == 1
    with pytest.raises(ValueError, match="mask_2 is connected but image_2 is not"):
        encode(model, image_1=image, mask_2=mask)
    # a mask of another image (another size) is refused before any work, naming both sizes
    with pytest.raises(ValueError, match=r"mask_2 is 192x192 pixels but image_2 is 256x192 \(width x height\)"):
        encode(model, image_1=image, mask_1=mask, image_2=_rgb_only, mask_2=mask)
    # ComfyUI hands a node every linked input, declared or not: a 17th image must not vanish.
    with pytest.raises(ValueError, match="no input image_17: it takes at most 16 condition images"):
        encode(model, image_1=image, image_17=image)


def test_a_mask_is_its_own_images_alpha_and_no_other_images(model):
    """LoadImage's IMAGE + MASK into Qwen21Encode encodes what the RGBA file holds (the MASK is 1 - alpha), and mask_2
    reaches image_2 alone: image_1's latents are those it has with no mask connected anywhere."""
    from PIL import Image

    path = host_examples() / "rgba_subject.png"
    image, mask = load_image_file(str(path))
    other = torch.rand(1, 64, 64, 3, generator=torch.Generator().manual_seed(2))
    masked, _, _, *_ = encode(model, image_1=other, image_2=image, mask_2=mask)
    unmasked, _, _, *_ = encode(model, image_1=other, image_2=image)
    with Image.open(path) as opened:
        from_file = model.pipe.encode("a red apple", images=[other, opened.convert("RGBA")], output_resolution=64)
    assert torch.equal(masked.condition_latents[1], from_file.condition_latents[1])
    assert torch.equal(masked.positive.embeds, from_file.positive.embeds)
    assert masked.content_hash == from_file.content_hash
    assert torch.equal(masked.condition_latents[0], unmasked.condition_latents[0])  # image_1 untouched by mask_2
    assert not torch.equal(masked.condition_latents[1], unmasked.condition_latents[1])  # without it: opaque
    assert masked.content_hash != unmasked.content_hash


def test_a_prompt_too_long_for_the_dit_fails_at_the_encode_node_before_any_weights_move(model, monkeypatch):
    calls = []
    original = model.encode
    monkeypatch.setattr(model, "encode", lambda **kwargs: calls.append(kwargs) or original(**kwargs))
    too_long = ("a photo of a cat. " * 3000)[:50000]
    with pytest.raises(ValueError, match=r"rotary position \d+ is outside the model's table \(-1024..8191\)"):
        encode(model, prompt=too_long)
    image = torch.rand(1, 64, 64, 3)
    with pytest.raises(ValueError, match="outside the model's table"):
        encode(model, prompt=too_long, image_1=image)
    assert calls == []
    encode(model, prompt="a red apple", image_1=image)
    assert len(calls) == 1


def host_examples():
    from qwen21_nodes.runner.cli import EXAMPLE_INPUTS

    return EXAMPLE_INPUTS


def test_sampler_gives_a_comfyui_latent_and_stats(model):
    cond, width, height, *_ = encode(model)
    result = sample(model, cond, batch_size=2, seed=5)
    (latent,) = result["result"]
    samples = latent["samples"]
    assert samples.shape == (2, 64, height // 16, width // 16) and samples.device.type == "cpu"
    assert samples.dtype == torch.float32 and torch.isfinite(samples).all()
    stats = result["ui"]["qwen21_stats"][0]
    assert stats["steps"] == 2 and "steps/s" in result["ui"]["qwen21_status"][0]
    expected = model.pipe.sample(cond, steps=2, seed=5, batch_size=2)
    assert torch.equal(samples, expected.cpu())
    other = sample(model, cond, batch_size=2, seed=6)["result"][0]["samples"]
    assert not torch.equal(samples, other)


def test_sampler_size_schedules_and_denoise(model):
    cond, _, _, *_ = encode(model)
    latent = sample(model, cond, width=96, height=64)["result"][0]
    assert latent["samples"].shape[-2:] == (4, 6)
    custom = sample(model, cond, schedule="custom", sigmas="1.0, 0.6, 0.3, 0")  # ComfyUI-style list
    assert custom["ui"]["qwen21_stats"][0]["steps"] == 3
    left = sample(model, cond, sigmas="1.0, 0.6, 0.3, 0")  # a custom list without schedule custom: said, not used
    assert left["ui"]["qwen21_stats"][0]["steps"] == 2
    assert "sigmas ignored (schedule default, not custom)" in left["ui"]["qwen21_status"][0]
    half = sample(model, cond, latent=latent, denoise=0.5)["result"][0]["samples"]
    assert half.shape == latent["samples"].shape  # size taken from the input latent
    with pytest.raises(ValueError, match="denoise 0.5 < 1 needs an input `latent`"):
        sample(model, cond, denoise=0.5)
    with pytest.raises(ValueError, match="latent must be Qwen-Image-2.1 latents"):
        sample(model, cond, latent={"samples": torch.zeros(1, 16, 8, 8)}, denoise=0.5)
    with pytest.raises(ValueError, match="turbo"):
        sample(model, cond, schedule="turbo")


def test_sampler_starts_from_the_input_latent_like_the_pipeline(model):
    """img2img through the node (VAE Encode -> Sampler at denoise 0.25) gives what the pipeline gives from the same
    start latent, seed and steps, and not the text-to-image result: every example workflow runs at denoise 1.0, so a
    node that dropped its `latent` would pass every other test."""
    cond, width, height, *_ = encode(model)
    image = torch.rand(1, height, width, 3, generator=torch.Generator().manual_seed(4))
    (start,) = Qwen21VAEEncode().encode(model, image)
    img2img = sample(model, cond, latent=start, denoise=0.25, steps=3, seed=11)["result"][0]["samples"]
    expected = model.pipe.sample(cond, steps=3, seed=11, start_latents=start["samples"], denoise=0.25)
    assert torch.equal(img2img, expected.cpu()), "the node's img2img differs from the pipeline's from the same start"
    text_to_image = sample(model, cond, steps=3, seed=11)["result"][0]["samples"]
    # a quarter of the schedule from the start latent ends nearer to it than a run from pure noise does
    to_start = (img2img - start["samples"]).abs().mean().item()
    from_noise = (text_to_image - start["samples"]).abs().mean().item()
    assert to_start < 0.5 * from_noise, f"img2img is {to_start:.4g} from its start, text-to-image {from_noise:.4g}"


def test_interrupt_stops_sampling_and_the_next_run_works(model):
    cond, _, _, *_ = encode(model)
    host.request_interrupt()
    with pytest.raises(host.Interrupted):
        sample(model, cond, steps=5)
    assert sample(model, cond)["ui"]["qwen21_stats"][0]["steps"] == 2


def test_decode_splits_alpha_like_comfyui(model):
    cond, width, height, *_ = encode(model)
    latent = sample(model, cond)["result"][0]
    result = Qwen21VAEDecode().decode(model, latent, "auto", 0, "auto", "exact")
    image, mask = result["result"]
    assert image.shape == (1, height, width, 3) and mask.shape == (1, height, width)
    rgba = model.pipe.decode(latent["samples"])
    assert torch.equal(image, rgba[..., :3]) and torch.equal(mask, 1.0 - rgba[..., 3])
    assert "VAE untiled" in result["ui"]["qwen21_status"][0]
    tiled = Qwen21VAEDecode().decode(model, latent, "on", 32, "fp32", "exact")
    assert tiled["ui"]["qwen21_stats"][0]["tiled"] and tiled["ui"]["qwen21_stats"][0]["tiles"] > 1
    # the node's settings reach the VAE (tile accuracy itself is tests/test_vae_tiling.py's business)
    tiled_rgba = model.pipe.decode(latent["samples"], tiling="on", tile_size=32, precision="fp32", quality="exact")
    assert torch.equal(tiled["result"][0], tiled_rgba[..., :3])
    assert torch.equal(tiled["result"][1], 1.0 - tiled_rgba[..., 3])
    assert not torch.equal(tiled["result"][0], image)
    with pytest.raises(ValueError, match="latents of other models"):
        Qwen21VAEDecode().decode(model, {"samples": torch.zeros(1, 16, 4, 4)}, "auto", 0, "auto", "exact")


def test_vae_encode_crops_to_16_and_round_trips_the_shape(model):
    image = torch.rand(2, 70, 50, 3)
    (latent,) = Qwen21VAEEncode().encode(model, image, torch.zeros(1, 64, 64))
    assert latent["samples"].shape == (2, 64, 4, 3)
    (decoded, alpha) = Qwen21VAEDecode().decode(model, latent, "auto", 0, "auto", "exact")["result"]
    assert decoded.shape == (2, 64, 48, 3) and alpha.shape == (2, 64, 48)
    with pytest.raises(ValueError, match="at least 16x16"):
        Qwen21VAEEncode().encode(model, torch.rand(1, 8, 8, 3))
    with pytest.raises(ValueError, match=r"mask is 64x64 pixels but image is 50x70 \(width x height\)"):
        Qwen21VAEEncode().encode(model, image, torch.rand(1, 64, 64))


def test_vae_encode_reads_the_mask_as_alpha_cropped_with_its_image(model):
    """The VAE reads the alpha: image + MASK (1 - alpha) encode as the RGBA image they make, the mask cropped to 16
    with its image (the same centre); LoadImage's 64x64 zero mask (no alpha) encodes as no mask, fully opaque."""
    generator = torch.Generator().manual_seed(6)
    image = torch.rand(1, 70, 50, 3, generator=generator)
    mask = (torch.rand(1, 70, 50, generator=generator) > 0.5).float()
    (masked,) = Qwen21VAEEncode().encode(model, image, mask)
    rgba = torch.cat([image, 1.0 - mask[..., None]], dim=-1)[:, 3:67, 1:49]  # the centre 64x48
    assert torch.equal(masked["samples"], model.pipe.encode_image(rgba)), "the mask is not the cropped image's alpha"
    (plain,) = Qwen21VAEEncode().encode(model, image)
    (zero_mask,) = Qwen21VAEEncode().encode(model, image, torch.zeros(1, 64, 64))
    opaque = torch.cat([image, torch.ones(1, 70, 50, 1)], dim=-1)[:, 3:67, 1:49]
    assert torch.equal(zero_mask["samples"], plain["samples"])
    assert torch.equal(plain["samples"], model.pipe.encode_image(opaque))
    assert (masked["samples"] - plain["samples"]).abs().max() > 0.01


def test_negative_prompt_is_encoded_by_the_sampler_only_for_true_cfg(model, monkeypatch):
    """cfg 1 never encodes the negative prompt; the first cfg > 1 run encodes it once, with the text encoder
    placed again through the memory manager (it was offloaded after Qwen21Encode), later runs reuse it."""
    calls, placed = [], []
    original = model.pipe.text_encoder.encode_prompts
    monkeypatch.setattr(
        model.pipe.text_encoder,
        "encode_prompts",
        lambda prompts, images: calls.append(list(prompts)) or original(prompts, images),
    )
    monkeypatch.setattr(model.text_encoder, "load", lambda *args: placed.append("load"))
    monkeypatch.setattr(model.text_encoder, "unload", lambda: placed.append("unload"))
    image = torch.rand(1, 64, 64, 3)
    cond, _, _, *_ = Qwen21Encode().encode(model, "a red apple", "blurry", 64, image_1=image)
    assert calls == [["a red apple"]] and placed == ["load", "unload"]
    plain = sample(model, cond, true_cfg_scale=1.0)
    assert len(calls) == 1 and cond.negative is None and plain["ui"]["qwen21_stats"][0]["prefills"] == 1
    guided = sample(model, cond, true_cfg_scale=4.0)
    assert calls[1:] == [["blurry"]] and placed[2:] == ["load", "unload"]
    assert guided["ui"]["qwen21_stats"][0]["prefills"] == 2  # both branches ran
    again = sample(model, cond, true_cfg_scale=4.0)
    assert len(calls) == 2 and len(placed) == 4  # encoded once
    assert torch.equal(again["result"][0]["samples"], guided["result"][0]["samples"])
    # the values: what the pipeline gives at cfg 4 (whose guidance formula tests/test_sampler.py checks), and not the
    # unguided result (a negative branch that saw the positive prompt would give exactly that)
    expected = model.pipe.sample(cond, steps=2, seed=0, true_cfg_scale=4.0)
    assert torch.equal(guided["result"][0]["samples"], expected.cpu())
    steer = (guided["result"][0]["samples"] - plain["result"][0]["samples"]).abs().max().item()
    assert steer > 0.01, f"cfg 4 with a negative prompt moved the latents by {steer:.3g} from cfg 1"


def test_the_encoder_asks_the_memory_manager_for_room_for_its_activations(model, monkeypatch):
    """Qwen21Encode loads the text encoder with its activations' estimate as memory_required (ComfyUI then keeps
    that much free beside it, or streams layers); the estimate covers the real sequence and grows by each image's
    <|image_pad|> tokens."""
    asked = []
    monkeypatch.setattr(model.text_encoder, "load", lambda memory_required=0: asked.append(memory_required))
    text_encoder = model.pipe.text_encoder
    image = torch.rand(1, 256, 256, 3)
    plain, _, _, *_ = Qwen21Encode().encode(model, "a red apple", "", 256)
    two, _, _, *_ = Qwen21Encode().encode(model, "a red apple", "", 256, image_1=image, image_2=image)
    per_token = text_encoder.activation_bytes(1)
    assert per_token == 36 * text_encoder.hidden_size * text_encoder.dtype.itemsize > 0
    assert asked[1] - asked[0] >= 2 * (256 // 32) ** 2 * per_token  # each image: its pads and its markers
    for cond, requested in ((plain, asked[0]), (two, asked[1])):
        assert requested >= cond.positive.embeds.shape[0] * per_token


def test_cancel_stops_inside_one_untiled_decode_and_the_next_decode_works(model):
    cond, _, _, *_ = encode(model)
    latent = sample(model, cond)["result"][0]
    before = Qwen21VAEDecode().decode(model, latent, "off", 0, "auto", "exact")["result"][0]
    decoder = model.pipe.vae.decoder
    last_ran = []
    # The user presses Cancel while the first up block runs; the last block must then never run.
    hooks = [
        decoder.up_blocks[0].resnets[0].register_forward_hook(lambda *args: host.request_interrupt()),
        decoder.up_blocks[-1].resnets[-1].register_forward_pre_hook(lambda *args: last_ran.append(True)),
    ]
    try:
        with pytest.raises(host.Interrupted):
            Qwen21VAEDecode().decode(model, latent, "off", 0, "auto", "exact")
    finally:
        for hook in hooks:
            hook.remove()
    assert last_ran == []  # stopped inside the one untiled pass
    after = Qwen21VAEDecode().decode(model, latent, "off", 0, "auto", "exact")["result"][0]
    assert torch.equal(after, before)  # the next decode works and the interruption points change no value


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_vae_interruption_points_change_no_value(model, device):
    """16 points per pass (after the mid block and every up-block residual block, as at the released size);
    on CUDA each waits for the GPU's earlier work, so a raise there stops a decode that is still running."""
    import copy

    vae = copy.deepcopy(model.pipe.vae).to(device)
    z = torch.randn(1, 64, 4, 6, generator=torch.Generator().manual_seed(0)).to(device)
    plain = vae.decode(z, tiling="off")
    points = []
    assert torch.equal(vae.decode(z, tiling="off", check_interrupt=lambda: points.append(1)), plain)
    assert len(points) == 1 + 3 * len(vae.decoder.up_blocks) == 16

    class Stop(Exception):
        pass

    def stop_at_third():
        points.append(1)
        if len(points) == 16 + 3:
            raise Stop

    with pytest.raises(Stop):
        vae.decode(z, tiling="off", check_interrupt=stop_at_third)
    assert torch.equal(vae.decode(z, tiling="off"), plain)


def test_prefix_cache_toggle_reaches_the_sampler(model):
    cond, _, _, *_ = encode(model)
    on = sample(model, cond, steps=3, prefix_cache=True)
    off = sample(model, cond, steps=3, prefix_cache=False)
    on_stats, off_stats = on["ui"]["qwen21_stats"][0], off["ui"]["qwen21_stats"][0]
    assert on_stats["prefix_cache"] == "on" and on_stats["prefills"] == 1
    assert off_stats["prefix_cache"] == "off" and off_stats["prefills"] == 3  # recomputed at every step
    assert torch.equal(on["result"][0]["samples"], off["result"][0]["samples"])  # fp32: identical


def test_decode_graphs_toggle_reaches_the_pipeline(model):
    """On the CPU the pipeline takes the toggle and reports why it decodes eagerly; the GPU test below checks
    capture, replay and the kept prefix through the node (tests/test_decode_graphs.py the bookkeeping, on
    the CPU with a stand-in capture)."""
    cond, _, _, *_ = encode(model)
    off = sample(model, cond, decode_graphs=False)["ui"]["qwen21_stats"][0]
    on = sample(model, cond, decode_graphs=True)["ui"]["qwen21_stats"][0]
    assert off["decode_graph"] == "off: disabled"
    assert on["decode_graph"] == "off: needs CUDA (model on cpu)"


@pytest.mark.gpu
def test_decode_graphs_toggle_captures_replays_and_keeps_the_prefix_on_cuda(model):
    """The load's kernel warm-up is waited for first: while it runs, a first-seen shape's timed step gives no verdict
    and the run stays eager (dit/decode_graphs.py), which made this test race the warm-up on fresh machines (it
    failed 3 of 4 there, issue 54)."""
    cuda_model = load_tiny(weight_dtype="bf16", device="cuda:0")
    if cuda_model.pipe.kernel_warmup is not None:
        cuda_model.pipe.kernel_warmup.wait()
    cond, _, _, *_ = encode(cuda_model)
    off = sample(cuda_model, cond, decode_graphs=False, steps=3)
    on = sample(cuda_model, cond, decode_graphs=True, steps=3)
    assert off["ui"]["qwen21_stats"][0]["decode_graph"] == "off: disabled"
    assert on["ui"]["qwen21_stats"][0]["decode_graph"] == "replay"
    assert torch.equal(on["result"][0]["samples"], off["result"][0]["samples"])
    rerun = sample(cuda_model, cond, decode_graphs=True, steps=3, seed=9)["ui"]["qwen21_stats"][0]
    assert rerun["prefix_cache"] == "reused" and rerun["prefills"] == 0  # the kept entry skips the prefill


def test_compile_blocks_toggle_reaches_the_transformer(model, monkeypatch):
    """torch.compile is replaced by a recording identity (real compilation is the GPU benchmark's business):
    with the toggle on, the decode steps run through the compiled block functions; off, they do not."""
    compiled_calls = []

    def recording_compile(fn, **kwargs):
        def compiled(*args, **kw):
            compiled_calls.append(fn.__name__)
            return fn(*args, **kw)

        return compiled

    monkeypatch.setattr(torch, "compile", recording_compile)
    cond, _, _, *_ = encode(model)
    transformer = model.pipe.transformer
    try:
        eager = sample(model, cond, steps=3)["result"][0]["samples"]
        assert not transformer.compiled and compiled_calls == []
        compiled = sample(model, cond, steps=3, compile_blocks=True)["result"][0]["samples"]
        layers = transformer.config.num_layers
        assert transformer.compiled and len(compiled_calls) == 3 * layers * 2  # qkv and finish, every decode step
        assert torch.equal(compiled, eager)  # the identity "compiler" changes nothing
        sample(model, cond, steps=3, compile_blocks=False)
        assert not transformer.compiled and len(compiled_calls) == 3 * layers * 2
    finally:
        transformer.compile_blocks(False)


def test_the_dit_is_loaded_for_what_the_run_needs_beyond_the_idle_caches_it_gets_back(model, monkeypatch):
    """A rerun finds the previous run's K/V cache idle in its graph entry (adopted, or evicted if it does not
    fit): the memory manager is asked only for the rest, so it does not stream DiT blocks for a cache it has."""
    cond, _, _, *_ = encode(model)
    asked = []
    monkeypatch.setattr(model.transformer, "load", lambda required=0, companions=(): asked.append(required))
    monkeypatch.setattr(model.pipe, "sampling_bytes", lambda *a, **k: 5000)
    for idle in (0, 1200, 9000):
        monkeypatch.setattr(model.pipe.decode_graphs, "idle_cache_bytes", lambda idle=idle: idle)
        sample(model, cond, steps=1)
    assert asked == [5000, 3800, 0]


# Widgets whose usable range depends on the machine, not on the node: the loaders' `gpus` goes up to 16 and a
# machine with fewer GPUs gets a clear error naming how many it has (tests/test_parallel.py checks that error).
MACHINE_BOUND = {("Qwen21ModelLoader", "gpus"), ("Qwen21DiffusersLoader", "gpus")}


def _numeric_widgets():
    for node_name, node_class in sorted(NODE_CLASS_MAPPINGS.items()):
        for name, (_section, kind, options) in input_specs(node_class).items():
            if kind in ("INT", "FLOAT") and (node_name, name) not in MACHINE_BOUND:
                for bound in ("min", "max"):
                    yield pytest.param(node_name, name, options[bound], id=f"{node_name}.{name}={bound}")


@pytest.fixture(scope="module")
def widget_model(model):
    """A model of its own: LoRAs at strength +-100 are merged into its weights."""
    return load_tiny()


@pytest.mark.parametrize("node_name,widget,value", list(_numeric_widgets()))
def test_every_numeric_widget_bound_is_accepted_by_its_node(widget_model, node_name, widget, value):
    """ComfyUI lets a user set a widget anywhere from its min to its max: the node must take both ends (the sampler's
    denoise offered 0, which the schedule refuses). Everything else small, so each call takes seconds on a CPU."""
    model = widget_model
    latent = {"samples": torch.zeros(1, 64, 4, 4)}
    hint = torch.rand(1, 64, 64, 3)
    control = {"control": lambda: NODE_CLASS_MAPPINGS["Qwen21ControlLoader"]().load(
        model, host.list_weight_files("model_patches")[0], "auto")[0], "control_image": lambda: hint}  # fmt: skip
    cheap_links = {
        "Qwen21Encode": lambda: {"model": model, "prompt": "a red apple", "output_resolution": 64},
        "Qwen21ApplyControl": lambda: {"model": model, **{k: make() for k, make in control.items()}},
        "Qwen21ApplyControlModel": lambda: {"model": None, **{k: make() for k, make in control.items()}},
        "Qwen21Sampler": lambda: {"model": model, "conditioning": encode(model)[0], "steps": 2, "latent": latent},
        "Qwen21VAEDecode": lambda: {"model": model, "latent": latent},
        "Qwen21LoraLoader": lambda: {"model": model, "lora_name": host.list_weight_files("loras")[0]},
        "Qwen21Scheduler": lambda: {"model": None},  # another MODEL than ours: the released schedule
        "Qwen21EmptyLatent": lambda: {},
    }
    assert node_name in cheap_links, f"{node_name} has numeric widgets: add a cheap call for it to this test"
    node_class = NODE_CLASS_MAPPINGS[node_name]
    defaults = {name: spec[2]["default"] for name, spec in input_specs(node_class).items() if "default" in spec[2]}
    inputs = {**defaults, **cheap_links[node_name](), widget: value}
    if node_name == "Qwen21ApplyControlModel":  # its MODEL exists inside ComfyUI only: the values pass, then it says so
        with pytest.raises(RuntimeError, match="inside ComfyUI"):
            getattr(node_class(), node_class.FUNCTION)(**inputs)
        return
    output = getattr(node_class(), node_class.FUNCTION)(**inputs)
    if node_name == "Qwen21LoraLoader":  # the strength is used where the DiT runs
        (with_lora,) = output
        assert sample(with_lora, encode(with_lora)[0], steps=1)["result"][0]["samples"].shape == (1, 64, 4, 4)


def test_empty_latent_has_the_size_asked_for_and_names_a_bad_one():
    from qwen21_nodes.nodes.latent import Qwen21EmptyLatent

    node = Qwen21EmptyLatent()
    (latent,) = node.make(1344, 768, 3)
    assert latent["samples"].shape == (3, 64, 48, 84) and not latent["samples"].any()
    with pytest.raises(ValueError, match="width 1000 is not a positive multiple of 32.*use 992"):
        node.make(1000, 768)
    with pytest.raises(ValueError, match="height 8192 is more than 4096"):
        node.make(1024, 8192)
    with pytest.raises(ValueError, match="batch_size must be from 1 to 16, got 17"):
        node.make(1024, 1024, 17)


def test_the_scheduler_names_a_size_beyond_its_widget():
    from qwen21_nodes.nodes.schedule import Qwen21Scheduler

    with pytest.raises(ValueError, match="multiples of 32 from 64 to 8192, got 1000000x1024"):
        Qwen21Scheduler().get_sigmas(None, "released", 8, 10**6, 1024, 1.0)


def test_error_texts_quote_the_limits_the_widgets_show(model):
    """An error must not name other limits than its widget (output_resolution said 32 under a widget minimum of 64;
    tile_size asked for multiples of 16 under a step of 64)."""
    from qwen21_nodes.nodes.encode import Qwen21Encode
    from qwen21_nodes.nodes.vae import Qwen21VAEDecode

    side = input_specs(Qwen21Encode)["output_resolution"][2]
    with pytest.raises(ValueError, match=rf"multiple of {side['step']} from {side['min']} to {side['max']}"):
        Qwen21Encode().encode(model, "a red apple", "", side["min"] - side["step"] // 2)
    tile = input_specs(Qwen21VAEDecode)["tile_size"][2]
    decode = Qwen21VAEDecode()
    latent = {"samples": torch.zeros(1, 64, 6, 6)}
    defaults = {name: spec[2]["default"] for name, spec in input_specs(Qwen21VAEDecode).items() if "default" in spec[2]}
    output = getattr(decode, decode.FUNCTION)(**{**defaults, "model": model, "latent": latent, "tiling": "on",
                                                 "tile_size": 3 * tile["step"]})  # fmt: skip
    assert output["result"][0].shape == (1, 96, 96, 3)
    with pytest.raises(ValueError, match=rf"multiple of {tile['step']} pixels"):
        getattr(decode, decode.FUNCTION)(**{**defaults, "model": model, "latent": latent, "tiling": "on",
                                            "tile_size": 3 * tile["step"] + tile["step"] // 2})  # fmt: skip


def test_every_node_has_a_help_page_that_fits_comfyuis_help_panel():
    """ComfyUI shows web/docs/<node>.md in a narrow side panel that cuts a wide table off at its default width: the
    pages list their inputs instead (a bullet each, or named in the text), every input of the node."""
    docs = Path(__file__).resolve().parents[1] / "web" / "docs"
    for name, node_class in NODE_CLASS_MAPPINGS.items():
        page = (docs / f"{name}.md").read_text()
        assert not re.search(r"^\s*\|", page, re.M), f"web/docs/{name}.md has a table"
        listed = set(re.findall(r"`(\w+)`", page))
        inputs = {
            n.split("_")[0] + "_1" if re.fullmatch(r"(image|mask)_\d+", n) else n for n in input_specs(node_class)
        }
        assert inputs <= listed | {"image_1", "mask_1"}, f"web/docs/{name}.md misses {sorted(inputs - listed)}"
