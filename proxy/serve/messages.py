"""The Messages wire's extras: its request hook, and ``POST /v1/messages/count_tokens``.

``count_tokens`` counts what the proxy *would* forward for the body (after its context
management), because a client that compacts on its own (Claude Code) must see the
size that reaches the model. An upstream that serves the endpoint (``api: anthropic``)
counts the managed body itself; otherwise the proxy answers ``{"input_tokens": N}``
with its own count, scaled by the model's calibration factor. It never answers 404:
Claude Code breaks on that.
"""

from __future__ import annotations

import math
import time
from typing import Any

import orjson
from aiohttp import web
from multidict import CIMultiDict

from proxy.core.budget import default_reserve
from proxy.core.errors import BadRequest, ContextLengthExceeded
from proxy.core.offload import run_step
from proxy.core.tokens import TokenCounter
from proxy.serve.http import (
    ERROR_SHAPE,
    OVERRIDE_HEADER,
    RESPONSE_HEADERS,
    client_keys,
    json_response,
    parse_body,
    read_body,
    request_id,
    state,
)
from proxy.serve.managed import report_headers
from proxy.serve.streaming import relay_answer
from proxy.upstream.base import Outgoing
from proxy.wire.messages import WIRE
from proxy.wire.messages.emulate import HOOK
from proxy.wire.sse import StreamWatcher

__all__ = ["HOOK", "count_tokens_handler"]


async def count_tokens_handler(request: web.Request) -> web.StreamResponse:
    st = state(request)
    served = st.served
    runtime = served.runtime
    started = time.perf_counter()
    rid = request_id(request)
    request[ERROR_SHAPE] = WIRE.error_shape
    request[RESPONSE_HEADERS] = CIMultiDict({"x-request-id": rid})
    tenant = runtime.authenticate(client_keys(request))
    raw = await read_body(request)
    offload = len(raw) > runtime.config.settings.server.offload_bytes
    body = await run_step(offload, parse_body, raw)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("model: Field required", param="model", code="missing_model")
    route = runtime.route(model)
    # count_tokens takes no max_tokens: budget the count as a request without one would be budgeted
    probe: dict[str, Any] = dict(body)
    added = body.get("max_tokens") is None  # a null one is none (and is never relayed)
    override = request.headers.get(OVERRIDE_HEADER)
    if added:
        # the reserve a request without an output limit gets, within this key's output cap (never refused by it)
        reserve = max(1, default_reserve(route.window, route.max_output))
        cap = runtime.policy(tenant, model, override).max_output_tokens
        probe["max_tokens"] = min(reserve, cap) if cap is not None else reserve
    exchange = await HOOK.begin(runtime, tenant, probe, override=override, request_id=rid, offload=offload)
    if exchange is not None:
        probe = exchange.body
    headers: CIMultiDict[str] = CIMultiDict({"x-request-id": rid})
    try:
        assembly, route, _policy = await runtime.assemble(WIRE, probe, tenant=tenant, override=override,
                                                          offload=offload, request_id=rid)
    except ContextLengthExceeded:
        # too large to forward: still say how large, so the client can compact it itself
        forwarded = probe
        before = after = await run_step(offload, _visible_tokens, probe, runtime.tokenizers.get(route.encoding))
    else:
        forwarded = assembly.body
        before, after = assembly.report.tokens_before, assembly.report.tokens_after
        headers.update(report_headers(assembly, time.perf_counter() - started))
    request[RESPONSE_HEADERS] = headers
    provider = served.providers.for_route(route)
    upstream_count = getattr(provider, "count_tokens", None)
    if upstream_count is not None:
        sent = {k: v for k, v in forwarded.items() if not (added and k == "max_tokens") and k != "stream"}
        call = Outgoing(WIRE.name, "/messages/count_tokens", sent, await run_step(offload, orjson.dumps, sent), False,
                        request.headers, rid)
        answer = await upstream_count(route, call)
        if answer is not None:
            return await relay_answer(request, answer, headers, idle_timeout=st.config.settings.server.idle_timeout,
                                      watcher=StreamWatcher(time.perf_counter(), WIRE.stream_end))
    factor = runtime.calibration.factor(route) if runtime.calibration is not None else 1.0
    out: dict[str, Any] = {"input_tokens": math.ceil(after * factor)}
    if body.get("context_management") is not None:
        out["context_management"] = {"original_input_tokens": math.ceil(before * factor)}
    return json_response(out, headers=headers)


def _visible_tokens(body: dict[str, Any], counter: TokenCounter) -> int:
    conversation = WIRE.parse(body, counter)
    return conversation.fixed_tokens + sum(item.tokens for item in conversation.items)
