"""Every route the server answers, in one readable list; a managed wire's routes come from the registry.

Each registered wire (``proxy.wire.Wires``) is served on its paths, under ``/v1`` and at the root,
by the one managed handler with the wire's hook (``proxy.serve.hooks``); its other endpoints by the
handler their name says (``ENDPOINTS``: a name no handler has is an error when the app is built).
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from types import MappingProxyType

from aiohttp import web

from proxy.serve import admin
from proxy.serve.compact import compact_handler
from proxy.serve.hooks import HOOKS
from proxy.serve.http import Handler, expect_continue
from proxy.serve.managed import make_handler
from proxy.serve.messages import count_tokens_handler
from proxy.serve.relay import canonical_path, make_relay
from proxy.wire import WIRES, Wires
from proxy.wire.protocol import Wire

# a wire's other endpoints, by the name its translator gives them
ENDPOINTS: MappingProxyType[str, Callable[[web.Request, Wire], Awaitable[web.StreamResponse]]] = MappingProxyType({
    "compact": compact_handler,  # relayed, or answered by ctxproxy's summariser (Codex has no fallback)
    "count_tokens": count_tokens_handler,  # relayed or counted locally (Claude Code breaks on a 404 here)
})


def _bound(endpoint: Callable[[web.Request, Wire], Awaitable[web.StreamResponse]], wire: Wire) -> Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        return await endpoint(request, wire)

    handle.__name__ = f"{wire.name}_{endpoint.__name__}"
    return handle


def add_routes(app: web.Application, wires: Wires = WIRES) -> None:
    # every route answers an Expect header with expect_continue (no 100 Continue for a body over the limit)
    post = functools.partial(app.router.add_post, expect_handler=expect_continue)
    get = functools.partial(app.router.add_get, expect_handler=expect_continue)
    route = functools.partial(app.router.add_route, expect_handler=expect_continue)
    managed: dict[str, Handler] = {}
    for wire in wires.values():
        handler = make_handler(wire, HOOKS.get(wire.name))
        served: list[tuple[str, Handler]] = [(path, handler) for path in wire.paths]
        for path, name in wire.endpoints.items():
            endpoint = ENDPOINTS.get(name)
            if endpoint is None:
                raise ValueError(f"the {wire.name} wire's endpoint {path} names no handler: {name!r}")
            served.append((path, _bound(endpoint, wire)))
        for path, serve in served:
            for spelling in ("/v1" + path, path):
                post(spelling, serve)
                if "{" not in spelling:  # a path with a model in it is routed by aiohttp alone
                    managed[canonical_path(spelling)] = serve
    post("/v1/ctxproxy/explain", admin.explain_handler)
    post("/v1/ctxproxy/explain/{wire}", admin.explain_handler)
    get("/v1/ctxproxy/policy", admin.policy_handler)
    get("/v1/models", admin.models_handler)
    get("/healthz", admin.healthz)
    get("/readyz", admin.readyz)
    get("/metrics", admin.metrics_handler)
    post("/admin/reload", admin.admin_reload)
    get("/admin/report", admin.admin_report)
    route("*", "/v1/ctxproxy/{tail:.*}", admin.not_found)  # the proxy's own namespace is never relayed
    route("*", "/v1/{tail:.*}", make_relay(managed))
