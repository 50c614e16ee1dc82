"""Model routes with ``provider: litellm``: a ``Provider`` over ``litellm.acompletion``, in OpenAI's shapes,
and over litellm's Anthropic-messages interface (``litellm.anthropic_interface.messages.acreate``) for
Messages requests, in Anthropic's shapes, to any provider litellm knows.

The Responses wire goes through ``litellm.aresponses`` (litellm translates it for
providers without a Responses API); its stream is re-emitted as named SSE events.

The HTTP route's contract (``proxy.upstream.http``) holds here too: no retries of litellm's or
of the SDKs under it (``num_retries`` and ``max_retries`` 0: the client decides, and a request a
provider received is billed once); ``server.connect_timeout`` to connect, then the whole answer
(non-streaming) or its first event (streaming) within ``server.first_byte_timeout`` (504 after),
then ``server.idle_timeout`` between events; ``upstreams.<name>.headers`` and ``X-Request-Id`` sent
with every call; failures mapped by ``proxy.upstream.litellm_errors`` (502 unreachable, 504 timeout,
the provider's status with its ``Retry-After`` and rate-limit headers), and the provider's headers
relayed with a successful answer where litellm keeps them (Chat Completions, Responses).

litellm is imported on first use only (its import costs seconds and ~150 MB),
with its local model map so nothing is fetched at run time. Its loggers lose the
stream handler litellm gives them, so their records reach the process's own
handlers (the server's JSON lines) and nothing writes to stdout or stderr on the
event loop; its per-call INFO line is kept only when the process logs at DEBUG.

A streaming Messages request for a model litellm sends to Anthropic's own Messages API (``anthropic/…``) is
streamed by litellm code that imports its proxy server (fastapi and more: the ``litellm[proxy]`` extra);
without it that import failed after the request had been sent (billed, and answered 502). Where it cannot, the
request is asked for whole and told to the client as the stream of events it is made of (``message_events``),
with a warning once per model (and config); other providers' Messages streams are translated from their own
and stream as they come.

No cookie crosses requests: litellm pools one HTTP client per provider, key and base URL for every
caller, and the httpx client it makes for OpenAI's SDK (the ``openai/``, ``azure/`` and OpenAI-compatible
providers) kept a provider's ``Set-Cookie`` and sent it with every later call: one tenant's session cookie
on another tenant's request. Those clients are made with a jar that stores and sends none (litellm's own
handler's clients already are), as the HTTP route's session has none (``proxy.upstream.http``).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
from collections.abc import AsyncIterator
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import TYPE_CHECKING, Any

import httpx
import orjson
from multidict import CIMultiDict

from plugins.base import Completion
from proxy.core.deadline import deadline
from proxy.core.errors import BadRequest, CtxProxyError, UpstreamTimeout
from proxy.core.modelinfo import offline_environment
from proxy.settings import ServerSettings, UpstreamSettings
from proxy.upstream.base import Outgoing
from proxy.upstream.http import REDACTED, Redactor, completion_from
from proxy.upstream.litellm_errors import answer_headers, upstream_error
from proxy.wire.chat import WIRE as CHAT
from proxy.wire.messages.stream import message_events

if TYPE_CHECKING:
    from proxy.policy import ModelRoute

# the wires litellm serves (one entry point each: ``_entry``); the fields each may pass are the wire's own
ENTRY_WIRES = ("chat", "responses", "messages")
LITELLM_LOGGERS = ("LiteLLM", "LiteLLM Router", "LiteLLM Proxy")
log = logging.getLogger("ctxproxy")


def _litellm() -> Any:
    offline_environment()
    import litellm

    litellm.telemetry = False
    litellm.suppress_debug_info = True
    _log_through_the_process()
    _cookieless_openai_clients()
    return litellm


def _log_through_the_process() -> None:
    """litellm's loggers without the stream handler it gives them (plain text, INFO to stdout, written on the
    caller's thread): their records go to the process's handlers like every other library's."""
    for name in LITELLM_LOGGERS:
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if isinstance(handler, logging.StreamHandler):
                logger.removeHandler(handler)
        if _warnings_or_debug not in logger.filters:
            logger.addFilter(_warnings_or_debug)


def _cookieless_openai_clients() -> None:
    """Every httpx client litellm makes for OpenAI's SDK without a cookie jar that keeps anything (module doc).

    Wraps litellm's one factory of them (``BaseOpenAILLM._get_async_http_client``; once, however often litellm
    is imported): the client it returns, new or ``litellm.aclient_session``, gets a jar whose policy allows no
    domain, so a response's cookies are never stored and none is sent."""
    from litellm.llms.openai.common_utils import BaseOpenAILLM

    factory = BaseOpenAILLM.__dict__.get("_get_async_http_client")
    made = getattr(factory, "__func__", None)
    if made is None or getattr(made, "cookieless", False):
        return

    def cookieless(*args: Any, **kwargs: Any) -> Any:
        client = made(*args, **kwargs)
        if isinstance(client, httpx.AsyncClient):
            client.cookies = CookieJar(policy=DefaultCookiePolicy(allowed_domains=()))  # (a Cookies would be copied)
        return client

    cookieless.cookieless = True  # type: ignore[attr-defined]
    BaseOpenAILLM._get_async_http_client = staticmethod(cookieless)  # type: ignore[method-assign]


# what litellm imports to stream Anthropic's own Messages API (both need its proxy extra)
NATIVE_STREAM_MODULES = ("litellm.llms.anthropic.messages.native.streaming_iterator",
                         "litellm.proxy.pass_through_endpoints.streaming_handler")


def _streams_messages(model: str) -> bool:
    """Whether litellm can stream a Messages request for ``model`` (module doc): every module its Anthropic stream
    needs loads (or this litellm has no such stream), or ``model`` is not sent to Anthropic's Messages API (when
    that is not known: False, as every provider can answer whole). Imports; never on the event loop."""
    litellm = _litellm()
    try:
        for module in NATIVE_STREAM_MODULES:
            importlib.import_module(module)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing.startswith("litellm.") and any(module == missing or module.startswith(missing + ".")
                                                  for module in NATIVE_STREAM_MODULES):
            return True  # (a litellm without that stream: it streams as it always has)
    except Exception:  # (another package it needs is missing, or fails to load)
        pass
    else:
        return True
    try:
        from litellm.utils import ProviderConfigManager

        name, provider, _, _ = litellm.get_llm_provider(model)
        native = ProviderConfigManager.get_provider_anthropic_messages_config(
            model=name, provider=litellm.LlmProviders(provider))
    except Exception:
        return False
    return native is None


async def _told(events: list[bytes]) -> AsyncIterator[bytes]:
    for event in events:
        yield event


def _warnings_or_debug(record: logging.LogRecord) -> bool:
    """litellm logs one INFO line per call: only warnings and errors, unless the process logs at DEBUG."""
    return record.levelno >= logging.WARNING or logging.getLogger().isEnabledFor(logging.DEBUG)


def _kwargs(route: ModelRoute, body: dict[str, Any], upstream: UpstreamSettings | None,
            allowed: frozenset[str]) -> dict[str, Any]:
    """litellm's arguments: the wire's own request fields from ``body`` (``allowed``, as the wire says: litellm
    reads many keyword arguments as its own, api_base, api_key, callbacks …, which a client must never set);
    model, base and key from the route."""
    kwargs = {k: v for k, v in body.items() if k in allowed}
    kwargs["model"] = route.upstream_model
    if upstream is not None:
        kwargs["api_base"] = upstream.base_url
        if upstream.api_key:
            kwargs["api_key"] = upstream.api_key
    return kwargs


def upstream_call_headers(upstream: UpstreamSettings | None, request_id: str,
                          purpose: str | None = None) -> dict[str, str]:
    """The headers the HTTP route adds to every call: the upstream's configured ones and the request id.

    With a configured key, a configured ``Authorization`` is left out, as on the HTTP route: litellm puts
    the key where the provider wants it.
    """
    out = dict(upstream.headers) if upstream is not None else {}
    if upstream is not None and upstream.api_key:
        out = {k: v for k, v in out.items() if k.lower() != "authorization"}
    for name in [k for k in out if k.lower() in ("x-request-id", "x-ctxproxy-purpose")]:
        del out[name]
    out["X-Request-Id"] = request_id
    if purpose:
        out["x-ctxproxy-purpose"] = purpose
    return out


def _entry(wire: str) -> Any:
    """The litellm function for ``wire``, imported now (seconds, the first time: never inside a deadline, and
    never on the event loop: ``LiteLLMProvider._function``)."""
    litellm = _litellm()
    if wire == "messages":
        from litellm.anthropic_interface import messages as anthropic_messages

        return anthropic_messages.acreate
    return litellm.aresponses if wire == "responses" else litellm.acompletion


def warm_up() -> None:
    """Import litellm and its entry points (the server calls it in a thread at start when a route uses litellm)."""
    for wire in ENTRY_WIRES:
        _entry(wire)


def _call_kwargs(route: ModelRoute, call: Outgoing, upstream: UpstreamSettings | None, *, timeout: httpx.Timeout,
                 purpose: str | None = None) -> dict[str, Any]:
    """Everything litellm is given for ``call``: the wire's fields, the route, the headers, no retries."""
    kwargs = _kwargs(route, call.body, upstream, call.fields or frozenset())
    kwargs.update(stream=call.stream, num_retries=0, max_retries=0, timeout=timeout,
                  extra_headers=upstream_call_headers(upstream, call.request_id, purpose))
    return kwargs


def _answer_body(wire: str, route: ModelRoute, result: Any) -> dict[str, Any]:
    """A non-streaming result as the wire's answer object (under the route's model name)."""
    if wire == "messages":
        out: dict[str, Any] = dict(result) if isinstance(result, dict) else result.model_dump(exclude_none=True)
    elif wire == "responses":
        out = result.model_dump(mode="json", exclude_none=True)
    else:
        out = result.model_dump(exclude_none=True)
    out["model"] = route.name
    return out


def _event(wire: str, route: ModelRoute, item: Any) -> bytes:
    """One streamed item as the wire's SSE event: Chat chunks, Responses' and Anthropic's named events."""
    if wire == "chat":
        data = item.model_dump(exclude_none=True)
        data["model"] = route.name
        return b"data: " + orjson.dumps(data) + b"\n\n"
    if wire == "responses":
        data = item.model_dump(mode="json", exclude_none=True)
        name = data.get("type") if isinstance(data.get("type"), str) else "message"
        return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"
    if isinstance(item, bytes):
        return item
    if isinstance(item, str):
        return item.encode()
    data = item if isinstance(item, dict) else item.model_dump(exclude_none=True)
    return f"event: {data.get('type', 'message')}\n".encode() + b"data: " + orjson.dumps(data) + b"\n\n"


async def _events(wire: str, route: ModelRoute, first: list[Any], rest: AsyncIterator[Any],
                  upstream: UpstreamSettings | None) -> AsyncIterator[bytes]:
    """The stream's events from its first (already read) on; a failure raises in the error tree."""
    try:
        for item in first:
            yield _event(wire, route, item)
        async for item in rest:
            yield _event(wire, route, item)
    except CtxProxyError:
        raise
    except Exception as exc:
        raise upstream_error(exc, upstream) from None
    if wire == "chat":
        yield b"data: [DONE]\n\n"


class LiteLLMAnswer:
    """A litellm result as an ``Answer``: a JSON body, or SSE events as litellm yields them; the upstream's key
    (``secret``) blanked out of both, as on the HTTP route."""

    def __init__(self, body: bytes | None = None, events: AsyncIterator[bytes] | None = None,
                 headers: CIMultiDict[str] | None = None, secret: str | None = None) -> None:
        self.status = 200
        self.streaming = events is not None
        self.headers: CIMultiDict[str] = CIMultiDict(headers or {})
        self.headers["Content-Type"] = "text/event-stream" if self.streaming else "application/json"
        self._body = body or b""
        if secret and secret.encode() in self._body:
            self._body = self._body.replace(secret.encode(), REDACTED)
        self._events = events
        self._secret = secret

    async def chunks(self, idle_timeout: float) -> AsyncIterator[bytes]:
        if self._events is None:
            yield self._body
            return
        redactor = Redactor(self._secret)
        iterator = self._events.__aiter__()
        while True:
            try:
                async with deadline(idle_timeout):
                    event = await iterator.__anext__()
            except StopAsyncIteration:
                tail = redactor.flush()
                if tail:
                    yield tail
                return
            except asyncio.TimeoutError:
                raise UpstreamTimeout(f"The upstream stream stalled for more than {idle_timeout:g}s.") from None
            out = redactor.feed(event)
            if out:
                yield out

    async def read(self, idle_timeout: float) -> bytes:
        return self._body

    def close(self, clean: bool) -> None:
        """Nothing to release: litellm's stream closes its connection when its generator is collected."""


class LiteLLMProvider:
    """Any provider through litellm (``provider: litellm`` routes); the Chat Completions, Responses and Messages
    wires, with the HTTP route's timeouts (``server``), headers and error mapping."""

    def __init__(self, upstream: UpstreamSettings | None, server: ServerSettings | None = None) -> None:
        self.upstream = upstream
        self.server = server if server is not None else ServerSettings()
        self._dropped: set[str] = set()  # field names already logged as not passed on (bounded)
        self._secret = upstream.api_key if upstream is not None else None
        self._functions: dict[str, Any] = {}  # litellm's entry point per wire, once imported
        self._streams: dict[str, bool] = {}  # per upstream model: litellm can stream its Messages requests
        self._finding = asyncio.Lock()  # held while one of them is found

    async def _function(self, wire: str) -> Any:
        """litellm's entry point for ``wire``: importing litellm takes seconds of CPU the first time, which would
        hold up every other request (and /healthz) on the event loop, so the first call imports it in a thread."""
        function = self._functions.get(wire)
        if function is None:
            function = self._functions[wire] = await asyncio.to_thread(_entry, wire)
        return function

    async def _streams_messages(self, route: ModelRoute) -> bool:
        """``_streams_messages`` for the route's model, found once (in a thread: it may import)."""
        model = route.upstream_model
        streams = self._streams.get(model)
        if streams is not None:
            return streams
        async with self._finding:  # (once, however many first requests come at once)
            streams = self._streams.get(model)
            if streams is not None:
                return streams
            streams = self._streams[model] = await asyncio.to_thread(_streams_messages, model)
            if not streams:
                log.warning("litellm route %s: litellm cannot stream %s's Messages requests without its proxy "
                            "extra (pip install 'litellm[proxy]'); each is asked for whole and sent to the client "
                            "as one burst of stream events (a route with provider: http streams Anthropic's API "
                            "as it comes)", route.name, model)
        return streams

    def _note_dropped(self, route: ModelRoute, call: Outgoing) -> None:
        """Say once per field name, at WARNING, which request fields litellm is not given (the wire's own)."""
        allowed = call.fields or frozenset()
        new = [k[:40] for k in call.body if k not in allowed and k not in ("model", "stream")
               and k[:40] not in self._dropped][: max(0, 200 - len(self._dropped))]
        if new:
            self._dropped.update(new)
            log.warning("litellm route %s (%s): request fields not passed on to litellm: %s", route.name, call.wire,
                        ", ".join(sorted(repr(k)[:40] for k in new)[:10]))

    def _timeout(self, read: float) -> httpx.Timeout:
        """litellm's own socket timeouts: connect as the HTTP route does, then ``read`` between two reads."""
        return httpx.Timeout(read, connect=min(self.server.connect_timeout, read))

    async def send(self, route: ModelRoute, call: Outgoing) -> LiteLLMAnswer:
        if call.fields is None or call.wire not in ENTRY_WIRES or (call.wire == "responses"
                                                                    and call.path != "/responses"):
            raise BadRequest(f"The model {route.name!r} is served through litellm, which this proxy offers on "
                             "the Chat Completions, Responses and Messages wires only.", param="model",
                             code="unsupported_wire")
        self._note_dropped(route, call)
        server = self.server
        entry = await self._function(call.wire)
        # a stream litellm cannot make is asked for whole, then told as its events (module doc)
        stream = call.stream and (call.wire != "messages" or await self._streams_messages(route))
        # streaming: the first byte bounds the first event, then idle_timeout bounds each gap (LiteLLMAnswer)
        read = max(server.first_byte_timeout, server.idle_timeout) if stream else server.first_byte_timeout
        kwargs = _call_kwargs(route, call, self.upstream, timeout=self._timeout(read))
        kwargs["stream"] = stream
        first: list[Any] = []
        try:
            async with deadline(server.first_byte_timeout):
                result = await entry(**kwargs)
                if not stream:
                    answer = _answer_body(call.wire, route, result)
                    if call.stream:
                        return LiteLLMAnswer(events=_told(message_events(answer)), headers=answer_headers(result),
                                             secret=self._secret)
                    return LiteLLMAnswer(body=orjson.dumps(answer), headers=answer_headers(result),
                                         secret=self._secret)
                rest = result.__aiter__()
                with contextlib.suppress(StopAsyncIteration):  # errors before the first event keep their status
                    first.append(await rest.__anext__())
        except TimeoutError:
            raise UpstreamTimeout("The upstream did not answer in time.") from None
        except CtxProxyError:
            raise
        except Exception as exc:
            raise upstream_error(exc, self.upstream) from None
        events = _events(call.wire, route, first, rest, self.upstream)
        return LiteLLMAnswer(events=events, headers=answer_headers(result), secret=self._secret)

    async def complete(
        self, route: ModelRoute, messages: list[dict[str, Any]], *, max_tokens: int, timeout: float,
        request_id: str,
    ) -> Completion:
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
        call = Outgoing(CHAT.name, "/chat/completions", body, b"", False, {}, request_id, CHAT.litellm_fields)
        entry = await self._function(call.wire)
        kwargs = _call_kwargs(route, call, self.upstream, timeout=self._timeout(timeout), purpose="summarize")
        try:
            async with deadline(timeout):
                result = await entry(**kwargs)
        except TimeoutError:
            raise UpstreamTimeout("The upstream did not answer in time.") from None
        except CtxProxyError:
            raise
        except Exception as exc:
            raise upstream_error(exc, self.upstream) from None
        raw = orjson.dumps(_answer_body("chat", route, result))
        if self._secret:  # never into a cached summary
            raw = raw.replace(self._secret.encode(), REDACTED)
        return completion_from(orjson.loads(raw), route)
