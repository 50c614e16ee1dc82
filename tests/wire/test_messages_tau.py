"""The 200 tau-bench trajectories (OpenAI chat format) converted to Messages blocks, through the pipeline over an
8k model, for each context manager: whole, cut mid tool round, and damaged (an orphan result, a lost
result, a displaced result, a duplicate). Every forwarded body is paired by Anthropic's rules, fits the budget by
an independent recount, keeps the system prompt and the current user turn; a refusal is justified."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from proxy.core.errors import ContextLengthExceeded
from proxy.core.modelinfo import ModelMap
from proxy.core.tokens import TokenCounter
from proxy.pipeline import assemble
from proxy.policy import Routes, policy_for
from proxy.wire.messages import WIRE
from tests.helpers import MANAGERS, hard_budget, make_config, services, tau_trajectories
from tests.wire.messages_helpers import CLAUDE, body, from_chat, pairing_problems, recount

WINDOW = 8_000
COUNTER = TokenCounter("o200k_base")


def variants(traj: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    out = [("full", traj)]
    tools = [i for i, m in enumerate(traj) if m["role"] == "tool"]
    if tools:
        out.append(("mid-round", traj[: tools[-1] + 1]))
        damaged = list(traj)
        last = tools[-1]
        if last + 1 < len(damaged):
            damaged[last], damaged[last + 1] = damaged[last + 1], damaged[last]
        if len(tools) > 2:
            damaged.insert(tools[1] + 1, {**damaged[tools[1]], "content": "duplicate"})
        del damaged[tools[0]]
        damaged.insert(1, {"role": "tool", "tool_call_id": "call_orphan", "content": "stray"})
        out.append(("damaged", damaged))
    return out


def current_text(messages: list[dict[str, Any]]) -> Any:
    for m in reversed(messages):
        if m["role"] == "user":
            if isinstance(m["content"], str):
                return m["content"]
            others = [b for b in m["content"] if b.get("type") != "tool_result"]
            if others:
                return others
    return None


@pytest.fixture(scope="module")
def matrix() -> dict[str, Any]:
    async def run() -> dict[str, Any]:
        results: dict[str, dict[str, Any]] = {}
        model_map = ModelMap()
        start = time.perf_counter()
        for manager, binding in MANAGERS.items():
            config = make_config(window=WINDOW, model=CLAUDE, context_manager=binding)
            route = Routes(config, model_map).resolve(CLAUDE)
            policy = policy_for(config, None, CLAUDE, None)
            stats: dict[str, Any] = {"refused": 0, "changed": 0, "unchanged": 0, "problems": []}
            for item in tau_trajectories():
                for variant, chat in variants(item["traj"]):
                    system, messages = from_chat(chat)
                    request = body(messages, system=system)
                    where = (item["task_id"], variant)
                    try:
                        a = await assemble(request, wire=WIRE, route=route, policy=policy, counter=COUNTER,
                                           services=services(COUNTER))
                    except ContextLengthExceeded:
                        stats["refused"] += 1
                        # justified only if the system prompt and the current turn alone do not fit
                        need = recount(body([{"role": "user", "content": current_text(messages)}], system=system))
                        if need <= hard_budget(WINDOW):
                            stats["problems"].append((*where, f"refused although {need} fit"))
                        continue
                    stats["changed" if a.changed else "unchanged"] += 1
                    out = a.body
                    problems = pairing_problems(out["messages"])
                    n = recount(out)
                    if n != a.report.tokens_after or n > a.report.hard_budget:
                        problems.append(f"{n} tokens, report {a.report.tokens_after}, budget {a.report.hard_budget}")
                    if out.get("system") is not request.get("system"):
                        problems.append("system changed")
                    if current_text(out["messages"]) != current_text(messages):
                        problems.append("current user turn changed")
                    if problems:
                        stats["problems"].append((*where, problems[:3]))
            results[manager] = stats
        return {"results": results, "elapsed": time.perf_counter() - start,
                "requests": sum(len(variants(i["traj"])) for i in tau_trajectories())}

    return asyncio.run(run())


@pytest.mark.parametrize("manager", sorted(MANAGERS))
def test_tau_bench_as_messages_over_an_8k_model(matrix: dict[str, Any], manager: str) -> None:
    stats = matrix["results"][manager]
    print(f"{manager:28}: changed={stats['changed']} unchanged={stats['unchanged']} refused={stats['refused']}")
    assert not stats["problems"], stats["problems"][:5]
    assert stats["changed"] + stats["unchanged"] + stats["refused"] == matrix["requests"]
    assert stats["changed"] > 100  # an 8k window really compacts these conversations
    assert stats["refused"] == 0  # a 1.3k-token system prompt and one turn always fit 8k


@pytest.mark.slow
def test_tau_bench_as_messages_runtime(matrix: dict[str, Any]) -> None:
    print(f"tau-bench as Messages: {matrix['requests']} requests x {len(MANAGERS)} managers, "
          f"{matrix['elapsed']:.1f}s")
    assert matrix["elapsed"] < 90
