"""The application's state, typed, and the one way to build a runtime from a config.

``build_shared`` opens the objects that outlive a reload (token counters, model map,
summary cache and its breaker, summaries, calibration, the prompt-cache tracker, the cost ledger
and its store);
``build_runtime`` wires a config to them (routes, providers, the summariser's engine,
the config's calibration modes and prices). The server, ``ctxproxy assemble`` and
explain all go through these two functions.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from aiohttp import web

from proxy.core.errors import ConfigError
from proxy.core.modelinfo import ModelMap, PriceOverride
from proxy.core.tokens import Tokenizers
from proxy.runtime import Runtime
from proxy.serve.metrics import Metrics
from proxy.settings import Config, load_config
from proxy.store.backends import cache_guard, open_cache, open_ledger_store
from proxy.store.cache import Cache, SafeCache
from proxy.store.calibration import CalibrationStore, ConfiguredCalibration
from proxy.store.ledger import Ledger
from proxy.store.prefix import PrefixTracker
from proxy.store.promptcache import PromptCacheTracker
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
    calibration: CalibrationStore
    ledger: Ledger
    prompt_cache: PromptCacheTracker = field(default_factory=PromptCacheTracker)

    async def close(self) -> None:
        await self.summaries.close()
        await self.calibration.close()
        await self.ledger.close()
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
            guard=cache_guard(s.cache, on_open=metrics.cache_breaker_opened if metrics else None),
        )
    summaries = SummaryService(
        cache,
        ttl=s.cache.ttl_seconds,
        local_entries=s.cache.local_summaries,
        lock_wait=s.summarizer.lock_wait_seconds,
        max_wait=s.summarizer.timeout_seconds * s.summarizer.max_calls_per_summary + LOCK_TTL,
        backoff_first=s.summarizer.retry_backoff_seconds,
        backoff_max=s.summarizer.max_backoff_seconds,
        on_call=metrics.summary_call if metrics else None,
        on_failure=metrics.summary_failed if metrics else None,
    )
    calibration = CalibrationStore(cache, on_factor=metrics.calibration_factor if metrics else None)
    ledger = Ledger(open_ledger_store(s.cache, create=True))
    if metrics is not None:
        metrics.ledger = ledger
    return Shared(Tokenizers(), model_map or ModelMap(), cache, summaries, UpstreamPool(s.server), calibration, ledger)


@dataclass
class Served:
    """A config wired to the shared objects: the runtime and the providers its routes use."""

    runtime: Runtime
    providers: Providers


def build_runtime(config: Config, shared: Shared, *, engine: bool = True) -> Served:
    """The runtime for ``config``; ``engine=False`` leaves it without a summariser (``assemble --offline``)."""
    providers = Providers(config, shared.pool)
    shared.model_map.set_price_overrides(price_overrides(config))
    runtime = Runtime(config, tokenizers=shared.tokenizers, model_map=shared.model_map, summaries=shared.summaries,
                      calibration=ConfiguredCalibration(shared.calibration, config))
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
        self.metrics.set_labels(tenant_names(config), model_names(config), upstream_names(config))
        log.info("config reloaded from %s", self.config_path)
        return []


STATE = web.AppKey("state", State)


def tenant_names(config: Config) -> list[str]:
    return [t.name for t in config.tenants]


def model_names(config: Config) -> list[str]:
    """Configured model names, and the upstream models they route to (calibration and prices are per upstream model)."""
    names = [m.name for m in config.settings.models]
    return names + [m.upstream_model for m in config.settings.models if m.upstream_model not in names]


def upstream_names(config: Config) -> list[str]:
    return list(config.settings.upstreams)


def price_overrides(config: Config) -> dict[str, PriceOverride]:
    """The config's own prices, by the upstream model they price (``models[].input_cost_per_token`` ...)."""
    out: dict[str, PriceOverride] = {}
    for m in config.settings.models:
        if any(p is not None for p in m.prices()):
            out[m.upstream_model] = PriceOverride(*m.prices())
    return out
