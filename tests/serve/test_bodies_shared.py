"""The parse a KnownBodies remembers is shared with the requests that reuse it; it must never change, and
a warm proxy must answer and forward exactly what a fresh one does, with bodies above MIN_BYTES (16 KiB) so that
the change is exercised (the existing warm harness's scenarios are all below it)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from proxy.serve.bodies import read_json_body
from tests.conftest import RunningProxy, StartProxy
from tests.fake_upstream import FakeUpstream
from tests.helpers import words
from tests.outside import share_model_map
from tests.wire.messages_helpers import assistant, text_block, thinking, tool_result, tool_use, user
from tests.wire.messages_warm_harness import CLAUDE, cold, config, send


@pytest.fixture(autouse=True)
def _shared_model_map(monkeypatch: pytest.MonkeyPatch) -> None:
    share_model_map(monkeypatch)


def strict(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(strict(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(strict(x, y) for x, y in zip(a, b))
    return a == b


def check_remembered(proxy: RunningProxy) -> int:
    """Every remembered parse still equals a whole parse of its bytes (nothing in the pipeline changed it)."""
    n = 0
    for bucket in proxy.state.bodies._buckets.values():
        for known in bucket.bodies:
            assert strict(known.body, read_json_body(known.raw)[0]), "a remembered parse was changed"
            n += 1
    return n


SYSTEM = "Be brief. " + words(4000, 3)
CC = {"type": "ephemeral"}


def body(messages: list[Any], **extra: Any) -> dict[str, Any]:
    return {"model": CLAUDE, "max_tokens": 256, "system": SYSTEM, "messages": messages, **extra}


def loop(rounds: int, size: int = 600, think: bool = False) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [user("Read every file.")]
    for i in range(rounds):
        blocks = [thinking(f"plan {i}")] if think else []
        messages.append(assistant([*blocks, text_block(f"step {i}"), tool_use(f"toolu_{i:03d}", "Read", path=f"/{i}")]))
        messages.append(user([tool_result(f"toolu_{i:03d}", words(size, i))]))
    return messages


def marked(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A client that moves a cache mark onto the last message (sends it anew)."""
    out = copy.deepcopy(messages)
    last = out[-1]
    if isinstance(last["content"], list):
        last["content"][-1] = {**last["content"][-1], "cache_control": CC}
    return out


CM = {"edits": [{"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 2},
                 "keep": {"type": "tool_uses", "value": 1}}]}

m = loop(14, think=True)
SCENARIOS: dict[str, list[dict[str, Any]]] = {
    "grow": [body(m[:n]) for n in range(3, len(m) + 1, 2)],
    "marks": [body(marked(m[:n])) for n in range(3, len(m) + 1, 2)],
    "think_toggle": [body(m[:n], **({"thinking": {"type": "enabled", "budget_tokens": 1024}} if n % 4 == 1 else {}))
                     for n in range(3, len(m) + 1, 2)],
    "context_management": [body(m[:n], context_management=CM) for n in range(3, len(m) + 1, 2)],
    "retry_and_truncate": [body(m[:n]) for n in (9, 11, 11, 7, 13, 13, 15, 5, 17)],
}


@pytest.mark.parametrize("emulate", [False, True])
@pytest.mark.parametrize("manager", ["summarising-drop", "masking", "none"])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
async def test_messages_warm_equals_fresh_and_shared_parses_never_change(
        upstream: FakeUpstream, start_proxy: StartProxy, scenario: str, manager: str, emulate: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from proxy.serve.bodies import KnownBodies

    calls = {"continue": 0}
    original = KnownBodies._continue

    def counting(self: Any, *args: Any) -> Any:
        calls["continue"] += 1
        return original(self, *args)

    monkeypatch.setattr(KnownBodies, "_continue", counting)
    mgr = {
        "summarising-drop": {"type": "summarising", "params": {"summarizer": "drop", "keep_turns": 2}},
        "masking": {"type": "observation-masking", "params": {"keep_recent": 2}},
        "none": None,
    }[manager]
    cfg = config(upstream, manager=mgr, budget=6_000 if manager != "none" else None)
    if emulate:
        cfg["upstreams"]["a"]["context_management"] = "emulate"
    warm = await start_proxy(cfg)
    remembered = 0
    for i, b in enumerate(SCENARIOS[scenario]):
        w = await send(warm, upstream, copy.deepcopy(b))
        remembered = max(remembered, check_remembered(warm))
        c = await cold(start_proxy, cfg, upstream, b)
        assert w == c, (i, w.get("answer"), c.get("answer"))
    assert remembered and calls["continue"] >= 3, calls  # the change was exercised
