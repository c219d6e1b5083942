"""GGUF diffusion-model files: the block dequantisation against the `gguf` package's own (bit for bit, every type, the
torch reference and the Triton kernel), the files read and checked (architecture, types, sizes, truncation), and a
model loaded from GGUF computing what the same model from a float file computes.

Tiny files are written with gguf's writer (tests/gguf_files.py): gguf quantises the 32-value types itself; the
K-quants come from small reference quantisers whose blocks gguf must read back as meant. The kernel runs on CUDA,
and on CPU through the Triton interpreter in the child process of `test_kernels_through_interpreter`.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import triton_interpreter
from gguf_files import dit_gguf, quantize, write_gguf
from qwen21_nodes.kernels.dequantize_gguf import (
    BLOCKS,
    QUANTIZED,
    dequantize_gguf,
    dequantize_gguf_reference,
    row_bytes,
)
from qwen21_nodes.qwen21_core.checkpoints import key_maps, loading
from qwen21_nodes.qwen21_core.checkpoints.files import Checkpoint, CheckpointError, WrongModelError
from qwen21_nodes.qwen21_core.config import TransformerConfig
from qwen21_nodes.qwen21_core.dit.transformer import QwenImage21Transformer
from qwen21_nodes.qwen21_core.quant.gguf_linear import GGUFLinear
from qwen21_nodes.qwen21_core.quant.plan import WeightFormats

gguf = pytest.importorskip("gguf", reason="the gguf package (a test extra) reads and writes the test files")

# Block linears 256 wide (K-quants need whole blocks of 256), context 64 as the tiny text encoder's
SMALL_DIT = TransformerConfig(in_channels=64, out_channels=64, num_layers=2, attention_head_dim=128,
                              num_attention_heads=2, context_in_dim=64, axes_dims_rope=(16, 56, 56))  # fmt: skip


@pytest.fixture
def kernel_device(monkeypatch):
    return triton_interpreter.kernel_device(
        monkeypatch, "no GPU here: the kernel runs on CPU in the child process of test_kernels_through_interpreter"
    )


def _random_blocks(qtype: str, rows: int, columns: int, seed: int) -> np.ndarray:
    """Rows of random bytes with finite fp16 scale fields: every code of every block appears."""
    rng = np.random.default_rng(seed)
    size, nbytes = BLOCKS[qtype]
    blocks = rng.integers(0, 256, (rows * columns // size, nbytes), dtype=np.uint8)
    fields = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q4_1": (0, 2), "Q5_1": (0, 2)}.get(qtype, (0,))
    for offset in fields:
        scales = rng.standard_normal(blocks.shape[0]).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def _gguf_dequantize(rows: np.ndarray, qtype: str, columns: int) -> torch.Tensor:
    values = gguf.quants.dequantize(rows, getattr(gguf.GGMLQuantizationType, qtype))
    return torch.from_numpy(values.reshape(rows.shape[0], columns).astype(np.float32))


@pytest.mark.parametrize("qtype", QUANTIZED)
def test_the_reference_dequantises_every_type_as_gguf_does_bit_for_bit(qtype):
    rows = _random_blocks(qtype, 5, 512, seed=len(qtype))
    ours = dequantize_gguf_reference(torch.from_numpy(rows), qtype, 512)
    assert torch.equal(ours.view(torch.int32), _gguf_dequantize(rows, qtype, 512).view(torch.int32))


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_the_tests_k_quantisers_write_blocks_gguf_reads_as_meant(qtype):
    """gguf quantises no K-quant; the tests' own quantisers must write blocks its dequantiser reads back exactly as
    they meant, close to the values they were given."""
    values = np.random.default_rng(3).standard_normal((6, 512)).astype(np.float32)
    rows, meant = quantize(values, qtype)
    back = _gguf_dequantize(rows, qtype, 512).numpy()
    assert np.array_equal(back.view(np.uint32), meant.view(np.uint32))
    assert np.sqrt(((back - values) ** 2).mean()) < {"Q4_K": 0.1, "Q5_K": 0.05, "Q6_K": 0.03}[qtype]


@pytest.mark.parametrize("qtype", QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_kernel_dequantises_every_type_as_gguf_does_bit_for_bit(kernel_device, qtype, dtype):
    rows = _random_blocks(qtype, 3, 768, seed=7)  # 768: tiles of the kernel's width end inside a row
    expected = _gguf_dequantize(rows, qtype, 768).to(dtype)
    got = dequantize_gguf(torch.from_numpy(rows).to(kernel_device), qtype, 768, dtype)
    assert got.dtype == dtype and torch.equal(got.cpu().float().view(torch.int32), expected.float().view(torch.int32))
    out = torch.full((3, 768), 7.0, dtype=dtype, device=kernel_device)
    assert dequantize_gguf(torch.from_numpy(rows).to(kernel_device), qtype, 768, dtype, out=out) is out
    assert torch.equal(out.cpu().float(), expected.float())


def test_kernels_through_interpreter():
    child = triton_interpreter.run_under_interpreter(__file__, "-k", "the_kernel_dequantises")
    assert " passed" in child.stdout and " failed" not in child.stdout and " skipped" not in child.stdout, child.stdout


def test_bad_rows_are_named():
    with pytest.raises(ValueError, match="Q4_K rows of 512 values are uint8 \\[N, 288\\]"):
        dequantize_gguf(torch.zeros(2, 100, dtype=torch.uint8), "Q4_K", 512)
    with pytest.raises(ValueError, match="multiple"):
        row_bytes("Q4_K", 300)
    with pytest.raises(ValueError, match="IQ4_XS.*not supported"):
        dequantize_gguf_reference(torch.zeros(1, 136, dtype=torch.uint8), "IQ4_XS", 256)


# ---- files -----------------------------------------------------------------------------------------------------


def _small_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """A random SMALL_DIT in ComfyUI's names (fused gate_up), as a converter writes a GGUF from ComfyUI's file."""
    torch.manual_seed(seed)
    model = QwenImage21Transformer(SMALL_DIT)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.05 if param.dim() > 1 else 1.0)
    slots = {name: slot.detach().clone() for name, slot in model.checkpoint_slots().items()}
    return key_maps.dit_to_comfyui(slots, prefix="")


def _float_model(held: dict[str, torch.Tensor]) -> QwenImage21Transformer:
    model = QwenImage21Transformer(SMALL_DIT)
    convert = key_maps._dit_converter("")
    model.load_diffusers_state_dict({name: part for key, t in held.items() for name, part in convert(key, t)})
    return model.eval()


def _forward(model, seed: int = 0) -> torch.Tensor:
    """Two sampling steps of a 64x64 latent on a random prompt (prefix prefill, then decode): the DiT's whole math."""
    from types import SimpleNamespace

    from qwen21_nodes.qwen21_core.conditioning import Conditioning, PromptEmbedding
    from qwen21_nodes.qwen21_core.config import SchedulerConfig
    from qwen21_nodes.qwen21_core.pipeline import Qwen21Pipeline

    vae = torch.nn.Module()
    vae.anchor = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
    vae.config = SimpleNamespace(latents_mean=[0.0] * 64, latents_std=[1.0] * 64)
    pipe = Qwen21Pipeline(model, vae, None, SchedulerConfig())
    embeds = torch.randn(12, model.config.context_in_dim, generator=torch.Generator().manual_seed(seed))
    cond = Conditioning(PromptEmbedding(embeds, torch.zeros(12, dtype=torch.bool)))
    with torch.inference_mode():
        return pipe.sample(cond, height=64, width=64, steps=2, seed=seed)


@pytest.mark.parametrize("qtype", QUANTIZED)
def test_a_gguf_dit_computes_what_the_same_model_from_a_float_file_computes(tmp_path, qtype):
    path, held = dit_gguf(tmp_path / f"dit_{qtype}.gguf", _small_state_dict(), qtype)
    model, info = loading.load_transformer(path, "cpu", torch.float32)
    layers = [layer for block in model.transformer_blocks for layer in block.linears().values()]
    assert all(isinstance(layer, GGUFLinear) and layer.fmt.types[0] == qtype for layer in layers)
    assert info["weights"] == f"gguf:{qtype} (8/8 block linears)" and info["layout"] == "comfyui"
    reference = _float_model(held)
    for name, layer in model.named_modules():
        if isinstance(layer, GGUFLinear):
            assert torch.equal(layer.float_weight(torch.float32), reference.get_submodule(name).weight)
    got, expected = _forward(model), _forward(reference)
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()


def test_a_gguf_dit_loads_dequantised_when_another_weight_format_is_asked_for(tmp_path):
    path, held = dit_gguf(tmp_path / "dit.gguf", _small_state_dict(), "Q5_0", other_type="BF16")
    model, _info = loading.load_transformer(path, "cpu", torch.float32, weight_formats=WeightFormats(dit="none"))
    assert not any(isinstance(m, GGUFLinear) for m in model.modules())
    reference = _float_model(held)
    assert all(torch.equal(p, reference.get_parameter(n)) for n, p in model.named_parameters())


def test_mixed_types_per_tensor_and_no_architecture_load(tmp_path):
    """A Q4_K_M-like file: to_v in Q6_K beside Q4_K, the other tensors quantised too (stable-diffusion.cpp packs
    modulation and the output layer), no general.architecture, diffusers' split MLP names."""
    state = _small_state_dict(1)
    tensors = {}
    for name, tensor in state.items():
        values = tensor.float().numpy()
        if name.endswith("img_mlp.gate_up.weight"):
            half = values.shape[0] // 2
            stem = name.removesuffix("gate_up.weight")
            tensors[stem + "gate_layer.weight"] = (values[:half], "Q4_K")
            tensors[stem + "proj.weight"] = (values[half:], "Q5_K")
            continue
        qtype = "Q6_K" if name.endswith("to_v.weight") else "Q4_K" if "transformer_blocks" in name else "Q8_0"
        tensors[name] = (values, "F32" if values.ndim == 1 or values.shape[-1] % 32 else qtype)
    path = write_gguf(tmp_path / "mixed.gguf", tensors, arch=None)
    model, info = loading.load_transformer(path, "cpu", torch.float32)
    qkv = model.transformer_blocks[0].attn.to_qkv
    assert isinstance(qkv, GGUFLinear) and qkv.fmt.types == ("Q4_K", "Q4_K", "Q6_K")
    assert model.transformer_blocks[1].img_mlp.gate_up.fmt.types == ("Q4_K", "Q5_K")
    assert info["layout"] == "diffusers"
    modulation = _gguf_dequantize(np.asarray(quantize(tensors["modulation.1.weight"][0], "Q8_0")[0]), "Q8_0",
                                  tensors["modulation.1.weight"][0].shape[-1])  # fmt: skip
    assert torch.equal(model.get_parameter("modulation.1.weight"), modulation)  # dequantised at load


def _corrupt(path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(data)] = data
    path.write_bytes(bytes(raw))


def test_bad_gguf_files_are_named_quickly(tmp_path):
    state = _small_state_dict()
    good, _ = dit_gguf(tmp_path / "good.gguf", state, "Q8_0")
    started = time.perf_counter()
    llama = write_gguf(tmp_path / "llama.gguf", {"token_embd.weight": (np.zeros((4, 64), np.float32), "F32")},
                       arch="llama")  # fmt: skip
    with pytest.raises(WrongModelError, match="architecture 'llama'"):
        loading.load_transformer(llama, "cpu", torch.float32)
    header = tmp_path / "header.gguf"
    header.write_bytes(good.read_bytes()[:200])
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        Checkpoint.open(header)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="truncated|not a readable GGUF"):
        Checkpoint.open(truncated)
    iq = write_gguf(tmp_path / "iq.gguf", {"img_in.weight": (np.zeros((4, 256), np.float32), "F32")})
    raw = bytearray(iq.read_bytes())
    type_at = raw.index(b"img_in.weight") + len(b"img_in.weight") + 4 + 2 * 8  # after the name, n_dims, 2 dims
    assert int.from_bytes(raw[type_at : type_at + 4], "little") == 0  # F32
    raw[type_at : type_at + 4] = int(gguf.GGMLQuantizationType.IQ4_XS).to_bytes(4, "little")
    iq.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="IQ4_XS, a GGUF type qwen21-nodes does not read|not a readable"):
        Checkpoint.open(iq)
    assert time.perf_counter() - started < 5.0
    vae = write_gguf(tmp_path / "vae.gguf", {"decoder.conv_in.weight": (np.zeros((4, 32), np.float32), "F32")})
    with pytest.raises(WrongModelError, match="diffusion model from GGUF"):
        loading.load_vae(vae, "cpu", torch.float32)


def _lora_file(tmp_path, rank: int = 4, alpha: float = 3.0):
    """A LoRA (ComfyUI key names, alpha != rank) on to_q, to_v and the MLP's gate and out of both blocks."""
    from safetensors.torch import save_file

    inner, hidden = SMALL_DIT.inner_dim, SMALL_DIT.mlp_dim
    shapes = {"attn.to_q": (inner, inner), "attn.to_v": (inner, inner), "img_mlp.gate_layer": (hidden, inner),
              "img_mlp.out": (inner, hidden)}  # fmt: skip
    generator = torch.Generator().manual_seed(9)
    tensors = {}
    for block in range(SMALL_DIT.num_layers):
        for layer, (out, inp) in shapes.items():
            stem = f"diffusion_model.transformer_blocks.{block}.{layer}"
            tensors[f"{stem}.lora_up.weight"] = torch.randn(out, rank, generator=generator) * 0.05
            tensors[f"{stem}.lora_down.weight"] = torch.randn(rank, inp, generator=generator) * 0.05
            tensors[f"{stem}.alpha"] = torch.tensor(alpha)
    path = tmp_path / "lora.safetensors"
    save_file(tensors, str(path))
    return path


def test_a_lora_on_gguf_weights_runs_beside_them_with_the_lora_s_effect(tmp_path):
    from qwen21_nodes.qwen21_core.lora.merge import LoraMerger, MemoryOriginals, layer_shapes
    from qwen21_nodes.qwen21_core.lora.reading import read_lora

    path, held = dit_gguf(tmp_path / "dit.gguf", _small_state_dict(), "Q4_K")
    model, _ = loading.load_transformer(path, "cpu", torch.float32)
    blocks = {name: p.clone() for name, p in model.named_parameters()}
    lora_path = _lora_file(tmp_path)
    lora = read_lora(lora_path, layer_shapes(model))
    assert not lora.side_path  # asked to merge: on GGUF weights it runs beside them all the same
    LoraMerger(model, MemoryOriginals()).apply([(lora, 0.8)])
    assert all(torch.equal(p, blocks[name]) for name, p in model.named_parameters())  # no block changed
    sides = [m for m in model.modules() if isinstance(m, GGUFLinear) and m.side_path is not None]
    assert len(sides) == 3 * SMALL_DIT.num_layers  # to_qkv (q, v), gate_up (gate) and out of each block
    reference, plain = _float_model(held), _float_model(held)
    LoraMerger(reference, MemoryOriginals()).apply([(read_lora(lora_path, layer_shapes(reference)), 0.8)])
    got, expected, without = _forward(model), _forward(reference), _forward(plain)
    effect = (expected - without).abs().max()
    assert effect > 1e-3 and (got - expected).abs().max() <= 1e-3 * effect


def test_gguf_blocks_of_other_types_stream_and_compute_the_same(tmp_path):
    """A file whose blocks differ in their types (block 0 in Q4_K, block 1 in Q8_0) streams from host RAM: the
    streamed model computes what the resident one does."""
    state = _small_state_dict(2)
    tensors = {name: (t.float().numpy(), "F32" if t.dim() == 1 else ("Q4_K" if "blocks.0." in name else
                                                                    "Q8_0" if "blocks.1." in name else "F32"))
               for name, t in state.items()}  # fmt: skip
    model, _ = loading.load_transformer(write_gguf(tmp_path / "mixed.gguf", tensors), "cpu", torch.float32)
    assert model._block_bytes(0) != model._block_bytes(1)
    whole = _forward(model)
    model.place("cpu", 0)  # every block streamed (on the CPU the same bookkeeping, which is what is tested here)
    assert model.streamer is not None and model.streamer.streamed == [0, 1]
    assert torch.equal(_forward(model), whole)
    model.place("cpu", None)
    assert torch.equal(_forward(model), whole)


# ---------------------------------------------------------------------------------------------------------
# QWEN21_GGUF_PREFETCH: the next layer dequantised ahead (quant/gguf_prefetch.py)
# ---------------------------------------------------------------------------------------------------------


def test_the_next_layer_dequantised_ahead_gives_the_plain_step_bit_for_bit(tmp_path, monkeypatch):
    """A decode step with the prefetch pipeline (on the CPU in order, the bookkeeping the side stream runs): every
    GGUF layer takes its weight from the pipeline in call order, and the sampled latents are the plain path's."""
    from qwen21_nodes.qwen21_core.dit import transformer
    from qwen21_nodes.qwen21_core.quant import gguf_prefetch

    path, _held = dit_gguf(tmp_path / "dit.gguf", _small_state_dict(), "Q4_K")
    model, _ = loading.load_transformer(path, "cpu", torch.float32)
    plain = _forward(model)
    steps = []

    def in_order(model, x):
        layers = [m for b in model.transformer_blocks for m in b.linears().values() if isinstance(m, GGUFLinear)]
        steps.append(gguf_prefetch.GGUFPrefetch(layers, x.device, x.dtype, streams=False))
        return steps[-1]

    monkeypatch.setattr(transformer, "step_prefetch", in_order)
    assert torch.equal(_forward(model), plain)
    assert len(steps) == 2  # one per decode step (2 steps; the prefill runs the plain path)
    assert all(step.on and step.expected == len(step.layers) == 8 for step in steps)
    assert gguf_prefetch.active_prefetch() is None and all(step.buffers is None for step in steps)


def test_a_layer_called_out_of_order_takes_the_plain_path_for_the_rest_of_the_step(tmp_path):
    """Out of order (another layer than the next one): no weight from the pipeline, then none for any layer."""
    from qwen21_nodes.qwen21_core.quant.gguf_prefetch import GGUFPrefetch, active_prefetch

    path, _held = dit_gguf(tmp_path / "dit.gguf", _small_state_dict(), "Q8_0")
    model, _ = loading.load_transformer(path, "cpu", torch.float32)
    layers = [m for b in model.transformer_blocks for m in b.linears().values()]
    prefetch = GGUFPrefetch(layers, torch.device("cpu"), torch.float32, streams=False)
    try:
        assert active_prefetch() is prefetch
        first = prefetch.weight(layers[0], torch.float32)
        assert torch.equal(first, layers[0].dequantized_weight(torch.float32))
        assert prefetch.weight(layers[2], torch.float32) is None  # layer 1 was next
        assert prefetch.weight(layers[1], torch.float32) is None and not prefetch.on
        x = torch.randn(3, layers[1].in_features)
        assert torch.equal(layers[1].weight_only(x), x @ layers[1].dequantized_weight(torch.float32).T)
    finally:
        prefetch.close()
    assert active_prefetch() is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none (run on the H200)")
def test_gguf_layers_dequantised_on_a_second_stream_give_the_plain_step_bit_for_bit(tmp_path, use_settings):
    """On the GPU in bf16 with QWEN21_GGUF_PREFETCH=1: eager decode steps fill every layer's weight on the side
    stream, and the latents equal the plain path's bit for bit (three runs: the buffers' memory reused)."""
    from qwen21_nodes.qwen21_core.quant import gguf_prefetch

    path, _held = dit_gguf(tmp_path / "dit.gguf", _small_state_dict(), "Q4_K")
    model, _ = loading.load_transformer(path, "cuda", torch.bfloat16)
    plain = _forward(model).cpu()
    use_settings(gguf_prefetch=True)
    made = []
    real = gguf_prefetch.GGUFPrefetch

    class Counted(real):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    gguf_prefetch.GGUFPrefetch = Counted
    try:
        for _ in range(3):
            assert torch.equal(_forward(model).cpu(), plain)
    finally:
        gguf_prefetch.GGUFPrefetch = real
    eager = [step for step in made if step.side is not None]
    assert eager and all(step.expected == len(step.layers) for step in eager)


def test_a_gguf_runs_memory_estimate_holds_its_dequantised_weights(tmp_path, use_settings):
    """The largest GGUF layer's weight in the compute dtype (two with QWEN21_GGUF_PREFETCH) is in what a run asks
    for: our pipeline's estimate adds it (and the ComfyUI MODEL's memory_required, test_comfyui_types); a float DiT
    adds nothing."""
    from qwen21_nodes.qwen21_core.conditioning import Conditioning, PromptEmbedding
    from qwen21_nodes.qwen21_core.config import SchedulerConfig
    from qwen21_nodes.qwen21_core.memory import sizing
    from qwen21_nodes.qwen21_core.pipeline import Qwen21Pipeline
    from qwen21_nodes.qwen21_core.quant.gguf_prefetch import gguf_transient_bytes
    from qwen21_nodes.qwen21_core.request import SampleRequest

    path, held = dit_gguf(tmp_path / "dit.gguf", _small_state_dict(), "Q4_K")
    model, _ = loading.load_transformer(path, "cpu", torch.float32)
    largest = max(m.out_features * m.in_features for b in model.transformer_blocks for m in b.linears().values())
    assert gguf_transient_bytes(model) == largest * 4 and gguf_transient_bytes(_float_model(held)) == 0
    use_settings(gguf_prefetch=True)
    assert gguf_transient_bytes(model) == 2 * largest * 4
    pipe = Qwen21Pipeline(model, torch.nn.Linear(1, 1), None, SchedulerConfig())
    cond = Conditioning(PromptEmbedding(torch.randn(12, SMALL_DIT.context_in_dim), torch.zeros(12, dtype=torch.bool)))
    request = SampleRequest(height=64, width=64, steps=2)
    plain = sizing.sampling_bytes(model.config, model.dtype, cond, request)
    assert pipe.sampling_bytes(cond, request) == plain + 2 * largest * 4
