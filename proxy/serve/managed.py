"""The handler of a managed wire: run the wire's hook and the pipeline, forward through the route's provider, relay.

One handler serves every wire (``make_handler(wire)``); ``proxy.serve.routes`` registers each
registered wire's paths. The request's scope (``proxy.serve.scope``) does what every handler
does (id, authentication, body, record, metrics, log); everything wire-specific comes from the
wire's translator: parsing and rendering, where the model is, the upstream path, the stream's end.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from aiohttp import web
from multidict import CIMultiDict

from proxy.core.offload import run_step
from proxy.pipeline import Assembly
from proxy.runtime import Runtime
from proxy.serve.http import OVERRIDE_HEADER, Handler, dumps_body, header_safe
from proxy.serve.scope import request_scope
from proxy.serve.state import State
from proxy.serve.streaming import relay_answer
from proxy.settings import Tenant
from proxy.upstream.base import Answer, Outgoing
from proxy.wire.protocol import Wire
from proxy.wire.sse import StreamWatcher


class Exchange(Protocol):
    """What a wire's request hook made of one request."""

    body: dict[str, Any]  # the body the pipeline runs on: the client's, or the hook's edit of it
    edited: bool  # the body is not the client's: its JSON is forwarded, never the client's bytes
    warnings: list[str]

    def local_answer(self) -> Answer | None:
        """An answer made without calling the upstream, or None."""

    def wrap(self, answer: Answer) -> Answer:
        """The upstream's answer as the client gets it."""

    def describe(self) -> dict[str, Any]:
        """What the hook did, for explain's report."""


class RequestHook(Protocol):
    """What a wire does around the pipeline (Messages: ``context_management`` emulation); None: nothing.

    ``dry_run`` (explain, count_tokens, ``ctxproxy assemble``): nothing is made that costs (a summary is
    looked up, never made)."""

    async def begin(self, runtime: Runtime, tenant: Tenant | None, body: dict[str, Any], *,
                    override: str | None, request_id: str, dry_run: bool = False,
                    offload: bool = False) -> Exchange | None: ...


def forward_bytes(raw: bytes | None, assembly: Assembly) -> bytes:
    """The client's bytes when nothing changed (and they are the body's); else the managed body."""
    if not assembly.changed and raw is not None:
        return raw
    return dumps_body(assembly.body)


def _outgoing(st: State, raw: bytes | None, assembly: Assembly,
              tenant: str) -> tuple[bool | None, dict[str, int], bytes]:
    """Whether the forwarded prefix is stable, the re-fetches this request shows (``proxy.store.refetch``), and
    the bytes to forward (all linear in the items)."""
    stable = st.prefix.observe(assembly.received, assembly.items, tenant)
    refetched = st.refetch.observe(tenant, assembly.received, assembly.items, assembly.summarised)
    return stable, refetched, forward_bytes(raw, assembly)


def report_headers(assembly: Assembly, overhead: float) -> dict[str, str]:
    """What the pipeline did (in observe mode: what enforce would have done; the client's body went upstream)."""
    r = assembly.report
    headers = {
        "x-ctxproxy-mode": r.mode,
        "x-ctxproxy-tokens-in": str(r.tokens_before),
        "x-ctxproxy-tokens-out": str(r.tokens_after),
        # a request that waited for a summariser says so, whoever made the summary
        "x-ctxproxy-summary": "waited" if r.summary_wait is not None and r.summary in ("created", "reused")
        else r.summary,
        "x-ctxproxy-repairs": str(sum(r.repairs.values())),
        "x-ctxproxy-overhead-ms": f"{overhead * 1000:.2f}",
    }
    if r.warnings:
        headers["x-ctxproxy-warning"] = header_safe("; ".join(r.warnings))
    return headers


def make_handler(wire: Wire, hook: RequestHook | None = None) -> Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        return await _handle(request, wire, hook)

    handle.__name__ = f"{wire.name}_handler"
    return handle


async def _handle(request: web.Request, wire: Wire, hook: RequestHook | None) -> web.StreamResponse:
    async with request_scope(request, wire) as scope:
        st, served, runtime, record, rid = scope.state, scope.served, scope.runtime, scope.record, scope.request_id
        idle = st.config.settings.server.idle_timeout
        body = await scope.body()
        override = request.headers.get(OVERRIDE_HEADER)
        exchange = await hook.begin(runtime, scope.tenant, body, override=override, request_id=rid,
                                    offload=scope.offload) if hook else None
        local = exchange.local_answer() if exchange is not None else None
        if local is not None:  # answered by the proxy itself (a paused compaction): no pipeline, nothing forwarded
            if exchange is not None and exchange.warnings:
                scope.headers["x-ctxproxy-warning"] = header_safe("; ".join(exchange.warnings))
            return scope.answered(await relay_answer(request, local, CIMultiDict(scope.headers), idle_timeout=idle,
                                                     watcher=StreamWatcher(time.perf_counter(), wire.stream_end)))
        forwardable: bytes | None = scope.raw
        if exchange is not None and exchange.edited:
            body, forwardable = exchange.body, None
        assembly, route, _policy = await runtime.assemble(
            wire, body, tenant=scope.tenant, override=override, offload=scope.offload, request_id=rid,
            params=request.match_info,
        )
        if exchange is not None:
            assembly.report.warnings.extend(exchange.warnings)
        record.report = assembly.report
        record.model = route.name
        scope.settled = (route, assembly)
        st.metrics.assembled(record.tenant, route.name, assembly.report, route.upstream_model)
        stable, refetched, data = await run_step(scope.offload, _outgoing, st, forwardable, assembly, record.tenant)
        if stable is not None:
            st.metrics.prefix(record.tenant, route.name, stable)
        if refetched:
            record.refetched = refetched
            st.metrics.refetched(record.tenant, route.name, refetched)
        overhead = time.perf_counter() - record.started
        record.overhead = overhead
        scope.headers.update(report_headers(assembly, overhead))
        call = Outgoing(wire.name, wire.upstream_path(route.upstream_model), assembly.body, data,
                        body.get("stream") is True, request.headers, rid, wire.litellm_fields)
        sent = time.perf_counter()
        watcher = StreamWatcher(sent, wire.stream_end)
        try:
            answer = await served.providers.for_route(route).send(route, call)
            if exchange is not None:
                answer = exchange.wrap(answer)
            response = await relay_answer(request, answer, scope.headers, idle_timeout=idle, watcher=watcher)
        finally:
            record.upstream = time.perf_counter() - sent
            record.ttft, record.usage = watcher.ttft, watcher.usage
        return scope.answered(response)
