"""Hostile and unusual Messages bodies through the proxy, from the outside (HTTP against the fake Anthropic
upstream): each test is a defect found by probing the wire, and fails without its fix."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from tests.conftest import RunningProxy, StartProxy
from tests.fake_upstream import FakeUpstream
from tests.outside import share_model_map
from tests.wire.messages_helpers import CLAUDE

UPSTREAM_KEY = "sk-ant-upstream-secret"


@pytest.fixture(autouse=True)
def _shared_model_map(monkeypatch: pytest.MonkeyPatch) -> None:
    share_model_map(monkeypatch)  # speed only


def config(upstream: FakeUpstream, *, emulate: bool = False, **extra: Any) -> dict[str, Any]:
    up: dict[str, Any] = {"base_url": upstream.url, "api": "anthropic", "api_key": UPSTREAM_KEY}
    if emulate:
        up["context_management"] = "emulate"
    out: dict[str, Any] = {
        "upstreams": {"a": up},
        "models": [{"name": CLAUDE, "context_window": 200_000, "max_output_tokens": 64_000}],
        "cache": {"backend": "memory"},
        "summarizer": {"retry_backoff_seconds": 0},
    }
    out.update(extra)
    return out


async def post(proxy: RunningProxy, payload: Any, path: str = "/v1/messages",
               headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(proxy.url + path, data=json.dumps(payload).encode(), headers={
            "x-api-key": "sk-ant-client", "content-type": "application/json", **(headers or {})}) as r:
        return r.status, await r.json(content_type=None)


def result(tid: str, content: str = "r") -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": tid, "content": content}


def assert_invalid_request(status: int, body: Any) -> None:
    assert status == 400, (status, body)
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body


# --------------------------------------------------------------------------- nothing left after the repair

STRAY_ONLY = {
    "one stray result": [{"role": "user", "content": [result("toolu_gone")]}],
    "two stray results in two user messages": [{"role": "user", "content": [result("toolu_a")]},
                                               {"role": "user", "content": [result("toolu_b")]}],
}


@pytest.mark.parametrize("messages", list(STRAY_ONLY.values()), ids=list(STRAY_ONLY))
async def test_a_conversation_of_stray_results_is_refused_not_forwarded_empty(
        upstream: FakeUpstream, start_proxy: StartProxy, messages: list[dict[str, Any]]) -> None:
    """Every block is an orphan tool_result: the repair leaves nothing, and ``messages: []`` is not a request
    (Anthropic answers 400 to it). It used to be forwarded empty: a results-only user message that does not
    follow an assistant message carries an internal boundary item that hid the emptiness."""
    proxy = await start_proxy(config(upstream))
    status, body = await post(proxy, {"model": CLAUDE, "max_tokens": 16, "messages": messages})
    assert_invalid_request(status, body)
    assert "after the pairing repair" in body["error"]["message"]
    assert upstream.messages == []


async def test_count_tokens_of_stray_results_is_refused_not_counted_empty(
        upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(config(upstream))
    status, body = await post(proxy, {"model": CLAUDE, "messages": STRAY_ONLY["one stray result"]},
                              path="/v1/messages/count_tokens")
    assert_invalid_request(status, body)
    assert upstream.counts == []


async def test_a_resumed_compaction_that_leaves_only_a_stray_result_is_refused(
        upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """Emulated compaction drops everything before a foreign compaction block: the tool_use before it goes, its
    result after it is a stray, and nothing is left to forward."""
    proxy = await start_proxy(config(upstream, emulate=True))
    messages = [{"role": "user", "content": "x"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Read", "input": {}},
                                                  {"type": "compaction", "content": "", "encrypted_content": "e"}]},
                {"role": "user", "content": [result("t1")]}]
    status, body = await post(proxy, {"model": CLAUDE, "max_tokens": 16, "messages": messages,
                                      "context_management": {"edits": [{"type": "compact_20260112"}]}})
    assert_invalid_request(status, body)
    assert upstream.messages == []


# --------------------------------------------------------------------------- max_tokens: null


async def test_max_tokens_null_is_refused_as_missing(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """``max_tokens`` is required on this wire; a null one used to pass the check and reach the provider."""
    proxy = await start_proxy(config(upstream))
    status, body = await post(proxy, {"model": CLAUDE, "max_tokens": None,
                                      "messages": [{"role": "user", "content": "hi"}]})
    assert_invalid_request(status, body)
    assert "max_tokens" in body["error"]["message"]
    assert upstream.messages == []


async def test_count_tokens_with_max_tokens_null_is_counted_and_relayed_without_it(
        upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """count_tokens takes no max_tokens: a null one is the same as none, and the tenant's output cap the proxy
    budgets with is never relayed (it used to be relayed as ``max_tokens: <cap>``)."""
    proxy = await start_proxy(config(upstream, tenants=[{"name": "t", "keys": ["k1"], "max_output_tokens": 100}]))
    messages = [{"role": "user", "content": "hi"}]
    status, body = await post(proxy, {"model": CLAUDE, "max_tokens": None, "messages": messages},
                              path="/v1/messages/count_tokens", headers={"x-api-key": "k1"})
    assert status == 200 and body == {"input_tokens": upstream.count_tokens_answer}
    assert upstream.counts[-1].body == {"model": CLAUDE, "messages": messages}


# --------------------------------------------------------------------------- context_management: null


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
async def test_a_null_context_management_is_not_sent_to_an_upstream_that_lacks_it(
        upstream: FakeUpstream, start_proxy: StartProxy, path: str) -> None:
    """For an upstream that lacks context_management the proxy removes the field; a null one used to slip
    through to it (and the answer gets no report: the request asked for no edits)."""
    proxy = await start_proxy(config(upstream, emulate=True))
    status, body = await post(proxy, {"model": CLAUDE, "max_tokens": 16, "context_management": None,
                                      "messages": [{"role": "user", "content": "hi"}]}, path=path)
    assert status == 200, body
    sent = (upstream.counts if path.endswith("count_tokens") else upstream.messages)[-1].body
    assert "context_management" not in sent
    assert "context_management" not in body


# --------------------------------------------------------------------------- a clamped max_tokens and thinking


async def test_a_clamped_max_tokens_keeps_the_thinking_budget_below_it(
        upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """Anthropic requires 1024 <= thinking.budget_tokens < max_tokens. A tenant's output cap that clamps
    max_tokens used to leave the budget above it: a request the provider refuses, forwarded and paid for."""
    proxy = await start_proxy(config(upstream, tenants=[{"name": "t", "keys": ["k1"], "max_output_tokens": 2_000}]))
    thinking = {"type": "enabled", "budget_tokens": 10_000}
    status, body = await post(proxy, {"model": CLAUDE, "max_tokens": 16_000, "thinking": thinking,
                                      "messages": [{"role": "user", "content": "hi"}]}, headers={"x-api-key": "k1"})
    assert status == 200, body
    sent = upstream.messages[-1].body
    assert sent["max_tokens"] == 2_000
    assert 1_024 <= sent["thinking"]["budget_tokens"] < sent["max_tokens"]


async def test_a_cap_with_no_room_for_thinking_is_refused_before_the_upstream(
        upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(config(upstream, tenants=[{"name": "t", "keys": ["k1"], "max_output_tokens": 1_000}]))
    status, body = await post(proxy, {"model": CLAUDE, "max_tokens": 4_000,
                                      "thinking": {"type": "enabled", "budget_tokens": 2_048},
                                      "messages": [{"role": "user", "content": "hi"}]}, headers={"x-api-key": "k1"})
    assert_invalid_request(status, body)
    assert "budget_tokens" in body["error"]["message"]
    assert upstream.messages == []


async def test_a_budget_already_below_the_clamped_max_tokens_is_left_alone(
        upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(config(upstream, tenants=[{"name": "t", "keys": ["k1"], "max_output_tokens": 2_000}]))
    thinking = {"type": "enabled", "budget_tokens": 1_500}
    status, _ = await post(proxy, {"model": CLAUDE, "max_tokens": 16_000, "thinking": thinking,
                                   "messages": [{"role": "user", "content": "hi"}]}, headers={"x-api-key": "k1"})
    assert status == 200
    assert upstream.messages[-1].body["thinking"] == thinking
