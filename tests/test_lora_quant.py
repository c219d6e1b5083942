"""LoRA on quantised DiT weights (fp8, int8, int8_convrot), on the CPU.

Merged (the default): the touched rows are dequantised, the deltas added in fp32 and the rows requantised in the
layer's own format. The bound these tests hold the result to is the one a quantisation of any float weight meets,
applied to the exact merged weight W* = dequant(q, s) + sum strength * alpha/rank * B A, in the basis the layer
stores (W H for int8_convrot), element by element:
    int8, int8_convrot:  |W_merged - W*| <= s'/2           (s' the row's new scale, absmax / 127: half a step)
    fp8 e4m3:            |W_merged - W*| <= max(|W*| / 16, s' / 1024)   (3 mantissa bits; subnormals step s'/512)
(+ 1e-6 of the row's largest value for the fp32 sum the merge rounds). So the requantisation error is the format's
own kind of error; its size is compared with the format's error on the same weights without a LoRA, too.
Also: rows no LoRA touches keep their bits; removal and switching restore the loaded bits exactly (from CPU copies
and re-read from bf16, fp8_scaled and int8_convrot files); stacks equal merged sums; blocks streaming from host
RAM merge like resident ones; the exact side path matches the float result.
"""

import pytest
import torch
from quant_files import regular_hadamard
from qwen21_nodes.qwen21_core.checkpoints import loading
from qwen21_nodes.qwen21_core.dit.decode_graphs import DecodeGraphs
from qwen21_nodes.qwen21_core.dit.transformer import uniform_plan
from qwen21_nodes.qwen21_core.lora.merge import (
    FileOriginals,
    LoraMerger,
    MemoryOriginals,
    layer_shapes,
    lora_layers,
    stack_identity,
)
from qwen21_nodes.qwen21_core.lora.reading import LoraError, read_lora
from qwen21_nodes.qwen21_core.quant.linear import QuantLinear
from qwen21_nodes.qwen21_core.quant.plan import WeightFormats
from qwen21_nodes.qwen21_core.quant.weights import FORMATS, dequantize_weight, quantize_weight
from safetensors.torch import save_file
from test_decode_graphs import Recorder, _prefilled
from test_lora import lora_state_dict, random_factors, snapshot, write
from test_quant import SMALL, _comfy_dit_file, _small_dit, _velocity

QUANT_FORMATS = ("fp8", "int8", "int8_convrot")
RANK = 4  # test_lora's factors; their alpha is 8: scale 2
BLOCK_LINEARS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "img_mlp.gate_layer", "img_mlp.proj",
                 "img_mlp.out")  # fmt: skip
EVERY_BLOCK_LINEAR = tuple(f"transformer_blocks.{i}.{p}" for i in range(SMALL.num_layers) for p in BLOCK_LINEARS)


def quantized_pair(fmt, seed=0, device="cpu", dtype=torch.float32):
    """A float model and a quantised copy of it (the quantised Linears in `fmt`, the rest shared)."""
    model = _small_dit(seed).to(device, dtype)
    return model, model.quantized_copy(uniform_plan(FORMATS[fmt], SMALL.num_layers))


def make_lora(tmp_path, model, layers=EVERY_BLOCK_LINEAR, seed=1, name="a", size=0.05):
    """A LoRA whose deltas are about a third of the weights' spread (test_lora.random_factors)."""
    factors = random_factors(model, layers, seed=seed, size=size)
    return read_lora(write(tmp_path / f"{name}.safetensors", *lora_state_dict(factors, "comfyui")), layer_shapes(model))


def quant_layers(model):
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}


def stored(layer) -> tuple[torch.Tensor, torch.Tensor]:
    return layer.qweight.detach().clone(), layer.weight_scale.detach().clone()


def rotate64(weight: torch.Tensor) -> torch.Tensor:
    """W H in fp64, with the test's own Hadamard matrix (tests/quant_files.py)."""
    return (weight.reshape(weight.shape[0], -1, 256) @ regular_hadamard(256)).reshape(weight.shape)


def exact_stored(model, originals: dict, stack) -> dict[str, torch.Tensor]:
    """Quantised layer -> W* in its stored basis, fp64: the loaded weight plus the stack's deltas, unrounded."""
    slots = lora_layers(model)
    layers = quant_layers(model)
    exact = {name: q.double() * s.double()[:, None] for name, (q, s) in originals.items()}
    for lora, strength in stack:
        for piece in lora.layers:
            slot = slots[piece.layer]
            name = slot.param.removesuffix(".qweight")
            delta = (piece.up.double() @ piece.down.double()) * (piece.scale * strength)
            exact[name][slot.rows] += rotate64(delta) if layers[name].fmt.rotation else delta
    return exact


def half_step_bound(layer: QuantLinear, exact: torch.Tensor) -> torch.Tensor:
    """The module docstring's elementwise bound for `layer` (its new scales) around the exact weight."""
    scale = layer.weight_scale.double()[:, None]
    slack = 1e-6 * exact.abs().amax(dim=1, keepdim=True)
    if layer.fmt.kind == "fp8":
        return torch.maximum(exact.abs() / 16, scale / 1024) + slack
    return scale / 2 + slack


def rel(got, want) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def own_error(float_model, name: str, fmt: str) -> float:
    """The format's error on this layer's float weight, without a LoRA (what quantising it at load costs)."""
    weight = float_model.get_submodule(name).weight.detach()
    q, s = quantize_weight(weight, FORMATS[fmt])
    return rel(dequantize_weight(q, s, FORMATS[fmt].for_width(weight.shape[1]).rotation, torch.float64), weight)


# ---- the merge's error ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_merged_weights_are_within_half_a_step_of_the_exact_merge(fmt, tmp_path):
    float_model, model = quantized_pair(fmt)
    layers = quant_layers(model)
    originals = {name: stored(layer) for name, layer in layers.items()}
    lora = make_lora(tmp_path, model)
    LoraMerger(model, MemoryOriginals()).apply([(lora, 0.8)])
    exact = exact_stored(model, originals, [(lora, 0.8)])
    for name, layer in layers.items():
        got = layer.qweight.double() * layer.weight_scale.double()[:, None]
        assert ((got - exact[name]).abs() <= half_step_bound(layer, exact[name])).all(), name
        assert not torch.equal(layer.qweight, originals[name][0]), f"{name}: the LoRA changed nothing"
        # the requantisation costs what quantising costs: the format's error on the exact merged weight itself, and
        # about its error on the weight without the LoRA (more where the LoRA's Gaussian delta raises a row's
        # largest value against its spread, as it does on these uniform random weights)
        merged_error, bare_error = rel(got, exact[name]), own_error(float_model, name, fmt)
        q, s = quantize_weight(exact[name].float(), layer.fmt, rotated=True)
        assert merged_error <= 1.02 * rel(q.double() * s.double()[:, None], exact[name]), name
        assert merged_error <= 1.5 * bare_error, (name, merged_error, bare_error)
        # and the LoRA moved the weight by far more than that
        assert rel(originals[name][0].double() * originals[name][1].double()[:, None], exact[name]) > 5 * bare_error
    if fmt == "int8_convrot":
        assert all(layer.fmt.rotation for layer in layers.values())  # every layer here is wide enough to rotate


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_rows_no_lora_touches_keep_their_bits_and_the_output_follows_the_exact_merge(fmt, tmp_path):
    float_model, model = quantized_pair(fmt)
    qkv = model.transformer_blocks[0].attn.to_qkv
    before = stored(qkv)
    lora = make_lora(tmp_path, model, layers=("transformer_blocks.0.attn.to_k",))
    x = torch.randn(7, qkv.in_features)
    plain = qkv(x)
    LoraMerger(model, MemoryOriginals()).apply([(lora, 1.0)])
    inner = SMALL.inner_dim
    for rows in (slice(0, inner), slice(2 * inner, 3 * inner)):  # to_q and to_v
        assert torch.equal(qkv.qweight[rows], before[0][rows]) and torch.equal(qkv.weight_scale[rows], before[1][rows])
    assert not torch.equal(qkv.qweight[inner : 2 * inner], before[0][inner : 2 * inner])
    (piece,) = lora.layers
    want = x.double() @ (float_model.transformer_blocks[0].attn.to_qkv.weight.double()[inner : 2 * inner]
                         + piece.scale * piece.up.double() @ piece.down.double()).t()  # fmt: skip
    got = qkv(x)[:, inner : 2 * inner]
    assert rel(got, want) < 2 * own_error(float_model, "transformer_blocks.0.attn.to_qkv", fmt)
    assert rel(plain[:, inner : 2 * inner], want) > 0.1  # without the merge the output would be far off


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_a_bf16_file_quantised_at_load_merges_from_its_floats_with_one_rounding(fmt, tmp_path):
    """With the file's float weights at hand the merged layer is quantise(W_file + delta), each checkpoint tensor
    as the loader quantises it: one rounding, where requantising the loaded values rounds twice."""
    from safetensors.torch import load_file

    float_model = _small_dit()
    path = _bf16_file(tmp_path, float_model)
    model, _ = loading.load_transformer(path, "cpu", torch.bfloat16, weight_formats=WeightFormats(fmt))
    twin, _ = loading.load_transformer(path, "cpu", torch.bfloat16, weight_formats=WeightFormats(fmt))
    lora = make_lora(tmp_path, model, layers=EVERY_BLOCK_LINEAR[:4] + EVERY_BLOCK_LINEAR[7:])  # block 0: q, k, v, out
    loaded = snapshot(model)
    LoraMerger(model, FileOriginals(path)).apply([(lora, 0.9)])
    LoraMerger(twin, MemoryOriginals()).apply([(lora, 0.9)])  # the same loaded values, merged from themselves
    stored_floats = {k: v.float() for k, v in load_file(path).items()}
    slots, holders = lora_layers(model), {}
    for key, slot in model.checkpoint_slots().items():
        if hasattr(slot, "layer") and key.endswith(".weight"):
            holders[key] = slot
    wanted = {key: stored_floats[key].clone() for key in holders}
    for piece in lora.layers:
        key = f"{piece.layer}.weight"
        wanted[key] += (piece.up.float() @ piece.down.float()) * (piece.scale * 0.9)  # in fp32 as the merge
    errors = {"file": [], "memory": []}
    for key, slot in holders.items():
        q, s = quantize_weight(wanted[key], slot.layer.fmt)  # what loading a bf16 file with the LoRA merged gives
        name = slots[key.removesuffix(".weight")].param
        assert torch.equal(slot.layer.qweight[slot.rows], q) and torch.equal(slot.layer.weight_scale[slot.rows], s)
        if not any(f"{piece.layer}.weight" == key for piece in lora.layers):
            assert torch.equal(slot.layer.qweight[slot.rows], loaded[name][slot.rows])  # untouched: as loaded
            continue
        twin_layer = twin.get_submodule(name.removesuffix(".qweight"))
        for source, layer in (("file", slot.layer), ("memory", twin_layer)):
            merged = dequantize_weight(layer.qweight[slot.rows], layer.weight_scale[slot.rows], layer.fmt.rotation,
                                       torch.float64)  # fmt: skip
            errors[source].append(rel(merged, wanted[key]))
    # one rounding against two: the weights' error energy about halves (fp8: the requantisation rounds finer)
    assert sum(errors["file"]) < 0.85 * sum(errors["memory"]), errors


# ---- exact removal and switching ----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_removal_and_switches_restore_the_quantised_bits_from_memory(fmt, tmp_path):
    _, model = quantized_pair(fmt)
    before, ptrs = snapshot(model), [p.data_ptr() for p in model.parameters()]
    a, b = make_lora(tmp_path, model, name="a"), make_lora(tmp_path, model, seed=2, name="b")
    originals = MemoryOriginals()
    merger = LoraMerger(model, originals)
    merger.apply([(a, 1.0)])
    first = snapshot(model)
    quantized_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                          if n.endswith(("qweight", "weight_scale")))  # fmt: skip
    assert originals.nbytes == quantized_bytes  # compact: the 8-bit values and scales of the touched layers
    for stack in ([(a, 0.3)], [(a, -0.5), (b, 2.0)], [(b, 1.0)], [(a, 1.0)]):  # strengths, stacks, another LoRA
        merger.apply(stack)
    assert all(torch.equal(p, first[n]) for n, p in model.named_parameters())  # recomputed, nothing accumulated
    merger.apply([])
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert [p.data_ptr() for p in model.parameters()] == ptrs and originals.nbytes == 0
    assert merger.last_stats["weights_restored"] == 4 * SMALL.num_layers


def _bf16_file(tmp_path, model):
    path = tmp_path / "dit_bf16.safetensors"
    save_file({k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.checkpoint_slots().items()}, path)
    return path


@pytest.mark.parametrize(
    "stored_as,loaded_as",
    [
        ("bf16", "fp8"), ("bf16", "int8"), ("bf16", "int8_convrot"),  # a bf16 file quantised while loading
        ("int8_convrot", "auto"), ("fp8", "auto"), ("int8", "auto"),  # Comfy-Org's files, as they are
        ("int8_convrot", "fp8"),  # requantised while loading
    ],
)  # fmt: skip
def test_removal_restores_the_loaded_bits_re_read_from_the_file(stored_as, loaded_as, tmp_path):
    float_model = _small_dit()
    path = _bf16_file(tmp_path, float_model) if stored_as == "bf16" else _comfy_dit_file(tmp_path, float_model,
                                                                                          stored_as)[0]  # fmt: skip
    model, info = loading.load_transformer(path, "cpu", torch.bfloat16, weight_formats=WeightFormats(loaded_as))
    assert info["weights"].startswith(stored_as if loaded_as == "auto" else loaded_as)
    before = snapshot(model)
    a, b = make_lora(tmp_path, model, name="a"), make_lora(tmp_path, model, seed=2, name="b")
    merger = LoraMerger(model, FileOriginals(path))
    merger.apply([(a, 1.0)])
    merged = snapshot(model)
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    merger.apply([(b, 0.5)])
    merger.apply([(a, 1.0)])
    assert all(torch.equal(p, merged[n]) for n, p in model.named_parameters())
    merger.apply([])
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


# ---- stacks --------------------------------------------------------------------------------------------------


def _lora_from(tmp_path, name, factors, scales):
    """A LoRA file of the given (up, down) factors with alpha = rank * scale per layer (so alpha/rank = scale)."""
    tensors = {}
    for layer, (up, down) in factors.items():
        stem = f"diffusion_model.{layer}"
        tensors |= {f"{stem}.lora_up.weight": up, f"{stem}.lora_down.weight": down,
                    f"{stem}.alpha": torch.tensor(float(down.shape[0] * scales[layer]))}  # fmt: skip
    return write(tmp_path / f"{name}.safetensors", tensors)


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_a_stack_on_separate_rows_is_bit_equal_to_one_lora_holding_both(fmt, tmp_path):
    _, model = quantized_pair(fmt)
    first = random_factors(model, ("transformer_blocks.0.attn.to_q", "transformer_blocks.1.img_mlp.out"), seed=3)
    second = random_factors(model, ("transformer_blocks.0.attn.to_k", "transformer_blocks.1.img_mlp.gate_layer"),
                            seed=4)  # fmt: skip
    shapes = layer_shapes(model)
    a = read_lora(_lora_from(tmp_path, "a", first, dict.fromkeys(first, 1.0)), shapes)
    b = read_lora(_lora_from(tmp_path, "b", second, dict.fromkeys(second, 1.0)), shapes)
    both = read_lora(_lora_from(tmp_path, "both", first | second, dict.fromkeys(first | second, 1.0)), shapes)
    merger = LoraMerger(model, MemoryOriginals())
    merger.apply([(a, 1.0), (b, 1.0)])
    stacked = snapshot(model)
    merger.apply([(both, 1.0)])  # each row gets exactly one delta either way: the same fp32 sums, the same rounding
    assert all(torch.equal(p, stacked[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_a_stack_on_the_same_rows_equals_merging_the_sum_within_the_bound(fmt, tmp_path):
    _, model = quantized_pair(fmt)
    first, second = random_factors(model, EVERY_BLOCK_LINEAR, seed=5), random_factors(model, EVERY_BLOCK_LINEAR, seed=6)
    shapes = layer_shapes(model)
    a = read_lora(_lora_from(tmp_path, "a", first, dict.fromkeys(first, 0.1)), shapes)
    b = read_lora(_lora_from(tmp_path, "b", second, dict.fromkeys(second, 0.1)), shapes)
    # one LoRA of rank 8 whose delta is 0.7 A + 0.4 B: its ups carry the strengths
    summed = {layer: (torch.cat([0.07 * first[layer][0], 0.04 * second[layer][0]], dim=1),
                      torch.cat([first[layer][1], second[layer][1]])) for layer in first}  # fmt: skip
    total = read_lora(_lora_from(tmp_path, "sum", summed, dict.fromkeys(summed, 1.0)), shapes)
    layers = quant_layers(model)
    originals = {name: stored(layer) for name, layer in layers.items()}
    merger = LoraMerger(model, MemoryOriginals())
    merger.apply([(a, 0.7), (b, 0.4)])
    stacked = {name: stored(layer) for name, layer in layers.items()}
    merger.apply([(total, 1.0)])
    exact = exact_stored(model, originals, [(total, 1.0)])
    differing = 0
    for name, layer in layers.items():
        q, s = stacked[name]
        got = q.double() * s.double()[:, None]
        # both are within half a step of (almost) the same exact weight
        assert ((got - exact[name]).abs() <= half_step_bound(layer, exact[name])).all(), name
        differing += (q != layer.qweight).sum().item()
    assert differing <= 1e-3 * sum(layer.qweight.numel() for layer in layers.values())


# ---- streaming blocks -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["bf16", *QUANT_FORMATS])
@pytest.mark.parametrize("restore_from", ["memory", "file"])
def test_blocks_streaming_from_host_ram_merge_like_resident_ones(fmt, restore_from, tmp_path):
    float_model = _small_dit().to(torch.bfloat16)
    path = _bf16_file(tmp_path, float_model)
    formats = WeightFormats("none" if fmt == "bf16" else fmt)
    resident, _ = loading.load_transformer(path, "cpu", torch.bfloat16, weight_formats=formats)
    streaming, _ = loading.load_transformer(path, "cpu", torch.bfloat16, weight_formats=formats)
    before = snapshot(streaming)
    streaming.place("cpu", 1)  # block 1 streams (on a CPU the same bookkeeping, copies within RAM)
    assert streaming.streaming_signature() == (1,)
    lora = make_lora(tmp_path, resident)
    mergers = []
    for model in (resident, streaming):
        mergers.append(LoraMerger(model, FileOriginals(path) if restore_from == "file" else MemoryOriginals()))
        mergers[-1].apply([(lora, 1.0)])
    with torch.inference_mode():
        assert torch.equal(_velocity(streaming), _velocity(resident))  # the streamed block has the LoRA too
    mergers[1].apply([(lora, 0.5)])
    mergers[1].apply([])
    with torch.inference_mode():
        unmerged = _velocity(streaming)
    streaming.place("cpu")  # whole again: every parameter readable
    assert all(torch.equal(p, before[n]) for n, p in streaming.named_parameters())
    mergers[0].apply([])
    with torch.inference_mode():
        assert torch.equal(unmerged, _velocity(resident))


# ---- the exact side path -----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_side_path_matches_the_exact_float_result_and_leaves_the_weights(fmt, tmp_path):
    import dataclasses

    float_model, model = quantized_pair(fmt)
    before = snapshot(model)
    lora = dataclasses.replace(make_lora(tmp_path, model), side_path=True)
    layers = quant_layers(model)
    x = torch.randn(11, SMALL.inner_dim)
    qkv = model.transformer_blocks[1].attn.to_qkv
    plain = qkv(x)
    merger = LoraMerger(model, MemoryOriginals())
    merger.apply([(lora, 0.6)])
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # not one bit changed
    assert merger.last_stats["side_paths"] == len(layers) and merger.last_stats["weights_merged"] == 0
    # to_q, to_k and to_v share the input: their three downs are one GEMM [3 rank, K], each up writes its rows
    assert qkv.side_path.down.shape == (3 * RANK, SMALL.inner_dim)
    inner = SMALL.inner_dim
    assert sorted((rows.start, rows.stop) for rows, _ in qkv.side_path.pieces) == [(i * inner, (i + 1) * inner)
                                                                                  for i in range(3)]  # fmt: skip
    exact = {name: dequantize_weight(q, s, layer.fmt.rotation, torch.float64) for name, layer in layers.items()
             for q, s in [stored(layer)]}  # fmt: skip
    slots = lora_layers(model)
    for piece in lora.layers:
        slot = slots[piece.layer]
        delta = 0.6 * piece.scale * piece.up.double() @ piece.down.double()
        exact[slot.param.removesuffix(".qweight")][slot.rows] += delta
    for name, layer in layers.items():
        xin = torch.randn(5, layer.in_features)
        assert rel(layer(xin), xin.double() @ exact[name].t()) < 1e-5, name  # fp32 rounding only
    assert rel(qkv(x), plain) > 0.05
    merger.apply([])
    assert qkv.side_path is None and torch.equal(qkv(x), plain)


def test_side_path_and_merge_mix_on_one_layer_and_a_diff_cannot_be_a_side_path(tmp_path):
    import dataclasses

    _, model = quantized_pair("int8")
    layer = model.transformer_blocks[0].img_mlp.out
    a = make_lora(tmp_path, model, name="a")
    b = dataclasses.replace(make_lora(tmp_path, model, seed=2, name="b"), side_path=True)
    x = torch.randn(6, layer.in_features)
    merger = LoraMerger(model, MemoryOriginals())
    merger.apply([(a, 1.0)])
    merged_only = layer(x)
    merger.apply([(a, 1.0), (b, 0.5)])
    (piece,) = [p for p in b.layers if p.layer == "transformer_blocks.0.img_mlp.out"]
    want = merged_only.double() + 0.5 * piece.scale * x.double() @ (piece.up.double() @ piece.down.double()).t()
    assert rel(layer(x), want) < 1e-5
    merged_b = dataclasses.replace(b, side_path=False)
    assert model.weights_id == stack_identity([(a, 1.0), (b, 0.5)]) != stack_identity([(a, 1.0), (merged_b, 0.5)])
    factors = random_factors(model, ("transformer_blocks.0.img_mlp.out",), seed=7)
    diff = read_lora(write(tmp_path / "diff.safetensors", *lora_state_dict(factors, "comfyui_diff")),
                     layer_shapes(model))  # fmt: skip
    merger.apply([])
    before = snapshot(model)
    with pytest.raises(LoraError, match="full-difference .* cannot run as a side path"):
        merger.apply([(dataclasses.replace(diff, side_path=True), 1.0)])
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    merger.apply([(diff, 1.0)])  # merged, a full difference works on quantised weights too
    assert not torch.equal(layer.qweight, before["transformer_blocks.0.img_mlp.out.qweight"])


def test_side_path_runs_where_the_layers_dtype_differs_from_the_activations(tmp_path):
    """The CPU crash of issue 23: the loader left QuantLinear.compute_dtype at fp32 under a bf16 model, and the side
    path's factors (made in compute_dtype) met bf16 activations."""
    import dataclasses

    float_model = _small_dit()
    path = _bf16_file(tmp_path, float_model)
    model, _ = loading.load_transformer(path, "cpu", torch.bfloat16, weight_formats=WeightFormats("fp8"))
    assert {layer.compute_dtype for layer in quant_layers(model).values()} == {torch.bfloat16}
    layer = model.transformer_blocks[0].attn.to_out
    layer.compute_dtype = torch.float32  # what the loader did before the fix
    lora = dataclasses.replace(make_lora(tmp_path, model), side_path=True)
    LoraMerger(model, MemoryOriginals()).apply([(lora, 1.0)])
    assert layer(torch.randn(3, layer.in_features, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_decode_graphs_are_kept_across_merges_and_rebuilt_for_side_paths(tmp_path):
    import dataclasses

    from test_decode_graphs import _layout

    _, model = quantized_pair("fp8")
    lora = make_lora(tmp_path, model)
    recorder = Recorder()
    graphs = DecodeGraphs(model, launch_bound_share=0, capture=recorder)
    branch = _prefilled(graphs, _layout())
    x, t = torch.randn(1, 16, SMALL.in_channels), torch.full((1,), 0.5)
    graphs(branch, x, t)
    graphs.release(branch)
    merger = LoraMerger(model, MemoryOriginals())
    merger.apply([(lora, 1.0)])  # in place: the captured graph stays valid
    again = _prefilled(graphs, _layout())
    assert again is branch and recorder.captures == 1
    graphs.release(again)
    merger.apply([(dataclasses.replace(lora, side_path=True), 1.0)])  # new tensors in the step: graphs rebuilt
    fresh = _prefilled(graphs, _layout())
    assert fresh is not branch and "weights moved" in graphs.describe()


# ---- on the GPU: W8A8 GEMMs, real CUDA graphs, streaming from pinned memory ------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_cuda_graphs_replay_the_merged_quantised_weights_and_recapture_for_the_side_path(fmt, tmp_path):
    import dataclasses

    from test_decode_graphs import _layout

    _, model = quantized_pair(fmt, device="cuda", dtype=torch.bfloat16)
    lora = make_lora(tmp_path, model, size=0.15)  # a LoRA effect well above fp8's rounding of activations
    graphs = DecodeGraphs(model, launch_bound_share=0)
    layout = _layout()
    g = torch.Generator().manual_seed(0)
    embeds, tokens = torch.randn(layout.prefix_len - 12, SMALL.context_in_dim, generator=g), torch.randn(16, 16)
    x = torch.randn(1, 16, SMALL.in_channels, generator=g).to("cuda", torch.bfloat16)
    t = torch.full((1,), 0.5, device="cuda", dtype=torch.bfloat16)

    def replay():
        branch = graphs.new_branch(layout, 1, "auto", "positive")
        model.prefill(branch, embeds.to("cuda", torch.bfloat16), tokens.to("cuda", torch.bfloat16))
        out = graphs(branch, x, t)
        eager = model.decode(branch, x, t)
        graphs.release(branch)
        return out, eager

    with torch.inference_mode():
        before, _ = replay()
        (entry,) = graphs.entries.values()
        merger = LoraMerger(model, MemoryOriginals())
        merger.apply([(lora, 1.0)])
        merged, eager = replay()
        assert list(graphs.entries.values()) == [entry] and entry.replays >= 2  # the same graph, replayed
        assert torch.equal(merged, eager) and not torch.equal(merged, before)
        merger.apply([(dataclasses.replace(lora, side_path=True), 1.0)])
        beside, eager = replay()
        assert entry not in graphs.entries.values()  # rebuilt: the side path's tensors are in the new graph
        assert torch.equal(beside, eager)
        # the side path is exact and the merge rounds once more: the two far nearer each other than to no LoRA
        assert (beside.float() - merged.float()).norm() < 0.3 * (merged.float() - before.float()).norm()
        merger.apply([])
        again, _ = replay()
        assert torch.equal(again, before)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_streamed_blocks_merge_on_the_gpu_like_resident_ones(fmt, tmp_path):
    float_model = _small_dit().to(torch.bfloat16)
    path = _bf16_file(tmp_path, float_model)
    resident, _ = loading.load_transformer(path, "cuda", torch.bfloat16, weight_formats=WeightFormats(fmt))
    streaming, _ = loading.load_transformer(path, "cuda", torch.bfloat16, weight_formats=WeightFormats(fmt))
    streaming.place("cuda", 0)  # every block streams from pinned host RAM
    lora = make_lora(tmp_path, resident)
    for model, originals in ((resident, FileOriginals(path)), (streaming, FileOriginals(path))):
        LoraMerger(model, originals).apply([(lora, 1.0)])
    with torch.inference_mode():
        assert torch.equal(_velocity_cuda(streaming), _velocity_cuda(resident))


def _velocity_cuda(model, seed=4, target=(4, 4)):
    from dit_reference import prompt_mask
    from qwen21_nodes.qwen21_core.dit.sequence import build_layout

    gen = torch.Generator().manual_seed(seed)
    shapes = [(4, 4)]
    mask = prompt_mask(6, shapes)
    layout = build_layout(mask, shapes, target)
    branch = model.new_branch(layout, 1)
    cuda = dict(device="cuda", dtype=torch.bfloat16)
    model.prefill(branch, torch.randn(mask.shape[0], SMALL.context_in_dim, generator=gen).to(**cuda),
                  torch.randn(16, SMALL.in_channels, generator=gen).to(**cuda))  # fmt: skip
    x = torch.randn(1, target[0] * target[1], SMALL.in_channels, generator=gen).to(**cuda)
    return model.decode(branch, x, torch.tensor([0.4], **cuda))


# ---- how a change reads and keeps the originals -----------------------------------------------------------


def _counting_reads(monkeypatch) -> list[int]:
    """Counts the passes over the checkpoint file (load_into calls) a merger makes, with the tensors each read."""
    from qwen21_nodes.qwen21_core.lora import merge

    passes = []
    real = merge.load_into

    def counted(slots, *args, **kwargs):
        passes.append(sum(slot is not None for slot in slots.values()))
        return real(slots, *args, **kwargs)

    monkeypatch.setattr(merge, "load_into", counted)
    return passes


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_a_bf16_file_is_re_read_once_per_change_and_merged_in_the_same_pass(fmt, tmp_path, monkeypatch):
    """Re-reading a bf16 file's floats and merging are one pass of the loader for all weights of a change, with no
    restore pass first; the result is the weights a fresh merge of the same stack gives (nothing left over)."""
    path = _bf16_file(tmp_path, _small_dit())
    model, _ = loading.load_transformer(path, "cpu", torch.bfloat16, weight_formats=WeightFormats(fmt))
    fresh, _ = loading.load_transformer(path, "cpu", torch.bfloat16, weight_formats=WeightFormats(fmt))
    before = snapshot(model)
    a = make_lora(tmp_path, model, name="a")
    b = make_lora(tmp_path, model, layers=EVERY_BLOCK_LINEAR[:7], seed=2, name="b")  # block 0 only
    LoraMerger(fresh, FileOriginals(path)).apply([(b, 1.0)])
    passes = _counting_reads(monkeypatch)
    merger = LoraMerger(model, FileOriginals(path))
    per_block = len(BLOCK_LINEARS)  # checkpoint tensors of a block's 4 quantised weights
    merger.apply([(a, 1.0)])
    assert passes == [per_block * SMALL.num_layers]  # every touched tensor, one pass
    merger.apply([(a, 0.4)])
    assert passes[1:] == [per_block * SMALL.num_layers]  # no restore pass before it
    merger.apply([(b, 1.0)])  # block 1 goes back to its loaded bits, block 0 gets b: one pass each
    assert passes[2:] == [per_block, per_block]
    assert all(torch.equal(p, fresh.get_parameter(n)) for n, p in model.named_parameters())
    merger.apply([])
    assert passes[4:] == [per_block]
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def _nan_lora(tmp_path, model, layer: str):
    factors = random_factors(model, EVERY_BLOCK_LINEAR, seed=7, size=0.05)
    factors[layer][0][3, 1] = float("nan")
    return read_lora(write(tmp_path / "nan.safetensors", *lora_state_dict(factors, "comfyui")), layer_shapes(model))


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
@pytest.mark.parametrize("source", ["memory", "bf16 file", "quantised file"])
def test_a_merge_failing_half_way_leaves_the_weights_restorable(fmt, source, tmp_path):
    """A NaN in a layer in the middle of the order: the checks (read once, after the values were written) fail the
    change naming the layer, every weight comes back to its loaded bits, and the next change works from them."""
    float_model = _small_dit()
    if source == "memory":
        model, originals = float_model.quantized_copy(uniform_plan(FORMATS[fmt], SMALL.num_layers)), MemoryOriginals()
    else:
        path = _bf16_file(tmp_path, float_model) if source == "bf16 file" else _comfy_dit_file(tmp_path, float_model,
                                                                                                fmt)[0]  # fmt: skip
        formats = WeightFormats(fmt if source == "bf16 file" else "auto")
        model, _ = loading.load_transformer(path, "cpu", torch.bfloat16, weight_formats=formats)
        originals = FileOriginals(path)
    before = snapshot(model)
    good = make_lora(tmp_path, model)
    bad = _nan_lora(tmp_path, model, "transformer_blocks.1.img_mlp.gate_layer")
    merger = LoraMerger(model, originals)
    merger.apply([(good, 1.0)])
    merged = snapshot(model)
    with pytest.raises(LoraError, match=r"transformer_blocks\.1\.img_mlp\.gate_layer.* gives nan"):
        merger.apply([(good, 0.5), (bad, 1.0)])
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert merger.merged == {} and merger.changed == set() and model.weights_id == ()
    merger.apply([(good, 1.0)])
    assert all(torch.equal(p, merged[n]) for n, p in model.named_parameters())
    merger.apply([])
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("fmt", ["bf16", *QUANT_FORMATS])
def test_copies_of_the_originals_are_packed_into_slabs_and_restore_bit_for_bit(fmt, tmp_path, monkeypatch):
    float_model, model = quantized_pair(fmt) if fmt != "bf16" else (None, _small_dit().to(torch.bfloat16))
    before = snapshot(model)
    a, b = make_lora(tmp_path, model, name="a"), make_lora(tmp_path, model, seed=2, name="b")
    originals = MemoryOriginals()
    touched = [p for n, p in model.named_parameters() if n.startswith("transformer_blocks.")
               and n.endswith(("qweight", "weight_scale", "to_qkv.weight", "to_out.weight", "gate_up.weight",
                               "out.weight"))]  # fmt: skip
    originals.SLAB_BYTES = sum(p.numel() * p.element_size() for p in touched) // 3  # several slabs, most shared
    seen = []
    monkeypatch.setattr("qwen21_nodes.qwen21_core.lora.merge.copies_place",
                        lambda nbytes, device, budget: seen.append((nbytes, device, budget)) or "pageable")  # fmt: skip
    merger = LoraMerger(model, originals)
    merger.apply([(a, 1.0)], vram_budget=12345)
    first = snapshot(model)
    slabs = {copy.untyped_storage().data_ptr() for copy in originals.saved.values()}
    assert 1 < len(slabs) < len(originals.saved) and all(copy.grad_fn is None for copy in originals.saved.values())
    assert all(copy.untyped_storage().nbytes() <= originals.SLAB_BYTES for copy in originals.saved.values())
    # one decision for all the copies of the change, asked with the pipeline's budget
    assert seen == [(sum(-(-t.numel() * t.element_size() // 256) * 256 for t in originals.saved.values()),
                     torch.device("cpu"), 12345)]  # fmt: skip
    for stack in ([(a, 0.3)], [(a, -0.5), (b, 2.0)], [(b, 1.0)], [(a, 1.0)]):
        merger.apply(stack)
    assert all(torch.equal(p, first[n]) for n, p in model.named_parameters())
    merger.apply([])
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters()) and originals.nbytes == 0


def test_slabs_pack_in_order_and_a_large_copy_goes_alone():
    from qwen21_nodes.qwen21_core.lora.merge import _slabs

    sizes = {"a": 256, "b": 512, "c": 2048, "d": 256, "e": 768}
    assert _slabs(sizes, 1024) == [(["a", "b"], 768), (["c"], 2048), (["d", "e"], 1024)]


def test_where_copies_of_the_originals_go_is_the_planners_decision(monkeypatch):
    from qwen21_nodes.qwen21_core.memory import planner

    gib = 2**30
    cuda = torch.device("cuda", 0)
    budgets = []
    monkeypatch.setattr(planner, "device_free_bytes", lambda device, budget=None: budgets.append(budget) or 20 * gib)
    monkeypatch.setattr(planner, "host_free_bytes", lambda: 16 * gib)
    room = planner.KEPT_COPIES_SHARE * (20 * gib - planner.HEADROOM_BYTES)
    assert planner.copies_place(int(room), cuda, budget=5) == "device" and budgets == [5]
    assert planner.copies_place(int(room) + 1, cuda) == "pinned"
    assert planner.copies_place(17 * gib, cuda) == "pageable"  # more than the host can pin
    assert planner.copies_place(1, torch.device("cpu")) == "pageable"  # weights on the CPU: copies beside them


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_gpu_copies_on_the_device_or_pinned_by_budget_and_file_floats_merged_in_one_pass(fmt, tmp_path):
    """Copies of the originals stay on the GPU when it has room and go to pinned RAM within a tight budget: both
    restore bit for bit and give the same merged bits. A bf16 file's floats merged on the GPU (the loader's pass,
    merges overlapping the reads) are quantise(W_file + delta), per checkpoint tensor, computed there."""
    from qwen21_nodes.qwen21_core.lora.merge import full_fp32_matmul
    from safetensors.torch import load_file

    _, model = quantized_pair(fmt, device="cuda", dtype=torch.bfloat16)
    before = snapshot(model)
    lora = make_lora(tmp_path, model)
    merged = {}
    for budget in (None, torch.cuda.memory_allocated() + 1):  # the device's free memory; no room left
        originals = MemoryOriginals()
        merger = LoraMerger(model, originals)
        merger.apply([(lora, 1.0)], vram_budget=budget)
        copies = list(originals.saved.values())
        if budget is None:
            assert originals.place == "device" and all(copy.is_cuda for copy in copies)
        else:
            assert originals.place == "pinned" and all(copy.is_pinned() for copy in copies)
        merged[budget] = snapshot(model)
        merger.apply([(lora, 0.5)])
        merger.apply([])
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    first, second = merged.values()
    assert all(torch.equal(first[n], second[n]) for n in first)

    path = _bf16_file(tmp_path, _small_dit())
    model, _ = loading.load_transformer(path, "cuda", torch.bfloat16, weight_formats=WeightFormats(fmt))
    LoraMerger(model, FileOriginals(path)).apply([(lora, 0.9)])
    wanted = {key: tensor.to("cuda", torch.float32) for key, tensor in load_file(path).items()}
    with full_fp32_matmul():
        for piece in lora.layers:
            delta = piece.up.to("cuda", torch.float32) @ piece.down.to("cuda", torch.float32)
            wanted[f"{piece.layer}.weight"] += delta * (piece.scale * 0.9)
    for key, slot in model.checkpoint_slots().items():
        if hasattr(slot, "layer") and key.endswith(".weight"):
            q, s = quantize_weight(wanted[key], slot.layer.fmt)
            assert torch.equal(slot.layer.qweight[slot.rows], q) and torch.equal(slot.layer.weight_scale[slot.rows], s)
