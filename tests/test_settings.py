"""The configuration (proxy.settings.load_config): bindings, env substitution, compaction sugar."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.core.errors import ConfigError
from proxy.settings import load_config
from tests.helpers import REPO

BASE: dict[str, Any] = {"upstreams": {"u": {"base_url": "http://127.0.0.1:9"}}, "cache": {"backend": "memory"}}


def problems(raw: dict[str, Any], env: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(raw, env=env or {})
    assert info.value.problems
    return info.value.problems


def with_(**extra: Any) -> dict[str, Any]:
    return {**BASE, **extra}


# --------------------------------------------------------------------------- bindings


@pytest.mark.parametrize(
    ("binding", "path"),
    [
        (42, "context_manager"),
        ([1, 2], "context_manager"),
        (True, "context_manager"),
        ("lru", "context_manager.type"),
        ({"type": "nope"}, "context_manager.type"),
        ({"type": 3}, "context_manager.type"),
        ({"type": "stack", "params": {"bogus": 1}}, "context_manager.params.bogus"),
        ({"type": "stack", "params": {"max_messages": 0}}, "context_manager.params.max_messages"),
        ({"type": "stack", "params": {"max_messages": "many"}}, "context_manager.params.max_messages"),
        ({"type": "sliding-window", "params": {"keep_turns": 0}}, "context_manager.params.keep_turns"),
        ({"type": "summarising", "params": {"hysteresis_ratio": 2}}, "context_manager.params.hysteresis_ratio"),
        ({"type": "summarising", "params": {"summarizer": "gpt"}}, "context_manager.params.summarizer.type"),
        ({"type": "summarising", "params": {"summarizer": {"type": "llm", "params": {"temp": 1}}}},
         "context_manager.params.summarizer.params.temp"),
        ({"type": "stack", "params": [1]}, "context_manager.params"),
        ({"type": "stack", "extra": 1}, "context_manager.extra"),
        ({"ref": "no_such_module_xyz:Plugin"}, "context_manager.ref"),
        ({"ref": "plugins.context.stack:NoSuchClass"}, "context_manager.ref"),
        ({"ref": "plugins.context.stack"}, "context_manager.ref"),
        ({"ref": "proxy.settings:Settings"}, "context_manager.ref"),
    ],
)
def test_bad_context_manager_names_its_key_path(binding: Any, path: str) -> None:
    found = problems(with_(context_manager=binding))
    assert len(found) == 1
    assert found[0].startswith(path + ":"), found


def test_ref_to_a_real_plugin_class_is_accepted() -> None:
    cfg = load_config(with_(context_manager={"ref": "plugins.context.stack:Stack", "params": {"max_messages": 5}}),
                      env={})
    assert cfg.context_manager.type == "stack" and cfg.context_manager.params.max_messages == 5


def test_tenant_binding_errors_name_the_tenant() -> None:
    raw = with_(tenants=[{"name": "a", "keys": ["k1"]}, {"name": "b", "keys": ["k2"], "context_manager": 42}])
    found = problems(raw)
    assert found[0].startswith("tenants[1].context_manager:"), found


def test_unknown_top_level_key_and_several_problems_at_once() -> None:
    found = problems(with_(contex_manager="stack", trimmer={"reserve_tokens": -1}))
    assert any(p.startswith("contex_manager:") for p in found)
    assert any(p.startswith("trimmer.reserve_tokens:") for p in found)


@pytest.mark.parametrize("name", ["stack", "full-history", "sliding-window", "sliding_window", "summarising",
                                  "summarizing"])
def test_plugin_names_and_aliases(name: str) -> None:
    cfg = load_config(with_(context_manager=name), env={})
    assert cfg.context_manager.type in {"stack", "sliding-window", "summarising"}


def test_default_is_summarising_with_llm() -> None:
    cfg = load_config(BASE, env={})
    assert cfg.context_manager.type == "summarising"
    assert cfg.context_manager.summarizer is not None and cfg.context_manager.summarizer.type == "llm"
    assert cfg.context_manager.params.keep_turns == 10


# --------------------------------------------------------------------------- environment


def test_env_substitution_with_and_without_defaults(tmp_path: Path) -> None:
    text = """
server:
  port: ${PORT:-9191}
  host: ${HOST}
upstreams:
  u:
    base_url: ${BASE_URL:-http://127.0.0.1:9}/v1
    api_key: ${KEY:-}
cache: {backend: memory}
context_manager: ${CM:-stack}
"""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    cfg = load_config(path, env={"HOST": "0.0.0.0"})
    assert cfg.settings.server.port == 9191 and cfg.settings.server.host == "0.0.0.0"
    assert cfg.settings.upstreams["u"].base_url == "http://127.0.0.1:9/v1"
    assert cfg.settings.upstreams["u"].api_key is None
    assert cfg.context_manager.type == "stack"
    cfg = load_config(path, env={"HOST": "h", "PORT": "7000", "CM": "sliding-window", "KEY": "sk-x",
                                 "BASE_URL": "https://api.example.com"})
    assert cfg.settings.server.port == 7000
    assert cfg.settings.upstreams["u"].base_url == "https://api.example.com/v1"
    assert cfg.settings.upstreams["u"].api_key == "sk-x"
    assert cfg.context_manager.type == "sliding-window"


def test_missing_env_var_is_reported_with_its_key_path() -> None:
    raw = {"upstreams": {"u": {"base_url": "http://127.0.0.1:9", "api_key": "${UPSTREAM_KEY}"}},
           "tenants": [{"name": "t", "keys": ["${TEAM_KEY}"]}], "cache": {"backend": "memory"}}
    found = problems(raw)
    assert any(p.startswith("upstreams.u.api_key:") and "UPSTREAM_KEY" in p for p in found), found
    assert any(p.startswith("tenants[0].keys[0]:") and "TEAM_KEY" in p for p in found), found


def test_env_default_may_be_empty_and_env_value_wins_over_default() -> None:
    raw = with_(summarizer_model="${SUMMARY_MODEL:-gpt-4o-mini}")
    assert load_config(raw, env={}).settings.summarizer_model == "gpt-4o-mini"
    assert load_config(raw, env={"SUMMARY_MODEL": "gpt-4.1"}).settings.summarizer_model == "gpt-4.1"


# --------------------------------------------------------------------------- compaction sugar


@pytest.mark.parametrize(
    ("compaction", "type_", "params"),
    [
        ({"strategy": "keep_recent", "max_messages": 40}, "stack", {"max_messages": 40}),
        ({"strategy": "keep_recent"}, "stack", {"max_messages": None}),
        ({"strategy": "sliding_window", "window_size": 6}, "sliding-window", {"keep_turns": 6}),
        ({"strategy": "sliding_window"}, "sliding-window", {"keep_turns": 10}),
        ({"strategy": "summarize", "summary_threshold": 5000, "keep_turns": 4}, "summarising",
         {"summary_threshold": 5000, "keep_turns": 4}),
        ({"strategy": "summarize"}, "summarising", {"summary_threshold": 0, "keep_turns": 10}),
    ],
)
def test_working_memory_compaction_sugar(compaction: dict[str, Any], type_: str, params: dict[str, Any]) -> None:
    cfg = load_config(with_(working_memory={"compaction": compaction}), env={})
    assert cfg.context_manager.type == type_
    for key, value in params.items():
        assert getattr(cfg.context_manager.params, key) == value


def test_context_manager_wins_over_compaction_sugar() -> None:
    raw = with_(working_memory={"compaction": {"strategy": "keep_recent", "max_messages": 5}},
                context_manager={"type": "sliding-window", "params": {"keep_turns": 3}})
    cfg = load_config(raw, env={})
    assert cfg.context_manager.type == "sliding-window" and cfg.context_manager.params.keep_turns == 3


def test_bad_compaction_strategy_is_named() -> None:
    found = problems(with_(working_memory={"compaction": {"strategy": "forget"}}))
    assert found[0].startswith("working_memory.compaction.strategy:"), found


def test_bad_sugar_value_names_the_sugar_path() -> None:
    found = problems(with_(working_memory={"compaction": {"strategy": "keep_recent", "max_messages": -3}}))
    assert found[0].startswith("working_memory.compaction"), found


# --------------------------------------------------------------------------- shipped configs


def _config_files() -> list[Path]:
    return sorted((REPO / "config").glob("*.yaml"))


def _env_for(path: Path) -> dict[str, str]:
    """A value for every ${VAR} without a default, so examples that require secrets still validate."""
    names = re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", path.read_text(encoding="utf-8"))
    return {n: f"test-value-{n.lower()}" for n in names}


def test_there_are_config_files() -> None:
    assert any(p.name == "ctxproxy.yaml" for p in _config_files())


@pytest.mark.parametrize("path", _config_files(), ids=lambda p: p.name)
def test_every_shipped_config_loads(path: Path) -> None:
    assert isinstance(yaml.safe_load(path.read_text(encoding="utf-8")), dict)
    cfg = load_config(path, env=_env_for(path))
    assert cfg.context_manager is not None


@pytest.mark.parametrize("compaction", [{"strategy": "keep_recent", "max_messages": 0},
                                        {"strategy": "sliding_window", "window_size": 0}])
def test_zero_in_compaction_sugar_is_rejected_like_in_params(compaction: dict[str, Any]) -> None:
    found = problems(with_(working_memory={"compaction": compaction}))
    assert found[0].startswith("working_memory.compaction"), found
