"""Spellings of managed paths over HTTP: the pipeline or a 404, never the relay around it; errors in the wire's
shape."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from tests.conftest import StartProxy, base_config
from tests.fake_upstream import FakeUpstream
from tests.outside import post

HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path", ["/v1/chat/completions/", "/v1/chat//completions", "/v1/chat%2Fcompletions"])
async def test_odd_spellings_of_the_chat_path_go_through_the_pipeline(
        start_proxy: StartProxy, upstream: FakeUpstream, path: str) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    async with aiohttp.ClientSession() as s, s.post(proxy.url + path, json={"model": "gpt-4o-mini", "messages": HI},
                                                    headers={"Authorization": "Bearer sk-client"}) as r:
        assert r.status == 200
        assert "x-ctxproxy-tokens-in" in r.headers  # managed, not relayed


async def test_a_path_starting_with_two_slashes_is_not_served(start_proxy: StartProxy, upstream: FakeUpstream) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    async with aiohttp.ClientSession() as s, s.post(proxy.url + "//v1/chat/completions",
                                                    json={"model": "gpt-4o-mini", "messages": HI}) as r:
        assert r.status == 404
    assert upstream.chat == [] and upstream.other == []


@pytest.mark.parametrize("path", ["/v1/messages/count_tokens", "/messages/count_tokens"])
async def test_count_tokens_is_answered_on_both_spellings(
        start_proxy: StartProxy, upstream: FakeUpstream, path: str) -> None:
    upstream.count_tokens_served = False
    proxy = await start_proxy(base_config(upstream.base_url))
    async with aiohttp.ClientSession() as s, s.post(proxy.url + path, json={"model": "gpt-4o-mini", "messages": HI},
                                                    headers={"x-api-key": "sk-client"}) as r:
        assert r.status == 200, await r.text()
        body: Any = await r.json()
    assert isinstance(body["input_tokens"], int) and body["input_tokens"] > 0


@pytest.mark.parametrize("path", ["/messages", "/v1/messages"])
async def test_a_wrong_method_on_the_messages_path_answers_in_anthropics_shape(
        start_proxy: StartProxy, upstream: FakeUpstream, path: str) -> None:
    proxy = await start_proxy(base_config(upstream.base_url, tenants=[{"name": "t", "keys": ["sk-t"]}]))
    async with aiohttp.ClientSession() as s, s.put(proxy.url + path, json={}, headers={"x-api-key": "sk-t"}) as r:
        assert r.status >= 400
        body = await r.json(content_type=None)
    assert body["type"] == "error" and isinstance(body["error"]["type"], str), body


MODEL = "gpt-4o-mini"


TENANT_KEY = "sk-tenant-acme-7f3a"


def tenant_config(upstream_url: str, **tenant: Any) -> dict[str, Any]:
    return base_config(upstream_url, tenants=[{"name": "acme", "keys": [TENANT_KEY], **tenant}],
                       summarizer={"retry_backoff_seconds": 0, "timeout_seconds": 2, "max_summary_tokens": 300})


@pytest.mark.usefixtures("shared_model_map")
async def test_trailing_slash_chat_path_goes_through_the_pipeline(upstream: FakeUpstream, start_proxy: StartProxy
                                                                  ) -> None:
    """Every spelling of the chat path goes through the pipeline: the tenant's max_output_tokens holds."""
    proxy = await start_proxy(tenant_config(upstream.base_url, models=[MODEL], max_output_tokens=100))
    status, headers, body = await post(proxy, {"model": MODEL, "max_tokens": 5000,
                                               "messages": [{"role": "user", "content": "hi"}]},
                                       path="/v1/chat/completions/", key=TENANT_KEY)
    assert status == 200, body
    assert upstream.other == [], [r.path for r in upstream.other]
    assert [r.body["max_tokens"] for r in upstream.chat] == [100]
    assert "x-ctxproxy-tokens-out" in headers
