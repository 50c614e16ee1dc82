"""Prometheus metrics: what the proxy removed, what it cost, what it saved, and how fast it was.

One ``Metrics`` instance owns its own ``CollectorRegistry`` (the global
``REGISTRY`` is never touched) and is the ``Observer`` the runtime reports
summariser calls and cache errors to; the request handler calls ``assembled``,
``finished``, ``payload_error``, ``prefix`` and ``refetched``, and after each answer
``account`` (the request's cost figures, ``proxy.serve.costs``) and
``calibration_sample``; the calibration store reports its factors to
``calibration_factor``. What the cost report needs is also added to the cost
ledger (``ledger``, ``proxy.store.ledger``) at the same places, with the same
labels, so the report's totals equal the counters'. The token, removal and
savings series have a ``mode`` label: ``enforce``, or ``observe`` for requests
forwarded as sent, whose figures are what enforce would have done (the ledger's
``observed_*`` amounts).

Label values come only from bounded sets, never from a key, a user id or
prompt text: a tenant is a configured tenant name ("default" when no tenants
are configured) or "other"; a model is a configured model name, an exact name
from litellm's model map (a few thousand entries), or "other". Other labels
are fixed vocabularies, except error codes (payload errors, observed refusals), which must look like
``^[a-z_]{1,40}$`` and are capped at 50 distinct codes per process.

Multiprocess mode (several worker processes behind one port): the parent sets
``PROMETHEUS_MULTIPROC_DIR`` to an empty directory *before* any worker imports
``prometheus_client`` (the library picks its value store at import time), and
each worker builds ``Metrics(..., multiprocess_dir=that_dir)``. Every metric
then writes its samples to per-process mmap files in that directory, and
``render()`` builds a fresh registry with a ``MultiProcessCollector`` that sums
counters and histograms over all processes, dead ones included. The directory
must be wiped when the server (not a worker) starts. Constructing ``Metrics``
with ``multiprocess_dir`` while the environment variable is missing or points
elsewhere raises ``RuntimeError`` rather than silently exporting one worker's
numbers. Caveats: in this mode ``_created`` samples are not exported, and two
live ``Metrics`` instances in one process would share (and overwrite) the same
series, so a process keeps one instance and calls ``set_labels`` on reload.
"""

from __future__ import annotations

import bisect
import logging
import os
import re
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client import values as prom_values
from prometheus_client.multiprocess import MultiProcessCollector

from proxy.core.conversation import UNMANAGED_REASONS
from proxy.core.pairing import REPAIR_KINDS
from proxy.core.usage import count, normalise_usage
from proxy.pipeline import MODES, REMOVED_HOW, SUMMARY_STATUSES
from proxy.store.background import BACKGROUND_RESULTS
from proxy.store.calibration import SAMPLE_RESULTS
from proxy.store.refetch import HOW as REFETCH_HOW
from proxy.upstream.engine import FAILURE_REASONS
from proxy.wire import WIRES, Wires

if TYPE_CHECKING:
    from plugins.base import Completion
    from proxy.core.modelinfo import ModelMap
    from proxy.core.usage import Usage
    from proxy.pipeline import Report
    from proxy.serve.costs import RequestCost
    from proxy.store.calibration import Sample
    from proxy.store.ledger import Ledger

log = logging.getLogger("ctxproxy")

OTHER = "other"
LABEL_MEMO = 4096  # model names whose label is remembered (they come from clients)
SUMMARY_RESULTS = SUMMARY_STATUSES - {"none"}
CACHE_OPERATIONS = frozenset({"get", "set", "lock", "unlock", "renew", "ping"})
ERROR_CODE = re.compile(r"[a-z_]{1,40}")
MAX_ERROR_CODES = 50

OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
UPSTREAM_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0)
# (ctxproxy's count - the provider's) / the provider's: negative = ctxproxy counted fewer (budgets too large)
ERROR_BUCKETS = (-0.5, -0.3, -0.2, -0.15, -0.1, -0.05, -0.02, -0.01, 0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)
CACHE_EFFECT_KINDS = ("break", "removed")
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

TM = ("tenant", "model")
TMM = (*TM, "mode")  # mode: enforce | observe (proxy.pipeline.MODES)


class Metrics:
    def __init__(
        self,
        tenants: Iterable[str],
        models: Iterable[str],
        model_map: ModelMap,
        *,
        multiprocess_dir: str | None = None,
        upstreams: Iterable[str] = (),
        wires: Wires = WIRES,
    ) -> None:
        self.wires = wires  # the ``wire`` label's values, and how each wire's usage reads
        if multiprocess_dir is not None:
            _check_multiprocess(multiprocess_dir)
        self.multiprocess_dir = multiprocess_dir
        self.model_map = model_map
        self.registry = CollectorRegistry(auto_describe=True)
        self._tenants: frozenset[str] = frozenset()
        self._models: frozenset[str] = frozenset()
        self._upstreams: frozenset[str] = frozenset()
        self._error_codes: set[str] = set()
        self._unpriced_logged: set[str] = set()
        self.ledger: Ledger | None = None  # set by the app: the cost report's persistent twin of these counters
        self._children: dict[tuple[Any, ...], Any] = {}  # labelled series of the after-answer metrics (bounded labels)
        self.set_labels(tenants, models, upstreams)

        def counter(name: str, doc: str, labels: tuple[str, ...]) -> Counter:
            return Counter(name, doc, labels, registry=self.registry)

        def histogram(name: str, doc: str, labels: tuple[str, ...], buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, registry=self.registry, buckets=buckets)

        self.requests = counter("ctxproxy_requests", "Managed requests by wire and HTTP status.",
                                (*TM, "wire", "status"))
        # mode="observe": requests forwarded as sent; forwarded and removed are then what enforce would have done
        self.tokens_received = counter("ctxproxy_tokens_received", "Prompt tokens the clients sent, by mode.", TMM)
        self.tokens_forwarded = counter(
            "ctxproxy_tokens_forwarded", "Prompt tokens forwarded upstream (mode=observe: that enforce would have "
            "forwarded).", TMM)
        self.tokens_removed = counter(
            "ctxproxy_tokens_removed", "Prompt tokens removed, by how (mode=observe: that enforce would have "
            "removed).", (*TMM, "how"))
        self.observed_refusals = counter(
            "ctxproxy_observed_refusals", "Requests forwarded in observe mode that enforce would have refused, "
            "by the refusal's code.", ("tenant", "code"))
        self.summaries = counter("ctxproxy_summaries", "Requests that used a summary, by result.", ("tenant", "result"))
        self.summarizer_failures = counter(
            "ctxproxy_summarizer_failures", "Summariser calls that failed, by reason.", ("tenant", "reason"))
        self.background_summaries = counter(
            "ctxproxy_background_summaries", "Summaries made in the background before a request needs them, by "
            "result: started, skipped (no room, or backing off), made, failed, used (first forwarded by a request "
            "of this process), wasted (made and not used in time, or before the process stopped), abandoned "
            "(at shutdown).", ("tenant", "result"))
        self.summary_wait = histogram(
            "ctxproxy_summary_wait_seconds", "Time requests waited for a summariser (only requests that waited: "
            "nothing else fitted under B).", ("tenant",), WAIT_BUCKETS)
        self.unpriced = counter(
            "ctxproxy_unpriced_model", "Cost figures skipped: the model has no price in litellm's map or the config.",
            ("model",))
        self.summarizer_tokens = counter(
            "ctxproxy_summarizer_tokens", "Tokens spent by the summariser.", (*TM, "kind"))
        self.summarizer_cost = counter(
            "ctxproxy_summarizer_cost_usd", "Summariser cost in USD (litellm prices).", TM)
        self.savings = counter(
            "ctxproxy_estimated_savings_usd", "Input price of the request's model times tokens removed (mode=observe: "
            "that enforce would have removed).", TMM)
        self.repairs = counter("ctxproxy_repairs", "Tool-call pairing repairs, by kind.", ("kind",))
        self.unmanaged = counter(
            "ctxproxy_unmanaged_requests", "Requests forwarded without context management because the provider "
            "holds part of the conversation (previous_response_id, conversation, item_reference).", ("wire", "reason"))
        self.payload_errors = counter("ctxproxy_payload_errors", "Requests refused as invalid, by code.", ("code",))
        self.cached_tokens = counter(
            "ctxproxy_provider_cached_tokens", "Prompt tokens the provider served from its prompt cache.", TM)
        self.cache_errors = counter("ctxproxy_cache_errors", "Summary-cache errors, by operation.", ("operation",))
        self.cache_breaker = counter(
            "ctxproxy_cache_breaker_opened", "Times the cache's circuit breaker opened (its operations timed out: "
            "the cache is bypassed until a probe answers).", ())
        self.log_lines_dropped = counter(
            "ctxproxy_log_lines_dropped", "Log lines dropped because stderr was not read as fast as they came "
            "(logging.queue_lines were waiting).", ())
        self.prefix_stable = counter(
            "ctxproxy_prefix_stable", "Whether the forwarded prefix matched the previous request's.", (*TM, "result"))
        self.refetches = counter(
            "ctxproxy_refetch", "Calls the model made again (same tool, same arguments) after ctxproxy removed their "
            "output from a request of the same conversation, by how it was removed: masked, summarised or dropped "
            "(counted by the replica that served both requests).", (*TM, "how"))
        self.overhead = histogram(
            "ctxproxy_overhead_seconds", "Time the proxy adds before forwarding.", (), OVERHEAD_BUCKETS)
        self._overhead = _series(self.overhead)
        self.upstream = histogram(
            "ctxproxy_upstream_seconds", "Upstream response time (whole response).", TM, UPSTREAM_BUCKETS)
        self.ttft = histogram("ctxproxy_upstream_ttft_seconds", "Upstream time to first token.", TM, TTFT_BUCKETS)
        # the net cost of context management (proxy.serve.costs), per tenant and the request's model
        self.request_summarizer_cost = counter(
            "ctxproxy_request_summarizer_cost_usd",
            "Summariser cost in USD, attributed to the tenant and model of the request that made the summary.", TM)
        self.cache_effect = counter(
            "ctxproxy_prompt_cache_effect_usd",
            "Prompt-cache cost of context management in USD, measured from the provider's cached tokens, by kind: "
            "break (a compaction changed a prefix the provider had cached) or removed (removed tokens the provider "
            "would have read from its cache: gross prices them at the full input price).", (*TM, "kind"))
        self.cache_effect_tokens = counter(
            "ctxproxy_prompt_cache_effect_tokens",
            "Provider tokens behind ctxproxy_prompt_cache_effect_usd, by kind.", (*TM, "kind"))
        self.net_savings = counter(
            "ctxproxy_net_savings_usd",
            "Net savings in USD of requests whose net was positive: gross - summariser - prompt-cache effect "
            "(net = this - ctxproxy_net_loss_usd).", TM)
        self.net_loss = counter(
            "ctxproxy_net_loss_usd",
            "Net savings in USD of requests whose net was negative, as a positive amount.", TM)
        # token-count calibration (proxy.store.calibration), per tenant and upstream model
        self.calibration = Gauge(
            "ctxproxy_token_calibration_factor",
            "The provider's input-token count over ctxproxy's that a tenant's budget uses, learned from usage "
            "(or the family default).",
            ("tenant", "upstream", "model"), registry=self.registry, multiprocess_mode="mostrecent")
        self.calibration_samples = counter(
            "ctxproxy_calibration_samples", "Answers considered for calibration, by result.", ("model", "result"))
        # the provider's refusals for length (proxy.serve.overflow): re-assembled and answered, or not
        self.overflow_recovered = counter(
            "ctxproxy_overflow_recovered", "Requests the provider refused for their length that were re-assembled "
            "within what the refusal taught and then answered.", TM)
        self.overflow_failed = counter(
            "ctxproxy_overflow_failed", "Requests the provider refused for their length that could not be recovered "
            "(nothing smaller to send, the retry refused or failed, or output already started).", TM)
        self.count_error = histogram(
            "ctxproxy_token_count_error_ratio",
            "Relative error of ctxproxy's input count against the provider's, (ctxproxy - provider) / provider: "
            "raw, and calibrated (ctxproxy's count times the factor the request's budget used).",
            ("model", "count"), ERROR_BUCKETS)

    # -- labels ---------------------------------------------------------------------------------------

    def _child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, remembered, as a series that counts without the library's per-call checks
        (``_series``): the after-answer metrics are updated on every answer."""
        key = (metric, *labels)  # (a metric hashes by identity)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = _series(metric.labels(*labels))
        return child

    def _ledger(self, tenant: str, model: str, **amounts: float) -> None:
        if self.ledger is not None:
            self.ledger.add_all(tenant, model, amounts)

    def set_labels(self, tenants: Iterable[str], models: Iterable[str], upstreams: Iterable[str] = ()) -> None:
        """Replace the allowed tenant, model and upstream names (on config reload)."""
        self._tenants = frozenset(tenants) or frozenset({"default"})
        self._models = frozenset(models)
        self._model_labels: dict[str, str] = {}
        self._upstreams = frozenset(upstreams)

    def tenant_label(self, tenant: str) -> str:
        return tenant if tenant in self._tenants else OTHER

    def model_label(self, model: str) -> str:
        label = self._model_labels.get(model)
        if label is None:
            label = model if model in self._models or self._in_model_map(model) else OTHER
            if len(self._model_labels) < LABEL_MEMO:  # names come from clients: remember a bounded number
                self._model_labels[model] = label
        return label

    def _in_model_map(self, model: str) -> bool:
        """An exact model-map name: ``ModelMap.get`` also resolves ``anything/<name>``, which is unbounded."""
        if not model or self.model_map.get(model) is None:
            return False
        return "/" not in model or self.model_map.get(model.split("/", 1)[1]) is None

    # -- events ---------------------------------------------------------------------------------------

    def summary_call(self, tenant: str, completion: Completion, model: str = "") -> None:
        """One summariser call, priced on the model the provider ran (not the alias it was routed by).

        Its tokens and cost are labelled with the summariser's model; against net savings it counts for
        the model of the request it was made for (``model``), whose context it managed.
        """
        t, m = self.tenant_label(tenant), self.model_label(completion.model)
        self.summarizer_tokens.labels(t, m, "prompt").inc(max(0, completion.prompt_tokens))
        self.summarizer_tokens.labels(t, m, "completion").inc(max(0, completion.completion_tokens))
        cost = self.model_map.cost(completion.priced_model, completion.prompt_tokens, completion.completion_tokens)
        if cost is None:
            self._unpriced(completion.priced_model)
            return
        # every summariser call is paid for, whatever asked for it (a request, compact, count_tokens, explain)
        # and whether or not that request was answered: it is counted here, once, against net savings
        cost = max(0.0, cost)
        self.summarizer_cost.labels(t, m).inc(cost)
        for_model = self.model_label(model or completion.model)
        if cost:
            self._child(self.net_loss, t, for_model).inc(cost)
        self._ledger(t, for_model, summarizer_usd=cost, net_usd=-cost)

    def background_summary(self, tenant: str, result: str) -> None:
        """What became of a background summary (``proxy.store.background``)."""
        label = result if result in BACKGROUND_RESULTS else OTHER
        self._child(self.background_summaries, self.tenant_label(tenant), label).inc(1)

    def background_summary_made(self, tenant: str, model: str, made: Completion | None) -> None:
        """A summary made in the background: created for the request that started it (its tenant and model).

        Its cost was counted where it was paid (``summary_call``); here it is attributed, as a request's own
        summary is in ``account``, and the cost report counts it as created."""
        t, m = self.tenant_label(tenant), self.model_label(model)
        self._ledger(t, m, summaries_created=1)
        if made is None:
            return
        cost = self.model_map.cost(made.priced_model, made.prompt_tokens, made.completion_tokens)
        if cost:
            self._child(self.request_summarizer_cost, t, m).inc(max(0.0, cost))

    def summary_failed(self, tenant: str, reason: str) -> None:
        self.summarizer_failures.labels(self.tenant_label(tenant), reason if reason in FAILURE_REASONS else OTHER).inc()

    def _unpriced(self, model: str) -> None:
        label = self.model_label(model)
        if model not in self._unpriced_logged and len(self._unpriced_logged) < 1000:
            self._unpriced_logged.add(model)
            log.warning("model %r has no price in litellm's map or the config: its cost figures are not counted "
                        "(set models[].input_cost_per_token / output_cost_per_token)", model[:100])
        self.unpriced.labels(label).inc()

    def cache_error(self, operation: str, exc: BaseException) -> None:
        """One summary-cache error (Observer); the exception is not recorded."""
        self.cache_errors.labels(operation if operation in CACHE_OPERATIONS else OTHER).inc()

    def cache_breaker_opened(self) -> None:
        """The cache backend timed out and is bypassed for a while (``proxy.store.guard``)."""
        self.cache_breaker.inc()

    def overflow(self, tenant: str, model: str, recovered: bool) -> None:
        """One refusal for length, recovered or not (``proxy.serve.overflow``)."""
        metric = self.overflow_recovered if recovered else self.overflow_failed
        self._child(metric, self.tenant_label(tenant), self.model_label(model)).inc(1)

    def assembled(self, tenant: str, model: str, report: Report, upstream_model: str | None = None) -> None:
        """What the pipeline did to one request; savings priced on the model the route sends upstream.

        In observe mode (``report.mode``): what enforce would have done, under ``mode="observe"`` (and the
        ledger's ``observed_*`` amounts); a request enforce would have refused counts only as such. Nothing
        was summarised or repaired: those series count enforced requests alone."""
        t, m = self.tenant_label(tenant), self.model_label(model)
        observed = report.mode == "observe"
        mode = report.mode if report.mode in MODES else OTHER
        if observed and report.would_refuse is not None:
            code = self._error_code(report.would_refuse)
            self._child(self.observed_refusals, t, code).inc(1)
            self._ledger(t, m, observed_requests=1, observed_refusals=1)
            return
        self._child(self.tokens_received, t, m, mode).inc(max(0, report.tokens_before))
        self._child(self.tokens_forwarded, t, m, mode).inc(max(0, report.tokens_after))
        removed = 0
        for how, n in report.removed.items():
            if n > 0:
                self._child(self.tokens_removed, t, m, mode, how if how in REMOVED_HOW else OTHER).inc(n)
                removed += n
        if removed and self.model_map.input_price(upstream_model or model) is None:
            self._unpriced(upstream_model or model)
        if observed:
            self._ledger(t, m, observed_requests=1, observed_tokens_received=max(0, report.tokens_before),
                         observed_tokens_forwarded=max(0, report.tokens_after), observed_tokens_removed=removed)
            return
        if report.summary != "none":
            self._child(self.summaries, t, report.summary if report.summary in SUMMARY_RESULTS else OTHER).inc(1)
        if report.summary_wait is not None:
            self._child(self.summary_wait, t).observe(max(0.0, report.summary_wait))
        for kind, n in report.repairs.items():
            if n > 0:
                self.repairs.labels(kind if kind in REPAIR_KINDS else OTHER).inc(n)
        if report.unmanaged:
            reason = report.unmanaged if report.unmanaged in UNMANAGED_REASONS else OTHER
            self.unmanaged.labels(report.wire if report.wire in self.wires.names else OTHER, reason).inc()
        self._ledger(t, m, tokens_received=max(0, report.tokens_before), tokens_forwarded=max(0, report.tokens_after),
                     tokens_removed=removed,
                     summaries_created=int(report.summary == "created"),
                     summaries_reused=int(report.summary == "reused"))

    def account(self, tenant: str, model: str, cost: RequestCost, mode: str = "enforce") -> None:
        """One answered request's figures: gross savings, the prompt-cache effect, and their net.

        The summariser's cost is counted where it is paid (``summary_call``); here it is only attributed.
        A request that got no answer saved nothing (the provider bills no failed request). In observe mode
        only the gross saving enforce would have made is known (``mode="observe"``, the ledger's
        ``observed_gross_usd``): no summary was made, and the provider's cache saw the client's payload.
        """
        t, m = self.tenant_label(tenant), self.model_label(model)
        if mode == "observe":
            if cost.gross_usd:
                self._child(self.savings, t, m, mode).inc(max(0.0, cost.gross_usd))
            self._ledger(t, m, observed_gross_usd=max(0.0, cost.gross_usd or 0.0), unpriced=int(cost.gross_usd is None))
            return
        if cost.gross_usd:
            self._child(self.savings, t, m, "enforce").inc(max(0.0, cost.gross_usd))
        if cost.summarizer_usd:
            self._child(self.request_summarizer_cost, t, m).inc(max(0.0, cost.summarizer_usd))
        effects = {"break": (cost.cache_break_usd, cost.cache.lost_reads + cost.cache.extra_writes),
                   "removed": (cost.cache_removed_usd, cost.cache.removed_reads)}
        effect_usd = 0.0
        for kind, (usd, tokens) in effects.items():
            if tokens > 0:
                self._child(self.cache_effect_tokens, t, m, kind).inc(tokens)
            if usd:
                self._child(self.cache_effect, t, m, kind).inc(max(0.0, usd))
                effect_usd += max(0.0, usd)
        net = cost.gross_usd - effect_usd if cost.gross_usd is not None else None
        if net is not None and net > 0:
            self._child(self.net_savings, t, m).inc(net)
        elif net is not None and net < 0:
            self._child(self.net_loss, t, m).inc(-net)
        # an unknown price was already counted where it was met (assembled, summary_call)
        self._ledger(t, m, gross_usd=max(0.0, cost.gross_usd or 0.0), cache_effect_usd=effect_usd,
                     net_usd=net or 0.0, unpriced=int(net is None))

    def calibration_factor(self, tenant: str, upstream: str, model: str, factor: float) -> None:
        """The factor in effect for a tenant on an upstream model (the calibration store's hook)."""
        self.calibration.labels(self.tenant_label(tenant), upstream if upstream in self._upstreams else OTHER,
                                self.model_label(model)).set(factor)

    def calibration_sample(self, model: str, sample: Sample, usage: Usage | None, proxy_tokens: int,
                           factor: float) -> None:
        """One answer considered for calibration; a used one adds to the accuracy histogram."""
        m = self.model_label(model)
        self._child(self.calibration_samples, m, sample.result if sample.result in SAMPLE_RESULTS else OTHER).inc(1)
        if sample.result != "used" or usage is None or usage.input_tokens <= 0:
            return
        provider = usage.input_tokens
        self._child(self.count_error, m, "raw").observe((proxy_tokens - provider) / provider)
        self._child(self.count_error, m, "calibrated").observe((proxy_tokens * _factor(factor) - provider) / provider)

    def finished(
        self,
        tenant: str,
        model: str,
        status: int,
        *,
        overhead: float | None,
        upstream: float | None,
        ttft: float | None,
        usage: dict[str, Any] | None,
        wire: str = "chat",
        normalised: Usage | None = None,
    ) -> None:
        """One finished request: status, timings, and the provider's usage block if any (``normalised``: that
        block already read in the wire's form, as the request's scope reads it once for this and ``settle``)."""
        t, m = self.tenant_label(tenant), self.model_label(model)
        self._child(self.requests, t, m, wire if wire in self.wires.names else OTHER,
                    str(status) if 100 <= status <= 599 else OTHER).inc(1)
        if self.ledger is not None:
            self.ledger.add_all(t, m, ONE_REQUEST)
        if overhead is not None:
            self._overhead.observe(max(0.0, overhead))
        if upstream is not None:
            self._child(self.upstream, t, m).observe(max(0.0, upstream))
        if ttft is not None:
            self._child(self.ttft, t, m).observe(max(0.0, ttft))
        cached = normalised.cached_tokens if normalised is not None else self._cached_tokens(usage, wire)
        if cached:
            self._child(self.cached_tokens, t, m).inc(cached)

    def payload_error(self, code: str) -> None:
        """One request refused as invalid; ``code`` is the error's machine-readable code."""
        self.payload_errors.labels(self._error_code(code)).inc()

    def _error_code(self, code: str) -> str:
        """An error code as a label: a known shape, and at most ``MAX_ERROR_CODES`` of them (else ``other``)."""
        if ERROR_CODE.fullmatch(code) and (code in self._error_codes or len(self._error_codes) < MAX_ERROR_CODES):
            self._error_codes.add(code)
            return code
        return OTHER

    def prefix(self, tenant: str, model: str, stable: bool) -> None:
        """Whether the forwarded prefix was unchanged since this conversation's previous request."""
        self._child(self.prefix_stable, self.tenant_label(tenant), self.model_label(model),
                    "stable" if stable else "shifted").inc(1)

    def refetched(self, tenant: str, model: str, counts: dict[str, int]) -> None:
        """Calls of one request that repeat a call whose output an earlier request removed, by how
        (``proxy.store.refetch``); the cost ledger counts them too, so the report equals the counter."""
        t, m = self.tenant_label(tenant), self.model_label(model)
        amounts: dict[str, float] = {}
        for how, n in counts.items():
            if n > 0:
                label = how if how in REFETCH_HOW else OTHER
                self._child(self.refetches, t, m, label).inc(n)
                if label != OTHER:
                    amounts[f"refetched_{label}"] = n
        if amounts:
            self._ledger(t, m, **amounts)

    def _cached_tokens(self, usage: dict[str, Any] | None, wire: str) -> int:
        """The provider's cached input tokens, read in the wire's own form (a usage of no known wire: guessed)."""
        known = self.wires.get(wire)
        normalised = normalise_usage(usage, known.usage_form) if known is not None else self.wires.guess_usage(usage)
        if normalised is not None:
            return normalised.cached_tokens
        details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
        value = details.get("cached_tokens") if isinstance(details, dict) else None
        return count(value) or 0  # (a count as normalise_usage reads one: no bool, nothing absurd)

    # -- exposition -----------------------------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        """The exposition body and its content type (summed over all workers in multiprocess mode)."""
        if self.multiprocess_dir is None:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=self.multiprocess_dir)  # type: ignore[no-untyped-call]
        return generate_latest(registry), CONTENT_TYPE_LATEST


class _CounterSeries:
    """One counter series: ``inc`` is its value's own (the library's ``Counter.inc`` checks, on every call, that
    the series is labelled and the amount not negative; both hold for every caller here)."""

    __slots__ = ("inc",)

    def __init__(self, value: Any) -> None:
        self.inc = value.inc


class _HistogramSeries:
    """One histogram series, observed as the library's ``Histogram.observe`` does it (the sum, then the first
    bucket whose bound is at least the amount), with a bisection and without the per-call checks."""

    __slots__ = ("_bounds", "_buckets", "_sum")

    def __init__(self, child: Any) -> None:
        self._sum = child._sum.inc
        self._bounds = list(child._upper_bounds)
        self._buckets = [bucket.inc for bucket in child._buckets]

    def observe(self, amount: float) -> None:
        self._sum(amount)
        if amount == amount:  # (NaN is in no bucket)
            self._buckets[bisect.bisect_left(self._bounds, amount)](1)


def _series(child: Any) -> Any:
    """A labelled series of a counter or histogram as a ``_CounterSeries`` / ``_HistogramSeries`` (the child itself
    for any other kind, or a library whose internals differ)."""
    if isinstance(child, Counter) and hasattr(getattr(child, "_value", None), "inc"):
        return _CounterSeries(child._value)
    if isinstance(child, Histogram) and all(hasattr(child, name) for name in ("_sum", "_upper_bounds", "_buckets")) \
            and len(child._upper_bounds) == len(child._buckets):
        return _HistogramSeries(child)
    return child


ONE_REQUEST: Mapping[str, float] = MappingProxyType({"requests": 1})  # a finished request's amount in the ledger


def _factor(value: float) -> float:
    return value if isinstance(value, (int, float)) and 0 < value < 100 else 1.0


def _check_multiprocess(path: str) -> None:
    env = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not os.path.isdir(path):
        raise RuntimeError(f"metrics multiprocess directory {path!r} does not exist")
    if env is None or not os.path.isdir(env) or not os.path.samefile(env, path):
        raise RuntimeError(f"multiprocess metrics need PROMETHEUS_MULTIPROC_DIR={path!r} in the environment")
    if prom_values.ValueClass is prom_values.MutexValue:
        raise RuntimeError("PROMETHEUS_MULTIPROC_DIR must be set before prometheus_client is first imported")
