"""The changed-prompt image of each KSampler session against the uncapped Qwen21 Sampler session of the same call
set, from the `session_summary` lines bench_comfyui_session.py printed (one server per card size and flag set).

    python benchmarks/door_ratios.py benchmarks/results/bench_comfyui_session_2026-12-07.jsonl

Prints one `door_ratio` line per KSampler summary: its card (cap_gib), flags and guidance scale, its steady image,
the baseline's (Qwen21 Sampler, no cap, same guidance scale), their ratio, the prompts, errors and peak allocation.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

FLAGS_OF_NOTE = ("--lowvram", "--novram")


def ratios(lines: list[dict]) -> list[dict]:
    summaries = [line for line in lines if line.get("what") == "session_summary"]
    baselines = {s["cfg"]: s for s in summaries if s.get("sampler") == "qwen21" and s.get("cap_gib") is None
                 and not set(s.get("comfyui_flags", [])) & set(FLAGS_OF_NOTE)}  # fmt: skip
    out = []
    for summary in summaries:
        if summary.get("sampler") != "ksampler" or summary["cfg"] not in baselines:
            continue
        base = baselines[summary["cfg"]]
        steady, base_steady = summary.get("steady_image_s"), base.get("steady_image_s")
        out.append(dict(what="door_ratio", cap_gib=summary.get("cap_gib"), cfg=summary["cfg"],
                        flags=[f for f in summary.get("comfyui_flags", []) if f in FLAGS_OF_NOTE],
                        steady_image_s=steady, baseline_steady_s=base_steady,
                        ratio=round(steady / base_steady, 3) if steady and base_steady else None,
                        prompts=summary.get("prompts"), errors=summary.get("errors"),
                        peak_allocated_max_gib=summary.get("peak_allocated_max_gib"),
                        code=summary.get("code")))  # fmt: skip
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
