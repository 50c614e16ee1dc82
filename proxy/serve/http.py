"""Small HTTP helpers shared by the handlers: bodies, keys, request ids, JSON answers, the error middleware."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import HttpVersion11, web
from aiohttp.http_exceptions import PayloadEncodingError
from aiohttp.web_protocol import RequestPayloadError
from multidict import CIMultiDict

from proxy.core.deadline import deadline
from proxy.core.errors import (
    BadRequest,
    BodyTooLarge,
    CtxProxyError,
    RequestTimeout,
    RouteError,
    UnsupportedEncoding,
    UpstreamStatus,
)
from proxy.serve.decoding import content_codings, decode_body
from proxy.serve.ids import RequestIds
from proxy.serve.state import STATE, State
from proxy.store.guard import cache_budget
from proxy.wire import WIRES
from proxy.wire.protocol import STANDARD_KEY_HEADERS, Wire, read_keys

log = logging.getLogger("ctxproxy")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
OVERRIDE_HEADER = "x-ctxproxy-context-manager"
# headers every answer to this request carries, errors included (x-request-id, x-ctxproxy-*)
RESPONSE_HEADERS = web.RequestKey("response_headers", CIMultiDict[str])
# the wire whose error shape this request's errors take (before a handler says: the path's wire, else OpenAI's)
ERROR_WIRE = web.RequestKey("error_wire", Wire)
ErrorBody = Callable[[CtxProxyError], dict[str, Any]]


def state(request: web.Request) -> State:
    return request.app[STATE]


def json_response(payload: Any, status: int = 200, headers: Any = None) -> web.Response:
    return web.Response(body=orjson.dumps(payload), status=status, content_type="application/json",
                        headers=headers)


def openai_body(error: CtxProxyError) -> dict[str, Any]:
    """OpenAI's error shape: the proxy's own endpoints' (the admin, explain and relayed paths of no wire)."""
    return error.to_openai()


def error_response(error: CtxProxyError, headers: Any = None, body: ErrorBody = openai_body) -> web.Response:
    """``error`` as an answer: ``body`` gives its shape (a wire's ``error_body``), the headers carry on."""
    out: CIMultiDict[str] = CIMultiDict(headers or {})
    out.popall("Content-Type", None)  # the upstream's, when it failed after sending its headers
    if isinstance(error, (UpstreamStatus, UnsupportedEncoding)):
        for name, value in error.headers.items():
            if name.lower() not in ("content-type",):
                out[name] = value
    return json_response(body(error), error.status, out)


def error_shape(request: web.Request) -> ErrorBody:
    """How this request's errors look: its wire's (a handler names it), else the wire its path belongs to."""
    wire: Wire | None = request.get(ERROR_WIRE)
    if wire is not None:
        return wire.error_body
    st = request.app.get(STATE)
    wires = st.wires if isinstance(st, State) else WIRES  # (an app without the state: the default wires)
    found = wires.for_path(request.path, below=True)
    return found.error_body if found is not None else openai_body


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure becomes the wire's error shape; no traceback ever reaches a client.

    Each request (and each task it starts) also gets its cache-time budget here (``proxy.store.guard``).
    """
    st = request.app.get(STATE)
    response: web.StreamResponse
    try:
        with cache_budget(st.config.settings.cache.budget_seconds if st is not None else None):
            response = await handler(request)
    except CtxProxyError as exc:
        response = error_response(exc, request.get(RESPONSE_HEADERS), error_shape(request))
    except web.HTTPRequestEntityTooLarge:
        response = error_response(BodyTooLarge("The request body is larger than this proxy accepts."),
                                  body=error_shape(request))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        response = error_response(RouteError(exc.status, exc.reason), body=error_shape(request))
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("internal error on %s %s", request.method, request.path)
        response = error_response(CtxProxyError("The proxy failed to handle this request."),
                                  request.get(RESPONSE_HEADERS), error_shape(request))
    if expectation(request) is not None and not response.prepared and not request.content.is_eof():
        # answered before the body it announced was read (refused, or a route that reads none): a client waiting for
        # 100 Continue (none sent: expect_continue) never sends it, and the next request on this connection would be
        # read as that body
        response.force_close()
    return response


def client_keys(request: web.Request, names: tuple[str, ...] = STANDARD_KEY_HEADERS) -> tuple[str, ...]:
    """Every key a client sent in ``names`` (a wire's ``key_headers``), in order; by default
    ``Authorization: Bearer``, ``x-api-key`` (Anthropic clients), ``api-key``.

    A client may send more than one (Claude Code with both ``ANTHROPIC_AUTH_TOKEN`` and ``ANTHROPIC_API_KEY``
    set): authentication takes the first that names a tenant.
    """
    return read_keys(request.headers, names)


def body_limit(request: web.Request) -> int:
    """The largest body accepted, in bytes: the running config's ``server.max_body_mb``, read per request, so a
    reload that raises or lowers it applies at once (aiohttp's own ``client_max_size`` is fixed when the app is
    built: it limits nothing here)."""
    return int(state(request).config.settings.server.max_body_mb * 1024 * 1024)


def expectation(request: web.Request) -> str | None:
    """What the request's ``Expect`` asks for, trimmed and in lower case; None when it asks nothing (an HTTP/1.0
    request's ``Expect`` means nothing: RFC 9110, 10.1.1)."""
    expect = request.headers.get("Expect")
    if not expect or request.version != HttpVersion11:
        return None
    return expect.strip().lower()


async def expect_continue(request: web.Request) -> None:
    """Every route's answer to an ``Expect`` header, before its handler runs: the interim ``100 Continue`` for
    ``100-continue``, unless the body announced is over ``body_limit`` (aiohttp's default sent it, and the client
    its whole body, before the 413). Nothing for another expectation: ``read_body`` refuses it (417). Either
    refusal is the handler's, through the middlewares, in the wire's shape, as every other answer."""
    if expectation(request) != "100-continue":
        return
    if request.content_length is None or request.content_length <= body_limit(request):
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # (what the answer writes is counted from here, as aiohttp does)


async def read_body(request: web.Request) -> bytes:
    """The request's body, its Content-Encoding undone (``proxy.serve.decoding``), within the size (``body_limit``)
    and time limits."""
    server = state(request).config.settings.server
    limit = body_limit(request)
    expects = expectation(request)
    if expects is not None and expects != "100-continue":
        raise RouteError(417, f"The request expects {header_safe(expects, 100)!r}; only '100-continue' is known.")
    if request.content_length is not None and request.content_length > limit:
        raise BodyTooLarge(f"The request body is {request.content_length} bytes; the limit is {limit}.")
    codings = content_codings(request.headers.getall("Content-Encoding", []))  # 415 before reading it
    # the chunks as read, joined once (a body that arrived whole is one chunk: no copy). Not a growing bytearray: its
    # buffer and the copy out of it were two more copies of the body (docs/benchmarks.md, tenth stop)
    chunks: list[bytes] = []
    size = 0
    content = request.content
    try:
        if content.is_eof():  # a body all here already (a small one arrives with its head): taken as it is
            chunks.append(content.read_nowait())
            size = len(chunks[0])
        else:
            async with deadline(server.body_timeout):
                while chunk := await content.readany():
                    chunks.append(chunk)
                    size += len(chunk)
                    if size > limit:
                        break
        if size > limit:
            raise BodyTooLarge(f"The request body is larger than the limit of {limit} bytes.")
    except asyncio.TimeoutError:  # (also a chunked body whose framing broke, under aiohttp's compiled parser)
        raise RequestTimeout(f"The request body did not arrive whole within {server.body_timeout:g}s.") from None
    except (RequestPayloadError, PayloadEncodingError):  # its framing broke (a chunk size that is not one ...)
        raise BadRequest("The request body's framing is malformed (Transfer-Encoding or Content-Length): it could "
                         "not be read.", code="invalid_body") from None
    raw = b"".join(chunks)
    if not codings:
        return raw
    if len(raw) > server.offload_bytes:
        return await asyncio.get_running_loop().run_in_executor(None, decode_body, raw, codings, limit)
    return decode_body(raw, codings, limit)


def dumps_json(value: Any) -> bytes:
    """Any JSON the proxy answers with (an explained body included): its integers beyond 64 bits as read."""
    try:
        return orjson.dumps(value)
    except TypeError as exc:
        if "64-bit" not in str(exc):
            raise
        return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")


def dumps_body(body: dict[str, Any]) -> bytes:
    """A body as JSON to forward (a 400 when it cannot be: orjson reads 1024 levels of nesting, writes 254)."""
    try:
        return orjson.dumps(body)
    except TypeError as exc:
        if "64-bit" in str(exc):  # an integer read exactly (``LONG_DIGITS``): written as the client wrote it
            return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")
        raise BadRequest("The request body is nested too deeply (more than 254 levels) to be forwarded.",
                         code="invalid_json") from None


def header_safe(text: str, limit: int = 1000) -> str:
    """A header value from anything: printable ASCII only (no CR/LF, no control characters), cut short."""
    return "".join(c if " " <= c <= "~" else "?" for c in text)[:limit]


def request_id(request: web.Request, ids: RequestIds) -> str:
    """The client's own ``x-request-id`` when it is a plain token, else a new UUID of ``ids`` (sent upstream too)."""
    given = request.headers.get("x-request-id", "")
    return given if REQUEST_ID.match(given) else ids.new()
