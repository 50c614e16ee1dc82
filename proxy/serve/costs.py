"""What context management saved on one request, net of what it cost (the summariser's
calls, the prompt cache it broke), and the after-answer step.

Per request, priced on the upstream model its route names (``ModelMap.prices``: the config's prices,
else litellm's map):

- **gross** = tokens removed, as the provider counts them (ctxproxy's count × the calibration factor the
  request's budget used), × the input price;
- **summariser** = the summariser call(s) this request made (input and output, at the summariser
  model's prices); a summary reused later costs nothing more;
- **prompt-cache effect** (``proxy.store.promptcache``), measured from the provider's cached tokens:
  ``break`` = (tokens the previous request read from the cache that this one, after a compaction,
  did not) × (input - cache-read price) + cache writes above the previous request's × (write - input
  price); ``removed`` = (removed tokens the provider would have read from its cache) × (input -
  cache-read price);
- **net** = gross - summariser - prompt-cache effect. None when a price is unknown (never priced at 0).

``proxy.serve.feedback.settle`` computes them after each answer; explain computes them for one request
without an answer (the prompt-cache effect is then unknown).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from proxy.core.modelinfo import ModelMap, Prices
from proxy.store.promptcache import NO_EFFECT, CacheEffect

if TYPE_CHECKING:
    from proxy.pipeline import Report


@dataclass
class RequestCost:
    """One request's figures in USD (None: not priced, or not measurable)."""

    priced_model: str
    removed_tokens: int = 0  # as the provider counts them
    gross_usd: float | None = None
    summarizer_usd: float | None = 0.0
    cache_break_usd: float | None = 0.0
    cache_removed_usd: float | None = 0.0
    net_usd: float | None = None
    measured: bool = False  # the prompt-cache effect was measured (the conversation's previous answer is known)
    cache: CacheEffect = NO_EFFECT
    unpriced: list[str] = field(default_factory=list)  # models whose price is unknown

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["cache"] = asdict(self.cache)
        return out


def removed_tokens(report: Report) -> int:
    """Tokens removed from one request, as the provider counts them."""
    if not report.removed:
        return 0
    removed = sum(n for n in report.removed.values() if n > 0)
    factor = report.calibration if 0 < report.calibration < 100 else 1.0
    return round(removed * factor)


def summarizer_call(report: Report) -> tuple[str, int, int] | None:
    """(priced model, prompt tokens, completion tokens) of the summary this request made, if it made one."""
    if report.summary != "created":
        return None
    made = report.summary_detail.get("summarizer")
    if not isinstance(made, Mapping):
        return None
    model, prompt, completion = made.get("priced_model"), made.get("prompt_tokens"), made.get("completion_tokens")
    if not isinstance(model, str) or not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    return model, max(0, prompt), max(0, completion)


def request_cost(report: Report, upstream_model: str, model_map: ModelMap,
                 effect: CacheEffect | None = None) -> RequestCost:
    """The figures of one request; ``effect`` is None when nothing could be measured (explain, no answer)."""
    cost = RequestCost(upstream_model, removed_tokens(report), measured=effect is not None and effect.tracked,
                       cache=effect or NO_EFFECT)
    prices = model_map.prices(upstream_model)
    if prices is None:
        cost.unpriced.append(upstream_model)
    else:
        cost.gross_usd = cost.removed_tokens * prices.input
    call = summarizer_call(report)
    if call is not None:
        model, prompt, completion = call
        cost.summarizer_usd = model_map.cost(model, prompt, completion)
        if cost.summarizer_usd is None:
            cost.unpriced.append(model)
    if effect is None:
        cost.cache_break_usd = cost.cache_removed_usd = None
    elif prices is not None:
        cost.cache_break_usd, cost.cache_removed_usd = cache_effect_usd(effect, prices)
    else:
        cost.cache_break_usd = cost.cache_removed_usd = None
    if cost.gross_usd is not None and cost.summarizer_usd is not None:
        cost.net_usd = cost.gross_usd - cost.summarizer_usd - (cost.cache_break_usd or 0.0) \
            - (cost.cache_removed_usd or 0.0)
    return cost


def cache_effect_usd(effect: CacheEffect, prices: Prices) -> tuple[float, float]:
    """(break, removed) in USD: cache reads lost are paid at the input price instead of the read price."""
    discount = max(0.0, prices.input - prices.cache_read)
    premium = max(0.0, prices.cache_write - prices.input)
    return effect.lost_reads * discount + effect.extra_writes * premium, effect.removed_reads * discount
