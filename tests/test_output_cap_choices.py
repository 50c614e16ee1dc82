"""A tenant's max_output_tokens covers a request's whole output: with ``n`` choices each gets its share.

Without it, ``n: 128`` with ``max_tokens`` at the cap bought 128 times the output the key allows.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import StartProxy, base_config
from tests.fake_upstream import FakeUpstream
from tests.outside import post

HI = [{"role": "user", "content": "hi"}]


def tenant(policy: str = "clamp") -> dict[str, Any]:
    return {"name": "t", "keys": ["sk-t"], "max_output_tokens": 100, "max_output_policy": policy}


@pytest.mark.parametrize(("extra", "sent"), [
    ({"n": 4, "max_tokens": 100}, {"max_tokens": 25}),
    ({"n": 4}, {"max_tokens": 25}),
    ({"n": 3, "max_completion_tokens": 90}, {"max_completion_tokens": 33}),
    ({"n": 4, "max_tokens": 20}, {"max_tokens": 20}),  # within its share: untouched
    ({"n": 1, "max_tokens": 100}, {"max_tokens": 100}),
])
async def test_clamped_to_each_choices_share(start_proxy: StartProxy, upstream: FakeUpstream,
                                             extra: dict[str, Any], sent: dict[str, int]) -> None:
    proxy = await start_proxy(base_config(upstream.base_url, tenants=[tenant()]))
    status, _, body = await post(proxy, {"model": "gpt-4o-mini", "messages": HI, **extra}, key="sk-t")
    assert status == 200, body
    forwarded = upstream.chat[-1].body
    for key, value in sent.items():
        assert forwarded[key] == value
    assert forwarded.get("n", 1) * max(forwarded.get(k, 0) for k in ("max_tokens", "max_completion_tokens")) <= 100


@pytest.mark.parametrize(("policy", "extra"), [
    ("clamp", {"n": 101}),  # not even one token per choice
    ("refuse", {"n": 2, "max_tokens": 80}),
    # pydantic-based upstreams (vLLM, llama-cpp-python, LiteLLM's proxy) read these as 4: never one choice here
    ("clamp", {"n": 4.0, "max_tokens": 100}),
    ("clamp", {"n": "4", "max_tokens": 100}),
    ("clamp", {"n": True, "max_tokens": 100}),
    ("clamp", {"n": 0}),
])
async def test_refused_when_the_share_cannot_hold(start_proxy: StartProxy, upstream: FakeUpstream, policy: str,
                                                  extra: dict[str, Any]) -> None:
    proxy = await start_proxy(base_config(upstream.base_url, tenants=[tenant(policy)]))
    status, _, body = await post(proxy, {"model": "gpt-4o-mini", "messages": HI, **extra}, key="sk-t")
    assert status == 400, body
    assert body["error"]["code"] in ("max_tokens_exceeded", "invalid_n"), body
    assert upstream.chat == []


async def test_a_stray_n_on_another_wire_does_not_shrink_its_cap(
    start_proxy: StartProxy, upstream: FakeUpstream
) -> None:
    proxy = await start_proxy(base_config(upstream.base_url, tenants=[tenant()]))
    status, _, body = await post(proxy, {"model": "gpt-4o-mini", "input": "hi", "n": 4}, key="sk-t",
                                 path="/v1/responses")
    assert status == 200, body
    assert upstream.responses[-1].body["max_output_tokens"] == 100
