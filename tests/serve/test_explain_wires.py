"""``POST /v1/ctxproxy/explain``: which wire a body is explained as, driven from the outside (HTTP through the proxy).

With no wire named (no ``/<wire>`` suffix, no ``?wire=``), the body says: ``input`` without
``messages`` is a Responses body, anything else a Chat Completions one.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import StartProxy, base_config
from tests.fake_upstream import FakeUpstream
from tests.outside import post, share_model_map

MODEL = "gpt-4o-mini"
EXPLAIN = "/v1/ctxproxy/explain"
RESPONSES_BODY: dict[str, Any] = {"model": MODEL, "instructions": "Be brief.", "input": [
    {"role": "user", "content": "read it"},
    {"type": "function_call", "call_id": "c1", "name": "read", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c1", "output": "text"},
    {"role": "user", "content": "and now?"}]}
CHAT_BODY: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(autouse=True)
def _shared_model_map(monkeypatch: pytest.MonkeyPatch) -> None:
    share_model_map(monkeypatch)  # speed only


@pytest.mark.parametrize("path", [EXPLAIN, EXPLAIN + "/responses", EXPLAIN + "?wire=responses"])
async def test_a_responses_body_is_explained_as_responses_with_or_without_a_wire_named(
    upstream: FakeUpstream, start_proxy: StartProxy, path: str
) -> None:
    """Without the suffix it answered 400 "'messages' must be an array": the body was read as Chat Completions."""
    proxy = await start_proxy(base_config(upstream.base_url))
    status, headers, payload = await post(proxy, RESPONSES_BODY, path=path)
    assert status == 200, payload
    assert set(payload) == {"input", "report"} and payload["input"] == RESPONSES_BODY["input"]
    assert payload["report"]["wire"] == "responses" and payload["report"]["repairs"] == {}
    assert headers["x-request-id"]
    assert upstream.responses == [] and upstream.chat == []  # nothing forwarded


@pytest.mark.parametrize("body", [
    CHAT_BODY,
    {**CHAT_BODY, "input": "ignored: a Chat body that also has input"},
    {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64},  # a Messages-like body
])
async def test_any_other_body_is_still_explained_as_chat(
    upstream: FakeUpstream, start_proxy: StartProxy, body: dict[str, Any]
) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    status, _, payload = await post(proxy, body, path=EXPLAIN)
    assert status == 200, payload
    assert set(payload) == {"messages", "report"} and payload["report"]["wire"] == "chat"


async def test_a_named_wire_wins_over_the_body(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    status, _, payload = await post(proxy, RESPONSES_BODY, path=EXPLAIN + "?wire=chat")
    assert status == 400 and payload["error"]["param"] == "messages"
    status, _, payload = await post(proxy, RESPONSES_BODY, path=EXPLAIN + "/nope")
    assert status == 404 and "nope" in payload["error"]["message"]
