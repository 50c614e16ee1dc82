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
import os
import time
from dataclasses import dataclass, field
from typing import Any, TypedDict

from aiohttp import web

from proxy.core.errors import ConfigError
from proxy.core.modelinfo import ModelMap, PriceOverride
from proxy.core.tokens import Tokenizers
from proxy.runtime import Runtime
from proxy.serve.bodies import KnownBodies
from proxy.serve.ids import RequestIds
from proxy.serve.metrics import Metrics
from proxy.serve.workers import Status, Supervised
from proxy.settings import Config, load_config
from proxy.store.backends import cache_guard, open_cache, open_ledger_store
from proxy.store.background import BackgroundSummaries
from proxy.store.cache import Cache, SafeCache
from proxy.store.calibration import CalibrationStore, ConfiguredCalibration
from proxy.store.compaction import Compaction
from proxy.store.ledger import Ledger
from proxy.store.prefix import PrefixTracker
from proxy.store.promptcache import PromptCacheTracker
from proxy.store.refetch import RefetchTracker
from proxy.store.summaries import LOCK_TTL, SummaryService
from proxy.upstream.engine import UpstreamEngine
from proxy.upstream.http import UpstreamPool
from proxy.upstream.providers import Providers
from proxy.wire import WIRES, Wires

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
    background: BackgroundSummaries = field(
        default_factory=lambda: BackgroundSummaries(concurrency=0, queue=0, unused_after=3600.0))
    prompt_cache: PromptCacheTracker = field(default_factory=PromptCacheTracker)

    async def close(self, drain: float = 0.0) -> None:
        """Close everything; background summaries get ``drain`` seconds to finish (then they are abandoned)."""
        await self.background.close(drain)  # first: its summaries are counted and priced, and need the pool
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
        cache, **summary_settings(config),
        on_call=metrics.summary_call if metrics else None,
        on_failure=metrics.summary_failed if metrics else None,
    )
    background = BackgroundSummaries(**background_settings(config), observer=metrics)
    calibration = CalibrationStore(cache, on_factor=metrics.calibration_factor if metrics else None)
    ledger = Ledger(open_ledger_store(s.cache, create=True))
    if metrics is not None:
        metrics.ledger = ledger
    return Shared(Tokenizers(), model_map or ModelMap(), cache, summaries, UpstreamPool(s.server), calibration, ledger,
                  background)


@dataclass
class Served:
    """A config wired to the shared objects: the runtime and the providers its routes use."""

    runtime: Runtime
    providers: Providers


class SummarySettings(TypedDict):
    ttl: float | None
    local_entries: int
    lock_wait: float
    max_wait: float
    backoff_first: float
    backoff_max: float


class BackgroundSettings(TypedDict):
    concurrency: int
    queue: int
    unused_after: float


def background_settings(config: Config) -> BackgroundSettings:
    s = config.settings.summarizer
    return BackgroundSettings(concurrency=s.background_summaries, queue=s.background_queue,
                              unused_after=s.background_unused_seconds)


def summary_settings(config: Config) -> SummarySettings:
    s = config.settings
    return SummarySettings(
        ttl=s.cache.ttl_seconds,
        local_entries=s.cache.local_summaries,
        lock_wait=s.summarizer.lock_wait_seconds,
        max_wait=s.summarizer.timeout_seconds * s.summarizer.max_calls_per_summary + LOCK_TTL,
        backoff_first=s.summarizer.retry_backoff_seconds,
        backoff_max=s.summarizer.max_backoff_seconds,
    )


# Settings read once, when the process starts: a reload that changes one names it, and it keeps its value.
RESTART_ONLY = (
    "server.host", "server.port", "server.workers",  # the listening socket and the worker processes
    "server.metrics_host", "server.metrics_port",  # the keyless metrics listener
    "server.header_timeout", "server.drain_timeout",  # given to aiohttp's runner when it is built
    "cache.backend", "cache.path", "cache.url", "cache.size_limit_mb",  # the open cache holds summaries, locks, ledger
    "cache.timeout_seconds", "cache.breaker_timeouts", "cache.breaker_cooldown_seconds",  # the backend's breaker
    "logging.queue_lines",  # the log's queue is made when the server starts
)


def restart_required(running: Config, new: Config) -> list[str]:
    """The restart-only settings whose value differs between the config the process started with and ``new``."""
    def value(config: Config, path: str) -> Any:
        node: Any = config.settings
        for part in path.split("."):
            node = getattr(node, part)
        return node

    return [path for path in RESTART_ONLY if value(running, path) != value(new, path)]


def build_runtime(config: Config, shared: Shared, *, engine: bool = True) -> Served:
    """The runtime for ``config``; ``engine=False`` leaves it without a summariser (``assemble --offline``).

    The shared objects take the config's live settings here (upstream timeouts and pool sizes, the summary
    cache's TTL, the summariser's back-off and lock waits), so a reload applies them.
    """
    shared.pool.configure(config.settings.server)
    shared.summaries.configure(**summary_settings(config))
    shared.background.configure(**background_settings(config))
    providers = Providers(config, shared.pool)
    shared.model_map.set_price_overrides(price_overrides(config))
    runtime = Runtime(config, tokenizers=shared.tokenizers, model_map=shared.model_map, summaries=shared.summaries,
                      calibration=ConfiguredCalibration(shared.calibration, config),
                      compaction=Compaction(shared.summaries, shared.background))
    if engine:
        runtime.engine = UpstreamEngine(runtime.route, providers.for_route)
    return Served(runtime, providers)


@dataclass
class Reloaded:
    """What a reload did: the problems that rejected it (the running config kept), or the settings that
    changed but keep their running value until a restart."""

    problems: list[str] = field(default_factory=list)
    restart_required: list[str] = field(default_factory=list)


@dataclass
class State:
    """Everything a handler needs; the runtime is swapped whole on reload."""

    served: Served
    shared: Shared
    metrics: Metrics
    config_path: str | None
    prefix: PrefixTracker = field(default_factory=PrefixTracker)
    refetch: RefetchTracker = field(default_factory=RefetchTracker)  # re-fetches of removed outputs, per conversation
    bodies: KnownBodies = field(default_factory=KnownBodies)  # bodies read from where they differ
    ids: RequestIds = field(default_factory=RequestIds)  # ids of requests that came without one
    draining: bool = False
    drain_timeout: float = 0.0  # how long shutdown waits for in-flight work (the runner's, ``make_runner``)
    drain_started: float | None = None  # when shutdown began (time.monotonic)
    supervised: Supervised | None = None  # a worker of ``serve --workers N``
    wires: Wires = field(default_factory=lambda: WIRES)  # the wires this app speaks (``create_app(wires=...)``)
    started_with: Config = field(init=False)  # the config the process was built with

    def __post_init__(self) -> None:
        self.started_with = self.served.runtime.config

    @property
    def runtime(self) -> Runtime:
        return self.served.runtime

    @property
    def config(self) -> Config:
        return self.served.runtime.config

    def announce(self) -> None:
        """A worker tells its supervisor (and the others) it is serving, with the config it started with."""
        if self.supervised is not None:
            self.supervised.write(Status(os.getpid(), self.started_with.read_at))

    def reload(self) -> Reloaded:
        """Re-read the config file; on any problem keep the running config and return the problems."""
        if self.config_path is None:
            return Reloaded(["no config file to reload (the app was built from an in-memory config)"])
        asked = time.monotonic()
        done = self._reload(self.config_path)
        if self.supervised is not None:
            self.supervised.write(Status(os.getpid(), asked, done.problems, done.restart_required))
        return done

    def _reload(self, path: str) -> Reloaded:
        try:
            config = load_config(path)
        except ConfigError as exc:
            for problem in exc.problems:
                log.error("reload rejected, keeping the running config: %s", problem)
            return Reloaded(exc.problems)
        level = config.settings.logging.level
        if level != self.config.settings.logging.level:
            logging.getLogger().setLevel(level)
        self.served = build_runtime(config, self.shared)
        self.metrics.set_labels(tenant_names(config), model_names(config), upstream_names(config))
        pending = restart_required(self.started_with, config)
        log.info("config reloaded from %s", path)
        if pending:
            log.warning("these settings changed but keep their running values until a restart: %s",
                        ", ".join(pending))
        return Reloaded(restart_required=pending)


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
