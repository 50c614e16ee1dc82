"""Model routes with ``provider: litellm``: ``litellm.acompletion`` translated back to OpenAI's shapes.

litellm is imported on first use only (its import costs seconds and ~150 MB),
with its local model map so nothing is fetched at run time.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import orjson

from plugins.base import Completion
from proxy.errors import (
    CtxProxyError,
    UpstreamStatus,
    UpstreamTimeout,
    UpstreamUnreachable,
    normalise_error_body,
)
from proxy.settings import UpstreamSettings

if TYPE_CHECKING:
    from proxy.policy import ModelRoute

PASS_THROUGH_DROP = ("model", "stream")
log = logging.getLogger("ctxproxy")


def _litellm() -> Any:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    os.environ.setdefault("LITELLM_TELEMETRY", "False")
    import litellm

    litellm.telemetry = False
    litellm.suppress_debug_info = True
    return litellm


def _kwargs(route: ModelRoute, body: dict[str, Any], upstream: UpstreamSettings | None) -> dict[str, Any]:
    kwargs = {k: v for k, v in body.items() if k not in PASS_THROUGH_DROP}
    kwargs["model"] = route.upstream_model
    if upstream is not None:
        kwargs["api_base"] = upstream.base_url
        if upstream.api_key:
            kwargs["api_key"] = upstream.api_key
    return kwargs


def _error(exc: Exception) -> CtxProxyError:
    name = type(exc).__name__
    if "Timeout" in name:
        return UpstreamTimeout("The upstream did not answer in time.")
    status = getattr(exc, "status_code", None)
    if isinstance(status, int) and 400 <= status < 500:
        message = _plain(str(getattr(exc, "message", None) or exc))
        return UpstreamStatus(status, normalise_error_body(status, {"error": {"message": message, "code": None}}))
    log.warning("litellm route failed: %s", _plain(f"{name}: {exc}"))
    if isinstance(status, int) and 500 <= status < 600 and "APIConnectionError" not in name:
        return UpstreamStatus(status, normalise_error_body(status, {"error": {
            "message": f"The upstream failed ({name}).", "code": None}}))
    return UpstreamUnreachable(f"The upstream is unreachable or failed ({name}).")


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
        raise _error(exc) from None
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
        raise _error(exc) from None

    async def events() -> AsyncIterator[bytes]:
        try:
            async for chunk in stream:
                data = chunk.model_dump(exclude_none=True)
                data["model"] = route.name
                yield b"data: " + orjson.dumps(data) + b"\n\n"
        except Exception as exc:
            raise _error(exc) from None
        yield b"data: [DONE]\n\n"

    return events()


async def complete_once(route: ModelRoute, body: dict[str, Any], upstream: UpstreamSettings | None) -> Completion:
    """One summariser call through litellm."""
    out = await chat(route, body, upstream)
    text = ""
    try:
        text = out["choices"][0]["message"].get("content") or ""
    except (KeyError, IndexError, TypeError):
        text = ""
    usage = out.get("usage") or {}
    return Completion(text, route.name, int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0))
