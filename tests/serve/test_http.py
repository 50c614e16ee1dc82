"""proxy.serve.http: header_safe, request ids, client keys, body parsing, error answers and the error middleware."""

from __future__ import annotations

import asyncio
import gzip
import json
import re
import uuid
import zlib
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from hypothesis import given
from hypothesis import strategies as st
from multidict import CIMultiDict

from proxy.core.errors import (
    BadRequest,
    ContextLengthExceeded,
    CtxProxyError,
    InvalidJSON,
    UpstreamStatus,
)
from proxy.serve.bodies import LONG_DIGITS, long_digits, parse_body
from proxy.serve.http import (
    ERROR_WIRE,
    RESPONSE_HEADERS,
    client_keys,
    error_middleware,
    error_response,
    header_safe,
    openai_body,
    request_id,
)
from proxy.serve.ids import RequestIds
from proxy.wire import WIRES
from tests.conftest import RunningProxy, StartProxy, base_config
from tests.fake_upstream import FakeUpstream, is_uuid
from tests.outside import post, request
from tests.store.test_summaries_http import config

IDS = RequestIds()


def req(headers: dict[str, str] | list[tuple[str, str]] | None = None, method: str = "POST",
        path: str = "/v1/chat/completions") -> web.Request:
    return make_mocked_request(method, path, headers=CIMultiDict(headers or {}))


# --------------------------------------------------------------------------- header_safe


@pytest.mark.parametrize(("text", "safe"), [
    ("x-ctxproxy-context-manager ignored: not valid JSON", "x-ctxproxy-context-manager ignored: not valid JSON"),
    ("line one\r\nSet-Cookie: a=b", "line one??Set-Cookie: a=b"),
    ("tab\there", "tab?here"),
    ("Zürich 東京 🚀", "Z?rich ?? ?"),
    ("\x00\x7f~ ", "??~ "),
    ("", ""),
])
def test_header_safe(text: str, safe: str) -> None:
    assert header_safe(text) == safe


def test_header_safe_cuts_long_text() -> None:
    assert header_safe("a" * 5000) == "a" * 1000
    assert header_safe("abcdef", limit=3) == "abc"


@given(st.text(max_size=300))
def test_header_safe_is_always_a_valid_header_value(text: str) -> None:
    out = header_safe(text)
    assert all(" " <= c <= "~" for c in out)
    assert len(out) == min(len(text), 1000)


# --------------------------------------------------------------------------- request ids


@pytest.mark.parametrize("given_id", [
    "req_abc123", "3f1c9b2a-7d4e-4c6b-9a8f-1e2d3c4b5a69", "trace:span.01-A", "a", "x" * 128,
    "01HZX4Y5Z6ABCDEFGHJKMNPQRS",
])
def test_plain_client_request_ids_are_kept(given_id: str) -> None:
    assert request_id(req({"X-Request-ID": given_id}), IDS) == given_id


@pytest.mark.parametrize("given_id", [
    "", "x" * 129, "has space", "semi;colon", "quote\"d", "ünïcode", "slash/y", "a,b", "{json}", "tab\tx",
    "new\r\nline",
])
def test_other_request_ids_are_replaced_with_uuids(given_id: str) -> None:
    rid = request_id(make_mocked_request("POST", "/", headers=CIMultiDict({"x-request-id": given_id})), IDS)
    assert rid != given_id
    assert uuid.UUID(rid).version == 4


def test_a_missing_request_id_gets_a_fresh_uuid_each_time() -> None:
    a, b = request_id(req(), IDS), request_id(req(), IDS)
    assert a != b
    assert uuid.UUID(a) and uuid.UUID(b)


# --------------------------------------------------------------------------- client keys


@pytest.mark.parametrize(("headers", "key"), [
    ({"Authorization": "Bearer sk-acme-1"}, "sk-acme-1"),
    ({"Authorization": "bearer sk-acme-1"}, "sk-acme-1"),
    ({"Authorization": "BEARER   sk-acme-1  "}, "sk-acme-1"),
    ({"x-api-key": "sk-ant-acme"}, "sk-ant-acme"),  # Anthropic clients
    ({"api-key": "azure-acme"}, "azure-acme"),  # Azure OpenAI clients
    ({"Authorization": "Basic dXNlcjpwdw==", "x-api-key": "sk-ant-acme"}, "sk-ant-acme"),
    ({"Authorization": "Bearer sk-a", "x-api-key": "sk-b", "api-key": "sk-c"}, "sk-a"),
    ({"x-api-key": "", "api-key": "azure-acme"}, "azure-acme"),
    ({"Authorization": "Bearer "}, None),
    ({"Authorization": "Bearer"}, None),
    ({}, None),
])
def test_client_keys_first(headers: dict[str, str], key: str | None) -> None:
    keys = client_keys(req(headers))
    assert (keys[0] if keys else None) == key


def test_client_keys_in_order() -> None:
    assert client_keys(req({"Authorization": "Bearer sk-a", "x-api-key": "sk-b", "api-key": "sk-c"})) == (
        "sk-a", "sk-b", "sk-c")


# --------------------------------------------------------------------------- bodies


def test_parse_body_accepts_json_objects() -> None:
    assert parse_body(b'{"model": "gpt-4o", "messages": []}') == {"model": "gpt-4o", "messages": []}


@pytest.mark.parametrize(("raw", "cls", "code"), [
    (b"", InvalidJSON, "invalid_json"),
    (b"{", InvalidJSON, "invalid_json"),
    (b'{"a": NaN}', InvalidJSON, "invalid_json"),
    (b"\xff\xfe{}", InvalidJSON, "invalid_json"),
    (b'"a string"', BadRequest, "invalid_body"),
    (b"[]", BadRequest, "invalid_body"),
    (b"null", BadRequest, "invalid_body"),
    (b"42", BadRequest, "invalid_body"),
])
def test_parse_body_refuses(raw: bytes, cls: type[CtxProxyError], code: str) -> None:
    with pytest.raises(cls) as err:
        parse_body(raw)
    assert err.value.code == code
    assert err.value.status == 400


# --------------------------------------------------------------------------- error answers


def test_error_payload_in_each_shape() -> None:
    error = ContextLengthExceeded("This request needs 9000 input tokens", param="messages")
    assert openai_body(error) == error.to_openai()
    assert WIRES["chat"].error_body(error) == error.to_openai()
    assert WIRES["messages"].error_body(error) == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "This request needs 9000 input tokens"}}


def test_error_response_carries_request_headers_and_an_upstreams_headers() -> None:
    error = UpstreamStatus(429, {"error": {"message": "slow down"}},
                           {"Retry-After": "7", "Content-Type": "text/html", "x-ratelimit-remaining-tokens": "0"})
    headers = CIMultiDict({"x-request-id": "rid-1", "Content-Type": "text/event-stream"})
    response = error_response(error, headers)
    assert response.status == 429
    assert response.content_type == "application/json"
    assert response.headers["x-request-id"] == "rid-1"
    assert response.headers["Retry-After"] == "7"
    assert response.headers["x-ratelimit-remaining-tokens"] == "0"
    assert json.loads(response.body) == {"error": {"message": "slow down"}}  # type: ignore[arg-type]
    assert headers["Content-Type"] == "text/event-stream"  # the caller's headers are not touched


async def call(handler: Any, request: web.Request) -> web.StreamResponse:
    return await error_middleware(request, handler)  # type: ignore[no-any-return]


async def test_middleware_renders_tree_errors_in_the_requests_shape() -> None:
    async def refuse(request: web.Request) -> web.StreamResponse:
        request[RESPONSE_HEADERS] = CIMultiDict({"x-request-id": "rid-9"})
        raise BadRequest("'model' is required", param="model", code="missing_model")

    r = req()
    response = await call(refuse, r)
    assert response.status == 400
    assert response.headers["x-request-id"] == "rid-9"
    assert json.loads(response.body)["error"]["code"] == "missing_model"  # type: ignore[attr-defined]
    r = req(path="/v1/messages")
    r[ERROR_WIRE] = WIRES["messages"]
    response = await call(refuse, r)
    assert json.loads(response.body)["type"] == "error"  # type: ignore[attr-defined]


@pytest.mark.parametrize(("exc", "status", "code"), [
    (web.HTTPNotFound(), 404, "not_found"),
    (web.HTTPMethodNotAllowed("GET", ["POST"]), 405, "method_not_allowed"),
    (web.HTTPRequestEntityTooLarge(max_size=10, actual_size=20), 413, "request_too_large"),
    (web.HTTPConflict(), 409, "http_error"),
])
async def test_middleware_turns_http_exceptions_into_openai_errors(exc: web.HTTPException, status: int,
                                                                   code: str) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        raise exc

    response = await call(handler, req())
    assert response.status == status
    assert json.loads(response.body)["error"]["code"] == code  # type: ignore[attr-defined]


async def test_middleware_hides_internal_errors(caplog: pytest.LogCaptureFixture) -> None:
    async def broken(request: web.Request) -> web.StreamResponse:
        raise KeyError("secret internals sk-upstream")

    response = await call(broken, req())
    assert response.status == 500
    body = response.body.decode()  # type: ignore[attr-defined]  # a web.Response
    assert "sk-upstream" not in body and "KeyError" not in body
    assert json.loads(body)["error"] == {"message": "The proxy failed to handle this request.", "type": "server_error",
                                         "param": None, "code": "internal_error"}
    assert "internal error on POST /v1/chat/completions" in caplog.text


async def test_middleware_lets_redirects_and_successes_through() -> None:
    async def ok(request: web.Request) -> web.StreamResponse:
        return web.Response(text="ok")

    assert (await call(ok, req())).status == 200

    async def redirect(request: web.Request) -> web.StreamResponse:
        raise web.HTTPFound("/elsewhere")

    with pytest.raises(web.HTTPFound):
        await call(redirect, req())


# --------------------------------------------------------------------------- Content-Encoding, over HTTP

ENCODED_ROUTES = [
    ("/v1/chat/completions", "openai", {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/responses", "openai", {"model": "gpt-4o-mini", "input": "hi"}),
    ("/v1/messages", "anthropic", {"model": "gpt-4o-mini", "max_tokens": 64,
                                   "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/messages/count_tokens", "anthropic",
     {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/ctxproxy/explain", "openai", {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/embeddings", "openai", {"model": "gpt-4o-mini", "input": "hi"}),  # relayed
]


@pytest.mark.parametrize("coding", ["br", "zstd", "gzip, br", "compress"])
@pytest.mark.parametrize(("path", "shape", "body"), ENCODED_ROUTES, ids=[r[0] for r in ENCODED_ROUTES])
async def test_a_body_in_a_coding_the_proxy_does_not_decode_is_415_in_the_wires_shape(
        upstream: FakeUpstream, start_proxy: StartProxy, path: str, shape: str, body: dict[str, Any],
        coding: str) -> None:
    """A br or zstd body used to get aiohttp's plain-text 400 (whether the optional decoders were installed
    decided it): now 415 in the wire's own error shape, with the codings it accepts, and nothing forwarded."""
    proxy = await start_proxy(base_config(upstream.base_url))
    status, headers, raw = await request(proxy, "POST", path, data=json.dumps(body).encode(),
                                         headers={"Content-Encoding": coding, "Content-Type": "application/json"})
    assert status == 415, raw[:300]
    assert headers["content-type"].startswith("application/json")
    assert headers["accept-encoding"] == "gzip, deflate"
    payload = json.loads(raw)
    if shape == "anthropic":
        assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error"
        assert "Content-Encoding" in payload["error"]["message"]
    else:
        assert payload["error"]["code"] == "unsupported_content_encoding"
        assert payload["error"]["type"] == "invalid_request_error"
    assert not upstream.chat and not upstream.other


@pytest.mark.parametrize("coding", ["gzip", "deflate", "deflate, gzip", "identity"])
@pytest.mark.parametrize(("path", "shape", "body"), ENCODED_ROUTES, ids=[r[0] for r in ENCODED_ROUTES])
async def test_gzip_and_deflate_bodies_keep_working(upstream: FakeUpstream, start_proxy: StartProxy, path: str,
                                                    shape: str, body: dict[str, Any], coding: str) -> None:
    """The proxy decodes gzip and deflate itself now (aiohttp's decoding is off): the request is served as if sent
    plain, and what goes upstream is the decoded body."""
    proxy = await start_proxy(base_config(upstream.base_url))
    data = json.dumps(body).encode()
    for name in [c.strip() for c in coding.split(",")]:  # in the order they were applied
        data = data if name == "identity" else gzip.compress(data) if name == "gzip" else zlib.compress(data)
    status, _headers, raw = await request(proxy, "POST", path, data=data,
                                          headers={"Content-Encoding": coding, "Content-Type": "application/json"})
    assert status == 200, raw[:300]
    forwarded = [r.body for r in (upstream.chat or upstream.other)]
    if path == "/v1/embeddings":
        assert json.loads(forwarded[0] or upstream.other[0].raw) == body
    elif path not in ("/v1/ctxproxy/explain", "/v1/messages/count_tokens"):
        assert forwarded and forwarded[0]["model"] == "gpt-4o-mini"


@pytest.mark.parametrize("stream", [False, True])
async def test_an_integer_beyond_64_bits_reaches_the_upstream_exactly(
        start_proxy: StartProxy, upstream: FakeUpstream, stream: bool) -> None:
    """A managed body is written again before it is forwarded: an integer too large for 64 bits (a seed, an
    account number in metadata or in a message's tool arguments) must reach the provider as the client wrote
    it, not as a float."""
    big, bigger = 12345678901234567890123, -99999999999999999999999999
    proxy = await start_proxy(base_config(upstream.base_url, context_manager={
        "type": "summarising", "params": {"summarizer": "drop", "trimmer": {"max_tokens": 300}}}))
    messages = [{"role": "user", "content": "word " * 400}, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "again"}]
    raw = json.dumps({"model": "gpt-4o-mini", "messages": messages, "seed": big, "metadata": {"n": bigger},
                      "stream": stream}).encode()
    status, headers, answer = await request(proxy, "POST", "/v1/chat/completions", data=raw,
                                            headers={"Content-Type": "application/json"})
    assert status == 200, answer
    assert int(headers["x-ctxproxy-tokens-out"]) < int(headers["x-ctxproxy-tokens-in"])  # managed: re-written
    sent = json.loads(upstream.chat[-1].raw)
    assert sent["seed"] == big and sent["metadata"] == {"n": bigger}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/v1/messages"])
async def test_a_body_arriving_in_many_pieces_is_forwarded_as_sent(start_proxy: StartProxy, upstream: FakeUpstream,
                                                                   path: str) -> None:
    """A chunked body trickling in (one HTTP chunk per piece, some read only after a wait) is read whole, its pieces
    in order, and an untouched request goes upstream byte for byte as the client wrote it."""
    proxy = await start_proxy(base_config(upstream.base_url))
    text = "".join(f"piece {i} " for i in range(3000))
    body = ({"model": "gpt-4o-mini", "max_tokens": 50, "messages": [{"role": "user", "content": text}]}
            if path != "/v1/responses" else {"model": "gpt-4o-mini", "input": text})
    raw = json.dumps(body).encode()

    async def pieces() -> Any:
        for i in range(0, len(raw), 997):
            yield raw[i:i + 997]
            if i % 5 == 0:
                await asyncio.sleep(0.005)

    status, _headers, answer = await request(proxy, "POST", path, data=pieces(),
                                             headers={"Content-Type": "application/json"})
    assert status == 200, answer
    forwarded = (upstream.chat or upstream.other)[-1].raw
    assert forwarded == raw


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/ctxproxy/explain"])
async def test_empty_bodies_one_after_another_are_each_answered(start_proxy: StartProxy, upstream: FakeUpstream,
                                                                path: str) -> None:
    """aiohttp gives every empty body one shared reader whose later reads say "a chunk ended", never "the end":
    each empty request is still answered at once."""
    proxy = await start_proxy(base_config(upstream.base_url))
    for _ in range(3):
        status, _headers, answer = await asyncio.wait_for(
            request(proxy, "POST", path, data=b"", headers={"Content-Type": "application/json"}), 10)
        assert status == 400, answer
    assert not upstream.chat


MODEL = "gpt-4o-mini"


OVERRIDE = "x-ctxproxy-context-manager"


@pytest.mark.usefixtures("shared_model_map")
async def test_escaped_crlf_in_an_override_never_reaches_a_header(upstream: FakeUpstream, start_proxy: StartProxy
                                                                  ) -> None:
    """An override whose JSON key holds \\r\\n is ignored with a clean, single-line warning header."""
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


async def chat(proxy: RunningProxy, messages: list[dict[str, Any]], request_id: str | None = None
               ) -> tuple[int, dict[str, str]]:
    headers = {"Authorization": "Bearer sk-client"}
    if request_id is not None:
        headers["x-request-id"] = request_id
    async with aiohttp.ClientSession() as s, s.post(proxy.base_url + "/chat/completions", headers=headers,
                                                    json={"model": "small-model", "messages": messages}) as r:
        await r.read()
        return r.status, {k.lower(): v for k, v in r.headers.items()}


def ids(upstream: FakeUpstream, purpose: str) -> list[str | None]:
    """X-Request-ID of every request the upstream received for ``purpose`` (summarize, or a path)."""
    return [rid for p, rid in upstream.request_ids if p == purpose]


@pytest.mark.usefixtures("shared_model_map")
async def test_chat_request_id_sent_upstream_is_a_uuid(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """A chat request without x-request-id is sent upstream with a generated UUID."""
    proxy = await start_proxy(config(upstream.base_url))
    status, headers = await chat(proxy, [{"role": "user", "content": "hi"}])
    assert status == 200
    sent = ids(upstream, "/v1/chat/completions")
    assert len(sent) == 1 and is_uuid(sent[0]), sent
    assert headers["x-request-id"] == sent[0]


@pytest.mark.usefixtures("shared_model_map")
async def test_clients_own_request_id_is_kept_upstream(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """The client's own x-request-id is sent upstream and echoed back unchanged."""
    proxy = await start_proxy(config(upstream.base_url))
    mine = str(uuid.uuid4())
    status, headers = await chat(proxy, [{"role": "user", "content": "hi"}], request_id=mine)
    assert status == 200
    assert ids(upstream, "/v1/chat/completions") == [mine]
    assert headers["x-request-id"] == mine


@given(st.lists(st.sampled_from([b"0", b"7", b"9", b"a", b"\"", b" ", b"\xff", b"/", b":"]), max_size=60),
       st.integers(0, 25))
def test_the_long_digit_check_finds_what_the_regular_expression_finds(parts: list[bytes], run: int) -> None:
    """The run-of-20-digits check that sends a body to the exact decoder answers as ``LONG_DIGITS`` does, at a
    fraction of its cost on a large body."""
    raw = b"".join(parts[: len(parts) // 2]) + b"5" * run + b"".join(parts[len(parts) // 2:])
    assert long_digits(raw) == bool(LONG_DIGITS.search(raw))


async def test_explaining_a_body_with_an_integer_beyond_64_bits_answers_it_exactly(
        start_proxy: StartProxy, upstream: FakeUpstream) -> None:
    """The explain endpoint answers with the body it would forward: an integer read exactly must be written
    back exactly, not end in a 500 (found by the long fuzz)."""
    big = 12345678901234567890123
    proxy = await start_proxy(base_config(upstream.base_url))
    raw = json.dumps({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi", "n": big}]}).encode()
    status, _, answer = await request(proxy, "POST", "/v1/ctxproxy/explain", data=raw,
                                      headers={"Content-Type": "application/json"})
    assert status == 200, answer
    assert b"12345678901234567890123" in answer


# --------------------------------------------------------------------------- Expect: 100-continue


async def _expecting(proxy: RunningProxy, path: str, body: bytes, *, announced: int | None = None,
                     expect: str = "100-continue", version: str = "1.1",
                     closing: list[bool] | None = None) -> tuple[list[bytes], bytes]:
    """Send a request's head with ``Expect`` and wait: the body goes only after a ``100 Continue``. Returns the
    status lines read and the final answer's body (``closing``: whether it says ``Connection: close``)."""
    port = int(proxy.url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (f"POST {path} HTTP/{version}\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer sk-client\r\nx-api-key: sk-client\r\nExpect: {expect}\r\n"
            f"Content-Length: {len(body) if announced is None else announced}\r\n\r\n")
    writer.write(head.encode())
    await writer.drain()
    statuses: list[bytes] = []
    try:
        while True:
            line = await asyncio.wait_for(reader.readline(), 5)
            statuses.append(line.rstrip())
            if b" 100 " in line:
                assert await reader.readline() == b"\r\n"
                writer.write(body)
                await writer.drain()
                continue
            break
        head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).decode()
        length = int(re.search(r"(?im)^content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
        if closing is not None:
            closing.append(re.search(r"(?im)^connection: *close", head) is not None)
        return statuses, await asyncio.wait_for(reader.readexactly(length), 5)
    finally:
        writer.close()


WIRE_BODIES = {
    "/v1/chat/completions": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"model": "gpt-4o-mini", "input": "hi"},
    "/v1/messages": {"model": "gpt-4o-mini", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]},
}


@pytest.mark.parametrize("path", list(WIRE_BODIES))
async def test_a_body_announced_over_the_limit_is_refused_before_it_is_sent(
        start_proxy: StartProxy, upstream: FakeUpstream, path: str) -> None:
    """With ``Expect: 100-continue`` and a Content-Length over ``max_body_mb``, the answer is the 413 in the wire's
    shape, with no ``100 Continue`` first: the client never sends the body (aiohttp's default asked for it), and
    is told to close the connection (a next request on it would be read as that body)."""
    proxy = await start_proxy(base_config(upstream.base_url, server={"max_body_mb": 0.01}))
    closing: list[bool] = []
    statuses, answer = await _expecting(proxy, path, b"", announced=1_000_000, closing=closing)
    assert statuses == [b"HTTP/1.1 413 Request Entity Too Large"]
    error = json.loads(answer)
    assert error["error"]["type"] == ("request_too_large" if path == "/v1/messages" else "invalid_request_error")
    assert closing == [True]
    assert not upstream.chat and not upstream.other


@pytest.mark.parametrize("path", list(WIRE_BODIES))
async def test_a_body_within_the_limit_is_asked_for_and_forwarded(
        start_proxy: StartProxy, upstream: FakeUpstream, path: str) -> None:
    """The proxy answers the expectation itself and holds the whole body before forwarding it: the upstream is
    not asked for a 100 of its own (one that never sends one would make the request wait for first_byte_timeout)."""
    proxy = await start_proxy(base_config(upstream.base_url))
    raw = json.dumps(WIRE_BODIES[path]).encode()
    statuses, _answer = await _expecting(proxy, path, raw)
    assert statuses == [b"HTTP/1.1 100 Continue", b"HTTP/1.1 200 OK"]
    sent = (upstream.chat or upstream.other)[-1]
    assert sent.raw == raw
    assert "expect" not in {name.lower() for name in sent.headers}


@pytest.mark.parametrize(("path", "anthropic"), [("/v1/messages", True), ("/v1/chat/completions", False),
                                                 ("/v1/ctxproxy/explain/messages", True)])
async def test_an_unknown_expectation_is_417_in_the_wires_shape(
        start_proxy: StartProxy, upstream: FakeUpstream, path: str, anthropic: bool) -> None:
    """No 100 for it: the body is refused (417) before it is read, in the shape of the wire the handler names."""
    proxy = await start_proxy(base_config(upstream.base_url))
    raw = json.dumps(WIRE_BODIES["/v1/messages"]).encode()
    statuses, answer = await _expecting(proxy, path, raw, expect="something-else")
    assert statuses == [b"HTTP/1.1 417 Expectation Failed"]
    error = json.loads(answer)
    assert (error.get("type") == "error") is anthropic
    assert "something-else" in error["error"]["message"]
    assert not upstream.chat and not upstream.other


@pytest.mark.parametrize("expect", ["100-continue", "something-else"])
async def test_an_http_1_0_expectation_means_nothing(start_proxy: StartProxy, upstream: FakeUpstream,
                                                     expect: str) -> None:
    """HTTP/1.0 has no interim answers: the body follows the head, and the request is served as any other (its
    Expect not passed on)."""
    proxy = await start_proxy(base_config(upstream.base_url))
    raw = json.dumps(WIRE_BODIES["/v1/chat/completions"]).encode()
    port = int(proxy.url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"POST /v1/chat/completions HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\nExpect: "
                 f"{expect}\r\nAuthorization: Bearer sk-client\r\nContent-Length: {len(raw)}\r\n\r\n".encode()
                 + raw)
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    assert answer.startswith(b"HTTP/1.0 200 OK") or answer.startswith(b"HTTP/1.1 200 OK"), answer[:200]
    assert upstream.chat[-1].raw == raw
    assert "expect" not in {name.lower() for name in upstream.chat[-1].headers}


@pytest.mark.parametrize(("method", "path", "expect", "length"), [
    ("GET", "/v1/models", "100-continue", 1_000_000),  # over max_body_mb: no 100; the route reads no body
    ("GET", "/healthz", "something-else", 10),  # an expectation only read_body refuses; the route reads none
    ("POST", "/v1/chat/completions", "100-continue", 1_000_000),  # refused (413)
])
async def test_an_answer_before_an_announced_body_closes_the_connection(
        start_proxy: StartProxy, upstream: FakeUpstream, method: str, path: str, expect: str, length: int) -> None:
    """A client sends no body it was not asked for (no 100 Continue): an answer made without it says
    ``Connection: close``, or the next request on the connection would be read as that body."""
    proxy = await start_proxy(base_config(upstream.base_url, server={"max_body_mb": 0.01}))
    reader, writer = await asyncio.open_connection("127.0.0.1", int(proxy.url.rsplit(":", 1)[1]))
    try:
        writer.write(f"{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-client\r\n"
                     f"Expect: {expect}\r\nContent-Length: {length}\r\n\r\n".encode())
        head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).decode()
    finally:
        writer.close()
    assert " 100 " not in head.split("\r\n", 1)[0]
    assert re.search(r"(?im)^connection: *close", head), head
