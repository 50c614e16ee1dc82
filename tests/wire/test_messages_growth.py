"""A growing 60-turn Messages conversation on a 16k budget, end to end over HTTP (the figures docs/wires.md quotes):
summariser calls, tokens received vs forwarded, and the share of consecutive requests whose prompt-cache prefix
(up to the previous request's last cache_control breakpoint) survived.

The client behaves like Claude Code: a system prompt of two blocks (a per-run billing header first, then the
prompt, marked), tools, a tool round or two per turn, and a moving breakpoint on the last block of the last
message. Run with ``-s`` to see the figures.
"""

from __future__ import annotations

import itertools
from typing import Any

import aiohttp
import pytest

from tests.conftest import StartProxy
from tests.fake_upstream import FakeUpstream
from tests.helpers import words
from tests.outside import share_model_map
from tests.wire.messages_helpers import CLAUDE, cache_marks, cached_prefix_survives, pairing_problems, recount

TURNS = 60
BUDGET = 16_000
SYSTEM = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197; cc_entrypoint=cli;"},
          {"type": "text", "text": "You are Claude Code. " + words(600, 3), "cache_control": {"type": "ephemeral"}}]
TOOLS = [{"name": n, "description": f"{n} tool. " + words(40, i), "input_schema": {"type": "object"}}
         for i, n in enumerate(["Read", "Bash", "Grep", "Edit"])]


@pytest.fixture(autouse=True)
def _shared_model_map(monkeypatch: pytest.MonkeyPatch) -> None:
    share_model_map(monkeypatch)  # speed only


def marked(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with Claude Code's moving breakpoint on the last block of the last message."""
    last = messages[-1]
    content = last["content"] if isinstance(last["content"], list) else [{"type": "text", "text": last["content"]}]
    marked = {**content[-1], "cache_control": {"type": "ephemeral"}}
    return [*messages[:-1], {**last, "content": [*content[:-1], marked]}]


async def grow(proxy_url: str, context_manager: Any) -> list[dict[str, Any]]:
    """Every request of the conversation: (tokens in, tokens out, summary header)."""
    out: list[dict[str, Any]] = []
    messages: list[dict[str, Any]] = []
    ids = 0
    async with aiohttp.ClientSession() as s:
        async def send() -> None:
            request = {"model": CLAUDE, "max_tokens": 1024, "system": SYSTEM, "tools": TOOLS,
                       "messages": marked(messages), "stream": True}
            async with s.post(proxy_url + "/v1/messages", json=request, headers={
                    "x-api-key": "sk-client", "x-ctxproxy-context-manager": context_manager}) as r:
                assert r.status == 200, await r.text()
                await r.read()
                out.append({"in": int(r.headers["x-ctxproxy-tokens-in"]),
                            "out": int(r.headers["x-ctxproxy-tokens-out"]), "summary": r.headers["x-ctxproxy-summary"]})

        for turn in range(TURNS):
            messages.append({"role": "user", "content": f"turn {turn}: " + words(60, turn)})
            await send()
            for r in range(1 + turn % 2):
                ids += 1
                messages.append({"role": "assistant", "content": [
                    {"type": "text", "text": f"Looking ({turn}.{r})."},
                    {"type": "tool_use", "id": f"toolu_{ids:04d}", "name": "Read",
                     "input": {"path": f"/src/{ids}.py"}}]})
                messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{ids:04d}",
                                                              "content": words(220, turn * 7 + r)}]})
                await send()
            messages.append({"role": "assistant", "content": [{"type": "text", "text": f"Done with {turn}: "
                                                               + words(50, turn)}]})
    return out


@pytest.mark.parametrize("manager", ["summarising", "sliding-window"])
async def test_a_growing_60_turn_conversation_on_a_16k_budget(
        upstream: FakeUpstream, start_proxy: StartProxy, manager: str) -> None:
    proxy = await start_proxy({
        "upstreams": {"a": {"base_url": upstream.url, "api": "anthropic", "api_key": "sk-ant-up"}},
        "models": [{"name": CLAUDE, "context_window": 200_000, "max_output_tokens": 64_000}],
        "trimmer": {"max_tokens": BUDGET}, "cache": {"backend": "memory"},
        "logging": {"level": "WARNING", "requests": False},
    })
    runtime = proxy.state.runtime
    factor = runtime.calibration.factor(runtime.route(CLAUDE), "default") if runtime.calibration is not None else 1.0
    stats = await grow(proxy.url, manager)
    sent = [r.body for r in upstream.messages]
    assert len(sent) == len(stats)
    for body in sent:
        assert not pairing_problems(body["messages"])
        assert recount(body) * factor <= BUDGET and cache_marks(body) <= 4
        assert body["system"] == SYSTEM and body["tools"] == TOOLS
    pairs = list(itertools.pairwise(sent))
    survived = sum(cached_prefix_survives(a, b) for a, b in pairs)
    received = sum(r["in"] for r in stats)
    forwarded = sum(r["out"] for r in stats)
    summariser_calls = len(upstream.summaries)
    compacted = sum(1 for r in stats if r["in"] != r["out"])
    print(f"\n{manager}: {TURNS} turns, {len(stats)} requests on a {BUDGET}-token budget: "
          f"summariser calls {summariser_calls}; tokens received {received:,}, forwarded {forwarded:,} "
          f"({forwarded / received:.0%}); compacted requests {compacted}; cached prefix survived in "
          f"{survived}/{len(pairs)} consecutive requests ({survived / len(pairs):.1%}); "
          f"largest forwarded {max(r['out'] for r in stats):,} (token figures in the proxy's count; the budget holds "
          f"in the provider's, at the calibration factor {factor})")
    assert compacted > len(stats) // 2  # the budget really binds for most of the conversation
    assert forwarded < received * 0.6
    assert survived / len(pairs) >= 0.9  # compaction moves on a grid: most requests keep the provider's cache
    if manager == "summarising":
        assert 1 <= summariser_calls <= 12  # grows with the conversation, not with its request count
    else:
        assert summariser_calls == 0
