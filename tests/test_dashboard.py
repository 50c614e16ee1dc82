"""The Grafana dashboard only queries series a real ``Metrics`` exports, with labels those series have."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from plugins.base import Completion
from proxy.core.modelinfo import ModelMap
from proxy.core.usage import Usage
from proxy.pipeline import Report
from proxy.serve.costs import RequestCost
from proxy.serve.metrics import Metrics
from proxy.store.calibration import Sample
from proxy.store.promptcache import CacheEffect

DASHBOARD = Path(__file__).resolve().parent.parent / "config" / "grafana-dashboard.json"
METRIC = re.compile(r"\bctxproxy_[A-Za-z0-9_:]*")
SELECTOR = re.compile(r"\b(ctxproxy_[A-Za-z0-9_:]*)\s*\{([^}]*)\}")
MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
GROUPING = re.compile(r"\bby\s*\(([^)]*)\)")

REQUIRED_TITLES = [
    "Summariser cost vs estimated savings per tenant",
    "Re-fetches per 100 requests by how",
    "Tokens received vs forwarded",
    "Tokens removed by how",
    "Summaries by result",
    "Repairs by kind",
    "Payload errors by code",
    "Proxy overhead p50/p99",
    "Upstream latency p50/p99",
    "Upstream TTFT p50/p99",
    "Requests by status",
    "Provider cached tokens",
    "Prefix stability share",
    "Cache errors by operation",
    "Gross, costs and net per tenant and model",
    "Prompt-cache effect by kind",
    "Token calibration factor",
    "Token count error p10/p50/p90",
    "Calibration samples by result",
    "Overflow refusals: recovered vs failed",
    "Savings: observed (would-be) vs enforced per tenant",
    "Observed: tokens received vs what enforce would forward",
    "Observed: requests enforce would refuse, by code",
    "Background summaries by result",
    "Requests that waited for a summariser (p50, rate)",
]
# the series whose mode=observe samples are what enforce would have done (proxy.serve.metrics)
MODED = ("ctxproxy_estimated_savings_usd_total", "ctxproxy_tokens_received_total", "ctxproxy_tokens_forwarded_total",
         "ctxproxy_tokens_removed_total")


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    data = json.loads(DASHBOARD.read_text())
    assert isinstance(data, dict)
    return data


def walk_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from walk_panels(panel.get("panels", []))


def expressions(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in walk_panels(dashboard["panels"]) for t in p.get("targets", []) if "expr" in t]
    for var in dashboard["templating"]["list"]:
        if var.get("type") != "query":
            continue
        query = var.get("query")
        exprs.append(query["query"] if isinstance(query, dict) else query)
        if var.get("definition"):
            exprs.append(var["definition"])
    return exprs


@pytest.fixture(scope="module")
def names() -> dict[str, set[str]]:
    return exported()


def exported() -> dict[str, set[str]]:
    """Every sample name a Metrics instance exports after each method ran once, with its label names."""
    m = Metrics(["acme"], ["gpt-4o-mini"], ModelMap(), upstreams=["openai"])
    report = Report(model="gpt-4o-mini", tenant="acme", context_manager="summarising", tokens_before=100,
                    tokens_after=40, removed={"summarised": 50, "trimmed": 10}, summary="created",
                    repairs={"orphan_result": 1})
    m.summary_call("acme", Completion("summary", "gpt-4o-mini", 100, 20))
    m.cache_error("get", OSError("down"))
    m.assembled("acme", "gpt-4o-mini", report)
    m.finished("acme", "gpt-4o-mini", 200, overhead=0.002, upstream=1.2, ttft=0.3,
               usage={"prompt_tokens_details": {"cached_tokens": 30}})
    m.payload_error("invalid_role")
    m.prefix("acme", "gpt-4o-mini", True)
    m.refetched("acme", "gpt-4o-mini", {"masked": 1, "summarised": 1, "dropped": 1})
    m.background_summary("acme", "used")
    m.assembled("acme", "gpt-4o-mini", Report(model="gpt-4o-mini", tenant="acme", context_manager="summarising",
                                              summary="created", summary_wait=1.5))
    for net in (0.5, -0.25):
        m.account("acme", "gpt-4o-mini", RequestCost(
            "gpt-4o-mini", 100, 1.0, 0.1, 0.2, 0.3, net, True, CacheEffect(True, True, 10, 2, 5, 1.0)))
    m.calibration_factor("acme", "openai", "gpt-4o-mini", 1.2)
    m.calibration_sample("gpt-4o-mini", Sample("used", 1.2), Usage(1200), 1000, 1.2)
    m.overflow("acme", "gpt-4o-mini", recovered=True)
    m.overflow("acme", "gpt-4o-mini", recovered=False)
    observed = Report(model="gpt-4o-mini", tenant="acme", context_manager="summarising", tokens_before=100,
                      tokens_after=40, removed={"summarised": 60}, mode="observe")
    m.assembled("acme", "gpt-4o-mini", observed)
    m.account("acme", "gpt-4o-mini", RequestCost("gpt-4o-mini", 60, 0.5), mode="observe")
    m.assembled("acme", "gpt-4o-mini", Report(model="gpt-4o-mini", tenant="acme", context_manager="summarising",
                                              mode="observe", would_refuse="context_length_exceeded"))
    body, _ = m.render()
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


def test_dashboard_is_valid_grafana_json(dashboard: dict[str, Any]) -> None:
    assert dashboard["schemaVersion"] >= 36
    assert any(i["name"] == "DS_PROMETHEUS" for i in dashboard["__inputs"])
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert "label_values(ctxproxy_requests_total, tenant)" in json.dumps(variables["tenant"]["query"])
    ids = [p["id"] for p in walk_panels(dashboard["panels"])]
    assert len(ids) == len(set(ids))
    for panel in walk_panels(dashboard["panels"]):
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}"
            assert panel["targets"], panel["title"]


def test_dashboard_has_the_panels(dashboard: dict[str, Any]) -> None:
    titles = {p["title"] for p in walk_panels(dashboard["panels"])}
    missing = [t for t in REQUIRED_TITLES if t not in titles]
    assert not missing


def test_every_queried_metric_is_exported(dashboard: dict[str, Any], names: dict[str, set[str]]) -> None:
    exprs = expressions(dashboard)
    referenced = {name for e in exprs for name in METRIC.findall(e)}
    assert len(referenced) >= 15
    unknown = sorted(referenced - names.keys())
    assert not unknown, f"dashboard queries metrics Metrics does not export: {unknown}"


def test_every_label_used_exists_on_its_metric(dashboard: dict[str, Any], names: dict[str, set[str]]) -> None:
    for expr in expressions(dashboard):
        for metric, matchers in SELECTOR.findall(expr):
            labels = set(MATCHER.findall(matchers))
            known = names.get(metric, set())
            assert labels <= known, f"{metric} has no label(s) {labels - known}"
        available = set().union(*(names.get(m, set()) for m in METRIC.findall(expr)))
        for clause in GROUPING.findall(expr):
            grouped = {label.strip() for label in clause.split(",") if label.strip()}
            assert grouped <= available, f"{expr}: no label(s) {grouped - available}"


def test_the_checks_catch_a_bogus_panel(names: dict[str, set[str]]) -> None:
    bogus = {"panels": [{"title": "x", "targets": [{"expr": "rate(ctxproxy_no_such_metric_total[5m])"}]}],
             "templating": {"list": []}}
    referenced = {name for e in expressions(bogus) for name in METRIC.findall(e)}
    assert referenced - names.keys() == {"ctxproxy_no_such_metric_total"}


def test_the_rollout_row_compares_observed_and_enforced_savings_per_tenant(dashboard: dict[str, Any]) -> None:
    """One panel puts what enforce saved next to what observe mode says it would have saved, per tenant; every
    other panel on those series shows enforced requests only, so would-be figures never inflate actual ones."""
    panels = {p["title"]: p for p in walk_panels(dashboard["panels"])}
    (expr,) = [t["expr"] for t in panels["Savings: observed (would-be) vs enforced per tenant"]["targets"]]
    assert "ctxproxy_estimated_savings_usd_total" in expr and GROUPING.findall(expr) == ["tenant, mode"]
    rollout = {"Savings: observed (would-be) vs enforced per tenant",
               "Observed: tokens received vs what enforce would forward"}
    for panel in walk_panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            for metric, matchers in SELECTOR.findall(target["expr"]):
                if metric in MODED and panel["title"] not in rollout:
                    assert 'mode!="observe"' in matchers, (panel["title"], target["expr"])
