"""A litellm failure as the proxy's error, by the HTTP route's rules (``proxy.upstream.http``).

litellm wraps every failure in an exception named after a status it chose (a refused
connection is an ``InternalServerError`` with status 500, a missing key too); the
exceptions it was raised from say what happened. A timeout anywhere among them is a 504
``upstream_timeout``; a connection that failed, a 502 ``upstream_unreachable``; an
answer of the provider's (litellm saw its headers) is relayed with the provider's status,
its error in OpenAI's shape and the headers ``read_error`` keeps (``Retry-After``, rate
limits). The operator's key is blanked out of every message, and a refusal of it is the
gateway's fault (502 ``upstream_auth_failed``). litellm's ``ContextWindowExceededError`` keeps its status and
gets the code ``context_length_exceeded``, so the proxy recovers from it (``proxy.serve.overflow``) whatever
the provider's words. Anything else is a 502.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator, Mapping
from typing import Any

import aiohttp
import orjson
from multidict import CIMultiDict

from proxy.core.errors import (
    CtxProxyError,
    UpstreamError,
    UpstreamStatus,
    UpstreamTimeout,
    UpstreamUnreachable,
    normalise_error_body,
)
from proxy.settings import UpstreamSettings
from proxy.upstream.http import response_headers

log = logging.getLogger("ctxproxy")

# class names (anywhere in an exception's MRO) that mean a timeout or a failed connection, in the libraries
# litellm calls providers with: openai's APITimeoutError / APIConnectionError (litellm's Timeout and
# APIConnectionError derive from them), httpx's TimeoutException / TransportError
TIMEOUT_CLASSES = frozenset({"APITimeoutError", "TimeoutException"})
CONNECTION_CLASSES = frozenset({"APIConnectionError", "TransportError"})
PROVIDER_PREFIX = "llm_provider-"  # how litellm names the provider's headers in a result's hidden params


def upstream_error(exc: BaseException, upstream: UpstreamSettings | None) -> CtxProxyError:
    """``exc`` (raised by a litellm call) as the error the client gets."""
    if isinstance(exc, CtxProxyError):
        return exc
    secret = upstream.api_key if upstream is not None else None
    causes = list(_causes(exc))
    if any(_is_timeout(e) for e in causes):
        return UpstreamTimeout("The upstream did not answer in time.")
    failed = next((e for e in causes if _is_connection(e)), None)
    if failed is not None:
        return UpstreamUnreachable(f"The upstream is unreachable ({_root_name(causes)}).")
    raw_headers = getattr(exc, "litellm_response_headers", None)
    status = _status(exc)
    answered = bool(raw_headers) or any(_named(e, "HTTPStatusError") for e in causes)
    if status is not None and (400 <= status < 500 or (answered and status < 600)):
        if secret and status in (401, 403):
            log.error("the upstream rejected the proxy's configured API key (HTTP %d, through litellm)", status)
            return UpstreamError("The upstream rejected the proxy's credentials; the proxy's operator must fix "
                                 "its configuration.", code="upstream_auth_failed")
        body = _error_body(causes, status, secret)
        error = body.get("error")
        if any(_named(e, "ContextWindowExceededError") for e in causes) and isinstance(error, dict):
            error["code"] = "context_length_exceeded"  # litellm knows it is one, whatever the provider's words
        return UpstreamStatus(status, body, dict(provider_headers(raw_headers)))
    log.warning("litellm route failed: %s", _redact(_plain(f"{type(exc).__name__}: {exc}"), secret))
    return UpstreamError(f"The upstream could not be called ({type(exc).__name__}).")


def provider_headers(raw: Any) -> CIMultiDict[str]:
    """The provider's response headers worth relaying: the HTTP route's rule, less the ones about its body
    (litellm answers with a body of its own)."""
    if not isinstance(raw, Mapping) and not hasattr(raw, "items"):
        return CIMultiDict()
    plain = {str(k): str(v) for k, v in raw.items()}
    return CIMultiDict((k, v) for k, v in response_headers(plain).items() if not k.lower().startswith("content-"))


def answer_headers(result: Any) -> CIMultiDict[str]:
    """The provider's headers behind a litellm result (litellm keeps them, prefixed, in its hidden params)."""
    hidden = getattr(result, "_hidden_params", None)
    extra = hidden.get("additional_headers") if isinstance(hidden, dict) else None
    if not isinstance(extra, dict):
        return CIMultiDict()
    return provider_headers({k[len(PROVIDER_PREFIX):]: v for k, v in extra.items()
                             if isinstance(k, str) and k.startswith(PROVIDER_PREFIX)})


def _causes(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(seen) < 20:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _named(exc: BaseException, name: str) -> bool:
    return any(cls.__name__ == name for cls in type(exc).__mro__)


def _is_timeout(exc: BaseException) -> bool:
    return isinstance(exc, TimeoutError) or any(cls.__name__ in TIMEOUT_CLASSES for cls in type(exc).__mro__)


def _is_connection(exc: BaseException) -> bool:
    return (isinstance(exc, (ConnectionError, socket.gaierror, aiohttp.ClientConnectionError))
            or any(cls.__name__ in CONNECTION_CLASSES for cls in type(exc).__mro__))


def _root_name(causes: list[BaseException]) -> str:
    """The innermost exception's class: the transport's own word for what failed (ConnectionRefusedError …)."""
    return type(causes[-1]).__name__


def _status(exc: BaseException) -> int | None:
    for name in ("provider_status_code", "status_code"):
        value = getattr(exc, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and 100 <= value <= 599:
            return value
    return None


def _error_body(causes: list[BaseException], status: int, secret: str | None) -> dict[str, Any]:
    """The provider's error in OpenAI's shape: its parsed body where an SDK kept it (openai's ``body``), else
    the JSON litellm quoted in its message ("AnthropicException - {...}"), else the message itself."""
    bodies = (getattr(e, "body", None) for e in causes)
    body = next((b for b in bodies if isinstance(b, dict) and isinstance(b.get("message"), str)), None)
    message = _plain(str(getattr(causes[0], "message", None) or causes[0]))
    payload: Any = {"error": body} if body is not None else None
    if payload is None:
        payload = _quoted_json(message)
    if payload is None:
        payload = {"error": {"message": message, "code": None}}
    out = normalise_error_body(status, payload)
    if secret:
        out = orjson.loads(orjson.dumps(out).replace(orjson.dumps(secret)[1:-1], b"[redacted]"))
    return out


def _quoted_json(message: str) -> Any:
    start = message.find("{")
    if start < 0:
        return None
    try:
        payload = orjson.loads(message[start:])
    except orjson.JSONDecodeError:
        return None
    return payload if isinstance(payload, dict) and "error" in payload else None


def _redact(text: str, secret: str | None) -> str:
    return text.replace(secret, "[redacted]") if secret else text


def _plain(message: str) -> str:
    """litellm's messages may embed a traceback: keep the first line of substance, never the traceback."""
    return message.split("\nTraceback", 1)[0].split("Traceback (most recent call last)", 1)[0].strip()[:1000]
