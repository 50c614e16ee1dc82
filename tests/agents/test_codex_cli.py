"""Codex CLI (``@openai/codex``) through the proxy on the Responses wire (``make check``).

Codex is installed from the npm registry into a cache folder (``CTXPROXY_NPM_CACHE``, default
``~/.cache/ctxproxy-tests/npm``) on first use; where it cannot be installed the test is skipped
with a one-line reason. ``codex exec`` runs a one-shot prompt against the proxy with the fake
upstream behind it (flags as in /work/shared/clients/README.md: a custom provider with
``wire_api = "responses"``): its streamed ``POST /v1/responses`` goes through the pipeline and
the answer stream is relayed until ``response.completed``.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import StartProxy, base_config
from tests.fake_upstream import REPLY, FakeUpstream
from tests.outside import metric_total, scrape, share_model_map

MODEL = "gpt-5-codex-proxy"
INSTALL_TIMEOUT = 300


@pytest.fixture(autouse=True)
def _shared_model_map(monkeypatch: pytest.MonkeyPatch) -> None:
    share_model_map(monkeypatch)


async def codex_binary() -> tuple[Path | None, str]:
    """The codex executable, installed into the cache folder if needed; (None, why) when it cannot be."""
    folder = Path(os.environ.get("CTXPROXY_NPM_CACHE", Path.home() / ".cache" / "ctxproxy-tests" / "npm"))
    binary = folder / "node_modules" / ".bin" / "codex"
    if binary.exists():
        return binary, ""
    npm = shutil.which("npm")
    if npm is None:
        return None, "npm is not installed"
    folder.mkdir(parents=True, exist_ok=True)
    proc = await asyncio.create_subprocess_exec(
        npm, "install", "--no-audit", "--no-fund", "--prefix", str(folder), "@openai/codex",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), INSTALL_TIMEOUT)
    except asyncio.TimeoutError:
        proc.kill()
        return None, f"npm install @openai/codex took more than {INSTALL_TIMEOUT}s"
    if proc.returncode != 0 or not binary.exists():
        last = out.decode("utf-8", "replace").strip().splitlines()[-1:] or ["no output"]
        return None, f"npm install @openai/codex failed: {last[0][:200]}"
    return binary, ""


@pytest.mark.slow
async def test_codex_exec_through_the_proxy(upstream: FakeUpstream, start_proxy: StartProxy, tmp_path: Path) -> None:
    codex, why = await codex_binary()
    if codex is None:
        pytest.skip(f"Codex CLI unavailable: {why}")
    proxy = await start_proxy(base_config(upstream.base_url, models=[
        {"name": MODEL, "context_window": 200_000, "max_output_tokens": 32_000}]))
    home = tmp_path / "home"
    (home / ".codex").mkdir(parents=True)
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(home), "CODEX_HOME": str(home / ".codex"),
           "OPENAI_API_KEY": "sk-codex", "NO_COLOR": "1", "RUST_LOG": "error"}
    args = [str(codex), "exec", "--skip-git-repo-check",
            "-c", f'model_providers.local.base_url="{proxy.base_url}"',
            "-c", 'model_providers.local.name="local"',
            "-c", 'model_providers.local.env_key="OPENAI_API_KEY"',
            "-c", 'model_providers.local.wire_api="responses"',
            "-c", 'model_provider="local"', "-m", MODEL, "Say hello."]
    work = tmp_path / "work"
    work.mkdir()
    proc = await asyncio.create_subprocess_exec(*args, cwd=work, env=env, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 180)
    except asyncio.TimeoutError:
        proc.kill()
        raise
    text = out.decode("utf-8", "replace") + err.decode("utf-8", "replace")
    assert proc.returncode == 0, text[-3000:]
    assert REPLY in text, text[-3000:]
    assert upstream.responses, "codex sent nothing through the proxy"
    body = upstream.responses[0].body
    assert body["stream"] is True and body["model"] == MODEL
    assert any(item.get("role") == "user" for item in body["input"])
    metrics = await scrape(proxy)
    assert metric_total(metrics, "ctxproxy_requests_total", wire="responses") >= 1
    # under budget: managed and forwarded as Codex sent it
    received = metric_total(metrics, "ctxproxy_tokens_received_total")
    assert received > 0 and metric_total(metrics, "ctxproxy_tokens_forwarded_total") == received
