"""The changed-prompt image of each session against the uncapped Qwen21 Sampler session of the same call set, from
the `session_summary` lines bench_comfyui_session.py printed (one server per DiT file, card size and flag set).

    python benchmarks/door_ratios.py benchmarks/results/bench_comfyui_session_2026-12-07.jsonl

Prints one `door_ratio` line per summary other than a baseline: KSampler's, and Qwen21 Sampler's under a cap, a
flag or another DiT file. Each gives its DiT file, card (cap_gib), flags and guidance scale, its steady image, the
baseline's (Qwen21 Sampler on the fp8 file, no cap, same guidance scale) and their ratio, `same_dit_ratio` against
the uncapped Qwen21 Sampler session of its own DiT file (where that is not the fp8 one), the prompts, errors and
peak allocation.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

FLAGS_OF_NOTE = ("--lowvram", "--novram")


def _ratio(steady, base) -> float | None:
    return round(steady / base, 3) if steady and base else None


def ratios(lines: list[dict]) -> list[dict]:
    """door_ratio rows; a baseline is looked for among the summaries of the same package (`code`) and the same
    control setting, the first with a steady image."""
    summaries = [line for line in lines if line.get("what") == "session_summary"]
    uncapped = {}
    for s in summaries:
        if (s.get("sampler") == "qwen21" and s.get("cap_gib") is None and s.get("steady_image_s")
                and not set(s.get("comfyui_flags", [])) & set(FLAGS_OF_NOTE)):  # fmt: skip
            uncapped.setdefault((s.get("code"), bool(s.get("control")), s.get("dit", "fp8"), s["cfg"]), s)
    out = []
    for summary in summaries:
        group = (summary.get("code"), bool(summary.get("control")))
        dit, cfg = summary.get("dit", "fp8"), summary["cfg"]
        base, own = uncapped.get((*group, "fp8", cfg)), uncapped.get((*group, dit, cfg))
        if summary is base or (base is None and (own is None or own is summary)):  # nothing to compare it with
            continue
        steady = summary.get("steady_image_s")
        row = dict(what="door_ratio", dit=dit, sampler=summary.get("sampler"), cap_gib=summary.get("cap_gib"),
                   cfg=cfg, control=group[1], flags=[f for f in summary.get("comfyui_flags", []) if f in FLAGS_OF_NOTE],
                   steady_image_s=steady, baseline_steady_s=(base or {}).get("steady_image_s"),
                   ratio=_ratio(steady, (base or {}).get("steady_image_s")))  # fmt: skip
        if dit != "fp8" and own is not None and own is not summary:
            row.update(same_dit_steady_s=own["steady_image_s"], same_dit_ratio=_ratio(steady, own["steady_image_s"]))
        row.update(
            prompts=summary.get("prompts"),
            errors=summary.get("errors"),
            peak_allocated_max_gib=summary.get("peak_allocated_max_gib"),
            code=summary.get("code"),
        )
        out.append(row)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+")
    args = parser.parse_args()
    lines = [json.loads(line) for path in args.files for line in Path(path).read_text().splitlines() if line.strip()]
    for row in ratios(lines):
        sys.stdout.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
