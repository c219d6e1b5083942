"""checkpoint.py + quantization.py: reading, validation, identification, streaming into modules, fp8, memory."""

import json
import os
import struct
import subprocess
import sys
import textwrap

import pytest
import torch
from qwen21_nodes.qwen21_core.checkpoints import files as ck
from qwen21_nodes.qwen21_core.checkpoints import formats as quantization
from qwen21_nodes.qwen21_core.checkpoints.files import (
    Checkpoint,
    CheckpointError,
    CheckpointMismatchError,
    WrongModelError,
)
from qwen21_nodes.qwen21_core.checkpoints.formats import UnsupportedQuantizationError
from safetensors.torch import save_file
from torch import nn


def _identity(key, tensor):
    return [(key, tensor)]


class TwoLayers(nn.Module):
    """Stand-in module: two bias-free linears and a norm weight."""

    def __init__(self, dim=8, hidden=12):
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)
        self.norm = nn.Parameter(torch.ones(dim))


def _weights(dim=8, hidden=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "up.weight": torch.randn(hidden, dim, generator=g),
        "down.weight": torch.randn(dim, hidden, generator=g),
        "norm": torch.rand(dim, generator=g) + 0.5,
    }


def _load(path, **kwargs):
    module = ck.build_empty(TwoLayers, "cpu", torch.float32)
    with Checkpoint.open(path) as ckpt:
        ck.load_into(ck.module_slots(module), ckpt, _identity, what="test module", **kwargs)
    return module


# ---- reading ------------------------------------------------------------------------------------------


def test_reads_every_dtype_bit_exactly(tmp_path):
    g = torch.Generator().manual_seed(1)
    tensors = {
        "bf16": torch.randn(3, 5, generator=g).bfloat16(),
        "f16": torch.randn(7, generator=g).half(),
        "f32": torch.randn(2, 3, 4, generator=g),
        "e4m3": torch.randn(4, 4, generator=g).to(torch.float8_e4m3fn),
        "e5m2": torch.randn(4, 4, generator=g).to(torch.float8_e5m2),
        "i64": torch.arange(5),
        "scalar": torch.tensor(3.5),
    }
    save_file(tensors, tmp_path / "a.safetensors", metadata={"format": "pt"})
    with Checkpoint.open(tmp_path / "a.safetensors") as ckpt:
        assert sorted(ckpt.keys()) == sorted(tensors)
        assert ckpt.metadata == {"format": "pt"}
        for key, expected in tensors.items():
            got = ckpt.read(key)
            assert got.dtype == expected.dtype and got.shape == expected.shape
            assert torch.equal(got.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)), key


def test_parallel_piecewise_reads_are_exact(tmp_path, monkeypatch):
    monkeypatch.setattr(ck, "_READ_PIECE", 1000)  # odd piece size: many pieces, cut inside elements
    big = torch.randn(300, 257, generator=torch.Generator().manual_seed(2))
    save_file({"big": big, "small": torch.ones(3)}, tmp_path / "a.safetensors")
    with Checkpoint.open(tmp_path / "a.safetensors") as ckpt:
        assert torch.equal(ckpt.read("big"), big)
        part = torch.empty(5000, dtype=torch.uint8)
        ckpt.read_bytes("big", 777, part)
        assert torch.equal(part, big.reshape(-1).view(torch.uint8)[777:5777])


def test_sharded_folder_reads_across_shards(tmp_path):
    weights = _weights()
    save_file({"up.weight": weights["up.weight"]}, tmp_path / "m-00001-of-00002.safetensors")
    save_file({k: weights[k] for k in ("down.weight", "norm")}, tmp_path / "m-00002-of-00002.safetensors")
    weight_map = {"up.weight": "m-00001-of-00002.safetensors", "down.weight": "m-00002-of-00002.safetensors",
                  "norm": "m-00002-of-00002.safetensors"}  # fmt: skip
    (tmp_path / "m.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    module = _load(tmp_path)  # the folder: the index is found
    assert torch.equal(module.up.weight, weights["up.weight"])
    assert torch.equal(module.down.weight, weights["down.weight"])
    assert torch.equal(module.norm, weights["norm"])


def test_sharded_index_errors(tmp_path):
    save_file({"a": torch.zeros(2)}, tmp_path / "s1.safetensors")
    index = tmp_path / "x.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="shard s2.safetensors is missing"):
        Checkpoint.open(index)
    index.write_text(json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"lists 1 tensors that are not in the shard.*'b'"):
        Checkpoint.open(index)


# ---- file errors --------------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"checkpoint not found: .*nope\.safetensors"):
        Checkpoint.open(tmp_path / "nope.safetensors")


def test_not_safetensors(tmp_path):
    path = tmp_path / "notes.safetensors"
    path.write_text("these are some notes, not a checkpoint " * 10)
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        Checkpoint.open(path)
    path.write_bytes(b"abc")
    with pytest.raises(CheckpointError, match=r"not a safetensors file \(only 3 bytes long\)"):
        Checkpoint.open(path)


def test_pickle_and_gguf_files_are_refused_without_opening(tmp_path):
    pickle_file = tmp_path / "model.ckpt"
    pickle_file.write_bytes(b"PK\x03\x04" + b"\x00" * 200)  # a zip header, as torch.save writes
    with pytest.raises(CheckpointError, match="pickle checkpoint; pickles are never opened"):
        Checkpoint.open(pickle_file)
    gguf = tmp_path / "model.safetensors"  # a GGUF under another name is read as a GGUF (its magic): this one is cut
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 200)
    with pytest.raises(CheckpointError, match="not a readable GGUF file|GGUF file without tensors"):
        Checkpoint.open(gguf)


def test_folder_without_safetensors_names_what_it_has(tmp_path):
    (tmp_path / "diffusion_pytorch_model.bin").write_bytes(b"\x80\x02")
    with pytest.raises(CheckpointError, match=r"no \.safetensors file.*diffusion_pytorch_model\.bin.*never opened"):
        Checkpoint.open(tmp_path)


def test_truncated_file(tmp_path):
    path = tmp_path / "a.safetensors"
    save_file({"w": torch.randn(64, 64)}, path)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 1000)
    with pytest.raises(CheckpointError, match=r"truncated: its header describes 16384 bytes .* only 15384 are present"):
        Checkpoint.open(path)


def test_corrupt_header_entry(tmp_path):
    header = json.dumps({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 60]}}).encode()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\x00" * 60)
    with pytest.raises(CheckpointError, match=r"w claims shape \[4, 4\] F32 but 60 bytes"):
        Checkpoint.open(path)


def test_tensors_sharing_bytes_are_refused_at_the_header_for_checkpoints_loras_and_shards(tmp_path):
    """A 24 MiB file whose tensors all point at the same bytes would be read (and held) once per tensor: refused at
    the header, quickly, before a byte of data is read (a LoRA at Qwen21 Load LoRA's reader too)."""
    import time

    from qwen21_nodes.qwen21_core.lora.reading import LoraError, read_lora

    mib = 2**20
    region = {"dtype": "F32", "shape": [mib], "data_offsets": [0, 4 * mib]}
    shared = {f"diffusion_model.transformer_blocks.{i}.attn.to_q.lora_up.weight": region for i in range(40)}
    path = _raw_safetensors(tmp_path / "shared.safetensors", shared, data_bytes=24 * mib)
    started = time.perf_counter()
    with pytest.raises(CheckpointError, match="share bytes of the file"):
        Checkpoint.open(path)
    assert time.perf_counter() - started < 0.5
    with pytest.raises(LoraError, match="share bytes of the file"):
        read_lora(path, {})
    half = {"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},
            "b": {"dtype": "U8", "shape": [8], "data_offsets": [4, 12]}}  # fmt: skip
    _raw_safetensors(tmp_path / "model-00001-of-00002.safetensors", {"ok": {"dtype": "U8", "shape": [4],
                                                                            "data_offsets": [0, 4]}})  # fmt: skip
    _raw_safetensors(tmp_path / "model-00002-of-00002.safetensors", half)
    index = {"weight_map": {"ok": "model-00001-of-00002.safetensors", "a": "model-00002-of-00002.safetensors",
                            "b": "model-00002-of-00002.safetensors"}}  # fmt: skip
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="'a' and 'b' share bytes"):
        Checkpoint.open(tmp_path / "model.safetensors.index.json")
    empty = {"a": {"dtype": "U8", "shape": [0], "data_offsets": [4, 4]}, "b": {"dtype": "U8", "shape": [8],
                                                                              "data_offsets": [0, 8]}}  # fmt: skip
    Checkpoint.open(_raw_safetensors(tmp_path / "empty.safetensors", empty)).close()  # no bytes: nothing shared


def _raw_safetensors(path, header: dict, data_bytes: int = 64):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\x00" * data_bytes)
    return path


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}, "data_offsets"),  # a read of 64 GiB before
        ({"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}, "data_offsets"),
        ({"dtype": "F32", "shape": [2], "data_offsets": ["0", "8"]}, "data_offsets"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [0.0, 8.0]}, "data_offsets"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [False, 8]}, "data_offsets"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [0, 8, 16]}, "data_offsets"),
        ({"dtype": "U8", "shape": [10**30], "data_offsets": [0, 10**30]}, "truncated"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [0, 10**30]}, "claims shape"),
        ({"dtype": "F32", "shape": [-2, -1], "data_offsets": [0, 8]}, "shape"),
        ({"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]}, "shape"),
        ({"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}, "shape"),
        ({"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 8]}, "shape"),
        ({"dtype": "F32", "shape": 2, "data_offsets": [0, 8]}, "shape"),
        ({"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}, "dtype"),
        ({"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}, "claims shape"),
        ({"dtype": "F32", "shape": [2]}, "data_offsets"),
        ("not an object", "entry"),
    ],
)
def test_every_bad_header_field_is_a_checkpoint_error(tmp_path, entry, message):
    """Offsets and shapes must be non-negative integers, offsets inside the file, sizes dtype x shape; anything else
    is a CheckpointError naming the file and the tensor, never a TypeError or a huge allocation."""
    path = _raw_safetensors(tmp_path / "bad.safetensors", {"ok": {"dtype": "U8", "shape": [4],
                                                                  "data_offsets": [0, 4]}, "w": entry})  # fmt: skip
    with pytest.raises(CheckpointError, match=rf"bad.safetensors: .*({message}.*'w'|\bw\b.*{message})"):
        ckpt = Checkpoint.open(path)
        ckpt.read("w")


@pytest.mark.parametrize("metadata", [["a"], {"format": 1}, "text"])
def test_bad_header_metadata_is_a_checkpoint_error(tmp_path, metadata):
    path = _raw_safetensors(tmp_path / "bad.safetensors", {"__metadata__": metadata})
    with pytest.raises(CheckpointError, match=r"bad.safetensors: .*__metadata__"):
        Checkpoint.open(path)


@pytest.mark.parametrize("metadata", ['{"layers": [1]}', "not json", '["x"]', '{"layers": {"w": {"format": [1]}}}'])
def test_malformed_quantisation_markers_are_checkpoint_errors(tmp_path, metadata):
    path = tmp_path / "q.safetensors"
    save_file({"w.weight": torch.zeros(2, 2)}, path, metadata={"_quantization_metadata": metadata})
    with Checkpoint.open(path) as ckpt, pytest.raises(CheckpointError, match=r"q.safetensors: .*_quantization_meta"):
        quantization.inspect(str(ckpt.path), ckpt.keys(), ckpt.dtype, ckpt.metadata, ckpt.read)


@pytest.mark.parametrize("shard", ["/etc/passwd", "../outside.safetensors", "sub/../../outside.safetensors"])
def test_a_sharded_index_names_shards_inside_its_folder_only(tmp_path, shard):
    folder = tmp_path / "model"
    folder.mkdir()
    save_file({"a": torch.zeros(2)}, tmp_path / "outside.safetensors")
    index = folder / "x.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": shard}}))
    with pytest.raises(CheckpointError, match=r"x.safetensors.index.json: shard .* must be a relative path inside"):
        Checkpoint.open(index)
    index.write_text(json.dumps({"weight_map": ["a"]}))
    with pytest.raises(CheckpointError, match="weight_map"):
        Checkpoint.open(index)


# ---- identification -----------------------------------------------------------------------------------


def _fake(tmp_path, shapes: dict, name="model.safetensors"):
    """A file with the given keys and shapes (zeros): enough for the probes."""
    path = tmp_path / name
    save_file({k: torch.zeros(s, dtype=torch.bfloat16) for k, s in shapes.items()}, path)
    return Checkpoint.open(path)


QWEN21_DIT = {
    "txt_in.text_norm.weight": [8],
    "img_in.weight": [8, 4],
    "transformer_blocks.0.img_mlp.gate_layer.weight": [6, 8],
}
QWEN21_VAE_COMFY = {
    "decoder.head.2.weight": [4, 6, 1, 3, 3],
    "decoder.upsamples.0.upsamples.0.residual.2.weight": [6, 6, 1, 3, 3],
    "decoder.middle.0.residual.0.gamma": [6, 1, 1, 1],
}
QWEN1_DIT = {
    "model.diffusion_model.txt_norm.weight": [3584],
    "model.diffusion_model.img_in.weight": [3072, 64],
    "model.diffusion_model.transformer_blocks.0.img_mod.1.weight": [18432, 3072],
}
WAN22_VAE = {
    "decoder.middle.0.residual.0.gamma": [8, 1, 1, 1],
    "conv2.weight": [48, 48, 1, 1, 1],
    "decoder.upsamples.0.upsamples.0.residual.2.weight": [8, 8, 3, 3, 3],
    "decoder.head.2.weight": [12, 8, 3, 3, 3],
}


@pytest.mark.parametrize(
    ("component", "shapes", "layout", "prefix"),
    [
        ("transformer", QWEN21_DIT, "diffusers", ""),
        ("transformer", {"model.diffusion_model.txt_in.text_norm.weight": [8],
                         "model.diffusion_model.transformer_blocks.0.img_mlp.gate_up.weight": [12, 8]},
         "comfyui", "model.diffusion_model."),
        ("transformer", {"txt_in.text_norm.weight": [8], "transformer_blocks.0.img_mlp.gate_up.weight": [12, 8]},
         "comfyui", ""),
        ("vae", {"encoder.conv_in.weight": [8, 4, 3, 3], "decoder.norm_out.gamma": [6, 1, 1, 1]}, "diffusers", ""),
        ("vae", QWEN21_VAE_COMFY, "comfyui", ""),
        ("text_encoder", {"model.visual.deepstack_merger_list.0.norm.weight": [8],
                          "model.language_model.norm.weight": [8]}, "transformers", ""),
        ("text_encoder", {"visual.deepstack_merger_list.0.norm.weight": [8], "model.norm.weight": [8]},
         "comfyui-internal", ""),
    ],
)  # fmt: skip
def test_identify_our_layouts(tmp_path, component, shapes, layout, prefix):
    with _fake(tmp_path, shapes) as ckpt:
        assert ck.identify(ckpt, component) == ck.Layout(component, layout, prefix)


@pytest.mark.parametrize(
    ("component", "shapes", "message"),
    [
        ("transformer", QWEN1_DIT, r"Qwen-Image 1\.x .*img_in \[3072, 64\]"),
        ("transformer", {"patch_embedding.weight": [5120, 16, 1, 2, 2], "blocks.0.self_attn.q.weight": [8, 8]},
         r"a Wan 2\.x video transformer \(patch_embedding \[5120, 16, 1, 2, 2\]\)"),
        ("transformer", {"double_blocks.0.img_attn.qkv.weight": [9, 3]}, "a Flux transformer"),
        ("transformer", {"model.diffusion_model.input_blocks.0.0.weight": [4, 4, 3, 3],
                         "first_stage_model.decoder.conv_in.weight": [4, 4, 3, 3]},
         r"a full Stable Diffusion checkpoint"),
        ("transformer", {"transformer_blocks.0.attn.to_q.lora_A.weight": [4, 8]}, "a LoRA"),
        ("transformer", QWEN21_VAE_COMFY, "the Qwen-Image-2.1 VAE; load it as the vae"),
        ("vae", QWEN21_DIT, "the Qwen-Image-2.1 transformer .*; load it as the transformer"),
        ("vae", {"decoder.middle.0.residual.0.gamma": [384, 1, 1, 1], "conv2.weight": [16, 16, 1, 1, 1]},
         r"a Wan 2\.1 VAE \(z_dim 16\), the VAE of Wan 2\.1 and of Qwen-Image 1\.x"),
        ("vae", WAN22_VAE, r"a Wan 2\.2 video VAE \(z_dim 48"),
        ("vae", {"encoder.conv_in.weight": [96, 3, 3, 3, 3], "post_quant_conv.weight": [16, 16, 1, 1, 1]},
         r"a Wan / Qwen-Image 1\.x video VAE in diffusers layout \(z_dim 16\)"),
        ("vae", {"decoder.conv_in.weight": [512, 16, 3, 3], "encoder.down.0.block.0.norm1.weight": [128]},
         r"a SD3/Flux VAE \(16 latent channels\)"),
        ("text_encoder", {"model.layers.0.self_attn.k_proj.bias": [512], "visual.blocks.0.attn.qkv.weight": [9, 3]},
         r"Qwen2\.5\(-VL\) .*Qwen-Image 1\.x text encoder"),
        ("text_encoder", {"model.layers.0.self_attn.q_norm.weight": [128], "model.norm.weight": [4096]},
         "a text-only Qwen3 language model"),
        ("text_encoder", {"encoder.block.0.layer.0.SelfAttention.k.weight": [8, 8]}, "a T5 text encoder"),
    ],
)  # fmt: skip
def test_identify_names_wrong_models(tmp_path, component, shapes, message):
    with _fake(tmp_path, shapes) as ckpt:
        with pytest.raises(WrongModelError, match="expected the Qwen-Image-2.1 .*" + message):
            ck.identify(ckpt, component)


def test_identify_unknown_lists_keys(tmp_path):
    with _fake(tmp_path, {"foo.bar": [2], "baz": [3]}) as ckpt:
        with pytest.raises(WrongModelError, match=r"none of its 2 keys match any known layout .*'foo\.bar'"):
            ck.identify(ckpt, "vae")


# ---- building and loading -----------------------------------------------------------------------------


class WithBuffersAndTies(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 4, 2, dtype=torch.float32) / 4)))
        self.steps = nn.Parameter(torch.arange(3), requires_grad=False)  # not floating point


def test_build_empty_keeps_buffers_ties_and_integer_dtypes():
    module = ck.build_empty(WithBuffersAndTies, "cpu", torch.bfloat16)
    assert module.embed.weight.dtype == torch.bfloat16 and module.embed.weight.device.type == "cpu"
    assert module.head.weight is module.embed.weight
    assert torch.equal(module.inv_freq, torch.tensor([1.0, 0.01]))  # computed in __init__, kept
    assert module.inv_freq.dtype == torch.float32
    assert module.steps.dtype == torch.int64
    assert not module.training and not module.embed.weight.requires_grad
    # nothing stays on meta, and parameters registered afterwards are not affected
    assert all(t.device.type == "cpu" for t in [*module.parameters(), *module.buffers()])
    assert nn.Linear(2, 2).weight.device.type == "cpu"


def test_load_into_copies_converts_and_casts(tmp_path):
    weights = _weights()
    save_file({k: v.bfloat16() for k, v in weights.items()}, tmp_path / "w.safetensors")
    module = _load(tmp_path / "w.safetensors")
    assert module.up.weight.dtype == torch.float32
    assert torch.equal(module.up.weight, weights["up.weight"].bfloat16().float())

    def renamed(key, tensor):  # a converter that splits one tensor into two slots (views)
        if key == "both":
            return [("up.weight", tensor[:12]), ("down.weight", tensor[12:].reshape(8, 12))]
        return [(key, tensor)]

    save_file({"both": torch.cat([weights["up.weight"], weights["down.weight"].reshape(12, 8)]),
               "norm": weights["norm"]}, tmp_path / "fused.safetensors")  # fmt: skip
    module = ck.build_empty(TwoLayers, "cpu", torch.float32)
    with Checkpoint.open(tmp_path / "fused.safetensors") as ckpt:
        ck.load_into(ck.module_slots(module), ckpt, renamed, what="test module")
    assert torch.equal(module.down.weight, weights["down.weight"])


def test_load_into_reports_missing_unexpected_and_shapes(tmp_path):
    weights = _weights()
    del weights["norm"]
    weights["extra.weight"] = torch.zeros(2)
    weights["up.weight"] = torch.zeros(5, 8)
    save_file(weights, tmp_path / "w.safetensors")
    with pytest.raises(CheckpointMismatchError) as err:
        _load(tmp_path / "w.safetensors")
    message = str(err.value)
    assert "does not fit the test module" in message
    assert "1 missing keys (norm)" in message
    assert "1 unexpected keys (extra.weight)" in message
    assert "1 shape mismatches (up.weight: checkpoint [5, 8] vs model [12, 8])" in message


def test_none_slots_are_optional_and_not_read(tmp_path):
    weights = _weights()
    save_file(weights, tmp_path / "w.safetensors")
    module = ck.build_empty(TwoLayers, "cpu", torch.float32)
    slots = ck.module_slots(module)
    slots["dropped.weight"] = None  # e.g. the VAE's time_conv: read and dropped
    with Checkpoint.open(tmp_path / "w.safetensors") as ckpt:
        assert ck.plan_load(slots, ckpt, _identity, quantization.QuantScheme(), "m") == sorted(weights)


# ---- fp8 and other quantisation ----------------------------------------------------------------------


def _fp8(weight, dtype=torch.float8_e4m3fn):
    scale = weight.abs().amax() / torch.finfo(dtype).max
    return (weight / scale).to(dtype), scale


@pytest.mark.parametrize("style", ["comfy_quant", "metadata", "scaled_fp8_old", "per_row"])
def test_fp8_scaled_file_loads_within_fp8_error(tmp_path, style):
    weights = _weights(seed=3)
    tensors, layers = {"norm": weights["norm"].bfloat16()}, {}
    for name in ("up", "down"):
        w = weights[f"{name}.weight"]
        if style == "per_row":
            scale = w.abs().amax(dim=1) / 448.0
            q = (w / scale[:, None]).to(torch.float8_e4m3fn)
        else:
            q, scale = _fp8(w)
        tensors[f"{name}.weight"] = q
        if style == "scaled_fp8_old":
            tensors[f"{name}.scale_weight"] = scale.float()
            tensors[f"{name}.scale_input"] = torch.tensor(1.0)
        else:
            tensors[f"{name}.weight_scale"] = scale.float()
            tensors[f"{name}.input_scale"] = torch.tensor(0.5)
        if style == "comfy_quant":
            tensors[f"{name}.comfy_quant"] = torch.tensor(list(b'{"format": "float8_e4m3fn"}'), dtype=torch.uint8)
        layers[name] = {"format": "float8_e4m3fn"}
    metadata = {"_quantization_metadata": json.dumps({"layers": layers})} if style == "metadata" else None
    if style == "scaled_fp8_old":
        tensors["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    save_file(tensors, tmp_path / "q.safetensors", metadata=metadata)

    module = _load(tmp_path / "q.safetensors")
    for name in ("up", "down"):
        original, loaded = weights[f"{name}.weight"], getattr(module, name).weight
        # e4m3 keeps 3 mantissa bits: relative rounding error at most 2^-4 (plus subnormals near zero)
        assert (loaded - original).abs().max() <= original.abs().max() / 16
        assert not torch.equal(loaded, original)  # it really went through fp8
    assert torch.equal(module.norm, weights["norm"].bfloat16().float())


def test_fp8_unscaled_e5m2_upcasts(tmp_path):
    weights = _weights(seed=4)
    save_file({k: v.to(torch.float8_e5m2) for k, v in weights.items()}, tmp_path / "q.safetensors")
    module = _load(tmp_path / "q.safetensors")
    assert torch.equal(module.up.weight, weights["up.weight"].to(torch.float8_e5m2).float())
    with Checkpoint.open(tmp_path / "q.safetensors") as ckpt:
        scheme = quantization.inspect(str(ckpt.path), ckpt.keys(), ckpt.dtype, ckpt.metadata, ckpt.read)
    assert scheme.name == "fp8 e5m2, unscaled"


def _marker(fmt):
    return torch.tensor(list(json.dumps({"format": fmt}).encode()), dtype=torch.uint8)


@pytest.mark.parametrize(
    ("tensors", "metadata", "message"),
    [
        ({"up.weight": torch.zeros(4, 2, dtype=torch.int8), "up.weight_scale": torch.tensor(1.0),
          "up.comfy_quant": _marker("asym_w4a8_int8")},
         None, r"ComfyUI quantisation format \['asym_w4a8_int8'\] on 1 layers"),
        ({"up.weight": torch.zeros(4, 4, dtype=torch.float8_e4m3fn), "up.weight_scale": torch.ones(4, 1),
          "up.comfy_quant": _marker("mxfp8")}, None, r"format \['mxfp8'\]"),
        ({"up.weight": torch.zeros(4, 2, dtype=torch.uint8)},
         {"_quantization_metadata": json.dumps({"layers": {"up": {"format": "nvfp4"}}})}, r"format \['nvfp4'\]"),
        ({"up.weight": torch.zeros(4, 4, dtype=torch.int8)}, None, "int8 weights without a ComfyUI int8_tensorwise"),
        ({"up.weight": torch.zeros(4, 4, dtype=torch.int16)}, None, "torch.int16 weights .*integer-quantised"),
        ({"up.qweight": torch.zeros(4, 4, dtype=torch.int32)}, None, "GPTQ/AWQ 4-bit quantisation"),
        ({"up.weight": torch.zeros(4, 4)}, {"comfy.gguf.orig_shape.up.weight": "4,4"}, "GGUF quantisation"),
    ],
)  # fmt: skip
def test_unsupported_quantisation_is_named(tmp_path, tensors, metadata, message):
    save_file(tensors, tmp_path / "q.safetensors", metadata=metadata)
    with Checkpoint.open(tmp_path / "q.safetensors") as ckpt:
        with pytest.raises(UnsupportedQuantizationError, match=message + r".*Supported: bf16, fp16 and fp32.*instead"):
            quantization.inspect(str(ckpt.path), ckpt.keys(), ckpt.dtype, ckpt.metadata, ckpt.read)


def test_unknown_safetensors_dtype_is_named(tmp_path):
    header = json.dumps({"w": {"dtype": "F8_E8M0", "shape": [4], "data_offsets": [0, 4]}}).encode()
    path = tmp_path / "mx.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\x00" * 4)
    with Checkpoint.open(path) as ckpt, pytest.raises(UnsupportedQuantizationError, match="dtype F8_E8M0"):
        quantization.inspect(str(ckpt.path), ckpt.keys(), ckpt.dtype, ckpt.metadata, ckpt.read)


# ---- memory -------------------------------------------------------------------------------------------

_MEMORY_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from torch import nn
    from qwen21_nodes.qwen21_core.checkpoints import files as ck

    path, layers, dim = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

    def status_mib(field):  # VmRSS: resident now; VmHWM: peak resident since the last reset
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(layers))

    module = ck.build_empty(Stack, "cpu", torch.float32)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak to the current resident size
    before = status_mib("VmRSS")
    with ck.Checkpoint.open(path) as ckpt:
        ck.load_into(ck.module_slots(module), ckpt, lambda k, t: [(k, t)], what="stack")
    peak = status_mib("VmHWM")
    assert all(bool((l.weight == i).all()) for i, l in enumerate(module.layers))
    print(json.dumps({"before_mib": before, "peak_mib": peak}))
    """
)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc to reset the peak RSS")
def test_peak_memory_stays_near_one_tensor_above_the_model(tmp_path):
    """Load a 256 MiB file (16 x 16 MiB tensors) in a fresh process; the peak RSS may grow by the model
    (256 MiB) plus about one tensor, not by a second copy of the file."""
    layers, dim = 16, 2048
    weights = {f"layers.{i}.weight": torch.full((dim, dim), float(i)) for i in range(layers)}
    save_file(weights, tmp_path / "big.safetensors")
    del weights
    model_mib, tensor_mib = layers * dim * dim * 4 / 2**20, dim * dim * 4 / 2**20
    env = dict(os.environ, OMP_NUM_THREADS="1")
    args = [str(tmp_path / "big.safetensors"), str(layers), str(dim)]
    out = subprocess.run([sys.executable, "-P", "-c", _MEMORY_SCRIPT, *args], capture_output=True, text=True, env=env,
                         check=True)  # fmt: skip
    result = json.loads(out.stdout.strip().splitlines()[-1])
    growth = result["peak_mib"] - result["before_mib"]
    print(f"peak RSS growth {growth:.0f} MiB for a {model_mib:.0f} MiB model (one tensor = {tensor_mib:.0f} MiB)")
    assert growth >= model_mib * 0.9  # the weights really were written
    assert growth <= model_mib + tensor_mib + 8, f"peak grew {growth:.0f} MiB, more than the model + one tensor"


def test_a_lora_header_far_beyond_what_loras_need_is_refused_before_it_is_parsed(tmp_path):
    """A 40 MiB header (safetensors allows 100) held the server for seconds while it was parsed: refused at once."""
    import time

    from qwen21_nodes.qwen21_core.lora.reading import LoraError, read_lora

    path = tmp_path / "huge_header.safetensors"
    header = b'{"__metadata__": {"x": "' + b"y" * (40 * 2**20) + b'"}}'
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    started = time.perf_counter()
    with pytest.raises(LoraError, match=r"header is 40.0 MiB, more than the 16 MiB"):
        read_lora(path, {})
    assert time.perf_counter() - started < 0.5
    Checkpoint.open(path).close()  # as a checkpoint (safetensors' own limit) it is a file like any other
