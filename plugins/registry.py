"""The plugin registry: every built-in listed in one place, third parties by ``ref``.

A binding is a plugin name (``context_manager: stack``) or an object
``{type, ref, params}``; ``ref`` is ``module:attr`` naming a plugin class.
Param aliases are resolved here and nowhere else.
"""

from __future__ import annotations

import builtins
import importlib
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from plugins.base import ContextManager, Summarizer
from proxy.core.errors import BindingError

KINDS = ("context_manager", "summarizer")

# alias -> canonical name, in order of precedence (first present wins)
PARAM_ALIASES: dict[str, tuple[str, ...]] = {"keep_turns": ("keep_turns", "window_size", "max_turns")}


@dataclass(frozen=True)
class Binding:
    """A resolved binding: the plugin class, validated params and (summarising) the bound summariser."""

    kind: str
    type: str
    plugin: builtins.type[Any]
    params: Any
    summarizer: Binding | None = None

    def create(self) -> Any:
        if self.summarizer is not None:
            return self.plugin(self.params, self.summarizer.create())
        return self.plugin(self.params)


__all__ = ["Binding", "BindingError", "Registry", "default_registry"]


class Registry:
    def __init__(self) -> None:
        self._plugins: dict[str, dict[str, type[Any]]] = {k: {} for k in KINDS}
        self._aliases: dict[str, dict[str, str]] = {k: {} for k in KINDS}

    def register(self, kind: str, plugin: type[Any], aliases: tuple[str, ...] = ()) -> None:
        for name in (plugin.name, *aliases):
            if name in self._plugins[kind] or name in self._aliases[kind]:
                raise ValueError(f"duplicate {kind} plugin name {name!r}")
        self._plugins[kind][plugin.name] = plugin
        for alias in aliases:
            self._aliases[kind][alias] = plugin.name

    def names(self, kind: str) -> list[str]:
        return sorted([*self._plugins[kind], *self._aliases[kind]])

    def canonical(self, kind: str, name: str) -> str | None:
        if name in self._plugins[kind]:
            return name
        return self._aliases[kind].get(name)

    def resolve(self, kind: str, value: Any, path: str) -> Binding:
        """Resolve a binding written in config or in a request override."""
        if isinstance(value, str):
            value = {"type": value}
        if not isinstance(value, dict):
            raise BindingError([(path, f"expected a plugin name or {{type, ref, params}}, got {value!r}")])
        unknown = set(value) - {"type", "ref", "params"}
        if unknown:
            raise BindingError([(f"{path}.{sorted(unknown)[0]}", "unknown key (allowed: type, ref, params)")])
        plugin = self._plugin(kind, value, path)
        raw = value.get("params") or {}
        if not isinstance(raw, dict):
            raise BindingError([(f"{path}.params", f"expected a mapping, got {raw!r}")])
        raw = resolve_param_aliases(raw)
        summarizer: Binding | None = None
        if kind == "context_manager" and "summarizer" in plugin.Params.model_fields:
            summarizer = self.resolve("summarizer", raw.get("summarizer", "llm"), f"{path}.params.summarizer")
            raw = {k: v for k, v in raw.items() if k != "summarizer"}
        try:
            params = plugin.Params.model_validate(raw)
        except ValidationError as exc:
            raise BindingError(
                [(".".join([f"{path}.params", *map(str, e["loc"])]), e["msg"]) for e in exc.errors()]
            ) from None
        return Binding(kind, plugin.name, plugin, params, summarizer)

    def _plugin(self, kind: str, value: dict[str, Any], path: str) -> type[Any]:
        ref = value.get("ref")
        if ref is not None:
            return _import_ref(kind, ref, f"{path}.ref")
        name = value.get("type")
        if not isinstance(name, str):
            raise BindingError([(f"{path}.type", f"expected a plugin name, got {name!r}")])
        canonical = self.canonical(kind, name)
        if canonical is None:
            raise BindingError(
                [(f"{path}.type" if path else "type",
                  f"unknown {kind} {name!r} (known: {', '.join(self.names(kind))})")]
            )
        return self._plugins[kind][canonical]


def resolve_param_aliases(raw: dict[str, Any]) -> dict[str, Any]:
    out = dict(raw)
    for canonical, names in PARAM_ALIASES.items():
        present = [n for n in names if n in out]
        if present:
            chosen = out[present[0]]
            for n in names:
                out.pop(n, None)
            out[canonical] = chosen
    return out


def _import_ref(kind: str, ref: Any, path: str) -> type[Any]:
    if not isinstance(ref, str) or ":" not in ref:
        raise BindingError([(path, f"expected 'module:attr', got {ref!r}")])
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
        plugin = getattr(module, attr)
    except Exception as exc:  # any import failure is a config problem, named by its path
        raise BindingError([(path, f"cannot import {ref!r}: {exc}")]) from None
    base = ContextManager if kind == "context_manager" else Summarizer
    if not (isinstance(plugin, type) and issubclass(plugin, base)):
        raise BindingError([(path, f"{ref!r} is not a {base.__name__} subclass")])
    return plugin


def default_registry() -> Registry:
    """Every built-in plugin."""
    from plugins.context.observation_masking import ObservationMasking
    from plugins.context.sliding_window import SlidingWindow
    from plugins.context.stack import Stack
    from plugins.context.summarising import Summarising
    from plugins.summarizers.drop import DropSummarizer
    from plugins.summarizers.llm import LLMSummarizer

    registry = Registry()
    registry.register("context_manager", Summarising, aliases=("summarizing",))
    registry.register("context_manager", SlidingWindow, aliases=("sliding_window",))
    registry.register("context_manager", Stack, aliases=("full-history",))
    registry.register("context_manager", ObservationMasking, aliases=("mask-observations",))
    registry.register("summarizer", LLMSummarizer)
    registry.register("summarizer", DropSummarizer)
    return registry
