"""The docs stay one contract: docs/algorithm.md states the protocol as it is (bounded in
length, no dated history: that lives in benchmarks/HISTORY.md), every doc the code cites
exists, every section of docs/algorithm.md a citation names is a heading there, every
anchor link into docs/algorithm.md resolves, and nothing cites a design file kept outside the
repository."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALGORITHM = ROOT / "docs" / "algorithm.md"
#: The most lines docs/algorithm.md may hold (issue 47: the protocol, not its history).
ALGORITHM_MAX_LINES = 600
#: Where the repository's own text lives: every file under these is scanned.
SCANNED = ("src", "tests", "docs", "benchmarks", "examples", "deploy", "README.md", "Makefile")
TEXT_SUFFIXES = {".py", ".md", ".txt", ".toml", ".yaml", ".yml", ".cfg", ".sh", ".json", ""}
#: Built from parts so that this file does not match itself.
FOREIGN_DESIGN = ("DESIGN" + ".md", "DESIGN" + " §")
#: A date, a "What changed" section or a "since issue N": history, not contract.
DATED = re.compile(r"20\d\d-\d\d-\d\d|what changed|since issue \d", re.IGNORECASE)
DOC_PATH = re.compile(r"\bdocs/[\w.-]+\.md\b")
#: The path of docs/algorithm.md, then a comma or not, then a section title in double quotes
#: (the path may be in backticks), matched after whitespace was collapsed so that a citation
#: may wrap lines.
SECTION_CITATION = re.compile(r"algorithm\.md`{0,2},?\s\"([^\"]+)\"")
ANCHOR_LINK = re.compile(r"algorithm\.md#([\w-]+)")


def _text_files(*roots: str) -> list[Path]:
    files = []
    for name in roots:
        path = ROOT / name
        candidates = [path] if path.is_file() else sorted(path.rglob("*"))
        for candidate in candidates:
            if (
                candidate.is_file()
                and "__pycache__" not in candidate.parts
                and candidate.suffix in TEXT_SUFFIXES
            ):
                files.append(candidate)
    return files


def _headings() -> list[str]:
    lines = ALGORITHM.read_text(encoding="utf-8").splitlines()
    return [line.lstrip("#").strip() for line in lines if re.match(r"#{1,6} ", line)]


def _names_of(heading: str) -> set[str]:
    """A heading is cited by its whole text or by the part before " (" or ":"."""
    names = {heading}
    for separator in (" (", ":"):
        if separator in heading:
            names.add(heading.split(separator, 1)[0])
    return names


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def test_algorithm_doc_is_bounded():
    lines = ALGORITHM.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= ALGORITHM_MAX_LINES, (
        f"docs/algorithm.md has {len(lines)} lines (at most {ALGORITHM_MAX_LINES}): "
        "move measurements to benchmarks/RESULTS.md and history to benchmarks/HISTORY.md"
    )


def test_algorithm_doc_holds_no_dated_history():
    lines = ALGORITHM.read_text(encoding="utf-8").splitlines()
    dated = [f"{n}: {line}" for n, line in enumerate(lines, 1) if DATED.search(line)]
    assert not dated, "dated history in docs/algorithm.md (belongs in HISTORY.md):\n" + (
        "\n".join(dated[:20])
    )


def test_no_foreign_design_file_is_cited():
    hits = []
    for path in _text_files(*SCANNED):
        text = path.read_text(encoding="utf-8", errors="replace")
        for n, line in enumerate(text.splitlines(), 1):
            if any(needle in line for needle in FOREIGN_DESIGN):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "cite the project's own docs instead:\n" + "\n".join(hits)


def test_every_doc_the_code_cites_exists():
    missing = []
    for path in _text_files("src", "tests"):
        for cited in DOC_PATH.findall(path.read_text(encoding="utf-8")):
            if not (ROOT / cited).is_file():
                missing.append(f"{path.relative_to(ROOT)}: {cited}")
    assert not missing, "cited docs that do not exist:\n" + "\n".join(missing)


def test_every_cited_algorithm_section_is_a_heading():
    names = set().union(*(_names_of(heading) for heading in _headings()))
    broken = []
    for path in _text_files(*SCANNED):
        text = " ".join(path.read_text(encoding="utf-8", errors="replace").split())
        for title in SECTION_CITATION.findall(text):
            if title not in names:
                broken.append(f"{path.relative_to(ROOT)}: {title!r}")
    assert not broken, "sections of docs/algorithm.md cited but not headings:\n" + (
        "\n".join(broken)
    )


def test_every_algorithm_anchor_resolves():
    anchors = {_slug(heading) for heading in _headings()}
    broken = []
    for path in _text_files(*SCANNED):
        for anchor in ANCHOR_LINK.findall(path.read_text(encoding="utf-8", errors="replace")):
            if anchor not in anchors:
                broken.append(f"{path.relative_to(ROOT)}: #{anchor}")
    assert not broken, "links to anchors docs/algorithm.md does not have:\n" + "\n".join(broken)
