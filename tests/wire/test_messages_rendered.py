"""Remembered renders from the outside (an outside review's harness): a warm proxy (masked copies and their
records reused, user messages rendered from runs of items reused) forwards and answers what a fresh proxy does, on
small and > 16 KiB bodies, parallel results split by the masking grid, trailing text after results, tenants
alternating, thinking toggled, emulated context_management, explain; and the cached messages and records are never
changed afterwards."""

from __future__ import annotations

import asyncio
import copy
import random
from typing import Any

import aiohttp
import pytest

from tests.conftest import StartProxy
from tests.fake_upstream import FakeUpstream
from tests.helpers import words
from tests.outside import share_model_map
from tests.wire.messages_helpers import assistant, text_block, thinking, tool_result, tool_use, user
from tests.wire.messages_rendered_check import check_caches
from tests.wire.messages_warm_harness import CLAUDE, cold, config, send


@pytest.fixture(autouse=True)
def _shared_model_map(monkeypatch: pytest.MonkeyPatch) -> None:
    share_model_map(monkeypatch)


def body(messages: list[Any], big: bool, **extra: Any) -> dict[str, Any]:
    system = "Be brief. " + (words(4000, 3) if big else "")
    return {"model": CLAUDE, "max_tokens": 256, "system": system, "messages": messages, **extra}


def parallel_loop(seed: int, rounds: int, size: int) -> list[dict[str, Any]]:
    r = random.Random(seed)
    messages: list[dict[str, Any]] = [user("Investigate. " + words(20, seed))]
    k = 0
    for i in range(rounds):
        ids = [f"toolu_{k + j:03d}" for j in range(r.choice([1, 2, 3, 4]))]
        k += len(ids)
        blocks = [thinking(words(5, i))] if r.random() < 0.3 else []
        messages.append(assistant([*blocks, *(tool_use(x, r.choice(["Read", "Grep", "Bash"]), p=x) for x in ids)]))
        results = [tool_result(x, words(r.choice([60, 200, 400]) * size, i + j),
                               **({"is_error": True} if j == 1 else {}))
                   for j, x in enumerate(ids)]
        if r.random() < 0.3:
            results.append(text_block(f"also {i}"))
        messages.append(user(results, **({"x_extra": i} if r.random() < 0.2 else {})))
    return messages


MANAGERS = {
    "om": {"type": "observation-masking", "params": {"keep_recent": 2, "mask_step": 1}},
    "om_step3": {"type": "observation-masking", "params": {"keep_recent": 3, "mask_step": 3}},
    "sumdrop": {"type": "summarising", "params": {"summarizer": "drop", "keep_turns": 2, "keep_recent": 2,
                                                  "mask_step": 1}},
}


@pytest.mark.parametrize("big", [False, True])
@pytest.mark.parametrize("manager", sorted(MANAGERS))
@pytest.mark.parametrize("seed", [0, 1])
async def test_warm_equals_fresh(upstream: FakeUpstream, start_proxy: StartProxy, big: bool, manager: str,
                                 seed: int) -> None:
    r = random.Random(seed)
    m = parallel_loop(seed, 16, 2 if big else 1)
    cuts = [i + 1 for i, x in enumerate(m) if x["role"] == "user" and i >= 2]
    reqs = []
    for n in cuts:
        extra = {"thinking": {"type": "adaptive"}} if r.random() < 0.3 else {}
        reqs.append((body(m[:n], big, **extra), r.choice(["sk-a", "sk-a", "sk-b"])))
        if r.random() < 0.3:  # a retry, and a truncated branch
            reqs.append((body(m[:n], big, **extra), "sk-a"))
            reqs.append((body(m[: max(3, n - 4)], big), "sk-a"))
    cfg = config(upstream, manager=MANAGERS[manager], budget=6_000 if big else 2_500)
    warm = await start_proxy(cfg)
    rendered = records = masked = 0
    for i, (b, k) in enumerate(reqs):
        w = await send(warm, upstream, copy.deepcopy(b), k)
        x, y = check_caches(warm)
        rendered, records = max(rendered, x), max(records, y)
        c = await cold(start_proxy, cfg, upstream, b, k)
        assert w == c, (i, w["headers"], c["headers"], w.get("answer"), c.get("answer"))
        masked += "x-ctxproxy-masked" in str(w["headers"]) or b"ctxproxy removed" in (w["forwarded"] or b"")
    assert masked and records and rendered, (masked, records, rendered)


@pytest.mark.parametrize("big", [False, True])
async def test_concurrent_tenants_and_branches(upstream: FakeUpstream, start_proxy: StartProxy, big: bool) -> None:
    m = parallel_loop(3, 16, 2 if big else 1)
    cfg = config(upstream, manager=MANAGERS["om"], budget=6_000 if big else 2_500)
    cuts = [i + 1 for i, x in enumerate(m) if x["role"] == "user" and i >= 2]
    reqs = [(body(m[:n], big), k) for n in cuts for k in ("sk-a", "sk-b")]
    reqs += [(body([*m[:n], assistant("x " + str(n)), user(f"branch {n}")], big), "sk-a") for n in cuts[3:]]
    expected = [await cold(start_proxy, cfg, upstream, b, k) for b, k in reqs]
    assert sum(e["status"] == 200 for e in expected) > len(expected) // 2, [e["status"] for e in expected]
    warm = await start_proxy(cfg)
    for _ in range(3):
        n = len(upstream.messages)
        got = await asyncio.gather(*(send(warm, upstream, copy.deepcopy(b), k) for b, k in reqs))
        forwarded = sorted(e["forwarded"] for e in expected if e["forwarded"] is not None)
        assert sorted(x.raw for x in upstream.messages[n:]) == forwarded
        for w, e in zip(got, expected):
            assert w["status"] == e["status"] and w["headers"] == e["headers"]
        check_caches(warm)


async def test_explain_between(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """explain (report with masked records, the rendered messages as JSON) between real requests."""
    m = parallel_loop(5, 16, 1)
    cfg = config(upstream, manager=MANAGERS["om"], budget=2_500)
    warm = await start_proxy(cfg)
    cuts = [i + 1 for i, x in enumerate(m) if x["role"] == "user" and i >= 2]
    for n in cuts:
        b = body(m[:n], False)
        async with aiohttp.ClientSession() as s, s.post(warm.url + "/v1/ctxproxy/explain?wire=messages", json=b,
                          headers={"x-api-key": "sk-a"}) as r:
            explained_warm = (r.status, await r.json())
        w = await send(warm, upstream, copy.deepcopy(b))
        fresh = await start_proxy(cfg)
        async with aiohttp.ClientSession() as s, s.post(fresh.url + "/v1/ctxproxy/explain?wire=messages", json=b,
                                                       headers={"x-api-key": "sk-a"}) as r:
            explained_cold = (r.status, await r.json())
        c = await send(fresh, upstream, copy.deepcopy(b))
        for e in (explained_warm, explained_cold):
            if isinstance(e[1], dict) and isinstance(e[1].get("report"), dict):
                for key in ("duration_ms", "timings", "request_id", "calibration_detail"):
                    e[1]["report"].pop(key, None)
        assert w == c
        assert explained_warm == explained_cold
        check_caches(warm)


@pytest.mark.parametrize("big", [False, True])
@pytest.mark.parametrize("n", [9, 11, 13, 15])
async def test_older_message_non_content_key_toggled(upstream: FakeUpstream, start_proxy: StartProxy,
                                                    big: bool, n: int) -> None:
    """A client that changes an old user message's extra key, key order or a result's cache_control between
    requests (its results masked, the message rendered anew): each request forwards what a fresh proxy does."""
    m = parallel_loop(7, 16, 2 if big else 1)[:n]
    users = [i for i, x in enumerate(m) if x["role"] == "user" and i >= 2]
    cfg = config(upstream, manager=MANAGERS["om"], budget=6_000 if big else 2_500)
    warm = await start_proxy(cfg)
    variants = []
    for v in range(6):
        mm = copy.deepcopy(m)
        for i in users[:4]:
            if v % 3 == 1:
                mm[i]["x_extra"] = v
            elif v % 3 == 2:
                mm[i] = {"content": mm[i]["content"], "role": "user"}  # key order
            if v >= 3 and isinstance(mm[i]["content"], list):
                mm[i]["content"][-1] = {**mm[i]["content"][-1], "cache_control": {"type": "ephemeral"}}
        variants.append(mm)
    seq = [variants[v % 6] for v in (0, 1, 0, 2, 0, 3, 4, 5, 0, 1)]
    masked = rendered = 0
    for i, mm in enumerate(seq):
        b = body(mm, big)
        w = await send(warm, upstream, copy.deepcopy(b))
        c = await cold(start_proxy, cfg, upstream, b)
        assert w == c, (i, w.get("answer"), c.get("answer"))
        masked += b"ctxproxy removed" in (w["forwarded"] or b"")
        rendered = max(rendered, check_caches(warm)[0])
    print('masked', n, big, masked, rendered)
