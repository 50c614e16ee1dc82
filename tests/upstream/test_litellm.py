"""A `provider: litellm` model route: litellm.acompletion behind the proxy, its HTTP mocked with respx.

respx stands in for the provider (Anthropic's Messages API) at litellm's HTTP seam; the proxy, the
pipeline and litellm's translation back to OpenAI's shapes run for real. litellm is switched to its
httpx transport so respx can see its calls.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest

from tests.fake_upstream import FakeUpstream

respx = pytest.importorskip("respx")
# litellm's own pydantic models warn about a TypedDict qualifier at first use; not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore:.*ReadOnly.*:UserWarning")

ANTHROPIC = "https://api.anthropic.com/v1/messages"
MESSAGE = {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-sonnet-4-5",
           "content": [{"type": "text", "text": "Hello from Claude"}], "stop_reason": "end_turn",
           "usage": {"input_tokens": 12, "output_tokens": 5}}


def _sse(events: list[tuple[str, dict[str, Any]]]) -> bytes:
    return b"".join(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode() for name, data in events)


STREAM = _sse([
    ("message_start", {"type": "message_start", "message": {**MESSAGE, "content": [], "stop_reason": None,
                                                             "usage": {"input_tokens": 12, "output_tokens": 1}}}),
    ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
    ("content_block_delta", {"type": "content_block_delta", "index": 0,
                             "delta": {"type": "text_delta", "text": "Hello"}}),
    ("content_block_delta", {"type": "content_block_delta", "index": 0,
                             "delta": {"type": "text_delta", "text": " from Claude"}}),
    ("content_block_stop", {"type": "content_block_stop", "index": 0}),
    ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 5}}),
    ("message_stop", {"type": "message_stop"}),
])


def config() -> dict[str, Any]:
    return {
        "upstreams": {"anthropic": {"base_url": "https://api.anthropic.com", "api_key": "sk-ant-test"}},
        "models": [{"name": "claude", "provider": "litellm", "upstream": "anthropic",
                    "model": "anthropic/claude-sonnet-4-5", "context_window": 200000, "max_output_tokens": 8192}],
        "cache": {"backend": "memory"},
    }


@pytest.fixture
def litellm_httpx(monkeypatch: pytest.MonkeyPatch) -> None:
    import litellm

    monkeypatch.setattr(litellm, "disable_aiohttp_transport", True)


async def test_litellm_route_non_streaming(start_proxy: Any, litellm_httpx: None) -> None:
    proxy = await start_proxy(config())
    with respx.mock(assert_all_called=True) as mock:
        provider = mock.post(ANTHROPIC).mock(return_value=httpx.Response(200, json=MESSAGE))
        async with aiohttp.ClientSession() as s, s.post(proxy.url + "/v1/chat/completions", json={
                "model": "claude", "max_tokens": 50,
                "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]}) as r:
            assert r.status == 200
            body = await r.json()
            assert r.headers["x-ctxproxy-tokens-in"]
    assert body["object"] == "chat.completion"
    assert body["model"] == "claude"
    assert body["choices"][0]["message"]["content"] == "Hello from Claude"
    assert body["usage"]["prompt_tokens"] == 12 and body["usage"]["completion_tokens"] == 5
    sent = provider.calls.last.request
    assert sent.headers["x-api-key"] == "sk-ant-test"  # the upstream's configured key
    payload = json.loads(sent.content)
    assert payload["model"] == "claude-sonnet-4-5"
    assert payload["messages"] == [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]


async def test_litellm_route_streaming_translated_to_openai_chunks(start_proxy: Any, litellm_httpx: None) -> None:
    proxy = await start_proxy(config())
    with respx.mock(assert_all_called=True) as mock:
        mock.post(ANTHROPIC).mock(return_value=httpx.Response(
            200, content=STREAM, headers={"content-type": "text/event-stream"}))
        async with aiohttp.ClientSession() as s, s.post(proxy.url + "/v1/chat/completions", json={
                "model": "claude", "max_tokens": 50, "stream": True,
                "messages": [{"role": "user", "content": "hi"}]}) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            raw = (await r.read()).decode()
    events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "claude" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    assert text == "Hello from Claude"


async def test_litellm_route_provider_error_is_relayed_in_openai_shape(start_proxy: Any, litellm_httpx: None) -> None:
    proxy = await start_proxy(config())
    with respx.mock(assert_all_called=True) as mock:
        mock.post(ANTHROPIC).mock(return_value=httpx.Response(
            429, json={"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}))
        async with aiohttp.ClientSession() as s, s.post(proxy.url + "/v1/chat/completions", json={
                "model": "claude", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}) as r:
            body = await r.json()
            status = r.status
    assert status == 429
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert "slow down" in body["error"]["message"]


async def test_litellm_failure_mid_stream_ends_with_an_error_event_without_traceback(
        start_proxy: Any, litellm_httpx: None) -> None:
    proxy = await start_proxy(config())
    broken = STREAM.split(b"event: content_block_stop")[0] + b"event: content_block_delta\ndata: {not json\n\n"
    with respx.mock(assert_all_called=True) as mock:
        mock.post(ANTHROPIC).mock(return_value=httpx.Response(
            200, content=broken, headers={"content-type": "text/event-stream"}))
        async with aiohttp.ClientSession() as s, s.post(proxy.url + "/v1/chat/completions", json={
                "model": "claude", "max_tokens": 50, "stream": True,
                "messages": [{"role": "user", "content": "hi"}]}) as r:
            raw = (await r.read()).decode()
    assert "data: [DONE]" not in raw
    assert '"error"' in raw.splitlines()[-2] or '"error"' in raw.strip().splitlines()[-1]
    assert "Traceback" not in raw and "site-packages" not in raw


# --------------------------------------------------------------------------- the Responses wire


async def test_litellm_route_responses_non_streaming_through_aresponses(start_proxy: Any, litellm_httpx: None) -> None:
    """A Responses body on a litellm route goes through litellm.aresponses; the answer is a response object."""
    import openai

    proxy = await start_proxy(config())
    with respx.mock(assert_all_called=True) as mock:
        provider = mock.post(ANTHROPIC).mock(return_value=httpx.Response(200, json=MESSAGE))
        async with openai.AsyncOpenAI(base_url=proxy.base_url, api_key="sk-client", max_retries=0) as client:
            response = await client.responses.create(model="claude", max_output_tokens=50, input=[
                {"role": "user", "content": "hi"},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "42"},
                {"type": "reasoning", "id": "rs_dangling", "summary": []}])
    assert response.output_text == "Hello from Claude" and response.model == "claude"
    payload = json.loads(provider.calls.last.request.content)
    assert payload["model"] == "claude-sonnet-4-5"
    assert [m["role"] for m in payload["messages"]] == ["user", "assistant", "user"]


async def test_litellm_route_responses_streaming_named_events(start_proxy: Any, litellm_httpx: None) -> None:
    import openai

    proxy = await start_proxy(config())
    with respx.mock(assert_all_called=True) as mock:
        mock.post(ANTHROPIC).mock(return_value=httpx.Response(
            200, content=STREAM, headers={"content-type": "text/event-stream"}))
        async with openai.AsyncOpenAI(base_url=proxy.base_url, api_key="sk-client", max_retries=0) as client:
            stream = await client.responses.create(model="claude", input="hi", stream=True)
            events = [event async for event in stream]
    assert events[-1].type == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello from Claude"


async def test_litellm_route_compact_is_answered_by_the_summariser(start_proxy: Any, litellm_httpx: None) -> None:
    """litellm has no compact endpoint: /v1/responses/compact is emulated (the summariser call goes to Anthropic)."""
    import openai

    summary = {**MESSAGE, "content": [{"type": "text", "text": "- the user said hi"}]}
    proxy = await start_proxy(config())
    with respx.mock(assert_all_called=True) as mock:
        mock.post(ANTHROPIC).mock(return_value=httpx.Response(200, json=summary))
        async with openai.AsyncOpenAI(base_url=proxy.base_url, api_key="sk-client", max_retries=0) as client:
            compacted = await client.responses.compact(model="claude", input=[{"role": "user", "content": "hi"}])
    assert compacted.object == "response.compaction"
    assert "the user said hi" in compacted.output[-1].content[0].text  # type: ignore[union-attr]


@pytest.mark.parametrize("status", [401, 403])
async def test_a_refused_operator_key_is_a_gateway_error_and_never_echoed(
        start_proxy: Any, litellm_httpx: None, status: int) -> None:
    """Through litellm as on the HTTP path: the proxy's own key refused is a 502, and the key never reaches a client."""
    proxy = await start_proxy(config())
    with respx.mock(assert_all_called=True) as mock:
        mock.post(ANTHROPIC).mock(return_value=httpx.Response(status, json={
            "type": "error", "error": {"type": "authentication_error", "message": "invalid x-api-key sk-ant-test"}}))
        async with aiohttp.ClientSession() as s, s.post(proxy.url + "/v1/chat/completions", json={
                "model": "claude", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}) as r:
            raw = await r.text()
            got = r.status
    assert got == 502 and "upstream_auth_failed" in raw
    assert "sk-ant-test" not in raw


async def test_a_provider_echoing_the_key_in_a_4xx_never_shows_it(start_proxy: Any, litellm_httpx: None) -> None:
    proxy = await start_proxy(config())
    with respx.mock(assert_all_called=True) as mock:
        mock.post(ANTHROPIC).mock(return_value=httpx.Response(400, json={
            "type": "error", "error": {"type": "invalid_request_error", "message": "bad request for key sk-ant-test"}}))
        async with aiohttp.ClientSession() as s, s.post(proxy.url + "/v1/chat/completions", json={
                "model": "claude", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}) as r:
            raw = await r.text()
            got = r.status
    assert got == 400 and "sk-ant-test" not in raw and "[redacted]" in raw


# --------------------------------------------------------------------------- the HTTP route's contract
# A real fake OpenAI upstream on 127.0.0.1 that litellm calls (``openai/`` models): timeouts, retries and
# connections are litellm's own HTTP, not a mock's. Messages bodies reach it as /v1/responses (litellm's
# adapter for providers without a Messages API).

WIRES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    "responses": ("/v1/responses", {"input": "hi"}),
    "messages": ("/v1/messages", {"max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]})}
WIRE_STREAM = [(wire, stream) for wire in WIRES for stream in (False, True)]
WIRE_IDS = [f"{wire}-{'stream' if stream else 'json'}" for wire, stream in WIRE_STREAM]


def fake_config(base_url: str, **server: Any) -> dict[str, Any]:
    return {
        "server": {"first_byte_timeout": 30.0, "idle_timeout": 30.0, **server},
        "upstreams": {"fake": {"base_url": base_url, "api_key": "sk-upstream-secret",
                               "headers": {"X-Org": "acme-org"}}},
        "models": [{"name": "ll", "provider": "litellm", "upstream": "fake", "model": "openai/gpt-4o-mini",
                    "context_window": 128000, "max_output_tokens": 1000}],
        "cache": {"backend": "memory"},
        "summarizer": {"retry_backoff_seconds": 0},
    }


async def call(proxy: Any, wire: str, stream: bool, **headers: str) -> tuple[int, dict[str, str], Any]:
    """One request on ``wire``; the answer's status, headers and JSON body (or raw text when it is not JSON)."""
    path, body = WIRES[wire]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s, s.post(
            proxy.url + path, json={"model": "ll", "stream": stream, **body},
            headers={"Authorization": "Bearer sk-client", **headers}) as r:
        raw = await r.read()
        try:
            payload: Any = json.loads(raw)
        except ValueError:
            payload = raw.decode()
        return r.status, {k.lower(): v for k, v in r.headers.items()}, payload


async def warm(start_proxy: Any, upstream: FakeUpstream, wire: str, stream: bool) -> None:
    """One answered request first, through a proxy with the default deadlines: litellm's first call on a path
    spends a second or more in its own set-up (imports, clients), which a 1 s deadline would count."""
    status, _, body = await call(await start_proxy(fake_config(upstream.base_url)), wire, stream)
    assert status == 200, body
    upstream.chat.clear()
    upstream.responses.clear()


def error_code(wire: str, body: Any) -> Any:
    """The error's code in the wire's shape (Anthropic's names it in ``type``)."""
    return body["error"]["type"] if wire == "messages" else body["error"]["code"]


def upstream_calls(upstream: FakeUpstream, wire: str) -> list[Any]:
    return upstream.chat if wire == "chat" else upstream.responses


@pytest.mark.parametrize(("wire", "stream"), WIRE_STREAM, ids=WIRE_IDS)
async def test_a_silent_upstream_is_a_504_after_first_byte_timeout(
        start_proxy: Any, upstream: FakeUpstream, wire: str, stream: bool) -> None:
    """litellm had no timeout but its own (10 minutes): a silent upstream kept the client waiting. Now, as on the
    HTTP route, nothing within server.first_byte_timeout is a 504 upstream_timeout, and it is not retried."""
    await warm(start_proxy, upstream, wire, stream)
    proxy = await start_proxy(fake_config(upstream.base_url, first_byte_timeout=1.0))
    upstream.mode = "hang"
    status, _, body = await call(proxy, wire, stream)
    assert status == 504, body
    assert error_code(wire, body) in ("upstream_timeout", "timeout_error", "api_error")
    assert "did not answer in time" in body["error"]["message"]
    assert len(upstream_calls(upstream, wire)) == 1
    if wire == "chat":  # and the upstream request is dropped, so the provider stops working on it
        for _ in range(100):
            if upstream.cancelled:
                break
            await asyncio.sleep(0.05)
        assert upstream.cancelled == 1


async def test_a_stream_that_stalls_ends_with_a_timeout_event(start_proxy: Any, upstream: FakeUpstream) -> None:
    """After the first event, server.idle_timeout bounds each gap, as on the HTTP route."""
    proxy = await start_proxy(fake_config(upstream.base_url, idle_timeout=1.0))
    upstream.mode = "stall"
    status, _, raw = await call(proxy, "chat", True)
    assert status == 200
    assert "upstream_timeout" in raw and "[DONE]" not in raw


@pytest.mark.parametrize(("wire", "stream"), WIRE_STREAM, ids=WIRE_IDS)
async def test_a_429_is_relayed_at_once_with_its_rate_limit_headers(
        start_proxy: Any, upstream: FakeUpstream, wire: str, stream: bool) -> None:
    """A 429 was retried twice behind the client's back (seconds of hidden waiting), then relayed without
    Retry-After. Now it is one upstream call, relayed with the provider's message and rate-limit headers:
    the client decides when to retry."""
    upstream.mode, upstream.status = "status", 429
    upstream.status_body = {"error": {"message": "Rate limit reached for requests", "type": "requests",
                                      "param": None, "code": "rate_limit_exceeded"}}
    upstream.status_headers = {"Retry-After": "30", "x-ratelimit-remaining-requests": "0",
                               "x-ratelimit-reset-requests": "30s", "Set-Cookie": "tracker=1"}
    proxy = await start_proxy(fake_config(upstream.base_url))
    status, headers, body = await call(proxy, wire, stream)
    assert status == 429, body
    assert headers["retry-after"] == "30"
    assert headers["x-ratelimit-remaining-requests"] == "0" and headers["x-ratelimit-reset-requests"] == "30s"
    assert "set-cookie" not in headers  # dropped as on the HTTP route
    assert "Rate limit reached for requests" in body["error"]["message"]
    assert len(upstream_calls(upstream, wire)) == 1


@pytest.mark.parametrize("status", [500, 503])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_a_5xx_is_relayed_after_one_upstream_call(
        start_proxy: Any, upstream: FakeUpstream, status: int, stream: bool) -> None:
    """A 5xx was retried too, so a request the provider had received could be billed more than once."""
    upstream.mode, upstream.status = "status", status
    upstream.status_body = {"error": {"message": "The engine is overloaded", "type": "server_error",
                                      "param": None, "code": None}}
    proxy = await start_proxy(fake_config(upstream.base_url))
    got, _, body = await call(proxy, "chat", stream)
    assert got == status
    assert body["error"]["message"] == "The engine is overloaded"
    assert len(upstream.chat) == 1


@pytest.mark.parametrize(("wire", "stream"), WIRE_STREAM, ids=WIRE_IDS)
async def test_an_unreachable_upstream_is_a_502(start_proxy: Any, wire: str, stream: bool) -> None:
    """A refused connection came back as litellm's 500 InternalServerError; the HTTP route says 502."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    proxy = await start_proxy(fake_config(f"http://127.0.0.1:{closed}/v1"))
    status, _, body = await call(proxy, wire, stream)
    assert status == 502, body
    assert error_code(wire, body) in ("upstream_unreachable", "api_error")
    assert "unreachable" in body["error"]["message"]
    assert "Traceback" not in json.dumps(body)


@pytest.mark.parametrize(("wire", "stream"), [("chat", False), ("chat", True), ("responses", False),
                                              ("responses", True), ("messages", False)])
async def test_the_upstreams_headers_and_the_request_id_are_sent(
        start_proxy: Any, upstream: FakeUpstream, wire: str, stream: bool) -> None:
    """upstreams.<name>.headers and X-Request-Id never reached a provider through litellm."""
    proxy = await start_proxy(fake_config(upstream.base_url))
    status, headers, body = await call(proxy, wire, stream, **{"X-Request-Id": "client-chosen-id-1"})
    assert status == 200, body
    sent = {k.lower(): v for k, v in upstream_calls(upstream, wire)[-1].headers.items()}
    assert sent["x-org"] == "acme-org"
    assert sent["x-request-id"] == headers["x-request-id"] == "client-chosen-id-1"
    assert sent["authorization"] == "Bearer sk-upstream-secret"


async def test_the_summarisers_calls_carry_the_headers_too(upstream: FakeUpstream) -> None:
    """The summariser's calls through litellm: the configured headers, its own request id and its purpose."""
    from proxy.core.modelinfo import ModelMap
    from proxy.policy import Routes
    from proxy.settings import load_config
    from proxy.upstream.litellm import LiteLLMProvider

    cfg = load_config(fake_config(upstream.base_url))
    route = Routes(cfg, ModelMap()).resolve("ll")
    provider = LiteLLMProvider(cfg.settings.upstreams["fake"], cfg.settings.server)
    done = await provider.complete(route, [{"role": "user", "content": "summarise"}], max_tokens=50, timeout=30,
                                   request_id="3b8f6a4e-0000-4000-8000-000000000001")
    assert done.text
    (summary,) = upstream.summaries
    sent = {k.lower(): v for k, v in summary.headers.items()}
    assert sent["x-org"] == "acme-org" and sent["x-ctxproxy-purpose"] == "summarize"
    assert sent["x-request-id"] == "3b8f6a4e-0000-4000-8000-000000000001"


async def test_anthropic_rate_limit_headers_are_relayed_through_litellm(start_proxy: Any, litellm_httpx: None) -> None:
    """The same through litellm's Anthropic provider (respx): one call, Retry-After and Anthropic's rate-limit
    headers relayed with the 429; on a success, its rate-limit headers reach the client as well."""
    proxy = await start_proxy(config())
    limits = {"retry-after": "12", "anthropic-ratelimit-requests-remaining": "0"}
    with respx.mock(assert_all_called=True) as mock:
        provider = mock.post(ANTHROPIC).mock(side_effect=[
            httpx.Response(429, headers=limits, json={"type": "error", "error": {
                "type": "rate_limit_error", "message": "slow down"}}),
            httpx.Response(200, headers={"anthropic-ratelimit-requests-remaining": "41"}, json=MESSAGE)])
        async with aiohttp.ClientSession() as s:
            async with s.post(proxy.url + "/v1/chat/completions", json={
                    "model": "claude", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}) as r:
                refused = (r.status, dict(r.headers), await r.json())
            async with s.post(proxy.url + "/v1/chat/completions", json={
                    "model": "claude", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}) as r:
                answered = (r.status, dict(r.headers))
    assert provider.call_count == 2  # one each: nothing retried
    assert refused[0] == 429 and refused[1]["Retry-After"] == "12"
    assert refused[1]["anthropic-ratelimit-requests-remaining"] == "0"
    assert refused[2]["error"]["message"] == "slow down" and refused[2]["error"]["type"] == "rate_limit_error"
    assert answered[0] == 200 and answered[1]["anthropic-ratelimit-requests-remaining"] == "41"
    assert answered[1]["Content-Type"] == "application/json"


@pytest.mark.slow
@pytest.mark.parametrize("provider", ["litellm", "openai"])
async def test_a_20s_upstream_is_answered_504_at_first_byte_timeout(
        start_proxy: Any, upstream: FakeUpstream, provider: str) -> None:
    """The figure behind the contract: a 20 s upstream, first_byte_timeout 3 s, on the litellm and HTTP routes."""
    await warm(start_proxy, upstream, "chat", False)  # litellm's import and set-up are not the upstream's time
    cfg = fake_config(upstream.base_url, first_byte_timeout=3.0)
    cfg["models"].append({"name": "direct", "upstream": "fake", "model": "gpt-4o-mini",
                          "context_window": 128000, "max_output_tokens": 1000})
    proxy = await start_proxy(cfg)
    upstream.mode, upstream.delay = "slow_first_byte", 20
    started = time.monotonic()
    body = {"model": "ll" if provider == "litellm" else "direct", "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as s, s.post(proxy.url + "/v1/chat/completions", json=body) as r:
        status = r.status
    elapsed = time.monotonic() - started
    assert status == 504
    assert 3.0 <= elapsed < 4.0, elapsed


async def test_an_upstream_echoing_its_key_in_a_stream_never_shows_it(start_proxy: Any, upstream: FakeUpstream) -> None:
    """As on the HTTP route, the upstream's key is blanked out of a litellm answer, streamed or not."""
    upstream.mode = "echo_key"
    proxy = await start_proxy(fake_config(upstream.base_url))
    status, _, raw = await call(proxy, "chat", True)
    assert status == 200
    assert "sk-upstream-secret" not in raw and "[redacted]" in raw


@pytest.mark.slow
async def test_importing_litellm_never_holds_up_other_requests(upstream: FakeUpstream, tmp_path: Path) -> None:
    """Importing litellm takes seconds of CPU. Done on the event loop (at a litellm route's first request) it held
    up every other request, /healthz included, for that long: it runs in a thread at start and at first use."""
    from tests.serve.test_logsink import CTXPROXY, free_port, wait_healthy, write_config

    routes = [{"name": "ll", "provider": "litellm", "upstream": "fake", "model": "openai/gpt-4o-mini",
               "context_window": 128000, "max_output_tokens": 1000}]
    config = write_config(tmp_path, upstream, models=routes)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([str(CTXPROXY), "serve", "--config", str(config), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    waits: list[float] = []
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            await wait_healthy(s, url, proc)

            async def probe() -> None:
                for _ in range(100):
                    started = time.perf_counter()
                    async with s.get(url + "/healthz") as r:
                        assert r.status == 200
                    waits.append(time.perf_counter() - started)
                    await asyncio.sleep(0.02)

            async def first_call() -> int:
                async with s.post(url + "/v1/chat/completions",
                                  json={"model": "ll", "messages": [{"role": "user", "content": "hi"}]}) as r:
                    await r.read()
                    return r.status

            status, _ = await asyncio.gather(first_call(), probe())
    finally:
        proc.terminate()
        proc.wait(10)
    assert status == 200
    assert max(waits) < 1.0, f"/healthz waited {max(waits):.2f}s while litellm was imported"
