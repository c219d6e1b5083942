"""Just-in-time dequantisation of a weight-only layer's weight: one read of q, one write of the result.

    w = dequantize_weight_fast(q, scale, torch.bfloat16)      # q [N, K] fp8 e4m3 / int8, scale [N] fp32 -> w [N, K]
    w = dequantize_for_linear(q, scale, torch.bfloat16)       # the same, never waiting for a compile (see below)

Numerics: w = q * scale[row] in fp32, rounded once to the output dtype: the torch expression
`(q.float() * scale[:, None]).to(dtype)` (`dequantize_weight_reference`), bit for bit. That expression runs three
kernels and moves about 19 bytes per element (the fp32 product written and read twice); the kernel moves 3 (fp8/int8
in, bf16 out) before F.linear reads the result.

Launch shape: 2-D tiles of BLOCK_ROWS rows x BLOCK_COLS columns, tails masked. The row count is not specialised on
(a new layer shape compiles nothing); the row width K is, on Triton's "multiple of 16" class, which tells the
compiler every row starts 16-byte aligned, so it reads 16 fp8 values per instruction. Every real layer's K is a
multiple of 16; other widths run right, in their own compiled variant (which the gate below leaves to torch).

The gate (`dequantize_for_linear`, used by QuantLinear's weight-only path): the kernel serves a (device, storage
dtype, output dtype) once it is `ready` there, and torch's expression (same bits) until then, so no encode waits for
the compile. The background warm-up (qwen21_core/quant/kernel_warmup.py) marks its keys pending when it is queued
and `warm_up` makes them ready after a compile, a launch and a bit-for-bit check against torch. A key nobody warms
up (QWEN21_KERNEL_WARMUP=0, tests, benchmarks) compiles on its first call, synchronously, and is ready after it.
A failed compile, launch or check is logged once and keeps torch's expression for that key.

When it serves: at every row count. Moving far fewer bytes than torch's expression (above) made the encode faster
for a short text prompt as well as for long image-conditioned ones (`benchmarks/bench_text_encoder.py --dequant`
measures it). Before kernels/launch.py's direct launch, a short encode was bound by the host's launches and the kernel
lost there; it then served only from a few hundred rows.
"""

from __future__ import annotations

import contextlib
import logging
import threading

import torch

from ._triton import INTERPRETER_ACTIVE, _device_key, cdiv, jit, same_bits, tl, triton_runs_on
from .launch import launch

log = logging.getLogger(__name__)

STORAGE_DTYPES = (torch.float8_e4m3fn, torch.int8)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BLOCK_ROWS = 4
BLOCK_COLS = 1024  # x 4 rows over 4 warps: 32 values per thread, two 16-byte fp8 loads
NUM_WARPS = 4
INTERPRETER_BLOCK_COLS = 64  # small tiles under the interpreter, so the tests' odd shapes cross tile edges
ALIGNMENT = 16  # bytes: the pointer class Triton specialises on, and the K class the warm-up compiles
WARMUP_SHAPE = (8, 544)  # K a multiple of 16, as every real layer's, and not of the tile: the masks compile too


# ---------------------------------------------------------------------------------------------------------
# Reference and kernel
# ---------------------------------------------------------------------------------------------------------


def dequantize_weight_reference(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """torch's expression: q * scale per row in fp32 (a bf16 scale would err 0.2%), rounded once to `dtype`."""
    result = (q.float() * scale[:, None]).to(dtype)
    return result if out is None else out.copy_(result)


@jit(do_not_specialize=("N",))  # layers of every height share one compile (see _triton.jit)
def _dequantize_weight_kernel(q_ptr, scale_ptr, out_ptr, N, K, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (rows < N)[:, None] & (cols < K)[None, :]
    offsets = rows[:, None] * K + cols[None, :]
    q = tl.load(q_ptr + offsets, mask=mask).to(tl.float32)  # masked lanes are never stored
    scale = tl.load(scale_ptr + rows, mask=rows < N, other=0.0)
    tl.store(out_ptr + offsets, (q * scale[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    block_cols = INTERPRETER_BLOCK_COLS if INTERPRETER_ACTIVE else BLOCK_COLS
    grid = (cdiv(n, BLOCK_ROWS), cdiv(k, block_cols))
    # Triton launches on the current device: a layer on another GPU (a text encoder of its own) needs its own
    guard = torch.cuda.device(q.device) if q.is_cuda and q.device.index != torch.cuda.current_device() else None
    with guard or contextlib.nullcontext():
        launch(_dequantize_weight_kernel, grid, q, scale, out, n, k, BLOCK_ROWS=BLOCK_ROWS, BLOCK_COLS=block_cols,
               num_warps=NUM_WARPS)  # fmt: skip
    return out


def _check(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None) -> None:
    if not isinstance(q, torch.Tensor) or q.dim() != 2 or q.dtype not in STORAGE_DTYPES or not q.is_contiguous():
        described = f"{q.dtype} {tuple(q.shape)}" if isinstance(q, torch.Tensor) else type(q).__name__
        contiguous = "" if not isinstance(q, torch.Tensor) or q.is_contiguous() else " (not contiguous)"
        raise ValueError(f"dequantize_weight: q must be a contiguous 2-D tensor of {STORAGE_DTYPES}, got "
                         f"{described}{contiguous}")  # fmt: skip
    n, k = q.shape
    if not isinstance(scale, torch.Tensor) or scale.shape != (n,) or scale.dtype != torch.float32:
        got = f"{scale.dtype} {tuple(scale.shape)}" if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise ValueError(f"dequantize_weight: scale must be float32 [{n}] (one per row of q), got {got}")
    if scale.device != q.device or not scale.is_contiguous():
        raise ValueError(f"dequantize_weight: scale must be contiguous and on q's device {q.device}, got "
                         f"{scale.device}")  # fmt: skip
    if dtype not in OUT_DTYPES:
        raise ValueError(f"dequantize_weight: dtype must be one of {OUT_DTYPES}, got {dtype}")
    if out is not None and (out.shape != q.shape or out.dtype != dtype or out.device != q.device
                            or not out.is_contiguous()):  # fmt: skip
        raise ValueError(f"dequantize_weight: out must be a contiguous {dtype} [{n}, {k}] on {q.device}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")  # fmt: skip


def dequantize_weight_fast(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """q [N, K] (float8_e4m3fn or int8, contiguous) times scale [N] (fp32) per row, in `dtype` (bf16, fp16 or
    fp32), written into `out` ([N, K] contiguous, `dtype`) or a new tensor. The Triton kernel where Triton runs on q's
    device, else the reference; bit-identical either way. Compiles on the first call for a dtype pair."""
    _check(q, scale, dtype, out)
    if out is None:
        out = torch.empty(q.shape, dtype=dtype, device=q.device)
    if not triton_runs_on(q.device) or q.numel() == 0:
        return dequantize_weight_reference(q, scale, dtype, out)
    return _launch(q, scale, out)


# ---------------------------------------------------------------------------------------------------------
# The gate: the kernel only where it is compiled (or nobody is compiling it in the background)
# ---------------------------------------------------------------------------------------------------------

_PENDING, _READY, _FAILED = "pending", "ready", "failed"
_states: dict[tuple[str, torch.dtype, torch.dtype], str] = {}
_forced: dict[tuple[str, torch.dtype, torch.dtype], bool] = {}  # forced(): serve (True) or not, whatever the rest
_lock = threading.Lock()


def _key(device, q_dtype: torch.dtype, out_dtype: torch.dtype) -> tuple[str, torch.dtype, torch.dtype]:
    return _device_key(device), q_dtype, out_dtype


def ready(device, q_dtype: torch.dtype, out_dtype: torch.dtype) -> bool:
    """Whether the kernel is compiled and checked for (device, storage dtype, output dtype), or forced on."""
    key = _key(device, q_dtype, out_dtype)
    return _forced.get(key, _states.get(key) == _READY)


def expect_warm_up(device, q_dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    """A warm-up job for this key is queued: torch's expression serves until `warm_up` has run."""
    with _lock:
        _states.setdefault(_key(device, q_dtype, out_dtype), _PENDING)


def _settle(key, ok: bool, reason: str = "") -> None:
    with _lock:
        was = _states.get(key)
        _states[key] = _READY if ok else _FAILED
    if not ok and was != _FAILED:
        log.warning("dequantize_weight: the kernel cannot serve %s %s -> %s (%s); torch's expression does", *key,
                    reason)  # fmt: skip


def warm_up(device, q_dtype: torch.dtype, out_dtype: torch.dtype) -> bool:
    """Compile the kernel for this key (a launch on a small weight whose K is a multiple of 16, the variant every
    real layer uses) and check its bits against torch's; the gate opens only if they match. Never raises."""
    key = _key(device, q_dtype, out_dtype)
    device = torch.device(key[0])
    try:
        gen = torch.Generator().manual_seed(0)
        values = torch.randn(WARMUP_SHAPE, generator=gen) * 100
        q = (values.round().clamp(-128, 127) if q_dtype == torch.int8 else values.clamp(-448, 448)).to(q_dtype)
        q, scale = q.to(device), (torch.rand(WARMUP_SHAPE[0], generator=gen) * 1e-2).to(device)
        with torch.no_grad():
            got = _launch(q, scale, torch.empty(WARMUP_SHAPE, dtype=out_dtype, device=device))
            ok = same_bits(got, dequantize_weight_reference(q, scale, out_dtype))
        _settle(key, ok, "" if ok else "its result differs from torch's")
        return ok
    except Exception as error:  # noqa: BLE001 - a compile or launch failure keeps torch's expression
        _settle(key, False, f"{type(error).__name__}: {error}")
        return False


def _serves(q: torch.Tensor, out_dtype: torch.dtype) -> bool:
    if not triton_runs_on(q.device) or q.dtype not in STORAGE_DTYPES or out_dtype not in OUT_DTYPES:
        return False
    if q.dim() != 2 or q.shape[1] % ALIGNMENT or q.data_ptr() % ALIGNMENT or not q.is_contiguous():
        return False  # another compiled variant than the warm-up's (or no kernel at all): not worth a compile
    key = _key(q.device, q.dtype, out_dtype)
    if key in _forced:
        return _forced[key]
    state = _states.get(key)
    if state is None:  # nobody warms this key up: compile now, unless a CUDA graph is being captured
        return not (q.is_cuda and torch.cuda.is_current_stream_capturing())
    return state == _READY


def dequantize_for_linear(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`dequantize_weight_fast(q, scale, dtype)` where the kernel is ready for (q's device, q's dtype, dtype), torch's
    expression elsewhere (a key being warmed up, one that failed, CPU): the same bits, never a
    wait."""
    if not _serves(q, dtype) or scale.dtype != torch.float32 or scale.data_ptr() % ALIGNMENT or q.numel() == 0:
        return dequantize_weight_reference(q, scale, dtype)
    key = _key(q.device, q.dtype, dtype)
    if ready(q.device, q.dtype, dtype):
        return dequantize_weight_fast(q, scale, dtype)
    try:  # the first call of a key nobody warms up
        out = dequantize_weight_fast(q, scale, dtype)
    except Exception as error:  # noqa: BLE001 - a compile or launch failure keeps torch's expression
        _settle(key, False, f"{type(error).__name__}: {error}")
        return dequantize_weight_reference(q, scale, dtype)
    _settle(key, True)
    return out


@contextlib.contextmanager
def forced(device, q_dtype: torch.dtype, out_dtype: torch.dtype, use_kernel: bool):
    """For benchmarks and tests: the gate open (kernel) or shut (torch's expression) for this key meanwhile."""
    key = _key(device, q_dtype, out_dtype)
    with _lock:
        saved = _forced.get(key)
        _forced[key] = use_kernel  # also where the kernel is not enabled: the benchmark compares both
    try:
        yield
    finally:
        with _lock:
            _forced.pop(key)
            if saved is not None:
                _forced[key] = saved


def clear() -> None:
    """Forget every key's state (tests)."""
    with _lock:
        _states.clear()
        _forced.clear()
