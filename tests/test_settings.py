"""The configuration (proxy.settings.load_config): bindings, env substitution, compaction sugar."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.core.errors import ConfigError
from proxy.settings import load_config
from tests.conftest import ROOT, base_config
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


# --------------------------------------------------------------------------- configs that load but cannot work


@pytest.mark.parametrize("url", ["http://cache:6379/0", "localhost:6379", "redis://cache:abc/0", "redis://cache/xyz",
                                 "redis://cache:99999/0", "redis://", "tcp://:s3cret-pw@cache:6379/0"])
def test_a_cache_url_that_is_not_a_redis_url_is_refused(url: str) -> None:
    """redis-py refuses such a URL only when the server starts (a traceback, exit 1): validate names it first."""
    found = problems(with_(cache={"backend": "redis", "url": url}))
    assert len(found) == 1 and found[0].startswith("cache.url: "), found
    assert "s3cret-pw" not in found[0]  # a URL's password is never echoed


@pytest.mark.parametrize("url", ["redis://cache:6379/0", "redis://cache", "rediss://:pw@cache:6380/2",
                                 "unix:///run/redis.sock", "redis://user:pw@[::1]:6379/1"])
def test_redis_urls_redis_py_accepts_are_accepted(url: str) -> None:
    assert load_config(with_(cache={"backend": "redis", "url": url}), env={}).settings.cache.url == url


MODELS = [{"name": "big", "context_window": 8000}, {"name": "mini", "context_window": 8000}]
CLOSED = with_(models=MODELS, allow_unknown_models=False)
TENANT = {"name": "t", "keys": ["k-1"]}
LLM_MODEL = {"type": "summarising", "params": {"summarizer": {"type": "llm", "params": {"model": "gone"}}}}


@pytest.mark.parametrize(("extra", "path"), [
    ({"summarizer_model": "gone"}, "summarizer_model"),
    ({"tenants": [TENANT, {**TENANT, "name": "u", "keys": ["k-2"], "summarizer_model": "gone"}]},
     "tenants[1].summarizer_model"),
    ({"context_manager": LLM_MODEL}, "context_manager.params.summarizer.params.model"),
    ({"tenants": [{**TENANT, "context_manager": LLM_MODEL}]},
     "tenants[0].context_manager.params.summarizer.params.model"),
])
def test_a_summariser_model_without_a_route_is_refused(extra: dict[str, Any], path: str) -> None:
    """With allow_unknown_models: false a summariser model must be a configured one, or every summary fails."""
    found = problems({**CLOSED, **extra})
    assert found == [f"{path}: 'gone' is not a configured model, and allow_unknown_models is false: "
                     "every summary would fail"]
    load_config({**CLOSED, **extra, "allow_unknown_models": True}, env={})  # any name routes then


def test_a_configured_summariser_model_is_accepted() -> None:
    binding = {"type": "summarising", "params": {"summarizer": {"type": "llm", "params": {"model": "mini"}}}}
    config = load_config({**CLOSED, "summarizer_model": "mini", "context_manager": binding,
                          "tenants": [{**TENANT, "summarizer_model": "big", "context_manager": binding}]}, env={})
    assert config.settings.summarizer_model == "mini"


DUPLICATED = """\
upstreams:
  u: {base_url: "http://127.0.0.1:9"}
cache: {backend: memory}
tenants:
  - name: t
    keys: [k-1]
    max_context_tokens: 1000
    models: [a]
    max_context_tokens: 900000
models:
  - {name: a, context_window: 8000}
cache: {backend: disk}
"""


def test_a_key_written_twice_is_refused_with_its_path_and_lines(tmp_path: Path) -> None:
    """YAML keeps the last of two equal keys silently: 1000 then 900000 gave a cap of 900000."""
    path = tmp_path / "c.yaml"
    path.write_text(DUPLICATED)
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert info.value.problems == [
        "tenants[0].max_context_tokens: written twice (lines 7 and 9); YAML would silently keep the last",
        "cache: written twice (lines 3 and 12); YAML would silently keep the last",
    ]


@pytest.mark.parametrize("text", [
    # a merge key overrides what it merges: that is not a duplicate
    "base: &b {base_url: 'http://127.0.0.1:9'}\nupstreams:\n  u:\n    <<: *b\n    base_url: 'http://127.0.0.1:8'\n",
    # the same key in two different mappings, and one node reached twice through an alias
    "upstreams:\n  u: &u {base_url: 'http://127.0.0.1:9'}\n  v: *u\nmodels: [{name: a}, {name: b}]\n",
])
def test_keys_that_only_look_repeated_are_not_duplicates(tmp_path: Path, text: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    try:
        load_config(path, env={})
    except ConfigError as exc:  # `base` is not a config key; nothing else may be wrong
        assert exc.problems == ["base: Extra inputs are not permitted"]


@pytest.mark.parametrize("text", ["upstreams: {u: {base_url: 'http://127.0.0.1:9'}}\nx: &x {a: 1, self: *x}\n",
                                  "x: " + "[" * 5000 + "]" * 5000 + "\n"], ids=["self-alias", "deep"])
def test_a_config_nested_in_itself_or_too_deep_is_refused_in_one_line(tmp_path: Path, text: str) -> None:
    """Both used to end ``validate`` and ``serve`` in a RecursionError traceback."""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert len(info.value.problems) == 1 and "nested too deeply" in info.value.problems[0]


# --------------------------------------------------------------------------- upstreams' model patterns


@pytest.mark.parametrize(("models", "why"), [
    ([""], "a model pattern is empty"),
    (["  "], "a model pattern is empty"),
    ([" claude-*"], "may not start or end with a space"),
    ("claude-*", "valid list"),
])
def test_a_bad_model_pattern_names_its_upstream(models: Any, why: str) -> None:
    raw = with_(upstreams={"u": {"base_url": "http://127.0.0.1:9", "models": models}})
    found = problems(raw)
    assert len(found) == 1 and found[0].startswith("upstreams.u.models") and why in found[0], found


def test_one_pattern_on_two_upstreams_is_refused() -> None:
    """A model goes to one upstream: the same pattern on two would send it to whichever is listed first."""
    raw = with_(upstreams={"a": {"base_url": "http://127.0.0.1:9", "models": ["claude-*"]},
                           "b": {"base_url": "http://127.0.0.1:10", "models": ["gpt-*", "claude-*"]}})
    assert problems(raw) == ["upstreams.b.models: 'claude-*' is also upstream 'a''s (a model goes to one upstream)"]


def test_the_first_matching_upstream_takes_a_model_and_routes_name_their_own() -> None:
    config = load_config(with_(upstreams={
        "default": {"base_url": "http://127.0.0.1:9"},
        "wide": {"base_url": "http://127.0.0.1:10", "models": ["claude-*"]},
        "narrow": {"base_url": "http://127.0.0.1:11", "models": ["claude-haiku-*"]},
    }, default_upstream="default"), env={})
    assert config.upstream_for("claude-haiku-4-5") == "wide"  # file order decides where patterns overlap
    assert config.upstream_for("claude-sonnet-4-5") == "wide"
    assert config.upstream_for("gpt-4o") == "default"
    assert config.upstream_for("Claude-sonnet-4-5") == "default"  # case matters, as in the providers' names


@pytest.mark.parametrize(("host", "url"), [
    ("127.0.0.1", "http://127.0.0.1:8080/v1"),
    ("127.0.0.1", "http://localhost:8080"),
    ("0.0.0.0", "http://127.0.0.1:8080/v1"),
    ("0.0.0.0", "http://[::1]:8080/v1"),
    ("::", "http://127.0.0.2:8080/v1"),
    ("127.0.0.1", "http://0.0.0.0:8080/v1"),  # a connection to the unspecified address reaches this host
    ("127.0.0.1", "http://LOCALHOST:8080/v1"),
    ("127.0.0.1", "http://[::ffff:127.0.0.1]:8080/v1"),
    ("127.0.0.1", "http://127.1:8080/v1"),  # a shorthand the resolver expands
    ("10.1.2.3", "http://10.1.2.3:8080/v1"),
])
def test_an_upstream_at_the_proxys_own_address_is_refused(host: str, url: str) -> None:
    """Every request would come back to the proxy, each one opening another connection to itself."""
    found = problems(with_(server={"host": host, "port": 8080}, upstreams={"u": {"base_url": url}}))
    assert len(found) == 1 and found[0].startswith("upstreams.u.base_url: ") and "own address" in found[0]


@pytest.mark.parametrize(("host", "port", "url"), [
    ("127.0.0.1", 8080, "http://127.0.0.1:8081/v1"),  # another port
    ("127.0.0.1", 8080, "http://10.1.2.3:8080/v1"),  # another host: the proxy listens on loopback only
    ("10.1.2.3", 8080, "http://127.0.0.1:8080/v1"),  # the proxy is not on loopback
    ("127.0.0.1", 0, "http://127.0.0.1:8080/v1"),  # a port chosen at start
    ("127.0.0.1", 80, "https://127.0.0.1/v1"),  # https's default port is 443
])
def test_an_upstream_elsewhere_is_accepted(host: str, port: int, url: str) -> None:
    load_config(with_(server={"host": host, "port": port}, upstreams={"u": {"base_url": url}}), env={})


MODE_PLACES = [
    ({"mode": "shadow"}, "mode"),
    ({"models": [{"name": "m", "mode": "OBSERVE"}]}, "models[0].mode"),
    ({"tenants": [{"name": "t", "keys": ["k"], "mode": False}]}, "tenants[0].mode"),  # YAML's `off`
]


@pytest.mark.parametrize(("extra", "path"), MODE_PLACES)
def test_a_mode_other_than_observe_or_enforce_is_refused_with_its_path(extra: dict[str, Any], path: str) -> None:
    found = problems(with_(**extra))
    assert len(found) == 1 and found[0].startswith(f"{path}:") and "'observe' or 'enforce'" in found[0], found


def test_mode_is_read_at_every_level_and_defaults_to_enforce() -> None:
    cfg = load_config(with_(mode="observe", models=[{"name": "m", "mode": "enforce"}],
                            tenants=[{"name": "t", "keys": ["k"], "mode": "observe"}]), env={})
    assert (cfg.settings.mode, cfg.settings.models[0].mode, cfg.tenants[0].settings.mode) == (
        "observe", "enforce", "observe")
    plain = load_config(with_(models=[{"name": "m"}], tenants=[{"name": "t", "keys": ["k"]}]), env={})
    assert (plain.settings.mode, plain.settings.models[0].mode, plain.tenants[0].settings.mode) == (
        "enforce", None, None)


TENANT_KEY = "sk-tenant-acme-7f3a"


def validate(tmp_path: Path, cfg: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return subprocess.run([sys.executable, "-m", "proxy.cli", "validate", str(path)], cwd=ROOT, text=True,
                          capture_output=True, timeout=60)


@pytest.mark.usefixtures("shared_model_map")
def test_validate_rejects_an_admin_key_equal_to_a_tenant_key(tmp_path: Path) -> None:
    """An admin key that is also a tenant's key is a config error (exit 2, naming the key path)."""
    cfg = base_config("http://127.0.0.1:9/v1", tenants=[{"name": "acme", "keys": [TENANT_KEY]}],
                      admin={"keys": [TENANT_KEY]})
    done = validate(tmp_path, cfg)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "admin.keys" in done.stderr
    assert TENANT_KEY not in done.stderr + done.stdout  # and the key itself is never printed


@pytest.mark.usefixtures("shared_model_map")
def test_validate_accepts_distinct_admin_and_tenant_keys(tmp_path: Path) -> None:
    """Distinct admin and tenant keys validate."""
    cfg = base_config("http://127.0.0.1:9/v1", tenants=[{"name": "acme", "keys": [TENANT_KEY]}],
                      admin={"keys": ["adm-different-key"]})
    done = validate(tmp_path, cfg)
    assert (done.returncode, done.stdout.strip()) == (0, "ok"), done.stderr
