"""The Qwen-Image-2.1 single-stream transformer, split into a prefix prefill and a target decode.

Numerically this is diffusers' `QwenImage21Transformer2DModel` (the reference); the structure is ours:

- The prefix (prompt tokens with condition-image latents in their slots) is modulated from t=0 and
  never sees the target, so `prefill` runs it once per generation and stores every layer's K/V
  (after QK-norm and RoPE) in a `PrefixKVCache`. Its last layer only needs K/V, so the rest of that
  layer is skipped, as are `norm_out`/`proj_out` for prefix rows (the reference computes and drops them).
- `decode` runs the target tokens only against the cached prefix. Everything step-invariant (rotary
  tables, masks, the t=0 modulation) lives in a `Branch` built once, so a step does no host sync and
  allocates nothing for the prefix; its tensors keep fixed addresses for CUDA-graph replay.
- Projections are fused: one QKV GEMM and one gate+up GEMM per block. Checkpoints keep their names:
  `checkpoint_slots()` maps every diffusers key to its slice of the fused weights.

Shapes: D = heads * head_dim (4096), M = D * mlp_ratio (12288), tokens are rows, [B, S, D].
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...kernels.dequantize_gguf import QUANTIZED as GGUF_QUANTIZED
from ...kernels.qk_norm_rope import qk_norm_rope
from ..config import TransformerConfig
from ..memory.host_copy import HostCopy
from ..memory.streaming import LayerStreamer
from ..quant.gguf_linear import GGUFLinear, GGUFSlot
from ..quant.gguf_prefetch import step_prefetch
from ..quant.linear import QuantLinear
from ..quant.slots import QuantSlot
from ..quant.weights import QuantFormat
from . import quant_math
from .attention import (
    backend_context,
    decode_attention,
    prefix_attention,
    prefix_masks,
    shared_prefix_decode_attention,
)
from .block_stack import BlockStack
from .kv_cache import KVCacheSpec, PrefixKVCache
from .sequence import SequenceLayout, rotary_cos_sin

TIMESTEP_CHANNELS = 256
PREFILL_ROW_CHUNK = 8192  # the prefix MLP runs in row chunks so 16 condition images stay in bounded memory


class TimestepEmbedding(nn.Module):
    """t in [0, 1] -> sinusoid (cos first) of 1000*t -> Linear -> SiLU -> Linear."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(TIMESTEP_CHANNELS, dim, bias=False)
        self.linear_2 = nn.Linear(dim, dim, bias=False)
        self._freqs = {}  # device -> frequencies; not a buffer, so meta construction needs no init

    def frequencies(self, device) -> torch.Tensor:
        key = str(device)
        if key not in self._freqs:
            half = TIMESTEP_CHANNELS // 2
            # computed on the CPU in fp32 so every device gets the same bits
            freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
            self._freqs[key] = freqs.to(device)
        return self._freqs[key]

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        args = (1000.0 * t.float())[:, None] * self.frequencies(t.device)[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1).to(self.linear_1.weight.dtype)
        return self.linear_2(F.silu(self.linear_1(emb)))


class TimeTextEmbed(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.timestep_embedder = TimestepEmbedding(dim)


class TextProjection(nn.Module):
    """Zero-centred RMSNorm (all fp32, scale = weight + 1) -> Linear -> GELU(tanh) -> Linear."""

    def __init__(self, context_dim: int, dim: int, eps: float):
        super().__init__()
        self.text_norm = nn.Module()
        self.text_norm.weight = nn.Parameter(torch.zeros(context_dim))
        self.in_layer = nn.Linear(context_dim, dim, bias=False)
        self.out_layer = nn.Linear(dim, dim, bias=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * (self.text_norm.weight.float() + 1)
        return self.out_layer(F.gelu(self.in_layer(x32.to(x.dtype)), approximate="tanh"))


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int):
        super().__init__()
        self.heads = heads
        self.head_dim = head_dim
        self.to_qkv = nn.Linear(dim, 3 * heads * head_dim, bias=False)  # rows: [q | k | v]
        self.to_out = nn.Linear(heads * head_dim, dim, bias=False)
        self.norm_q_weight = nn.Parameter(torch.ones(head_dim))
        self.norm_k_weight = nn.Parameter(torch.ones(head_dim))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)  # rows: [gate | up], ComfyUI's fused layout
        self.out = nn.Linear(hidden, dim, bias=False)


@dataclass
class Modulation:
    """Per-step block modulation, shared by all blocks: (1 + scale) and tanh(gate), each [B, 1, D]."""

    scale1: torch.Tensor
    gate1: torch.Tensor
    scale2: torch.Tensor
    gate2: torch.Tensor

    @classmethod
    def from_params(cls, params: torch.Tensor) -> Modulation:
        scale1, gate1, scale2, gate2 = (p[:, None, :] for p in params.chunk(4, dim=-1))
        return cls(1 + scale1, gate1.tanh(), 1 + scale2, gate2.tanh())


# The block's math around attention, as functions of tensors and weights only: the same compiled
# code then serves all blocks (see QwenImage21Transformer.compile_blocks).


def modulated_qkv(x, scale1, w_qkv, eps: float):
    """LayerNorm(x) * (1 + scale) -> the fused QKV projection [B, S, 3D]."""
    return F.linear(F.layer_norm(x, x.shape[-1:], eps=eps) * scale1, w_qkv)


def attention_out_and_mlp(x, attn, gate1, scale2, gate2, w_out, w_gate_up, w_down, eps: float):
    """Gated residual of the attention output, then the gated SwiGLU residual. attn: [B, S, D]."""
    x = x + gate1 * F.linear(attn, w_out)
    gate, up = F.linear(F.layer_norm(x, x.shape[-1:], eps=eps) * scale2, w_gate_up).chunk(2, dim=-1)
    x = x + gate2 * F.linear(F.silu(gate) * up, w_down)
    if x.dtype == torch.float16:
        x = x.clip(-65504, 65504)
    return x


# The block's Linears that may be quantised, by their path inside a block.
QUANTIZABLE = ("attn.to_qkv", "attn.to_out", "img_mlp.gate_up", "img_mlp.out")
_QUANTIZABLE_PARTS = tuple(tuple(name.split(".")) for name in QUANTIZABLE)  # (child, grandchild): plain getattrs


class Block(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.eps = config.eps
        self.attn = Attention(config.inner_dim, config.num_attention_heads, config.attention_head_dim)
        self.img_mlp = SwiGLU(config.inner_dim, config.mlp_dim)

    def linears(self) -> dict[str, nn.Module]:
        return {name: self.get_submodule(name) for name in QUANTIZABLE}

    def checkpoint_slots(self, prefix: str) -> dict[str, torch.Tensor]:
        """This block's diffusers keys (after `prefix`) -> the tensors they fill: the fused weights hand out row slices
        (to_q/to_k/to_v of `to_qkv`, gate_layer/proj of `gate_up`)."""
        inner, hidden = self.attn.heads * self.attn.head_dim, self.img_mlp.out.in_features
        qkv, gate_up = self.attn.to_qkv, self.img_mlp.gate_up
        return {
            prefix + "attn.to_q.weight": checkpoint_rows(qkv, 0, inner),
            prefix + "attn.to_k.weight": checkpoint_rows(qkv, inner, 2 * inner),
            prefix + "attn.to_v.weight": checkpoint_rows(qkv, 2 * inner, 3 * inner),
            prefix + "attn.to_out.0.weight": checkpoint_rows(self.attn.to_out),
            prefix + "attn.norm_q.weight": self.attn.norm_q_weight,
            prefix + "attn.norm_k.weight": self.attn.norm_k_weight,
            prefix + "img_mlp.gate_layer.weight": checkpoint_rows(gate_up, 0, hidden),
            prefix + "img_mlp.proj.weight": checkpoint_rows(gate_up, hidden, 2 * hidden),
            prefix + "img_mlp.out.weight": checkpoint_rows(self.img_mlp.out),
        }

    @property
    def quantized(self) -> bool:
        # read twice per block and step: attribute reads, not linears()' get_submodule walks
        return any(isinstance(getattr(getattr(self, a), b), QuantLinear) for a, b in _QUANTIZABLE_PARTS)

    def _qkv(self, x, scale1, fns):
        """[B, S, D] -> [B, S, 3, H, head_dim] (a view of one GEMM)."""
        if self.quantized:
            qkv = quant_math.modulated_qkv(x, scale1, self.attn.to_qkv, self.eps)
        else:
            qkv = fns.qkv(x, scale1, self.attn.to_qkv.weight, self.eps)
        return qkv.unflatten(-1, (3, self.attn.heads, self.attn.head_dim))

    def _finish(self, x, attn, mod: Modulation, fns):
        if self.quantized:  # the fused quantised math (compile_blocks does not apply to it)
            return quant_math.attention_out_and_mlp(
                x, attn.flatten(2), mod.gate1, mod.scale2, mod.gate2, self.attn.to_out, self.img_mlp.gate_up,
                self.img_mlp.out, self.eps,
            )  # fmt: skip
        return fns.finish(
            x, attn.flatten(2), mod.gate1, mod.scale2, mod.gate2, self.attn.to_out.weight,
            self.img_mlp.gate_up.weight, self.img_mlp.out.weight, self.eps,
        )  # fmt: skip

    def prefill(self, x, mod0: Modulation, branch: Branch, layer: int, last: bool, cache=None):
        """Prefix rows [1, P, D]: store this layer's K/V; return the next hidden state (None if last).

        cache: where layer `layer`'s K/V go (the branch's, unless given: a control block's go to its own).
        Sequence parallel (branch.shard set): x holds this rank's rows; attention and the stored K/V, its heads."""
        cache = branch.cache if cache is None else cache
        split = None if branch.shard is None else branch.shard.prefix
        qkv = self._qkv(x, mod0.scale1, EAGER)
        if split is not None:
            qkv = split.to_heads(qkv)
        k_out, v_out = cache.prefill_targets(layer)
        q, k, v = qk_norm_rope(
            qkv, self.attn.norm_q_weight, self.attn.norm_k_weight, branch.prefix_cos, branch.prefix_sin, self.eps,
            k_out=k_out, v_out=v_out,
        )  # fmt: skip
        del qkv
        cache.store_prefix(layer)
        if last:  # later layers read only this layer's K/V
            return None
        attn = prefix_attention(q, k, v, branch.layout.segments, branch.prefix_masks, out=torch.empty_like(q))
        del q
        if split is not None:
            attn = split.to_tokens(attn)
        if x.shape[1] <= PREFILL_ROW_CHUNK:
            return self._finish(x, attn, mod0, EAGER)
        # rows are independent after attention: chunk them so huge prefixes stay in bounded memory
        out = torch.empty_like(x)
        for start in range(0, x.shape[1], PREFILL_ROW_CHUNK):
            rows = slice(start, start + PREFILL_ROW_CHUNK)
            out[:, rows] = self._finish(x[:, rows], attn[:, rows], mod0, EAGER)
        return out

    def decode(self, x, mod: Modulation, branch: Branch, layer: int, fns, in_graph: bool, cache=None):
        """Target rows [B, N, D] against the cached prefix; writes this step's target K/V in place.

        cache: the K/V of layer `layer` (the branch's, unless given: a control block's are its own).
        Sequence parallel (branch.shard set): x holds this rank's rows; attention runs for its heads."""
        cache = branch.cache if cache is None else cache
        split = None if branch.shard is None else branch.shard.target
        qkv = self._qkv(x, mod.scale1, fns)
        if split is not None:
            qkv = split.to_heads(qkv)
        k_out, v_out = cache.target(layer)
        q, k, v = qk_norm_rope(
            qkv, self.attn.norm_q_weight, self.attn.norm_k_weight, branch.target_cos, branch.target_sin, self.eps,
            k_out=k_out, v_out=v_out, in_graph=in_graph,
        )  # fmt: skip
        del qkv
        joint = cache.joint(layer)
        if joint is not None:
            attn = decode_attention(q, joint[0], joint[1], branch.decode_key_mask)
        else:
            kp, vp = cache.prefix(layer)
            attn = shared_prefix_decode_attention(q, kp, vp, k, v, branch.prefix_key_valid)
            cache.done_with(layer)
        if split is not None:
            attn = split.to_tokens(attn)
        return self._finish(x, attn, mod, fns)


@dataclass(frozen=True)
class BlockFunctions:
    qkv: object
    finish: object


EAGER = BlockFunctions(modulated_qkv, attention_out_and_mlp)


@dataclass
class Branch:
    """One CFG branch of one generation: its layout, step-invariant tables and its K/V cache."""

    layout: SequenceLayout
    cache: PrefixKVCache | None
    prefix_cos: torch.Tensor
    prefix_sin: torch.Tensor
    target_cos: torch.Tensor
    target_sin: torch.Tensor
    prefix_masks: list
    prefix_key_valid: torch.Tensor | None  # [P] bool on device, None without padding
    decode_key_mask: torch.Tensor | None  # [1, 1, 1, P+N] bool on device, None without padding
    attention_backend: str = "auto"
    graph_key: tuple | None = None  # set when a DecodeGraphs manager may capture this branch
    # DecodeGraphs' verdict on a first-seen key (dit/decode_graphs.py): whether a step ran, "launch_bound" or
    # "gpu_bound" once a timed step decided, and the host's share of that step
    stepped: bool = False
    first_sight: str | None = None
    host_share: float | None = None
    # Sequence parallel (parallel/ulysses.py SequenceShard): this rank's rows, and heads for attention and the
    # cache; None: everything here. Duck-typed, so the model never imports torch.distributed.
    shard: object | None = None
    # The Fun-Control branch's state (dit/control.py ControlState): its blocks run beside the base's; None: plain
    control: object | None = None

    @property
    def batch(self) -> int:
        return self.cache.batch

    @property
    def cache_bytes(self) -> int:
        """Device bytes of this branch's K/V caches (the control blocks' too, with the control stream's start)."""
        total = self.cache.nbytes if self.cache is not None and self.cache.allocated else 0
        if self.control is not None and self.control.cache.allocated:
            total += self.control.cache.nbytes + self.control.start.numel() * self.control.start.element_size()
        return total

    @property
    def cache_host_bytes(self) -> int:
        total = self.cache.host_nbytes if self.cache is not None else 0
        return total + (self.control.cache.host_nbytes if self.control is not None else 0)

    def release(self):
        self.cache.release()
        if self.control is not None:
            self.control.release()


def checkpoint_rows(layer: nn.Module, start: int = 0, stop: int | None = None):
    """The checkpoint slot for rows [start, stop) of a block Linear's weight (a QuantSlot when quantised, a GGUFSlot
    for one segment of a GGUF layer)."""
    if isinstance(layer, GGUFLinear):
        return GGUFSlot(layer, start, stop)
    if isinstance(layer, QuantLinear):
        return QuantSlot(layer, start, stop)
    return layer.weight[start:stop]


def uniform_plan(fmt: QuantFormat, num_layers: int, keep: Iterable[str] = ()) -> dict[tuple[int, str], QuantFormat]:
    """Every block Linear in `fmt`, except the paths in `keep` (kept in the model's dtype)."""
    keep = set(keep)
    unknown = keep - set(QUANTIZABLE)
    if unknown:
        raise ValueError(f"layers to keep must be among {QUANTIZABLE}, got {sorted(unknown)}")
    return {(i, path): fmt for i in range(num_layers) for path in QUANTIZABLE if path not in keep}


class QwenImage21Transformer(BlockStack, nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        dim = config.inner_dim
        self.time_text_embed = TimeTextEmbed(dim)
        self.txt_in = TextProjection(config.context_in_dim, dim, config.eps)
        self.img_in = nn.Linear(config.in_channels, dim, bias=False)
        self.modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 4 * dim, bias=False))
        self.transformer_blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm_out = nn.Module()
        self.norm_out.linear = nn.Linear(dim, dim, bias=False)
        self.proj_out = nn.Linear(dim, config.output_channels, bias=False)
        self.block_functions = EAGER
        self.streamer: LayerStreamer | None = None  # set by place(): some blocks stream from host RAM
        self.host_copy: HostCopy | None = None  # the weights' pinned home off the GPU (memory/host_copy.py)
        self.weights_id: tuple = ()  # what is merged into the weights (a LoRA stack, lora/merge.py); () = as loaded

    def block_stack(self) -> nn.ModuleList:
        return self.transformer_blocks

    def compile_blocks(self, enabled: bool = True, mode: str | None = None):
        """Regional torch.compile of the block math around attention, for decode steps (opt-in).

        One compiled pair serves all blocks (weights are arguments). Not bit-identical to eager: inductor
        fuses the LayerNorm, modulation and SwiGLU elementwise work and rounds differently.
        """
        if not enabled:
            self.block_functions = EAGER
            return
        if self.block_functions is not EAGER:
            return  # already compiled: keep the compiled code (and its caches)
        self.block_functions = BlockFunctions(
            torch.compile(modulated_qkv, dynamic=False, mode=mode),
            torch.compile(attention_out_and_mlp, dynamic=False, mode=mode),
        )

    # ---- quantisation ------------------------------------------------------------------------------

    def gguf_plan(self, types: Mapping[str, str]) -> dict[tuple[int, str], tuple[tuple[int, str], ...]]:
        """(block, path in QUANTIZABLE) -> GGUF row segments ((rows, type), ...) for the block Linears a GGUF file
        stores in blocks; `types`: every diffusers weight name -> its GGUF type ("Q4_K", "BF16", ...). A Linear all
        of whose tensors are float stays a plain Linear."""
        inner, hidden = self.config.inner_dim, self.config.mlp_dim
        sources = {"attn.to_qkv": (("attn.to_q", inner), ("attn.to_k", inner), ("attn.to_v", inner)),
                   "attn.to_out": (("attn.to_out.0", inner),),
                   "img_mlp.gate_up": (("img_mlp.gate_layer", hidden), ("img_mlp.proj", hidden)),
                   "img_mlp.out": (("img_mlp.out", inner),)}  # fmt: skip
        plan = {}
        for index in range(len(self.transformer_blocks)):
            for path, parts in sources.items():
                segments = tuple((rows, types.get(f"transformer_blocks.{index}.{part}.weight", ""))
                                 for part, rows in parts)  # fmt: skip
                if any(qtype in GGUF_QUANTIZED for _, qtype in segments):
                    plan[(index, path)] = segments
        return plan

    def use_gguf_linears(self, plan: Mapping[tuple[int, str], tuple[tuple[int, str], ...]]) -> QwenImage21Transformer:
        """Replace block Linears (on the meta device, before loading) by GGUFLinears of the planned segments."""
        for (index, path), segments in plan.items():
            parent_name, _, name = path.rpartition(".")
            parent = self.transformer_blocks[index].get_submodule(parent_name)
            linear = getattr(parent, name)
            setattr(parent, name, GGUFLinear(linear.in_features, segments, compute_dtype=linear.weight.dtype))
        return self

    def shared_twin(self) -> QwenImage21Transformer:
        """A new transformer of the same config holding this one's very tensors (built on the meta device): its
        layers can then be swapped for other kinds without touching this one (benchmarks, tests)."""
        with torch.device("meta"):
            twin = QwenImage21Transformer(self.config)
        for module, source in zip(twin.modules(), self.modules(), strict=True):
            module._parameters = dict(source._parameters)
            module._buffers = dict(source._buffers)
            if hasattr(source, "_freqs"):
                module._freqs = source._freqs
        return twin

    def quantized_copy(self, plan: Mapping[tuple[int, str], QuantFormat]) -> QwenImage21Transformer:
        """A new transformer that shares this one's tensors, with the planned block Linears quantised from its
        weights (for benchmarks and tests: quantised and bf16 models side by side for a fraction of the memory)."""
        twin = self.shared_twin()
        for index, (block, source) in enumerate(zip(twin.transformer_blocks, self.transformer_blocks, strict=True)):
            for path, linear in source.linears().items():
                parent_name, _, child = path.rpartition(".")
                fmt = plan.get((index, path))
                layer = linear if fmt is None or isinstance(linear, QuantLinear) else None
                if layer is None:
                    layer = QuantLinear.from_weight(linear.weight.detach(), fmt)
                setattr(block.get_submodule(parent_name), child, layer)
        return twin.eval()

    # ---- checkpoints -------------------------------------------------------------------------------

    def checkpoint_slots(self) -> dict[str, torch.Tensor]:
        """Every key of a diffusers-layout checkpoint (297 for the released model) -> the tensor it fills.

        Fused weights hand out row slices: to_q/to_k/to_v of `to_qkv`, gate_layer/proj of `gate_up`.
        """
        slots = {}
        for name, param in self.named_parameters():
            if ".transformer_blocks." in f".{name}":
                continue
            slots[name] = param
        for i, block in enumerate(self.transformer_blocks):
            slots.update(block.checkpoint_slots(f"transformer_blocks.{i}."))
        return slots

    @torch.no_grad()
    def load_diffusers_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True):
        """Copy a diffusers-layout state dict in (names unchanged); errors list missing/unexpected keys."""
        slots = self.checkpoint_slots()
        missing = sorted(set(slots) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(slots))
        if strict and (missing or unexpected):
            raise ValueError(
                f"transformer state dict does not fit the config: {len(missing)} missing (e.g. {missing[:5]}), "
                f"{len(unexpected)} unexpected (e.g. {unexpected[:5]})"
            )
        for key, value in state_dict.items():
            slot = slots.get(key)
            if slot is None:
                continue
            if tuple(slot.shape) != tuple(value.shape):
                raise ValueError(f"transformer key {key}: checkpoint shape {tuple(value.shape)}, "
                                 f"model shape {tuple(slot.shape)}")  # fmt: skip
            if isinstance(slot, QuantSlot):
                slot.fill(value)
            else:
                slot.copy_(value)

    # ---- generation ------------------------------------------------------------------------------

    @property
    def compiled(self) -> bool:
        return self.block_functions is not EAGER

    @property
    def dtype(self) -> torch.dtype:
        return self.img_in.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.img_in.weight.device  # never streamed: where the model runs

    def new_branch_tables(self, layout: SequenceLayout, attention_backend: str = "auto") -> Branch:
        """The step-invariant tables of a branch (rotary cos/sin, masks), without a K/V cache.

        Normal (not inference-mode) tensors, so a graph entry can refresh them in place under any grad mode.
        """
        with torch.inference_mode(False):
            return self._branch_tables(layout, attention_backend)

    def _branch_tables(self, layout: SequenceLayout, attention_backend: str) -> Branch:
        device = self.device
        cos, sin = rotary_cos_sin(layout.positions, self.config.axes_dims_rope, device)
        p = layout.prefix_len
        prefix_key_valid = decode_key_mask = None
        if layout.key_valid is not None:
            prefix_key_valid = layout.key_valid.to(device)
            target_valid = torch.ones(layout.target_len, dtype=torch.bool)
            decode_key_mask = torch.cat([layout.key_valid, target_valid]).to(device)[None, None, None, :]
        return Branch(
            layout=layout,
            cache=None,
            prefix_cos=cos[:p],
            prefix_sin=sin[:p],
            target_cos=cos[p:],
            target_sin=sin[p:],
            prefix_masks=prefix_masks(layout.segments, layout.key_valid, device),
            prefix_key_valid=prefix_key_valid,
            decode_key_mask=decode_key_mask,
            attention_backend=attention_backend,
        )

    def new_branch(
        self, layout: SequenceLayout, batch: int = 1, attention_backend: str = "auto", kv: KVCacheSpec | None = None,
        shard=None, control=None,
    ) -> Branch:  # fmt: skip
        """Allocate the K/V cache (format, placement and layout from `kv`) and the step-invariant tables for one
        branch of a generation. shard: sequence parallel (the cache then holds the shard's heads only). control: a
        Fun-Control to run beside (anything with `net` and `strength`, control.py Control): its state and cache are
        allocated too; its context is set afterwards (`branch.control.set_context`)."""
        if control is not None and shard is not None:
            raise ValueError("a controlled branch runs on one device: sequence parallel is not supported with control")
        branch = self.new_branch_tables(layout, attention_backend)
        heads = None if shard is None else shard.heads
        branch.cache = PrefixKVCache(*self.cache_shape(layout, batch, heads), self.device, **vars(kv or KVCacheSpec()))
        branch.shard = shard
        if control is not None:
            branch.control = control.net.new_state(layout, batch, self.config.num_layers, control.strength, kv)
        return branch

    def cache_shape(self, layout: SequenceLayout, batch: int, heads: int | None = None) -> tuple:
        cfg = self.config
        return (cfg.num_layers, batch, layout.prefix_len, layout.target_len, heads or cfg.num_attention_heads,
                cfg.attention_head_dim, self.dtype)  # fmt: skip

    def _modulation(self, t: torch.Tensor):
        temb = self.time_text_embed.timestep_embedder(t.to(self.dtype))
        return temb, Modulation.from_params(self.modulation(temb))

    @torch.no_grad()
    def prefill(self, branch: Branch, prompt_embeds: torch.Tensor, condition_latents: torch.Tensor | None):
        """Run the prefix once and fill the branch's cache with every layer's K/V.

        prompt_embeds:      [L, context_dim] (one prompt, unpadded; image-slot rows are ignored).
        condition_latents:  [I, in_channels] packed condition tokens (all images, in order) or None.
        Sequence parallel (branch.shard set): every rank passes the same inputs; each fills its heads' K/V.
        """
        layout = branch.layout
        device, dtype = self.device, self.dtype
        text = prompt_embeds.to(device, dtype)[layout.text_source.to(device)]
        x = torch.empty(1, layout.prefix_len, self.config.inner_dim, device=device, dtype=dtype)
        x[0, layout.text_rows.to(device)] = self.txt_in(text)
        if layout.image_rows.numel():
            if condition_latents is None or condition_latents.shape[0] != layout.image_rows.numel():
                got = None if condition_latents is None else tuple(condition_latents.shape)
                raise ValueError(f"condition latents: expected [{layout.image_rows.numel()}, "
                                 f"{self.config.in_channels}] packed tokens, got {got}")  # fmt: skip
            x[0, layout.image_rows.to(device)] = self.img_in(condition_latents.to(device, dtype))
        if branch.shard is not None:
            x = branch.shard.prefix.rows(x)  # sequence parallel: this rank's rows from here on
        self.prefill_blocks(branch, x)
        branch.cache.filled = True

    def prefill_blocks(self, branch, x: torch.Tensor) -> None:
        """The blocks over the prefix rows x [1, P, D], each layer's K/V into `branch.cache` (see Block.prefill;
        `branch` may be a padded stand-in with the same attributes, dit/prefill_graphs.py). With control, the control
        stream's prefix rows run beside (their K/V into the control cache) and their skips reach x."""
        _, mod0 = self._modulation(torch.zeros(1, device=x.device))
        last = len(self.transformer_blocks) - 1
        control = getattr(branch, "control", None)
        # the stream's prefix rows start from x: before_proj of their zero context is its bias
        c = None if control is None else x + control.net.before_proj.bias
        blocks = control.net.stack_blocks() if control is not None else None
        with backend_context(branch.attention_backend, prefill=True):
            for i, block in self.stack_blocks():
                x = block.prefill(x, mod0, branch, i, last=i == last)
                if control is not None and i in control.inject:
                    k, control_block = next(blocks)  # control.inject lists the control blocks in order
                    # never "last": its skip feeds the base blocks after it
                    c = control_block.prefill(c, mod0, branch, k, last=False, cache=control.cache)
                    if x is not None:
                        x = control.add_skip(x, k, c)
        if control is not None:
            for _ in blocks:  # the streamer's hooks after the last control block
                pass
            control.cache.filled = True

    @torch.no_grad()
    def decode(self, branch: Branch, x: torch.Tensor, t: torch.Tensor, in_graph: bool = False) -> torch.Tensor:
        """Velocity for the target tokens. x: [B, N, in_channels]; t: [B] in [0, 1]. -> [B, N, out_channels].

        in_graph: the step is (being) captured into a CUDA graph, which changes the fused-kernel gate.
        Sequence parallel (branch.shard set): every rank passes the whole x, computes its rows and gets the whole
        velocity back (gathered).
        """
        if not branch.cache.filled:
            raise RuntimeError("decode called before prefill: the branch's prefix K/V cache is empty")
        temb, mod = self._modulation(t)
        split = None if branch.shard is None else branch.shard.target
        h = self.img_in((x if split is None else split.rows(x)).to(self.dtype))
        branch.cache.begin_step()
        control = branch.control
        ahead = False
        if control is not None:  # the control stream's target rows, beside the base's (see dit/control.py)
            control.cache.begin_step()
            ahead = control.runs_ahead(h, base_streams=self.streamer is not None)
            if not ahead:
                c = h + control.start
                blocks = control.net.stack_blocks()
        prefetch = step_prefetch(self, h)  # QWEN21_GGUF_PREFETCH: the next GGUF layer dequantised ahead
        step_device = h.device
        try:
            with backend_context(branch.attention_backend):
                fns = self.block_functions
                if ahead:
                    control.run_ahead(h, mod, branch, fns, in_graph, beside=h.is_cuda)
                for i, block in self.stack_blocks():
                    h = block.decode(h, mod, branch, i, fns, in_graph)
                    if control is not None and i in control.inject:
                        if ahead:
                            k = control.inject[i]
                            c = control.take(k)
                        else:
                            k, control_block = next(blocks)  # control.inject lists the control blocks in order
                            c = control_block.decode(c, mod, branch, k, fns, in_graph, cache=control.cache)
                        h = control.add_skip(h, k, c)
        finally:  # also after an error (out of memory): the side streams joined, nothing left pending
            if prefetch is not None:
                prefetch.close()
            if ahead:
                control.join(step_device)
        if control is not None and not ahead:
            for _ in blocks:  # the streamer's hooks after the last control block
                pass
        scale = self.norm_out.linear(F.silu(temb))[:, None, :]
        h = F.layer_norm(h, h.shape[-1:], eps=self.config.eps) * (1 + scale)
        out = self.proj_out(h)
        return out if split is None else split.gather_rows(out)
