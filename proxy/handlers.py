"""HTTP handlers: chat completions through the pipeline, relays, and the proxy's own endpoints."""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import unquote

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from proxy import litellm_route
from proxy.deadline import deadline
from proxy.errors import (
    AuthenticationError,
    BadRequest,
    BodyTooLarge,
    CtxProxyError,
    ModelNotFound,
    NotFound,
    PayloadError,
    UpstreamStatus,
    UpstreamTimeout,
    UpstreamUnreachable,
    error_body,
)
from proxy.explain import explain, parse_body
from proxy.pipeline import Assembly
from proxy.policy import ModelRoute
from proxy.requestlog import RequestRecord
from proxy.settings import Tenant
from proxy.streaming import SSE_HEADERS, STREAM_ERROR, StreamWatcher, error_event, relay_stream
from proxy.upstream import open_request, read_error, response_headers, upstream_headers

log = logging.getLogger("ctxproxy")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
OVERRIDE_HEADER = "x-ctxproxy-context-manager"
# headers every answer to this request carries, errors included (x-request-id, x-ctxproxy-*)
RESPONSE_HEADERS = web.RequestKey("response_headers", CIMultiDict)


def _state(request: web.Request) -> Any:
    from proxy.app import STATE

    return request.app[STATE]


def json_response(payload: Any, status: int = 200, headers: Any = None) -> web.Response:
    return web.Response(body=orjson.dumps(payload), status=status, content_type="application/json",
                        headers=headers)


def error_response(error: CtxProxyError, headers: Any = None) -> web.Response:
    out: CIMultiDict[str] = CIMultiDict(headers or {})
    out.popall("Content-Type", None)  # the upstream's, when it failed after sending its headers
    if isinstance(error, UpstreamStatus):
        for name, value in error.headers.items():
            if name.lower() not in ("content-type",):
                out[name] = value
    return json_response(error.to_openai(), error.status, out)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure becomes OpenAI's error shape; no traceback ever reaches a client."""
    try:
        return await handler(request)
    except CtxProxyError as exc:
        return error_response(exc, request.get(RESPONSE_HEADERS))
    except web.HTTPRequestEntityTooLarge:
        return error_response(BodyTooLarge("The request body is larger than this proxy accepts."))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status, "http_error")
        return json_response(error_body(exc.reason, "invalid_request_error", None, code), exc.status)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("internal error on %s %s", request.method, request.path)
        return json_response(error_body("The proxy failed to handle this request.", "server_error", None,
                                        "internal_error"), 500)


def bearer(request: web.Request) -> str | None:
    value = request.headers.get("Authorization", "")
    if value[:7].lower() == "bearer ":
        return value[7:].strip() or None
    return request.headers.get("api-key") or request.headers.get("x-api-key") or None


def authenticate(request: web.Request) -> Tenant | None:
    """With tenants configured, the proxy key picks the tenant; anything else is 401."""
    config = _state(request).config
    if not config.tenants:
        return None
    key = bearer(request)
    tenant: Tenant | None = config.tenant_for_key(key) if key else None
    if tenant is None:
        raise AuthenticationError(
            "Incorrect API key provided." if key else "Missing API key: send Authorization: Bearer <key>."
        )
    return tenant


async def read_body(request: web.Request) -> bytes:
    limit = int(_state(request).config.settings.server.max_body_mb * 1024 * 1024)
    if request.content_length is not None and request.content_length > limit:
        raise BodyTooLarge(f"The request body is {request.content_length} bytes; the limit is {limit}.")
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise BodyTooLarge(f"The request body is larger than the limit of {limit} bytes.") from None


def request_id(request: web.Request) -> str:
    given = request.headers.get("x-request-id", "")
    return given if REQUEST_ID.match(given) else uuid.uuid4().hex


def forward_body(raw: bytes, body: dict[str, Any], assembly: Assembly, route: ModelRoute) -> bytes:
    """The client's bytes when nothing changed; else its body with only messages/model/limits changed."""
    rename = route.upstream_model != body.get("model")
    if not assembly.changed and not rename:
        return raw
    out = dict(body)
    out["messages"] = assembly.messages
    out.update(assembly.body_changes)
    if rename:
        out["model"] = route.upstream_model
    try:
        return orjson.dumps(out)
    except TypeError:  # orjson reads 1024 levels of nesting but writes only 254
        raise BadRequest("The request body is nested too deeply (more than 254 levels) to be forwarded.",
                         code="invalid_json") from None


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
        headers["x-ctxproxy-warning"] = "; ".join(r.warnings)[:1000]
    return headers


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = _state(request)
    runtime = state.runtime  # in-flight requests keep the policy they started with
    started = time.perf_counter()
    rid = request_id(request)
    request[RESPONSE_HEADERS] = CIMultiDict({"x-request-id": rid})
    record = RequestRecord(request_id=rid, started=started)
    status = 500
    try:
        tenant = authenticate(request)
        record.tenant = tenant.name if tenant else "default"
        raw = await read_body(request)
        offload = len(raw) > runtime.config.settings.server.offload_bytes
        body = (await asyncio.get_running_loop().run_in_executor(None, parse_body, raw)) if offload \
            else parse_body(raw)
        record.model = body.get("model") if isinstance(body.get("model"), str) else None
        assembly, route, _policy = await runtime.assemble(
            body, tenant=tenant, override=request.headers.get(OVERRIDE_HEADER), offload=offload
        )
        record.report = assembly.report
        record.model = route.name
        state.metrics.assembled(record.tenant, route.name, assembly.report)
        stable = state.prefix.observe(assembly.received, assembly.messages, assembly.keys)
        if stable is not None:
            state.metrics.prefix(record.tenant, route.name, stable)
        data = forward_body(raw, body, assembly, route)
        overhead = time.perf_counter() - started
        record.overhead = overhead
        headers: CIMultiDict[str] = CIMultiDict(report_headers(assembly, overhead))
        headers["x-request-id"] = rid
        request[RESPONSE_HEADERS] = headers
        if route.provider == "litellm":
            response = await _litellm(request, route, body, assembly, headers, record)
        else:
            response = await _openai(request, runtime, route, data, headers, record)
        status = response.status
        return response
    except CtxProxyError as exc:
        status = exc.status
        if isinstance(exc, PayloadError) or exc.code == "context_length_exceeded":
            state.metrics.payload_error(exc.code or "invalid_payload")
        record.error = exc.code
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        status = 499  # the client went away
        raise
    finally:
        record.status = status
        if STREAM_ERROR in request:
            record.error = request[STREAM_ERROR]
        state.metrics.finished(record.tenant, record.model or "other", status, overhead=record.overhead,
                               upstream=record.upstream, ttft=record.ttft, usage=record.usage)
        if state.config.settings.logging.requests:
            record.log()


async def _openai(
    request: web.Request, runtime: Any, route: ModelRoute, data: bytes, headers: CIMultiDict[str],
    record: RequestRecord,
) -> web.StreamResponse:
    config = runtime.config
    server = config.settings.server
    upstream = config.settings.upstreams[route.upstream]
    session = _state(request).pool.session(upstream)
    forward_auth = not config.tenants and upstream.api_key is None
    up_headers = upstream_headers(request.headers, upstream, forward_client_auth=forward_auth,
                                  request_id=record.request_id)
    up_headers["Content-Type"] = "application/json"
    sent = time.perf_counter()
    response = await open_request(session, "POST", upstream.base_url + "/chat/completions", data=data,
                                  headers=up_headers, first_byte_timeout=server.first_byte_timeout)
    if response.status >= 400:
        record.upstream = time.perf_counter() - sent
        raise await read_error(response, server.idle_timeout, upstream.api_key)
    headers.extend(response_headers(response.headers))
    if response.content_type == "text/event-stream":
        watcher = StreamWatcher(sent)
        try:
            return await relay_stream(request, response, headers, idle_timeout=server.idle_timeout,
                                      watcher=watcher)
        finally:
            record.upstream = time.perf_counter() - sent
            record.ttft, record.usage = watcher.ttft, watcher.usage
    try:
        async with deadline(server.idle_timeout):
            raw = await response.read()
    except asyncio.TimeoutError:
        response.close()
        raise UpstreamTimeout("The upstream stalled while sending its answer.") from None
    except aiohttp.ClientError:
        response.close()
        raise UpstreamUnreachable("The upstream closed the connection before its answer was complete.") from None
    finally:
        response.release()
    record.upstream = record.ttft = time.perf_counter() - sent
    record.usage = _usage(raw)
    headers.setdefault("Content-Type", "application/json")
    return web.Response(body=raw, status=response.status, headers=headers)


def _usage(raw: bytes) -> dict[str, Any] | None:
    try:
        payload = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    usage = payload.get("usage") if isinstance(payload, dict) else None
    return usage if isinstance(usage, dict) else None


async def _litellm(
    request: web.Request, route: ModelRoute, body: dict[str, Any], assembly: Assembly,
    headers: CIMultiDict[str], record: RequestRecord,
) -> web.StreamResponse:
    config = _state(request).config
    upstream = config.settings.upstreams.get(route.upstream)
    call_body = dict(body)
    call_body["messages"] = assembly.messages
    call_body.update(assembly.body_changes)
    sent = time.perf_counter()
    if not body.get("stream"):
        out = await litellm_route.chat(route, call_body, upstream)
        record.upstream = record.ttft = time.perf_counter() - sent
        record.usage = out.get("usage") if isinstance(out.get("usage"), dict) else None
        return json_response(out, 200, headers)
    events = await litellm_route.open_stream(route, call_body, upstream)
    headers["Content-Type"] = "text/event-stream"
    headers.update(SSE_HEADERS)
    response = web.StreamResponse(status=200, headers=headers)
    await response.prepare(request)
    watcher = StreamWatcher(sent)
    try:
        async for event in events:
            watcher.feed(event)
            await response.write(event)
    except CtxProxyError as exc:
        request[STREAM_ERROR] = exc.code or "stream_error"
        await response.write(error_event(exc))
    finally:
        record.upstream = time.perf_counter() - sent
        record.ttft, record.usage = watcher.ttft, watcher.usage
    await response.write_eof()
    return response


async def explain_handler(request: web.Request) -> web.Response:
    state = _state(request)
    tenant = authenticate(request)
    raw = await read_body(request)
    return json_response(await explain(state.runtime, raw, tenant, request.headers.get(OVERRIDE_HEADER)))


async def policy_handler(request: web.Request) -> web.Response:
    state = _state(request)
    tenant = authenticate(request)
    policy = state.runtime.policy(tenant, None, request.headers.get(OVERRIDE_HEADER))
    out = policy.describe()
    if policy.warnings:
        out["warnings"] = policy.warnings
    return json_response(out)


async def models_handler(request: web.Request) -> web.Response:
    state = _state(request)
    tenant = authenticate(request)
    config = state.config
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
    state = _state(request)
    config = state.config
    upstream = config.settings.upstreams[config.default_upstream]
    headers = upstream_headers(request.headers, upstream, forward_client_auth=not config.tenants,
                               request_id=request_id(request))
    try:
        response = await open_request(state.pool.session(upstream), "GET", upstream.base_url + "/models",
                                      data=None, headers=headers, first_byte_timeout=3)
        async with response:
            if response.status != 200:
                return []
            payload = orjson.loads(await asyncio.wait_for(response.read(), 3))
    except (CtxProxyError, asyncio.TimeoutError, aiohttp.ClientError, orjson.JSONDecodeError):
        return []
    data = payload.get("data") if isinstance(payload, dict) else None
    return data if isinstance(data, list) else []


async def relay(request: web.Request) -> web.StreamResponse:
    """Any other /v1/* path, relayed untouched to the default upstream (streaming-safe)."""
    state = _state(request)
    config = state.config
    tenant = authenticate(request)
    upstream = config.settings.upstreams[config.default_upstream]
    raw = await read_body(request) if request.can_read_body else None
    if tenant is not None and tenant.settings.models is not None and raw:
        _check_relayed_model(raw, tenant.settings.models)
    headers = upstream_headers(request.headers, upstream, forward_client_auth=not config.tenants and
                               upstream.api_key is None, request_id=request_id(request))
    if "Content-Type" in request.headers:
        headers["Content-Type"] = request.headers["Content-Type"]
    url = relay_url(upstream.base_url, request.raw_path)
    server = config.settings.server
    response = await open_request(state.pool.session(upstream), request.method, URL(url, encoded=True),
                                  data=raw, headers=headers, first_byte_timeout=server.first_byte_timeout)
    if response.status >= 400:
        raise await read_error(response, server.idle_timeout, upstream.api_key)
    out_headers = response_headers(response.headers)
    if response.content_type == "text/event-stream":
        return await relay_stream(request, response, out_headers, idle_timeout=server.idle_timeout,
                                  watcher=StreamWatcher(time.perf_counter()))
    out = web.StreamResponse(status=response.status, headers=out_headers)
    try:
        await out.prepare(request)
        while True:
            try:
                async with deadline(server.idle_timeout):
                    chunk = await response.content.readany()
            except (asyncio.TimeoutError, aiohttp.ClientError, OSError):
                # the upstream failed after the answer started: cut the client's connection, so the
                # truncated body can never look complete (and the client is not left waiting for the rest)
                if request.transport is not None:
                    request.transport.close()
                return out
            if not chunk:
                break
            await out.write(chunk)
        await out.write_eof()
    finally:
        response.close()
    return out


def relay_url(base_url: str, raw_path: str) -> str:
    """The upstream URL for a relayed ``/v1/...`` path, kept percent-encoded exactly as the client sent it.

    Dot segments are refused: a relayed path may not climb out of the upstream's base path.
    """
    tail = raw_path[len("/v1"):] if raw_path.startswith("/v1") else raw_path
    decoded = unquote(tail.split("?", 1)[0]).replace("\\", "/")
    if any(segment in (".", "..") for segment in decoded.split("/")):
        raise NotFound("Relayed paths may not contain '.' or '..' segments.")
    return base_url + tail


def _check_relayed_model(raw: bytes, allowed: list[str]) -> None:
    """A tenant's model allow-list holds on every endpoint, not only chat completions."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return
    model = body.get("model") if isinstance(body, dict) else None
    if isinstance(model, str) and model not in allowed:
        raise ModelNotFound(f"The model {model[:100]!r} does not exist or you do not have access to it.",
                            param="model")


async def healthz(request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    state = _state(request)
    cache_ok = await state.shared.cache.ping()
    body = {"status": "ready" if cache_ok and not state.draining else "not ready", "config": state.config.source,
            "cache": state.shared.cache.name if cache_ok else "unavailable", "draining": state.draining}
    return json_response(body, 200 if cache_ok and not state.draining else 503)


async def metrics_handler(request: web.Request) -> web.Response:
    payload, content_type = _state(request).metrics.render()
    return web.Response(body=payload, headers={"Content-Type": content_type})


async def admin_reload(request: web.Request) -> web.Response:
    state = _state(request)
    key = bearer(request)
    if not key or not state.config.is_admin_key(key):
        raise AuthenticationError("An admin key is required for /admin/reload.")
    problems = state.reload()
    if problems:
        return json_response({"reloaded": False, "problems": problems}, 400)
    return json_response({"reloaded": True})


async def not_found(request: web.Request) -> web.Response:
    raise NotFound(f"No route for {request.method} {request.path}.")


def add_routes(app: web.Application) -> None:
    r = app.router
    for path in ("/v1/chat/completions", "/chat/completions"):
        r.add_post(path, chat_completions)
    r.add_post("/v1/ctxproxy/explain", explain_handler)
    r.add_get("/v1/ctxproxy/policy", policy_handler)
    r.add_get("/v1/models", models_handler)
    r.add_get("/healthz", healthz)
    r.add_get("/readyz", readyz)
    r.add_get("/metrics", metrics_handler)
    r.add_post("/admin/reload", admin_reload)
    r.add_route("*", "/v1/ctxproxy/{tail:.*}", not_found)  # the proxy's own namespace is never relayed
    r.add_route("*", "/v1/{tail:.*}", relay)
