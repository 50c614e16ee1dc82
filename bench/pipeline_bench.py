#!/usr/bin/env python3
"""In-process pipeline timings on the benchmark payloads, next to tiktoken's own encode time.

cold = an empty token-count LRU and summary cache; warm = the same conversation
plus one new turn (the common agent case), after the previous request was
assembled. Prints a markdown table; medians of --runs runs.

    .venv/bin/python bench/pipeline_bench.py [--runs 7] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import gzip
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from plugins.base import Completion  # noqa: E402
from proxy.core.modelinfo import ModelMap  # noqa: E402
from proxy.core.tokens import Tokenizers, use_bundled_encodings  # noqa: E402
from proxy.runtime import Runtime  # noqa: E402
from proxy.settings import Config, load_config  # noqa: E402
from proxy.store.compaction import Compaction  # noqa: E402
from proxy.store.memory import MemoryCache  # noqa: E402
from proxy.store.summaries import SummaryService  # noqa: E402
from proxy.wire.chat import WIRE as CHAT  # noqa: E402
from tests.wire.chat_helpers import is_valid  # noqa: E402

PAYLOADS = ROOT / "bench" / "payloads"


def read_payload(name: str) -> Any:
    """A payload's JSON; agent_huge.json is kept gzip-compressed (bench/README.md)."""
    path = PAYLOADS / name
    raw = path.read_bytes() if path.exists() else gzip.decompress(path.with_name(name + ".gz").read_bytes())
    return json.loads(raw)


MODEL_MAP = ModelMap()


class InstantEngine:
    async def complete(self, model: str, messages: list[Any], *, max_tokens: int, timeout: float,
                       purpose: str, request_id: str = "") -> Completion:
        return Completion("Summary of the earlier work: files read, tests run, decisions taken.", model, 1000, 50)


def make_runtime(cfg: Config, tokenizers: Tokenizers | None = None) -> Runtime:
    """A runtime on a fresh memory cache with an instant summariser."""
    summaries = SummaryService(MemoryCache(), ttl=None, lock_wait=5, backoff_first=0, backoff_max=0)
    return Runtime(cfg, tokenizers=tokenizers or Tokenizers(), model_map=MODEL_MAP, summaries=summaries,
                   engine=InstantEngine(), compaction=Compaction(summaries))


def config(manager: Any, budget: int) -> Any:
    return load_config({
        "upstreams": {"up": {"base_url": "http://127.0.0.1:9"}},
        "models": [{"name": "gpt-4o-mini", "context_window": 400000, "max_output_tokens": 16384}],
        "context_manager": manager,
        "trimmer": {"max_tokens": budget},
        "cache": {"backend": "memory"},
    })


MANAGERS = {
    "summarising": {"type": "summarising", "params": {"keep_turns": 10}},
    "sliding-window": {"type": "sliding-window", "params": {"keep_turns": 10}},
    "stack": {"type": "stack", "params": {"max_messages": 200}},
}


def grown(body: dict[str, Any], i: int) -> dict[str, Any]:
    """The same conversation plus one new turn (user + assistant tool round + result)."""
    out = dict(body)
    out["messages"] = body["messages"] + [
        {"role": "assistant", "content": f"Step {i} done."},
        {"role": "user", "content": f"Now continue with step {i + 1}."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_new_{i}", "type": "function", "function": {"name": "read_file",
                                                                      "arguments": '{"path": "README.md"}'}}]},
        {"role": "tool", "tool_call_id": f"call_new_{i}", "content": "# README\n" + "line of text\n" * 40},
    ]
    return out


async def run_case(name: str, manager: Any, budget: int, runs: int, tokenizers: Tokenizers) -> dict[str, Any]:
    body = read_payload(name)
    cold, warm = [], []
    out_tokens = valid = None
    for _ in range(runs):
        cfg = config(manager, budget)
        # as in the server, the encoding and litellm's model map are loaded at startup: cold means
        # an empty token-count cache and summary cache, not a process that has read nothing yet
        tokenizers.get("o200k_base").clear()
        runtime = make_runtime(cfg, tokenizers)
        b0 = copy.deepcopy(body)
        t = time.perf_counter()
        a, _, _ = await runtime.assemble(CHAT, b0, tenant=None)
        cold.append(time.perf_counter() - t)
        for i in range(3):
            b = grown(body, i)
            t = time.perf_counter()
            a, _, _ = await runtime.assemble(CHAT, b, tenant=None)
            warm.append(time.perf_counter() - t)
            body_i = b  # noqa: F841
        out_tokens, valid = a.report.tokens_after, is_valid(a.messages)
        assert out_tokens <= budget
    return {"payload": name, "manager": manager["type"], "budget": budget, "cold_ms": statistics.median(cold) * 1e3,
            "warm_ms": statistics.median(warm) * 1e3, "tokens_out": out_tokens, "pairing_valid": valid}


def tiktoken_floor(name: str, runs: int) -> float:
    import tiktoken

    body = read_payload(name)
    texts = []
    for m in body["messages"]:
        if isinstance(m.get("content"), str):
            texts.append(m["content"])
        for c in m.get("tool_calls") or []:
            texts.append(c["function"]["arguments"])
    enc = tiktoken.get_encoding("o200k_base")
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        for text in texts:
            enc.encode_ordinary(text)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--json-out")
    a = ap.parse_args()
    use_bundled_encodings()
    tokenizers = Tokenizers()
    tokenizers.get("o200k_base")  # load the encoding and the model map once, outside the timings
    MODEL_MAP.get("gpt-4o-mini")
    rows = []
    for name, budget in (("agent_long.json", 16000), ("agent_huge.json", 128000)):
        floor = tiktoken_floor(name, a.runs)
        for manager in MANAGERS.values():
            row = await run_case(name, manager, budget, a.runs, tokenizers)
            row["tiktoken_ms"] = floor
            rows.append(row)
    print("| payload | manager | budget | cold ms | warm ms (+1 turn) | tiktoken o200k encode ms | cold / tiktoken "
          "| tokens out | pairing |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['payload']} | {r['manager']} | {r['budget']} | {r['cold_ms']:.1f} | {r['warm_ms']:.2f} | "
              f"{r['tiktoken_ms']:.1f} | {r['cold_ms'] / r['tiktoken_ms']:.2f}x | {r['tokens_out']} | "
              f"{'valid' if r['pairing_valid'] else 'BROKEN'} |")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
