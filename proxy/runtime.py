"""What serves requests: a config plus the long-lived objects built from it.

The server, ``ctxproxy assemble`` and the explain endpoint all call
``Runtime.assemble``, so the CLI shows exactly what the server would forward, on
every wire. A runtime is built in one place (``proxy.serve.state.build_runtime``); a reload
builds a new Runtime that shares the long-lived parts (token counters, model map,
summary cache, calibration); requests in flight keep the Runtime they started on.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping
from typing import Any, Protocol

from plugins.base import Compactor, Engine, Services, SummaryStore
from proxy.core.conversation import WireAdapter
from proxy.core.errors import AuthenticationError, BadRequest, ModelNotFound, SummarizerFailed
from proxy.core.modelinfo import ModelMap
from proxy.core.tokens import Tokenizers
from proxy.pipeline import Assembly, assemble, observe
from proxy.policy import ModelRoute, Policy, Routes, policy_for
from proxy.settings import Config, Tenant

POLICY_MEMO = 4096


class Calibration(Protocol):
    """The provider-over-proxy token ratio per tenant and (upstream, model) (``proxy.store.calibration``).

    ``tenant`` is the tenant's name (``default`` without tenants): one tenant's traffic never widens
    another's budget. ``factor`` is on every request's path and must be a dict lookup; ``prime`` says what to
    await before the factor is known (the shared cache, only the first time a tenant's route is seen; None:
    nothing, and no coroutine is made on a request's path).
    """

    def factor(self, route: ModelRoute, tenant: str) -> float: ...

    def window(self, route: ModelRoute) -> int | None:
        """The provider's real window where its refusals showed it narrower than the route's (None: not)."""

    def prime(self, route: ModelRoute, tenant: str) -> Awaitable[object] | None: ...


def model_of(wire: WireAdapter, body: dict[str, Any], params: Mapping[str, str] | None = None) -> str:
    """The model a request names, where its wire keeps it; the one refusal of a request without one."""
    model = wire.model_of(body, params or {})
    if not isinstance(model, str) or not model:
        raise BadRequest(f"'{wire.model_param}' is required and must be a string", param=wire.model_param,
                         code="missing_model")
    return model


class Runtime:
    def __init__(
        self,
        config: Config,
        *,
        tokenizers: Tokenizers,
        model_map: ModelMap,
        summaries: SummaryStore | None = None,
        engine: Engine | None = None,
        calibration: Calibration | None = None,
        compaction: Compactor | None = None,
    ) -> None:
        self.config = config
        self.compaction = compaction  # the one compaction service, over ``summaries`` (proxy.store.compaction)
        self.tokenizers = tokenizers
        self.model_map = model_map
        self.summaries = summaries
        self.engine = engine
        self.calibration = calibration
        self.routes = Routes(config, model_map)
        self._policies: dict[tuple[str | None, str | None], Policy] = {}

    def authenticate(self, keys: str | tuple[str, ...] | None) -> Tenant | None:
        """The one tenant authentication: with tenants configured the first proxy key that names one, else 401."""
        if not self.config.tenants:
            return None
        candidates = (keys,) if isinstance(keys, str) else keys or ()
        for key in candidates:
            tenant = self.config.tenant_for_key(key) if key else None
            if tenant is not None:
                return tenant
        raise AuthenticationError(
            "Incorrect API key provided." if any(candidates) else "Missing API key: send Authorization: Bearer <key>."
        )

    def route(self, model: str) -> ModelRoute:
        return self.routes.resolve(model)

    def policy(self, tenant: Tenant | None, model: str | None, override: str | None) -> Policy:
        """The effective policy; without an override it is fixed for a config, so it is remembered.

        A policy is never changed once made (the pipeline copies what it reports), and its plugin
        instances hold only their params.
        """
        if override:
            return policy_for(self.config, tenant, model, override)
        key = (tenant.name if tenant is not None else None, model)
        policy = self._policies.get(key)
        if policy is None:
            policy = policy_for(self.config, tenant, model, None)
            if len(self._policies) < POLICY_MEMO:  # model names come from clients: a bounded number
                self._policies[key] = policy
        return policy

    def window_of(self, model: str) -> int:
        try:
            return self.window(self.routes.resolve(model))
        except ModelNotFound:
            return self.routes.fallback_window()

    def window(self, route: ModelRoute) -> int:
        """The route's window, narrowed to the provider's real one where its refusals showed it smaller."""
        learned = self.calibration.window(route) if self.calibration is not None else None
        return min(route.window, learned) if learned is not None else route.window

    def services(self, route: ModelRoute, policy: Policy, *, request_id: str = "", dry_run: bool = False,
                 window: int | None = None) -> Services:
        """``window``: the route's, as ``window(route)`` gives it, when the caller has it already."""
        s = self.config.settings
        return Services(
            engine=self.engine,
            summaries=self.summaries,
            compaction=self.compaction,
            tenant=policy.tenant,
            model=route.name,
            summarizer_model=policy.summarizer_model,
            summary_tokens=s.summarizer.max_summary_tokens,
            values_tokens=s.summarizer.max_values_tokens,
            summarizer_timeout=s.summarizer.timeout_seconds,
            summarizer_window=self.window(route) if window is None else window,
            window_of=self.window_of,
            summarizer_max_calls=s.summarizer.max_calls_per_summary,
            counter=self.tokenizers.get(route.encoding),
            request_id=request_id,
            dry_run=dry_run,
        )

    async def calibration_factor(self, route: ModelRoute, tenant: str) -> float:
        """The route's provider-over-proxy token ratio for ``tenant`` (1.0 without calibration)."""
        if self.calibration is None:
            return 1.0
        loading = self.calibration.prime(route, tenant)
        if loading is not None:
            await loading
        return self.calibration.factor(route, tenant)

    async def assemble(
        self,
        wire: WireAdapter,
        body: dict[str, Any],
        *,
        tenant: Tenant | None,
        override: str | None = None,
        offload: bool = False,
        request_id: str = "",
        dry_run: bool = False,
        params: Mapping[str, str] | None = None,
        mode: str | None = None,
    ) -> tuple[Assembly, ModelRoute, Policy]:
        """Policy, route and the whole pipeline for one body of ``wire`` (its synchronous steps in a worker
        thread with ``offload``: a large body); ``params``: the request path's (a model in the path).

        In the policy's mode, or in ``mode`` when given (explain's ``?mode=``): in observe mode the
        assembly forwards the client's body and reports what enforce would have done, never calling the
        summariser (``proxy.pipeline.observe``)."""
        model = model_of(wire, body, params)
        route = self.route(model)
        policy = self.policy(tenant, model, override)
        # (each awaited only when it must wait: a coroutine a request costs more than the lookup)
        counter = self.tokenizers.loaded(route.encoding)
        if counter is None:
            counter = await self.tokenizers.counter(route.encoding)
        calibration = 1.0  # (``calibration_factor``, inline)
        if self.calibration is not None:
            loading = self.calibration.prime(route, policy.tenant)
            if loading is not None:
                await loading
            calibration = self.calibration.factor(route, policy.tenant)
        provider_window = self.calibration.window(route) if self.calibration is not None else None
        window = min(route.window, provider_window) if provider_window is not None else route.window  # (``window``)
        if (mode or policy.mode) == "observe":
            assembly = await observe(
                body, wire=wire, route=route, policy=policy, counter=counter,
                services=self.services(route, policy, request_id=request_id, dry_run=True, window=window),
                offload=offload, calibration=calibration, provider_window=provider_window,
            )
            return assembly, route, policy
        assembly = await assemble(
            body, wire=wire, route=route, policy=policy, counter=counter,
            services=self.services(route, policy, request_id=request_id, dry_run=dry_run, window=window),
            offload=offload, calibration=calibration, provider_window=provider_window,
        )
        if assembly.report.summary == "failed" and policy.on_summarizer_error == "fail":
            raise SummarizerFailed("the summariser failed and this proxy is configured with on_summarizer_error: fail")
        return assembly, route, policy
