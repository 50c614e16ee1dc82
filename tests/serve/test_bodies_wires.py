"""Chat and Responses over HTTP with bodies above 16 KiB (an outside review's harness): a warm proxy forwards and
answers what a fresh one does, the remembered parses never change, and the remembered keys stay true to the
elements they are read back for (``Conversations.shared``)."""

from __future__ import annotations

import copy
import json
from typing import Any

import aiohttp
import pytest

from proxy.core.tokens import content_key
from proxy.serve.bodies import KnownBodies
from tests.conftest import RunningProxy, StartProxy, base_config
from tests.fake_upstream import FakeUpstream
from tests.helpers import words
from tests.outside import share_model_map
from tests.serve.test_bodies_shared import check_remembered
from tests.wire.responses_helpers import chat_to_responses

MODEL = "gpt-4o-mini"


@pytest.fixture(autouse=True)
def _shared_model_map(monkeypatch: pytest.MonkeyPatch) -> None:
    share_model_map(monkeypatch)


def turn(i: int) -> list[dict[str, Any]]:
    cid = f"call_{i}"
    return [
        {"role": "user", "content": f"question {i}: " + words(60, i)},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": "lookup", "arguments": json.dumps({"t": i})}}]},
        {"role": "tool", "tool_call_id": cid, "content": words(500, i)},
        {"role": "assistant", "content": f"answer {i}: " + words(40, i)},
    ]


SYSTEM = {"role": "system", "content": "You are a support agent. " + words(300)}
CHAT: list[dict[str, Any]] = [SYSTEM, *(m for i in range(14) for m in turn(i))]


def chat_bodies() -> list[dict[str, Any]]:
    out = []
    for n in [*range(6, len(CHAT) + 1, 3), 20, 20, 33, 9, len(CHAT)]:
        msgs = copy.deepcopy(CHAT[:n])
        if n % 2:
            msgs[-1] = {**msgs[-1], "name": "again"}  # the last message sent anew
        out.append({"model": MODEL, "messages": msgs, "tools": [{"type": "function", "function": {
            "name": "lookup", "parameters": {"type": "object"}}}], "max_tokens": 100})
    return out


def responses_bodies() -> list[dict[str, Any]]:
    out = []
    for body in chat_bodies():
        items = chat_to_responses(body["messages"])
        out.append({"model": MODEL, "instructions": "Be terse.", "input": items, "store": False,
                    "max_output_tokens": 100})
    out.append({"model": MODEL, "instructions": "Be terse.", "input": "x " * 9000})
    out.append({"model": MODEL, "instructions": "Be terse.", "input": "x " * 9000 + "y"})
    return out


MANAGERS = {
    "summarising": {"type": "summarising", "params": {"summarizer": "drop", "keep_turns": 2}},
    "masking": {"type": "observation-masking", "params": {"keep_recent": 2}},
    "none": None,
}


async def send(proxy: RunningProxy, upstream: FakeUpstream, path: str, body: dict[str, Any]) -> dict[str, Any]:
    bucket = upstream.chat if path.endswith("completions") else upstream.responses
    before = len(bucket)
    async with aiohttp.ClientSession() as s, s.post(proxy.url + path, json=body,
                                                   headers={"Authorization": "Bearer sk-client"}) as r:
        raw = await r.read()
        out: dict[str, Any] = {"status": r.status, "headers": {
            k.lower(): v for k, v in r.headers.items()
            if k.lower().startswith("x-ctxproxy") and k.lower() != "x-ctxproxy-overhead-ms"}}
        if r.status != 200:
            out["answer"] = raw
    out["forwarded"] = bucket[-1].raw if len(bucket) > before else None
    return out


def check_keyed(proxy: RunningProxy) -> int:
    n = 0
    for counter in proxy.state.served.runtime.tokenizers._counters.values():
        for (_tenant, wire, _k0, _k1), branches in counter.conversations._known.items():
            for known in branches:
                for element, key in zip(known.elements, known.keys):
                    salt = {"chat": 1, "responses": 2, "messages": 3}[wire]
                    assert content_key(element) ^ salt == key, "a stale key: an element changed after it was keyed"
                    n += 1
    return n


@pytest.mark.parametrize("manager", sorted(MANAGERS))
@pytest.mark.parametrize("wire", ["chat", "responses"])
async def test_warm_equals_fresh(upstream: FakeUpstream, start_proxy: StartProxy, wire: str, manager: str,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = base_config(upstream.base_url, models=[
        {"name": MODEL, "context_window": 128000, "max_output_tokens": 16384}],
        summarizer_model=MODEL, summarizer={"retry_backoff_seconds": 0, "timeout_seconds": 2})
    if MANAGERS[manager] is not None:
        cfg["context_manager"] = MANAGERS[manager]
        cfg["trimmer"] = {"max_tokens": 6000}
    path = "/v1/chat/completions" if wire == "chat" else "/v1/responses"
    bodies = chat_bodies() if wire == "chat" else responses_bodies()
    warm = await start_proxy(cfg)
    remembered = keyed = 0
    calls = {"continue": 0}
    original = KnownBodies._continue

    def counting(self: Any, *args: Any) -> Any:
        calls["continue"] += 1
        return original(self, *args)

    monkeypatch.setattr(KnownBodies, "_continue", counting)
    for i, b in enumerate(bodies):
        w = await send(warm, upstream, path, copy.deepcopy(b))
        remembered = max(remembered, check_remembered(warm))
        keyed = max(keyed, check_keyed(warm))
        c = await send(await start_proxy(cfg), upstream, path, copy.deepcopy(b))
        assert w == c, (i, w.get("answer"), c.get("answer"), w["headers"], c["headers"])
    assert remembered and keyed and calls["continue"] > 3, (remembered, keyed, calls)
