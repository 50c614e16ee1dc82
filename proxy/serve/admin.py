"""The proxy's own endpoints: health, readiness, metrics, reload, the caller's policy, models, explain."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from proxy.core.errors import AuthenticationError, BadRequest, CtxProxyError, ModelNotFound, NotFound
from proxy.core.offload import run_step
from proxy.runtime import Runtime
from proxy.serve.explain import calibration_detail, explain
from proxy.serve.http import (
    ERROR_SHAPE,
    OVERRIDE_HEADER,
    client_keys,
    json_response,
    read_body,
    request_id,
    state,
)
from proxy.serve.report import cost_report, parse_since, render
from proxy.serve.requestlog import RequestRecord
from proxy.settings import Config, Tenant
from proxy.upstream.anthropic import anthropic_headers
from proxy.upstream.http import open_request, upstream_headers
from proxy.wire import WIRES


async def explain_handler(request: web.Request) -> web.Response:
    """POST /v1/ctxproxy/explain[/<wire>] (or ``?wire=``): what the pipeline would forward, nobody billed.

    With no wire named, the body says (``proxy.serve.explain.wire_of``: Responses or Chat).
    ``?summarize=true`` makes a summary that would be created (and bills the summariser).
    """
    st = state(request)
    name = request.match_info.get("wire") or request.query.get("wire")
    wire = WIRES.get(name) if name else None
    if name and wire is None:
        raise NotFound(f"No wire {name[:40]!r}; known: {', '.join(sorted(WIRES))}.")
    # a wire picked from the body is Chat or Responses: both answer errors in OpenAI's shape
    request[ERROR_SHAPE] = (wire or WIRES["chat"]).error_shape
    rid = request_id(request)
    record = RequestRecord(request_id=rid, started=time.perf_counter(), wire=(wire or WIRES["chat"]).name,
                           event="explain")
    status = 500
    try:
        tenant = st.runtime.authenticate(client_keys(request))
        record.tenant = tenant.name if tenant else "default"
        raw = await read_body(request)
        summarize = request.query.get("summarize", "").lower() in ("1", "true", "yes")
        out = await explain(st.runtime, wire, raw, tenant, request.headers.get(OVERRIDE_HEADER),
                            summarize=summarize, request_id=rid)
        report = out["report"]
        record.model = report.get("model")
        record.wire = report.get("wire") or record.wire  # the wire picked from the body, when none was named
        status = 200
        # the answer holds the whole forwarded conversation: written off the loop when it is large
        data = await run_step(len(raw) > st.config.settings.server.offload_bytes, orjson.dumps, out)
        return web.Response(body=data, content_type="application/json", headers={"x-request-id": rid})
    except CtxProxyError as exc:
        status, record.error = exc.status, exc.code
        raise
    finally:
        record.status = status
        record.overhead = time.perf_counter() - record.started
        if st.config.settings.logging.requests:
            record.log()


async def policy_handler(request: web.Request) -> web.Response:
    """GET /v1/ctxproxy/policy[?model=]: the caller's effective policy, and the calibration of its models."""
    st = state(request)
    runtime = st.runtime
    tenant = runtime.authenticate(client_keys(request))
    model = request.query.get("model") or None
    policy = runtime.policy(tenant, model, request.headers.get(OVERRIDE_HEADER))  # 404: a model it may not use
    out = policy.describe()
    out["calibration"] = await _calibration(runtime, [model] if model else _usable(runtime.config, tenant))
    if policy.warnings:
        out["warnings"] = policy.warnings
    return json_response(out)


def _usable(config: Config, tenant: Tenant | None) -> list[str]:
    allowed = tenant.settings.models if tenant is not None else None
    return list(allowed) if allowed is not None else [m.name for m in config.settings.models]


async def _calibration(runtime: Runtime, models: list[str]) -> dict[str, Any]:
    """Per model name: the factor its budget uses, and where it comes from."""
    out: dict[str, Any] = {}
    for name in models:
        try:
            route = runtime.route(name)
        except ModelNotFound:
            continue
        if runtime.calibration is not None:
            await runtime.calibration.prime(route)
        out[name] = calibration_detail(runtime, route)
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
        headers = anthropic_headers(request.headers, upstream, request_id=request_id(request),
                                    forward_client_auth=config.forwards_client_auth(upstream))
    else:
        headers = upstream_headers(request.headers, upstream, forward_client_auth=config.forwards_client_auth(upstream),
                                   request_id=request_id(request))
    try:
        response = await open_request(st.shared.pool.session(upstream), "GET", url,
                                      data=None, headers=headers, first_byte_timeout=3)
        async with response:
            if response.status != 200:
                return []
            payload = orjson.loads(await asyncio.wait_for(response.read(), 3))
    except (CtxProxyError, asyncio.TimeoutError, aiohttp.ClientError, orjson.JSONDecodeError):
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
    payload, content_type = state(request).metrics.render()
    return web.Response(body=payload, headers={"Content-Type": content_type})


async def admin_reload(request: web.Request) -> web.Response:
    st = state(request)
    if not any(st.config.is_admin_key(key) for key in client_keys(request)):
        raise AuthenticationError("An admin key is required for /admin/reload.")
    problems = st.reload()
    if problems:
        return json_response({"reloaded": False, "problems": problems}, 400)
    return json_response({"reloaded": True})


async def admin_report(request: web.Request) -> web.Response:
    """GET /admin/report?since=24h (admin key): the cost report, per tenant and model, from the cost ledger."""
    st = state(request)
    if not any(st.config.is_admin_key(key) for key in client_keys(request)):
        raise AuthenticationError("An admin key is required for /admin/report.")
    try:
        since = parse_since(request.query.get("since", "24h"))
    except ValueError as exc:
        raise BadRequest(str(exc), param="since", code="invalid_since") from None
    await st.shared.ledger.flush()  # this process's latest buckets first
    report = await cost_report(st.shared.cache, since)
    if request.query.get("format") == "text":
        return web.Response(text=render(report), content_type="text/plain")
    return json_response(report)


async def not_found(request: web.Request) -> web.Response:
    raise NotFound(f"No route for {request.method} {request.path}.")
