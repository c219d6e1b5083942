"""Where a traced run's time went on the GPU: busy, idle, and what the host was doing while the GPU waited.

    with torch.profiler.profile(activities=[CPU, CUDA]) as profiler:
        ...                                   # ranges labelled "node <class>" / "qwen21 <part>" (record_function)
    emit(**gpu_timeline(profiler))

The GPU is idle wherever no kernel or copy runs. Each idle gap is put on the innermost labelled ranges the host was
in while it lasted: a gap under "qwen21 prefill" is the prefill's launches not keeping the GPU fed, one under
"node Qwen21SaveImage" is time the GPU had nothing to do because the host was writing a PNG.
"""

from __future__ import annotations

from itertools import pairwise

import torch

LABELS = ("node ", "qwen21 ")
MIN_GAP_US = 200.0  # shorter gaps are launch latency between kernels: summed, not listed


def tracer(device, stack: bool = False):
    """A torch.profiler over the host and, on CUDA, the GPU; `stack`: Python frames too."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities, with_stack=stack)


def gpu_timeline(profiler, top: int = 12) -> dict:
    events = profiler.events()
    ranges = []
    work = []
    for event in events:
        start, end = event.time_range.start, event.time_range.end
        if event.name.startswith(LABELS):
            if event.device_type.name == "CPU":
                ranges.append((start, end, event.name))
            continue
        if getattr(event, "is_user_annotation", False):
            continue  # the GPU-side copy of any annotation (ours above, torch.compile's regions) is not work
        if event.device_type.name == "CUDA":
            work.append((start, end, event.name))
    if not work:
        return dict(error="no GPU work in the trace")
    work.sort()
    window_start = min([r[0] for r in ranges] + [work[0][0]])
    window_end = max([r[1] for r in ranges] + [max(w[1] for w in work)])
    busy, gaps, cursor = 0.0, [], window_start
    for start, end, _name in work:
        if start > cursor:
            gaps.append((cursor, start))
        if end > cursor:
            busy += end - max(start, cursor)
            cursor = end
    if window_end > cursor:
        gaps.append((cursor, window_end))

    def host_range(at: float) -> str:
        inside = [r for r in ranges if r[0] <= at < r[1]]
        return min(inside, key=lambda r: r[1] - r[0])[2] if inside else "outside the labelled ranges"

    idle_by_range: dict[str, float] = {}
    listed = []
    short_total = 0.0
    for start, end in gaps:
        length = end - start
        if length < MIN_GAP_US:
            short_total += length
            continue
        # split at the ranges' edges inside the gap: a gap from the sampler's last kernel through SaveImage is
        # mostly SaveImage's
        edges = sorted({start, end} | {t for r in ranges for t in r[:2] if start < t < end})
        for piece_start, piece_end in pairwise(edges):
            where = host_range(piece_start)
            idle_by_range[where] = idle_by_range.get(where, 0.0) + piece_end - piece_start
        listed.append((length, start, host_range(start)))
    kernels: dict[str, list[float]] = {}
    for start, end, name in work:
        kernels.setdefault(name[:80], []).append(end - start)
    by_kernel = sorted(kernels.items(), key=lambda item: -sum(item[1]))[:top]
    wall_by_range: dict[str, float] = {}
    for start, end, name in ranges:
        wall_by_range[name] = wall_by_range.get(name, 0.0) + (end - start)
    ms = 1e-3
    return dict(
        wall_ms=round((window_end - window_start) * ms, 2),
        gpu_busy_ms=round(busy * ms, 2),
        gpu_idle_ms=round((window_end - window_start - busy) * ms, 2),
        idle_in_short_gaps_ms=round(short_total * ms, 2),
        idle_by_host_range_ms={k: round(v * ms, 2) for k, v in sorted(idle_by_range.items(), key=lambda i: -i[1])},
        longest_gaps=[
            dict(ms=round(length * ms, 2), at_ms=round((start - window_start) * ms, 2), host=where)
            for length, start, where in sorted(listed, reverse=True)[:top]
        ],  # fmt: skip
        host_range_wall_ms={k: round(v * ms, 2) for k, v in sorted(wall_by_range.items(), key=lambda i: -i[1])},
        top_gpu_work=[dict(name=name, calls=len(times), ms=round(sum(times) * ms, 2)) for name, times in by_kernel],
    )


def top_host_ops(profiler, top: int = 20) -> list[dict]:
    """The CPU ops by their own host time (what the launches cost the host), per call and in all."""
    averages = profiler.key_averages()
    rows = [a for a in averages if a.self_cpu_time_total > 0 and not a.key.startswith(LABELS)]
    rows.sort(key=lambda a: -a.self_cpu_time_total)
    return [dict(op=a.key[:80], calls=a.count, self_ms=round(a.self_cpu_time_total * 1e-3, 3),
                 us_per_call=round(a.self_cpu_time_total / max(a.count, 1), 2)) for a in rows[:top]]  # fmt: skip
