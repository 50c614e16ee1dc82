"""A `provider: litellm` route passes litellm only the wire's own request fields.

litellm reads many keyword arguments as its own (``base_url``, ``api_base``, ``api_key``,
``extra_body``, ``extra_headers``, ``mock_response``, ``fallbacks`` …). Passed on from a client's body,
they sent the operator's key to a host of the client's choosing, lifted a tenant's output cap, or
answered locally. Two fake upstreams on 127.0.0.1: the route's own, and the one a hostile body names.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.conftest import StartProxy, base_config
from tests.fake_upstream import FakeUpstream
from tests.outside import post

pytestmark = pytest.mark.filterwarnings("ignore:.*ReadOnly.*:UserWarning")

HOSTILE: list[tuple[str, Any]] = [
    ("base_url", None), ("api_base", None), ("api_key", "sk-client-own"),
    ("extra_body", {"max_tokens": 9999}), ("extra_headers", {"X-Evil": "1"}), ("headers", {"X-Evil": "1"}),
    ("mock_response", "answered locally"), ("fallbacks", ["gpt-4o"]), ("timeout", 0.001), ("num_retries", 50),
    ("custom_llm_provider", "anthropic"), ("metadata", {"model_group": "x"}),
]


@pytest.fixture
async def evil() -> AsyncIterator[FakeUpstream]:
    fake = await FakeUpstream().start()
    yield fake
    await fake.stop()


@pytest.mark.parametrize(("field", "value"), HOSTILE, ids=[f for f, _ in HOSTILE])
async def test_litellm_only_arguments_in_a_body_never_reach_litellm(
        start_proxy: StartProxy, upstream: FakeUpstream, evil: FakeUpstream, field: str, value: Any) -> None:
    cfg = base_config(upstream.base_url,
                      models=[{"name": "ll", "provider": "litellm", "upstream": "fake", "model": "openai/gpt-4o-mini",
                               "context_window": 128000, "max_output_tokens": 1000}],
                      tenants=[{"name": "acme", "keys": ["sk-acme"], "models": ["ll"], "max_output_tokens": 50}])
    proxy = await start_proxy(cfg)
    if value is None:
        value = evil.base_url
    status, _, body = await post(proxy, {"model": "ll", "messages": [{"role": "user", "content": "hi"}],
                                         field: value}, key="sk-acme")
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] != "answered locally"
    assert evil.chat == [] and evil.other == []  # the hostile host saw nothing, least of all the operator's key
    sent = upstream.chat[-1]
    assert sent.headers["Authorization"] == "Bearer sk-upstream-secret"
    assert "X-Evil" not in sent.headers
    assert sent.body.get("max_tokens", 0) <= 50  # the tenant's cap holds
    assert field not in sent.body


async def test_the_wires_own_fields_still_reach_the_provider(start_proxy: StartProxy, upstream: FakeUpstream) -> None:
    cfg = base_config(upstream.base_url,
                      models=[{"name": "ll", "provider": "litellm", "upstream": "fake", "model": "openai/gpt-4o-mini",
                               "context_window": 128000, "max_output_tokens": 1000}])
    proxy = await start_proxy(cfg)
    status, _, body = await post(proxy, {
        "model": "ll", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.25, "seed": 7,
        "stop": ["END"], "user": "u-1", "max_tokens": 40}, key="sk-client")
    assert status == 200, body
    sent = upstream.chat[-1].body
    assert (sent["temperature"], sent["seed"], sent["stop"], sent["user"], sent["max_tokens"]) == (
        0.25, 7, ["END"], "u-1", 40)


async def test_responses_through_litellm_drop_litellm_arguments_too(
        start_proxy: StartProxy, upstream: FakeUpstream, evil: FakeUpstream) -> None:
    cfg = base_config(upstream.base_url,
                      models=[{"name": "ll", "provider": "litellm", "upstream": "fake", "model": "openai/gpt-4o-mini",
                               "context_window": 128000, "max_output_tokens": 1000}])
    proxy = await start_proxy(cfg)
    status, _, body = await post(proxy, {"model": "ll", "input": "hi", "base_url": evil.base_url,
                                         "extra_body": {"max_output_tokens": 9999}}, path="/v1/responses")
    assert status == 200, body
    assert evil.responses == [] and evil.other == []
    sent = upstream.responses[-1]
    assert sent.headers["Authorization"] == "Bearer sk-upstream-secret"
    assert "base_url" not in sent.body and "extra_body" not in sent.body


async def test_responses_fields_litellm_supports_reach_the_provider(
        start_proxy: StartProxy, upstream: FakeUpstream, caplog: pytest.LogCaptureFixture) -> None:
    cfg = base_config(upstream.base_url,
                      models=[{"name": "ll", "provider": "litellm", "upstream": "fake", "model": "openai/gpt-4o-mini",
                               "context_window": 128000, "max_output_tokens": 1000}])
    proxy = await start_proxy(cfg)
    for _ in range(2):
        status, _, body = await post(proxy, {"model": "ll", "input": "hi", "metadata": {"team": "a"},
                                             "base_url": "http://127.0.0.1:9"}, path="/v1/responses")
        assert status == 200, body
    assert upstream.responses[-1].body["metadata"] == {"team": "a"}
    dropped = [r for r in caplog.records if "not passed on to litellm" in r.getMessage()]
    assert len(dropped) == 1 and "'base_url'" in dropped[0].getMessage()  # said once, naming the field
