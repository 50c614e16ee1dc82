"""The layers of docs/architecture.md hold: no import runs upward, and the module graph has no circle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# bottom to top; a module may import only from its own layer or the ones below
LAYERS: list[tuple[str, ...]] = [
    ("proxy.core",),
    ("plugins",),
    ("proxy.settings", "proxy.policy", "proxy.pipeline", "proxy.runtime"),
    ("proxy.wire",),
    ("proxy.upstream",),
    ("proxy.store",),
    ("proxy.serve",),
    ("proxy.cli", "proxy"),
]


def layer_of(module: str) -> int:
    best, level = -1, -1
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, level = len(prefix), i
    return level


def modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for folder in ("proxy", "plugins"):
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imports(path: Path, known: set[str]) -> set[str]:
    """Every proxy/plugins module ``path`` imports, at any depth (function-level and TYPE_CHECKING included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports(path, known) - {name} for name, path in mods.items()}


def test_every_module_has_a_layer() -> None:
    assert [m for m in modules() if layer_of(m) < 0] == []


def test_no_import_runs_upward() -> None:
    upward = [f"{m} -> {d}" for m, deps in graph().items() for d in deps
              if d != "proxy" and layer_of(d) > layer_of(m)]
    assert upward == []


def test_the_import_graph_has_no_circle() -> None:
    g = graph()
    g = {m: {d for d in deps if d != "proxy"} for m, deps in g.items()}  # the package marker imports nothing
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for d in sorted(g.get(m, ())):
            if state.get(d) == 1:
                return [*path[path.index(d):], d]
            if d not in state and (cycle := visit(d)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(g):
        if m not in state:
            cycle = visit(m)
            assert cycle is None, " -> ".join(cycle)


def test_a_wire_imports_only_the_core() -> None:
    """proxy/wire is pure functions of bodies: a translator stands on the vocabulary (proxy/core) alone, so what
    runs around a request (runtime, pipeline, policy, settings, summarisers, stores) lives above it."""
    outside = [f"{m} -> {d}" for m, deps in graph().items() if m.startswith("proxy.wire") for d in deps
               if not (d.startswith("proxy.core") or d.startswith("proxy.wire"))]
    assert outside == []


def test_a_wire_package_imports_no_other_wires() -> None:
    """Each wire's package owns its protocol: it shares the wire-neutral modules (proxy/wire/*.py), not another
    wire's code."""
    packages = {p.name for p in (ROOT / "proxy" / "wire").iterdir() if (p / "__init__.py").exists()}

    def package(module: str) -> str | None:
        parts = module.split(".")
        return parts[2] if len(parts) >= 3 and parts[:2] == ["proxy", "wire"] and parts[2] in packages else None

    crossing = [f"{m} -> {d}" for m, deps in graph().items() if package(m) for d in deps
                if package(d) and package(d) != package(m)]
    assert crossing == []
