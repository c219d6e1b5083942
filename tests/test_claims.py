"""Numbers in tooltips, help pages, workflow notes and the README must come from BENCHMARKS.md and say where.

Convention: a measured number is followed, in the same sentence, by a citation
`(BENCHMARKS: <section>[, <section>...])`, where <section> is how a `## ` heading of BENCHMARKS.md begins. This
test checks that every number between a citation and the start of its sentence (or the previous citation)
appears in one of the cited sections, to the precision it is written with (134 matches 133.5; 0.5 matches
0.49). In tooltips, help pages and workflow notes every number with a unit (ms, s, GiB, dB, x, ...) must be
cited that way. The README's performance tables are checked as a whole against BENCHMARKS.md. A test cannot
tell a right number from a wrong one that happens to be measured too, but a stale or invented number fails.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from benchmark_lines import benchmark_text
from qwen21_nodes import NODE_CLASS_MAPPINGS

ROOT = Path(__file__).resolve().parents[1]
CITATION = re.compile(r"\(BENCHMARKS: ([^)]+)\)")
# a number not inside a word ("H200", "bf16"), a version ("0.42.1"), a size ("1024x1024") or an exponent ("1e-5")
NUMBER = re.compile(r"(?<![\w.^])(?<!e-)\d+(?:\.\d+)?(?![\w.]*\d)")
# a number with a unit, not in a name like "Qwen3-VL-8B"
UNIT = re.compile(r"(?<![\w.])(?<![A-Za-z]-)(\d+(?:\.\d+)?)\s?(?:ms|µs|s|GiB|MiB|KiB|GB|B|dB|x|%)(?![\w])")
BLOCK_BREAK = re.compile(r"\n\s*\n|\n(?=\s*(?:[-*] |\| |#))")  # paragraphs, list items, table rows, headings
SENTENCE_END = re.compile(r"(?<=[.;!?])\s+")


def _sections() -> dict[str, str]:
    parts = re.split(r"^## ", benchmark_text(), flags=re.MULTILINE)
    return {part.split("\n", 1)[0]: part for part in parts[1:]}


SECTIONS = _sections()


def _numbers(text: str) -> list[str]:
    return NUMBER.findall(text.replace(",", ""))


def _matches(claim: str, measured: list[str]) -> bool:
    """claim written with k decimals equals some measured value rounded to k decimals (half up)."""
    decimals = len(claim.split(".")[1]) if "." in claim else 0
    value, half = float(claim), 0.5 * 10**-decimals
    return any(abs(float(m) - value) <= half + 1e-9 for m in measured)


def _section_numbers(names: str) -> list[str]:
    found = []
    for name in (" ".join(n.split()) for n in re.split(r"[,;]", names)):  # a citation may wrap
        heads = [head for head in SECTIONS if head.startswith(name)]
        assert heads, f"(BENCHMARKS: {name}) names no section of BENCHMARKS.md; sections: {list(SECTIONS)}"
        for head in heads:
            found += _numbers(SECTIONS[head])
    return found


def _sentences(text: str) -> list[str]:
    """Sentences within paragraphs, list items and table rows (a citation belongs to its sentence)."""
    return [sentence for block in BLOCK_BREAK.split(text) for sentence in SENTENCE_END.split(block)]


def cited_spans(text: str):
    """(span, cited section names) for every citation: the span runs back to the previous citation or the
    start of its sentence."""
    for sentence in _sentences(text):
        start = 0
        for citation in CITATION.finditer(sentence):
            yield sentence[start : citation.start()], citation.group(1)
            start = citation.end()


def uncited_units(text: str) -> list[str]:
    """Numbers with a unit that no later citation in their sentence covers."""
    missing = []
    for sentence in _sentences(text):
        covered_until = max((c.start() for c in CITATION.finditer(sentence)), default=-1)
        missing += [m.group(0) for m in UNIT.finditer(sentence) if m.start() > covered_until]
    return missing


def tooltips() -> dict[str, str]:
    texts = {}
    for name, node in NODE_CLASS_MAPPINGS.items():
        for inputs in node.INPUT_TYPES().values():
            for input_name, spec in inputs.items():
                if len(spec) > 1 and "tooltip" in spec[1]:
                    texts[f"{name}.{input_name}"] = spec[1]["tooltip"]
        for index, tooltip in enumerate(getattr(node, "OUTPUT_TOOLTIPS", ())):
            texts[f"{name}.output{index}"] = tooltip
        texts[f"{name}.DESCRIPTION"] = getattr(node, "DESCRIPTION", "") or ""
    return texts


def help_pages() -> dict[str, str]:
    return {path.name: path.read_text(encoding="utf-8") for path in sorted((ROOT / "web" / "docs").glob("*.md"))}


def workflow_notes() -> dict[str, str]:
    notes = {}
    for path in sorted((ROOT / "workflows").glob("*.json")):
        for node in json.loads(path.read_text(encoding="utf-8"))["nodes"]:
            if node["type"] in ("Note", "MarkdownNote"):
                notes[f"{path.name}#{node['id']}"] = "\n".join(map(str, node.get("widgets_values", [])))
    return notes


def _all_texts() -> dict[str, str]:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    return {**tooltips(), **help_pages(), **workflow_notes(), "README.md": readme}


@pytest.mark.parametrize("where", sorted(_all_texts()))
def test_cited_numbers_are_in_the_cited_benchmark_section(where):
    text = _all_texts()[where]
    for span, names in cited_spans(text):
        measured = _section_numbers(names)
        stale = [number for number in _numbers(span) if not _matches(number, measured)]
        assert not stale, f"{where}: {stale} not in BENCHMARKS.md section(s) {names!r}, cited for: {span!r}"


@pytest.mark.parametrize("where", sorted({**tooltips(), **help_pages(), **workflow_notes()}))
def test_every_measured_number_in_tooltips_help_pages_and_workflow_notes_cites_its_benchmark(where):
    text = {**tooltips(), **help_pages(), **workflow_notes()}[where]
    assert not uncited_units(text), f"{where}: {uncited_units(text)} cite no (BENCHMARKS: ...) section"


def test_readme_performance_tables_match_the_benchmarks():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    performance = readme.split("## Performance", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in performance.splitlines() if line.startswith("|") and not line.startswith("| ---")]
    measured = _numbers(benchmark_text())
    for row in rows:
        stale = [number for number in _numbers(row) if not _matches(number, measured)]
        assert not stale, f"README performance table: {stale} appear nowhere in BENCHMARKS.md ({row})"


def test_the_vae_planners_constants_are_the_ones_benchmarks_md_records():
    from qwen21_nodes.qwen21_core.vae.tiling import BYTES_PER_PIXEL

    vae = next(text for head, text in SECTIONS.items() if head.startswith("VAE"))
    for key, value in BYTES_PER_PIXEL.items():
        assert re.search(rf"(?<!\d){value}(?!\d)", vae), f"BYTES_PER_PIXEL{key} = {value} is not in BENCHMARKS.md"


def test_the_checker_catches_stale_and_uncited_numbers():
    """The rules above on known-bad texts: the README's first-build VAE time, an uncited tooltip number."""
    ((span, names),) = cited_spans("the exact decode takes 329 ms at 2048x2048 (BENCHMARKS: VAE)")
    assert [n for n in _numbers(span) if not _matches(n, _section_numbers(names))] == ["329"]
    ((span, names),) = cited_spans("the exact decode takes 275.7 ms at 2048x2048 (BENCHMARKS: VAE)")
    assert [n for n in _numbers(span) if not _matches(n, _section_numbers(names))] == []
    assert uncited_units("a new prompt then costs ~1-3 s of transfer") == ["3 s"]
    assert uncited_units("a step takes 114.4 ms (BENCHMARKS: DiT). Then 5 ms more.") == ["5 ms"]
