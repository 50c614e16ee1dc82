"""Issue 11, items 12-15 ("Security"): each defect reproduced from the outside.

Over HTTP through the proxy (``start_proxy`` / ``upstream`` fixtures, the real aiohttp
fake upstream, the official ``openai`` client), raw sockets for slow clients, and the
CLI (``ctxproxy validate``) as a subprocess. A test marked ``xfail(strict=True)``
fails on today's code for the reason in its ``reason``; once fixed it turns into an
error and the mark must go.

Names the fixes are expected to follow: ``server.header_timeout`` and
``server.body_timeout`` (item 15, seconds to receive a request's headers and body).
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import yaml

from tests.conftest import ROOT, RunningProxy, StartProxy, base_config
from tests.fake_upstream import FakeUpstream
from tests.outside import Message, post, request, share_model_map, text_of

MODEL = "gpt-4o-mini"
TENANT_KEY = "sk-tenant-acme-7f3a"
UPSTREAM_KEY = "sk-upstream-secret"  # base_config's upstream key
OVERRIDE = "x-ctxproxy-context-manager"


@pytest.fixture(autouse=True)
def _shared_model_map(monkeypatch: pytest.MonkeyPatch) -> None:
    share_model_map(monkeypatch)  # speed only


def tenant_config(upstream_url: str, **tenant: Any) -> dict[str, Any]:
    return base_config(upstream_url, tenants=[{"name": "acme", "keys": [TENANT_KEY], **tenant}],
                       summarizer={"retry_backoff_seconds": 0, "timeout_seconds": 2, "max_summary_tokens": 300})


# =========================================================================== item 12: overrides may only tighten


def twenty_turns() -> list[Message]:
    """A 20-turn conversation of about 8.3k tokens."""
    out: list[Message] = [{"role": "system", "content": "You are ACME's support agent."}]
    for i in range(20):
        out += [{"role": "user", "content": f"Question {i}: " + text_of(60, i)},
                {"role": "assistant", "content": f"Answer {i}: " + text_of(340, i + 100)}]
    out.append({"role": "user", "content": "And the last question?"})
    return out


POLICY = {"type": "summarising", "params": {"summary_threshold": 2000, "keep_turns": 3}}


async def tokens_out(proxy: RunningProxy, override: str | None) -> tuple[int, dict[str, str]]:
    headers = {OVERRIDE: override} if override is not None else {}
    status, got, body = await post(proxy, {"model": MODEL, "messages": twenty_turns()}, key=TENANT_KEY,
                                   headers=headers)
    assert status == 200, body
    return int(got["x-ctxproxy-tokens-out"]), got


@pytest.mark.parametrize("override", [
    "sliding-window",
    json.dumps({"type": "summarising", "params": {"summary_threshold": 0}}),
], ids=["sliding-window", "summary_threshold-0"])
async def test_override_cannot_loosen_the_tenants_policy(upstream: FakeUpstream, start_proxy: StartProxy,
                                                         override: str) -> None:
    """Item 12: a loosening override is ignored with a warning; what is forwarded stays what the policy gives."""
    proxy = await start_proxy(tenant_config(upstream.base_url, context_manager=POLICY))
    first, _ = await tokens_out(proxy, None)  # under B: forwarded whole while its summary is made in the background
    await proxy.state.shared.background.idle()
    baseline, _ = await tokens_out(proxy, None)
    assert baseline < 3000 < first  # the tenant's policy: summary + the last 3 turns
    loosened, headers = await tokens_out(proxy, override)
    assert "x-ctxproxy-warning" in headers, headers
    assert loosened == baseline


async def test_override_may_tighten_the_tenants_policy(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """Item 12 control (passes today): a tightening override (trimmer.max_tokens 1000) applies without a warning."""
    proxy = await start_proxy(tenant_config(upstream.base_url, context_manager=POLICY))
    baseline, _ = await tokens_out(proxy, None)
    tighter, headers = await tokens_out(proxy, json.dumps({"type": "summarising",
                                                           "params": {"trimmer": {"max_tokens": 1000}}}))
    assert "x-ctxproxy-warning" not in headers, headers
    assert tighter <= 1000 < baseline


# =========================================================================== item 13: the /v1/* relay with tenants


def error_shape(raw: bytes) -> dict[str, Any]:
    body = json.loads(raw)
    assert set(body) == {"error"} and set(body["error"]) >= {"message", "type", "param", "code"}, body
    return dict(body["error"])


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/chat/completions/chatcmpl-abc123/messages",
                                  "/v1/files"])
async def test_stored_object_listings_are_not_relayed_for_tenants(upstream: FakeUpstream, start_proxy: StartProxy,
                                                                  path: str) -> None:
    """Item 13: with tenants, GET listings of stored objects answer 403/404 (OpenAI's shape) and reach nobody."""
    proxy = await start_proxy(tenant_config(upstream.base_url, models=[MODEL]))
    status, _headers, raw = await request(proxy, "GET", path, key=TENANT_KEY)
    assert status in (403, 404), raw[:300]
    error_shape(raw)
    assert upstream.other == [] and upstream.chat == []


async def test_trailing_slash_chat_path_goes_through_the_pipeline(upstream: FakeUpstream, start_proxy: StartProxy
                                                                  ) -> None:
    """Item 13: every spelling of the chat path goes through the pipeline: the tenant's max_output_tokens holds."""
    proxy = await start_proxy(tenant_config(upstream.base_url, models=[MODEL], max_output_tokens=100))
    status, headers, body = await post(proxy, {"model": MODEL, "max_tokens": 5000,
                                               "messages": [{"role": "user", "content": "hi"}]},
                                       path="/v1/chat/completions/", key=TENANT_KEY)
    assert status == 200, body
    assert upstream.other == [], [r.path for r in upstream.other]
    assert [r.body["max_tokens"] for r in upstream.chat] == [100]
    assert "x-ctxproxy-tokens-out" in headers


async def test_model_allow_list_holds_on_multipart_bodies(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """Item 13: a multipart /v1/audio/transcriptions with a model outside the tenant's allow-list is refused."""
    proxy = await start_proxy(tenant_config(upstream.base_url, models=[MODEL]))
    form = aiohttp.FormData()
    form.add_field("model", "whisper-1")
    form.add_field("file", b"RIFF\x00\x00\x00\x00WAVEfmt ", filename="a.wav", content_type="audio/wav")
    status, _headers, raw = await request(proxy, "POST", "/v1/audio/transcriptions", key=TENANT_KEY, data=form)
    assert status in (403, 404), raw[:300]
    assert error_shape(raw)["code"] in ("model_not_found", "forbidden", "not_found", "permission_denied")
    assert upstream.other == []


# =========================================================================== item 14: header values


async def test_escaped_crlf_in_an_override_never_reaches_a_header(upstream: FakeUpstream, start_proxy: StartProxy
                                                                  ) -> None:
    """Item 14: an override whose JSON key holds \\r\\n is ignored with a clean, single-line warning header."""
    proxy = await start_proxy(base_config(upstream.base_url))
    override = '{"type": "stack", "params": {"bad\\r\\nX-Injected: yes": 1}}'  # JSON escapes, valid header text
    assert "\r" not in override and "\n" not in override
    try:
        status, headers, body = await post(proxy, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                                           headers={OVERRIDE: override})
    except aiohttp.ClientError as exc:
        pytest.fail(f"the client got no answer: {exc!r}")
    assert status == 200, body
    assert "x-injected" not in headers
    warning = headers.get("x-ctxproxy-warning", "")
    assert warning and "\r" not in warning and "\n" not in warning, warning


# =========================================================================== item 15: loose ends


async def slow_client(proxy: RunningProxy, payload: bytes, wait: float) -> tuple[bool, bytes]:
    """Send ``payload`` and stall; whether the server closed the connection within ``wait`` s, and what it sent."""
    host, port = proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(payload)
        await writer.drain()
        got = b""
        deadline = time.monotonic() + wait
        while (left := deadline - time.monotonic()) > 0:
            try:
                chunk = await asyncio.wait_for(reader.read(4096), left)
            except asyncio.TimeoutError:
                break
            except ConnectionError:
                return True, got
            if not chunk:
                return True, got
            got += chunk
        return False, got
    finally:
        writer.close()


async def start_with_read_timeouts(upstream: FakeUpstream, start_proxy: StartProxy) -> tuple[RunningProxy, float]:
    """The proxy with 1 s header/body read timeouts (``server.header_timeout`` and ``server.body_timeout``)."""
    return await start_proxy(base_config(upstream.base_url, server={"header_timeout": 1, "body_timeout": 1})), 2.5


async def test_slow_headers_are_timed_out(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """Item 15: a client that sends partial headers and stalls is disconnected after the header timeout."""
    proxy, wait = await start_with_read_timeouts(upstream, start_proxy)
    closed, got = await slow_client(proxy, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: 1", wait)
    assert closed, f"the connection was still open after {wait} s of partial headers"
    assert got == b"" or got.startswith(b"HTTP/1.1 408"), got[:200]


async def test_slow_body_is_timed_out(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """Item 15: a client that sends 10 of its announced 1000 body bytes and stalls is disconnected (or 408)."""
    proxy, wait = await start_with_read_timeouts(upstream, start_proxy)
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n")
    closed, got = await slow_client(proxy, head + b'{"model": ', wait)
    assert closed or got.startswith(b"HTTP/1.1 408"), f"no answer and still open after {wait} s: {got[:200]!r}"
    assert upstream.chat == []


def validate(tmp_path: Path, cfg: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return subprocess.run([sys.executable, "-m", "proxy.cli", "validate", str(path)], cwd=ROOT, text=True,
                          capture_output=True, timeout=60)


def test_validate_rejects_an_admin_key_equal_to_a_tenant_key(tmp_path: Path) -> None:
    """Item 15: an admin key that is also a tenant's key is a config error (exit 2, naming the key path)."""
    cfg = base_config("http://127.0.0.1:9/v1", tenants=[{"name": "acme", "keys": [TENANT_KEY]}],
                      admin={"keys": [TENANT_KEY]})
    done = validate(tmp_path, cfg)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "admin.keys" in done.stderr
    assert TENANT_KEY not in done.stderr + done.stdout  # and the key itself is never printed


def test_validate_accepts_distinct_admin_and_tenant_keys(tmp_path: Path) -> None:
    """Item 15 control (passes today): distinct admin and tenant keys validate."""
    cfg = base_config("http://127.0.0.1:9/v1", tenants=[{"name": "acme", "keys": [TENANT_KEY]}],
                      admin={"keys": ["adm-different-key"]})
    done = validate(tmp_path, cfg)
    assert (done.returncode, done.stdout.strip()) == (0, "ok"), done.stderr


async def test_upstream_key_echoed_in_a_stream_is_redacted(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """Item 15: the upstream's key, echoed back inside a streamed 200 answer, never reaches the client."""
    upstream.mode = "echo_key"
    proxy = await start_proxy(base_config(upstream.base_url))
    async with openai.AsyncOpenAI(base_url=proxy.base_url, api_key="sk-client", max_retries=0) as client:
        stream = await client.chat.completions.create(model=MODEL, stream=True,
                                                      messages=[{"role": "user", "content": "hi"}])
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text.startswith("You called me with")  # the echo came through ...
    assert UPSTREAM_KEY not in text  # ... redacted, as in relayed errors


async def test_chunk_framing_error_mid_stream_ends_the_stream_at_once(upstream: FakeUpstream, start_proxy: StartProxy
                                                                      ) -> None:
    """Item 15: the upstream breaks HTTP chunked framing mid-stream: the client's stream ends with an error at once."""
    upstream.mode = "bad_chunk"
    idle = 2.0
    proxy = await start_proxy(base_config(upstream.base_url, server={"idle_timeout": idle}))
    async with aiohttp.ClientSession() as s, s.post(proxy.base_url + "/chat/completions", json={
            "model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}) as r:
        assert r.status == 200
        raw = await r.content.readany()  # the first chunk; the framing breaks 0.2 s later
        started = time.monotonic()
        try:
            async for chunk in r.content.iter_any():
                raw += chunk
        except aiohttp.ClientPayloadError:
            pass  # the proxy may also cut the connection
    elapsed = time.monotonic() - started
    assert b'"error"' in raw and b"[DONE]" not in raw, raw[-300:]
    assert elapsed < idle / 2, f"the framing error surfaced {elapsed:.1f} s after the first chunk (idle timeout {idle} s)"


async def test_explain_writes_a_request_log_line(upstream: FakeUpstream, start_proxy: StartProxy,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """Item 15: an explain request is logged like any other request: one line with its request id."""
    caplog.set_level(logging.INFO, logger="ctxproxy.requests")
    proxy = await start_proxy(base_config(upstream.base_url))
    rid = "0b7f7d3e-4a53-4d7e-9d8c-5a2b1f0e9c41"
    status, _headers, body = await post(proxy, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                                        path="/v1/ctxproxy/explain", headers={"x-request-id": rid})
    assert status == 200, body
    lines = [r.getMessage() for r in caplog.records if r.name == "ctxproxy.requests"]
    assert any(rid in line for line in lines), lines
