"""Calibration end to end (issue 15): a provider whose tokenizer counts 1.3x o200k, through the real server.

The fake upstream reports ``prompt_tokens`` = 1.3 x the true o200k count of what it received. With
calibration, after a handful of answers the factor is 1.3 and no forwarded payload exceeds the window
as the upstream counts it; with calibration off, the same conversation overflows it.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from tests.conftest import RunningProxy, StartProxy, base_config
from tests.fake_upstream import FakeUpstream, request_tokens
from tests.outside import metric_total, scrape
from tests.test_summarisation import conversation

MODEL = "gpt-4o-mini"
WINDOW, OUTPUT = 8000, 1000
RESERVE = min(OUTPUT, WINDOW // 4)  # the completion reserve: the model's max output, at most a quarter of the window
SCALE = 1.3
HANDFUL = 3  # answers before the factor is learned (MIN_SAMPLES)


def config(url: str, calibration: Any = "auto", **extra: Any) -> dict[str, Any]:
    cfg = base_config(
        url,
        models=[{"name": MODEL, "context_window": WINDOW, "max_output_tokens": OUTPUT, "calibration": calibration}],
        summarizer_model=MODEL,
        context_manager={"type": "summarising", "params": {"keep_turns": 4}},
        summarizer={"retry_backoff_seconds": 0, "timeout_seconds": 5, "max_summary_tokens": 300},
    )
    cfg.update(extra)
    return cfg


async def post(s: aiohttp.ClientSession, proxy: RunningProxy, messages: list[dict[str, Any]],
               **extra: Any) -> tuple[int, dict[str, str], bytes]:
    async with s.post(proxy.url + "/v1/chat/completions", json={"model": MODEL, "messages": messages, **extra},
                      headers={"Authorization": "Bearer sk-client"}) as r:
        return r.status, dict(r.headers), await r.read()


async def policy(s: aiohttp.ClientSession, proxy: RunningProxy, model: str = MODEL) -> dict[str, Any]:
    async with s.get(proxy.url + f"/v1/ctxproxy/policy?model={model}",
                     headers={"Authorization": "Bearer sk-client"}) as r:
        assert r.status == 200
        body: dict[str, Any] = await r.json()
        return body["calibration"][model]


async def run(upstream: FakeUpstream, proxy: RunningProxy, turns: range) -> list[int]:
    """The provider's prompt_tokens of every request of a growing conversation."""
    async with aiohttp.ClientSession() as s:
        for n in turns:
            status, _, _ = await post(s, proxy, conversation(n))
            assert status == 200
    return [u["prompt_tokens"] for u in upstream.usages]


async def test_the_factor_converges_and_no_payload_overflows(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    upstream.prompt_scale = SCALE
    proxy = await start_proxy(config(upstream.base_url))
    counts = await run(upstream, proxy, range(3, 61))
    # what the upstream counted is what it received, times 1.3 (the fake counts independently of the proxy)
    assert counts == [round(SCALE * request_tokens(r.body)) for r in upstream.chat]
    async with aiohttp.ClientSession() as s:
        learned = await policy(s, proxy)
    assert learned["source"] == "learned" and learned["factor"] == pytest.approx(SCALE, abs=0.02)
    assert learned["upstream"] == "fake" and learned["upstream_model"] == MODEL
    assert max(counts) > (WINDOW - RESERVE) * 0.8  # the conversation did press against the window
    assert [c for c in counts[HANDFUL:] if c > WINDOW - RESERVE] == []  # fits with room for the answer
    text = await scrape(proxy)
    assert metric_total(text, "ctxproxy_token_calibration_factor", upstream="fake", model=MODEL) == learned["factor"]
    assert metric_total(text, "ctxproxy_calibration_samples_total", model=MODEL, result="used") == len(counts)
    # the accuracy histogram: raw counts are ~23 % low ((1 - 1.3) / 1.3), calibrated ones within a per cent
    assert metric_total(text, "ctxproxy_token_count_error_ratio_count", model=MODEL, count="raw") == len(counts)
    assert metric_total(text, "ctxproxy_token_count_error_ratio_bucket", model=MODEL, count="raw", le="-0.2") \
        == len(counts)
    late = metric_total(text, "ctxproxy_token_count_error_ratio_bucket", model=MODEL, count="calibrated", le="0.02") \
        - metric_total(text, "ctxproxy_token_count_error_ratio_bucket", model=MODEL, count="calibrated", le="-0.02")
    assert late >= len(counts) - HANDFUL


async def test_with_calibration_off_the_same_run_overflows(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    upstream.prompt_scale = SCALE
    proxy = await start_proxy(config(upstream.base_url, calibration="off"))
    counts = await run(upstream, proxy, range(3, 61))
    over = [c for c in counts if c > WINDOW - RESERVE]
    assert over, "without calibration the upstream would have seen no overflow: the test proves nothing"
    assert max(counts) > WINDOW  # beyond the window itself: a real provider refuses these
    async with aiohttp.ClientSession() as s:
        shown = await policy(s, proxy)
    assert (shown["factor"], shown["source"]) == (1.0, "off")
    assert shown["learned"] == pytest.approx(SCALE, abs=0.02)  # still learned, for the operator to see


async def test_a_pinned_factor_and_explain(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(config(upstream.base_url, calibration=1.5))
    async with aiohttp.ClientSession() as s, s.post(
            proxy.url + "/v1/ctxproxy/explain", json={"model": MODEL, "messages": conversation(40)},
            headers={"Authorization": "Bearer sk-client"}) as r:
        assert r.status == 200
        report = (await r.json())["report"]
    assert report["calibration"] == 1.5
    assert report["calibration_detail"]["source"] == "pinned"
    b = WINDOW - RESERVE - WINDOW // 10
    assert report["hard_budget"] == int(b / 1.5)
    assert report["tokens_after"] <= report["hard_budget"]


async def test_streamed_answers_teach_it_too(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    upstream.prompt_scale = SCALE
    proxy = await start_proxy(config(upstream.base_url))
    async with aiohttp.ClientSession() as s:
        for n in range(3, 3 + HANDFUL):
            status, _, raw = await post(s, proxy, conversation(n), stream=True,
                                        stream_options={"include_usage": True})
            assert status == 200 and raw.endswith(b"data: [DONE]\n\n")
        status, _, _ = await post(s, proxy, conversation(9), stream=True)  # no usage asked for: no sample
        assert (await policy(s, proxy))["factor"] == pytest.approx(SCALE, abs=0.02)
    text = await scrape(proxy)
    assert metric_total(text, "ctxproxy_calibration_samples_total", model=MODEL, result="used") == HANDFUL
    assert metric_total(text, "ctxproxy_calibration_samples_total", model=MODEL, result="no_usage") == 1


@pytest.mark.parametrize("usage", [
    {"prompt_tokens": 0},
    {"prompt_tokens": -40},
    {"prompt_tokens": "4000"},
    {"prompt_tokens": 10},  # the fake's fixed usage: not a count of this payload
    {"prompt_tokens": 10**9},
    None,
])
async def test_odd_usage_teaches_nothing(upstream: FakeUpstream, start_proxy: StartProxy, usage: Any) -> None:
    proxy = await start_proxy(config(upstream.base_url, models=[
        {"name": MODEL, "model": "SmolLM2-135M-Instruct", "context_window": WINDOW, "max_output_tokens": OUTPUT}]))
    upstream.fixed_usage = usage
    async with aiohttp.ClientSession() as s:
        for n in range(3, 9):
            status, _, _ = await post(s, proxy, conversation(n))
            assert status == 200
        shown = await policy(s, proxy)
    assert (shown["factor"], shown["source"], shown["samples"]) == (1.2, "default", 0)  # SmolLM's default, unmoved
