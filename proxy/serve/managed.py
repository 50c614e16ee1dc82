"""The handler of a managed wire: run the wire's hook and the pipeline, forward through the route's provider, relay.

One handler serves every wire (``make_handler(wire)``); ``proxy.serve.routes`` registers each
registered wire's paths. The request's scope (``proxy.serve.scope``) does what every handler
does (id, authentication, body, record, metrics, log); everything wire-specific comes from the
wire's translator: parsing and rendering, where the model is, the upstream path, the stream's end.
A refusal for length that comes before the answer is recovered once (``proxy.serve.overflow``).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web
from multidict import CIMultiDict

from proxy.core.errors import UpstreamStatus
from proxy.core.offload import run_step
from proxy.pipeline import Assembly
from proxy.policy import ModelRoute
from proxy.runtime import Runtime
from proxy.serve.http import OVERRIDE_HEADER, Handler, dumps_body, header_safe
from proxy.serve.overflow import recover
from proxy.serve.scope import Scope, request_scope
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
    received, sent = assembly.item_keys()
    stable = st.prefix.observe(assembly.received, assembly.items, tenant, sent)
    refetched = st.refetch.observe(tenant, assembly.received, assembly.items, assembly.summarised, received)
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
    """``_handle`` for ``wire``: a partial, not a coroutine that awaits it (one coroutine less a request; aiohttp
    takes a partial of a coroutine function as one)."""
    handle = functools.partial(_handle, wire=wire, hook=hook)
    handle.__name__ = f"{wire.name}_handler"  # type: ignore[attr-defined]  # (a partial has a __dict__)
    return handle


async def _handle(request: web.Request, wire: Wire, hook: RequestHook | None) -> web.StreamResponse:
    with request_scope(request, wire) as scope:
        st, runtime, record, rid = scope.state, scope.runtime, scope.record, scope.request_id
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
        assembly, route = await _assemble(scope, wire, body, exchange, override)
        record.model = route.name
        upstream = _Upstream(scope, wire, route, body, exchange, override, assembly)
        try:
            stable, refetched, data = await run_step(scope.offload, _outgoing, st, forwardable, assembly,
                                                     record.tenant)
            if stable is not None:
                st.metrics.prefix(record.tenant, route.name, stable)
            if refetched:
                record.refetched = refetched
                st.metrics.refetched(record.tenant, route.name, refetched)
            upstream.first_bytes = data
            upstream.overhead = record.overhead = time.perf_counter() - record.started
            sent = time.perf_counter()
            watcher = StreamWatcher(sent, wire.stream_end)
            try:
                try:
                    answer = await upstream.send(assembly)
                except UpstreamStatus as exc:  # nothing has reached the client yet: a refusal for length is recovered
                    _, answer = await recover(scope, exc, route, assembly, upstream.reassemble, upstream.send)
                if exchange is not None:
                    answer = exchange.wrap(answer)
                response = await relay_answer(request, answer, scope.headers, idle_timeout=idle, watcher=watcher)
            finally:
                record.upstream = time.perf_counter() - sent
                record.ttft, record.usage = watcher.ttft, watcher.usage
        finally:  # the figures of what the provider last received (a refused attempt's are replaced by its retry's)
            st.metrics.assembled(record.tenant, route.name, upstream.forwarded.report, route.upstream_model)
        return scope.answered(response)


async def _assemble(scope: Scope, wire: Wire, body: dict[str, Any], exchange: Exchange | None,
                    override: str | None) -> tuple[Assembly, ModelRoute]:
    """The pipeline on the request's body (the hook's edit of it, if any), with the hook's warnings."""
    assembly, route, _policy = await scope.runtime.assemble(
        wire, body, tenant=scope.tenant, override=override, offload=scope.offload, request_id=scope.request_id,
        params=scope.request.match_info,
    )
    if exchange is not None:
        assembly.report.warnings.extend(exchange.warnings)
    return assembly, route


@dataclass
class _Upstream:
    """One request's way to its route's provider: sends an assembly (the first, or a retry's), and can assemble the
    request again (``proxy.serve.overflow``)."""

    scope: Scope
    wire: Wire
    route: ModelRoute
    body: dict[str, Any]
    exchange: Exchange | None
    override: str | None
    first: Assembly
    first_bytes: bytes = b""  # the first assembly's (the client's own when nothing changed)
    overhead: float = 0.0

    def __post_init__(self) -> None:
        self.forwarded = self.first  # the assembly the provider last received: its figures are the request's

    async def send(self, assembly: Assembly) -> Answer:
        scope, wire, record = self.scope, self.wire, self.scope.record
        self.forwarded = assembly
        record.report, scope.settled = assembly.report, (self.route, assembly)
        scope.headers.update(report_headers(assembly, self.overhead))
        data = self.first_bytes if assembly is self.first else await run_step(
            scope.offload, _again, scope.state, assembly, record.tenant)
        call = Outgoing(wire.name, wire.upstream_path(self.route.upstream_model), assembly.body, data,
                        self.body.get("stream") is True, scope.request.headers, scope.request_id, wire.litellm_fields)
        return await scope.served.providers.for_route(self.route).send(self.route, call)

    async def reassemble(self) -> Assembly:
        return (await _assemble(self.scope, self.wire, self.body, self.exchange, self.override))[0]


def _again(st: State, assembly: Assembly, tenant: str) -> bytes:
    """A retry's bytes; the prefix tracker now remembers what it forwarded (its figure was counted for the first)."""
    st.prefix.observe(assembly.received, assembly.items, tenant, assembly.item_keys()[1])
    return forward_bytes(None, assembly)
