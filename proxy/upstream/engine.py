"""The summariser's engine: a non-streaming call through the proxy's own routes and providers.

Each summariser call gets its own request id (a UUID: several servers and their
request-id middlewares refuse anything else) and is logged with the id of the
client request it was made for. A failure becomes ``SummaryUnavailable`` whose
message names the upstream status, the upstream's own message (with the
upstream key blanked out; never prompt text), the route and both request ids,
and whose ``reason`` is a bounded metric label.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from typing import Any

from plugins.base import Completion
from proxy.core.errors import (
    CtxProxyError,
    ModelNotFound,
    SummaryUnavailable,
    UpstreamStatus,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from proxy.policy import ModelRoute
from proxy.upstream.base import Provider

log = logging.getLogger("ctxproxy.summaries")

FAILURE_REASONS = frozenset({"status", "timeout", "unreachable", "empty", "backoff", "error", "no_route"})


class UpstreamEngine:
    """``plugins.base.Engine`` over the proxy's routes: route a model name, call its provider."""

    def __init__(self, route: Callable[[str], ModelRoute], provider: Callable[[ModelRoute], Provider]) -> None:
        self._route = route
        self._provider = provider

    async def complete(
        self, model: str, messages: list[dict[str, Any]], *, max_tokens: int, timeout: float, purpose: str,
        request_id: str = "",
    ) -> Completion:
        call_id = str(uuid.uuid4())
        try:
            route = self._route(model)
        except ModelNotFound:
            raise SummaryUnavailable(f"the summariser model {model[:100]!r} has no route", reason="no_route") from None
        log.debug("summariser call %s for request %s on route %s", call_id, request_id or "-", route.name)
        try:
            return await asyncio.wait_for(
                self._provider(route).complete(route, messages, max_tokens=max_tokens, timeout=timeout,
                                               request_id=call_id),
                timeout=timeout)
        except (asyncio.TimeoutError, UpstreamTimeout):
            raise SummaryUnavailable(
                _where(route, call_id, f"timed out after {timeout:g}s"), reason="timeout"
            ) from None
        except UpstreamStatus as exc:
            raise SummaryUnavailable(
                _where(route, call_id, f"upstream answered {exc.status}: {_message(exc)}"), reason="status"
            ) from None
        except UpstreamUnreachable as exc:
            raise SummaryUnavailable(_where(route, call_id, exc.message), reason="unreachable") from None
        except CtxProxyError as exc:
            raise SummaryUnavailable(_where(route, call_id, exc.message), reason="error") from None


def _where(route: ModelRoute, call_id: str, what: str) -> str:
    return f"{what} (route {route.name!r} -> {route.upstream}/{route.upstream_model}, summariser request {call_id})"


def _message(exc: UpstreamStatus) -> str:
    """The upstream's own error message, short and on one line (the key is already blanked out of it)."""
    text = " ".join(exc.message.split())
    return text[:300] if text else "(empty body)"
