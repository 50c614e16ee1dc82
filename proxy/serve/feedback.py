"""After each answer: learn from the provider's usage, and count what context management saved and cost.

``settle`` runs in the managed handler's ``finally`` for every request the pipeline assembled (no
await: nothing here can delay or fail the answer). It takes the provider's usage
(normalised in the form its wire says, ``proxy.core.usage``), gives the calibration store the tenant's sample
(``proxy.store.calibration``; a refusal for length is learned from when it comes: ``proxy.serve.overflow``), lets the
prompt-cache tracker compare the answer with the conversation's previous one
(``proxy.store.promptcache``), prices the request (``proxy.serve.costs``) and counts it in the
metrics (and through them the cost ledger). In observe mode the sample is the client's payload
(what went upstream) and the figures counted are what enforce would have saved (``mode="observe"``).
"""

from __future__ import annotations

from proxy.core.refusal import Refusal
from proxy.core.usage import Usage
from proxy.pipeline import Assembly
from proxy.policy import ModelRoute
from proxy.serve.costs import RequestCost, removed_tokens, request_cost
from proxy.serve.metrics import Metrics
from proxy.serve.state import Shared
from proxy.store.calibration import hidden_input


def settle(shared: Shared, metrics: Metrics, route: ModelRoute, assembly: Assembly, tenant: str,
           usage: Usage | None, status: int, *, refusal: Refusal | None = None) -> RequestCost:
    """Calibrate from one answer, measure its prompt-cache effect, count its figures; returns them (for the log).

    ``usage``: the answer's, read in its wire's form (``proxy.core.usage.normalise_usage``). ``refusal``: the
    provider refused the request for length; that was already learned from (``proxy.serve.overflow``), and there
    is no usage to learn from."""
    report = assembly.report
    observed = report.mode == "observe"
    answered = usage if 200 <= status < 300 else None
    sent = assembly.forwarded_tokens  # what went upstream, as ctxproxy counts it (observe: the client's payload)
    if refusal is None:  # a refusal for length was learned from when it came (proxy.serve.overflow)
        sample = shared.calibration.observe(tenant, route.upstream, route.upstream_model,
                                            answered.input_tokens if answered is not None else None,
                                            sent, hidden_input(assembly.body))
        metrics.calibration_sample(route.upstream_model, sample, answered, sent, report.calibration)
    # cached-token counts that do not add up (cached above the input ...) measure nothing
    cached = answered if answered is not None and answered.consistent else None
    # observe mode removed nothing: the provider's cache saw the client's payload
    effect = shared.prompt_cache.observe(tenant, assembly.received, assembly.items, cached,
                                         0 if observed else removed_tokens(report), assembly.item_keys())
    if observed:  # what enforce would have saved: gross only (its summaries and cache effect are not known)
        cost = request_cost(report, route.upstream_model, shared.model_map, None)
        cost.summarizer_usd = cost.net_usd = None
    else:
        cost = request_cost(report, route.upstream_model, shared.model_map, effect if cached is not None else None)
    if answered is not None:  # a request that got no answer saved nothing
        metrics.account(tenant, route.name, cost, mode=report.mode)
    return cost
