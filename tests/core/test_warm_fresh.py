"""A warm proxy (remembered items, walks, renders and masked copies) forwards and answers what a fresh proxy does
for the same request, on the three wires, five managers, branches, retries, two tenants and concurrent requests
(an outside review's harness; more seeds were run there: 75 runs, about 2,300 requests)."""

from __future__ import annotations

import copy
import json
import random
from typing import Any

import aiohttp
import pytest

from tests.conftest import StartProxy
from tests.fake_upstream import FakeUpstream
from tests.helpers import words
from tests.outside import share_model_map
from tests.wire import messages_helpers as mh
from tests.wire import responses_helpers as rh


@pytest.fixture(autouse=True)
def _shared_model_map(monkeypatch: pytest.MonkeyPatch) -> None:
    share_model_map(monkeypatch)


def cfg(upstream: FakeUpstream, manager: Any, budget: int) -> dict[str, Any]:
    common = {"context_window": 200_000, "max_output_tokens": 4_096, "tokenizer": "o200k_base", "calibration": "off"}
    return {
        "upstreams": {"openai": {"base_url": upstream.base_url},
                      "anthropic": {"base_url": upstream.url, "api": "anthropic", "api_key": "sk-ant-up"}},
        "default_upstream": "openai",
        "models": [{"name": "gpt-x", **common}, {"name": "claude-x", "upstream": "anthropic", **common}],
        "cache": {"backend": "memory"},
        "summarizer": {"retry_backoff_seconds": 0},
        "context_manager": manager,
        "trimmer": {"max_tokens": budget},
        "tenants": [{"name": "a", "keys": ["sk-a"]}, {"name": "b", "keys": ["sk-b"]}],
    }


def convo(seed: int, rounds: int) -> list[dict[str, Any]]:
    r = random.Random(seed)
    m: list[dict[str, Any]] = [{"role": "system", "content": "sys"},
                               {"role": "user", "content": "go " + words(10, seed)}]
    k = 0
    for i in range(rounds):
        if r.random() < 0.3:
            m.append({"role": "assistant", "content": "answer " + words(8, i)})
            m.append({"role": "user", "content": "next " + words(6, i)})
        n = r.choice([1, 1, 2, 3])
        ids = [f"call_{r.choice([k + j, r.randrange(0, k + 1)]) if r.random() < 0.2 else k + j}" for j in range(n)]
        ids = list(dict.fromkeys(ids))
        k += n
        m.append({"role": "assistant", "content": None,
                  "tool_calls": [{"id": x, "type": "function", "function": {"name": r.choice(["Read", "Grep"]),
                                                                              "arguments": json.dumps({"p": x})}}
                                 for x in ids]})
        for j, x in enumerate(ids):
            m.append({"role": "tool", "tool_call_id": x, "content": words(r.choice([30, 120, 300]), i * 7 + j)})
    return m


def to_wire(wire: str, m: list[dict[str, Any]], model: str) -> tuple[str, dict[str, Any]]:
    if wire == "chat":
        return "/v1/chat/completions", {"model": model, "messages": m, "max_tokens": 256}
    if wire == "responses":
        return "/v1/responses", {"model": model, "input": rh.chat_to_responses(m), "max_output_tokens": 256}
    system, converted = mh.from_chat(m)
    return "/v1/messages", {"model": model, "max_tokens": 256, "system": system, "messages": converted}


async def send(url: str, upstream: FakeUpstream, path: str, body: Any, key: str) -> dict[str, Any]:
    lists = {"/v1/chat/completions": upstream.chat, "/v1/responses": upstream.responses,
             "/v1/messages": upstream.messages}
    target = lists[path]
    before = len(target)
    headers = {"authorization": f"Bearer {key}", "x-api-key": key, "anthropic-version": "2023-06-01"}
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body, headers=headers) as r:
        raw = await r.read()
        out: dict[str, Any] = {"status": r.status, "headers": {
            k.lower(): v for k, v in r.headers.items()
            if k.lower().startswith("x-ctxproxy")
            and k.lower() not in ("x-ctxproxy-overhead-ms", "x-ctxproxy-request-id")}}
        if r.status != 200:
            out["answer"] = raw
    out["forwarded"] = target[-1].raw if len(target) > before else None
    return out


MANAGERS = {
    "om": {"type": "observation-masking", "params": {"keep_recent": 2, "mask_step": 1}},
    "sumdrop": {"type": "summarising", "params": {"summarizer": "drop", "keep_turns": 2, "keep_recent": 2,
                                                  "mask_step": 1}},
    "sumdrop_wm": {"type": "summarising", "params": {"summarizer": "drop", "keep_turns": 1, "keep_recent": 1,
                                                     "mask_step": 2, "working_memory_messages": 3}},
    "sliding": {"type": "sliding-window", "params": {"keep_turns": 2}},
    "stack": {"type": "stack", "params": {"max_messages": 9, "working_memory_messages": 4}},
}

SEEDS = [0]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("wire", ["chat", "responses", "messages"])
@pytest.mark.parametrize("manager", sorted(MANAGERS))
async def test_warm_equals_fresh(upstream: FakeUpstream, start_proxy: StartProxy, wire: str, manager: str,
                                 seed: int) -> None:
    r = random.Random(seed * 31 + len(manager))
    m = convo(seed, 14)
    model = "claude-x" if wire == "messages" else "gpt-x"
    points = [i + 1 for i, x in enumerate(m) if i >= 3 and (
        x["role"] == "user" or (x["role"] == "tool" and (i + 1 == len(m) or m[i + 1]["role"] != "tool")))]
    reqs = []
    for n in points:
        reqs.append((m[:n], r.choice(["sk-a", "sk-a", "sk-b"])))
        if r.random() < 0.25:
            reqs.append((m[:n], "sk-a"))
            reqs.append((m[: max(3, n - 3)], "sk-a"))
        if r.random() < 0.2:
            branch = [*m[:n], {"role": "assistant", "content": "br"}, {"role": "user", "content": f"b{n}"}]
            reqs.append((branch, "sk-a"))
    c = cfg(upstream, MANAGERS[manager], r.choice([1500, 2500, 4000]))
    warm = await start_proxy(c)
    mismatches = []
    for i, (msgs, key) in enumerate(reqs):
        path, body = to_wire(wire, msgs, model)
        w = await send(warm.url, upstream, path, copy.deepcopy(body), key)
        fresh = await start_proxy(c)
        f = await send(fresh.url, upstream, path, copy.deepcopy(body), key)
        if w != f:
            mismatches.append((i, len(msgs), key, w, f))
    assert not mismatches, mismatches[0]


def compaction_input(m: list[dict[str, Any]], n: int) -> list[Any]:
    """Responses input with a compaction item first and a second one later (the last one is pinned)."""
    items = rh.chat_to_responses(m)
    out: list[Any] = [{"type": "compaction", "id": "cmp_0", "encrypted_content": "QUJD" * 40}]
    out += items[1:]
    if n % 2 and len(out) > 6:
        out.insert(4, {"type": "compaction", "id": f"cmp_{n}", "encrypted_content": "REVG" * 30})
    return out


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("wire", ["chat", "responses", "responses_cmp", "messages"])
@pytest.mark.parametrize("manager", ["om", "sumdrop", "stack"])
async def test_concurrent_warm_equals_fresh(upstream: FakeUpstream, start_proxy: StartProxy, wire: str,
                                            manager: str, seed: int) -> None:
    """All the requests of a conversation (growing, branches, two tenants) at once through one warm proxy, three
    times; each forwards and reports what a fresh proxy does for it alone."""
    import asyncio
    m = convo(seed + 100, 12)
    model = "claude-x" if wire == "messages" else "gpt-x"
    points = [i + 1 for i, x in enumerate(m) if i >= 3 and x["role"] in ("user", "tool")]
    bodies = []
    for n in points:
        for key in ("sk-a", "sk-b"):
            if wire == "responses_cmp":
                path, body = "/v1/responses", {"model": model, "input": compaction_input(m[:n], n),
                                               "max_output_tokens": 256}
            else:
                path, body = to_wire(wire, m[:n], model)
            bodies.append((path, body, key))
    c = cfg(upstream, MANAGERS[manager], 1500 + 500 * seed)
    expected = []
    for path, body, key in bodies:
        fresh = await start_proxy(c)
        expected.append(await send(fresh.url, upstream, path, copy.deepcopy(body), key))
    warm = await start_proxy(c)
    lists = {"/v1/chat/completions": upstream.chat, "/v1/responses": upstream.responses,
             "/v1/messages": upstream.messages}
    for _ in range(3):
        target = lists[bodies[0][0]]
        n = len(target)
        got = await asyncio.gather(*(send(warm.url, upstream, p, copy.deepcopy(b), k) for p, b, k in bodies))
        assert sorted(x.raw for x in target[n:]) == sorted(e["forwarded"] for e in expected if e["forwarded"])
        for g, e in zip(got, expected):
            assert (g["status"], g["headers"], g.get("answer")) == (e["status"], e["headers"], e.get("answer"))
