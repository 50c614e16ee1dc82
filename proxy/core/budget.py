"""The token budget of one request (docs/design.md#4-the-budget)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_WINDOW = 128_000
DEFAULT_RESERVE = 4_096
# With no max_tokens in the request, the completion reserve is the model's max output, but never more than
# this share of the window: many models list a max output equal to their window, which left no input budget.
RESERVE_WINDOW_SHARE = 0.25


class TrimmerParams(BaseModel):
    """How the hard budget is derived (``trimmer:`` at top level or inside a context manager's params)."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int | None = Field(
        None, ge=1, description="Explicit input ceiling (alias token_budget); capped by the tenant's cap."
    )
    reserve_tokens: int | None = Field(
        None, ge=0, description="Completion reserve; default: the request's max_(completion_)tokens, "
        "else the model's max output tokens capped at a quarter of the window."
    )
    safety_margin_ratio: float = Field(
        0.1, description="Fraction of the window held back for estimate error (clamped to [0, 0.5])."
    )

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: object) -> object:
        if isinstance(data, dict) and "token_budget" in data:
            data = dict(data)
            budget = data.pop("token_budget")
            data.setdefault("max_tokens", budget)
        return data

    def merged_over(self, base: TrimmerParams | None) -> TrimmerParams:
        """These params, with fields left unset taken from ``base``."""
        if base is None:
            return self
        values = base.model_dump()
        values.update(self.model_dump(exclude_unset=True))
        return TrimmerParams(**values)


@dataclass(frozen=True)
class Budget:
    """window, reserve and margin give the hard budget B; T is the summary threshold."""

    window: int
    reserve: int
    margin: int
    hard_budget: int
    threshold: int
    hysteresis_ratio: float
    # what set B: window (window - reserve - margin), provider (the same, on the provider's real window, learned
    # from its refusal for length: ``window`` is then that one), budget (trimmer.max_tokens), cap (tenant)
    limited_by: str = "window"

    @property
    def step(self) -> int:
        """Tokens of growth absorbed between two compactions: the grid of prefix-stable cuts."""
        return max(1, math.ceil(self.hysteresis_ratio * self.hard_budget))


def compute_budget(
    *,
    window: int,
    request_max_tokens: int | None,
    model_max_output: int | None,
    trimmer: TrimmerParams,
    tenant_cap: int | None,
    hysteresis_ratio: float = 0.1,
    summary_threshold: int = 0,
    calibration: float = 1.0,
    provider_window: int | None = None,
) -> Budget:
    """B and T in the proxy's own token count.

    ``calibration`` is the provider's count over the proxy's for this model (``proxy.store.calibration``):
    B holds in the provider's count, so in the proxy's own count it is B / calibration. ``provider_window``
    is the provider's real window where it refused a larger payload (``proxy.store.windows``): it replaces a
    larger configured window, and caps an explicit ``trimmer.max_tokens`` too (the provider has the last word).
    """
    narrowed = provider_window is not None and 0 < provider_window < window
    if narrowed and provider_window is not None:
        window = provider_window
    if trimmer.reserve_tokens is not None:
        reserve = trimmer.reserve_tokens
    elif request_max_tokens is not None:
        reserve = request_max_tokens
    else:
        reserve = default_reserve(window, model_max_output)
    ratio = min(0.5, max(0.0, trimmer.safety_margin_ratio))
    margin = math.ceil(ratio * window)
    derived = window - reserve - margin
    hard, limited_by = derived, "provider" if narrowed else "window"
    if trimmer.max_tokens is not None and not (narrowed and derived < trimmer.max_tokens):
        hard, limited_by = trimmer.max_tokens, "budget"
    if tenant_cap is not None and tenant_cap < hard:
        hard, limited_by = tenant_cap, "cap"
    if calibration > 0 and calibration != 1.0:
        hard = int(hard / calibration)
    hard = max(0, hard)
    ratio_h = max(0.0, hysteresis_ratio)
    threshold = summary_threshold if summary_threshold > 0 else int(hard / (1 + ratio_h))
    return Budget(window, reserve, margin, hard, min(threshold, hard), ratio_h, limited_by)


def default_reserve(window: int, model_max_output: int | None) -> int:
    """The completion reserve of a request that sets no output limit: the model's max output, at most a
    quarter of the window."""
    reserve = model_max_output if model_max_output is not None else DEFAULT_RESERVE
    return min(reserve, int(window * RESERVE_WINDOW_SHARE))


def why(budget: Budget) -> str:
    """The real cause of the hard budget, in words, for a refusal message."""
    if budget.limited_by == "budget":
        return "the configured token budget (trimmer.max_tokens)"
    if budget.limited_by == "cap":
        return "this key's context cap (max_context_tokens)"
    window = f"the provider's window {budget.window}" if budget.limited_by == "provider" else f"window {budget.window}"
    text = (f"{window} - completion reserve {budget.reserve} - safety margin {budget.margin}")
    if budget.window - budget.reserve - budget.margin <= 0:
        text += ": the completion reserve (the request's max_tokens, or the model's max output) leaves no room " \
                "for input; lower max_tokens"
    return text
