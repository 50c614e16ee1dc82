"""A request the warm memory refuses to keep (larger than a quarter of its byte bound; an outside review's
reproduction) is not kept alive by what is remembered with the items it did keep: the walk of the history
(``Item.walk``) and the Messages render (``AnthropicItem.memo``) on the conversation's first item."""
from __future__ import annotations

import gc
from typing import Any

import aiohttp
import pytest

from proxy.core.warm import Conversations
from tests.conftest import StartProxy
from tests.core.test_warm_fresh import cfg as fresh_config
from tests.fake_upstream import FakeUpstream
from tests.helpers import words
from tests.outside import share_model_map
from tests.wire import messages_helpers as mh


@pytest.fixture(autouse=True)
def _shared_model_map(monkeypatch: pytest.MonkeyPatch) -> None:
    share_model_map(monkeypatch)


def cfg(upstream: FakeUpstream) -> dict[str, Any]:
    return fresh_config(upstream, {"type": "observation-masking", "params": {"keep_recent": 1, "mask_step": 1}}, 3000)


def call(i: int) -> list[dict[str, Any]]:
    return [{"role": "assistant", "content": None, "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": {"name": "Read", "arguments": "{}"}}]}]


MARK = "BIGOUTPUT"


def convo(big: bool) -> list[dict[str, Any]]:
    m: list[dict[str, Any]] = [{"role": "user", "content": "start " + words(10, 1)}]
    for i in range(4):
        m += call(i)
        m.append({"role": "tool", "tool_call_id": f"c{i}", "content": words(200, i)})
    m.append({"role": "user", "content": "more"})
    if big:
        m += call(9)
        m.append({"role": "tool", "tool_call_id": "c9", "content": MARK + " " + words(60_000, 9)})  # ~400 KB
        m += call(10)
        m.append({"role": "tool", "tool_call_id": "c10", "content": "small"})
        m.append({"role": "user", "content": "again"})  # the big output in the history (masking's walk)
    return m


def big_strings_reachable(root: object) -> int:
    """How many paths (first found) lead from ``root`` to a large output; printed."""
    seen: set[int] = set()
    stack: list[tuple[object, tuple[str, ...]]] = [(root, ())]
    found = 0
    while stack:
        o, path = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, str):
            if o.startswith(MARK):
                found += 1
                print("PATH", " -> ".join(path))
            continue
        if isinstance(o, type):
            continue
        for r in gc.get_referents(o):
            name = type(r).__name__
            if hasattr(type(o), "__slots__"):
                for slot in getattr(type(o), "__slots__", ()):
                    if getattr(o, slot, None) is r:
                        name = f"{slot}:{name}"
            stack.append((r, (*path, name)))
    return found


@pytest.mark.parametrize("wire", ["chat", "messages"])
async def test_an_unkept_request_is_not_retained(upstream: FakeUpstream, start_proxy: StartProxy, wire: str) -> None:
    proxy = await start_proxy(cfg(upstream))

    async def send(m: list[dict[str, Any]]) -> int:
        if wire == "chat":
            path, body = "/v1/chat/completions", {"model": "gpt-x", "messages": m, "max_tokens": 256}
        else:
            _system, converted = mh.from_chat(m)
            path, body = "/v1/messages", {"model": "claude-x", "max_tokens": 256, "messages": converted}
        async with aiohttp.ClientSession() as s, s.post(proxy.url + path, json=body, headers={
                "authorization": "Bearer sk-a", "x-api-key": "sk-a", "anthropic-version": "2023-06-01"}) as r:
            await r.read()
            return r.status

    assert await send(convo(False)) == 200
    from proxy.serve.state import STATE
    memory = proxy.app[STATE].shared.tokenizers._counters["o200k_base"].conversations
    assert isinstance(memory, Conversations) and len(memory) == 1
    memory._max_bytes = 600_000  # a quarter: 150 KB; the big request (~400 KB of JSON) is not to be kept
    size_before = memory.size
    assert await send(convo(True)) == 200
    assert memory.size == size_before  # the warm memory did not keep the big request ...
    gc.collect()
    assert big_strings_reachable(memory) == 0  # ... nor does anything it holds
