"""The Messages warm path against a fresh proxy, from the outside (an outside review's differential harness).

Each request of a sequence goes through one proxy, then alone through a fresh one; status, x-ctxproxy-* headers
(timings aside), error bodies and the bytes the fake upstream received must be equal. Scenarios: a growing tool
loop, two tenants alternating, thinking toggled, cache_control marks split between prefix and tail (system, tool
results' inner content), an empty prefill then continued, non-dict entries after a known prefix; managers with
masking and summarising; offload on and off; concurrent requests with different tails; count_tokens and emulated
context_management edits in between."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest

from tests.conftest import StartProxy
from tests.fake_upstream import FakeUpstream
from tests.helpers import words
from tests.outside import share_model_map
from tests.wire.messages_helpers import assistant, text_block, thinking, tool_result, tool_use, user
from tests.wire.messages_warm_harness import CLAUDE, cold, compare, config, send


@pytest.fixture(autouse=True)
def _shared_model_map(monkeypatch: pytest.MonkeyPatch) -> None:
    share_model_map(monkeypatch)


def body(messages: list[Any], **extra: Any) -> dict[str, Any]:
    return {"model": CLAUDE, "max_tokens": 256, "system": "Be brief.", "messages": messages, **extra}


CC = {"type": "ephemeral"}


def loop(rounds: int, size: int = 200, think: bool = False) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [user("Read every file.")]
    for i in range(rounds):
        blocks = [thinking(f"plan {i}")] if think else []
        messages.append(assistant([*blocks, text_block(f"step {i}"), tool_use(f"toolu_{i:03d}", "Read", path=f"/{i}")]))
        messages.append(user([tool_result(f"toolu_{i:03d}", words(size, i))]))
    return messages


SCENARIOS: dict[str, list[tuple[Any, str]]] = {}
m = loop(12)
SCENARIOS["loop_grow"] = [(body(m[:n]), "sk-a") for n in range(3, len(m) + 1, 2)]
SCENARIOS["two_tenants"] = [(body(m[:n]), "sk-a" if n % 4 == 1 else "sk-b") for n in range(3, len(m) + 1, 2)]
t = loop(6, think=True)
SCENARIOS["think_toggle"] = [
    (body(t[:n], **({"thinking": {"type": "enabled", "budget_tokens": 1024}} if n % 4 == 1 else {})), "sk-a")
    for n in range(3, len(t) + 1, 2)
]
SCENARIOS["marks"] = [
    (body([user([text_block("a", cache_control=CC)]), assistant([text_block("b", cache_control=CC)])]), "sk-a"),
    (
        body(
            [
                user([text_block("a", cache_control=CC)]),
                assistant([text_block("b", cache_control=CC)]),
                user([text_block("c", cache_control=CC)]),
            ],
            system=[{"type": "text", "text": "s", "cache_control": CC}],
        ),
        "sk-a",
    ),
    (
        body(
            [
                user([text_block("a", cache_control=CC)]),
                assistant([text_block("b", cache_control=CC)]),
                user([text_block("c", cache_control=CC)]),
                assistant("d"),
                user([tool_result("x", [text_block("y", cache_control=CC)])]),
            ]
        ),
        "sk-a",
    ),
]
SCENARIOS["prefill"] = [
    (body([user("hi"), assistant("")]), "sk-a"),
    (body([user("hi"), assistant(""), user("x")]), "sk-a"),
    (body([user("hi"), assistant("Sure")]), "sk-a"),
    (body([user("hi"), assistant("Sure"), assistant("")]), "sk-a"),
]
SCENARIOS["nondict"] = [
    (body([user("a"), assistant("b")]), "sk-a"),
    (body([user("a"), assistant("b"), 7, user("c")]), "sk-a"),
    (body([user("a"), assistant("b"), user("c"), "x"]), "sk-a"),
]


@pytest.mark.parametrize("manager", ["summarising-drop", "masking", "none"])
@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
async def test_sequences(
    upstream: FakeUpstream, start_proxy: StartProxy, scenario: str, manager: str, offload: bool
) -> None:
    mgr = {
        "summarising-drop": {"type": "summarising", "params": {"summarizer": "drop", "keep_turns": 2}},
        "masking": {"type": "observation-masking", "params": {"keep_recent": 2}},
        "none": None,
    }[manager]
    cfg = config(
        upstream,
        manager=mgr,
        budget=3_000 if manager != "none" else None,
        server={"idle_timeout": 5, "offload_bytes": 0 if offload else 262_144},
    )
    diffs = await compare(start_proxy, cfg, upstream, SCENARIOS[scenario])
    assert not diffs, diffs[:2]


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("mode", ["enforce", "observe"])
async def test_concurrent_bytes(upstream: FakeUpstream, start_proxy: StartProxy, offload: bool, mode: str) -> None:
    mgr = {"type": "summarising", "params": {"summarizer": "drop", "keep_turns": 2}}
    cfg = config(
        upstream,
        manager=mgr,
        budget=3_000,
        mode=mode,
        server={"idle_timeout": 5, "offload_bytes": 0 if offload else 262_144},
    )
    warm = await start_proxy(cfg)
    base = loop(10, think=True)
    await send(warm, upstream, body(base[:9]))
    tails = [
        body(
            [*base[:9], assistant(f"answer {i}"), user(f"question {i} " + words(50, i))],
            **({"thinking": {"type": "adaptive"}} if i % 2 else {}),
        )
        for i in range(6)
    ]
    tails += [body(base[:k]) for k in (11, 13, 15, 17, 19, 21)]
    expected = []
    for b in tails:
        c = await cold(start_proxy, cfg, upstream, b)
        expected.append(c)
    for _ in range(4):
        n = len(upstream.messages)
        results = await asyncio.gather(*(send(warm, upstream, copy.deepcopy(b)) for b in tails))
        got = sorted(r.raw for r in upstream.messages[n:])
        assert got == sorted(e["forwarded"] for e in expected)
        for w, c in zip(results, expected):
            assert w["status"] == c["status"] and w["headers"] == c["headers"], (w["headers"], c["headers"])


@pytest.mark.parametrize("emulate", [False, True])
async def test_count_tokens_and_edits_between(upstream: FakeUpstream, start_proxy: StartProxy, emulate: bool) -> None:
    mgr = {"type": "summarising", "params": {"summarizer": "drop", "keep_turns": 2}}
    cfg = config(upstream, manager=mgr, budget=4_000)
    if emulate:
        cfg["upstreams"]["a"]["context_management"] = "emulate"
    cm = {
        "edits": [
            {
                "type": "clear_tool_uses_20250919",
                "trigger": {"type": "tool_uses", "value": 2},
                "keep": {"type": "tool_uses", "value": 1},
            }
        ]
    }
    m = loop(10, think=True)
    reqs = []
    for n in range(3, len(m) + 1, 2):
        b = body(m[:n])
        reqs.append(("/v1/messages/count_tokens", {k: v for k, v in b.items() if k != "max_tokens"}))
        reqs.append(("/v1/messages", {**b, "context_management": cm}))
        reqs.append(("/v1/messages", b))
    warm = await start_proxy(cfg)
    for path, b in reqs:
        w = await send(warm, upstream, copy.deepcopy(b), path=path)
        c = await cold(start_proxy, cfg, upstream, b, path=path)
        assert w == c, (path, w, c)


@pytest.mark.parametrize("seed", [0, 1])
def test_masked_results_resumed_in_process(seed: int) -> None:
    """Pipeline level: a 40-round tool loop with parallel calls, thinking toggled, trailing text after results and
    tenants alternating, through masking and summarising managers on small budgets: every request forwards and
    reports what a fresh counter does (observation masking's cached copies are reused on the warm side)."""
    import random

    from proxy.core.tokens import TokenCounter
    from tests.wire.test_messages import MANAGERS, Setup, _forwarded

    managers = {
        "om": {"type": "observation-masking", "params": {"keep_recent": 3}},
        "sumdrop": {"type": "summarising", "params": {"summarizer": "drop", "keep_turns": 3}},
    }
    for name, value in managers.items():
        MANAGERS.setdefault(name, value)
    r = random.Random(seed)
    messages: list[dict[str, Any]] = [user("Investigate the repo. " + words(30, 1))]
    k = 0
    for i in range(40):
        if r.random() < 0.1:
            messages += [assistant("Interim: " + words(20, i)), user("continue " + words(10, i))]
        ids = [f"toolu_{k + j}" for j in range(r.choice([1, 1, 2, 3]))]
        k += len(ids)
        blocks = [thinking(words(10, i))] if r.random() < 0.5 else []
        messages.append(assistant([*blocks, *(tool_use(x, r.choice(["Read", "Grep"]), path=f"/{x}") for x in ids)]))
        results = [tool_result(x, words(r.choice([40, 120, 300]), i)) for x in ids]
        messages.append(user(results if r.random() < 0.8 else [*results, text_block(f"also {i}")]))
    cuts = [i + 1 for i, m in enumerate(messages) if m["role"] == "user" and i >= 2]
    requests = [
        (
            body(messages[:n], **({"thinking": {"type": "adaptive"}} if r.random() < 0.5 else {})),
            r.choice(["t", "t", "u"]),
        )
        for n in cuts
    ]

    masked = 0
    for manager in ("om", "sumdrop"):
        setup = Setup(manager, 3_000)
        warm = TokenCounter("o200k_base")
        for request, tenant in requests:
            expected = _forwarded(setup, copy.deepcopy(request), TokenCounter("o200k_base"), tenant)
            assert _forwarded(setup, copy.deepcopy(request), warm, tenant) == expected
            masked += bool(expected[0] != "refused" and expected[2].get("masked"))
    assert masked > 10  # observation masking was at work
