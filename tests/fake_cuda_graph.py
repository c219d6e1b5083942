"""A CPU stand-in for CUDA-graph capture, for the decode-graph tests (DecodeGraphs(capture=RecordingCapture())).

A CUDA graph records kernels together with the addresses of the tensors they read and write, and a replay runs
exactly those kernels again on whatever those tensors hold by then: the Python code of the step does not run
again, so a tensor created or rebound after capture is never seen. `RecordingCapture` gives the CPU the same
semantics: it records every aten op of the captured call (through a TorchDispatchMode) with the very tensor
objects it read and wrote, and `RecordedGraph.replay()` runs those ops again, writing each result into the
tensor recorded as that op's output. "Replay equals eager" therefore holds only when the step reads nothing but
tensors that stay in place (weights, the branch's cache and tables, the static inputs), as on the GPU.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


class _OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            raise RuntimeError(f"the captured step reads a tensor value on the host ({func}); a CUDA graph cannot")
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


class RecordedGraph:
    """The ops of one captured call; replay() reruns them on the recorded tensors."""

    def __init__(self, ops):
        self.ops = ops
        self.replays = 0

    @torch.no_grad()  # kernels only, like a CUDA graph: no autograd
    def replay(self):
        for func, args, kwargs, out in self.ops:
            fresh = func(*args, **kwargs)
            for recorded, new in zip(tree_flatten(out)[0], tree_flatten(fresh)[0], strict=True):
                # in-place ops and views already wrote (or alias) the recorded tensor; others get copied in
                if isinstance(recorded, torch.Tensor) and not _same_memory(recorded, new):
                    recorded.copy_(new)
        self.replays += 1


class RecordingCapture:
    """The `capture` argument of DecodeGraphs: counts captures, can fail on purpose, records the ops."""

    def __init__(self, fail: BaseException | None = None):
        self.captures = 0
        self.fail = fail
        self.graphs: list[RecordedGraph] = []

    def __call__(self, decode, static_x, static_t):
        self.captures += 1
        if self.fail is not None:
            raise self.fail
        with _OpRecorder() as recorder:
            static_out = decode(static_x, static_t)
        graph = RecordedGraph(recorder.ops)
        self.graphs.append(graph)
        return graph, static_out
