"""Regression tests for the final review's cost and count_tokens findings (over HTTP)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from proxy.serve.report import cost_report
from tests.conftest import StartProxy, base_config
from tests.fake_upstream import FakeUpstream
from tests.helpers import words


def priced_total(proxy: Any, name: str) -> float:
    text = proxy.state.metrics.render()[0].decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


async def test_count_tokens_is_not_refused_by_a_tenants_output_cap(upstream: FakeUpstream,
                                                                   start_proxy: StartProxy) -> None:
    """count_tokens sets no max_tokens: a refusing output cap has nothing to refuse."""
    cfg = base_config(upstream.base_url)
    cfg["models"] = [{"name": "claude-x", "context_window": 200_000, "max_output_tokens": 64_000}]
    cfg["tenants"] = [{"name": "t", "keys": ["k1"], "max_output_tokens": 1000, "max_output_policy": "refuse"}]
    proxy = await start_proxy(cfg)
    body = {"model": "claude-x", "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as s, s.post(proxy.url + "/v1/messages/count_tokens", json=body,
                                                    headers={"x-api-key": "k1"}) as r:
        assert r.status == 200, await r.text()
        assert (await r.json())["input_tokens"] > 0


async def test_a_request_the_upstream_failed_saved_nothing(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """Tokens removed from a request whose answer failed are counted as tokens, never as money saved."""
    cfg = base_config(upstream.base_url, context_manager={"type": "sliding-window",
                                                          "params": {"keep_turns": 1, "cut_step": 1}})
    cfg["trimmer"] = {"max_tokens": 2000}
    proxy = await start_proxy(cfg)
    upstream.mode, upstream.status = "status", 500
    msgs: list[dict[str, Any]] = []
    for i in range(6):
        msgs += [{"role": "user", "content": words(300, i)}, {"role": "assistant", "content": words(300, i + 50)}]
    msgs.append({"role": "user", "content": "now"})
    async with aiohttp.ClientSession() as s, s.post(proxy.url + "/v1/chat/completions",
                                                    json={"model": "gpt-4o-mini", "messages": msgs}) as r:
        assert r.status == 500
        assert int(r.headers["x-ctxproxy-tokens-out"]) < int(r.headers["x-ctxproxy-tokens-in"])
    await asyncio.sleep(0.05)  # the after-answer step runs on the next loop turn
    assert priced_total(proxy, "ctxproxy_tokens_removed_total") > 0
    assert priced_total(proxy, "ctxproxy_estimated_savings_usd_total") == 0
    assert priced_total(proxy, "ctxproxy_net_savings_usd_total") == 0
    await proxy.state.shared.ledger.flush()
    total = (await cost_report(proxy.state.shared.ledger.store, 3600))["total"]
    assert total["gross_usd"] == 0 and total["net_usd"] == 0


async def test_a_summary_made_by_compact_is_paid_for_in_the_ledger(upstream: FakeUpstream,
                                                                   start_proxy: StartProxy) -> None:
    """Every summariser call counts against net savings and in the cost report, whatever asked for it."""
    cfg = base_config(upstream.base_url)
    cfg["upstreams"]["fake"]["responses_compact"] = "emulate"
    proxy = await start_proxy(cfg)
    items: list[dict[str, Any]] = []
    for i in range(4):
        items += [{"role": "user", "content": words(200, i)}, {"role": "assistant", "content": words(200, i + 9)}]
    items.append({"role": "user", "content": "go"})
    async with aiohttp.ClientSession() as s, s.post(proxy.url + "/v1/responses/compact",
                                                    json={"model": "gpt-4o-mini", "input": items}) as r:
        assert r.status == 200, await r.text()
    assert len(upstream.summaries) == 1
    paid = priced_total(proxy, "ctxproxy_summarizer_cost_usd_total")
    assert paid > 0
    assert priced_total(proxy, "ctxproxy_net_loss_usd_total") == paid
    await proxy.state.shared.ledger.flush()
    total = (await cost_report(proxy.state.shared.ledger.store, 3600))["total"]
    assert abs(total["summarizer_usd"] - paid) < 1e-12 and abs(total["net_usd"] + paid) < 1e-12
