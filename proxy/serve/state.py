"""The application's state, typed, and the one way to build a runtime from a config.

``build_shared`` opens the objects that outlive a reload (token counters, model map,
summary cache, summaries, calibration); ``build_runtime`` wires a config to them
(routes, providers, the summariser's engine). The server, ``ctxproxy assemble`` and
explain all go through these two functions.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from aiohttp import web

from proxy.core.errors import ConfigError
from proxy.core.modelinfo import ModelMap
from proxy.core.tokens import Tokenizers
from proxy.runtime import Runtime
from proxy.serve.metrics import Metrics
from proxy.settings import Config, load_config
from proxy.store.backends import open_cache
from proxy.store.cache import Cache, SafeCache
from proxy.store.prefix import PrefixTracker
from proxy.store.summaries import LOCK_TTL, SummaryService
from proxy.upstream.engine import UpstreamEngine
from proxy.upstream.http import UpstreamPool
from proxy.upstream.providers import Providers

log = logging.getLogger("ctxproxy")


@dataclass
class Shared:
    """Objects that outlive a config reload."""

    tokenizers: Tokenizers
    model_map: ModelMap
    cache: Cache | SafeCache
    summaries: SummaryService
    pool: UpstreamPool

    async def close(self) -> None:
        await self.summaries.close()
        await self.pool.close()
        await self.cache.close()


def build_shared(
    config: Config,
    *,
    metrics: Metrics | None = None,
    cache: Cache | None = None,
    model_map: ModelMap | None = None,
) -> Shared:
    s = config.settings
    if cache is None:
        cache = open_cache(
            s.cache.backend, path=s.cache.path, url=s.cache.url, ttl=s.cache.ttl_seconds,
            size_limit_mb=s.cache.size_limit_mb, on_error=metrics.cache_error if metrics else None,
        )
    summaries = SummaryService(
        cache,
        ttl=s.cache.ttl_seconds,
        lock_wait=s.summarizer.lock_wait_seconds,
        max_wait=s.summarizer.timeout_seconds * s.summarizer.max_calls_per_summary + LOCK_TTL,
        backoff_first=s.summarizer.retry_backoff_seconds,
        backoff_max=s.summarizer.max_backoff_seconds,
        on_call=metrics.summary_call if metrics else None,
        on_failure=metrics.summary_failed if metrics else None,
    )
    return Shared(Tokenizers(), model_map or ModelMap(), cache, summaries, UpstreamPool(s.server))


@dataclass
class Served:
    """A config wired to the shared objects: the runtime and the providers its routes use."""

    runtime: Runtime
    providers: Providers


def build_runtime(config: Config, shared: Shared, *, engine: bool = True) -> Served:
    """The runtime for ``config``; ``engine=False`` leaves it without a summariser (``assemble --offline``)."""
    providers = Providers(config, shared.pool)
    runtime = Runtime(config, tokenizers=shared.tokenizers, model_map=shared.model_map, summaries=shared.summaries)
    if engine:
        runtime.engine = UpstreamEngine(runtime.route, providers.for_route)
    return Served(runtime, providers)


@dataclass
class State:
    """Everything a handler needs; the runtime is swapped whole on reload."""

    served: Served
    shared: Shared
    metrics: Metrics
    config_path: str | None
    prefix: PrefixTracker = field(default_factory=PrefixTracker)
    draining: bool = False

    @property
    def runtime(self) -> Runtime:
        return self.served.runtime

    @property
    def config(self) -> Config:
        return self.served.runtime.config

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
        self.served = build_runtime(config, self.shared)
        self.metrics.set_labels(tenant_names(config), model_names(config))
        log.info("config reloaded from %s", self.config_path)
        return []


STATE = web.AppKey("state", State)


def tenant_names(config: Config) -> list[str]:
    return [t.name for t in config.tenants]


def model_names(config: Config) -> list[str]:
    return [m.name for m in config.settings.models]
