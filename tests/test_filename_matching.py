"""tests/ mirrors the sources file for file, so a module's tests are found where its name says.

The rule: ``tests/<path>/test_<name>.py`` tests ``proxy/<path>/<name>.py`` (or the package
``proxy/<path>/<name>/``, or a data file such as ``proxy/openapi.yaml``); ``tests/plugins/...`` mirrors
``plugins/...`` and ``tests/bench/...`` mirrors ``bench/...`` the same way. A topic may follow the name
(``tests/store/test_summaries_redis.py`` tests ``proxy/store/summaries.py`` through a real redis-server).
A test file that matches no source is a suite that spans subjects, and is named in ``CROSS_CUTTING`` with
the reason; anything else is a test filed by the review that found its bug instead of by its subject.
(After mitmproxy's test/filename_matching.py.)
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
# where tests/<first part>/... finds its sources; everything else mirrors proxy/
SOURCE_ROOTS = {"plugins": ROOT / "plugins", "bench": ROOT / "bench"}

# Suites that span subjects by design, each with its reason. Keep this short.
CROSS_CUTTING = {
    "agents": "real agents and SDKs (Codex, Claude Code, the Agents SDK, LangChain) driving the whole proxy",
    "check": "`make check`: the container, a real LLM server, replicas behind nginx",
    "deploy": "the deployment files (compose, nginx, Prometheus, Grafana, Dockerfile, Makefile, .ci)",
    "test_architecture.py": "the layering of every package",
    "test_docs.py": "the documentation's references, repository-wide",
    "test_filename_matching.py": "this rule itself",
    "test_security.py": "security properties that must hold on every path at once (keys, tenants, upstream choice)",
    "test_observability.py": "metrics, explain and request logs of the same real runs, checked against each other",
    "test_reliability_input.py": "hostile and fuzzed bodies against every managed path, bounded time and memory",
    "wire/test_errors.py": "each wire's error module against the same error tree, side by side",
}


def source_dir(parts: tuple[str, ...]) -> Path:
    if parts and parts[0] in SOURCE_ROOTS:
        return SOURCE_ROOTS[parts[0]].joinpath(*parts[1:])
    return ROOT.joinpath("proxy", *parts)


def subjects(directory: Path) -> set[str]:
    """The names a test file in the mirrored folder may be named after: modules, packages, data files."""
    if not directory.is_dir():
        return set()
    return {p.stem if p.is_file() else p.name for p in directory.iterdir()
            if (p.is_file() and p.suffix in (".py", ".yaml") and p.stem != "__init__")
            or (p.is_dir() and (p / "__init__.py").is_file())}


def matches(name: str, names: set[str]) -> bool:
    """``name`` is one of ``names``, or one of them followed by ``_<topic>``."""
    return any(name == s or name.startswith(s + "_") for s in names)


def allowed(rel: Path) -> bool:
    return rel.parts[0] in CROSS_CUTTING or rel.as_posix() in CROSS_CUTTING


def unmatched() -> list[str]:
    out = []
    for path in sorted(TESTS.rglob("test_*.py")):
        rel = path.relative_to(TESTS)
        if allowed(rel):
            continue
        name = path.stem.removeprefix("test_")
        if not matches(name, subjects(source_dir(rel.parts[:-1]))):
            out.append(rel.as_posix())
    return out


def test_every_test_file_is_named_after_its_subject() -> None:
    """A test file sits where its subject's source sits, named after it; a cross-cutting suite says why."""
    assert unmatched() == [], "no source file matches (rename it after its subject, or explain it in CROSS_CUTTING)"


def test_the_allow_list_names_only_what_exists() -> None:
    """An allow-list entry for a suite that was moved or merged must go too."""
    stale = [name for name in CROSS_CUTTING if not (TESTS / name).exists()]
    assert stale == []


def test_the_rule_matches_as_documented() -> None:
    """The examples of the module docstring hold, and a review-named file does not match."""
    assert "summaries" in subjects(source_dir(("store",)))
    assert "chat" in subjects(source_dir(("wire",)))  # a package
    assert "openapi" in subjects(source_dir(()))  # a data file
    assert "masking" in subjects(source_dir(("plugins",)))
    assert matches("summaries_redis", subjects(source_dir(("store",))))  # a topic after the name
    assert not matches("defects_review", subjects(source_dir(())))
