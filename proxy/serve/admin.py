"""The proxy's own endpoints: health, readiness, metrics, reload, the caller's policy, models, explain."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import orjson
from aiohttp import web

from proxy.core.errors import (
    AuthenticationError,
    BadRequest,
    ConfigError,
    CtxProxyError,
    LedgerUnavailable,
    ModelNotFound,
    NotFound,
    ReportUnavailable,
)
from proxy.core.offload import run_step
from proxy.pipeline import MODES
from proxy.runtime import Runtime
from proxy.serve.explain import calibration_detail, explain_body
from proxy.serve.http import (
    OVERRIDE_HEADER,
    client_keys,
    dumps_json,
    json_response,
    request_id,
    state,
)
from proxy.serve.report import cost_report, parse_since, render
from proxy.serve.scope import request_scope
from proxy.serve.workers import Supervised
from proxy.settings import Config, Tenant, load_config
from proxy.upstream.anthropic import anthropic_headers
from proxy.upstream.client import ClientError
from proxy.upstream.http import open_request, upstream_headers

WORKERS_RELOAD_WAIT = 10.0  # seconds POST /admin/reload waits for every worker to confirm


async def explain_handler(request: web.Request) -> web.StreamResponse:
    """POST /v1/ctxproxy/explain[/<wire>] (or ``?wire=``): what the pipeline would forward, nobody billed.

    With no wire named, the body says (``proxy.wire.registry.Wires.sniff``). ``?summarize=true`` makes a
    summary that would be created (and bills the summariser); ``?mode=enforce|observe`` explains the body in
    that mode rather than the policy's. A wire whose model is in its path takes
    it from the query here (``?model=``).
    """
    wires = state(request).wires
    name = request.match_info.get("wire") or request.query.get("wire")
    wire = wires.get(name) if name else None
    if name and wire is None:
        raise NotFound(f"No wire {name[:40]!r}; known: {', '.join(sorted(wires))}.")
    # a wire picked from the body answers errors in the shape of the first registered (OpenAI's) until it is known
    with request_scope(request, wire or next(iter(wires.values())), event="explain", counted=False,
                       key_headers=None if wire is not None else wires.key_headers) as scope:
        body = await scope.body()
        if wire is None:
            scope.speak(wires.sniff(body))
        summarize = request.query.get("summarize", "").lower() in ("1", "true", "yes")
        mode = request.query.get("mode") or None
        if mode is not None and mode not in MODES:
            raise BadRequest(f"mode must be one of {', '.join(MODES)}", param="mode", code="invalid_mode")
        params = {k: v for k, v in request.query.items() if k not in ("wire", "summarize", "mode")}
        out = await explain_body(scope.runtime, scope.wire, body, scope.tenant, request.headers.get(OVERRIDE_HEADER),
                                 summarize=summarize, request_id=scope.request_id, offload=scope.offload,
                                 params=params, mode=mode)
        scope.record.model = out["report"].get("model")
        # the answer holds the whole forwarded conversation: written off the loop when it is large
        data = await run_step(scope.offload, dumps_json, out)
        return scope.answered(web.Response(body=data, content_type="application/json",
                                           headers={"x-request-id": scope.request_id}))


async def policy_handler(request: web.Request) -> web.Response:
    """GET /v1/ctxproxy/policy[?model=]: the caller's effective policy, and the calibration of its models."""
    st = state(request)
    runtime = st.runtime
    tenant = runtime.authenticate(client_keys(request))
    model = request.query.get("model") or None
    policy = runtime.policy(tenant, model, request.headers.get(OVERRIDE_HEADER))  # 404: a model it may not use
    out = policy.describe()
    out["calibration"] = await _calibration(runtime, [model] if model else _usable(runtime.config, tenant),
                                            policy.tenant)
    if policy.warnings:
        out["warnings"] = policy.warnings
    return json_response(out)


def _usable(config: Config, tenant: Tenant | None) -> list[str]:
    allowed = tenant.settings.models if tenant is not None else None
    return list(allowed) if allowed is not None else [m.name for m in config.settings.models]


async def _calibration(runtime: Runtime, models: list[str], tenant: str) -> dict[str, Any]:
    """Per model name: the factor the tenant's budget uses, and where it comes from."""
    out: dict[str, Any] = {}
    for name in models:
        try:
            route = runtime.route(name)
        except ModelNotFound:
            continue
        loading = runtime.calibration.prime(route, tenant) if runtime.calibration is not None else None
        if loading is not None:
            await loading
        out[name] = calibration_detail(runtime, route, tenant)
    return out


async def models_handler(request: web.Request) -> web.Response:
    st = state(request)
    tenant = st.runtime.authenticate(client_keys(request))
    config = st.config
    allowed = tenant.settings.models if tenant else None
    seen: dict[str, dict[str, Any]] = {}
    for m in config.settings.models:
        seen[m.name] = {"id": m.name, "object": "model", "created": 0, "owned_by": "ctxproxy"}
    if config.settings.allow_unknown_models:
        for item in await _upstream_models(request):
            if isinstance(item, dict) and isinstance(item.get("id"), str):
                seen.setdefault(item["id"], item)
    data = [v for k, v in seen.items() if allowed is None or k in allowed]
    return json_response({"object": "list", "data": data})


async def _upstream_models(request: web.Request) -> list[Any]:
    st = state(request)
    config = st.config
    upstream = config.settings.upstreams[config.default_upstream]
    url = upstream.base_url + "/models"
    if upstream.api == "anthropic":  # the API root, and its key in x-api-key
        url = upstream.base_url + "/v1/models"
        headers = anthropic_headers(request.headers, upstream, request_id=request_id(request, st.ids),
                                    forward_client_auth=config.forwards_client_auth(upstream))
    else:
        headers = upstream_headers(request.headers, upstream, forward_client_auth=config.forwards_client_auth(upstream),
                                   request_id=request_id(request, st.ids))
    try:
        response = await open_request(st.shared.pool.session(upstream), "GET", url,
                                      data=None, headers=headers, first_byte_timeout=3)
        async with response:
            if response.status != 200:
                return []
            payload = orjson.loads(await asyncio.wait_for(response.read(), 3))
    except (CtxProxyError, asyncio.TimeoutError, ClientError, orjson.JSONDecodeError):
        return []
    data = payload.get("data") if isinstance(payload, dict) else None
    return data if isinstance(data, list) else []


async def healthz(request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    st = state(request)
    cache_ok = await st.shared.cache.ping()
    body = {"status": "ready" if cache_ok and not st.draining else "not ready", "config": st.config.source,
            "cache": st.shared.cache.name if cache_ok else "unavailable", "draining": st.draining}
    return json_response(body, 200 if cache_ok and not st.draining else 503)


async def metrics_handler(request: web.Request) -> web.Response:
    """GET /metrics: open without tenants; with tenants it names each one with its traffic and cost, so only an
    admin key reads it here (a scraper without one reads ``server.metrics_port``)."""
    st = state(request)
    if st.config.tenants and not any(st.config.is_admin_key(key) for key in client_keys(request)):
        raise AuthenticationError("With tenants configured, /metrics needs an admin key (admin.keys); a scraper "
                                  "without one reads the server.metrics_port listener.")
    return await open_metrics_handler(request)


async def open_metrics_handler(request: web.Request) -> web.Response:
    """GET /metrics on the ``server.metrics_port`` listener: no key (bind it to loopback or a private network)."""
    payload, content_type = state(request).metrics.render()
    return web.Response(body=payload, headers={"Content-Type": content_type})


async def admin_reload(request: web.Request) -> web.Response:
    """POST /admin/reload (admin key): re-read the config file, in this process or in every worker."""
    st = state(request)
    if not any(st.config.is_admin_key(key) for key in client_keys(request)):
        raise AuthenticationError("An admin key is required for /admin/reload.")
    if st.supervised is not None and st.config_path is not None:
        return await _reload_every_worker(st.supervised, st.config_path)
    done = st.reload()
    if done.problems:
        return json_response({"reloaded": False, "problems": done.problems}, 400)
    return json_response({"reloaded": True, "restart_required": done.restart_required})


async def _reload_every_worker(supervised: Supervised, config_path: str) -> web.Response:
    """Under ``--workers``: a new config is checked here first (an invalid one reaches no worker), then every
    worker reloads (the supervisor relays SIGHUP) and the answer says what each did."""
    try:
        load_config(config_path)
    except ConfigError as exc:
        return json_response({"reloaded": False, "problems": exc.problems}, 400)
    if not supervised.supervisor_alive():
        return json_response({"reloaded": False, "problems": [
            f"the supervisor (pid {supervised.supervisor}) is gone: restart the server"]}, 503)
    outcomes = await supervised.reload_all(WORKERS_RELOAD_WAIT)
    if outcomes is None:
        return json_response({"reloaded": False, "problems": [
            f"the workers' status files in {supervised.directory} cannot be read: restart the server"]}, 503)
    states = {o.state for o in outcomes}
    body: dict[str, Any] = {
        "reloaded": states <= {"reloaded", "exited"},
        "workers": [o.as_dict() for o in outcomes],
        "restart_required": list(dict.fromkeys(p for o in outcomes for p in o.restart_required)),
    }
    problems = [f"worker {o.pid} did not confirm its reload within {WORKERS_RELOAD_WAIT:g}s"
                for o in outcomes if o.state == "pending"]
    problems += [f"worker {o.pid}: {problem}" for o in outcomes if o.state == "rejected" for problem in o.problems]
    if problems:
        body["problems"] = problems
    return json_response(body, 504 if "pending" in states else 400 if "rejected" in states else 200)


async def admin_report(request: web.Request) -> web.Response:
    """GET /admin/report?since=24h (admin key): the cost report, per tenant and model, from the cost ledger."""
    st = state(request)
    if not any(st.config.is_admin_key(key) for key in client_keys(request)):
        raise AuthenticationError("An admin key is required for /admin/report.")
    try:
        since = parse_since(request.query.get("since", "24h"))
    except ValueError as exc:
        raise BadRequest(str(exc), param="since", code="invalid_since") from None
    ledger = st.shared.ledger
    try:
        await ledger.flush()  # this process's latest buckets first
        report = await cost_report(ledger.store, since)
    except LedgerUnavailable as exc:
        raise ReportUnavailable(f"The cost report cannot be made: the cost ledger is unavailable: {exc}") from None
    if st.supervised is not None and st.shared.cache.name == "memory":
        # each worker's ledger lives in its own memory: this one can only speak for itself
        workers = max(1, len(st.supervised.statuses()))
        report["scope"] = {"worker_pid": os.getpid(), "workers": workers}
        report["warning"] = (f"cache.backend is memory and {workers} workers serve this port: this report counts "
                             f"only worker {os.getpid()}'s requests; use the disk or redis backend for one report")
    if request.query.get("format") == "text":
        text = render(report) + (f"warning: {report['warning']}\n" if "warning" in report else "")
        return web.Response(text=text, content_type="text/plain")
    return json_response(report)


async def not_found(request: web.Request) -> web.Response:
    raise NotFound(f"No route for {request.method} {request.path}.")
