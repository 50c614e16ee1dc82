"""Model routes with ``provider: litellm``: a ``Provider`` over ``litellm.acompletion``, in OpenAI's shapes,
and over litellm's Anthropic-messages interface (``litellm.anthropic_interface.messages.acreate``) for
Messages requests, in Anthropic's shapes, to any provider litellm knows.

The Responses wire goes through ``litellm.aresponses`` (litellm translates it for
providers without a Responses API); its stream is re-emitted as named SSE events.

litellm is imported on first use only (its import costs seconds and ~150 MB),
with its local model map so nothing is fetched at run time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import orjson
from multidict import CIMultiDict

from plugins.base import Completion
from proxy.core.deadline import deadline
from proxy.core.errors import (
    BadRequest,
    CtxProxyError,
    UpstreamError,
    UpstreamStatus,
    UpstreamTimeout,
    UpstreamUnreachable,
    normalise_error_body,
)
from proxy.core.modelinfo import offline_environment
from proxy.settings import UpstreamSettings
from proxy.upstream.base import Outgoing
from proxy.upstream.http import completion_from

if TYPE_CHECKING:
    from proxy.policy import ModelRoute

# What a client may pass to litellm, per wire: the provider API's own request fields. Everything else is
# dropped, because litellm reads many more keyword arguments as its own (api_base, base_url, api_key,
# extra_headers, mock_response, fallbacks, callbacks, timeout …): from a client's body they would send the
# operator's key to a host of the client's choosing, lift the tenant's caps or bypass the model routes.
CHAT_FIELDS = frozenset({
    "messages", "functions", "function_call", "temperature", "top_p", "n", "stream_options", "stop",
    "max_tokens", "max_completion_tokens", "modalities", "prediction", "audio", "presence_penalty",
    "frequency_penalty", "logit_bias", "user", "response_format", "seed", "tools", "tool_choice",
    "parallel_tool_calls", "logprobs", "top_logprobs", "reasoning_effort", "verbosity", "safety_identifier",
    "service_tier", "store", "prompt_cache_key", "prompt_cache_retention", "thinking", "web_search_options",
})
RESPONSES_FIELDS = frozenset({
    "input", "include", "instructions", "max_output_tokens", "prompt", "parallel_tool_calls",
    "previous_response_id", "reasoning", "store", "background", "temperature", "text", "tool_choice", "tools",
    "top_p", "truncation", "user", "service_tier", "safety_identifier", "conversation", "max_tool_calls",
    "prompt_cache_key", "prompt_cache_retention", "stream_options", "top_logprobs", "metadata",
    "context_management", "partial_images",
})
MESSAGES_FIELDS = frozenset({
    "max_tokens", "messages", "metadata", "stop_sequences", "system", "temperature", "thinking", "tool_choice",
    "tools", "top_k", "top_p", "container", "service_tier", "output_config", "output_format", "mcp_servers",
    "cache_control", "inference_geo", "speed",
})
FIELDS = {"chat": CHAT_FIELDS, "responses": RESPONSES_FIELDS, "messages": MESSAGES_FIELDS}
log = logging.getLogger("ctxproxy")


def _litellm() -> Any:
    offline_environment()
    import litellm

    litellm.telemetry = False
    litellm.suppress_debug_info = True
    return litellm


def _kwargs(route: ModelRoute, body: dict[str, Any], upstream: UpstreamSettings | None,
            wire: str = "chat") -> dict[str, Any]:
    """litellm's arguments: the wire's own request fields from ``body``; model, base and key from the route."""
    allowed = FIELDS[wire]
    kwargs = {k: v for k, v in body.items() if k in allowed}
    kwargs["model"] = route.upstream_model
    if upstream is not None:
        kwargs["api_base"] = upstream.base_url
        if upstream.api_key:
            kwargs["api_key"] = upstream.api_key
    return kwargs


def _error(exc: Exception, upstream: UpstreamSettings | None = None) -> CtxProxyError:
    """A litellm failure in the error tree, with the same rules as the HTTP path (``upstream.http.read_error``):
    the operator's key is blanked out of every message, and a refusal of it is the gateway's fault (502)."""
    name = type(exc).__name__
    secret = upstream.api_key if upstream is not None else None
    if "Timeout" in name:
        return UpstreamTimeout("The upstream did not answer in time.")
    status = getattr(exc, "status_code", None)
    if secret and status in (401, 403):
        log.error("the upstream rejected the proxy's configured API key (HTTP %d, through litellm)", status)
        return UpstreamError("The upstream rejected the proxy's credentials; the proxy's operator must fix "
                             "its configuration.", code="upstream_auth_failed")
    if isinstance(status, int) and 400 <= status < 500:
        message = _redact(_plain(str(getattr(exc, "message", None) or exc)), secret)
        return UpstreamStatus(status, normalise_error_body(status, {"error": {"message": message, "code": None}}))
    log.warning("litellm route failed: %s", _redact(_plain(f"{name}: {exc}"), secret))
    if isinstance(status, int) and 500 <= status < 600 and "APIConnectionError" not in name:
        return UpstreamStatus(status, normalise_error_body(status, {"error": {
            "message": f"The upstream failed ({name}).", "code": None}}))
    return UpstreamUnreachable(f"The upstream is unreachable or failed ({name}).")


def _redact(text: str, secret: str | None) -> str:
    return text.replace(secret, "[redacted]") if secret else text


def _plain(message: str) -> str:
    """litellm's messages may embed a traceback: keep the first line of substance, never the traceback."""
    return message.split("\nTraceback", 1)[0].split("Traceback (most recent call last)", 1)[0].strip()[:1000]


async def chat(route: ModelRoute, body: dict[str, Any], upstream: UpstreamSettings | None) -> dict[str, Any]:
    """A non-streaming completion, as an OpenAI chat.completion object."""
    litellm = _litellm()
    try:
        response = await litellm.acompletion(**_kwargs(route, body, upstream))
    except CtxProxyError:
        raise
    except Exception as exc:
        raise _error(exc, upstream) from None
    out: dict[str, Any] = response.model_dump(exclude_none=True)
    out["model"] = route.name
    return out


async def open_stream(
    route: ModelRoute, body: dict[str, Any], upstream: UpstreamSettings | None
) -> AsyncIterator[bytes]:
    """Start a streaming completion (errors before the first chunk raise); yields SSE events."""
    litellm = _litellm()
    try:
        stream = await litellm.acompletion(**_kwargs(route, body, upstream), stream=True)
    except Exception as exc:
        raise _error(exc, upstream) from None

    async def events() -> AsyncIterator[bytes]:
        try:
            async for chunk in stream:
                data = chunk.model_dump(exclude_none=True)
                data["model"] = route.name
                yield b"data: " + orjson.dumps(data) + b"\n\n"
        except Exception as exc:
            raise _error(exc, upstream) from None
        yield b"data: [DONE]\n\n"

    return events()


async def responses(route: ModelRoute, body: dict[str, Any], upstream: UpstreamSettings | None) -> dict[str, Any]:
    """A non-streaming Responses call, as an OpenAI response object."""
    litellm = _litellm()
    try:
        response = await litellm.aresponses(**_kwargs(route, body, upstream, "responses"))
    except CtxProxyError:
        raise
    except Exception as exc:
        raise _error(exc, upstream) from None
    out: dict[str, Any] = response.model_dump(mode="json", exclude_none=True)
    out["model"] = route.name
    return out


async def open_responses_stream(
    route: ModelRoute, body: dict[str, Any], upstream: UpstreamSettings | None
) -> AsyncIterator[bytes]:
    """Start a streaming Responses call (errors before the first event raise); yields named SSE events."""
    litellm = _litellm()
    try:
        stream = await litellm.aresponses(**_kwargs(route, body, upstream, "responses"), stream=True)
    except Exception as exc:
        raise _error(exc, upstream) from None

    async def events() -> AsyncIterator[bytes]:
        try:
            async for event in stream:
                data = event.model_dump(mode="json", exclude_none=True)
                name = data.get("type") if isinstance(data.get("type"), str) else "message"
                yield b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"
        except Exception as exc:
            raise _error(exc, upstream) from None

    return events()


async def messages_call(
    route: ModelRoute, body: dict[str, Any], upstream: UpstreamSettings | None, stream: bool
) -> LiteLLMAnswer:
    """A Messages request through litellm's Anthropic-messages interface: to any provider, in Anthropic's shapes."""
    _litellm()
    from litellm.anthropic_interface import messages as anthropic_messages

    kwargs = _kwargs(route, body, upstream, "messages")
    try:
        result: Any = await anthropic_messages.acreate(**kwargs, stream=stream)
    except Exception as exc:
        raise _error(exc, upstream) from None
    if not stream:
        out = dict(result) if isinstance(result, dict) else result.model_dump(exclude_none=True)
        out["model"] = route.name
        return LiteLLMAnswer(body=orjson.dumps(out))

    async def events() -> AsyncIterator[bytes]:
        try:
            async for chunk in result:
                if isinstance(chunk, bytes):
                    yield chunk
                elif isinstance(chunk, str):
                    yield chunk.encode()
                else:  # an event object: as Anthropic's named SSE event
                    data = chunk if isinstance(chunk, dict) else chunk.model_dump(exclude_none=True)
                    yield f"event: {data.get('type', 'message')}\n".encode() + b"data: " + orjson.dumps(data) + b"\n\n"
        except Exception as exc:
            raise _error(exc, upstream) from None

    return LiteLLMAnswer(events=events())


class LiteLLMAnswer:
    """A litellm result as an ``Answer``: a JSON body, or SSE events as litellm yields them."""

    def __init__(self, body: bytes | None = None, events: AsyncIterator[bytes] | None = None) -> None:
        self.status = 200
        self.streaming = events is not None
        self.headers: CIMultiDict[str] = CIMultiDict(
            {"Content-Type": "text/event-stream" if self.streaming else "application/json"})
        self._body = body or b""
        self._events = events

    async def chunks(self, idle_timeout: float) -> AsyncIterator[bytes]:
        if self._events is None:
            yield self._body
            return
        iterator = self._events.__aiter__()
        while True:
            try:
                async with deadline(idle_timeout):
                    event = await iterator.__anext__()
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                raise UpstreamTimeout(f"The upstream stream stalled for more than {idle_timeout:g}s.") from None
            yield event

    async def read(self, idle_timeout: float) -> bytes:
        return self._body

    def close(self, clean: bool) -> None:
        """Nothing to release: litellm's stream closes its connection when its generator is collected."""


class LiteLLMProvider:
    """Any provider through litellm (``provider: litellm`` routes); the Chat Completions, Responses and Messages
    wires."""

    def __init__(self, upstream: UpstreamSettings | None) -> None:
        self.upstream = upstream
        self._dropped: set[str] = set()  # field names already logged as not passed on (bounded)

    def _note_dropped(self, route: ModelRoute, call: Outgoing) -> None:
        """Say once per field name, at WARNING, which request fields litellm is not given (``FIELDS``)."""
        allowed = FIELDS.get(call.wire, CHAT_FIELDS)
        new = [k[:40] for k in call.body if k not in allowed and k not in ("model", "stream")
               and k[:40] not in self._dropped][: max(0, 200 - len(self._dropped))]
        if new:
            self._dropped.update(new)
            log.warning("litellm route %s (%s): request fields not passed on to litellm: %s", route.name, call.wire,
                        ", ".join(sorted(repr(k)[:40] for k in new)[:10]))

    async def send(self, route: ModelRoute, call: Outgoing) -> LiteLLMAnswer:
        self._note_dropped(route, call)
        if call.wire == "messages":
            return await messages_call(route, call.body, self.upstream, call.stream)
        if call.wire == "responses" and call.path == "/responses":
            if call.stream:
                return LiteLLMAnswer(events=await open_responses_stream(route, call.body, self.upstream))
            return LiteLLMAnswer(body=orjson.dumps(await responses(route, call.body, self.upstream)))
        if call.wire != "chat":
            raise BadRequest(f"The model {route.name!r} is served through litellm, which this proxy offers on "
                             "the Chat Completions, Responses and Messages wires only.", param="model",
                             code="unsupported_wire")
        if call.stream:
            return LiteLLMAnswer(events=await open_stream(route, call.body, self.upstream))
        return LiteLLMAnswer(body=orjson.dumps(await chat(route, call.body, self.upstream)))

    async def complete(
        self, route: ModelRoute, messages: list[dict[str, Any]], *, max_tokens: int, timeout: float,
        request_id: str,
    ) -> Completion:
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
        out = await asyncio.wait_for(chat(route, body, self.upstream), timeout=timeout)
        return completion_from(out, route)
