#!/usr/bin/env python3
"""Prefix stability on a growing agent conversation (provider prompt-cache friendliness).

Replays agent_long.json as the agent sent it: one request each time the model is
called (after every user message and every round of tool results), 100
consecutive requests from the point where the 16k budget starts to bind. For
each context manager it reports the share of requests whose forwarded messages
start with the previous request's forwarded messages — measured by the same
``PrefixTracker`` that feeds ``ctxproxy_prefix_stable_total``.

    .venv/bin/python bench/prefix_bench.py [--budget 16000] [--requests 100]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.pipeline_bench import make_runtime, read_payload  # noqa: E402
from proxy.settings import load_config  # noqa: E402
from proxy.store.prefix import PrefixTracker  # noqa: E402
from proxy.wire.chat import WIRE as CHAT  # noqa: E402
from tests.wire.chat_helpers import is_valid  # noqa: E402

MANAGERS: dict[str, Any] = {
    "summarising (llm)": {"type": "summarising", "params": {"keep_turns": 10}},
    "summarising (drop)": {"type": "summarising", "params": {"keep_turns": 10, "summarizer": "drop"}},
    "summarising (llm, no masking)": {"type": "summarising", "params": {"keep_turns": 10,
                                                                        "mask_observations": False}},
    "observation-masking": {"type": "observation-masking"},
    "sliding-window": {"type": "sliding-window", "params": {"keep_turns": 10}},
    "stack (max_messages 120)": {"type": "stack", "params": {"max_messages": 120}},
    "trimmer alone (stack, no cap)": {"type": "stack"},
}


def request_points(messages: list[dict[str, Any]]) -> list[int]:
    """Lengths at which the agent called the model: before every assistant message, and at the end."""
    points = [i for i in range(1, len(messages)) if messages[i].get("role") == "assistant"]
    return [*points, len(messages)]


async def share(manager: Any, budget: int, count: int, payload: str) -> tuple[float, int, int, int]:
    body = read_payload(payload)
    messages = body["messages"]
    cfg = load_config({
        "upstreams": {"up": {"base_url": "http://127.0.0.1:9"}},
        "models": [{"name": "gpt-4o-mini", "context_window": 128000}],
        "context_manager": manager,
        "trimmer": {"max_tokens": budget},
        "cache": {"backend": "memory"},
    })
    runtime = make_runtime(cfg)
    tracker = PrefixTracker()
    points = request_points(messages)
    results: list[bool] = []
    compacted = created = 0
    for n in points[1:]:
        request = dict(body, messages=messages[:n])
        assembly, _, _ = await runtime.assemble(CHAT, request, tenant=None)
        assert is_valid(assembly.messages) and assembly.report.tokens_after <= budget
        if assembly.report.tokens_before > budget * 0.9 or results:
            stable = tracker.observe(assembly.received, assembly.items)
            if stable is not None:
                results.append(stable)
                compacted += assembly.changed
                created += assembly.report.summary == "created"
        else:
            tracker.observe(assembly.received, assembly.items)
        if len(results) >= count:
            break
    return sum(results) / max(1, len(results)), len(results), compacted, created


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=int, default=16000)
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--payload", default="agent_long.json")
    a = ap.parse_args()
    print("| context manager | payload | budget | requests | compacted | summaries made | prefix kept |")
    print("|---|---|---|---|---|---|---|")
    for name, manager in MANAGERS.items():
        s, n, compacted, created = await share(manager, a.budget, a.requests, a.payload)
        print(f"| {name} | {a.payload} | {a.budget} | {n} | {compacted} | {created} | {s:.1%} |")


if __name__ == "__main__":
    asyncio.run(main())
