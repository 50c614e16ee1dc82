"""proxy.serve.explain over HTTP: ``POST /v1/ctxproxy/explain`` says what would be forwarded, and makes no call."""

from __future__ import annotations

import logging

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
