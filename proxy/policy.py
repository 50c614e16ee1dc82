"""Per-request policy: tenant, model route, and the context manager after any override.

Precedence: the tenant's policy, then the request's override (header
``x-ctxproxy-context-manager``), then the org default. With tenants configured
an override may only tighten (same or smaller limits); a malformed or loosening
override is ignored and a warning says why.

The mode (``observe`` or ``enforce``, ``mode_for``) is the operator's alone (no request changes it):
the tenant's own ``mode``, else the model route's (``models[].mode``), else the top level's.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

import orjson
from pydantic import ValidationError

from plugins.base import ContextManager
from plugins.registry import Binding
from proxy.core.budget import DEFAULT_WINDOW, Budget, TrimmerParams
from proxy.core.errors import BindingError, ModelNotFound, OverrideRejected
from proxy.core.modelinfo import ModelMap
from proxy.core.tokens import encoding_for
from proxy.settings import Config, Tenant

log = logging.getLogger("ctxproxy")

# Params an override may change, and only downwards.
TIGHTENING = ("keep_turns", "max_messages", "working_memory_messages", "summary_threshold", "keep_recent")
# Carried over from the policy on a type change (so a switch keeps the policy's window and masking grids);
# the window they give together (at most keep_turns + cut_step - 1 turns) may only narrow.
CARRIED = (*TIGHTENING, "cut_step", "mask_step")
# Changing the manager type is allowed only to one that keeps no more than the base: a window keeps
# fewer turns; masking keeps B and T (the base's trimmer and threshold always hold) and forgets only outputs.
TYPE_CHANGES = {("summarising", "sliding-window"), ("summarising", "observation-masking")}
WARNED_MODELS = 1000  # unknown model names warned about once each, at most
ROUTE_MEMO = 4096  # model names whose route is remembered (they come from clients)


@dataclass(frozen=True)
class ModelRoute:
    """Where a model name goes, and its limits."""

    name: str
    upstream: str
    upstream_model: str
    provider: str
    window: int
    max_output: int | None
    encoding: str


@dataclass
class Policy:
    """The effective policy of one request."""

    tenant: str
    binding: Binding
    manager: ContextManager
    trimmer: TrimmerParams
    pairing: str
    max_context_tokens: int | None
    max_output_tokens: int | None
    max_output_policy: str
    allowed_models: list[str] | None
    summarizer_model: str | None
    on_summarizer_error: str
    mode: str = "enforce"  # observe: forward as sent, report what enforce would do (proxy.pipeline.observe)
    budget_cap: int | None = None
    # with an override in effect: the base binding's (summary_threshold, hysteresis_ratio), so the
    # effective summary threshold never rises above the one the policy gives
    base_threshold: tuple[int, float] | None = None
    warnings: list[str] = field(default_factory=list)
    # the budgets computed for this policy (``proxy.pipeline``), by route window and output cap, request cap,
    # calibration and provider window
    budgets: dict[tuple[Any, ...], Budget] = field(default_factory=dict, init=False, repr=False, compare=False)

    def describe(self) -> dict[str, Any]:
        """What GET /v1/ctxproxy/policy shows (never keys)."""
        return {
            "tenant": self.tenant,
            "mode": self.mode,
            "context_manager": {
                "type": self.binding.type,
                "params": self.binding.params.model_dump(mode="json", exclude_none=True, exclude={"summarizer"}),
                **({"summarizer": self.binding.summarizer.type} if self.binding.summarizer else {}),
            },
            "trimmer": self.trimmer.model_dump(mode="json", exclude_none=True),
            "pairing": self.pairing,
            "max_context_tokens": self.max_context_tokens,
            "max_output_tokens": self.max_output_tokens,
            "max_output_policy": self.max_output_policy,
            "models": self.allowed_models,
            "summarizer_model": self.summarizer_model,
            "on_summarizer_error": self.on_summarizer_error,
        }


class Routes:
    """Resolves model names to routes (the app owns one per config)."""

    def __init__(self, config: Config, model_map: ModelMap) -> None:
        self.config = config
        self.model_map = model_map
        self._warned: set[str] = set()
        self._memo: dict[str, ModelRoute] = {}

    def resolve(self, name: str) -> ModelRoute:
        """The route of a model name (remembered: routes are fixed for a config; client names, bounded)."""
        route = self._memo.get(name)
        if route is None:
            route = self._resolve(name)
            if len(self._memo) < ROUTE_MEMO:
                self._memo[name] = route
        return route

    def _resolve(self, name: str) -> ModelRoute:
        cfg = self.config
        m = cfg.model(name)
        if m is None and not cfg.settings.allow_unknown_models:
            raise ModelNotFound(f"The model {name!r} does not exist or you do not have access to it.", param="model")
        upstream_model = m.upstream_model if m else name
        info = self.model_map.get(upstream_model) or self.model_map.get(name)
        window = m.context_window if m and m.context_window else None
        if window is None and info is not None:
            window = info.max_input_tokens
        if window is None:
            window = DEFAULT_WINDOW
            # model names come from clients: remember (and log) a bounded number of them, each cut short
            if name not in self._warned and len(self._warned) < WARNED_MODELS:
                self._warned.add(name)
                log.warning("model %r has no known context window; assuming %d tokens", name[:100], DEFAULT_WINDOW)
        max_output = m.max_output_tokens if m and m.max_output_tokens else (info.max_output_tokens if info else None)
        return ModelRoute(
            name=name,
            upstream=(m.upstream if m and m.upstream else cfg.upstream_for(upstream_model)),
            upstream_model=upstream_model,
            provider=m.provider if m else "openai",
            window=window,
            max_output=max_output,
            encoding=encoding_for(upstream_model, m.tokenizer if m else None),
        )

    def fallback_window(self) -> int:
        return DEFAULT_WINDOW


def mode_for(config: Config, tenant: Tenant | None, model: str | None) -> str:
    """``observe`` or ``enforce``: the tenant's own mode, else the model route's, else the top level's.

    A tenant's is the most specific: a team put in observe (or switched to enforce) stays so on every
    model, and a route's mode (say, a new model still observed) applies to the tenants that set none.
    """
    if tenant is not None and tenant.settings.mode is not None:
        return tenant.settings.mode
    route = config.model(model) if model is not None else None
    if route is not None and route.mode is not None:
        return route.mode
    return config.settings.mode


def policy_for(config: Config, tenant: Tenant | None, model: str | None, override: str | None) -> Policy:
    """The effective policy for one request (raises ModelNotFound for a model the tenant may not use)."""
    s = config.settings
    ts = tenant.settings if tenant else None
    if ts is not None and ts.models is not None and model is not None and model not in ts.models:
        raise ModelNotFound(f"The model {model!r} does not exist or you do not have access to it.", param="model")
    base = tenant.context_manager if tenant and tenant.context_manager else config.context_manager
    binding, budget_cap, warnings = base, None, []
    base_threshold: tuple[int, float] | None = None
    if override:
        try:
            binding, budget_cap = _override(config, base, override, strict=bool(config.tenants))
        except OverrideRejected as exc:
            warnings.append(f"x-ctxproxy-context-manager ignored: {exc}")
        else:
            params = base.params.model_dump() if config.tenants else {}
            if params:
                base_threshold = (int(params.get("summary_threshold") or 0),
                                  float(params.get("hysteresis_ratio", 0.1)))
    manager: ContextManager = binding.create()
    # an override never loosens the trimmer: the budget comes from the base binding's (capped by budget_cap)
    base_trimmer: TrimmerParams | None = getattr(base.params, "trimmer", None)
    trimmer = (base_trimmer or TrimmerParams()).merged_over(s.trimmer)
    return Policy(
        tenant=tenant.name if tenant else "default",
        binding=binding,
        manager=manager,
        trimmer=trimmer,
        pairing=(ts.pairing if ts and ts.pairing else s.pairing),
        max_context_tokens=ts.max_context_tokens if ts else None,
        max_output_tokens=ts.max_output_tokens if ts else None,
        max_output_policy=ts.max_output_policy if ts else "clamp",
        allowed_models=ts.models if ts else None,
        summarizer_model=(ts.summarizer_model if ts and ts.summarizer_model else s.summarizer_model),
        on_summarizer_error=s.on_summarizer_error,
        mode=mode_for(config, tenant, model),
        budget_cap=budget_cap,
        base_threshold=base_threshold,
        warnings=warnings,
    )


def _override(config: Config, base: Binding, header: str, strict: bool) -> tuple[Binding, int | None]:
    """The binding a request asked for, and a cap on B from its ``trimmer.max_tokens``."""
    value: Any = header.strip()
    if value.startswith("{"):
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError:
            raise OverrideRejected("not valid JSON") from None
    if _names_a_ref(value):
        raise OverrideRejected("ref plugins cannot be chosen per request")
    try:
        chosen = config.registry.resolve("context_manager", value, "x-ctxproxy-context-manager")
    except BindingError as exc:
        raise OverrideRejected(str(exc)) from None
    trimmer = chosen.params.model_dump(exclude_unset=True).get("trimmer") or {}
    cap = trimmer.get("max_tokens")
    chosen = _inherit(base, chosen, value)
    if strict:
        problem = _loosens(base, chosen)
        if problem:
            raise OverrideRejected(f"it would loosen the policy ({problem})")
    return chosen, cap


def _widest_window(params: dict[str, Any]) -> int | None:
    """The most turns a turn window keeps verbatim (``plugins.base.window``: keep .. keep + step - 1)."""
    keep = params.get("keep_turns")
    if not isinstance(keep, int):
        return None
    step = params.get("cut_step")
    if not isinstance(step, int) or step < 1:
        step = max(1, -(-max(keep, 1) // 2))  # the default: ceil(keep_turns / 2)
    return keep + step - 1


def _names_a_ref(value: Any, depth: int = 0) -> bool:
    """Whether a ``ref`` key appears anywhere in an override (a nested summariser binding included):
    resolving it would import a module a client named."""
    if depth > 32:
        return True
    if isinstance(value, dict):
        return "ref" in value or any(_names_a_ref(v, depth + 1) for v in value.values())
    if isinstance(value, list):
        return any(_names_a_ref(v, depth + 1) for v in value)
    return False


def _inherit(base: Binding, chosen: Binding, value: Any) -> Binding:
    """The override's params over the base's: what the request does not set stays as the policy has it.

    Without this an override that sets one param (``keep_turns``, ``trimmer.max_tokens``) would
    silently reset every other one to the plugin's default (e.g. keep_turns 10 over a tenant's 6, or
    the ``llm`` summariser over a tenant's ``drop``). On a type change only the shared limits
    (``TIGHTENING``) carry over. The base's trimmer never does: the policy keeps the base's trimmer
    and takes only ``trimmer.max_tokens`` from the override.
    """
    raw = value.get("params") if isinstance(value, dict) else None
    fields = chosen.plugin.Params.model_fields
    inherited = {
        k: v for k, v in base.params.model_dump().items()
        if k in fields and k not in ("trimmer", "summarizer") and (chosen.type == base.type or k in CARRIED)
    }
    try:
        params = chosen.plugin.Params.model_validate({**inherited, **chosen.params.model_dump(exclude_unset=True)})
    except ValidationError as exc:
        raise OverrideRejected(f"it does not combine with the policy's params ({exc.errors()[0]['msg']})") from None
    summarizer = chosen.summarizer
    if summarizer is not None and base.summarizer is not None and not (isinstance(raw, dict) and "summarizer" in raw):
        summarizer = base.summarizer
    return dataclasses.replace(chosen, params=params, summarizer=summarizer)


def _loosens(base: Binding, chosen: Binding) -> str | None:
    """Why ``chosen`` keeps more than ``base`` allows, or None when it only tightens."""
    if chosen.type != base.type and (base.type, chosen.type) not in TYPE_CHANGES:
        return f"{base.type} cannot become {chosen.type}"
    old = base.params.model_dump()
    new = chosen.params.model_dump()
    for key, value in chosen.params.model_dump(exclude_unset=True).items():
        if key == "trimmer":
            if set(value or {}) - {"max_tokens"}:
                return "only trimmer.max_tokens may be set per request"
        elif key == "summary_threshold":
            # 0 (or none) means the derived threshold, which is looser than any explicit one
            if old.get(key) and (not value or value > old[key]):
                return f"summary_threshold {value} is looser than {old[key]}"
        elif key in TIGHTENING:
            if old.get(key) is not None and (value is None or value > old[key]):
                return f"{key} {value} > {old[key]}"
        elif key == "mask_observations":
            if old.get(key) and not value:
                return "mask_observations cannot be turned off per request"
        elif chosen.type == base.type and value != old.get(key):
            return f"{key} cannot be changed per request"
    if chosen.type != base.type and old.get("keep_turns") is not None and new.get("keep_turns") is not None \
            and new["keep_turns"] > old["keep_turns"]:
        return f"keep_turns {new['keep_turns']} > {old['keep_turns']}"
    if chosen.type != base.type:
        # the window moves cut_step turns at a time, so it keeps up to keep_turns + cut_step - 1 turns: a
        # larger cut_step keeps more (a huge one never cuts at all)
        widest, allowed = _widest_window(new), _widest_window(old)
        if widest is not None and allowed is not None and widest > allowed:
            return (f"keep_turns {new['keep_turns']} with cut_step {new.get('cut_step')} keeps up to {widest} turns, "
                    f"more than the policy's {allowed}")
    if old.get("summary_threshold") and not new.get("summary_threshold"):
        # compared on effective values: without an explicit threshold the derived one applies, which is looser
        return f"summary_threshold would become the derived one, looser than {old['summary_threshold']}"
    # switching to drop only tightens; another summariser model or prompt does not
    if (base.summarizer is not None and chosen.summarizer is not None and chosen.summarizer != base.summarizer
            and chosen.summarizer.type != "drop"):
        return "the summariser cannot be changed per request"
    return None

