"""``create_app(config)``: the aiohttp application, its shared objects and their lifecycle."""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from proxy import handlers
from proxy.cache import Cache
from proxy.errors import ConfigError
from proxy.metrics import Metrics
from proxy.modelinfo import ModelMap
from proxy.prefix import PrefixTracker
from proxy.runtime import Runtime, Shared, open_shared
from proxy.settings import Config, load_config
from proxy.upstream import UpstreamEngine, UpstreamPool

log = logging.getLogger("ctxproxy")

MB = 1024 * 1024


@dataclass
class State:
    """Everything a handler needs; the runtime is swapped whole on reload."""

    runtime: Runtime
    shared: Shared
    pool: UpstreamPool
    metrics: Metrics
    config_path: str | None
    prefix: PrefixTracker = field(default_factory=PrefixTracker)
    draining: bool = False
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)

    @property
    def config(self) -> Config:
        return self.runtime.config

    def reload(self) -> list[str]:
        """Re-read the config file; on any problem keep the running config and return the problems."""
        if self.config_path is None:
            return ["no config file to reload (the app was built from an in-memory config)"]
        try:
            config = load_config(self.config_path)
        except ConfigError as exc:
            for problem in exc.problems:
                log.error("reload rejected, keeping the running config: %s", problem)
            return exc.problems
        self.runtime = Runtime(config, self.shared)
        self.runtime.engine = UpstreamEngine(self.runtime, self.pool)
        self.metrics.set_labels(_tenant_names(config), _model_names(config))
        log.info("config reloaded from %s", self.config_path)
        return []


STATE = web.AppKey("state", State)


def _tenant_names(config: Config) -> list[str]:
    return [t.name for t in config.tenants]


def _model_names(config: Config) -> list[str]:
    return [m.name for m in config.settings.models]


def create_app(config: Config, *, config_path: str | None = None, cache: Cache | None = None) -> web.Application:
    """Build the app; shared objects are created here and closed on cleanup."""
    s = config.settings
    model_map = ModelMap()
    metrics = Metrics(
        _tenant_names(config), _model_names(config), model_map,
        multiprocess_dir=os.environ.get("PROMETHEUS_MULTIPROC_DIR"),
    )
    shared = open_shared(config, observer=metrics, cache=cache, model_map=model_map)
    pool = UpstreamPool(s.server)
    runtime = Runtime(config, shared)
    runtime.engine = UpstreamEngine(runtime, pool)
    state = State(runtime, shared, pool, metrics, config_path)

    app = web.Application(
        client_max_size=int(s.server.max_body_mb * MB) + 1,
        middlewares=[handlers.error_middleware],
    )
    app[STATE] = state
    app.cleanup_ctx.append(_lifecycle)
    handlers.add_routes(app)
    return app


async def _lifecycle(app: web.Application) -> Any:
    state = app[STATE]
    yield
    for task in list(state.tasks):
        task.cancel()
    await state.shared.summaries.close()
    await state.pool.close()
    await state.shared.cache.close()
