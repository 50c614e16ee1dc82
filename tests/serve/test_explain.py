"""proxy.serve.explain over HTTP: ``POST /v1/ctxproxy/explain`` says what would be forwarded, and makes no call."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import pytest

from tests.conftest import StartProxy, base_config
from tests.fake_upstream import FakeUpstream
from tests.outside import chat_body, post
from tests.store.test_summaries_http import config as summarising_config
from tests.store.test_summaries_http import conversation


@pytest.mark.usefixtures("shared_model_map")
async def test_explain_endpoint_never_calls_the_summariser(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """Explain reports what would be summarised without calling (and billing) any provider."""
    proxy = await start_proxy(summarising_config(upstream.base_url))
    status, _headers, body = await post(proxy, chat_body(conversation(40)), path="/v1/ctxproxy/explain")
    assert status == 200, body
    assert upstream.summaries == [] and upstream.chat == []
    report = body["report"]
    # what would be summarised is reported (turns, tokens, whether a cached summary exists; names are the fix's)
    assert any("summar" in k and v for k, v in report.items() if k != "summary"), report


MODEL = "gpt-4o-mini"


@pytest.mark.usefixtures("shared_model_map")
async def test_explain_writes_a_request_log_line(upstream: FakeUpstream, start_proxy: StartProxy,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """An explain request is logged like any other request: one line with its request id."""
    caplog.set_level(logging.INFO, logger="ctxproxy.requests")
    proxy = await start_proxy(base_config(upstream.base_url))
    rid = "0b7f7d3e-4a53-4d7e-9d8c-5a2b1f0e9c41"
    status, _headers, body = await post(proxy, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                                        path="/v1/ctxproxy/explain", headers={"x-request-id": rid})
    assert status == 200, body
    lines = [r.getMessage() for r in caplog.records if r.name == "ctxproxy.requests"]
    assert any(rid in line for line in lines), lines


SMALL = "small-model"  # tests.store.test_summaries_http: 8k window, keep_turns 4, summariser gpt-4o-mini


async def loop_lag_until(done: asyncio.Future[Any], tick: float = 0.005) -> float:
    """The longest the event loop (shared by this test's client and the proxy) was held up while ``done`` ran."""
    loop = asyncio.get_running_loop()
    worst, last = 0.0, loop.time()
    while not done.done():
        await asyncio.sleep(tick)
        now = loop.time()
        worst, last = max(worst, now - last - tick), now
    return worst


@pytest.mark.slow
async def test_a_large_explain_call_does_not_stall_the_event_loop(upstream: FakeUpstream, start_proxy: StartProxy
                                                                   ) -> None:
    """A huge body on ``/v1/ctxproxy/explain`` is assembled off the event loop, as on the chat path: other
    requests are not held up while it runs."""
    from tests.core.test_offload_http import PROMPT_LIMIT, SMALL, huge_body
    from tests.core.test_offload_http import post as post_raw

    proxy = await start_proxy(base_config(upstream.base_url))  # a fresh proxy: the big body's counts are cold
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        for _ in range(2):  # warm-up: tokenizer, connection pools
            assert (await post_raw(s, proxy.url + "/v1/chat/completions", SMALL))[0] == 200
        big = asyncio.ensure_future(post_raw(s, proxy.url + "/v1/ctxproxy/explain", huge_body()))
        worst = await loop_lag_until(big)
        status, _, raw = await big
    assert status == 200, raw[:300]
    # the same body on the chat path holds the loop for ~30 ms (tests/core/test_offload_http.py)
    assert worst < PROMPT_LIMIT, f"the event loop was held for {1000 * worst:.0f} ms by one explain call"


async def test_explaining_in_observe_mode_a_body_without_its_conversation_answers_null(
        upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """Observe mode forwards a body enforce would refuse; explain says so with the field it would forward: null when
    the body has none (schemathesis found a 200 whose ``messages`` the OpenAPI document said could not be null)."""
    import yaml

    from tests.conftest import ROOT

    proxy = await start_proxy(base_config(upstream.base_url))
    async with aiohttp.ClientSession() as s, s.post(
            proxy.url + "/v1/ctxproxy/explain/chat?mode=observe", json={"model": "gpt-4o-mini", "input": ""},
            headers={"Authorization": "Bearer sk-client"}) as r:
        assert r.status == 200
        out = await r.json()
    assert out["messages"] is None and out["report"]["would_refuse"]
    spec = yaml.safe_load((ROOT / "proxy" / "openapi.yaml").read_text(encoding="utf-8"))
    assert spec["components"]["schemas"]["Explanation"]["properties"]["messages"]["nullable"] is True
