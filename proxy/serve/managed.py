"""The handler of a managed wire: authenticate, run the pipeline, forward through the route's provider, relay.

One handler serves every wire (``make_handler(wire)``); a route module per wire
(``proxy.serve.routes``) registers its paths. Everything wire-specific comes from
the adapter: parsing and rendering, the error shape, the stream's end.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

from aiohttp import web
from multidict import CIMultiDict

from proxy.core.conversation import WireAdapter
from proxy.core.errors import CtxProxyError, PayloadError, UpstreamStatus
from proxy.core.offload import run_step
from proxy.core.refusal import length_refusal
from proxy.pipeline import Assembly
from proxy.policy import ModelRoute
from proxy.runtime import Runtime
from proxy.serve.feedback import settle
from proxy.serve.http import (
    ERROR_SHAPE,
    OVERRIDE_HEADER,
    RESPONSE_HEADERS,
    Handler,
    client_keys,
    dumps_body,
    header_safe,
    parse_body,
    read_body,
    request_id,
    state,
)
from proxy.serve.requestlog import RequestRecord
from proxy.serve.state import State
from proxy.serve.streaming import STREAM_ERROR, relay_answer
from proxy.settings import Tenant
from proxy.upstream.base import Answer, Outgoing
from proxy.wire.sse import StreamEnd, StreamWatcher

log = logging.getLogger("ctxproxy")


class ManagedWire(WireAdapter, Protocol):
    """A wire adapter as the server uses it: plus its path, error shape and stream conventions."""

    path: str
    error_shape: str
    stream_end: StreamEnd


class Exchange(Protocol):
    """What a wire's request hook made of one request."""

    body: dict[str, Any]  # the body the pipeline runs on: the client's, or the hook's edit of it
    edited: bool  # the body is not the client's: its JSON is forwarded, never the client's bytes
    warnings: list[str]

    def local_answer(self) -> Answer | None:
        """An answer made without calling the upstream, or None."""

    def wrap(self, answer: Answer) -> Answer:
        """The upstream's answer as the client gets it."""


class RequestHook(Protocol):
    """What a wire does around the pipeline (Messages: ``context_management`` emulation); None: nothing."""

    async def begin(self, runtime: Runtime, tenant: Tenant | None, body: dict[str, Any], *,
                    override: str | None, request_id: str, offload: bool = False) -> Exchange | None: ...


def forward_bytes(raw: bytes | None, assembly: Assembly) -> bytes:
    """The client's bytes when nothing changed (and they are the body's); else the managed body."""
    if not assembly.changed and raw is not None:
        return raw
    return dumps_body(assembly.body)


def _outgoing(st: State, raw: bytes | None, assembly: Assembly, tenant: str) -> tuple[bool | None, bytes]:
    """Whether the forwarded prefix is stable, and the bytes to forward (both linear in the items)."""
    return st.prefix.observe(assembly.received, assembly.items, tenant), forward_bytes(raw, assembly)


def report_headers(assembly: Assembly, overhead: float) -> dict[str, str]:
    r = assembly.report
    headers = {
        "x-ctxproxy-tokens-in": str(r.tokens_before),
        "x-ctxproxy-tokens-out": str(r.tokens_after),
        "x-ctxproxy-summary": r.summary,
        "x-ctxproxy-repairs": str(sum(r.repairs.values())),
        "x-ctxproxy-overhead-ms": f"{overhead * 1000:.2f}",
    }
    if r.warnings:
        headers["x-ctxproxy-warning"] = header_safe("; ".join(r.warnings))
    return headers


def make_handler(wire: ManagedWire, hook: RequestHook | None = None) -> Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        return await _handle(request, wire, hook)

    handle.__name__ = f"{wire.name}_handler"
    return handle


async def _handle(request: web.Request, wire: ManagedWire, hook: RequestHook | None) -> web.StreamResponse:
    st = state(request)
    served = st.served  # in-flight requests keep the policy and providers they started with
    runtime = served.runtime
    started = time.perf_counter()
    rid = request_id(request)
    request[RESPONSE_HEADERS] = CIMultiDict({"x-request-id": rid})
    request[ERROR_SHAPE] = wire.error_shape
    record = RequestRecord(request_id=rid, started=started, wire=wire.name)
    status = 500
    assembly: Assembly | None = None
    route: ModelRoute | None = None
    try:
        tenant = runtime.authenticate(client_keys(request))
        record.tenant = tenant.name if tenant else "default"
        raw = await read_body(request)
        offload = len(raw) > runtime.config.settings.server.offload_bytes
        body: dict[str, Any] = await run_step(offload, parse_body, raw)
        record.model = body.get("model") if isinstance(body.get("model"), str) else None
        override = request.headers.get(OVERRIDE_HEADER)
        exchange = await hook.begin(runtime, tenant, body, override=override, request_id=rid,
                                    offload=offload) if hook else None
        local = exchange.local_answer() if exchange is not None else None
        if local is not None:  # answered by the proxy itself (a paused compaction): no pipeline, nothing forwarded
            headers0: CIMultiDict[str] = CIMultiDict({"x-request-id": rid})
            if exchange is not None and exchange.warnings:
                headers0["x-ctxproxy-warning"] = header_safe("; ".join(exchange.warnings))
            response = await relay_answer(request, local, headers0, idle_timeout=st.config.settings.server.idle_timeout,
                                          watcher=StreamWatcher(time.perf_counter(), wire.stream_end))
            status = response.status
            return response
        forwardable: bytes | None = raw
        if exchange is not None and exchange.edited:
            body, forwardable = exchange.body, None
        assembly, route, _policy = await runtime.assemble(
            wire, body, tenant=tenant, override=override, offload=offload, request_id=rid,
        )
        if exchange is not None:
            assembly.report.warnings.extend(exchange.warnings)
        record.report = assembly.report
        record.model = route.name
        st.metrics.assembled(record.tenant, route.name, assembly.report, route.upstream_model)
        stable, data = await run_step(offload, _outgoing, st, forwardable, assembly, record.tenant)
        if stable is not None:
            st.metrics.prefix(record.tenant, route.name, stable)
        overhead = time.perf_counter() - started
        record.overhead = overhead
        headers: CIMultiDict[str] = CIMultiDict(report_headers(assembly, overhead))
        headers["x-request-id"] = rid
        request[RESPONSE_HEADERS] = headers
        call = Outgoing(wire.name, wire.path, assembly.body, data, body.get("stream") is True, request.headers, rid)
        sent = time.perf_counter()
        watcher = StreamWatcher(sent, wire.stream_end)
        try:
            answer = await served.providers.for_route(route).send(route, call)
            if exchange is not None:
                answer = exchange.wrap(answer)
            response = await relay_answer(request, answer, headers, idle_timeout=st.config.settings.server.idle_timeout,
                                          watcher=watcher)
        finally:
            record.upstream = time.perf_counter() - sent
            record.ttft, record.usage = watcher.ttft, watcher.usage
        status = response.status
        return response
    except CtxProxyError as exc:
        status = exc.status
        if isinstance(exc, PayloadError) or exc.code == "context_length_exceeded":
            st.metrics.payload_error(exc.code or "invalid_payload")
        if isinstance(exc, UpstreamStatus):  # the provider's own words: a refusal for length is calibration evidence
            record.refusal = length_refusal(exc.status, exc.raw if isinstance(exc.raw, dict) else exc.body)
        record.error = exc.code
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        status = 499  # the client went away
        raise
    finally:
        record.status = status
        if STREAM_ERROR in request:
            record.error = request[STREAM_ERROR]
        st.metrics.finished(record.tenant, record.model or "other", status, overhead=record.overhead,
                            upstream=record.upstream, ttft=record.ttft, usage=record.usage, wire=wire.name)
        if assembly is not None and route is not None:
            # learn from the answer's usage and count what it cost, once the answer is on its way (next loop turn)
            asyncio.get_running_loop().call_soon(_after_answer, st, route, assembly, record, status, wire.name)
        elif st.config.settings.logging.requests:
            record.log()


def _after_answer(st: State, route: ModelRoute, assembly: Assembly, record: RequestRecord, status: int,
                  wire: str) -> None:
    try:
        record.cost = settle(st.shared, st.metrics, route, assembly, record.tenant, record.usage, status, wire,
                             refusal=record.refusal)
    except Exception:  # a bug here must never touch the answer, nor silence the request log
        log.exception("usage feedback failed for request %s", record.request_id)
    if st.config.settings.logging.requests:
        record.log()
