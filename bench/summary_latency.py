"""How long the request that crosses the summary threshold takes, with a slow summariser.

A growing conversation (one user turn and one answer more per request, no tool outputs to mask, so
every compaction is a summary) is sent through ctxproxy to a fake upstream whose summariser takes
``--delay`` seconds, with ``--think`` seconds between requests (an agent user reading the answer).
Each ``--ratio`` is one pass over the same conversation on a fresh proxy and cache:
``summary_prefetch_ratio: 0`` is the summariser on the critical path (the request that crosses T
makes the summary and waits for it), the default ``0.8`` starts it in the background.

The threshold-crossing requests are the ones that waited for a summary in the first pass (the
reference, normally ratio 0): their latency is reported for every pass, p50 and max, beside the
slowest of all requests, the summariser calls, and the summaries made in the background, used and
wasted. Every forwarded request is checked against B.

Run: ``.venv/bin/python bench/summary_latency.py [--requests 40] [--think 2] [--delay 1.5]
[--ratio 0 0.8] [--json-out FILE]``; ``--ratio none`` leaves the parameter out (a ctxproxy without it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proxy.core.modelinfo import offline_environment
from tests.fake_upstream import FakeUpstream
from tests.helpers import assistant, system, user, words

offline_environment()

MODEL = "small-model"
WINDOW, MAX_OUT = 8000, 1000
HARD_BUDGET = WINDOW - MAX_OUT - WINDOW // 10


def conversation(requests: int) -> list[list[dict[str, Any]]]:
    """Every request of the conversation: request i holds i user turns, the last one unanswered."""
    msgs: list[dict[str, Any]] = [system("You are a careful assistant. " + words(60, 1))]
    out = []
    for i in range(requests):
        msgs.append(user(f"turn {i}: " + words(130, 3 * i)))
        out.append(list(msgs))
        msgs.append(assistant(f"answer {i}: " + words(150, 5 * i + 1)))
    return out


@dataclass
class Pass:
    ratio: str
    latencies: list[float] = field(default_factory=list)
    statuses: list[str] = field(default_factory=list)
    tokens_out: list[int] = field(default_factory=list)
    summariser_calls: int = 0
    background: dict[str, float] = field(default_factory=dict)
    over_budget: int = 0


def config(upstream: str, ratio: str) -> dict[str, Any]:
    params: dict[str, Any] = {"keep_turns": 4}
    if ratio != "none":
        params["summary_prefetch_ratio"] = float(ratio)
    return {
        "upstreams": {"fake": {"base_url": upstream, "api_key": "sk-upstream"}},
        "models": [{"name": MODEL, "context_window": WINDOW, "max_output_tokens": MAX_OUT},
                   {"name": "gpt-4o-mini", "context_window": 128_000, "max_output_tokens": 16_384}],
        "summarizer_model": "gpt-4o-mini",
        "context_manager": {"type": "summarising", "params": params},
        "summarizer": {"timeout_seconds": 30, "max_summary_tokens": 300},
        "cache": {"backend": "memory"},
        "logging": {"level": "WARNING", "requests": False},
    }


def background_counts(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("ctxproxy_background_summaries_total{"):
            result = line.split('result="', 1)[1].split('"', 1)[0]
            out[result] = out.get(result, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def one_pass(ratio: str, requests: int, think: float, delay: float) -> Pass:
    from proxy.serve.app import create_app
    from proxy.serve.server import make_runner
    from proxy.serve.state import STATE
    from proxy.settings import load_config

    fake = await FakeUpstream(summary_delay=delay).start()
    cfg = load_config(config(fake.base_url, ratio))
    app = create_app(cfg)
    runner = make_runner(app, cfg, shutdown_timeout=5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    out = Pass(ratio)
    try:
        async with aiohttp.ClientSession() as s:
            for n, messages in enumerate(conversation(requests)):
                if n:
                    await asyncio.sleep(think)
                began = time.perf_counter()
                async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                                  json={"model": MODEL, "messages": messages}) as r:
                    await r.read()
                    assert r.status == 200, r.status
                    out.latencies.append(time.perf_counter() - began)
                    out.statuses.append(r.headers["x-ctxproxy-summary"])
                    out.tokens_out.append(int(r.headers["x-ctxproxy-tokens-out"]))
    finally:
        await runner.cleanup()  # a background summary still unused now counts as wasted
        text = app[STATE].metrics.render()[0].decode()
        await fake.stop()
    out.summariser_calls = len(fake.summaries)
    out.background = background_counts(text)
    out.over_budget = sum(1 for t in out.tokens_out if t > HARD_BUDGET)
    return out


def p50(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def table(passes: list[Pass], crossing: list[int]) -> str:
    rows = ["| summary_prefetch_ratio | crossing requests | their p50 | their max | slowest request | "
            "statuses | summariser calls | background started / made / used / wasted | over B |",
            "|---|---|---|---|---|---|---|---|---|"]
    for p in passes:
        mine = [p.latencies[i] for i in crossing]
        counts = {k: p.statuses.count(k) for k in sorted(set(p.statuses))}
        b = p.background
        rows.append(
            f"| {p.ratio} | {len(crossing)} | {1000 * p50(mine):.0f} ms | {1000 * max(mine, default=0):.0f} ms | "
            f"{1000 * max(p.latencies):.0f} ms | {', '.join(f'{k} {v}' for k, v in counts.items())} | "
            f"{p.summariser_calls} | {b.get('started', 0):.0f} / {b.get('made', 0):.0f} / "
            f"{b.get('used', 0):.0f} / {b.get('wasted', 0):.0f} | {p.over_budget} |")
    return "\n".join(rows)


async def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--think", type=float, default=2.0)
    ap.add_argument("--delay", type=float, default=1.5)
    ap.add_argument("--ratio", nargs="+", default=["0", "0.8"])
    ap.add_argument("--json-out")
    args = ap.parse_args(argv)
    passes = [await one_pass(r, args.requests, args.think, args.delay) for r in args.ratio]
    reference = passes[0]
    crossing = [i for i, s in enumerate(reference.statuses) if s in ("created", "waited")]
    print(f"{args.requests} requests, {args.think:g} s think time, a {args.delay:g} s summariser, "
          f"B = {HARD_BUDGET}; crossing requests (waited in the first pass): {crossing}")
    print(table(passes, crossing))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": vars(args), "crossing": crossing,
                                                   "passes": [asdict(p) for p in passes]}, indent=1) + "\n")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
