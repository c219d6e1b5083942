"""The measurements in benchmarks/results/*.jsonl, for tests that check code and docs against them."""

from __future__ import annotations

import functools
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def result_files() -> list[Path]:
    return sorted(RESULTS.glob("*.jsonl"))


@functools.cache
def file_records(name: str) -> tuple[dict, ...]:
    """The lines of one data file (one JSON object each), each with "_file": its file name."""
    path = RESULTS / name
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            record = json.loads(line)
            assert isinstance(record, dict), f"{name}:{number} is not a JSON object"
            records.append({**record, "_file": name})
    return tuple(records)


def json_records(what: str | None = None) -> list[dict]:
    """Every data line, optionally only those with this "what"."""
    return [r for path in result_files() for r in file_records(path.name) if what is None or r.get("what") == what]
