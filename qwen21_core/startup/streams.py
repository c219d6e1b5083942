"""One side stream per device and purpose, kept for the life of the process.

Work that must not queue behind (or hold up) the compute stream runs on a side stream: the start-up's priming and
kernel warm-up jobs (from background threads), the runs before a CUDA-graph capture (dit/decode_graphs.py), and work a
step runs beside its own (the Fun-Control blocks run ahead, dit/control.py; the next GGUF layer dequantised,
quant/gguf_prefetch.py). Each
purpose gets one stream per device and keeps it: a stream that runs a GEMM gets a cuBLAS workspace that lives as long
as the process, so a new stream per job or per capture left memory behind every time. Purposes do not share one, so
a capture's runs never wait for the warm-up's queued work. The streams a step waits for run at the highest priority.
"""

from __future__ import annotations

import threading

import torch

STARTUP = "start-up"  # priming and kernel warm-up jobs
CAPTURE = "capture"  # the runs before a CUDA-graph capture
CONTROL = "control"  # the Fun-Control blocks run ahead of the DiT's (QWEN21_CONTROL_STREAM)
GGUF = "gguf"  # the next GGUF layer dequantised while the current one multiplies (QWEN21_GGUF_PREFETCH)
_HIGH_PRIORITY = (CONTROL, GGUF)  # the compute stream waits for their work

_streams: dict[tuple[str, int], torch.cuda.Stream] = {}
_lock = threading.Lock()


def side_stream(device: torch.device, purpose: str) -> torch.cuda.Stream | None:
    """The side stream of `purpose` on `device` (None off CUDA); made at the first ask, from any thread."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        stream = _streams.get((purpose, index))
        if stream is None:
            priority = -1 if purpose in _HIGH_PRIORITY else 0  # torch clamps to the device's range
            stream = _streams[(purpose, index)] = torch.cuda.Stream(index, priority=priority)
        return stream
