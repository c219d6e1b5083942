"""The kernel warm-up of one loaded model: which parts run in which order, and what a run waits for.

`start(pipe)` builds the parts from each model's own job builders and starts a `KernelWarmup` (warmup.py) on the DiT's
device; nothing on a CPU, without Triton or with QWEN21_KERNEL_WARMUP=0. Parts, queued in this order, the text
encoder's and the DiT's at once, the image encode and the VAE's once those are done (a first image may need the
former before it samples; the latter run during its sampling):
- "text": the weight-only dequantisation of quantised Linears (quant/kernel_warmup.py), first because the encode comes
  first. The DiT's weight-only layers share its keys (it is the same kernel), so the DiT's QuantLinears are scanned
  too. Nobody waits for it: the layers use torch's expression (the same bits) until the kernel is ready;
- "dit": what a first image needs, a GGUF model's block dequantisation included; the sampler waits for it
  (`before_sampling`);
- each later M bucket, a part of its own (dit/kernel_warmup.py), waited for only by the launches of that bucket
  (`PendingBuckets`): a prompt of under 64 tokens prefills in one of them;
- "image_encode": an image prompt's encode on a tiny model, whose kernels a fresh machine's first edit waited for
  (text/kernel_warmup.py). A part of its own, so that its failure skips no other job; nobody waits;
- "vae": a first exact decode does not wait for it (`vae_kernels`).

What a run does meanwhile, through the functions below (the pipeline calls each in one line): an encode pauses the
jobs (`encoding`), the sampler waits for "dit" (`before_sampling`), a VAE call runs torch's ops or waits
(`vae_kernels`), a launch of a bucket still compiling waits for its part (`PendingBuckets`). Decode-graph captures are
thread-local (dit/decode_graphs.py), so the VAE's warm-up may go on while the sampler captures.
"""

from __future__ import annotations

import contextlib
import logging
import threading

from ...kernels._triton import TRITON_AVAILABLE, torch_ops_only
from ...kernels.launch_configs import set_bucket_gate
from ..dit.kernel_warmup import PART, bucket_part, dit_warmup_parts, later_buckets
from ..memory.planner import indexed_device
from .warmup import KernelWarmup, warmup_enabled

log = logging.getLogger(__name__)


def start(pipe) -> KernelWarmup | None:
    """Start the kernel warm-up of a loaded pipeline's models (see the module docstring); None where nothing runs. Its
    waits call `pipe.check_interrupted` (the host's Cancel) while they last."""
    from ..quant.kernel_warmup import dequantize_warmup_jobs, gguf_warmup_jobs
    from ..text.kernel_warmup import image_encode_warmup_jobs
    from ..vae.kernel_warmup import vae_warmup_jobs

    device = indexed_device(pipe.execution_device)
    if device.type != "cuda" or not TRITON_AVAILABLE or not warmup_enabled():
        return None
    encoder = pipe.text_encoder
    quantised = [(encoder.model, encoder.device) if encoder is not None else (None, device),
                 (pipe.transformer, device)]  # fmt: skip
    dit = dit_warmup_parts(pipe.transformer, device)
    image = image_encode_warmup_jobs(encoder, indexed_device(encoder.device)) if encoder is not None else []
    # Two stages (warmup.py): what the first encode and sampling may use (the prompt's length picks the prefill's M
    # bucket), then the image encode and the VAE's, which run during the first sampling
    dit[PART] = [*dit[PART], *gguf_warmup_jobs(pipe.transformer, device)]
    first = {"text": dequantize_warmup_jobs(quantised), PART: dit.pop(PART), **dit}
    parts = {**first, "image_encode": image, "vae": vae_warmup_jobs(pipe.vae, device)}
    warmup = KernelWarmup(parts, device, first=tuple(first), on_part_done=PENDING_BUCKETS.forget_done,
                          check_interrupted=pipe.check_interrupted)  # fmt: skip
    PENDING_BUCKETS.expect(warmup, {bucket: bucket_part(bucket) for bucket in later_buckets()})
    warmup.start()
    # while it runs, decode graphs read a step's host share from the thread's CPU time (dit/decode_graphs.py)
    pipe.decode_graphs.background_busy = warmup.busy
    return warmup


class PendingBuckets:
    """The M buckets a warm-up still compiles, and the kernels' bucket gate while there are any
    (kernels/launch_configs.py `set_bucket_gate`): a launch of such a bucket outside the warm-up waits for the part
    compiling it. The sampler then waits only for the buckets its rows fall in, not for every bucket queued, and does
    not compete with the warm-up for that bucket's compiles (one variant is never compiled twice at once anyway:
    kernels/launch.py `_compile`). Once every part is done the gate is removed and a launch costs one check again."""

    def __init__(self):
        self._parts: dict[int, list[tuple[KernelWarmup, str]]] = {}  # bucket -> (warm-up, its part compiling it)
        self._lock = threading.Lock()

    def expect(self, warmup: KernelWarmup, parts: dict[int, str]) -> None:
        """`warmup` compiles each bucket of `parts` in the part named there (call it before the warm-up starts)."""
        with self._lock:
            for bucket, part in parts.items():
                self._parts.setdefault(int(bucket), []).append((warmup, part))
            if self._parts:
                set_bucket_gate(self.wait_for)

    def wait_for(self, bucket: int) -> None:
        """The gate: block until `bucket`'s parts are done (on any thread that launches; the warm-up's own launches
        force their bucket and never come here)."""
        waiting = self._parts.get(bucket)
        if not waiting:
            return
        for warmup, part in list(waiting):
            warmup.wait(part)
        self.forget_done()

    def forget_done(self, _part: str | None = None) -> None:
        """Drop the buckets whose parts are done; remove the gate once none is left (also a warm-up's part callback)."""
        with self._lock:
            for bucket, waiting in list(self._parts.items()):
                left = [(warmup, part) for warmup, part in waiting if not warmup.done(part)]
                if left:
                    self._parts[bucket] = left
                else:
                    del self._parts[bucket]
            if not self._parts:
                set_bucket_gate(None)


PENDING_BUCKETS = PendingBuckets()


@contextlib.contextmanager
def encoding(warmup: KernelWarmup | None, with_images: bool = False):
    """Hold the warm-up's jobs while an encode runs (warmup.py `paused`): nothing in an encode waits for them. With
    condition images the VAE encodes them too, its kernels used as `vae_kernels` says."""
    with contextlib.ExitStack() as stack:
        if warmup is not None and warmup.busy():
            stack.enter_context(warmup.paused())
        if with_images:
            stack.enter_context(vae_kernels(warmup, "exact"))
        yield


def before_sampling(warmup: KernelWarmup | None) -> None:
    """Wait for the DiT's first part: what any first step launches (the later buckets' parts are waited for by their
    own launches; the VAE's and those may go on: captures are thread-local)."""
    if warmup is not None:
        warmup.wait(PART)


def vae_kernels(warmup: KernelWarmup | None, quality: str):
    """How a VAE call uses its kernels while the warm-up may still be compiling them. The exact path's kernels are
    self-tested to equal torch's ops bit for bit, so until the warm-up is done an exact decode or encode runs torch's
    ops (the same image, a little slower) instead of waiting: a first decode that waits for the compiles takes far
    longer than one through torch's ops. The fast path has no torch twin with its numerics, so it waits."""
    if warmup is None or "vae" not in warmup.jobs or warmup.done("vae"):
        return contextlib.nullcontext()
    if quality != "exact":
        warmup.wait("vae")
        return contextlib.nullcontext()
    log.info("VAE kernels still compiling in the background: this call uses torch's ops (the same result)")
    return torch_ops_only()
