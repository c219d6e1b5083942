"""How a run uses the workers of a model loaded on several devices, from `SampleOptions.parallel`: the sampler's
choice, and the same choice asked ahead of the run by the memory sizing (which must not fail where the sampler
would report a clear error itself)."""

from __future__ import annotations

MODES = ("cfg", "sequence")


def parallel_mode(option: str, workers, use_cfg: bool) -> str | None:
    """How a run uses the workers (SampleOptions.parallel): "cfg", "sequence" or None (this device alone)."""
    if option == "off" or (option == "auto" and workers is None):
        return None
    if workers is None:
        raise ValueError(f"parallel={option!r} needs a model loaded on several GPUs (the loader's `gpus` >= 2); "
                         "this one runs on one device: use parallel 'auto' or 'off'")  # fmt: skip
    if option == "auto":
        return "cfg" if use_cfg and workers.world == 2 else "sequence"
    if option == "cfg" and not use_cfg:
        raise ValueError("parallel='cfg' runs the two CFG branches on two GPUs: it needs true_cfg_scale > 1 and a "
                         "negative prompt; use 'sequence' (or 'auto') at true_cfg_scale 1")  # fmt: skip
    if option == "cfg" and workers.world != 2:
        raise ValueError(f"parallel='cfg' runs on exactly 2 GPUs (one per CFG branch); this model has "
                         f"{workers.world}: use 'sequence' (or 'auto')")  # fmt: skip
    return option


def expected_mode(option: str, workers, use_cfg: bool) -> str | None:
    """The mode the sampler will pick, for sizing its memory beforehand; None when the workers are gone or the
    option does not fit them (the sampler then reports it)."""
    if workers is None or workers.closed:
        return None
    try:
        return parallel_mode(option, workers, use_cfg)
    except ValueError:
        return None
