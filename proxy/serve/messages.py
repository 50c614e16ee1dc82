"""The Messages wire's extras: its request hook, and ``POST /v1/messages/count_tokens``.

``count_tokens`` counts what ``/v1/messages`` *would* forward for the same body (after its
context management), because a client that compacts on its own (Claude Code) must see the
size that reaches the model. It runs the hook and the pipeline exactly as ``/v1/messages``
would, but in dry-run: a summary or an emulated compaction is looked up in the cache, never
made, so counting bills nobody; a summary that does not exist yet is counted at its largest
(``summarizer.max_summary_tokens``). Its body usually has no ``max_tokens`` (Claude Code sends
none): it is then budgeted with a reserve of one token (``COUNT_RESERVE``), the smallest
``/v1/messages`` can be sent with, so the answer is the most ``/v1/messages`` would forward
for this conversation, and exactly that whenever the real request's ``max_tokens`` (or a
configured ``trimmer.reserve_tokens``, which both use) leaves it under its summary threshold.

An upstream that serves the endpoint (``api: anthropic``) counts the managed body itself;
otherwise the proxy answers ``{"input_tokens": N}`` with its own count, scaled by the model's
calibration factor. With emulated ``context_management`` the answer also carries
``context_management.original_input_tokens``: the body's count before the edits, as Anthropic
reports it. It never answers 404: Claude Code breaks on that.
"""

from __future__ import annotations

import math
import time
from typing import Any

import orjson
from aiohttp import web
from multidict import CIMultiDict

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
from proxy.upstream.base import Answer, Outgoing
from proxy.wire.messages import WIRE
from proxy.wire.messages.emulate import HOOK
from proxy.wire.sse import StreamWatcher

__all__ = ["COUNT_RESERVE", "HOOK", "count_tokens_handler"]

# the completion reserve a count_tokens body without max_tokens is budgeted with: the smallest a request can have
COUNT_RESERVE = 1


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
    probe: dict[str, Any] = dict(body)
    added = body.get("max_tokens") is None  # a null one is none (and is never relayed)
    if added:
        probe["max_tokens"] = COUNT_RESERVE
    override = request.headers.get(OVERRIDE_HEADER)
    unedited = probe
    exchange = await HOOK.begin(runtime, tenant, probe, override=override, request_id=rid, dry_run=True,
                                offload=offload)
    if exchange is not None:
        probe = exchange.body
    counter = runtime.tokenizers.get(route.encoding)
    headers: CIMultiDict[str] = CIMultiDict({"x-request-id": rid})
    unmade = runtime.config.settings.summarizer.max_summary_tokens if exchange is not None and \
        exchange.compaction == "would_create" else 0
    try:
        assembly, route, _policy = await runtime.assemble(WIRE, probe, tenant=tenant, override=override,
                                                          offload=offload, request_id=rid, dry_run=True)
    except ContextLengthExceeded:
        # too large to forward: still say how large, so the client can compact it itself
        forwarded, after = probe, await run_step(offload, _count, probe, counter)
    else:
        forwarded, after = assembly.body, assembly.report.tokens_after
        if assembly.report.summary == "would_create":  # counted at its largest, not as the placeholder
            unmade += runtime.config.settings.summarizer.max_summary_tokens
        headers.update(report_headers(assembly, time.perf_counter() - started))
    request[RESPONSE_HEADERS] = headers
    name = tenant.name if tenant else "default"
    factor = runtime.calibration.factor(route, name) if runtime.calibration is not None else 1.0
    # emulated context_management: Anthropic reports the body's size before its edits too
    original = math.ceil(await run_step(offload, _count, unedited, counter) * factor) if exchange is not None \
        and body.get("context_management") is not None else None
    provider = served.providers.for_route(route)
    upstream_count = getattr(provider, "count_tokens", None)
    if upstream_count is not None:
        sent = {k: v for k, v in forwarded.items() if not (added and k == "max_tokens") and k != "stream"}
        call = Outgoing(WIRE.name, "/messages/count_tokens", sent, await run_step(offload, orjson.dumps, sent), False,
                        request.headers, rid)
        answer = await upstream_count(route, call)
        if answer is not None:
            idle = st.config.settings.server.idle_timeout
            if not unmade and original is None:
                return await relay_answer(request, answer, headers, idle_timeout=idle,
                                          watcher=StreamWatcher(time.perf_counter(), WIRE.stream_end))
            return await _amended(answer, headers, idle, math.ceil(unmade * factor), original)
    out: dict[str, Any] = {"input_tokens": math.ceil((after + unmade) * factor)}
    if original is not None:
        out["context_management"] = {"original_input_tokens": original}
    return json_response(out, headers=headers)


def _count(body: dict[str, Any], counter: TokenCounter) -> int:
    """The proxy's count of a Messages body as it stands."""
    conversation = WIRE.parse(body, counter)
    return conversation.fixed_tokens + sum(item.tokens for item in conversation.items)


async def _amended(answer: Answer, headers: CIMultiDict[str], idle: float, unmade: int,
                   original: int | None) -> web.Response:
    """The upstream's count of the managed body, plus a summary not made yet, with the size before the edits."""
    try:
        raw = await answer.read(idle)
    finally:
        answer.close(True)
    try:
        payload = orjson.loads(raw)
    except orjson.JSONDecodeError:
        payload = None
    if not isinstance(payload, dict) or not isinstance(payload.get("input_tokens"), int):
        return web.Response(body=raw, status=answer.status, headers={**headers, "Content-Type": "application/json"})
    payload["input_tokens"] += unmade
    if original is not None:
        payload["context_management"] = {"original_input_tokens": original}
    return json_response(payload, headers=headers)
