"""A PNG writer that uses every core: the pixels are cut into bands of rows, each band is filtered and deflated
in a thread of its own, and the bands' streams are joined into one zlib stream.

Why: ComfyUI's SaveImage writes through PIL on one core, the largest cost of a turbo image after sampling
(benchmarks/bench_save_png.py measures both writers). zlib and numpy release the GIL, so the bands run in parallel.

The file is standard PNG (8 bits per channel, no interlace): each band's deflate stream ends on a byte boundary
with a sync flush (an empty stored block, not the final one) except the last, so the concatenation is one valid
deflate stream; its Adler-32 is combined from the bands' checksums. Every row uses the Paeth filter, computed
from the raw pixels (vectorised per band): on photographs it is the filter PNG encoders pick for most rows, and
one filter for all rows costs a fraction of trying all five per row. Bands restart deflate's dictionary, which
costs a few hundred bytes per band.
"""

from __future__ import annotations

import os
import struct
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
COLOR_TYPES = {1: 0, 2: 4, 3: 2, 4: 6}  # channels -> PNG colour type (grey, grey+alpha, RGB, RGBA)
PAETH = 4  # the PNG filter-type byte
ADLER_MODULUS = 65521
MIN_BAND_BYTES = 128 * 1024  # below this a band's thread costs more than it saves
MAX_WORKERS = 16

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_workers() -> int:
    return min(MAX_WORKERS, usable_cores())


def _thread_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=default_workers(), thread_name_prefix="qwen21-png")
        return _pool


def adler32_concat(first: int, second: int, second_length: int) -> int:
    """The Adler-32 of A + B from adler32(A), adler32(B) and len(B).

    With a = 1 + the sum of the bytes and b = the sum of every prefix's a: appending B adds B's byte sum to a, and
    to b its own b plus (a(A) - 1) once for each of B's bytes."""
    a1, b1 = first & 0xFFFF, first >> 16
    a2, b2 = second & 0xFFFF, second >> 16
    a = (a1 + a2 - 1) % ADLER_MODULUS
    b = (b1 + b2 + second_length * (a1 - 1)) % ADLER_MODULUS
    return (b << 16) | a


def paeth_filtered(rows: np.ndarray, row_above: np.ndarray | None) -> np.ndarray:
    """[n, W, C] uint8 rows -> [n, 1 + W*C] uint8: each row's filter byte and Paeth residuals.

    `row_above` is the image row before the band ([W, C]), None for the image's first row (PNG treats it as
    zeros)."""
    x = rows.astype(np.int16)
    up = np.empty_like(x)
    up[0] = 0 if row_above is None else row_above
    up[1:] = x[:-1]
    left = np.zeros_like(x)
    left[:, 1:] = x[:, :-1]
    up_left = np.zeros_like(x)
    up_left[:, 1:] = up[:, :-1]
    # distances of left + up - up_left to each neighbour; ties prefer left, then up (the PNG specification's order)
    to_left, to_up, to_up_left = np.abs(up - up_left), np.abs(left - up_left), np.abs(left + up - 2 * up_left)
    predictor = np.where((to_left <= to_up) & (to_left <= to_up_left), left, np.where(to_up <= to_up_left, up, up_left))
    out = np.empty((x.shape[0], 1 + x.shape[1] * x.shape[2]), np.uint8)
    out[:, 0] = PAETH
    out[:, 1:] = (x - predictor).astype(np.uint8).reshape(x.shape[0], -1)  # residuals mod 256
    return out


def _deflate_band(pixels: np.ndarray, start: int, stop: int, level: int) -> tuple[bytes, int, int]:
    """One band's raw deflate stream (ending in a sync flush unless it is the image's last), Adler-32 and length."""
    data = paeth_filtered(pixels[start:stop], pixels[start - 1] if start else None)
    compressor = zlib.compressobj(level, zlib.DEFLATED, -15)  # raw deflate: the zlib wrapper is written once
    stream = compressor.compress(data) + compressor.flush(zlib.Z_FINISH if stop == len(pixels) else zlib.Z_SYNC_FLUSH)
    return stream, zlib.adler32(data), data.nbytes


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(body, zlib.crc32(kind)))


def _text_chunk(keyword: str, text: str) -> bytes:
    if not 1 <= len(keyword) <= 79 or "\0" in keyword:
        raise ValueError(f"PNG text keyword {keyword!r} must be 1 to 79 characters without NUL")
    key = keyword.encode("latin-1")
    try:
        return _chunk(b"tEXt", key + b"\0" + text.encode("latin-1"))
    except UnicodeEncodeError:  # international text: uncompressed iTXt, no language tag
        return _chunk(b"iTXt", key + b"\0\0\0\0\0" + text.encode("utf-8"))


def _zlib_header(level: int) -> bytes:
    method = 0x78  # deflate with a 32 KiB window
    flags = (0 if level <= 1 else 1 if level <= 5 else 2 if level == 6 else 3) << 6  # informative only
    flags += (31 - (method * 256 + flags) % 31) % 31  # the header, read as 16 bits, is a multiple of 31
    return bytes((method, flags))


def encode_png(
    pixels: np.ndarray, text: dict[str, str] | None = None, level: int = 4, workers: int | None = None
) -> bytes:
    """PNG bytes of `pixels`, uint8 [H, W, C] with C 1 (grey), 2 (grey + alpha), 3 (RGB) or 4 (RGBA).

    `text`: keyword -> text chunks (ComfyUI's prompt and workflow), written before the pixels as PIL does. `level`:
    zlib's compression level. `workers`: bands to deflate at once (default: the usable cores, at most 16)."""
    if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] not in COLOR_TYPES:
        raise ValueError(f"PNG pixels must be uint8 [H, W, C] with C in 1-4, got {pixels.dtype} {tuple(pixels.shape)}")
    height, width, channels = pixels.shape
    if height == 0 or width == 0:
        raise ValueError(f"PNG pixels must have at least one row and column, got {height}x{width}")
    if not 0 <= level <= 9:
        raise ValueError(f"PNG compression level must be 0 to 9, got {level}")
    pixels = np.ascontiguousarray(pixels)
    workers = workers or default_workers()
    bands = max(1, min(workers, height, pixels.nbytes // MIN_BAND_BYTES))
    rows = -(-height // bands)
    starts = range(0, height, rows)
    if len(starts) == 1:
        pieces = [_deflate_band(pixels, 0, height, level)]
    else:
        pool = _thread_pool()
        jobs = [pool.submit(_deflate_band, pixels, start, min(start + rows, height), level) for start in starts]
        pieces = [job.result() for job in jobs]
    checksum = 1  # Adler-32 of nothing
    for _stream, band_checksum, length in pieces:
        checksum = adler32_concat(checksum, band_checksum, length)
    idat = b"".join([_zlib_header(level), *(stream for stream, _, _ in pieces), struct.pack(">I", checksum)])
    header = struct.pack(">IIBBBBB", width, height, 8, COLOR_TYPES[channels], 0, 0, 0)
    texts = [_text_chunk(k, v) for k, v in (text or {}).items()]
    return b"".join([PNG_SIGNATURE, _chunk(b"IHDR", header), *texts, _chunk(b"IDAT", idat), _chunk(b"IEND", b"")])


def write_png(path: str | os.PathLike, pixels: np.ndarray, text: dict[str, str] | None = None, level: int = 4) -> None:
    """encode_png to a file."""
    data = encode_png(pixels, text, level)
    with open(path, "wb") as handle:
        handle.write(data)
