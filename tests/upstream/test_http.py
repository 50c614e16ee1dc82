"""proxy.upstream.http: the Redactor, header rules both ways, relay URLs, transport errors and error bodies.

Servers here are tiny aiohttp apps or raw sockets on 127.0.0.1 (no fake upstream
needed); everything runs in well under a second.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from hypothesis import example, given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.core.errors import UpstreamError, UpstreamStatus, UpstreamTimeout, UpstreamUnreachable
from proxy.policy import ModelRoute
from proxy.settings import ServerSettings, UpstreamSettings
from proxy.upstream.base import Outgoing
from proxy.upstream.client import HTTPClient, Response
from proxy.upstream.http import (
    REDACTED,
    HTTPAnswer,
    HTTPProvider,
    Redactor,
    UpstreamPool,
    completion_from,
    connection_listed,
    open_request,
    read_error,
    response_headers,
    upstream_headers,
)
from tests.conftest import StartProxy, base_config
from tests.fake_upstream import FakeUpstream
from tests.faults import (
    CHAT_MODEL,
    HELLO,
    RAW_FAULTS,
    RawUpstream,
    Resources,
    eventually,
    openai_error,
    send_chat,
    sse_data,
)
from tests.outside import chat_body

SECRET = "sk-proj-Abc123_def-456XYZ"
ROUTE = ModelRoute("gpt-4o-mini", "u", "gpt-4o-mini-2024-07-18", "openai", 128_000, 16_384, "o200k_base")

# --------------------------------------------------------------------------- Redactor


def redact(secret: str | None, chunks: list[bytes]) -> bytes:
    r = Redactor(secret)
    return b"".join(r.feed(c) for c in chunks) + r.flush()


def test_redactor_split_across_every_chunk_boundary() -> None:
    body = f'{{"error": {{"message": "Incorrect API key provided: {SECRET}. Also {SECRET}"}}}}'.encode()
    expected = body.replace(SECRET.encode(), REDACTED)
    for i in range(len(body) + 1):
        for j in range(i, len(body) + 1, 3):
            out = redact(SECRET, [body[:i], body[i:j], body[j:]])
            assert out == expected, (i, j)
            assert SECRET.encode() not in out


def test_redactor_byte_by_byte() -> None:
    body = (b"data: " + SECRET.encode() + b"\n\n") * 3
    out = redact(SECRET, [body[i:i + 1] for i in range(len(body))])
    assert out == body.replace(SECRET.encode(), REDACTED)


def test_redactor_holds_back_only_a_possible_start_of_the_secret() -> None:
    r = Redactor(SECRET)
    assert r.feed(b"data: hello\n\n") == b"data: hello\n\n"  # nothing held: streaming is not delayed
    assert r.feed(b"data: sk-pr") == b"data: "
    assert r.feed(b"ogress\n\n") == b"sk-progress\n\n"  # not the secret after all: released
    assert r.flush() == b""
    assert r.feed(b"tail sk") == b"tail "
    assert r.flush() == b"sk"


@pytest.mark.parametrize("secret", [None, ""])
def test_without_a_secret_chunks_pass_through(secret: str | None) -> None:
    r = Redactor(secret)
    chunk = b"anything sk-proj-x"
    assert r.feed(chunk) is chunk
    assert r.flush() == b""


KEY_CHARS = st.sampled_from("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_")


@settings(max_examples=400, deadline=None)
@given(
    secret=st.text(KEY_CHARS, min_size=1, max_size=12),
    pieces=st.lists(st.one_of(st.text(KEY_CHARS, max_size=6), st.sampled_from([" ", "\n", '"', "data: ", "[redacted]"]),
                              st.just("<S>")), max_size=12),
    cuts=st.lists(st.integers(0, 200), max_size=8),
)
@example(secret="aa", pieces=["a", "<S>", "a"], cuts=[1, 2, 3])
@example(secret="abab", pieces=["<S>", "ab"], cuts=[1, 3, 5])
def test_redactor_output_equals_replace_whatever_the_chunking(secret: str, pieces: list[str], cuts: list[int]) -> None:
    text = "".join(secret if p == "<S>" else p for p in pieces).encode()
    points = sorted({c % (len(text) + 1) for c in cuts})
    chunks, last = [], 0
    for p in points:
        chunks.append(text[last:p])
        last = p
    chunks.append(text[last:])
    out = redact(secret, chunks)
    assert out == text.replace(secret.encode(), REDACTED)
    assert secret.encode() not in out or secret.encode() in REDACTED


# --------------------------------------------------------------------------- headers


def up(**kwargs: Any) -> UpstreamSettings:
    return UpstreamSettings(base_url="https://api.example.com/v1", **kwargs)


CLIENT = [
    ("Authorization", "Bearer sk-client"),
    ("api-key", "azure-client-key"),
    ("X-Api-Key", "anthropic-client-key"),
    ("OpenAI-Organization", "org-client"),
    ("OpenAI-Project", "proj_client"),
    ("Content-Type", "application/json"),
    ("Accept", "text/event-stream"),
    ("User-Agent", "OpenAI/Python 1.54.0"),
    ("X-Stainless-Retry-Count", "0"),
    ("OpenAI-Beta", "assistants=v2"),
    ("Anthropic-Version", "2023-06-01"),
    ("Host", "proxy.internal:8080"),
    ("Content-Length", "1234"),
    ("Connection", "keep-alive, X-Hop-Secret"),
    ("X-Hop-Secret", "must not travel"),
    ("Keep-Alive", "timeout=5"),
    ("Transfer-Encoding", "chunked"),
    ("TE", "trailers"),
    ("Upgrade", "h2c"),
    ("Proxy-Authorization", "Basic cHJveHk6cHc="),
    ("Cookie", "session=abc"),
    ("Forwarded", "for=10.0.0.1"),
    ("X-Forwarded-For", "10.0.0.1"),
    ("X-Real-IP", "10.0.0.1"),
    ("Accept-Encoding", "gzip, br"),
    ("X-Ctxproxy-Context-Manager", '{"type": "sliding-window"}'),
    ("x-ctxproxy-anything", "proxy-only"),
    ("X-Request-ID", "client-chosen-id"),
]
ALWAYS_DROPPED = {"host", "content-length", "connection", "x-hop-secret", "keep-alive", "transfer-encoding", "te",
                  "upgrade", "proxy-authorization", "cookie", "forwarded", "x-forwarded-for", "x-real-ip",
                  "accept-encoding", "x-ctxproxy-context-manager", "x-ctxproxy-anything"}
CREDENTIALS = {"authorization", "api-key", "x-api-key", "openai-organization", "openai-project"}


def names(headers: CIMultiDict[str]) -> set[str]:
    return {k.lower() for k in headers}


def test_upstream_headers_with_the_operators_key() -> None:
    out = upstream_headers(CIMultiDict(CLIENT), up(api_key=SECRET, headers={"OpenAI-Organization": "org-operator"}),
                           forward_client_auth=False, request_id="3f1c-uuid")
    assert not names(out) & ALWAYS_DROPPED
    assert out["Authorization"] == f"Bearer {SECRET}"
    assert out.getall("Authorization") == [f"Bearer {SECRET}"]
    assert out["OpenAI-Organization"] == "org-operator"  # the upstream's configured header, not the client's
    assert not {"api-key", "x-api-key", "openai-project"} & names(out)
    assert out["X-Request-Id"] == "3f1c-uuid" and len(out.getall("X-Request-Id")) == 1
    for kept in ("Content-Type", "Accept", "User-Agent", "X-Stainless-Retry-Count", "OpenAI-Beta", "Anthropic-Version"):
        assert out[kept] == dict(CLIENT)[kept]


def test_upstream_headers_forwarding_the_clients_own_credentials() -> None:
    out = upstream_headers(CIMultiDict(CLIENT), up(), forward_client_auth=True, request_id="rid")
    assert names(out) >= CREDENTIALS
    assert out["Authorization"] == "Bearer sk-client"
    assert not names(out) & ALWAYS_DROPPED


def test_upstream_headers_never_forward_client_credentials_when_not_allowed() -> None:
    out = upstream_headers(CIMultiDict(CLIENT), up(), forward_client_auth=False, request_id="rid")
    assert not names(out) & CREDENTIALS
    assert not names(out) & ALWAYS_DROPPED


def test_repeated_client_headers_are_kept_and_case_does_not_matter() -> None:
    client = CIMultiDict([("x-custom", "1"), ("X-CUSTOM", "2"), ("AUTHORIZATION", "Bearer k"),
                          ("CONNECTION", "X-Custom-Hop"), ("x-custom-hop", "drop")])
    out = upstream_headers(client, up(), forward_client_auth=False, request_id="rid")
    assert out.getall("X-Custom") == ["1", "2"]
    assert "authorization" not in names(out) and "x-custom-hop" not in names(out)


@pytest.mark.parametrize(("headers", "listed"), [
    ({"Connection": "close"}, {"close"}),
    ({"connection": "Keep-Alive, X-A ,, x-b"}, {"keep-alive", "x-a", "x-b"}),
    ({"X-Other": "connection"}, set()),
    ({}, set()),
])
def test_connection_listed(headers: dict[str, str], listed: set[str]) -> None:
    assert connection_listed(headers) == listed
    # aiohttp's headers (looked up, not walked): any case, and every Connection header a sender repeats
    multi = CIMultiDict([(name.upper(), value) for name, value in headers.items()] + [("cOnNeCtIoN", "X-Late")])
    assert connection_listed(multi) == listed | {"x-late"}
    assert connection_listed(CIMultiDictProxy(multi)) == listed | {"x-late"}


def test_response_headers_keep_what_clients_need_and_drop_the_rest() -> None:
    upstream = CIMultiDict([
        ("Content-Type", "application/json"), ("x-ratelimit-remaining-requests", "499"), ("Retry-After", "3"),
        ("openai-processing-ms", "412"), ("anthropic-ratelimit-tokens-remaining", "10000"),
        ("Date", "Tue, 01 Jul 2025 10:00:00 GMT"), ("Server", "cloudflare"), ("Set-Cookie", "__cf_bm=x"),
        ("X-Request-ID", "req_upstream"), ("Connection", "keep-alive, X-Upstream-Hop"), ("X-Upstream-Hop", "1"),
        ("Transfer-Encoding", "chunked"), ("Content-Length", "99"), ("Content-Encoding", "gzip"),
        ("Keep-Alive", "timeout=5"), ("Proxy-Authenticate", "Basic"), ("Trailer", "X-Checksum"),
    ])
    out = response_headers(upstream)
    assert names(out) == {"content-type", "x-ratelimit-remaining-requests", "retry-after", "openai-processing-ms",
                          "anthropic-ratelimit-tokens-remaining"}


# --------------------------------------------------------------------------- completion_from


@pytest.mark.parametrize(("payload", "text", "prompt", "completion"), [
    ({"choices": [{"message": {"role": "assistant", "content": "- summary"}}],
      "usage": {"prompt_tokens": 1200, "completion_tokens": 80}}, "- summary", 1200, 80),
    ({"choices": [{"message": {"content": None, "refusal": "no"}}]}, "", 0, 0),
    ({"choices": []}, "", 0, 0),
    ({"choices": [{"message": "text"}]}, "", 0, 0),
    ({}, "", 0, 0),
    ([], "", 0, 0),
    ("garbage", "", 0, 0),
    (None, "", 0, 0),
    ({"choices": [{"message": {"content": "x"}}], "usage": {"prompt_tokens": -5, "completion_tokens": True}},
     "x", 0, 0),
    ({"choices": [{"message": {"content": "x"}}], "usage": {"prompt_tokens": 1.5, "completion_tokens": "9"}},
     "x", 0, 0),
    ({"choices": [{"message": {"content": ["parts"]}}], "usage": []}, "", 0, 0),
])
def test_completion_from(payload: Any, text: str, prompt: int, completion: int) -> None:
    c = completion_from(payload, ROUTE)
    assert (c.text, c.prompt_tokens, c.completion_tokens) == (text, prompt, completion)
    assert (c.model, c.upstream_model) == ("gpt-4o-mini", "gpt-4o-mini-2024-07-18")


# --------------------------------------------------------------------------- over a socket


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Handler], Awaitable[str]]]:
    runners: list[web.AppRunner] = []

    async def start(handler: Handler) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handler)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


async def raw_server(reply: bytes) -> tuple[asyncio.AbstractServer, str]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(reply)
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


async def test_open_request_maps_a_refused_connection_to_502() -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    async with HTTPClient() as s:
        with pytest.raises(UpstreamUnreachable):
            await open_request(s, "POST", f"http://127.0.0.1:{port}/v1/x", data=b"{}", headers={},
                               first_byte_timeout=2)


async def test_open_request_maps_a_silent_upstream_to_504(serve: Any) -> None:
    async def hang(request: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.Response()

    url = await serve(hang)
    async with HTTPClient() as s:
        with pytest.raises(UpstreamTimeout):
            await open_request(s, "POST", url + "/v1/x", data=b"{}", headers={}, first_byte_timeout=0.1)


@pytest.mark.parametrize("reply", [b"garbage\r\n\r\n", b"HTTP/1.1 abc OK\r\n\r\n", b"\x00\x01\x02\r\n\r\n"])
async def test_open_request_maps_a_non_http_answer_to_502(reply: bytes) -> None:
    server, url = await raw_server(reply)
    try:
        async with HTTPClient() as s:
            with pytest.raises(UpstreamUnreachable):
                await open_request(s, "GET", url + "/", data=None, headers={}, first_byte_timeout=2)
    finally:
        server.close()
        await server.wait_closed()


async def response_of(url: str) -> tuple[HTTPClient, Response]:
    session = HTTPClient()
    return session, await session.request("GET", url)


async def test_read_error_redacts_the_key_and_normalises_the_body(serve: Any) -> None:
    async def echo(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": f"Incorrect API key provided: {SECRET}",
                                            "type": "invalid_request_error", "code": "invalid_api_key"}},
                                 status=400, headers={"Retry-After": "1", "Set-Cookie": "a=b"})

    url = await serve(echo)
    session, response = await response_of(url + "/v1/chat/completions")
    async with session:
        error = await read_error(response, 2, SECRET)
    assert isinstance(error, UpstreamStatus)
    assert error.status == 400
    assert SECRET not in str(error.to_openai()) and SECRET not in str(error.raw)
    assert "[redacted]" in error.message
    assert error.headers.get("Retry-After") == "1" and "Set-Cookie" not in error.headers


@pytest.mark.parametrize("status", [401, 403])
async def test_an_upstream_rejecting_the_proxys_own_key_is_a_gateway_error(serve: Any, status: int) -> None:
    async def reject(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": f"bad key {SECRET}"}}, status=status)

    url = await serve(reject)
    session, response = await response_of(url + "/v1/chat/completions")
    async with session:
        error = await read_error(response, 2, SECRET)
    assert type(error) is UpstreamError
    assert (error.status, error.code) == (502, "upstream_auth_failed")
    assert SECRET not in error.message


async def test_an_upstream_rejecting_the_clients_key_is_relayed(serve: Any) -> None:
    async def reject(request: web.Request) -> web.Response:
        return web.Response(text="Unauthorized", status=401)

    url = await serve(reject)
    session, response = await response_of(url + "/v1/chat/completions")
    async with session:
        error = await read_error(response, 2, None)
    assert isinstance(error, UpstreamStatus)
    assert error.status == 401
    assert error.to_openai()["error"] == {"message": "Unauthorized", "type": "authentication_error", "param": None,
                                          "code": None}


async def test_http_answer_redacts_a_streamed_key_split_across_chunks(serve: Any) -> None:
    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        body = f"data: {{\"echo\": \"Bearer {SECRET}\"}}\n\ndata: [DONE]\n\n".encode()
        for i in range(0, len(body), 5):
            await resp.write(body[i:i + 5])
            await asyncio.sleep(0)
        return resp

    url = await serve(stream)
    session, response = await response_of(url + "/")
    async with session:
        answer = HTTPAnswer(response, SECRET)
        assert answer.streaming
        out = b"".join([chunk async for chunk in answer.chunks(2)])
        answer.close(True)
    assert SECRET.encode() not in out
    assert out.endswith(b"data: [DONE]\n\n") and b"[redacted]" in out


async def test_http_answer_read_redacts_and_times_out(serve: Any) -> None:
    async def body(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        await resp.write(f'{{"echo": "{SECRET}"'.encode())
        if request.path == "/stall":
            await asyncio.sleep(5)
        await resp.write(b"}")
        return resp

    url = await serve(body)
    session, response = await response_of(url + "/ok")
    async with session:
        answer = HTTPAnswer(response, SECRET)
        assert not answer.streaming
        assert await answer.read(2) == b'{"echo": "[redacted]"}'
    session, response = await response_of(url + "/stall")
    async with session:
        with pytest.raises(UpstreamTimeout):
            await HTTPAnswer(response, SECRET).read(0.1)


async def test_provider_complete_sends_a_summariser_call_and_maps_its_answer(serve: Any) -> None:
    seen: list[tuple[CIMultiDict[str], Any]] = []

    async def chat(request: web.Request) -> web.Response:
        seen.append((CIMultiDict(request.headers), await request.json()))
        return web.json_response({"choices": [{"message": {"content": "- summary"}}],
                                  "usage": {"prompt_tokens": 10, "completion_tokens": 2}})

    url = await serve(chat)
    pool = UpstreamPool(ServerSettings())
    try:
        provider = HTTPProvider(UpstreamSettings(base_url=url + "/v1", api_key=SECRET), pool, forward_client_auth=False)
        out = await provider.complete(ROUTE, [{"role": "user", "content": "x"}], max_tokens=64, timeout=2,
                                      request_id="9b2c6f0e-0000-4000-8000-000000000000")
    finally:
        await pool.close()
    assert (out.text, out.prompt_tokens, out.completion_tokens) == ("- summary", 10, 2)
    headers, body = seen[0]
    assert body == {"model": "gpt-4o-mini-2024-07-18", "messages": [{"role": "user", "content": "x"}],
                    "max_tokens": 64, "temperature": 0}
    assert headers["Authorization"] == f"Bearer {SECRET}"
    assert headers["x-ctxproxy-purpose"] == "summarize"
    assert headers["X-Request-Id"] == "9b2c6f0e-0000-4000-8000-000000000000"


async def test_provider_send_raises_upstream_errors_and_forwards_the_bytes(serve: Any) -> None:
    seen: list[bytes] = []

    async def chat(request: web.Request) -> web.Response:
        seen.append(await request.read())
        if request.headers.get("x-fail"):
            return web.json_response({"error": {"message": "overloaded"}}, status=529)
        return web.json_response({"ok": True})

    url = await serve(chat)
    pool = UpstreamPool(ServerSettings())
    try:
        provider = HTTPProvider(UpstreamSettings(base_url=url + "/v1"), pool, forward_client_auth=True)
        call = Outgoing("chat", "/chat/completions", {}, b'{"model":"m"}', False, {"Authorization": "Bearer c"}, "r1")
        answer = await provider.send(ROUTE, call)
        assert await answer.read(2) == b'{"ok": true}'
        failing = Outgoing("chat", "/chat/completions", {}, b"{}", False, {"x-fail": "1"}, "r2")
        with pytest.raises(UpstreamStatus) as err:
            await provider.send(ROUTE, failing)
        assert err.value.status == 529
    finally:
        await pool.close()
    assert seen[0] == b'{"model":"m"}'


async def test_the_pool_keeps_one_session_per_base_url() -> None:
    pool = UpstreamPool(ServerSettings())
    a, b = up(), UpstreamSettings(base_url="https://other.example.com/v1")
    try:
        assert pool.session(a) is pool.session(up(api_key="another key, same URL"))
        assert pool.session(a) is not pool.session(b)
    finally:
        await pool.close()
    assert pool.session(a) is not None
    await pool.close()


MODEL = "gpt-4o-mini"


UPSTREAM_KEY = "sk-upstream-secret"  # base_config's upstream key


@pytest.mark.usefixtures("shared_model_map")
async def test_upstream_key_echoed_in_a_stream_is_redacted(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """The upstream's key, echoed back inside a streamed 200 answer, never reaches the client."""
    upstream.mode = "echo_key"
    proxy = await start_proxy(base_config(upstream.base_url))
    async with openai.AsyncOpenAI(base_url=proxy.base_url, api_key="sk-client", max_retries=0) as client:
        stream = await client.chat.completions.create(model=MODEL, stream=True,
                                                      messages=[{"role": "user", "content": "hi"}])
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text.startswith("You called me with")  # the echo came through ...
    assert UPSTREAM_KEY not in text  # ... redacted, as in relayed errors


async def test_the_clients_x_ctxproxy_headers_are_the_proxys_own(
    serve_routes: Callable[[dict[str, Handler]], Awaitable[str]], start_proxy: StartProxy
) -> None:
    """``x-ctxproxy-*`` headers an upstream sends (on a 200 or an error) never reach the client: those headers
    report what the proxy did, and an upstream must not be able to spoof them."""
    spoofed = {"x-ctxproxy-summary": "created", "x-ctxproxy-tokens-out": "1", "x-ctxproxy-warning": "from upstream"}

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("user") == "fail":
            return web.json_response({"error": {"message": "slow down"}}, status=429, headers=spoofed)
        return web.json_response({"id": "chatcmpl-1", "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]},
            headers=spoofed)

    base = await serve_routes({"/v1/chat/completions": completions})
    proxy = await start_proxy(base_config(base))
    for user in ("ok", "fail"):
        body = chat_body([{"role": "user", "content": "hi"}], MODEL, user=user)
        async with aiohttp.ClientSession() as s, s.post(proxy.base_url + "/chat/completions", json=body,
                                                        headers={"Authorization": "Bearer sk-client"}) as r:
            assert r.headers.getall("x-ctxproxy-summary", []) == ["none"], (user, r.headers)
            assert r.headers.getall("x-ctxproxy-tokens-out") != ["1"], (user, r.headers)
            assert "x-ctxproxy-warning" not in r.headers, (user, r.headers)


@pytest.mark.parametrize(("mode", "stream", "status", "code"), RAW_FAULTS, ids=[f[0] for f in RAW_FAULTS])
async def test_raw_upstream_faults(start_proxy: Any, mode: str, stream: bool, status: int, code: str) -> None:
    raw_up = await RawUpstream(mode).start()
    try:
        cfg = base_config(raw_up.url)
        cfg["server"] = {"first_byte_timeout": 0.5, "idle_timeout": 0.5}
        proxy = await start_proxy(cfg)
        async with aiohttp.ClientSession() as s:
            started = time.monotonic()
            body = {"model": CHAT_MODEL, "messages": HELLO, "stream": stream}
            got, headers, raw = await send_chat(s, proxy.url, body)
            elapsed = time.monotonic() - started
        assert elapsed < 3
        assert got == status, raw[:300]
        if stream:
            events = sse_data(raw)
            assert b"[DONE]" not in events
            err = json.loads(events[-1])["error"]
        else:
            err = openai_error(raw)
            assert headers["x-request-id"]
        # (a chunk-framing error is seen as a stall: the client's parser drops the connection's data)
        assert err["code"] == code or (mode == "bad_chunked_stream" and err["code"] == "upstream_timeout")
        assert raw_up.connections == 1  # no retry behind the client's back
        # the broken connection is not kept for reuse
        assert await eventually(lambda: Resources.take(proxy).acquired == 0)
    finally:
        await raw_up.stop()


async def test_a_cookie_one_upstream_answer_sets_is_never_sent_with_another_request(
    serve_routes: Callable[[dict[str, Handler]], Awaitable[str]], start_proxy: StartProxy
) -> None:
    """The proxy's upstream sessions keep no cookies: a provider's ``Set-Cookie`` (a CDN's session cookie) answered
    to one tenant's request would otherwise go out with every later request, any tenant's, on that connection pool.
    (A cookie jar ignores cookies of an IP address: the upstream is named ``localhost`` here.)"""
    cookies: list[str | None] = []

    async def completions(request: web.Request) -> web.Response:
        cookies.append(request.headers.get("Cookie"))
        return web.json_response({"id": "chatcmpl-1", "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]},
            headers={"Set-Cookie": "__cf_bm=tenant-a-session; Path=/; HttpOnly"})

    async def models(request: web.Request) -> web.Response:
        cookies.append(request.headers.get("Cookie"))
        return web.json_response({"object": "list", "data": []})

    base = (await serve_routes({"/v1/chat/completions": completions, "/v1/models": models})).replace(
        "127.0.0.1", "localhost")
    tenants = [{"name": "a", "keys": ["sk-tenant-a"]}, {"name": "b", "keys": ["sk-tenant-b"]}]
    proxy = await start_proxy(base_config(base, tenants=tenants))
    async with aiohttp.ClientSession() as s:
        for key in ("sk-tenant-a", "sk-tenant-b"):
            body = chat_body([{"role": "user", "content": "hi"}], MODEL)
            async with s.post(proxy.base_url + "/chat/completions", json=body,
                              headers={"Authorization": f"Bearer {key}"}) as r:
                assert r.status == 200, await r.text()
                assert "Set-Cookie" not in r.headers
        async with s.get(proxy.base_url + "/models", headers={"Authorization": "Bearer sk-tenant-b"}) as r:
            assert r.status == 200, await r.text()
    assert cookies == [None, None, None]
