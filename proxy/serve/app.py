"""``create_app(config)``: the aiohttp application, its typed state and its lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator

from aiohttp import web

from proxy.core.modelinfo import ModelMap
from proxy.serve.admin import not_found, open_metrics_handler
from proxy.serve.http import error_middleware
from proxy.serve.metrics import Metrics
from proxy.serve.routes import add_routes
from proxy.serve.state import (
    STATE,
    State,
    build_runtime,
    build_shared,
    model_names,
    tenant_names,
    upstream_names,
)
from proxy.serve.workers import Supervised
from proxy.settings import Config
from proxy.store.cache import Cache
from proxy.wire import WIRES, Wires


def create_app(config: Config, *, config_path: str | None = None, cache: Cache | None = None,
               wires: Wires = WIRES) -> web.Application:
    """Build the app speaking ``wires``; shared objects are created here and closed on cleanup."""
    model_map = ModelMap()
    metrics = Metrics(tenant_names(config), model_names(config), model_map,
                      multiprocess_dir=os.environ.get("PROMETHEUS_MULTIPROC_DIR"), upstreams=upstream_names(config),
                      wires=wires)
    shared = build_shared(config, metrics=metrics, cache=cache, model_map=model_map)
    state = State(build_runtime(config, shared), shared, metrics, config_path,
                  supervised=Supervised.from_env(os.environ), wires=wires)
    # bodies are read by proxy.serve.http.read_body, which applies the running config's max_body_mb
    app = web.Application(middlewares=[error_middleware])
    state.drain_timeout = config.settings.server.drain_timeout  # the runner's, when ``make_runner`` builds it
    app[STATE] = state
    app.on_shutdown.append(_draining)
    app.cleanup_ctx.append(_lifecycle)
    add_routes(app, wires)
    return app


async def _draining(app: web.Application) -> None:
    """Shutdown begins (before in-flight requests are awaited): the drain timeout runs from now."""
    state = app[STATE]
    state.drain_started = time.monotonic()
    state.shared.background.drain()  # no new background summary; the running ones go on


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    shared = state.shared
    flushing = asyncio.create_task(shared.ledger.run())  # the cost ledger, written every few seconds
    yield
    flushing.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await flushing
    # background summaries get what is left of the drain timeout, then are abandoned (nothing half-written)
    began = state.drain_started if state.drain_started is not None else time.monotonic()
    await shared.close(drain=max(0.0, began + state.drain_timeout - time.monotonic()))


def create_metrics_app(app: web.Application) -> web.Application:
    """The ``server.metrics_port`` listener's app: ``GET /metrics`` of ``app``, with no key, and nothing else."""
    metrics = web.Application(middlewares=[error_middleware])
    metrics[STATE] = app[STATE]  # the same state (a reload swaps its runtime); ``app`` opens and closes it
    metrics.router.add_get("/metrics", open_metrics_handler)
    metrics.router.add_route("*", "/{tail:.*}", not_found)
    return metrics
