"""The measurements recorded in BENCHMARKS.md, for tests that check code and docs against them."""

from __future__ import annotations

import json
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "BENCHMARKS.md"


def benchmark_text() -> str:
    return BENCHMARKS.read_text(encoding="utf-8")


def json_records(what: str | None = None) -> list[dict]:
    """The raw JSON lines quoted in BENCHMARKS.md (one object per line), optionally only those with this "what";
    each gets "_section": the `## ` heading it sits under."""
    records, section = [], ""
    for line in benchmark_text().splitlines():
        line = line.strip()
        if line.startswith("## "):
            section = line[3:]
        if line.startswith("{") and line.endswith("}"):
            record = json.loads(line)
            if what is None or record.get("what") == what:
                records.append({**record, "_section": section})
    return records
