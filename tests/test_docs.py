"""The documentation's references resolve: every cited heading exists, every relative link reaches a file.

Code, config and docs cite the design by its heading anchors (``docs/design.md#4-the-budget``, as GitHub
renders them) instead of section numbers, which went wrong the day the sections were renumbered; this test
is what keeps an anchor from rotting the same way when a heading changes.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
MARKDOWN = [ROOT / "README.md", *DOCS]
# where a file may cite a document by anchor: sources, tests, config and docs (not data or payloads)
CITING_DIRS = ("proxy", "plugins", "tests", "config", "bench", "docs", "deploy", ".ci")
CITING_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".cfg", ".txt"}
CITING_FILES = ("README.md", "Makefile", "pyproject.toml", "Dockerfile", "compose.yaml")
SKIPPED_DIRS = {"data", "payloads", "results", "__pycache__"}

_FENCE = re.compile(r"^(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_CITED = re.compile(r"(?<![\w/.-])((?:docs/)?[\w.-]+\.md)#([\w-]+)")
# the design's old numbered citations, a tracker that is not in the repository, and a style guide that is not either
_STALE = re.compile(r"DESIGN\s*§|STYLE\s+\d")


def slug(heading: str) -> str:
    """A heading's anchor as GitHub renders it: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"<[^>]+>", "", heading)  # inline HTML
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link keeps its text
    text = text.replace("`", "").replace("*", "").strip().lower()
    kept = "".join(ch for ch in text if ch in " -_" or unicodedata.category(ch)[0] in "LN")
    return kept.replace(" ", "-")


def prose_lines(path: Path) -> list[str]:
    """A markdown file's lines outside fenced code blocks (a ``#`` there is a shell comment, not a heading)."""
    out, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line.strip()):
            fenced = not fenced
            continue
        out.append("" if fenced else line)
    return out


def anchors(path: Path) -> set[str]:
    """Every anchor a markdown file's headings give, duplicates numbered as GitHub numbers them."""
    seen: Counter[str] = Counter()
    found: set[str] = set()
    for line in prose_lines(path):
        match = _HEADING.match(line)
        if match is None:
            continue
        base = slug(match.group(2))
        found.add(base if not seen[base] else f"{base}-{seen[base]}")
        seen[base] += 1
    return found


def citing_files() -> list[Path]:
    files = [ROOT / name for name in CITING_FILES if (ROOT / name).is_file()]
    for top in CITING_DIRS:
        for path in sorted((ROOT / top).rglob("*")):
            rel = path.relative_to(ROOT).parts
            if path.is_file() and path.suffix in CITING_SUFFIXES and not SKIPPED_DIRS & set(rel):
                files.append(path)
    return files


def relative_links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link in a markdown file that points inside the repository."""
    links = []
    for number, line in enumerate(prose_lines(path), 1):
        line = re.sub(r"`[^`]*`", "", line)  # a link written inside code is an example, not a link
        for target in _LINK.findall(line):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, mailto: ...
                links.append((number, target))
    return links


def test_slug_matches_github() -> None:
    """The anchor rule is GitHub's, checked on the kinds of heading the docs have."""
    assert slug("4. The budget") == "4-the-budget"
    assert slug("2. One request's path") == "2-one-requests-path"
    assert slug("Reuse: content-addressed and persistent") == "reuse-content-addressed-and-persistent"
    assert slug("`--workers N`") == "--workers-n"
    assert slug("Calibration and cost") == "calibration-and-cost"


def test_every_cited_anchor_exists() -> None:
    """A document cited by anchor in code, config, tests or docs has a heading with that anchor."""
    problems = []
    known: dict[Path, set[str]] = {}
    for path in citing_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            for doc, anchor in _CITED.findall(line):
                target = ROOT / doc if doc.startswith("docs/") or doc == "README.md" else path.parent / doc
                if not target.is_file():
                    target = ROOT / "docs" / doc
                if not target.is_file():
                    problems.append(f"{path.relative_to(ROOT)}:{number}: {doc} does not exist")
                    continue
                if target not in known:
                    known[target] = anchors(target)
                if anchor not in known[target]:
                    problems.append(f"{path.relative_to(ROOT)}:{number}: {doc} has no heading #{anchor}")
    assert not problems, "\n".join(problems)


def test_design_citations_name_a_heading() -> None:
    """The design is cited by anchor, never by a section number, and no file cites a style guide by number."""
    stale = [f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}"
             for path in citing_files()
             for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
             if _STALE.search(line) and path != Path(__file__).resolve()]
    assert not stale, "\n".join(stale)


@pytest.mark.parametrize("doc", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    """Every relative link of the README and docs/ reaches a file of the repository, and its heading when it
    names one."""
    problems = []
    for number, target in relative_links(doc):
        where, _, anchor = target.partition("#")
        path = (doc.parent / where).resolve() if where else doc
        if not path.exists():
            problems.append(f"{number}: {target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            problems.append(f"{number}: {target}: no heading #{anchor} in {path.relative_to(ROOT)}")
        elif anchor and path.suffix != ".md":
            problems.append(f"{number}: {target}: an anchor into a file that is not markdown")
    assert not problems, f"{doc.relative_to(ROOT)}:\n" + "\n".join(problems)


# A tracker's number ("issue 17", "Item 9:") where a reason belongs, in any file of the repository that
# citing_files() reads (sources, tests, config, docs, the build's files; not data or payloads).
_TRACKER = re.compile(r"\b(?:issues?\s+#?\d+|items?\s+\d+(?:\.\d+)?\s*[:(])", re.IGNORECASE)


def test_comments_give_reasons_not_issue_numbers() -> None:
    """A comment or doc says why in words: a tracker's number means nothing to a reader without that tracker."""
    problems = [f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}"
                for path in citing_files()
                for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
                if _TRACKER.search(line) and path != Path(__file__).resolve()]
    assert not problems, "\n".join(problems)


# A test cited in a document: `tests/serve/test_relay.py::test_name`, `serve/test_relay.py::test_name` (docs
# that cite from tests/), or `::test_name` after such a citation on the same line.
_TEST_REF = re.compile(r"^((?:tests/)?(?:\w+/)*test_\w+\.py)?::(test_\w+)")


def defined_tests(path: Path) -> set[str]:
    return set(re.findall(r"^(?:async )?(?:def|class) (test_\w+|Test\w+)", path.read_text(encoding="utf-8"), re.M))


@pytest.mark.parametrize("doc", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_cited_tests_exist(doc: Path) -> None:
    """A test a document cites as its evidence exists in the file it names: moving or renaming a test must
    not leave the docs pointing at nothing."""
    problems = []
    for number, line in enumerate(prose_lines(doc), 1):
        last: str | None = None
        for code in re.findall(r"`([^`]*)`", line):
            ref = _TEST_REF.match(code)
            if not ref:
                continue
            name = ref.group(2)
            cited = ref.group(1) or last
            if cited is None:
                continue
            last = cited
            path = ROOT / (cited if cited.startswith("tests/") else "tests/" + cited)
            if not path.is_file():
                problems.append(f"{number}: {cited}: no such file")
            elif name not in defined_tests(path):
                problems.append(f"{number}: {cited} has no {name}")
    assert not problems, f"{doc.relative_to(ROOT)}:\n" + "\n".join(problems)
