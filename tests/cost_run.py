"""The cost figures of docs/cost.md: one agent conversation with and without context management.

An agent conversation of ``turns`` user turns (each followed by 2-4 tool rounds and an answer; the agent
sends a request after every user message and every round of tool results, as agents do) goes twice
through a fake upstream that reports its true o200k counts and OpenAI-style prompt caching (cached
tokens = the longest common prefix with the conversation's previous request, in blocks of 128 tokens,
from 1,024 on):

- **unmanaged**: straight to the upstream, every request the whole conversation;
- **managed**: through ctxproxy on a ``budget``-token budget (``trimmer.max_tokens``) with the
  default ``summarising`` manager and a ``gpt-4o-mini`` summariser.

Both runs are priced from the usage the upstream reported (input, cached input, output) at litellm's
prices for ``model``; the managed run adds what its summariser calls reported. Their difference is
what context management really saved on this conversation; the proxy's own figures (gross, summariser,
prompt-cache effect, net: its metrics) are set beside it.

Run: ``.venv/bin/python -m tests.cost_run [turns] [budget] [model ...]``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
from aiohttp import web

from proxy.core.modelinfo import ModelMap, offline_environment
from tests.fake_upstream import FakeUpstream
from tests.helpers import assistant, call, system, tool, user, words
from tests.outside import metric_total

offline_environment()

SUMMARISER = "gpt-4o-mini"
ROUTE = "agent"
# a summary as long as real ones run (the fake's default is one line): ~300 tokens
SUMMARY = " ".join(f"- Step {i}: booking ZX{i}Q for passenger U-{100 + i} moved to seat {i}C, fare {400 + i}.50 USD, "
                   "confirmation sent; open task: refund the change fee." for i in range(12))


def agent_requests(turns: int) -> list[list[dict[str, Any]]]:
    """Every request of a ``turns``-turn agent conversation; each one extends the previous."""
    out: list[list[dict[str, Any]]] = []
    msgs: list[dict[str, Any]] = [system(words(400, 1))]
    ids = itertools.count()
    for turn in range(1, turns + 1):
        msgs.append(user(f"turn {turn}: " + words(30, turn)))
        out.append(list(msgs))
        for r in range(2 + (turn * 5 + 7) % 3):
            n_calls = 2 if (turn + r) % 3 == 0 else 1
            tids = [f"call_{next(ids)}" for _ in range(n_calls)]
            msgs.append(call(*[(t, "lookup", json.dumps({"turn": turn, "round": r})) for t in tids]))
            for k, t in enumerate(tids):
                msgs.append(tool(t, f"{t} result: " + words(180 // n_calls, turn * 13 + r + k)))
            out.append(list(msgs))
        msgs.append(assistant(f"answer {turn}: " + words(60, turn + 3)))
    return out


@dataclass
class Figures:
    model: str
    turns: int
    budget: int
    requests: int
    summaries_created: int  # by a request, or in the background
    summaries_reused: int
    background_made: int  # of summaries_created, made in the background; of those, never used by a request:
    background_wasted: int
    tokens_unmanaged: int  # input tokens the upstream counted, over the run
    tokens_managed: int
    cached_unmanaged: int
    cached_managed: int
    cost_unmanaged: float  # USD, from the upstream's usage
    cost_managed: float  # chat requests + summariser calls
    actual_saving: float  # cost_unmanaged - cost_managed
    gross: float  # ctxproxy's figures (its metrics)
    summariser: float
    cache_break: float
    cache_removed: float
    net: float

    def table(self) -> str:
        rows = [
            ("requests (agent calls)", f"{self.requests}"),
            ("summaries created / reused", f"{self.summaries_created} / {self.summaries_reused}"),
            ("of those created, in the background / wasted", f"{self.background_made} / {self.background_wasted}"),
            ("input tokens, unmanaged -> managed", f"{self.tokens_unmanaged:,} -> {self.tokens_managed:,}"),
            ("of which cached, unmanaged -> managed", f"{self.cached_unmanaged:,} -> {self.cached_managed:,}"),
            ("cost without context management", f"${self.cost_unmanaged:.4f}"),
            ("cost with it (incl. summariser)", f"${self.cost_managed:.4f}"),
            ("actual saving (difference)", f"${self.actual_saving:.4f}"),
            ("ctxproxy: gross savings", f"${self.gross:.4f}"),
            ("ctxproxy: summariser cost", f"-${self.summariser:.4f}"),
            ("ctxproxy: prompt-cache effect, break", f"-${self.cache_break:.4f}"),
            ("ctxproxy: prompt-cache effect, removed", f"-${self.cache_removed:.4f}"),
            ("ctxproxy: net savings", f"${self.net:.4f}"),
        ]
        width = max(len(k) for k, _ in rows)
        head = f"{self.turns}-turn agent conversation, {self.budget:,}-token budget, priced as {self.model}"
        return "\n".join([head, *(f"  {k.ljust(width)}  {v}" for k, v in rows)])


async def run(turns: int = 60, budget: int = 16_000, model: str = "gpt-4o", manager: Any = None) -> Figures:
    from proxy.serve.app import create_app
    from proxy.serve.server import make_runner
    from proxy.serve.state import STATE
    from proxy.settings import load_config

    fake = await FakeUpstream(prompt_scale=1.0, report_cached=True, cache_min=1024, cache_block=128,
                              summary_text=SUMMARY).start()
    config = load_config({
        "upstreams": {"fake": {"base_url": fake.base_url, "api_key": "sk-upstream"}},
        "models": [{"name": ROUTE, "model": model, "context_window": 128_000, "max_output_tokens": 4096},
                   {"name": SUMMARISER, "context_window": 128_000, "max_output_tokens": 16_384}],
        "summarizer_model": SUMMARISER,
        "trimmer": {"max_tokens": budget},
        "cache": {"backend": "memory"},
        "logging": {"level": "WARNING", "requests": False},
        **({"context_manager": manager} if manager is not None else {}),
    })
    app = create_app(config)
    runner = make_runner(app, config, shutdown_timeout=2)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    requests = agent_requests(turns)
    try:
        async with aiohttp.ClientSession() as s:
            for target, conversation in ((f"http://127.0.0.1:{port}/v1", "managed"), (fake.base_url, "unmanaged")):
                for messages in requests:
                    async with s.post(target + "/chat/completions", json={"model": ROUTE, "messages": messages},
                                      headers={"Authorization": "Bearer sk-client",
                                               "x-fake-conversation": conversation}) as r:
                        assert r.status == 200, await r.text()
    finally:
        await runner.cleanup()  # a background summary no request used by now counts as wasted
        await fake.stop()
    text = app[STATE].metrics.render()[0].decode()
    n = len(requests)
    managed, unmanaged = fake.usages[:n], fake.usages[n:]
    prices = ModelMap().prices(model)
    mini = ModelMap().prices(SUMMARISER)
    assert prices is not None and mini is not None

    def cost(usages: list[dict[str, Any]]) -> float:
        return sum(prices.call(u["prompt_tokens"], u["completion_tokens"], u["prompt_tokens_details"]["cached_tokens"])
                   for u in usages)

    summariser_cost = sum(mini.call(u["prompt_tokens"], u["completion_tokens"]) for u in fake.summary_usages)
    cost_unmanaged, cost_managed = cost(unmanaged), cost(managed) + summariser_cost
    t = {"tenant": "default", "model": ROUTE}
    return Figures(
        model=model, turns=turns, budget=budget, requests=n,
        summaries_created=int(metric_total(text, "ctxproxy_summaries_total", result="created")
                              + metric_total(text, "ctxproxy_background_summaries_total", result="made")),
        summaries_reused=int(metric_total(text, "ctxproxy_summaries_total", result="reused")),
        background_made=int(metric_total(text, "ctxproxy_background_summaries_total", result="made")),
        background_wasted=int(metric_total(text, "ctxproxy_background_summaries_total", result="wasted")),
        tokens_unmanaged=sum(u["prompt_tokens"] for u in unmanaged),
        tokens_managed=sum(u["prompt_tokens"] for u in managed),
        cached_unmanaged=sum(u["prompt_tokens_details"]["cached_tokens"] for u in unmanaged),
        cached_managed=sum(u["prompt_tokens_details"]["cached_tokens"] for u in managed),
        cost_unmanaged=cost_unmanaged, cost_managed=cost_managed, actual_saving=cost_unmanaged - cost_managed,
        gross=metric_total(text, "ctxproxy_estimated_savings_usd_total", **t),
        summariser=metric_total(text, "ctxproxy_request_summarizer_cost_usd_total", **t),
        cache_break=metric_total(text, "ctxproxy_prompt_cache_effect_usd_total", **t, kind="break"),
        cache_removed=metric_total(text, "ctxproxy_prompt_cache_effect_usd_total", **t, kind="removed"),
        net=metric_total(text, "ctxproxy_net_savings_usd_total", **t)
        - metric_total(text, "ctxproxy_net_loss_usd_total", **t),
    )


def main(argv: list[str]) -> None:
    turns = int(argv[0]) if argv else 60
    budget = int(argv[1]) if len(argv) > 1 else 16_000
    for model in argv[2:] or ["gpt-4o", "claude-sonnet-4-5"]:
        figures = asyncio.run(run(turns, budget, model))
        print(figures.table())
        print(json.dumps(asdict(figures)))
        print()


if __name__ == "__main__":
    main(sys.argv[1:])
