"""What serves requests: a config plus the long-lived objects built from it.

The server, ``ctxproxy assemble`` and the explain endpoint all call
``Runtime.assemble``, so the CLI shows exactly what the server would forward.
A reload builds a new Runtime that shares the shared parts (token counters,
model map, summary cache); requests in flight keep the Runtime they started on.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Protocol

from plugins.base import Completion, Engine, Services
from proxy.cache import Cache, open_cache
from proxy.errors import BadRequest, ModelNotFound, SummarizerFailed
from proxy.modelinfo import ModelMap
from proxy.pipeline import Assembly, Prepared, assemble, prepare
from proxy.policy import ModelRoute, Policy, Routes, policy_for
from proxy.settings import Config, Tenant
from proxy.summaries import SummaryService
from proxy.tokens import Tokenizers

log = logging.getLogger("ctxproxy")


class Observer(Protocol):
    """Receives what metrics need from below the request handler."""

    def summary_call(self, tenant: str, completion: Completion) -> None: ...

    def cache_error(self, operation: str, exc: BaseException) -> None: ...


@dataclass
class Shared:
    """Objects that outlive a config reload."""

    tokenizers: Tokenizers
    model_map: ModelMap
    cache: Cache
    summaries: SummaryService


def open_shared(
    config: Config,
    observer: Observer | None = None,
    cache: Cache | None = None,
    model_map: ModelMap | None = None,
) -> Shared:
    s = config.settings
    if cache is None:
        cache = open_cache(
            s.cache.backend,
            path=s.cache.path,
            url=s.cache.url,
            ttl=s.cache.ttl_seconds,
            size_limit_mb=s.cache.size_limit_mb,
            on_error=observer.cache_error if observer else None,
        )
    summaries = SummaryService(
        cache,
        ttl=s.cache.ttl_seconds,
        lock_wait=s.summarizer.lock_wait_seconds,
        lock_ttl=s.summarizer.timeout_seconds * 4 + 30,
        backoff_first=s.summarizer.retry_backoff_seconds,
        backoff_max=s.summarizer.max_backoff_seconds,
        on_call=observer.summary_call if observer else None,
    )
    return Shared(Tokenizers(), model_map or ModelMap(), cache, summaries)


class Runtime:
    def __init__(self, config: Config, shared: Shared, engine: Engine | None = None) -> None:
        self.config = config
        self.shared = shared
        self.routes = Routes(config, shared.model_map)
        self.engine = engine

    def authenticate(self, key: str | None) -> Tenant | None:
        return self.config.tenant_for_key(key) if key else None

    def route(self, model: str) -> ModelRoute:
        return self.routes.resolve(model)

    def policy(self, tenant: Tenant | None, model: str | None, override: str | None) -> Policy:
        return policy_for(self.config, tenant, model, override)

    def services(self, route: ModelRoute, policy: Policy) -> Services:
        s = self.config.settings
        summarizer_model = policy.summarizer_model or route.name
        try:
            window = self.routes.resolve(summarizer_model).window
        except ModelNotFound:
            window = route.window
        return Services(
            engine=self.engine,
            summaries=self.shared.summaries,
            tenant=policy.tenant,
            model=route.name,
            summarizer_model=policy.summarizer_model,
            summary_tokens=s.summarizer.max_summary_tokens,
            summarizer_timeout=s.summarizer.timeout_seconds,
            summarizer_window=window,
            summarizer_max_calls=s.summarizer.max_calls_per_summary,
            counter=self.shared.tokenizers.get(route.encoding),
        )

    async def assemble(
        self,
        body: dict[str, Any],
        *,
        tenant: Tenant | None,
        override: str | None = None,
        offload: bool = False,
    ) -> tuple[Assembly, ModelRoute, Policy]:
        """Policy, route and the whole pipeline for one chat-completions body."""
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise BadRequest("'model' is required and must be a string", param="model", code="missing_model")
        route = self.route(model)
        policy = self.policy(tenant, model, override)
        counter = self.shared.tokenizers.get(route.encoding)
        prepared: Prepared | None = None
        if offload:
            prepared = await asyncio.get_running_loop().run_in_executor(None, prepare, body, counter)
        assembly = await assemble(
            body, route=route, policy=policy, counter=counter, services=self.services(route, policy),
            prepared=prepared,
        )
        if assembly.report.summary == "failed" and policy.on_summarizer_error == "fail":
            raise SummarizerFailed("the summariser failed and this proxy is configured with on_summarizer_error: fail")
        return assembly, route, policy
