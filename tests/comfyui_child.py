"""Run inside a real ComfyUI (its Python) by tests/test_comfyui_types.py (on the CPU) and tests/test_comfyui_gpu.py: our
MODEL, CONDITIONING, SIGMAS and VAE driven by ComfyUI's own nodes in-process. argv: ComfyUI folder, a scratch folder,
the checks to run, and optionally the device ("cpu", the default, or "cuda"). Prints one JSON line per check:
{"check": name, ...measurements}; the pytest side asserts on them."""

from __future__ import annotations

import json
import logging
import sys
import traceback
from pathlib import Path

COMFYUI_DIR, SCRATCH = Path(sys.argv[1]), Path(sys.argv[2])
CHECKS = sys.argv[3].split(",")
DEVICE = sys.argv[4] if len(sys.argv) > 4 else "cpu"
sys.path.insert(0, str(COMFYUI_DIR))  # ComfyUI's own modules, as its main.py has them

import comfy.cli_args  # noqa: E402

comfy.cli_args.args.cpu = DEVICE == "cpu"
import comfy.model_management  # noqa: E402,F401 - first, so the pack sees a ComfyUI process
import comfy.patcher_extension  # noqa: E402
import comfy.samplers  # noqa: E402
import folder_paths  # noqa: E402
import torch  # noqa: E402
from comfy_extras import nodes_custom_sampler as custom  # noqa: E402
from qwen21_nodes.nodes import NODE_CLASS_MAPPINGS as OURS  # noqa: E402
from qwen21_nodes.nodes import host  # noqa: E402
from qwen21_nodes.qwen21_core.tiny import NAMES, make_tiny  # noqa: E402

import nodes as comfy_nodes  # noqa: E402

LORA_KEYS_NOT_LOADED: list[str] = []
LOG_LINES: list[str] = []


class _Lines(logging.Handler):
    def emit(self, record):
        message = record.getMessage()
        LOG_LINES.append(message)
        if message.startswith("lora key not loaded:"):
            LORA_KEYS_NOT_LOADED.append(message.split(":", 1)[1].strip())


logging.getLogger().addHandler(_Lines())
logging.getLogger().setLevel(logging.INFO)


def emit(**fields):
    print(json.dumps(fields), flush=True)


def setup():
    models = SCRATCH / "models"
    if not (models / NAMES["lora"]).exists():
        make_tiny(models)
    for kind in ("diffusion_models", "text_encoders", "vae", "loras", "diffusers", "model_patches"):
        folder_paths.add_model_folder_path(kind, str(models / kind), is_default=True)
    assert host.IN_COMFYUI


def load(weight_dtype="fp32"):
    loader = OURS["Qwen21ModelLoader"]()
    return loader.load(Path(NAMES["transformer"]).name, Path(NAMES["text_encoder"]).name, Path(NAMES["vae"]).name,
                       weight_dtype, "cpu" if DEVICE == "cpu" else "cuda:0", "auto")  # fmt: skip


def encode(handle, prompt="a red apple", negative="blurry", resolution=64, **images):
    return OURS["Qwen21Encode"]().encode(handle, prompt, negative, resolution, **images)


def ours(handle, cond, seed=3, steps=3, cfg=1.0, latent=None, denoise=1.0):
    inputs = {"seed": seed, "steps": steps, "true_cfg_scale": cfg, "width": 0, "height": 0, "batch_size": 1,
              "schedule": "default", "sigmas": "", "denoise": denoise, "prefix_cache": True, "decode_graphs": True,
              "latent": latent}  # fmt: skip
    return OURS["Qwen21Sampler"]().sample(handle, cond, **inputs)["result"][0]["samples"]


def custom_advanced(model, positive, negative, latent, seed=3, steps=3, cfg=1.0, sampler="euler", schedule=None):
    sigmas = schedule if schedule is not None else OURS["Qwen21Scheduler"]().get_sigmas(
        model, "released", steps, 0, 0, 1.0, latent=latent)[0]  # fmt: skip
    guider = custom.CFGGuider().get_guider(model, positive, negative, cfg)[0]
    (noise,) = custom.RandomNoise().get_noise(seed)
    (chosen,) = custom.KSamplerSelect().get_sampler(sampler)
    return custom.SamplerCustomAdvanced().sample(noise, guider, chosen, sigmas, latent)[0]["samples"]


def asked_memory(run) -> list[int]:
    """run() with ComfyUI's load_models_gpu recording the memory_required of each load that places our DiT: what
    ComfyUI's own sampler asks room for (comfy/sampler_helpers.py estimate_memory), beside the weights."""
    import comfy.sampler_helpers

    asked, real = [], comfy.model_management.load_models_gpu

    def recording(models, memory_required=0, *args, **kwargs):
        if any(type(getattr(m, "model", None)).__name__ == "Qwen21ComfyModel" for m in models):
            asked.append(int(memory_required))
        return real(models, memory_required, *args, **kwargs)

    comfy.model_management.load_models_gpu = comfy.sampler_helpers.comfy.model_management.load_models_gpu = recording
    try:
        run()
    finally:
        comfy.model_management.load_models_gpu = real
    return asked


def relative(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


# ---- checks -------------------------------------------------------------------------------------------------


def check_parity():
    """SamplerCustomAdvanced + euler + Qwen21Scheduler's SIGMAS against Qwen21 Sampler, cfg 1 and 4, with a
    condition image."""
    handle, model, _vae = load()
    image = torch.rand(1, 64, 96, 3, generator=torch.Generator().manual_seed(1))
    cond, _w, _h, positive, negative, latent = encode(handle, image_1=image)
    out = {}
    for cfg in (1.0, 4.0):
        expected = ours(handle, cond, cfg=cfg)
        got = custom_advanced(model, positive, negative, latent, cfg=cfg)
        out[f"cfg{cfg:g}"] = relative(got, expected)
        out[f"cfg{cfg:g}_prefills"] = handle.pipe.last_sample_stats["prefills"]
    emit(check="parity", **out)


def check_native_layout():
    """A CONDITIONING built to native TextEncodeQwenImage21's layout (context without pads, image_slots, raw
    reference latents, no marker of ours) gives what ours gives."""
    handle, model, _vae = load()
    image = torch.rand(1, 64, 64, 3, generator=torch.Generator().manual_seed(2))
    _cond, _w, _h, positive, negative, latent = encode(handle, image_1=image)

    def native(conditioning):
        context, extras = conditioning[0]
        plain = {k: v for k, v in extras.items() if k != "qwen21"}
        return [[context.clone(), {**plain, "reference_latents": [r.clone() for r in plain["reference_latents"]]}]]

    ours_latent = custom_advanced(model, positive, negative, latent)
    native_latent = custom_advanced(model, native(positive), native(negative), latent)
    emit(check="native_layout", relative=relative(native_latent, ours_latent),
         slots=positive[0][1]["image_slots"], references=len(positive[0][1]["reference_latents"]))  # fmt: skip


def check_ksampler_matrix():
    handle, model, vae = load()
    _cond, _w, _h, positive, negative, latent = encode(handle)
    results = {}
    for sampler in ("euler", "euler_ancestral", "dpmpp_2m", "res_multistep"):
        for scheduler in ("simple", "normal", "beta"):
            (out,) = comfy_nodes.KSampler().sample(model, 7, 3, 1.0, sampler, scheduler, positive, negative, latent)
            results[f"{sampler}/{scheduler}"] = bool(torch.isfinite(out["samples"]).all())
    (guided,) = comfy_nodes.KSamplerAdvanced().sample(model, "enable", 7, 4, 3.0, "euler", "simple", positive,
                                                      negative, latent, 0, 4, "disable")  # fmt: skip
    results["advanced/cfg3"] = bool(torch.isfinite(guided["samples"]).all())
    # a size Qwen21 Encode does not derive (its latent is square without images): Qwen21 Empty Latent's
    (wide,) = OURS["Qwen21EmptyLatent"]().make(96, 64, 2)
    (wide_out,) = comfy_nodes.KSampler().sample(model, 7, 2, 1.0, "euler", "simple", positive, negative, wide)
    (wide_image,) = comfy_nodes.VAEDecode().decode(vae, wide_out)
    emit(check="ksampler_matrix", results=results, shape=list(out["samples"].shape),
         wide_latent=list(wide_out["samples"].shape), wide_image=list(wide_image.shape))  # fmt: skip


def check_simple_schedule():
    """KSampler's `simple` on our MODEL against the released schedule at 1024x1024, 40 steps."""
    _handle, model, _vae = load()
    sampling = model.get_model_object("model_sampling")
    simple = comfy.samplers.calculate_sigmas(sampling, "simple", 40)
    latent = {"samples": torch.zeros(1, 64, 64, 64)}
    released = OURS["Qwen21Scheduler"]().get_sigmas(model, "released", 40, 1024, 1024, 1.0, latent=latent)[0]
    emit(check="simple_schedule", max_abs=(simple - released).abs().max().item(),
         max_abs_before_last=(simple[:-2] - released[:-2]).abs().max().item())  # fmt: skip


def check_lora_stack():
    """Two LoraLoaderModelOnly in a row, then a changed strength, against Qwen21 Load LoRA's chain: the same latents;
    and back to the plain MODEL, bit for bit."""
    handle, model, _vae = load()
    _cond, _w, _h, positive, negative, latent = encode(handle)
    name = Path(NAMES["lora"]).name
    plain = custom_advanced(model, positive, negative, latent)
    out = {}
    for first, second in ((0.7, 0.4), (0.7, -0.2)):
        (one,) = comfy_nodes.LoraLoaderModelOnly().load_lora_model_only(model, name, first)
        (two,) = comfy_nodes.LoraLoaderModelOnly().load_lora_model_only(one, name, second)
        theirs = custom_advanced(two, positive, negative, latent)
        (ours_one,) = OURS["Qwen21LoraLoader"]().load(handle, name, first)
        (ours_two,) = OURS["Qwen21LoraLoader"]().load(ours_one, name, second)
        mine = custom_advanced(ours_two.comfy_model, positive, negative, latent)
        out[f"{first}+{second}"] = {"difference": (theirs - mine).abs().max().item(),
                                    "effect": (theirs - plain).abs().max().item()}  # fmt: skip
    out["plain_again"] = (custom_advanced(model, positive, negative, latent) - plain).abs().max().item()
    emit(check="lora_stack", **out)


def check_lora(weight_dtype):
    """LoraLoaderModelOnly on our MODEL against Qwen21 Load LoRA (same file and strength), both sampled by
    SamplerCustomAdvanced; in fp32 also against Qwen21 Sampler's own loop."""
    LORA_KEYS_NOT_LOADED.clear()
    handle, model, _vae = load(weight_dtype)
    cond, _w, _h, positive, negative, latent = encode(handle)
    lora_name = Path(NAMES["lora"]).name
    plain = custom_advanced(model, positive, negative, latent)
    (with_comfy,) = comfy_nodes.LoraLoaderModelOnly().load_lora_model_only(model, lora_name, 0.7)
    theirs = custom_advanced(with_comfy, positive, negative, latent)
    (with_ours,) = OURS["Qwen21LoraLoader"]().load(handle, lora_name, 0.7)
    mine = custom_advanced(with_ours.comfy_model, positive, negative, latent)
    again = custom_advanced(model, positive, negative, latent)  # the plain MODEL after the LoRA'd clones
    loop = ours(with_ours, cond)  # our own sampler's loop, with our LoRA
    emit(check=f"lora_{weight_dtype}", effect=(theirs - plain).abs().max().item(),
         difference=(theirs - mine).abs().max().item(), plain_again=(again - plain).abs().max().item(),
         our_loop=relative(theirs, loop), patches=len(with_comfy.patches),
         keys_not_loaded=len(LORA_KEYS_NOT_LOADED))  # fmt: skip


def check_conditioning_nodes():
    handle, model, _vae = load()
    _cond, _w, _h, positive, negative, latent = encode(handle)
    guided = custom_advanced(model, positive, negative, latent, cfg=4.0)
    (zero,) = comfy_nodes.ConditioningZeroOut().zero_out(negative)
    zeroed = custom_advanced(model, positive, zero, latent, cfg=4.0)
    (ranged,) = comfy_nodes.ConditioningSetTimestepRange().set_range(positive, 0.0, 0.5)
    (_rest,) = comfy_nodes.ConditioningSetTimestepRange().set_range(positive, 0.5, 1.0)
    (combined,) = comfy_nodes.ConditioningCombine().combine(ranged, _rest)
    split = custom_advanced(model, combined, negative, latent)
    whole = custom_advanced(model, positive, negative, latent)
    (average,) = comfy_nodes.ConditioningAverage().addWeighted(positive, positive, 0.5)
    averaged = custom_advanced(model, average, negative, latent)
    emit(check="conditioning_nodes", zero_out_changes=(zeroed - guided).abs().max().item(),
         split_range_vs_whole=relative(split, whole), average_of_same=relative(averaged, whole),
         finite=bool(torch.isfinite(zeroed).all() and torch.isfinite(split).all()))  # fmt: skip


def check_vae():
    handle, model, vae = load()
    cond, *_ = encode(handle)
    latent = {"samples": ours(handle, cond)}
    (image,) = comfy_nodes.VAEDecode().decode(vae, latent)
    rgb, _alpha = OURS["Qwen21VAEDecode"]().decode(handle, latent, "auto", 0, "auto", "exact")["result"]
    (tiled,) = comfy_nodes.VAEDecodeTiled().decode(vae, latent, 64, 32)
    (encoded,) = comfy_nodes.VAEEncode().encode(vae, image)
    (ours_encoded,) = OURS["Qwen21VAEEncode"]().encode(handle, image[..., :3])
    emit(check="vae", channels=image.shape[-1], rgb=(image - rgb).abs().max().item(),
         tiled_finite=bool(torch.isfinite(tiled).all()),
         tiled_shape=list(tiled.shape),
         encode=(encoded["samples"] - ours_encoded["samples"]).abs().max().item())  # fmt: skip


def check_bad_inputs():
    handle, model, _vae = load()
    _cond, _w, _h, positive, negative, latent = encode(handle)
    errors = {}

    def attempt(name, run):
        try:
            run()
            errors[name] = None
        except Exception as error:  # noqa: BLE001 - each case reports its message
            errors[name] = f"{type(error).__name__}: {error}"

    sdxl = [[torch.zeros(1, 77, 2048), {"pooled_output": torch.zeros(1, 1280)}]]
    attempt("sdxl_conditioning", lambda: custom_advanced(model, sdxl, negative, latent))
    wide = [[torch.zeros(1, 77, 4096), {}]]
    width = model.model.pipe.transformer.config.context_in_dim
    t5 = [[torch.zeros(1, 12, width), {"pooled_output": torch.zeros(1, 768)}]]
    attempt("t5_conditioning", lambda: custom_advanced(model, t5, negative, latent))
    if width != 4096:
        attempt("wrong_width", lambda: custom_advanced(model, wide, negative, latent))
    four = {"samples": torch.randn(1, 4, 8, 8)}
    attempt("four_channel_latent", lambda: comfy_nodes.KSampler().sample(model, 1, 2, 1.0, "euler", "simple",
                                                                         positive, negative, four))  # fmt: skip
    patched = model.clone()
    patched.set_model_attn1_patch(lambda q, k, v, extra_options: (q, k, v))
    attempt("attention_patch", lambda: custom_advanced(patched, positive, negative, latent))
    # after every error, the next run works
    after = custom_advanced(model, positive, negative, latent)
    emit(check="bad_inputs", errors=errors, after_finite=bool(torch.isfinite(after).all()))


def check_sdxl_lora():
    """A LoRA for another model through ComfyUI's loader: ComfyUI names every key it cannot map, nothing lands."""
    from safetensors.torch import save_file

    LORA_KEYS_NOT_LOADED.clear()
    _handle, model, _vae = load()
    path = SCRATCH / "models" / "loras" / "sdxl_like.safetensors"
    save_file({"lora_unet_input_blocks_1_1_proj_in.lora_down.weight": torch.zeros(4, 320),
               "lora_unet_input_blocks_1_1_proj_in.lora_up.weight": torch.zeros(320, 4)}, str(path))  # fmt: skip
    try:
        comfy_nodes.LoraLoaderModelOnly().load_lora_model_only(model, path.name, 1.0)
        error = None
    except Exception as raised:  # noqa: BLE001 - the message is the measurement
        error = f"{type(raised).__name__}: {raised}"
    emit(check="sdxl_lora", keys_not_loaded=LORA_KEYS_NOT_LOADED[:], error=error)


def ksampler(model, positive, negative, latent, cfg=1.0, seed=7, steps=3, sampler="euler", scheduler="simple"):
    (out,) = comfy_nodes.KSampler().sample(model, seed, steps, cfg, sampler, scheduler, positive, negative, latent)
    return out["samples"]


def check_object_patch_leak():
    """An object patch (ModelSamplingAuraFlow's shift) on one clone must not reach the plain MODEL: the plain MODEL
    after the patched clone ran gives its own latent again, bit for bit."""
    from comfy_extras.nodes_model_advanced import ModelSamplingAuraFlow

    handle, model, _vae = load()
    _cond, _w, _h, positive, negative, latent = encode(handle)
    plain = ksampler(model, positive, negative, latent)
    (shifted,) = ModelSamplingAuraFlow().patch_aura(model, 6.0)
    patched = ksampler(shifted, positive, negative, latent)
    again = ksampler(model, positive, negative, latent)
    emit(check="object_patch_leak", patched_effect=(patched - plain).abs().max().item(),
         plain_again=(again - plain).abs().max().item())  # fmt: skip


def check_negative_left_alone():
    """At cfg 1 KSampler never uses the negative: it stays unencoded (no text-encoder load inside the run); at cfg 4
    it is encoded once, before the run; a cfg below 1 (a legitimate ComfyUI setting) runs too."""
    from qwen21_nodes.nodes.comfy.conditioning import unencoded_negative

    handle, model, _vae = load()
    _cond, _w, _h, positive, negative, latent = encode(handle, negative="")
    entry = {"cross_attn": negative[0][0], **negative[0][1]}
    encodes = []
    original = handle.pipe.encode_negative
    handle.pipe.encode_negative = lambda cond: encodes.append(1) or original(cond)
    ksampler(model, positive, negative, latent, cfg=1.0)
    after_cfg1 = len(encodes)
    pending_after_cfg1 = unencoded_negative(entry) is not None and entry["qwen21"].emitted is None
    guided = ksampler(model, positive, negative, latent, cfg=4.0)
    ksampler(model, positive, negative, latent, cfg=4.0, seed=8)
    low = ksampler(model, positive, negative, latent, cfg=0.5)
    emit(
        check="negative_left_alone",
        encodes_at_cfg1=after_cfg1,
        pending_after_cfg1=pending_after_cfg1,
        encodes_after_cfg4_twice=len(encodes),
        finite=bool(torch.isfinite(guided).all() and torch.isfinite(low).all()),
    )


def check_empty_latents():
    """ComfyUI's Empty Latent Image and EmptySD3LatentImage on our MODEL: the size asked for, or a named error."""
    from comfy_extras.nodes_sd3 import EmptySD3LatentImage

    handle, model, vae = load()
    _cond, _w, _h, positive, negative, _latent = encode(handle)
    sizes, errors = {}, {}
    makers = {"EmptyLatentImage": lambda w, h: comfy_nodes.EmptyLatentImage().generate(w, h, 1)[0],
              "EmptySD3LatentImage": lambda w, h: _first(EmptySD3LatentImage.execute(w, h, 1))}  # fmt: skip
    for name, make in makers.items():
        for width, height in ((256, 256), (256, 160), (200, 136)):
            key = f"{name}/{width}x{height}"
            try:
                samples = ksampler(model, positive, negative, make(width, height), steps=1)
                (image,) = comfy_nodes.VAEDecode().decode(vae, {"samples": samples})
                sizes[key] = list(image.shape)
            except Exception as error:  # noqa: BLE001 - the message is the measurement
                errors[key] = f"{type(error).__name__}: {error}"
    emit(check="empty_latents", sizes=sizes, errors=errors)


def _first(output):
    return output[0] if isinstance(output, tuple) else output.result[0]


def check_unet_patches():
    """FreeU reads a UNet setting from the model config: refused by name at the node, and the MODEL still works."""
    from comfy_extras.nodes_freelunch import FreeU_V2

    handle, model, _vae = load()
    _cond, _w, _h, positive, negative, latent = encode(handle)
    try:
        FreeU_V2().patch(model, 1.3, 1.4, 0.9, 0.2)
        error = None
    except Exception as raised:  # noqa: BLE001 - the message is the measurement
        error = f"{type(raised).__name__}: {raised}"
    emit(
        check="unet_patches",
        error=error,
        is_key_error=error is not None and error.startswith("UNetPatchError"),
        after_finite=bool(torch.isfinite(ksampler(model, positive, negative, latent)).all()),
    )


def check_alpha_not_rank():
    """A LoRA whose alpha is not its rank, through ComfyUI's loader and Qwen21 Load LoRA: the merged weight is
    W + strength * alpha / rank * up @ down (fp32, computed here), and the plain MODEL gets W back exactly."""
    from qwen21_nodes.qwen21_core.lora.merge import lora_layers
    from safetensors.torch import save_file

    handle, model, _vae = load()
    transformer = handle.pipe.transformer
    slots = lora_layers(transformer)
    layer, rank, alpha, strength = "transformer_blocks.0.attn.to_q", 4, 3.0, 0.5
    slot = slots[layer]
    generator = torch.Generator().manual_seed(5)
    up = torch.randn(slot.shape[0], rank, generator=generator)
    down = torch.randn(rank, slot.shape[1], generator=generator)
    path = SCRATCH / "models" / "loras" / "alpha_not_rank.safetensors"
    save_file({f"diffusion_model.{layer}.lora_up.weight": up, f"diffusion_model.{layer}.lora_down.weight": down,
               f"diffusion_model.{layer}.alpha": torch.tensor(alpha)}, str(path))  # fmt: skip

    def weight():
        return transformer.get_parameter(slot.param)[slot.rows].detach().clone()

    comfy.model_management.load_models_gpu([model])
    original = weight()
    expected = original + strength * alpha / rank * (up @ down)
    (theirs,) = comfy_nodes.LoraLoaderModelOnly().load_lora_model_only(model, path.name, strength)
    comfy.model_management.load_models_gpu([theirs])
    through_comfy = weight()
    (ours_handle,) = OURS["Qwen21LoraLoader"]().load(handle, path.name, strength)
    comfy.model_management.load_models_gpu([ours_handle.comfy_model])
    through_ours = weight()
    comfy.model_management.load_models_gpu([model])
    scale = (expected - original).abs().max().item()
    emit(check="alpha_not_rank", comfy=(through_comfy - expected).abs().max().item() / scale,
         ours=(through_ours - expected).abs().max().item() / scale,
         plain_again=(weight() - original).abs().max().item())  # fmt: skip


def check_conditioning_combine():
    """ConditioningCombine of two different prompts through KSampler (cfg 1, and cfg 4 with a negative): ComfyUI
    averages the two predictions; the reference computes each prompt's velocity in a run of its own (our math per
    conditioning, nothing shared between them), inside the same KSampler loop."""
    import comfy.patcher_extension
    from qwen21_nodes.nodes.comfy.sampling import RUN_KEY

    handle, model, _vae = load()
    _c1, _w, _h, first, negative, latent = encode(handle, "a red apple on a table")
    _c2, _w, _h, second, _negative, _latent = encode(handle, "a blue car in the rain")
    (combined,) = comfy_nodes.ConditioningCombine().combine(first, second)

    def one_run_per_conditioning(executor, x, timestep, context, control, transformer_options, **kwargs):
        chunks = kwargs["qwen21"].conds
        rows = x.shape[0] // len(chunks)
        options = {k: v for k, v in transformer_options.items() if k != RUN_KEY}
        sides = transformer_options.get("cond_or_uncond") or [0] * len(chunks)
        out = []
        for index, cond in enumerate(chunks):
            part = slice(index * rows, (index + 1) * rows)
            single = kwargs["qwen21"].__class__([cond])
            out.append(
                executor(
                    x[part],
                    timestep[part],
                    context,
                    control,
                    {**options, "cond_or_uncond": [sides[index]]},
                    **{**kwargs, "qwen21": single},
                )
            )
        return torch.cat(out)

    reference = model.clone()
    reference.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, "reference",
                                   one_run_per_conditioning)  # fmt: skip
    out = {}
    for cfg in (1.0, 4.0):
        got = ksampler(model, combined, negative, latent, cfg=cfg)
        expected = ksampler(reference, combined, negative, latent, cfg=cfg)
        alone = ksampler(model, first, negative, latent, cfg=cfg)
        out[f"cfg{cfg:g}"] = {"relative": relative(got, expected), "effect": relative(alone, expected)}
    emit(check="conditioning_combine", **out)


def check_gguf_model():
    """The loader with the tiny GGUF DiT (Q8_0 blocks): KSampler on its MODEL gives Qwen21 Sampler's latent, and
    ComfyUI's LoRA loader on it runs the LoRA beside the blocks (its effect, the blocks untouched)."""
    from qwen21_nodes.qwen21_core.quant.gguf_linear import GGUFLinear

    loader = OURS["Qwen21ModelLoader"]()
    handle, model, _vae = loader.load(Path(NAMES["gguf"]).name, Path(NAMES["text_encoder"]).name,
                                      Path(NAMES["vae"]).name, "auto", DEVICE if DEVICE == "cpu" else "cuda:0",
                                      "auto")  # fmt: skip
    layers = [m for m in handle.pipe.transformer.modules() if isinstance(m, GGUFLinear)]
    cond, _w, _h, positive, negative, latent = encode(handle)
    ours_latent = ours(handle, cond)
    theirs = custom_advanced(model, positive, negative, latent)
    blocks = [layer.qweight.clone() for layer in layers]
    (with_lora,) = comfy_nodes.LoraLoaderModelOnly().load_lora_model_only(model, Path(NAMES["lora"]).name, 0.7)
    lora_latent = custom_advanced(with_lora, positive, negative, latent)
    plain_again = custom_advanced(model, positive, negative, latent)
    shape = [1, 64, 8, 8]  # memory_required of the GGUF MODEL against the float one's (the same config and dtype)
    _h, float_model, _v = load()
    required = model.model.memory_required(shape) - float_model.model.memory_required(shape)
    largest = max(m.out_features * m.in_features for m in layers) * handle.pipe.dtype.itemsize
    emit(check="gguf_model", required_extra=required, largest_weight=largest,
         layers=len(layers), types=sorted({t for m in layers for t in m.fmt.types}),
         relative=relative(theirs, ours_latent), lora_effect=(lora_latent - theirs).abs().max().item(),
         blocks_untouched=all(torch.equal(a, b.qweight) for a, b in zip(blocks, layers, strict=True)),
         plain_again=(plain_again - theirs).abs().max().item())  # fmt: skip


def check_small_card():
    """KSampler at cfg 1 and cfg 4 on a card where ComfyUI sees no room for the DiT and the text encoder together
    (--reserve-vram taken to all but what is allocated now, and a hard cap on this process): its manager evicts one
    for the other at every load. The prompt is encoded afresh for the capped runs, as a changed prompt is (its negative
    pending). The latents equal the uncapped run's, and at every model call the DiT is on the GPU (the negative's
    encode once evicted it mid-run, and the step ran on the CPU)."""
    small_card("small_card", *load("bf16"))


def check_small_card_gguf():
    """check_small_card with the tiny GGUF DiT (its blocks kept quantised, weight_dtype auto): the 8 GB card's case,
    where the GGUF blocks are what ComfyUI's manager places and streams."""
    loader = OURS["Qwen21ModelLoader"]()
    small_card("small_card_gguf", *loader.load(Path(NAMES["gguf"]).name, Path(NAMES["text_encoder"]).name,
                                               Path(NAMES["vae"]).name, "auto", "cuda:0", "auto"))  # fmt: skip


def small_card(check, handle, model, _vae):
    import comfy.model_management as mm
    import comfy.patcher_extension

    _cond, _w, _h, positive, negative, latent = encode(handle, "a red apple", negative="blurry")
    uncapped = {cfg: ksampler(model, positive, negative, latent, cfg=cfg) for cfg in (1.0, 4.0)}
    devices = []

    def where(executor, *args, **kwargs):
        devices.append(str(handle.pipe.transformer.device))
        return executor(*args, **kwargs)

    watched = model.clone()
    watched.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, "where", where)
    device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, (torch.cuda.memory_allocated(device) + 2**31) / total))
    mm.EXTRA_RESERVED_VRAM = int(mm.get_free_memory(device))  # ComfyUI's own view: nothing free beyond what it holds
    errors = {}
    capped = {}
    for cfg in (1.0, 4.0):
        _cond, _w, _h, positive, negative, latent = encode(handle, "a red apple", negative="blurry")  # afresh
        try:
            capped[cfg] = ksampler(watched, positive, negative, latent, cfg=cfg)
        except Exception as error:  # noqa: BLE001 - the message is the measurement
            errors[f"cfg{cfg:g}"] = f"{type(error).__name__}: {str(error)[:300]}"
    torch.cuda.set_per_process_memory_fraction(1.0)
    mm.EXTRA_RESERVED_VRAM = 0
    emit(check=check, devices=sorted(set(devices)), calls=len(devices), errors=errors,
         difference={f"cfg{cfg:g}": (capped[cfg] - uncapped[cfg]).abs().max().item() for cfg in capped},
         effect=(uncapped[4.0] - uncapped[1.0]).abs().max().item())  # fmt: skip


def check_encoder_in_place():
    """On the GPU: a text encoder that ComfyUI's manager left partly loaded (as sampling leaves it on a card without
    room for both models) encodes where it is, its other layers streamed, with no load through the manager, and gives
    the embeddings it gives whole."""
    import comfy.model_management as mm

    handle, _model, _vae = load("bf16")
    whole = encode(handle, "a red apple")[0].positive.embeds.float().cpu()
    te = handle.text_encoder
    te.patcher.partially_unload(te.patcher.offload_device, te.device_bytes() // 2)
    placed, loads, real = te.device_bytes(), [], mm.load_models_gpu

    def recording(models, *args, **kwargs):
        loads.append(any(m is te.patcher for m in models))
        return real(models, *args, **kwargs)

    mm.load_models_gpu = recording
    try:
        streamed = encode(handle, "a red apple")[0].positive.embeds.float().cpu()
    finally:
        mm.load_models_gpu = real
    emit(check="encoder_in_place", placed=placed, full=te.full_bytes, encoder_loads=sum(loads),
         resident=getattr(te.streamable, "resident_layers", None), layers=te.streamable.num_layers,
         difference=(streamed - whole).abs().max().item())  # fmt: skip


def check_control():
    """Fun-Control through ComfyUI's samplers: Qwen21 Apply Fun Control (MODEL) on our MODEL against Qwen21 Sampler with
    Qwen21 Apply Fun Control on the same weights; the MODEL output of the latter too; a partial range, strength 0."""
    handle, model, _vae = load()
    (control,) = OURS["Qwen21ControlLoader"]().load(handle, Path(NAMES["control"]).name, "auto")
    cond, _w, _h, positive, negative, latent = encode(handle)
    hint = torch.rand(1, 80, 48, 3, generator=torch.Generator().manual_seed(4))
    mask = torch.zeros(1, 64, 64)
    mask[:, 16:48, 16:48] = 1.0
    images = {"control_image": hint, "inpaint_image": torch.rand(1, 64, 64, 3), "mask": mask}
    controlled, controlled_model = OURS["Qwen21ApplyControl"]().apply(handle, control, 1.0, 0.0, 1.0, **images)
    (model_control,) = OURS["Qwen21ApplyControlModel"]().apply(model, control, 1.0, 0.0, 1.0, **images)
    (half,) = OURS["Qwen21ApplyControlModel"]().apply(model, control, 1.0, 0.5, 1.0, **images)
    (off,) = OURS["Qwen21ApplyControlModel"]().apply(model, control, 0.0, 0.0, 1.0, **images)
    expected = ours(controlled, cond)
    plain = ours(handle, cond)
    got = custom_advanced(model_control, positive, negative, latent)
    stats = dict(handle.pipe.last_sample_stats)  # this run's: the controlled MODEL's
    (both,) = OURS["Qwen21ApplyControlModel"]().apply(model, control, 1.0, 0.25, 0.75, **images)
    memory = {name: asked_memory(lambda m=patcher: custom_advanced(m, positive, negative, latent)) for name, patcher
              in (("plain", model), ("control", model_control), ("off", off), ("both_sides", both))}  # fmt: skip
    emit(check="control", parity=relative(got, expected), effect=relative(plain, expected), memory=memory,
         apply_model_output=relative(custom_advanced(controlled_model, positive, negative, latent), expected),
         half_to_full=relative(custom_advanced(half, positive, negative, latent), expected),
         half_to_plain=relative(custom_advanced(half, positive, negative, latent), plain),
         off_to_plain=(custom_advanced(off, positive, negative, latent)
                       - custom_advanced(model, positive, negative, latent)).abs().max().item(),
         prefills=stats.get("prefills"), status_control=stats.get("control"))  # fmt: skip


class NativeFunControlStandIn:
    """A stand-in for native ComfyUI's QwenImage21FunControlPatch (comfy_extras/nodes_qwen.py, Comfy-Org/ComfyUI
    08f68f09), holding what the real one holds and registering the same way: a diffusion-model wrapper and a block
    replacement ("dit", ("single_block", i)) per injection layer. Its hooks only count calls: on our MODEL they must
    never run (the door takes the control over)."""

    calls = 0

    def __init__(self, model_patch, vae, control_image, inpaint_image, mask, strength, injection_layers,
                 sigma_start, sigma_end):  # fmt: skip
        self.model_patch, self.vae = model_patch, vae
        self.control_image, self.inpaint_image, self.mask = control_image, inpaint_image, mask
        self.strength, self.injection_layers = strength, injection_layers
        self.sigma_start, self.sigma_end = sigma_start, sigma_end

    def diffusion_model_wrapper(self, executor, *args, **kwargs):
        NativeFunControlStandIn.calls += 1
        return executor(*args, **kwargs)

    def models(self):
        return [self.model_patch]

    def register(self, model):
        model.add_wrapper(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, self.diffusion_model_wrapper)
        replaced = model.model_options.get("transformer_options", {}).get("patches_replace", {}).get("dit", {})
        for index in self.injection_layers:
            block = NativeBlockStandIn(self, index, replaced.get(("single_block", index)))
            model.set_model_patch_replace(block, "dit", "single_block", index)


class NativeBlockStandIn:
    def __init__(self, control_patch, block_index, previous):
        self.control_patch, self.block_index, self.previous = control_patch, block_index, previous

    def __call__(self, args, extra_args):
        NativeFunControlStandIn.calls += 1
        return extra_args["original_block"](args)


class NativeModuleStandIn(torch.nn.Module):
    """What native's ModelPatchLoader makes of the file: a module whose state dict is the file's tensors."""

    def __init__(self, path):
        super().__init__()
        from safetensors.torch import load_file

        self.tensors = load_file(str(path))
        blocks = {key.split(".")[1] for key in self.tensors if key.startswith("control_blocks.")}
        self.control_blocks = [None] * len(blocks)

    def state_dict(self, *args, **kwargs):
        return dict(self.tensors)


def check_native_control():
    """Native QwenImage21FunControlNetApply's patches (stand-ins with its layout) on our MODEL: the door runs our
    branch with the same images, strength and sigmas, never native's hooks, and gives what our MODEL node gives."""
    import types

    handle, model, vae = load()
    (control,) = OURS["Qwen21ControlLoader"]().load(handle, Path(NAMES["control"]).name, "auto")
    _cond, _w, _h, positive, negative, latent = encode(handle)
    hint = torch.rand(1, 64, 64, 3, generator=torch.Generator().manual_seed(5))
    (ours_model,) = OURS["Qwen21ApplyControlModel"]().apply(model, control, 0.8, 0.0, 1.0, control_image=hint)
    model_patch = types.SimpleNamespace(model=NativeModuleStandIn(SCRATCH / "models" / NAMES["control"]))
    num_base = len(model.get_model_object("diffusion_model").transformer_blocks)  # as native's node reads it
    native_model = model.clone()
    sampling = model.get_model_object("model_sampling")
    NativeFunControlStandIn(model_patch, vae, hint, None, None, 0.8, list(range(0, num_base, num_base // 1)),
                            float(sampling.percent_to_sigma(0.0)),
                            float(sampling.percent_to_sigma(1.0))).register(native_model)  # fmt: skip
    memory, expected, got = {}, [], []
    memory["ours"] = asked_memory(lambda: expected.append(custom_advanced(ours_model, positive, negative, latent)))
    memory["native"] = asked_memory(lambda: got.append(custom_advanced(native_model, positive, negative, latent)))
    memory["plain"] = asked_memory(lambda: custom_advanced(model, positive, negative, latent))
    (expected,), (got,) = expected, got
    again = custom_advanced(native_model, positive, negative, latent)  # the converted weights are kept
    plain = custom_advanced(model, positive, negative, latent)
    emit(check="native_control", parity=relative(got, expected), again=relative(again, got),
         effect=relative(plain, expected), native_hooks_called=NativeFunControlStandIn.calls,
         memory=memory)  # fmt: skip


def check_model_type_line():
    """ComfyUI logs 'model_type FLUX' for every flow model it builds, ours too: the next line says what is loaded."""
    del LOG_LINES[:]
    load()
    flux = next(i for i, line in enumerate(LOG_LINES) if line == "model_type FLUX")
    emit(check="model_type_line", after=LOG_LINES[flux + 1 : flux + 4])


def main() -> int:
    setup()
    for name in CHECKS:
        try:
            with torch.inference_mode():  # as ComfyUI's executor runs every node of a prompt (execution.py)
                if name.startswith("lora_") and name != "lora_stack":
                    check_lora(name.removeprefix("lora_"))
                else:
                    globals()[f"check_{name}"]()
        except Exception:  # noqa: BLE001 - reported per check
            emit(check=name, failed=traceback.format_exc()[-3000:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
