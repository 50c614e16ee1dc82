"""Every route the server answers, in one readable list (a managed wire is its adapter plus its paths)."""

from __future__ import annotations

from aiohttp import web

from proxy.serve import admin, messages
from proxy.serve.compact import COMPACT_PATH, compact_handler
from proxy.serve.http import Handler
from proxy.serve.managed import ManagedWire, RequestHook, make_handler
from proxy.serve.relay import canonical_path, make_relay
from proxy.wire.chat import WIRE as CHAT
from proxy.wire.messages import WIRE as MESSAGES
from proxy.wire.responses import WIRE as RESPONSES

# a managed wire and the paths it answers (each also under /v1)
MANAGED: tuple[tuple[ManagedWire, tuple[str, ...]], ...] = (
    (CHAT, ("/chat/completions",)),
    (RESPONSES, ("/responses",)),
    (MESSAGES, ("/messages",)),
)
# what a wire does around the pipeline, by wire name (Messages: context_management emulation)
HOOKS: dict[str, RequestHook] = {MESSAGES.name: messages.HOOK}


def add_routes(app: web.Application) -> None:
    r = app.router
    managed: dict[str, Handler] = {}
    for wire, paths in MANAGED:
        handler = make_handler(wire, HOOKS.get(wire.name))
        for path in paths:
            for spelling in ("/v1" + path, path):
                r.add_post(spelling, handler)
                managed[canonical_path(spelling)] = handler
    for spelling in ("/v1" + COMPACT_PATH, COMPACT_PATH):  # relayed or answered by ctxproxy's summariser
        r.add_post(spelling, compact_handler)
        managed[canonical_path(spelling)] = compact_handler
    for spelling in ("/v1/messages/count_tokens", "/messages/count_tokens"):  # Claude Code breaks on a 404 here
        r.add_post(spelling, messages.count_tokens_handler)
        managed[canonical_path(spelling)] = messages.count_tokens_handler
    r.add_post("/v1/ctxproxy/explain", admin.explain_handler)
    r.add_post("/v1/ctxproxy/explain/{wire}", admin.explain_handler)
    r.add_get("/v1/ctxproxy/policy", admin.policy_handler)
    r.add_get("/v1/models", admin.models_handler)
    r.add_get("/healthz", admin.healthz)
    r.add_get("/readyz", admin.readyz)
    r.add_get("/metrics", admin.metrics_handler)
    r.add_post("/admin/reload", admin.admin_reload)
    r.add_get("/admin/report", admin.admin_report)
    r.add_route("*", "/v1/ctxproxy/{tail:.*}", admin.not_found)  # the proxy's own namespace is never relayed
    r.add_route("*", "/v1/{tail:.*}", make_relay(managed))
