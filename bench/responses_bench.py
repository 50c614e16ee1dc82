#!/usr/bin/env python3
"""Per-request CPU of a Responses and a Messages request next to the same conversation as Chat Completions.

The benchmark payloads (Chat Completions) are converted to Responses input items
(messages, ``function_call`` / ``function_call_output`` by call id, the tools in the
Responses shape) and to Anthropic Messages (a top-level system, ``tool_use`` blocks, one
user message per run of ``tool_result`` blocks, the tools in Anthropic's shape); each request is what the
managed handler does on the CPU: parse the JSON body (as the server does: from where it differs from the
previous one, ``proxy.serve.bodies``; ``--whole``: decoded whole), run the pipeline (``Runtime.assemble``),
serialise the body to forward when it changed. The wires alternate run by run (ABCABC), so all see the same
machine state. cold = empty token-count and summary caches; warm = the previous request plus one new turn (a growing
conversation). Medians of --runs runs, CPU time (process) per request.

    .venv/bin/python bench/responses_bench.py [--runs 7] [--json-out FILE] [--profile N]

``--profile N`` runs N warm requests of each wire (agent_long, under and over budget) under cProfile
instead, and prints the top entries by own time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.pipeline_bench import MANAGERS, config, make_runtime, read_payload  # noqa: E402
from proxy.core.tokens import Tokenizers, use_bundled_encodings  # noqa: E402
from proxy.runtime import Runtime  # noqa: E402
from proxy.serve.bodies import KnownBodies, read_json_body  # noqa: E402
from proxy.wire.chat import WIRE as CHAT  # noqa: E402
from proxy.wire.messages import WIRE as MESSAGES  # noqa: E402
from proxy.wire.responses import WIRE as RESPONSES  # noqa: E402

WIRES = {"chat": CHAT, "responses": RESPONSES, "messages": MESSAGES}
WARMING = 3
# warm requests not measured: a conversation's body is decoded whole until its third request (seen, read back,
# proven: ``proxy.serve.bodies``); the three after them are

Message = dict[str, Any]


def to_responses(body: dict[str, Any]) -> dict[str, Any]:
    """The same conversation on the Responses wire."""
    items: list[Message] = []
    for m in body["messages"]:
        role, content = m["role"], m.get("content")
        if role in ("system", "developer", "user"):
            items.append({"role": role, "content": content})
        elif role == "assistant":
            if content:
                items.append({"type": "message", "role": "assistant", "status": "completed",
                              "content": [{"type": "output_text", "text": content, "annotations": []}]})
            for call in m.get("tool_calls") or []:
                items.append({"type": "function_call", "call_id": call["id"], "name": call["function"]["name"],
                              "arguments": call["function"]["arguments"], "status": "completed"})
        elif role == "tool":
            items.append({"type": "function_call_output", "call_id": m["tool_call_id"], "output": content})
    tools = [{"type": "function", **t["function"]} for t in body.get("tools") or []]
    out: dict[str, Any] = {"model": body["model"], "input": items}
    if tools:
        out["tools"] = tools
    return out


def to_messages(body: dict[str, Any]) -> dict[str, Any]:
    """The same conversation on the Anthropic Messages wire."""
    from bench.retention_wires import FORMS

    out, _elements, _origins = FORMS["messages"].request(body["model"], body["messages"])
    tools = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
              "input_schema": t["function"].get("parameters", {"type": "object"})} for t in body.get("tools") or []]
    if tools:
        out["tools"] = tools
    return out


CONVERT = {"chat": lambda b: b, "responses": to_responses, "messages": to_messages}


def grown_chat(body: dict[str, Any], i: int) -> dict[str, Any]:
    from bench.pipeline_bench import grown

    return grown(body, i)


async def one(runtime: Runtime, wire: Any, raw: bytes, bodies: KnownBodies | None = None) -> tuple[float, float, int]:
    """CPU and wall seconds of one request as the handler spends them, and the tokens forwarded. ``bodies``: read
    the body as the server does, from where it differs from the previous one (else a whole ``orjson.loads``)."""
    cpu, wall = time.process_time(), time.perf_counter()
    body = bodies.parse(raw, "bench", wire.name, wire.field, read_json_body) if bodies else orjson.loads(raw)
    assembly, _route, _policy = await runtime.assemble(wire, body, tenant=None)
    if assembly.changed:
        orjson.dumps(assembly.body)
    return time.process_time() - cpu, time.perf_counter() - wall, assembly.report.tokens_after


async def run_case(name: str, manager: Any, budget: int, runs: int, tokenizers: Tokenizers,
                   whole: bool = False) -> list[dict[str, Any]]:
    chat_body = read_payload(name)
    chats = [chat_body]
    for i in range(WARMING + 3):  # a growing conversation: each request is the previous one plus a turn
        chats.append(grown_chat(chats[-1], i))
    raws = {w: [orjson.dumps(convert(b)) for b in chats] for w, convert in CONVERT.items()}
    cold: dict[str, list[float]] = {w: [] for w in WIRES}
    warm: dict[str, list[float]] = {w: [] for w in WIRES}
    tokens: dict[str, int] = {}
    for _ in range(runs):
        for w in WIRES:  # ABCABC: each wire on a fresh runtime and empty caches
            tokenizers.get("o200k_base").clear()
            runtime = make_runtime(config(manager, budget), tokenizers)
            bodies = None if whole else KnownBodies()
            cpu, _wall, _n = await one(runtime, WIRES[w], raws[w][0], bodies)
            cold[w].append(cpu)
            for i, raw in enumerate(raws[w][1:], 1):
                cpu, _wall, tokens[w] = await one(runtime, WIRES[w], raw, bodies)
                if i > WARMING:
                    warm[w].append(cpu)
    return [{"payload": name, "manager": manager["type"], "budget": budget, "wire": w,
             "cold_ms": statistics.median(cold[w]) * 1e3, "warm_ms": statistics.median(warm[w]) * 1e3,
             "tokens_out": tokens[w], "bytes": len(raws[w][-1])} for w in WIRES]


async def profile(requests: int, tokenizers: Tokenizers) -> None:
    """cProfile of ``requests`` warm requests per wire and case: the top entries by own time."""
    import cProfile
    import pstats

    chat_body = read_payload("agent_long.json")
    for budget in (200_000, 16_000):
        for w, convert in CONVERT.items():
            runtime = make_runtime(config(MANAGERS["summarising"], budget), tokenizers)
            chats = [chat_body]
            for i in range(requests):
                chats.append(grown_chat(chats[-1], i))
            raws = [orjson.dumps(convert(chat)) for chat in chats]
            bodies = KnownBodies()
            await one(runtime, WIRES[w], raws[0], bodies)
            prof = cProfile.Profile()
            prof.enable()
            for raw in raws[1:]:
                await one(runtime, WIRES[w], raw, bodies)
            prof.disable()
            print(f"\n## agent_long, budget {budget // 1000}k, {w}: {requests} warm requests (+1 turn each)")
            pstats.Stats(prof).sort_stats("tottime").print_stats(14)


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--json-out")
    ap.add_argument("--profile", type=int, default=0)
    ap.add_argument("--whole", action="store_true", help="decode every body whole (as before 2026-12-02, third stop)")
    a = ap.parse_args()
    use_bundled_encodings()
    tokenizers = Tokenizers()
    tokenizers.get("o200k_base")
    if a.profile:
        await profile(a.profile, tokenizers)
        return
    rows: list[dict[str, Any]] = []
    cases = [("agent_long.json", 200_000, MANAGERS["summarising"]),  # under budget: forwarded as sent
             ("agent_long.json", 16_000, MANAGERS["summarising"]),  # over budget: summarised, then reused
             ("agent_long.json", 16_000, MANAGERS["sliding-window"]),
             ("agent_huge.json", 128_000, MANAGERS["summarising"])]
    for name, budget, manager in cases:
        rows += await run_case(name, manager, budget, a.runs, tokenizers, a.whole)
    print("| payload → budget | manager | wire | body bytes | cold CPU ms | warm CPU ms (+1 turn) | tokens out |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['payload'].split('.')[0]} → {r['budget'] // 1000}k | {r['manager']} | {r['wire']} | "
              f"{r['bytes']:,} | {r['cold_ms']:.1f} | {r['warm_ms']:.2f} | {r['tokens_out']:,} |")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
