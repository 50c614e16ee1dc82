"""One request's scope: what every handler of a wire does around what is its own.

``request_scope(request, wire)`` owns, for each request it opens: the request id (the client's
``x-request-id`` when it is a plain token), the wire's error shape, the answer's headers,
authentication (with the keys from the headers the wire names), reading the body (decoded,
within the size and time limits) and parsing it (in a worker thread when it is large), the
model check (where the wire keeps the model; one refusal for all), the request record, the
``finished`` metric (and a payload error's; explain is logged, not counted), and the one log line; a request whose
pipeline ran
is settled after its answer (``proxy.serve.feedback``) before its line is written. A handler
keeps only what differs: what it does with the body, and the answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from proxy.core.errors import CtxProxyError, PayloadError
from proxy.core.offload import run_step
from proxy.core.usage import Usage, normalise_usage
from proxy.pipeline import Assembly
from proxy.policy import ModelRoute
from proxy.runtime import Runtime, model_of
from proxy.serve.bodies import read_json_body
from proxy.serve.feedback import settle
from proxy.serve.http import (
    ERROR_WIRE,
    RESPONSE_HEADERS,
    client_keys,
    read_body,
    request_id,
    state,
)
from proxy.serve.requestlog import RequestRecord
from proxy.serve.state import Served, State
from proxy.serve.streaming import STREAM_ERROR
from proxy.settings import Tenant
from proxy.wire.protocol import Wire

log = logging.getLogger("ctxproxy")


@dataclass
class Scope:
    """One request in flight: what the scope found out, and what the handler tells it."""

    request: web.Request
    state: State
    served: Served  # in-flight requests keep the runtime and providers they started with
    wire: Wire
    record: RequestRecord
    headers: CIMultiDict[str]  # every answer's headers, errors included (``RESPONSE_HEADERS``)
    tenant: Tenant | None = None
    raw: bytes = b""
    offload: bool = False  # a large body: its synchronous work runs in a worker thread
    status: int = 500
    settled: tuple[ModelRoute, Assembly] | None = None  # the pipeline ran: settle the answer's usage
    counted: bool = True  # one of the wire's requests in the metrics (``finished``) and the cost ledger

    @property
    def runtime(self) -> Runtime:
        return self.served.runtime

    @property
    def request_id(self) -> str:
        return self.record.request_id

    @property
    def tenant_name(self) -> str:
        return self.record.tenant

    def speak(self, wire: Wire) -> None:
        """The request turned out to be of ``wire`` (explain picks it from the body): its errors and record."""
        self.wire = wire
        self.record.wire = wire.name
        self.request[ERROR_WIRE] = wire

    async def body(self) -> dict[str, Any]:
        """The request's body, read and parsed (off the event loop when it is large)."""
        self.raw = await read_body(self.request)
        self.offload = len(self.raw) > self.runtime.config.settings.server.offload_bytes
        body: dict[str, Any] = await run_step(self.offload, self.state.bodies.parse, self.raw, self.record.tenant,
                                              self.wire.name, self.wire.field, self._parse_whole)
        model = self.wire.model_of(body, self.request.match_info)
        self.record.model = model if isinstance(model, str) else None
        return body

    def _parse_whole(self, raw: bytes) -> tuple[dict[str, Any], bool]:
        return read_json_body(raw, self.state.wires.interpreted_fields)

    def model(self, body: dict[str, Any]) -> str:
        """The model the request names, where its wire keeps it (refused when there is none)."""
        return model_of(self.wire, body, self.request.match_info)

    def answered(self, response: web.StreamResponse) -> web.StreamResponse:
        self.status = response.status
        return response


def request_scope(request: web.Request, wire: Wire, *, event: str = "request", counted: bool = True,
                  key_headers: tuple[str, ...] | None = None) -> RequestScope:
    """The scope of one request of ``wire`` (``event`` names it in the log: request, compact, count_tokens …).

    ``counted``: the request is one of the wire's requests in the metrics and the cost ledger (explain, which
    forwards nothing and bills nobody, is logged but not counted). ``key_headers``: where the client's key may
    be when the wire is not known yet (default: the wire's own)."""
    st = state(request)
    rid = request_id(request, st.ids)
    headers: CIMultiDict[str] = CIMultiDict({"x-request-id": rid})
    request[RESPONSE_HEADERS] = headers
    request[ERROR_WIRE] = wire
    request[STREAM_ERROR] = ""  # none yet (set, so that reading it raises no KeyError: ``in`` on a request does)
    record = RequestRecord(request_id=rid, started=time.perf_counter(), wire=wire.name, event=event)
    return RequestScope(Scope(request, st, st.served, wire, record, headers, counted=counted),
                        key_headers or wire.key_headers)


class RequestScope:
    """``request_scope``'s context: authenticates on entry; on exit, whatever ended the request, finishes it
    (``_finish``). A plain context, not an asynchronous one or a generator's: neither awaits anything, and every
    request enters one."""

    __slots__ = ("_key_headers", "_scope")

    def __init__(self, scope: Scope, key_headers: tuple[str, ...]) -> None:
        self._scope = scope
        self._key_headers = key_headers

    def __enter__(self) -> Scope:
        scope = self._scope
        try:
            scope.tenant = scope.runtime.authenticate(client_keys(scope.request, self._key_headers))
        except BaseException as exc:
            _ended(scope, exc)
            raise
        scope.record.tenant = scope.tenant.name if scope.tenant else "default"
        return scope

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        _ended(self._scope, exc)  # (an exception goes on)


def _ended(scope: Scope, exc: BaseException | None) -> None:
    """The request ended (``exc``: what ended it, if anything): its status and error, then ``_finish``."""
    try:
        if isinstance(exc, CtxProxyError):
            scope.status = exc.status
            if scope.counted and (isinstance(exc, PayloadError) or exc.code == "context_length_exceeded"):
                scope.state.metrics.payload_error(exc.code or "invalid_payload")
            scope.record.error = exc.code
        elif isinstance(exc, (asyncio.CancelledError, ConnectionResetError)):
            scope.status = 499  # the client went away
    finally:
        _finish(scope)


def _finish(scope: Scope) -> None:
    st, record = scope.state, scope.record
    record.status = scope.status
    overhead = record.overhead  # the time before forwarding (a managed request's)
    if record.event != "request" and overhead is None:
        record.overhead = time.perf_counter() - record.started  # the log says how long the proxy's own answer took
    stream_error = scope.request[STREAM_ERROR]
    if stream_error:
        record.error = stream_error
    # the provider's usage, read once in the wire's form (the metrics and the feedback after the answer need it)
    answered = normalise_usage(record.usage, scope.wire.usage_form) if record.usage is not None else None
    if scope.counted:
        st.metrics.finished(record.tenant, record.model or "other", scope.status, overhead=overhead,
                            upstream=record.upstream, ttft=record.ttft, usage=record.usage, wire=record.wire,
                            normalised=answered)
    if scope.settled is not None:
        # learn from the answer's usage and count what it cost, once the answer is on its way (next loop turn)
        route, assembly = scope.settled
        asyncio.get_running_loop().call_soon(_after_answer, st, route, assembly, record, scope.status, answered)
    elif st.config.settings.logging.requests:
        record.log()


def _after_answer(st: State, route: ModelRoute, assembly: Assembly, record: RequestRecord, status: int,
                  answered: Usage | None) -> None:
    try:
        record.cost = settle(st.shared, st.metrics, route, assembly, record.tenant, answered, status,
                             refusal=record.refusal)
    except Exception:  # a bug here must never touch the answer, nor silence the request log
        log.exception("usage feedback failed for request %s", record.request_id)
    if st.config.settings.logging.requests:
        record.log()
