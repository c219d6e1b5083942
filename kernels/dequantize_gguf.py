"""GGUF weight blocks -> a float weight: the torch reference of each block type (here) and the Triton kernel that
writes a layer's weight in the activation dtype right before its GEMM.

A GGUF tensor of a Linear weight [N, K] is stored row by row, each row K / block_size blocks of `type_size` bytes
(ggml's layouts, as llama.cpp's gguf-py reads them):
- Q8_0 (32 values, 34 bytes): fp16 d, 32 int8 q; x = d * q.
- Q4_0 (32, 18): fp16 d, 16 bytes of nibbles (low nibbles are values 0-15, high 16-31); x = d * (q - 8).
- Q4_1 (32, 20): fp16 d, fp16 m, nibbles; x = d * q + m.
- Q5_0 (32, 22): fp16 d, 32 high bits (one uint32, bit i for value i), nibbles; x = d * (q | h << 4) - 16 * d.
- Q5_1 (32, 24): fp16 d, fp16 m, the high bits, nibbles; x = d * (q | h << 4) + m.
- Q4_K (256, 144): fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32, 128 bytes of
  nibbles (each 32 bytes: a sub-block pair, low nibbles first); x = (d * sc) * q - dmin * m.
- Q5_K (256, 176): as Q4_K, with 32 bytes of high bits (bit j of byte l: value l of sub-block j) before the nibbles.
- Q6_K (256, 210): 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales (one per 16 values), fp16 d;
  x = (d * sc) * (q - 32).
- F32, F16, BF16: the values themselves.
The arithmetic is gguf-py's, in fp32 and in its order (products rounded before the subtraction: the kernel is
compiled without fused multiply-adds), so that the reference and the kernel give its bits exactly; the result is
rounded once to the asked dtype.

The kernels: one program per (row, BLOCK_COLS values of it); each value reads the bytes that hold its quant and its
block's scales (neighbouring values share them, from the cache), so a read of the weight's bytes and one write of
the result in the activation dtype is all the memory traffic. The row count is not specialised on. The 32-value types
index values in one flat range (`_dequantize_gguf_kernel`, which also holds the K-quants' first version, kept for
bench_gguf's comparison). The K-quants take whole super-blocks as a [super-block, sub-block, 32] tile instead:
each super-block's scales are decoded once for its sub-blocks, and a sub-block's quant bytes and output values are
contiguous along the tile's last axis, so they move as wide loads and stores where the flat range's divisions hid
that from the compiler and left one-byte gathers.
"""

from __future__ import annotations

import contextlib

import torch

from ._triton import INTERPRETER_ACTIVE, cdiv, jit, tl, triton_runs_on
from .launch import launch

# type name -> (values per block, bytes per block)
BLOCKS = {
    "Q8_0": (32, 34),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
    "F32": (1, 4),
    "F16": (1, 2),
    "BF16": (1, 2),
}
QUANTIZED = tuple(name for name, (size, _) in BLOCKS.items() if size > 1)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CODES = {name: index for index, name in enumerate(QUANTIZED)}  # the kernel's QTYPE constexpr
BLOCK_COLS = 1024
INTERPRETER_BLOCK_COLS = 512  # two K-quant super-blocks: a tile's masked tail is tested too
NUM_WARPS = 4


def row_bytes(qtype: str, columns: int) -> int:
    """Bytes of one row of `columns` values in `qtype`."""
    size, nbytes = BLOCKS[qtype]
    if columns % size:
        raise ValueError(f"a {qtype} row holds whole blocks of {size} values; {columns} is not a multiple")
    return columns // size * nbytes


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 (little-endian fp16) -> [...] fp32."""
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] uint8 -> [..., 2n]: the low nibbles, then the high ones."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins of a K-quant super-block from its 12 bytes [..., 12] -> ([..., 8], [..., 8])."""
    low, high, top = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([low & 63, (top & 0x0F) | ((low >> 6) << 4)], dim=-1)
    mn = torch.cat([high & 63, (top >> 4) | ((high >> 6) << 4)], dim=-1)
    return sc.float(), mn.float()


def dequantize_gguf_reference(data: torch.Tensor, qtype: str, columns: int,
                              dtype: torch.dtype = torch.float32) -> torch.Tensor:  # fmt: skip
    """Rows of GGUF blocks (uint8 [N, row_bytes]) -> [N, columns] in `dtype` (computed in fp32, rounded once)."""
    if qtype not in BLOCKS:
        raise ValueError(f"GGUF type {qtype!r} is not supported; supported: {', '.join(BLOCKS)}")
    dequantize_gguf_reference_check(data, qtype, columns)
    rows = data.shape[0]
    size, nbytes = BLOCKS[qtype]
    if size == 1:
        stored = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[qtype]
        return data.contiguous().view(stored).to(dtype)
    blocks = data.reshape(-1, nbytes)
    values = _BLOCK_MATH[qtype](blocks)
    return values.reshape(rows, columns).to(dtype)


def _q8_0(b):
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b[:, 0:2])[:, None]


def _q4_0(b):
    return _f16(b[:, 0:2])[:, None] * (_nibbles(b[:, 2:]).to(torch.int8) - 8).float()


def _q4_1(b):
    return _f16(b[:, 0:2])[:, None] * _nibbles(b[:, 4:]).float() + _f16(b[:, 2:4])[:, None]


def _high_bits_32(qh: torch.Tensor) -> torch.Tensor:
    """[B, 4] uint8 (a little-endian uint32) -> [B, 32]: bit i."""
    shifts = torch.arange(8, device=qh.device, dtype=torch.uint8)
    return ((qh[:, :, None] >> shifts) & 1).reshape(qh.shape[0], 32)


def _q5_0(b):
    q = _nibbles(b[:, 6:]) | (_high_bits_32(b[:, 2:6]) << 4)
    return _f16(b[:, 0:2])[:, None] * (q.to(torch.int8) - 16).float()


def _q5_1(b):
    q = _nibbles(b[:, 8:]) | (_high_bits_32(b[:, 4:8]) << 4)
    return _f16(b[:, 0:2])[:, None] * q.float() + _f16(b[:, 2:4])[:, None]


def _k_quant(b, qs, high=None):
    """Q4_K / Q5_K: qs [B, 128] nibbles (32 bytes per pair of sub-blocks), high [B, 32] or None."""
    sc, mn = _scale_min_k4(b[:, 4:16])
    d = _f16(b[:, 0:2])[:, None] * sc  # [B, 8]
    dm = _f16(b[:, 2:4])[:, None] * mn
    pairs = qs.reshape(-1, 4, 32)
    q = torch.stack([pairs & 0x0F, pairs >> 4], dim=2).reshape(-1, 8, 32)  # sub-block j: pair j // 2, low/high
    if high is not None:
        shifts = torch.arange(8, device=b.device, dtype=torch.uint8)
        q = q | (((high[:, None, :] >> shifts[None, :, None]) & 1) << 4)
    return (d[:, :, None] * q.float() - dm[:, :, None]).reshape(-1, 256)


def _q4_k(b):
    return _k_quant(b, b[:, 16:144])


def _q5_k(b):
    return _k_quant(b, b[:, 48:176], b[:, 16:48])


def _q6_k(b):
    ql, qh = b[:, 0:128].reshape(-1, 2, 64), b[:, 128:192].reshape(-1, 2, 32)
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(b[:, 208:210])[:, None] * scales).reshape(-1, 16, 1)
    low = torch.stack([ql & 0x0F, ql >> 4], dim=2).reshape(-1, 2, 4, 32)  # per half: [l0 | l1 | h0 | h1] of 32
    shifts = torch.tensor([0, 2, 4, 6], device=b.device, dtype=torch.uint8)
    hi = (qh[:, :, None, :] >> shifts[None, None, :, None]) & 3  # [B, 2, 4, 32]
    q = ((low | (hi << 4)).to(torch.int8) - 32).float().reshape(-1, 16, 16)
    return (d * q).reshape(-1, 256)


_BLOCK_MATH = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q4_K": _q4_k,
               "Q5_K": _q5_k, "Q6_K": _q6_k}  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# The kernel
# ---------------------------------------------------------------------------------------------------------


@jit
def _f16_at(ptr):
    """The little-endian fp16 at byte pointer(s) `ptr`, as fp32."""
    bits = tl.load(ptr).to(tl.uint16) | (tl.load(ptr + 1).to(tl.uint16) << 8)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@jit(do_not_specialize=("N",))
def _dequantize_gguf_kernel(q_ptr, out_ptr, N, K, ROW_BYTES, QTYPE: tl.constexpr, SIZE: tl.constexpr,
                            TYPE_SIZE: tl.constexpr, BLOCK_COLS: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = cols < K
    cols = tl.where(mask, cols, 0)  # masked lanes read the row's first block (never stored)
    j = cols % SIZE
    p = q_ptr + row * ROW_BYTES + (cols // SIZE) * TYPE_SIZE  # each value's block
    if QTYPE == 0:  # Q8_0
        x = tl.load(p + 2 + j).to(tl.int8, bitcast=True).to(tl.float32) * _f16_at(p)
    elif QTYPE == 1:  # Q4_0
        nib = (tl.load(p + 2 + j % 16) >> (4 * (j // 16)).to(tl.uint8)) & 0x0F
        x = _f16_at(p) * (nib.to(tl.int8) - 8).to(tl.float32)
    elif QTYPE == 2:  # Q4_1
        nib = (tl.load(p + 4 + j % 16) >> (4 * (j // 16)).to(tl.uint8)) & 0x0F
        x = _f16_at(p) * nib.to(tl.float32) + _f16_at(p + 2)
    elif QTYPE == 3:  # Q5_0
        high = (tl.load(p + 2 + j // 8) >> (j % 8).to(tl.uint8)) & 1
        nib = (tl.load(p + 6 + j % 16) >> (4 * (j // 16)).to(tl.uint8)) & 0x0F
        x = _f16_at(p) * ((nib | (high << 4)).to(tl.int8) - 16).to(tl.float32)
    elif QTYPE == 4:  # Q5_1
        high = (tl.load(p + 4 + j // 8) >> (j % 8).to(tl.uint8)) & 1
        nib = (tl.load(p + 8 + j % 16) >> (4 * (j // 16)).to(tl.uint8)) & 0x0F
        x = _f16_at(p) * (nib | (high << 4)).to(tl.float32) + _f16_at(p + 2)
    elif QTYPE == 5 or QTYPE == 6:  # Q4_K, Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins
        sub = j // 32
        lane = j % 32
        first = sub < 4
        at_sub = tl.load(p + 4 + sub)  # scales[sub] (a scale for sub < 4)
        at_next = tl.load(p + 8 + sub % 4)  # scales[sub + 4]: a min for sub < 4, the low bits for sub >= 4
        at_back = tl.load(p + 4 + sub % 4)  # scales[sub - 4] for sub >= 4
        sc = tl.where(first, at_sub & 63, (tl.load(p + 8 + sub) & 0x0F) | ((at_back >> 6) << 4))
        mn = tl.where(first, at_next & 63, (tl.load(p + 8 + sub) >> 4) | ((at_sub >> 6) << 4))
        d = _f16_at(p) * sc.to(tl.float32)
        dm = _f16_at(p + 2) * mn.to(tl.float32)
        qs = 16 if QTYPE == 5 else 48
        q = (tl.load(p + qs + (sub // 2) * 32 + lane) >> (4 * (sub % 2)).to(tl.uint8)) & 0x0F
        if QTYPE == 6:
            q = q | (((tl.load(p + 16 + lane) >> sub.to(tl.uint8)) & 1) << 4)
        x = d * q.to(tl.float32) - dm
    else:  # Q6_K
        half = j // 128
        group = (j % 128) // 32
        lane = j % 32
        low = (tl.load(p + half * 64 + (group % 2) * 32 + lane) >> (4 * (group // 2)).to(tl.uint8)) & 0x0F
        high = (tl.load(p + 128 + half * 32 + lane) >> (2 * group).to(tl.uint8)) & 3
        scale = tl.load(p + 192 + j // 16).to(tl.int8, bitcast=True).to(tl.float32)
        x = (_f16_at(p + 208) * scale) * ((low | (high << 4)).to(tl.int8) - 32).to(tl.float32)
    tl.store(out_ptr + row * K + cols, x.to(out_ptr.dtype.element_ty), mask=mask)


@jit(do_not_specialize=("N",))
def _dequantize_k_quant_kernel(q_ptr, out_ptr, N, K, ROW_BYTES, QTYPE: tl.constexpr, TYPE_SIZE: tl.constexpr,
                               SUPER_BLOCKS: tl.constexpr):  # fmt: skip
    """Q4_K, Q5_K, Q6_K: SUPER_BLOCKS super-blocks of 256 values of one row, as an [SUPER_BLOCKS, 8, 32] tile (Q4_K
    and Q5_K: sub-block, value; Q6_K: group of 32 values, value); the arithmetic and its order are the flat kernel's
    were, so the bits are gguf's."""
    row = tl.program_id(0).to(tl.int64)
    blocks = tl.program_id(1) * SUPER_BLOCKS + tl.arange(0, SUPER_BLOCKS)
    valid = blocks < K // 256
    blocks = tl.where(valid, blocks, 0)  # masked super-blocks read the row's first (never stored)
    p = q_ptr + row * ROW_BYTES + blocks * TYPE_SIZE  # [S] each super-block's bytes
    sub = tl.arange(0, 8)
    lane = tl.arange(0, 32)
    p3 = p[:, None, None]
    sub3 = sub[None, :, None]
    lane3 = lane[None, None, :]
    if QTYPE == 5 or QTYPE == 6:  # Q4_K, Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins
        ps = p[:, None] + 4  # [S, 1] the 12 bytes of scales and mins
        first = sub[None, :] < 4
        at_sub = tl.load(ps + sub[None, :])  # scales[sub] (a scale for sub < 4)
        at_next = tl.load(ps + 4 + sub[None, :] % 4)  # scales[sub + 4]: a min for sub < 4, the low bits for sub >= 4
        at_back = tl.load(ps + sub[None, :] % 4)  # scales[sub - 4] for sub >= 4
        at_top = tl.load(ps + 4 + sub[None, :])  # scales[sub + 4] for sub >= 4 (bytes 8 to 11)
        sc = tl.where(first, at_sub & 63, (at_top & 0x0F) | ((at_back >> 6) << 4))
        mn = tl.where(first, at_next & 63, (at_top >> 4) | ((at_sub >> 6) << 4))
        d = _f16_at(p)[:, None] * sc.to(tl.float32)  # [S, 8]
        dm = _f16_at(p + 2)[:, None] * mn.to(tl.float32)
        qs = 16 if QTYPE == 5 else 48
        q = (tl.load(p3 + qs + (sub3 // 2) * 32 + lane3) >> (4 * (sub3 % 2)).to(tl.uint8)) & 0x0F
        if QTYPE == 6:
            q = q | (((tl.load(p3 + 16 + lane3) >> sub3.to(tl.uint8)) & 1) << 4)
        x = d[:, :, None] * q.to(tl.float32) - dm[:, :, None]
    else:  # Q6_K: group g of 32 values: half g // 4, group g % 4 of that half
        half = sub3 // 4
        group = sub3 % 4
        low = (tl.load(p3 + half * 64 + (group % 2) * 32 + lane3) >> (4 * (group // 2)).to(tl.uint8)) & 0x0F
        high = (tl.load(p3 + 128 + half * 32 + lane3) >> (2 * group).to(tl.uint8)) & 3
        scale = tl.load(p3 + 192 + sub3 * 2 + lane3 // 16).to(tl.int8, bitcast=True).to(tl.float32)
        x = (_f16_at(p + 208)[:, None, None] * scale) * ((low | (high << 4)).to(tl.int8) - 32).to(tl.float32)
    cols = blocks[:, None, None] * 256 + sub3 * 32 + lane3
    tl.store(out_ptr + row * K + cols, x.to(out_ptr.dtype.element_ty), mask=valid[:, None, None])


def _launch(data: torch.Tensor, qtype: str, out: torch.Tensor, tiled: bool = True) -> torch.Tensor:
    n, k = out.shape
    size, nbytes = BLOCKS[qtype]
    block_cols = INTERPRETER_BLOCK_COLS if INTERPRETER_ACTIVE else BLOCK_COLS
    elsewhere = data.is_cuda and data.device.index != torch.cuda.current_device()  # Triton launches on the current
    with torch.cuda.device(data.device) if elsewhere else contextlib.nullcontext():
        if size == 256 and tiled:
            blocks = block_cols // 256
            launch(_dequantize_k_quant_kernel, (n, cdiv(k // 256, blocks)), data, out, n, k, data.shape[1],
                   QTYPE=CODES[qtype], TYPE_SIZE=nbytes, SUPER_BLOCKS=blocks, num_warps=NUM_WARPS,
                   enable_fp_fusion=False)  # fmt: skip
        else:
            launch(_dequantize_gguf_kernel, (n, cdiv(k, block_cols)), data, out, n, k, data.shape[1],
                   QTYPE=CODES[qtype], SIZE=size, TYPE_SIZE=nbytes, BLOCK_COLS=block_cols, num_warps=NUM_WARPS,
                   enable_fp_fusion=False)  # fmt: skip
    return out


def dequantize_gguf(data: torch.Tensor, qtype: str, columns: int, dtype: torch.dtype = torch.bfloat16,
                    out: torch.Tensor | None = None, tiled: bool = True) -> torch.Tensor:  # fmt: skip
    """`dequantize_gguf_reference`, written into `out` ([N, columns] contiguous, `dtype`) or a new tensor: the Triton
    kernel where Triton runs on the data's device (a quantised type), else the reference. Bit-identical either way.
    tiled=False: the K-quants through the flat kernel (their first version, for bench_gguf's comparison)."""
    if dtype not in OUT_DTYPES:
        raise ValueError(f"dequantize_gguf: dtype must be one of {OUT_DTYPES}, got {dtype}")
    expected = (data.shape[0] if data.dim() == 2 else -1, columns)
    if out is not None and (tuple(out.shape) != expected or out.dtype != dtype or out.device != data.device
                            or not out.is_contiguous()):  # fmt: skip
        raise ValueError(f"dequantize_gguf: out must be a contiguous {dtype} {list(expected)} on {data.device}, got "
                         f"{out.dtype} {list(out.shape)} on {out.device}")  # fmt: skip
    if qtype not in QUANTIZED or not triton_runs_on(data.device) or data.numel() == 0:
        result = dequantize_gguf_reference(data, qtype, columns, dtype)
        return result if out is None else out.copy_(result)
    dequantize_gguf_reference_check(data, qtype, columns)
    if out is None:
        out = torch.empty(expected, dtype=dtype, device=data.device)
    return _launch(data.contiguous(), qtype, out, tiled)


def dequantize_gguf_reference_check(data: torch.Tensor, qtype: str, columns: int) -> None:
    """The shape and dtype rules of `dequantize_gguf_reference`, without computing anything."""
    if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != row_bytes(qtype, columns):
        raise ValueError(f"{qtype} rows of {columns} values are uint8 [N, {row_bytes(qtype, columns)}], got "
                         f"{data.dtype} {list(data.shape)}")  # fmt: skip
