"""proxy.serve.explain over HTTP: ``POST /v1/ctxproxy/explain`` says what would be forwarded, and makes no call."""

from __future__ import annotations

import pytest

from tests.conftest import StartProxy
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
