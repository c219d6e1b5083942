"""One side stream per device and purpose, kept for the life of the process.

Work that must not queue behind (or hold up) the compute stream runs on a side stream: the start-up's priming and
kernel warm-up jobs (from background threads) and the runs before a CUDA-graph capture (dit/decode_graphs.py). Each
purpose gets one stream per device and keeps it: a stream that runs a GEMM gets a cuBLAS workspace that lives as long
as the process, so a new stream per job or per capture left memory behind every time. Purposes do not share one, so
a capture's runs never wait for the warm-up's queued work.
"""

from __future__ import annotations

import threading

import torch

STARTUP = "start-up"  # priming and kernel warm-up jobs
CAPTURE = "capture"  # the runs before a CUDA-graph capture

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
            stream = _streams[(purpose, index)] = torch.cuda.Stream(index)
        return stream
