"""proxy.metrics: bounded labels, cost and savings from the litellm map, multiprocess aggregation."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client import values as prom_values
from prometheus_client.parser import text_string_to_metric_families

from plugins.base import Completion
from proxy.core.modelinfo import ModelMap
from proxy.pipeline import Report
from proxy.serve.costs import request_cost
from proxy.serve.metrics import MAX_ERROR_CODES, Metrics, _series

ROOT = Path(__file__).resolve().parents[2]
MODEL = "gpt-4o-mini"
KEY = "sk-proj-Zx81LqS3cretKeyThatMustNeverBeALabel"


@pytest.fixture(scope="module")
def model_map() -> ModelMap:
    mm = ModelMap()
    if not mm.input_price(MODEL):
        pytest.skip("litellm's model map is not installed")
    return mm


@pytest.fixture
def metrics(model_map: ModelMap) -> Metrics:
    return Metrics(["acme", "globex"], ["my-alias"], model_map)


def samples(m: Metrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    body, content_type = m.render()
    assert content_type.startswith("text/plain")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }


def value(m: Metrics, name: str, **labels: str) -> float:
    return samples(m).get((name, frozenset(labels.items())), 0.0)


def report(**kw: object) -> Report:
    r = Report(model=MODEL, tenant="acme", context_manager="summarising")
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def test_unknown_tenant_and_model_become_other(metrics: Metrics) -> None:
    metrics.finished("intruder", "no-such-model-xyz", 200, overhead=None, upstream=None, ttft=None, usage=None)
    metrics.finished("acme", "my-alias", 200, overhead=None, upstream=None, ttft=None, usage=None)
    metrics.finished("acme", MODEL, 502, overhead=None, upstream=None, ttft=None, usage=None)
    assert value(metrics, "ctxproxy_requests_total", tenant="other", model="other", wire="chat", status="200") == 1
    assert value(metrics, "ctxproxy_requests_total", tenant="acme", model="my-alias", wire="chat", status="200") == 1
    # Not configured, but an exact name in litellm's model map.
    assert value(metrics, "ctxproxy_requests_total", tenant="acme", model=MODEL, wire="chat", status="502") == 1


def test_default_tenant_only_without_tenants(model_map: ModelMap) -> None:
    m = Metrics([], [], model_map)
    assert m.tenant_label("default") == "default"
    assert m.tenant_label("acme") == "other"
    m.set_labels(["acme"], ["x"])
    assert m.tenant_label("acme") == "acme"
    assert m.tenant_label("default") == "other"
    assert m.model_label("x") == "x"


def test_prefixed_model_names_are_not_labels(metrics: Metrics) -> None:
    # ModelMap.get resolves "anything/<known>"; that must not open an unbounded label.
    assert metrics.model_label(f"{KEY}/{MODEL}") == "other"
    assert metrics.model_label("") == "other"


def test_key_like_strings_never_reach_the_output(metrics: Metrics) -> None:
    metrics.finished(KEY, KEY, 401, overhead=0.01, upstream=1.0, ttft=0.5,
                     usage={"prompt_tokens_details": {"cached_tokens": 3}})
    metrics.assembled(KEY, f"{KEY}/{MODEL}", report(tokens_before=10, tokens_after=5, removed={KEY: 5},
                                                    repairs={KEY: 1}, summary=KEY))
    metrics.summary_call(KEY, Completion("text", KEY, 10, 2))
    metrics.prefix(KEY, KEY, True)
    metrics.payload_error(KEY)
    metrics.cache_error(KEY, RuntimeError(KEY))
    metrics.finished("acme", MODEL, 10_000, overhead=None, upstream=None, ttft=None, usage=None)
    body = metrics.render()[0].decode()
    assert KEY not in body and "sk-" not in body
    assert value(metrics, "ctxproxy_tokens_removed_total", tenant="other", model="other", mode="enforce",
                 how="other") == 5
    assert value(metrics, "ctxproxy_repairs_total", kind="other") == 1
    assert value(metrics, "ctxproxy_summaries_total", tenant="other", result="other") == 1
    assert value(metrics, "ctxproxy_cache_errors_total", operation="other") == 1
    assert value(metrics, "ctxproxy_requests_total", tenant="acme", model=MODEL, wire="chat", status="other") == 1


def test_assembled_counts_tokens_removals_repairs_and_savings(metrics: Metrics, model_map: ModelMap) -> None:
    metrics.assembled("acme", MODEL, report(
        tokens_before=10_000, tokens_after=3_000, summary="created",
        removed={"summarised": 6_000, "wm_capped": 500, "trimmed": 500, "windowed": 0},
        repairs={"orphan_result": 2, "missing_result": 1},
    ))
    t = {"tenant": "acme", "model": MODEL, "mode": "enforce"}
    assert value(metrics, "ctxproxy_tokens_received_total", **t) == 10_000
    assert value(metrics, "ctxproxy_tokens_forwarded_total", **t) == 3_000
    assert value(metrics, "ctxproxy_tokens_removed_total", **t, how="summarised") == 6_000
    assert value(metrics, "ctxproxy_tokens_removed_total", **t, how="wm_capped") == 500
    assert ("ctxproxy_tokens_removed_total", frozenset({**t, "how": "windowed"}.items())) not in samples(metrics)
    assert value(metrics, "ctxproxy_repairs_total", kind="orphan_result") == 2
    assert value(metrics, "ctxproxy_repairs_total", kind="missing_result") == 1
    # savings are counted once the request was answered (a failed request saved nothing)
    assert value(metrics, "ctxproxy_estimated_savings_usd_total", **t) == 0
    r = report(
        tokens_before=10_000, tokens_after=3_000, removed={"summarised": 6_000, "wm_capped": 500, "trimmed": 500}
    )
    metrics.account("acme", MODEL, request_cost(r, MODEL, model_map))
    savings = value(metrics, "ctxproxy_estimated_savings_usd_total", **t)
    assert savings > 0
    assert savings == pytest.approx(7_000 * (model_map.input_price(MODEL) or 0))


def test_an_observed_request_counts_under_mode_observe_and_nothing_it_did_not_do(
        metrics: Metrics, model_map: ModelMap) -> None:
    """Observe mode's figures are what enforce would have done: they go to ``mode="observe"``; no summary was used
    and nothing was repaired, so those series stay empty; a would-be refusal counts only as one, its code a
    bounded label."""
    r = report(tokens_before=10_000, tokens_after=3_000, summary="would_create", removed={"summarised": 7_000},
               repairs={"orphan_result": 1}, mode="observe")
    metrics.assembled("acme", MODEL, r)
    metrics.account("acme", MODEL, request_cost(r, MODEL, model_map), mode="observe")
    seen = {"tenant": "acme", "model": MODEL, "mode": "observe"}
    assert value(metrics, "ctxproxy_tokens_received_total", **seen) == 10_000
    assert value(metrics, "ctxproxy_tokens_forwarded_total", **seen) == 3_000
    assert value(metrics, "ctxproxy_tokens_removed_total", **seen, how="summarised") == 7_000
    assert value(metrics, "ctxproxy_estimated_savings_usd_total", **seen) == pytest.approx(
        7_000 * (model_map.input_price(MODEL) or 0))
    assert value(metrics, "ctxproxy_tokens_received_total", tenant="acme", model=MODEL, mode="enforce") == 0
    assert not any(name in ("ctxproxy_summaries_total", "ctxproxy_repairs_total", "ctxproxy_net_savings_usd_total")
                   for name, _ in samples(metrics))
    for code in ("context_length_exceeded", KEY):
        metrics.assembled("acme", MODEL, report(tokens_before=9_000, mode="observe", would_refuse=code))
    assert value(metrics, "ctxproxy_observed_refusals_total", tenant="acme", code="context_length_exceeded") == 1
    assert value(metrics, "ctxproxy_observed_refusals_total", tenant="acme", code="other") == 1
    assert value(metrics, "ctxproxy_tokens_received_total", **seen) == 10_000  # the refusals counted no tokens


def test_summaries_by_result(metrics: Metrics) -> None:
    for status in ["created", "reused", "reused", "failed", "none"]:
        metrics.assembled("globex", MODEL, report(summary=status))
    assert value(metrics, "ctxproxy_summaries_total", tenant="globex", result="created") == 1
    assert value(metrics, "ctxproxy_summaries_total", tenant="globex", result="reused") == 2
    assert value(metrics, "ctxproxy_summaries_total", tenant="globex", result="failed") == 1
    assert not any(name == "ctxproxy_summaries_total" and ("result", "none") in labels
                   for name, labels in samples(metrics))


def test_summariser_tokens_and_cost(metrics: Metrics, model_map: ModelMap) -> None:
    metrics.summary_call("acme", Completion("a summary", MODEL, 20_000, 800))
    metrics.summary_call("acme", Completion("a summary", MODEL, 10_000, 200))
    t = {"tenant": "acme", "model": MODEL}
    assert value(metrics, "ctxproxy_summarizer_tokens_total", **t, kind="prompt") == 30_000
    assert value(metrics, "ctxproxy_summarizer_tokens_total", **t, kind="completion") == 1_000
    cost = value(metrics, "ctxproxy_summarizer_cost_usd_total", **t)
    assert cost > 0
    assert cost == pytest.approx(model_map.cost(MODEL, 30_000, 1_000))


def test_cached_tokens_and_timings(metrics: Metrics) -> None:
    t = {"tenant": "acme", "model": MODEL}
    usage = {"prompt_tokens": 5000, "prompt_tokens_details": {"cached_tokens": 4096}}
    metrics.finished("acme", MODEL, 200, overhead=0.0003, upstream=2.0, ttft=0.4, usage=usage)
    for bad in [None, {}, {"prompt_tokens_details": None}, {"prompt_tokens_details": {"cached_tokens": "7"}},
                {"prompt_tokens_details": {"cached_tokens": True}},
                # no usable input count: the cached count read alone, and an absurd one is no count
                {"prompt_tokens": 2**63, "prompt_tokens_details": {"cached_tokens": 2**63}},
                {"prompt_tokens_details": {"cached_tokens": 10**30}}, {"prompt_tokens_details": {"cached_tokens": -4}}]:
        metrics.finished("acme", MODEL, 200, overhead=None, upstream=None, ttft=None, usage=bad)
    assert value(metrics, "ctxproxy_provider_cached_tokens_total", **t) == 4096
    assert value(metrics, "ctxproxy_overhead_seconds_count") == 1
    assert value(metrics, "ctxproxy_overhead_seconds_bucket", le="0.0005") == 1
    assert value(metrics, "ctxproxy_overhead_seconds_bucket", le="0.0001") == 0
    assert value(metrics, "ctxproxy_upstream_seconds_sum", **t) == 2.0
    assert value(metrics, "ctxproxy_upstream_ttft_seconds_count", **t) == 1
    assert value(metrics, "ctxproxy_requests_total", **t, wire="chat", status="200") == 9


def test_prefix_stability(metrics: Metrics) -> None:
    metrics.prefix("acme", MODEL, True)
    metrics.prefix("acme", MODEL, True)
    metrics.prefix("acme", MODEL, False)
    assert value(metrics, "ctxproxy_prefix_stable_total", tenant="acme", model=MODEL, result="stable") == 2
    assert value(metrics, "ctxproxy_prefix_stable_total", tenant="acme", model=MODEL, result="shifted") == 1


def test_payload_error_codes_are_bounded(metrics: Metrics) -> None:
    metrics.payload_error("invalid_role")
    metrics.payload_error("invalid_role")
    for bad in ["Invalid-Role", "x" * 41, "", "code with spaces", "code1"]:
        metrics.payload_error(bad)
    assert value(metrics, "ctxproxy_payload_errors_total", code="invalid_role") == 2
    assert value(metrics, "ctxproxy_payload_errors_total", code="other") == 5
    for i in range(MAX_ERROR_CODES + 10):
        metrics.payload_error("code_" + "".join(chr(97 + int(d)) for d in str(i)))
    metrics.payload_error("invalid_role")  # already known: still its own label
    codes = {dict(labels)["code"] for name, labels in samples(metrics) if name == "ctxproxy_payload_errors_total"}
    assert len(codes) == MAX_ERROR_CODES + 1  # the cap plus "other"
    assert value(metrics, "ctxproxy_payload_errors_total", code="invalid_role") == 3
    assert value(metrics, "ctxproxy_payload_errors_total", code="other") == 5 + 11


def test_cache_errors_by_operation(metrics: Metrics) -> None:
    for op in ["get", "set", "lock", "ping", "get"]:
        metrics.cache_error(op, ConnectionError("redis down"))
    assert value(metrics, "ctxproxy_cache_errors_total", operation="get") == 2
    assert value(metrics, "ctxproxy_cache_errors_total", operation="ping") == 1
    assert "redis down" not in metrics.render()[0].decode()


def test_instances_do_not_share_state(model_map: ModelMap) -> None:
    a, b = Metrics([], [], model_map), Metrics([], [], model_map)
    a.payload_error("invalid_role")
    assert value(a, "ctxproxy_payload_errors_total", code="invalid_role") == 1
    assert value(b, "ctxproxy_payload_errors_total", code="invalid_role") == 0


def test_multiprocess_dir_requires_the_environment(tmp_path: Path, model_map: ModelMap,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    if prom_values.ValueClass is not prom_values.MutexValue:
        pytest.skip("this test process runs prometheus_client in multiprocess mode")
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    with pytest.raises(RuntimeError, match="PROMETHEUS_MULTIPROC_DIR"):
        Metrics([], [], model_map, multiprocess_dir=str(tmp_path))
    # Set now, but prometheus_client was imported without it: its value store is per-process memory.
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="before prometheus_client"):
        Metrics([], [], model_map, multiprocess_dir=str(tmp_path))


WORKER = textwrap.dedent("""
    import os, sys
    from plugins.base import Completion
    from proxy.serve.metrics import Metrics
    from proxy.core.modelinfo import ModelMap
    from proxy.pipeline import Report

    m = Metrics(["acme"], [], ModelMap(), multiprocess_dir=os.environ["PROMETHEUS_MULTIPROC_DIR"])
    n = int(sys.argv[1])
    for _ in range(n):
        m.finished("acme", "gpt-4o-mini", 200, overhead=0.001, upstream=1.5, ttft=0.2, usage=None)
    r = Report(model="gpt-4o-mini", tenant="acme", context_manager="x", tokens_before=100 * n,
               removed={"windowed": 10 * n})
    m.assembled("acme", "gpt-4o-mini", r)
    from proxy.serve.costs import request_cost
    m.account("acme", "gpt-4o-mini", request_cost(r, "gpt-4o-mini", m.model_map))
    m.summary_call("acme", Completion("s", "gpt-4o-mini", 1000, 100))
    m.payload_error("invalid_role")
""")

RENDER = textwrap.dedent("""
    import os, sys
    from proxy.serve.metrics import Metrics
    from proxy.core.modelinfo import ModelMap

    m = Metrics(["acme"], [], ModelMap(), multiprocess_dir=os.environ["PROMETHEUS_MULTIPROC_DIR"])
    body, _ = m.render()
    sys.stdout.write(body.decode())
""")


def run(code: str, mpdir: Path, *args: str) -> str:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(mpdir)}
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_multiprocess_render_sums_all_workers(tmp_path: Path, model_map: ModelMap) -> None:
    mpdir = tmp_path / "prom"
    mpdir.mkdir()
    run(WORKER, mpdir, "3")
    run(WORKER, mpdir, "4")
    assert len(list(mpdir.glob("*.db"))) >= 2
    got = {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(run(RENDER, mpdir))
        for s in family.samples
    }
    t = {"tenant": "acme", "model": MODEL}

    def v(name: str, **labels: str) -> float:
        return got.get((name, frozenset(labels.items())), 0.0)

    assert v("ctxproxy_requests_total", **t, wire="chat", status="200") == 7
    assert v("ctxproxy_tokens_received_total", **t, mode="enforce") == 700
    assert v("ctxproxy_tokens_removed_total", **t, mode="enforce", how="windowed") == 70
    assert v("ctxproxy_estimated_savings_usd_total", **t, mode="enforce") == pytest.approx(
        70 * (model_map.input_price(MODEL) or 0))
    assert v("ctxproxy_summarizer_cost_usd_total", **t) == pytest.approx(2 * (model_map.cost(MODEL, 1000, 100) or 0))
    assert v("ctxproxy_payload_errors_total", code="invalid_role") == 2
    assert v("ctxproxy_overhead_seconds_count") == 7
    assert v("ctxproxy_overhead_seconds_bucket", le="0.001") == 7
    assert v("ctxproxy_upstream_seconds_sum", **t) == pytest.approx(10.5)
    assert v("ctxproxy_upstream_ttft_seconds_bucket", **t, le="+Inf") == 7


def test_after_answer_metrics_keep_labels_bounded(metrics: Metrics) -> None:
    from proxy.core.usage import Usage
    from proxy.serve.costs import RequestCost
    from proxy.store.calibration import Sample
    from proxy.store.promptcache import CacheEffect

    metrics.account(KEY, KEY, RequestCost(KEY, 10, 1.0, 0.5, 0.1, 0.2, 0.2, True, CacheEffect(True, True, 5, 0, 3)))
    metrics.account("acme", MODEL, RequestCost(MODEL, 10, 0.1, 0.5, 0.0, 0.0, -0.4))
    metrics.calibration_factor(KEY, KEY, KEY, 1.3)
    metrics.calibration_sample(KEY, Sample(KEY, 1.3), Usage(1300), 1000, 1.3)
    metrics.calibration_sample(MODEL, Sample("used", 1.3), Usage(1300), 1000, 1.3)
    body = metrics.render()[0].decode()
    assert KEY not in body and "sk-" not in body
    # net here is gross - the prompt-cache effect; the summariser's cost is counted where it is paid (summary_call)
    assert value(metrics, "ctxproxy_net_savings_usd_total", tenant="other", model="other") == pytest.approx(0.7)
    assert value(metrics, "ctxproxy_net_savings_usd_total", tenant="acme", model=MODEL) == pytest.approx(0.1)
    assert value(metrics, "ctxproxy_prompt_cache_effect_tokens_total", tenant="other", model="other", kind="break") == 5
    assert value(metrics, "ctxproxy_token_calibration_factor", tenant="other", upstream="other", model="other") == 1.3
    assert value(metrics, "ctxproxy_calibration_samples_total", model="other", result="other") == 1
    assert value(metrics, "ctxproxy_token_count_error_ratio_count", model=MODEL, count="raw") == 1
    # (1000 - 1300) / 1300 raw; 1000 x 1.3 calibrated is exact
    assert value(metrics, "ctxproxy_token_count_error_ratio_bucket", model=MODEL, count="raw", le="-0.2") == 1
    assert value(metrics, "ctxproxy_token_count_error_ratio_bucket", model=MODEL, count="calibrated", le="0.0") == 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.floats(min_value=0, max_value=1e6, allow_nan=False),
                          st.sampled_from([0.0, 0.005, 0.01, 0.25, 1.0, 10.0, math.inf]),
                          st.floats(min_value=-2, max_value=2, allow_nan=False)), max_size=30))
def test_series_count_exactly_as_the_library_does(amounts: list[float]) -> None:
    """The remembered series (``_child``) skip the library's per-call checks, not its arithmetic: every counter
    and histogram figure equals the library's own ``inc`` / ``observe`` on the same amounts."""
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    made = {}
    for name, registry in (("ours", ours), ("theirs", theirs)):
        made[name] = (Counter("c", "c", ("k",), registry=registry),
                      Histogram("h", "h", ("k",), buckets=(0.01, 0.25, 1.0, 5.0), registry=registry))
    series = {(kind, label): _series(metric.labels(label))
              for kind, metric in zip(("c", "h"), made["ours"]) for label in ("a", "b")}
    plain: dict[tuple[str, str], Any] = {(kind, label): metric.labels(label)
                                         for kind, metric in zip(("c", "h"), made["theirs"]) for label in "ab"}
    for i, amount in enumerate(amounts):
        label = "ab"[i % 2]
        if amount >= 0:
            series[("c", label)].inc(amount)
            plain[("c", label)].inc(amount)
        series[("h", label)].observe(amount)
        plain[("h", label)].observe(amount)

    def figures(registry: CollectorRegistry) -> list[tuple[str, tuple[tuple[str, str], ...], float]]:
        return sorted((s.name, tuple(sorted(s.labels.items())), s.value)
                      for family in text_string_to_metric_families(generate_latest(registry).decode())
                      for s in family.samples if not s.name.endswith("_created"))

    assert figures(ours) == figures(theirs)
    assert all(not isinstance(s, (Counter, Histogram)) for s in series.values())  # the fast series were made
