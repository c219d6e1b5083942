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
    # shapes: which real-size first calls a first prompt waited for (idle_host_ops)
    return torch.profiler.profile(activities=activities, with_stack=stack, record_shapes=True)


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
    long_gaps = [(start, end) for start, end in gaps if end - start >= MIN_GAP_US]
    idle_ops = idle_host_ops(events, long_gaps, top)
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
        **idle_ops,
    )


def idle_host_ops(events, gaps: list[tuple[float, float]], top: int = 12) -> dict:
    """What each host thread ran while the GPU idled in `gaps` (sorted, disjoint): at every moment the innermost
    event open on that thread, named with the innermost labelled range around it ("python in <range>" where only a
    labelled range was open: our own Python between ops). The main thread is the one the node ranges ran on; the
    others are the warm-up's and torch's threads, listed to show what competed with it (empty in the H200 traces with
    torch 2.11 although the warm-up's jobs ran meanwhile: its profiler seems to record the tracing thread's ops only).
    Also the single events that
    held the GPU idle longest, with their input shapes where the trace recorded them: what a first call waited for."""
    by_thread: dict[int, list[tuple[float, float, str, str]]] = {}
    label_threads: dict[int, int] = {}
    for event in events:
        ours = event.name.startswith(LABELS)
        if event.device_type.name != "CPU" or (getattr(event, "is_user_annotation", False) and not ours):
            continue
        thread = getattr(event, "thread", 0)
        shapes = [list(shape) for shape in getattr(event, "input_shapes", None) or [] if shape]
        spans = by_thread.setdefault(thread, [])
        spans.append((event.time_range.start, event.time_range.end, event.name, str(shapes)[:120] if shapes else ""))
        if ours:
            label_threads[thread] = label_threads.get(thread, 0) + 1
    if not gaps or not by_thread:
        return {}
    main = max(label_threads, key=label_threads.get) if label_threads else next(iter(by_thread))
    main_names, main_events = _innermost_overlap(by_thread[main], gaps)
    other: dict[str, float] = {}
    for thread, spans in by_thread.items():
        if thread != main:
            for name, length in _innermost_overlap(spans, gaps)[0].items():
                other[name] = other.get(name, 0.0) + length

    def ranked(names: dict[str, float], count: int) -> dict[str, float]:
        return {k[:100]: round(v * 1e-3, 2) for k, v in sorted(names.items(), key=lambda i: -i[1])[:count]}

    longest = sorted(main_events, key=lambda item: -item[0])[: 2 * top]
    return dict(idle_main_thread_ms=ranked(main_names, 2 * top), idle_other_threads_ms=ranked(other, top),
                idle_longest_events=[dict(ms=round(length * 1e-3, 2), event=name[:100], shapes=shapes)
                                     for length, name, shapes in longest])  # fmt: skip


def _innermost_overlap(spans: list[tuple[float, float, str, str]], gaps: list[tuple[float, float]]):
    """One thread's events: per name (with its innermost labelled range), how long it was the innermost open event
    inside the gaps; and per event, (that time, its name, its shapes). The most recently begun open event is the
    innermost."""
    spans = [span for span in spans if span[1] > span[0]]  # an instant covers nothing
    edges = [(start, 1, index) for index, (start, *_rest) in enumerate(spans)]
    edges += [(end, 0, index) for index, (_start, end, *_rest) in enumerate(spans)]
    edges.sort()  # at one moment, ends before starts
    open_spans: list[int] = []
    totals: dict[str, float] = {}
    per_event: dict[tuple[int, int], float] = {}
    previous, gap_index = None, 0
    for at, is_start, index in edges:
        if open_spans and previous is not None and at > previous:
            while gap_index < len(gaps) and gaps[gap_index][1] <= previous:
                gap_index += 1
            covered, probe = 0.0, gap_index
            while probe < len(gaps) and gaps[probe][0] < at:
                covered += max(0.0, min(at, gaps[probe][1]) - max(previous, gaps[probe][0]))
                probe += 1
            if covered:
                innermost = open_spans[-1]
                name = spans[innermost][2]
                label = next((spans[i][2] for i in reversed(open_spans) if spans[i][2].startswith(LABELS)), None)
                if name.startswith(LABELS):
                    name = f"python in {name}"
                else:
                    # a runtime call (a kernel's first load) is named with the op around it, whose shapes say which
                    owner = next((i for i in reversed(open_spans) if spans[i][3]), innermost)
                    per_event[(owner, innermost)] = per_event.get((owner, innermost), 0.0) + covered
                    name = f"{name} in {label}" if label else name
                totals[name] = totals.get(name, 0.0) + covered
        previous = at
        if is_start:
            open_spans.append(index)
        elif index in open_spans:
            open_spans.remove(index)
    named = []
    for (owner, innermost), length in per_event.items():
        name = spans[owner][2] if owner == innermost else f"{spans[owner][2]} > {spans[innermost][2]}"
        named.append((length, name, spans[owner][3]))
    return totals, named


def top_host_ops(profiler, top: int = 20) -> list[dict]:
    """The CPU ops by their own host time (what the launches cost the host), per call and in all."""
    averages = profiler.key_averages()
    rows = [a for a in averages if a.self_cpu_time_total > 0 and not a.key.startswith(LABELS)]
    rows.sort(key=lambda a: -a.self_cpu_time_total)
    return [dict(op=a.key[:80], calls=a.count, self_ms=round(a.self_cpu_time_total * 1e-3, 3),
                 us_per_call=round(a.self_cpu_time_total / max(a.count, 1), 2)) for a in rows[:top]]  # fmt: skip
