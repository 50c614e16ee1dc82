"""Claude Code (``claude -p``) through ctxproxy against the fake Anthropic upstream (``make check``).

Claude Code installs from the npm registry (``@anthropic-ai/claude-code``) into a cache folder on first use; where
npm or the registry is not available the test is skipped with one line saying so. It is pointed at the proxy with
``ANTHROPIC_BASE_URL`` and a proxy key in ``ANTHROPIC_API_KEY`` (docs/wires.md#claude-code).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import StartProxy
from tests.fake_upstream import REPLY, FakeUpstream
from tests.wire.messages_helpers import pairing_problems

pytestmark = pytest.mark.slow

CACHE = Path(os.environ.get("CTXPROXY_CLAUDE_CODE_DIR", Path.home() / ".cache" / "ctxproxy-tests" / "claude-code"))
PACKAGE = "@anthropic-ai/claude-code"


async def claude_binary() -> str:
    """The ``claude`` executable, installed from the npm registry on first use (skip when that is impossible)."""
    binary = CACHE / "node_modules" / ".bin" / "claude"
    if binary.exists():
        return str(binary)
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("Claude Code check skipped: npm is not installed on this machine")
    CACHE.mkdir(parents=True, exist_ok=True)
    proc = await asyncio.create_subprocess_exec(
        npm, "install", "--prefix", str(CACHE), "--no-audit", "--no-fund", PACKAGE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), 300)
    except asyncio.TimeoutError:
        proc.kill()
        pytest.skip(f"Claude Code check skipped: npm install {PACKAGE} did not finish in 300 s")
    if proc.returncode != 0 or not binary.exists():
        last = out.decode("utf-8", "replace").strip().splitlines()[-1:] or ["(no output)"]
        pytest.skip(f"Claude Code check skipped: {PACKAGE} could not be installed from the npm registry ({last[0]})")
    return str(binary)


async def run_claude(binary: str, base_url: str, key: str, home: Path, prompt: str,
                     model: str | None = None) -> tuple[int, str]:
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(home), "ANTHROPIC_BASE_URL": base_url,
           "ANTHROPIC_API_KEY": key, "DISABLE_TELEMETRY": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
           "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1", "CI": "1"}
    if model is not None:  # every call Claude Code makes, its small background ones included
        env.update(ANTHROPIC_MODEL=model, ANTHROPIC_SMALL_FAST_MODEL=model, ANTHROPIC_DEFAULT_HAIKU_MODEL=model)
    proc = await asyncio.create_subprocess_exec(
        binary, "-p", prompt, "--output-format", "json", env=env, cwd=str(home),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 180)
    except asyncio.TimeoutError:
        proc.kill()
        raise AssertionError("claude -p did not finish within 180 s") from None
    return proc.returncode or 0, out.decode("utf-8", "replace") + err.decode("utf-8", "replace")


async def test_claude_code_through_the_proxy(upstream: FakeUpstream, start_proxy: StartProxy, tmp_path: Path) -> None:
    binary = await claude_binary()
    proxy = await start_proxy({
        "upstreams": {"anthropic": {"base_url": upstream.url, "api": "anthropic", "api_key": "sk-ant-upstream"}},
        "tenants": [{"name": "dev", "keys": ["ctxproxy-dev-key"]}],
        "cache": {"backend": "memory"},
        "logging": {"level": "WARNING"},
    })
    code, output = await run_claude(binary, proxy.url, "ctxproxy-dev-key", tmp_path, "Say hello.")
    assert code == 0, output[-3000:]
    result: dict[str, Any] = json.loads(output[output.index("{"):output.rindex("}") + 1])
    assert REPLY in json.dumps(result)
    assert upstream.messages, "Claude Code sent nothing through the proxy"
    for sent in upstream.messages:
        headers = {k.lower(): v for k, v in sent.headers.items()}
        assert headers["x-api-key"] == "sk-ant-upstream"  # the proxy key is never forwarded
        assert "ctxproxy-dev-key" not in json.dumps(headers)
        assert "anthropic-version" in headers
        assert not pairing_problems(sent.body["messages"])
    first = upstream.messages[0].body
    assert isinstance(first["system"], list) and first["tools"]


async def test_claude_code_through_a_litellm_route(upstream: FakeUpstream, start_proxy: StartProxy,
                                                   tmp_path: Path) -> None:
    """Claude Code streams every request; on a ``provider: litellm`` route to Anthropic (``anthropic/…``) litellm
    cannot stream without its proxy extra, so each is asked for whole and told as a stream (docs/reliability.md,
    "A Messages stream litellm cannot make is not sent"): Claude Code still gets its answer."""
    binary = await claude_binary()
    proxy = await start_proxy({
        "upstreams": {"anthropic": {"base_url": upstream.url, "api_key": "sk-ant-upstream"}},
        "models": [{"name": "claude", "provider": "litellm", "upstream": "anthropic",
                    "model": "anthropic/claude-sonnet-4-5", "context_window": 200000, "max_output_tokens": 8192}],
        "tenants": [{"name": "dev", "keys": ["ctxproxy-dev-key"]}],
        "cache": {"backend": "memory"},
        "logging": {"level": "WARNING"},
    })
    code, output = await run_claude(binary, proxy.url, "ctxproxy-dev-key", tmp_path, "Say hello.", model="claude")
    assert code == 0, output[-3000:]
    result: dict[str, Any] = json.loads(output[output.index("{"):output.rindex("}") + 1])
    assert REPLY in json.dumps(result)
    assert upstream.messages, "Claude Code sent nothing through the proxy"
    for sent in upstream.messages:
        assert {k.lower(): v for k, v in sent.headers.items()}["x-api-key"] == "sk-ant-upstream"
        assert not pairing_problems(sent.body["messages"])
