"""``POST /v1/messages/count_tokens``: the Messages wire's count of what ``/v1/messages`` would forward.

``count_tokens`` counts what ``/v1/messages`` *would* forward for the same body (after its
context management), because a client that compacts on its own (Claude Code) must see the
size that reaches the model. It runs the hook and the pipeline exactly as ``/v1/messages``
would, but in dry-run: a summary or an emulated compaction is looked up in the cache, never
made, so counting bills nobody; a summary that does not exist yet is counted at its largest
(``summarizer.max_summary_tokens``, and its values section: the pipeline's estimate for the turns it
would cover, ``summarizer.max_values_tokens`` for an emulated compaction). Its body usually has no ``max_tokens``
(Claude Code sends
none): it is then budgeted with a reserve of one token (``COUNT_RESERVE``), the smallest
``/v1/messages`` can be sent with, so the answer is the most ``/v1/messages`` would forward
for this conversation, and exactly that whenever the real request's ``max_tokens`` (or a
configured ``trimmer.reserve_tokens``, which both use) leaves it under its summary threshold.
In observe mode ``/v1/messages`` forwards the body as sent, so that is what is counted (the
headers say what enforce would have forwarded).

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

from proxy.core.errors import ContextLengthExceeded
from proxy.core.offload import run_step
from proxy.core.tokens import TokenCounter
from proxy.serve.hooks import HOOKS
from proxy.serve.http import OVERRIDE_HEADER, RESPONSE_HEADERS, dumps_body, json_response
from proxy.serve.managed import report_headers
from proxy.serve.scope import request_scope
from proxy.serve.streaming import relay_answer
from proxy.upstream.base import Answer, Outgoing
from proxy.wire.protocol import Wire
from proxy.wire.sse import StreamWatcher

__all__ = ["COUNT_RESERVE", "count_tokens_handler"]

# the completion reserve a count_tokens body without max_tokens is budgeted with: the smallest a request can have
COUNT_RESERVE = 1


async def count_tokens_handler(request: web.Request, wire: Wire) -> web.StreamResponse:
    with request_scope(request, wire, event="count_tokens") as scope:
        st, served, runtime, rid, tenant = scope.state, scope.served, scope.runtime, scope.request_id, scope.tenant
        started = scope.record.started
        body = await scope.body()
        route = runtime.route(scope.model(body))
        scope.record.model = route.name
        offload = scope.offload
        probe: dict[str, Any] = dict(body)
        added = body.get("max_tokens") is None  # a null one is none (and is never relayed)
        if added:
            probe["max_tokens"] = COUNT_RESERVE
        override = request.headers.get(OVERRIDE_HEADER)
        unedited = probe
        hook = HOOKS.get(wire.name)
        exchange = await hook.begin(runtime, tenant, probe, override=override, request_id=rid, dry_run=True,
                                    offload=offload) if hook is not None else None
        if exchange is not None:
            probe = exchange.body
        counter = await runtime.tokenizers.counter(route.encoding)
        headers: CIMultiDict[str] = CIMultiDict({"x-request-id": rid})
        summarizer = runtime.config.settings.summarizer
        max_summary = summarizer.max_summary_tokens
        unmade = (
            max_summary + summarizer.max_values_tokens
            if exchange is not None and exchange.describe().get("compaction") == "would_create"
            else 0
        )
        try:
            assembly, route, _policy = await runtime.assemble(wire, probe, tenant=tenant, override=override,
                                                              offload=offload, request_id=rid, dry_run=True,
                                                              params=request.match_info)
        except ContextLengthExceeded:
            # too large to forward: still say how large, so the client can compact it itself
            forwarded, after = probe, await run_step(offload, _count, wire, probe, counter)
        else:
            # in observe mode the client's body is what /v1/messages forwards: that is what is counted
            forwarded, after = assembly.body, assembly.forwarded_tokens
            if assembly.report.summary == "would_create" and assembly.report.mode != "observe":
                # counted at its largest, not as the placeholder
                unmade += int(assembly.report.summary_detail.get("summary_tokens_at_most", max_summary))
            headers.update(report_headers(assembly, time.perf_counter() - started))
        request[RESPONSE_HEADERS] = headers
        factor = runtime.calibration.factor(route, scope.tenant_name) if runtime.calibration is not None else 1.0
        # emulated context_management: Anthropic reports the body's size before its edits too
        original = math.ceil(await run_step(offload, _count, wire, unedited, counter) * factor) \
            if exchange is not None and body.get("context_management") is not None else None
        provider = served.providers.for_route(route)
        upstream_count = getattr(provider, "count_tokens", None)
        if upstream_count is not None:
            sent = {k: v for k, v in forwarded.items() if not (added and k == "max_tokens") and k != "stream"}
            path = next(own for own, name in wire.endpoints.items() if name == "count_tokens")
            call = Outgoing(wire.name, path, sent, await run_step(offload, dumps_body, sent), False,
                            request.headers, rid)
            answer = await upstream_count(route, call)
            if answer is not None:
                idle = st.config.settings.server.idle_timeout
                if not unmade and original is None:
                    return scope.answered(await relay_answer(request, answer, headers, idle_timeout=idle,
                                                             watcher=StreamWatcher(time.perf_counter(),
                                                                                   wire.stream_end)))
                return scope.answered(await _amended(answer, headers, idle, math.ceil(unmade * factor), original))
        out: dict[str, Any] = {"input_tokens": math.ceil((after + unmade) * factor)}
        if original is not None:
            out["context_management"] = {"original_input_tokens": original}
        return scope.answered(json_response(out, headers=headers))


def _count(wire: Wire, body: dict[str, Any], counter: TokenCounter) -> int:
    """The proxy's count of a body as it stands."""
    conversation = wire.parse(body, counter)
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
