"""Every figure the documents quote traces to a data line in benchmarks/results/*.jsonl.

The data: one file per benchmark and date, a JSON object per line (what a benchmark printed). A figure lives in one
data line; documents quote it, and a quote must match a value of a line to the precision it is written with (134
matches 133.5; 0.5 matches 0.49).

BENCHMARKS.md: every `## ` section links the data files it quotes (`benchmarks/results/<file>.jsonl`), and every
number in the section must be a value of a line in them. A paragraph, list item or table row that names commits the
lines know (their "recorded" or "code" field) narrows that to those commits' lines. Not figures, so not checked: code
spans, link targets, dates, commit ids, versions, issue numbers, targets ("target 1.3") and bounds ("≤ 2 s").

Everywhere else (README.md, CHANGELOG.md, docs/*.md, the help pages web/docs/*.md, the nodes' tooltips, the
workflows' notes): a measured number is followed, in the same sentence, by a citation `(BENCHMARKS: <section>[,
<section>...])`, where <section> is how a `## ` heading of BENCHMARKS.md begins; every number between a citation and
the start of its sentence (or the previous citation) must be a value of the cited sections' data lines, of the
commits the sentence names if it names some. A table takes the commits and citations of the paragraph that
introduces it. Every number with a unit (ms, s, GiB, dB, x, ...) in these texts must be cited that way. A test cannot
tell a right number from a wrong one that happens to be measured too (nor ms from s: values are compared without
units), but a stale or invented number fails.
"""

from __future__ import annotations

import functools
import json
import math
import re
from pathlib import Path

import pytest
from benchmark_lines import RESULTS, file_records, result_files
from qwen21_nodes import NODE_CLASS_MAPPINGS

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "BENCHMARKS.md"
CITATION = re.compile(r"\(BENCHMARKS:\s+([^)]+)\)")
# a number not inside a word ("H200", "bf16", "Qwen3-VL-8B"), a version ("0.42.1"), a size ("1024x1024") or an
# exponent ("1e-5")
NUMBER = re.compile(r"(?<![\w.^])(?<![A-Za-z]-)(?<!e-)\d+(?:\.\d+)?(?![\w.]*\d)")
# a number with a unit, not in a name like "Qwen3-VL-8B"
UNIT = re.compile(r"(?<![\w.])(?<![A-Za-z]-)(\d+(?:\.\d+)?)\s?(?:ms|µs|s|GiB|MiB|KiB|GB|B|dB|x|%)(?![\w])")
BLOCK_BREAK = re.compile(r"\n\s*\n|\n(?=\s*(?:[-*] |\d+\. |\| |#))")  # paragraphs, list items, table rows, headings
SENTENCE_END = re.compile(r"(?<=[.;!?])\s+")
DATA_FILE = re.compile(r"results/([\w.-]+\.jsonl)")
COMMIT = re.compile(r"(?<![\w/])[0-9a-f]{7,40}(?![\w/])")
NOT_FIGURES = re.compile(
    r"`[^`]*`"  # code spans: commands, names, settings
    r"|\]\([^)]*\)"  # link targets
    r"|[\w.-]+\.jsonl"  # data file names
    r"|(?<!\d)\d{4}-\d{2}-\d{2}(?!\d)"  # dates
    r"|\b(?:Python|torch|torchvision|triton|Triton|transformers|diffusers|ComfyUI|CUDA|cuDNN|driver|issues?|"
    r"Qwen-Image|PEP)\s+\d[\w.+-]*"  # versions, issue numbers
    r"|\btargets?\b[^.;,)|\d]{0,24}\d+(?:\.\d+)?"  # a target is not a measurement,
    r"|[≤≥]\s*\d+(?:\.\d+)?"  # nor is a bound
)


# --- the data ---------------------------------------------------------------------------------------------------


def _numbers_in(value) -> list[float]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, (int, float)):
        return [float(value)] if math.isfinite(value) else []
    if isinstance(value, str):
        return [float(n) for n in NUMBER.findall(value)]
    if isinstance(value, dict):
        return [n for item in value.values() for n in _numbers_in(item)]
    if isinstance(value, list):
        return [n for item in value for n in _numbers_in(item)]
    return []


BOOKKEEPING = ("date", "recorded", "call", "code", "_file")  # where and when a line was made, not what it measured


@functools.cache
def _line_values(name: str) -> tuple[tuple[frozenset, tuple[float, ...]], ...]:
    """Per data line of a file: (its commits, its numbers)."""
    return tuple(
        (
            frozenset(r[k] for k in ("recorded", "code") if k in r),
            tuple(_numbers_in({k: v for k, v in r.items() if k not in BOOKKEEPING})),
        )
        for r in file_records(name)
    )


def measured(files: tuple[str, ...], commits: frozenset = frozenset()) -> list[float]:
    """The values of the data lines of these files, only those of these commits if any are named."""
    return [
        n for name in files for known, values in _line_values(name) if not commits or known & commits for n in values
    ]


def known_commits(files: tuple[str, ...]) -> frozenset:
    return frozenset(c for name in files for known, _ in _line_values(name) for c in known)


# --- the documents' numbers -------------------------------------------------------------------------------------


def _numbers(text: str) -> list[str]:
    return NUMBER.findall(COMMIT.sub(" ", NOT_FIGURES.sub(" ", text)).replace(",", ""))


def _matches(claim: str, values: list[float]) -> bool:
    """claim written with k decimals equals some measured value rounded to k decimals (half up)."""
    decimals = len(claim.split(".")[1]) if "." in claim else 0
    value, half = float(claim), 0.5 * 10**-decimals
    return any(abs(m - value) <= half + 1e-9 for m in values)


def unmatched(text: str, files: tuple[str, ...]) -> list[str]:
    """The numbers of `text` that no data line of `files` holds (of the commits `text` names, if it names any)."""
    commits = frozenset(COMMIT.findall(NOT_FIGURES.sub(" ", text))) & known_commits(files)
    values = measured(files, commits)
    return [number for number in _numbers(text) if not _matches(number, values)]


def _blocks(text: str) -> list[str]:
    """Paragraphs, list items and table rows, outside fenced code."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return [block for block in BLOCK_BREAK.split(text) if block.strip()]


# --- BENCHMARKS.md ----------------------------------------------------------------------------------------------


PREAMBLE = "(before the first section)"


def benchmark_sections() -> dict[str, str]:
    """BENCHMARKS.md's `## ` sections by heading, each text starting with its heading line."""
    parts = re.split(r"^## ", BENCHMARKS.read_text(encoding="utf-8"), flags=re.M)
    return {PREAMBLE: "\n" + parts[0], **{part.split("\n", 1)[0]: part for part in parts[1:]}}


SECTIONS = benchmark_sections()


def section_files(head: str) -> tuple[str, ...]:
    if head == PREAMBLE:  # it speaks of all of them
        return tuple(path.name for path in result_files())
    return tuple(dict.fromkeys(DATA_FILE.findall(SECTIONS[head])))


def cited_files(names: str) -> tuple[str, ...]:
    files = []
    for name in (" ".join(n.split()) for n in re.split(r"[,;]", names)):  # a citation may wrap
        heads = [head for head in SECTIONS if head != PREAMBLE and head.startswith(name)]
        assert heads, f"(BENCHMARKS: {name}) names no section of BENCHMARKS.md; sections: {list(SECTIONS)[1:]}"
        files += [file for head in heads for file in section_files(head)]
    return tuple(dict.fromkeys(files))


def test_data_files_are_json_lines_named_by_benchmark_and_date():
    names = [path.name for path in result_files()]
    assert names, f"no data in {RESULTS}"
    for name in names:
        assert re.fullmatch(r"[a-z0-9_]+_\d{4}-\d{2}-\d{2}\.jsonl", name), f"{name}: <benchmark>_<date>.jsonl"
        benchmark, date = name[: -len("_2026-01-01.jsonl")], name[-len("2026-01-01.jsonl") : -len(".jsonl")]
        assert benchmark == "probes" or (ROOT / "benchmarks" / f"{benchmark}.py").is_file(), f"{name}: no such script"
        for record in file_records(name):
            assert record["date"] == date and COMMIT.fullmatch(record["recorded"]), (name, record)


@pytest.mark.parametrize("head", sorted(SECTIONS))
def test_every_figure_in_benchmarks_md_is_in_its_sections_data(head):
    files = section_files(head)
    missing = [name for name in files if not (RESULTS / name).is_file()]
    assert not missing, f"BENCHMARKS.md section {head!r} links data files that do not exist: {missing}"
    for block in _blocks(SECTIONS[head].split("\n", 1)[1]):  # the heading names commands, not figures
        if _numbers(block):
            assert files, f"BENCHMARKS.md section {head!r} quotes figures but links no benchmarks/results file"
        stale = unmatched(block, files)
        assert not stale, f"BENCHMARKS.md {head!r}: {stale} are in no data line of {files}: {block.strip()[:300]!r}"


def test_benchmarks_md_and_readme_link_only_what_exists():
    for document in (
        "BENCHMARKS.md",
        "README.md",
        "CHANGELOG.md",
        *(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")),
    ):
        text = (ROOT / document).read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if not re.match(r"https?://", target):
                assert (ROOT / document).parent.joinpath(target).resolve().exists(), f"{document} links {target}"


# --- the quotes elsewhere ---------------------------------------------------------------------------------------


def _sentences(text: str) -> list[str]:
    """Sentences within paragraphs, list items and table rows (a citation belongs to its sentence); a table's rows
    carry the commits and citations of the paragraph before the table."""
    sentences, caption = [], ""
    for block in BLOCK_BREAK.split(text):
        if block.lstrip().startswith("|"):
            if re.fullmatch(r"\s*\|[\s|:-]*", block):
                continue
            sentences.append(block + caption)
            continue
        commits = COMMIT.findall(NOT_FIGURES.sub(" ", block))
        caption = "".join(f" {commit}" for commit in commits)
        caption += "".join(f" (BENCHMARKS: {names})" for names in CITATION.findall(block))
        sentences += SENTENCE_END.split(block)
    return sentences


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
        bare = NOT_FIGURES.sub(lambda m: " " * len(m.group(0)), sentence)
        missing += [m.group(0) for m in UNIT.finditer(bare) if m.start() > covered_until]
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


def documents() -> dict[str, str]:
    pages = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
    return {str(path.relative_to(ROOT)): re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)
            for path in pages}  # fmt: skip


def _all_texts() -> dict[str, str]:
    return {**tooltips(), **help_pages(), **workflow_notes(), **documents()}


@pytest.mark.parametrize("where", sorted(_all_texts()))
def test_cited_numbers_are_in_the_cited_sections_data(where):
    text = _all_texts()[where]
    for span, names in cited_spans(text):
        stale = unmatched(span, cited_files(names))
        assert not stale, (
            f"{where}: {stale} are in no data line of BENCHMARKS.md section(s) {names!r}, cited for: {span!r}"
        )


@pytest.mark.parametrize("where", sorted(_all_texts()))
def test_every_measured_number_cites_its_benchmark(where):
    assert not uncited_units(_all_texts()[where]), f"{where}: {uncited_units(_all_texts()[where])} cite no section"


def test_the_vae_planners_constants_are_the_ones_the_data_records():
    from qwen21_nodes.qwen21_core.vae.tiling import BYTES_PER_PIXEL

    lines = [r for path in result_files() for r in file_records(path.name) if r.get("what") == "bytes_per_pixel"]
    assert {(r["kind"], r["quality"], r["element_bytes"]): r["current"] for r in lines} == BYTES_PER_PIXEL


def test_the_checker_catches_stale_uncited_and_unbacked_numbers():
    """The rules above on known-bad texts."""
    vae = cited_files("VAE")
    # the README's first-build VAE time: measured once, no data line holds it
    ((span, names),) = cited_spans("the exact decode takes 329 ms at 2048x2048 (BENCHMARKS: VAE)")
    assert unmatched(span, cited_files(names)) == ["329"]
    ((span, names),) = cited_spans("the exact decode takes 275.7 ms at 2048x2048 (BENCHMARKS: VAE)")
    assert unmatched(span, cited_files(names)) == []
    assert unmatched("275.7 ms", vae) == [] and unmatched("275.71 ms", vae) == ["275.71"]
    # a table row takes its caption's citation
    ((span, names),) = list(
        cited_spans("Decodes (BENCHMARKS: VAE):\n\n| exact | 275.7 ms |\n| --- | --- |\n| fast | 999 ms |")
    )[2:]
    assert (names, unmatched(span, cited_files(names))) == ("VAE", ["999"])
    # ... and the commits it names
    ((span, names),) = list(cited_spans("Restarts of ea5b990 (BENCHMARKS: Session):\n\n| fp8 | 3.994 s |"))[1:]
    assert unmatched(span, cited_files(names)) == ["3.994"]
    # a real figure of another commit's lines fails where a text names its commit
    files = cited_files("Session")
    assert unmatched("a restart's first image took 3.994 s", files) == []
    assert unmatched("b6d235f: 3.994 s", files) == [] and unmatched("ea5b990: 3.994 s", files) == ["3.994"]
    # a figure of another benchmark's data is not in this section's (a BENCHMARKS.md block)
    vae_section = next(head for head in SECTIONS if head.startswith("VAE"))
    assert unmatched("| fp8, restart | 3.994 s |", section_files(vae_section)) == ["3.994"]
    # code spans, data files, dates, versions, issue numbers, targets and bounds are not figures
    assert _numbers("`--limit 3`, a.jsonl, 2026-12-02, torch 2.11.0, issue 23, target 1.3, ≤ 2 s: 4.2 s") == ["4.2"]
    assert uncited_units("a new prompt then costs ~1-3 s of transfer") == ["3 s"]
    assert uncited_units("a step takes 114.4 ms (BENCHMARKS: DiT). Then 5 ms more.") == ["5 ms"]
    with pytest.raises(AssertionError, match="names no section"):
        cited_files("No such section")
