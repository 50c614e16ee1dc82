"""Anthropic's HTTP API (``api: anthropic``) as a ``Provider``: Messages requests and the summariser's calls.

The upstream's ``base_url`` is the API root (``https://api.anthropic.com``): a wire's
path goes below ``/v1`` (``/v1/messages``). Its key goes in ``x-api-key``; with no
tenants and no key configured the client's own ``x-api-key``/``Authorization`` is
forwarded instead. The client's ``anthropic-version`` and ``anthropic-beta`` pass
through unchanged (a missing version gets the stable one, which the API requires).
Errors keep Anthropic's own body (``UpstreamStatus.raw``), so the Messages wire
relays them as they came.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import orjson
from multidict import CIMultiDict

from plugins.base import Completion
from proxy.core.errors import UpstreamError
from proxy.settings import UpstreamSettings
from proxy.upstream.base import Outgoing
from proxy.upstream.http import HTTPAnswer, UpstreamPool, open_request, read_error, upstream_headers

if TYPE_CHECKING:
    from proxy.policy import ModelRoute

API_VERSION = "2023-06-01"  # the Messages API's stable version, sent when a client sends none
COUNT_UNSERVED = frozenset({404, 405, 501})  # count_tokens not served here: the proxy counts itself


class AnthropicProvider:
    """An Anthropic API upstream; Chat Completions requests go to its OpenAI-compatible endpoint."""

    def __init__(self, upstream: UpstreamSettings, pool: UpstreamPool, *, forward_client_auth: bool) -> None:
        self.upstream = upstream
        self.pool = pool
        self.forward_client_auth = forward_client_auth

    def url(self, path: str) -> str:
        return f"{self.upstream.base_url}/v1{path}"

    def headers(
        self, client_headers: Mapping[str, str], request_id: str, *, wire: str = "messages"
    ) -> CIMultiDict[str]:
        headers = anthropic_headers(client_headers, self.upstream, forward_client_auth=self.forward_client_auth,
                                    request_id=request_id, bearer=wire != "messages")
        headers["Content-Type"] = "application/json"
        return headers

    async def send(self, route: ModelRoute, call: Outgoing) -> HTTPAnswer:
        response = await open_request(self.pool.session(self.upstream), "POST", self.url(call.path), data=call.data,
                                      headers=self.headers(call.client_headers, call.request_id, wire=call.wire),
                                      first_byte_timeout=self.pool.server.first_byte_timeout)
        if response.status >= 400:
            raise await read_error(response, self.pool.server.idle_timeout, self.upstream.api_key)
        return HTTPAnswer(response, self.upstream.api_key)

    async def count_tokens(self, route: ModelRoute, call: Outgoing) -> HTTPAnswer | None:
        """``POST /v1/messages/count_tokens`` upstream; None when the upstream does not serve it."""
        response = await open_request(self.pool.session(self.upstream), "POST", self.url("/messages/count_tokens"),
                                      data=call.data, headers=self.headers(call.client_headers, call.request_id),
                                      first_byte_timeout=self.pool.server.first_byte_timeout)
        if response.status in COUNT_UNSERVED:
            response.release()
            return None
        if response.status >= 400:
            raise await read_error(response, self.pool.server.idle_timeout, self.upstream.api_key)
        return HTTPAnswer(response, self.upstream.api_key)

    async def complete(
        self, route: ModelRoute, messages: list[dict[str, Any]], *, max_tokens: int, timeout: float,
        request_id: str,
    ) -> Completion:
        system = "\n\n".join(str(m.get("content", "")) for m in messages if m.get("role") == "system")
        body: dict[str, Any] = {
            "model": route.upstream_model, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": m["role"], "content": m.get("content", "")} for m in messages
                         if m.get("role") in ("user", "assistant")],
        }
        if system:
            body["system"] = system
        headers = self.headers({}, request_id)
        headers["x-ctxproxy-purpose"] = "summarize"
        response = await open_request(self.pool.session(self.upstream), "POST", self.url("/messages"),
                                      data=orjson.dumps(body), headers=headers, first_byte_timeout=timeout)
        if response.status >= 400:
            raise await read_error(response, timeout, self.upstream.api_key)
        # (an upstream that echoes the key must not put it into a cached summary)
        raw = await HTTPAnswer(response, self.upstream.api_key).read(timeout)
        try:
            payload = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise UpstreamError("The upstream's answer is not JSON.", code="upstream_invalid_answer") from None
        return completion_from_message(payload, route)


def anthropic_headers(client_headers: Mapping[str, str], upstream: UpstreamSettings, *, forward_client_auth: bool,
                      request_id: str, bearer: bool = False) -> CIMultiDict[str]:
    """Headers for an Anthropic API upstream: the shared ones, with the upstream's key in ``x-api-key``.

    ``bearer``: the key as ``Authorization: Bearer`` instead (Anthropic's OpenAI-compatible endpoint).
    """
    # the shared builder puts api_key in Authorization: build without it, then set Anthropic's header
    headers = upstream_headers(client_headers, upstream.model_copy(update={"api_key": None}),
                               forward_client_auth=forward_client_auth, request_id=request_id)
    key = upstream.api_key
    if key:
        if bearer:
            headers["Authorization"] = f"Bearer {key}"
        else:
            headers["x-api-key"] = key
    if not bearer and "anthropic-version" not in headers:
        headers["anthropic-version"] = API_VERSION
    return headers


def completion_from_message(payload: Any, route: ModelRoute) -> Completion:
    """An Anthropic message as the summariser's ``Completion`` (priced on the upstream model)."""
    text = ""
    content = payload.get("content") if isinstance(payload, dict) else None
    if isinstance(content, list):
        text = "".join(b["text"] for b in content if isinstance(b, dict) and b.get("type") == "text"
                       and isinstance(b.get("text"), str))
    usage = payload.get("usage") if isinstance(payload, dict) else None
    usage = usage if isinstance(usage, dict) else {}
    prompt = sum(_int(usage.get(k)) for k in ("input_tokens", "cache_read_input_tokens",
                                             "cache_creation_input_tokens"))
    return Completion(text, route.name, prompt, _int(usage.get("output_tokens")), route.upstream_model)


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
