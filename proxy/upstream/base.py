"""The one seam to providers: a ``Provider`` sends a managed request and completes a summary.

Implementations: ``proxy.upstream.http.HTTPProvider`` (an OpenAI-compatible HTTP
API over a pooled HTTP client), ``proxy.upstream.anthropic.AnthropicProvider``
(Anthropic's Messages API, same pool) and ``proxy.upstream.litellm.LiteLLMProvider``
(any provider through litellm). A route picks its provider once
(``Providers.for_route``). Two capabilities outside ``send``/``complete`` are still
asked of the route's settings where they are used: whether compaction and
``context_management`` are the upstream's (``serve/compact.py``,
``serve/context_management/hook.py``). Every external dependency has one such seam, as httpx has its
transports: unit tests put a fake behind it, wire tests a real fake server on 127.0.0.1.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from multidict import CIMultiDict

from plugins.base import Completion

if TYPE_CHECKING:
    from proxy.policy import ModelRoute


@dataclass
class Outgoing:
    """One managed request on its way upstream.

    ``wire``: the wire's name (chat | responses | messages …); ``path``: the wire's path below the
    API root (``/chat/completions``); ``body``: the managed body; ``data``: its bytes (the client's
    own when nothing changed); ``client_headers``: the client's request headers; ``fields``: the
    request fields a provider that rebuilds the call (litellm) may pass on, as the wire says
    (None: the wire has no such route).
    """

    wire: str
    path: str
    body: dict[str, Any]
    data: bytes
    stream: bool
    client_headers: Mapping[str, str]
    request_id: str
    fields: frozenset[str] | None = None


class Answer(Protocol):
    """An upstream's answer once its headers arrived (status < 400; errors are raised)."""

    status: int
    headers: CIMultiDict[str]
    streaming: bool

    def chunks(self, idle_timeout: float) -> AsyncIterator[bytes]:
        """The body as it arrives; raises UpstreamTimeout/UpstreamUnreachable if it breaks off."""

    async def read(self, idle_timeout: float) -> bytes:
        """The whole body."""

    def close(self, clean: bool) -> None:
        """Release the connection (``clean``) or drop it, so the provider stops generating."""


class Provider(Protocol):
    async def send(self, route: ModelRoute, call: Outgoing) -> Answer:
        """Send ``call``; raise an UpstreamError for a transport failure or an upstream 4xx/5xx."""

    async def complete(
        self, route: ModelRoute, messages: list[dict[str, Any]], *, max_tokens: int, timeout: float,
        request_id: str,
    ) -> Completion:
        """One non-streaming summariser call (Chat Completions messages in, text out)."""
