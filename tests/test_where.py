"""``ctxproxy where``: what ``make run`` prints before serving, read from the config about to be served.

Run as ``make run`` runs it (``python -m proxy.cli where --config FILE``, a real process, the environment
given explicitly), so what is checked is what a user reads: where each kind of client points, which
upstream takes which models with whose key, open or keyed, and never a key.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "config" / "ctxproxy.yaml"


def where(config: Path, **env: str) -> subprocess.CompletedProcess[str]:
    bare = {k: v for k, v in os.environ.items() if k in ("PATH", "SYSTEMROOT")}
    return subprocess.run([sys.executable, "-m", "proxy.cli", "where", "--config", str(config)], cwd=ROOT,
                          env={**bare, **env}, capture_output=True, text=True, timeout=60)


def write(tmp_path: Path, config: dict[str, object]) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def test_the_default_config_serves_every_client_with_their_own_keys() -> None:
    """With neither key set, both wires' base URLs are printed and each upstream forwards the client's key."""
    out = where(DEFAULT)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "ctxproxy: point a client at http://127.0.0.1:8080"
    assert any(line.split()[0] == "OPENAI_BASE_URL=http://127.0.0.1:8080/v1" and "Codex CLI" in line for line in lines)
    assert any(line.split()[0] == "ANTHROPIC_BASE_URL=http://127.0.0.1:8080" and "Claude Code" in line
               for line in lines)
    upstreams = [line for line in lines if line.lstrip().startswith("upstream ")]
    assert upstreams == [
        "  upstream  openai: https://api.openai.com/v1 (the default: every other model; "
        "the client's own key is forwarded)",
        "  upstream  anthropic: https://api.anthropic.com (models claude-*; the client's own key is forwarded)",
    ]
    assert lines[-1].startswith("  access    open: no tenants")


def test_configured_keys_are_named_never_printed() -> None:
    keys = {"OPENAI_API_KEY": "sk-proj-never-printed-1", "ANTHROPIC_API_KEY": "sk-ant-never-printed-2"}
    out = where(DEFAULT, **keys)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("the configured key is sent") == 2
    assert not any(key in out.stdout + out.stderr for key in keys.values())


def test_a_keyed_proxy_names_its_tenants_and_an_upstream_without_a_key(tmp_path: Path) -> None:
    path = write(tmp_path, {
        "server": {"host": "0.0.0.0", "port": 9001},
        "upstreams": {"up": {"base_url": "https://user:hunter2@llm.example/v1"}},
        "models": [{"name": "house", "upstream": "up"}],
        "tenants": [{"name": "research", "keys": ["rk-secret-tenant-key"]}],
    })
    out = where(path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == ("ctxproxy: point a client at http://127.0.0.1:9001 (bound to 0.0.0.0: "
                                          "from elsewhere, use this host's address)")
    assert ("upstream  up: https://***@llm.example/v1 (models house and every other model; no key is "
            "configured: the upstream will refuse)") in out.stdout
    assert "keyed: 1 tenant(s) (research)" in out.stdout
    assert "hunter2" not in out.stdout and "rk-secret-tenant-key" not in out.stdout


def test_an_ipv6_wildcard_is_reached_on_the_ipv6_loopback(tmp_path: Path) -> None:
    path = write(tmp_path, {"server": {"host": "::", "port": 8081},
                            "upstreams": {"up": {"base_url": "http://127.0.0.1:9/v1"}}})
    out = where(path)
    assert out.returncode == 0, out.stderr
    assert "OPENAI_BASE_URL=http://[::1]:8081/v1" in out.stdout


def test_a_config_that_does_not_load_stops_make_run_with_its_problems(tmp_path: Path) -> None:
    """``make run`` runs ``where`` first: a bad config ends there (exit 2), each problem named, nothing printed."""
    path = write(tmp_path, {"upstreams": {"up": {"base_url": "ftp://nope"}}, "nonsense": 1})
    out = where(path)
    assert out.returncode == 2
    assert out.stdout == ""
    assert "upstreams.up.base_url" in out.stderr and "nonsense" in out.stderr


def test_a_client_variable_left_pointing_at_the_proxy_is_refused() -> None:
    """Codex and the openai SDK read OPENAI_BASE_URL, and so does the default config for its upstream: set to
    the proxy itself where the proxy starts, every request would loop back into it. Refused, with the hint."""
    out = where(DEFAULT, OPENAI_BASE_URL="http://localhost:8080/v1")
    assert out.returncode == 2
    assert "upstreams.openai.base_url" in out.stderr and "this proxy's own address" in out.stderr
    assert "OPENAI_BASE_URL" in out.stderr
