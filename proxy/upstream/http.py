"""OpenAI-compatible HTTP upstreams: pooled clients, headers, timeouts and error mapping.

Upstreams get one pooled ``HTTPClient`` (``proxy.upstream.client``) per base URL. Every failure
below HTTP becomes an ``UpstreamError`` (502 unreachable, 504 timeout); an
upstream 4xx/5xx becomes ``UpstreamStatus`` with an OpenAI-shaped body. The
upstream's own key never reaches a client: it is blanked out of error bodies and
of answers, streamed or not.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

import orjson
from multidict import CIMultiDict, CIMultiDictProxy

from plugins.base import Completion
from proxy.core.deadline import deadline
from proxy.core.errors import (
    UpstreamError,
    UpstreamStatus,
    UpstreamTimeout,
    UpstreamUnreachable,
    normalise_error_body,
)
from proxy.settings import ServerSettings, UpstreamSettings
from proxy.upstream.base import Outgoing
from proxy.upstream.client import ClientError, ConnectTimeout, HTTPClient, InvalidResponse, Response

if TYPE_CHECKING:
    from proxy.policy import ModelRoute

log = logging.getLogger("ctxproxy")

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te",
    "trailer", "trailers", "transfer-encoding", "upgrade", "host", "content-length", "accept-encoding",
    "content-encoding", "forwarded", "x-forwarded-for", "x-forwarded-host", "x-forwarded-proto", "x-real-ip",
    "cookie", "cookie2",
    "expect",  # (answered by the proxy, which holds the whole body before it forwards it: proxy.serve.http)
})
CLIENT_CREDENTIALS = frozenset({"authorization", "api-key", "x-api-key", "openai-organization", "openai-project"})
RESPONSE_DROP = HOP_BY_HOP | {"date", "server", "set-cookie", "set-cookie2", "x-request-id"}


class UpstreamPool:
    """One pooled client per upstream base URL and pool settings (the app owns one pool).

    ``server`` is replaced on a reload (``configure``): the timeouts read from it apply to the next request.
    A client is keyed by the settings it was built with, so a reload that changes an upstream's
    ``max_connections`` / ``keepalive_seconds`` or ``server.connect_timeout`` opens a new client for new
    requests; the old one finishes its requests in flight and is closed with the pool. A client keeps no
    cookies: a provider's ``Set-Cookie`` (a CDN's session cookie) answered to one client's request never goes
    out with another's; the proxy relays no cookies either way (``HOP_BY_HOP``, ``RESPONSE_DROP``).
    """

    def __init__(self, server: ServerSettings) -> None:
        self.server = server
        self._sessions: dict[tuple[str, int, float, float], HTTPClient] = {}

    def configure(self, server: ServerSettings) -> None:
        self.server = server

    def session(self, upstream: UpstreamSettings) -> HTTPClient:
        key = (upstream.base_url, upstream.max_connections, upstream.keepalive_seconds, self.server.connect_timeout)
        session = self._sessions.get(key)
        if session is None or session.closed:
            session = HTTPClient(limit=upstream.max_connections, keepalive=upstream.keepalive_seconds,
                                 connect_timeout=self.server.connect_timeout)
            self._sessions[key] = session
        return session

    async def close(self) -> None:
        sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            await session.close()


def upstream_headers(
    client_headers: Mapping[str, str], upstream: UpstreamSettings, *, forward_client_auth: bool, request_id: str
) -> CIMultiDict[str]:
    """Headers sent upstream: the client's, less hop-by-hop, proxy-only and (unless allowed) credentials."""
    out: CIMultiDict[str] = CIMultiDict()
    listed = connection_listed(client_headers)
    for name, value in client_headers.items():
        lower = name.lower()
        if lower in HOP_BY_HOP or lower in listed or lower.startswith("x-ctxproxy-") or lower == "x-request-id":
            continue
        if lower in CLIENT_CREDENTIALS and not forward_client_auth:
            continue
        out.add(name, value)
    for name, value in upstream.headers.items():
        out[name] = value
    if upstream.api_key:
        out["Authorization"] = f"Bearer {upstream.api_key}"
    out["X-Request-Id"] = request_id
    return out


def response_headers(upstream: Mapping[str, str]) -> CIMultiDict[str]:
    """Upstream response headers worth relaying (rate limits, Retry-After, processing time, ...)."""
    out: CIMultiDict[str] = CIMultiDict()
    listed = connection_listed(upstream)
    for name, value in upstream.items():
        lower = name.lower()
        # x-ctxproxy-* answer headers are this proxy's own: an upstream (another ctxproxy?) never sets them here
        if lower not in RESPONSE_DROP and lower not in listed and not lower.startswith("x-ctxproxy-"):
            out.add(name, value)
    return out


def connection_listed(headers: Mapping[str, str]) -> frozenset[str]:
    """Header names the sender declared hop-by-hop in its ``Connection`` header (RFC 9110 §7.6.1)."""
    if isinstance(headers, (CIMultiDict, CIMultiDictProxy)):  # aiohttp's: one lookup, not a pass over them all
        values = headers.getall("Connection", ())
    else:
        values = [value for name, value in headers.items() if name.lower() == "connection"]
    if not values:
        return NOTHING_LISTED
    return frozenset(token.strip().lower() for value in values for token in value.split(",") if token.strip())


NOTHING_LISTED: frozenset[str] = frozenset()


async def open_request(
    session: HTTPClient,
    method: str,
    url: str,
    *,
    data: bytes | None,
    headers: Mapping[str, str],
    first_byte_timeout: float,
) -> Response:
    """Send a request and wait for the response headers, mapping transport failures to 502/504."""
    try:
        return await session.request(method, url, data=data, headers=headers, timeout=first_byte_timeout)
    except ConnectTimeout:
        raise UpstreamTimeout("Connecting to the upstream timed out.") from None
    except asyncio.TimeoutError:
        raise UpstreamTimeout("The upstream did not answer in time.") from None
    except InvalidResponse as exc:  # not HTTP: a garbage status line, oversized headers, bad chunking
        raise UpstreamUnreachable(f"The upstream sent an invalid HTTP response ({type(exc).__name__}).") from None
    except ClientError as exc:
        raise UpstreamUnreachable(f"The upstream is unreachable ({exc.kind}).") from None
    except OSError as exc:
        raise UpstreamUnreachable(f"The upstream is unreachable ({type(exc).__name__}).") from None


async def read_error(response: Response, idle_timeout: float,
                     secret: str | None = None) -> UpstreamError:
    """An upstream 4xx/5xx as an UpstreamStatus with an OpenAI-shaped body (``secret`` blanked out of it).

    When the proxy sent its own key (``secret``) and the upstream rejects it (401/403), the client's
    credentials are not at fault: that is a gateway misconfiguration, answered 502.
    """
    try:
        async with deadline(idle_timeout):
            raw = await response.read()
    except (asyncio.TimeoutError, ClientError):
        raw = b""
    finally:
        response.release()
    if secret and response.status in (401, 403):
        log.error("the upstream rejected the proxy's configured API key (HTTP %d)", response.status)
        return UpstreamError("The upstream rejected the proxy's credentials; the proxy's operator must fix "
                             "its configuration.", code="upstream_auth_failed")
    if secret and raw:  # a provider may echo the key it was sent ("Incorrect API key provided: sk-...")
        raw = raw.replace(secret.encode(), b"[redacted]")
    try:
        payload: Any = orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError:
        payload = raw.decode("utf-8", "replace")
    return UpstreamStatus(response.status, normalise_error_body(response.status, payload),
                          dict(response_headers(response.headers)), payload)


class Redactor:
    """Blanks a secret out of a byte stream, also when it is split across chunks.

    Only a chunk's tail that could be the start of the secret is held back (usually nothing),
    so streaming is not delayed.
    """

    def __init__(self, secret: str | None) -> None:
        self.secret = secret.encode() if secret else b""
        self._held = b""

    def feed(self, chunk: bytes) -> bytes:
        if not self.secret:
            return chunk
        data = self._held + chunk
        data = data.replace(self.secret, REDACTED)
        keep = 0
        for n in range(min(len(self.secret) - 1, len(data)), 0, -1):
            if self.secret.startswith(data[-n:]):
                keep = n
                break
        self._held = data[len(data) - keep:] if keep else b""
        return data[: len(data) - keep] if keep else data

    def flush(self) -> bytes:
        held, self._held = self._held, b""
        return held


REDACTED = b"[redacted]"


class HTTPAnswer:
    """An upstream's ``Response`` as an ``Answer`` (``proxy.upstream.base``)."""

    def __init__(self, response: Response, secret: str | None) -> None:
        self.response = response
        self.status = response.status
        self.headers = response_headers(response.headers)
        self.streaming = response.content_type == "text/event-stream"
        self._secret = secret

    async def chunks(self, idle_timeout: float) -> AsyncIterator[bytes]:
        redactor = Redactor(self._secret)
        response = self.response
        while True:
            try:
                # what has arrived already is taken without a timer (arming one costs more than relaying a chunk)
                chunk = response.read_nowait()
                if not chunk and not response.at_eof():
                    async with deadline(idle_timeout):
                        chunk = await response.readany()
            except asyncio.TimeoutError:
                raise UpstreamTimeout(f"The upstream stream stalled for more than {idle_timeout:g}s.") from None
            except InvalidResponse:
                raise UpstreamUnreachable("The upstream sent a malformed stream.") from None
            except (ClientError, OSError):
                raise UpstreamUnreachable("The upstream closed the stream before it was complete.") from None
            if not chunk:
                tail = redactor.flush()
                if tail:
                    yield tail
                return
            out = redactor.feed(chunk)
            if out:
                yield out

    async def read(self, idle_timeout: float) -> bytes:
        try:
            if self.response.is_eof():  # all here already, as a short answer is with its head: nothing to wait for
                raw = self.response.read_arrived()
            else:
                async with deadline(idle_timeout):
                    raw = await self.response.read()
        except asyncio.TimeoutError:
            self.response.close()
            raise UpstreamTimeout("The upstream stalled while sending its answer.") from None
        except InvalidResponse:
            self.response.close()
            raise UpstreamUnreachable("The upstream sent an invalid HTTP response (InvalidResponse).") from None
        except ClientError:
            self.response.close()
            raise UpstreamUnreachable("The upstream closed the connection before its answer was complete.") from None
        finally:
            self.response.release()
        if self._secret and self._secret.encode() in raw:
            raw = raw.replace(self._secret.encode(), REDACTED)
        return raw

    def close(self, clean: bool) -> None:
        if clean:
            self.response.release()
        else:
            self.response.close()


class HTTPProvider:
    """An OpenAI-compatible HTTP API (``api: openai``) as a ``Provider``."""

    def __init__(self, upstream: UpstreamSettings, pool: UpstreamPool, *, forward_client_auth: bool) -> None:
        self.upstream = upstream
        self.pool = pool
        self.forward_client_auth = forward_client_auth

    def url(self, path: str) -> str:
        return self.upstream.base_url + path

    async def send(self, route: ModelRoute, call: Outgoing) -> HTTPAnswer:
        headers = upstream_headers(call.client_headers, self.upstream, forward_client_auth=self.forward_client_auth,
                                   request_id=call.request_id)
        headers["Content-Type"] = "application/json"
        response = await open_request(self.pool.session(self.upstream), "POST", self.url(call.path), data=call.data,
                                      headers=headers, first_byte_timeout=self.pool.server.first_byte_timeout)
        if response.status >= 400:
            raise await read_error(response, self.pool.server.idle_timeout, self.upstream.api_key)
        return HTTPAnswer(response, self.upstream.api_key)

    async def complete(
        self, route: ModelRoute, messages: list[dict[str, Any]], *, max_tokens: int, timeout: float,
        request_id: str,
    ) -> Completion:
        body: dict[str, Any] = {"model": route.upstream_model, "messages": messages, "max_tokens": max_tokens,
                                "temperature": 0}
        headers = upstream_headers({"Content-Type": "application/json"}, self.upstream, forward_client_auth=False,
                                   request_id=request_id)
        headers["x-ctxproxy-purpose"] = "summarize"
        response = await open_request(self.pool.session(self.upstream), "POST", self.url("/chat/completions"),
                                      data=orjson.dumps(body), headers=headers, first_byte_timeout=timeout)
        if response.status >= 400:
            raise await read_error(response, timeout, self.upstream.api_key)
        # (an upstream that echoes the key must not put it into a cached summary)
        raw = await HTTPAnswer(response, self.upstream.api_key).read(timeout)
        try:
            payload = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise UpstreamError("The upstream's answer is not JSON.", code="upstream_invalid_answer") from None
        return completion_from(payload, route)


def completion_from(payload: Any, route: ModelRoute) -> Completion:
    """A Chat Completions answer as the summariser's ``Completion`` (priced on the upstream model)."""
    text = ""
    try:
        content = payload["choices"][0]["message"].get("content")
        text = content if isinstance(content, str) else ""
    except (KeyError, IndexError, TypeError, AttributeError):
        text = ""
    usage = payload.get("usage") if isinstance(payload, dict) else None
    usage = usage if isinstance(usage, dict) else {}
    return Completion(text, route.name, _int(usage.get("prompt_tokens")), _int(usage.get("completion_tokens")),
                      route.upstream_model)


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
