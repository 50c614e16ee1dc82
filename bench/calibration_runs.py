#!/usr/bin/env python3
"""The two calibration runs, measured through the real proxy for each way of setting the calibration factor.

A conversation in Claude Code's shape (``tests/test_calibration_server.py:claude_code_run``: a 15k-token tool
list, three tool-heavy requests, then file reads of 8k tokens each; 36 requests on the Messages wire) against
a fake provider that enforces a 48k window (4k of it the answer's) and counts tool schemas at 0.5x and text at
1.3x o200k (the extreme run: 0.2x / 1.4x). Each way runs the same requests through the same proxy; only the
factor the budget divides by differs:

- ``shipped``: the proxy as it is: its calibration store (the envelope of recent ratios) and its recovery from
  a refusal for length (``proxy.serve.overflow``);
- ``median``: the rule before: the median of the last 32 ratios (the family default until 3), a refusal
  dropping the samples below it and weighing 3 samples;
- ``envelope``: the shipped rule (``proxy.store.calibration.envelope``), without the recovery;
- ``split``: tool schemas and the rest calibrated apart, by least squares over the last 32 answers
  (provider = a x tools + b x rest), the budget then solved for this request's tool list.

For the last three, the factor is set by this script before each request, from the answers so far (the
refused ones included, from the count the refusal states); the proxy's recovery cannot help them (its
retry would use the same factor), so each of their refusals reaches the client. Printed per run and way:
refused attempts, client errors, and how full the provider's window was on the text-heavy requests (the
provider's count over window - answer: the price of a conservative bound is a lower figure).

    .venv/bin/python -m bench.calibration_runs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from proxy.core.modelinfo import offline_environment
from proxy.store.calibration import MAX_FACTOR, MIN_FACTOR, envelope, family_default, publish
from tests.fake_upstream import FakeUpstream, ProviderWindow, o200k_tokens
from tests.outside import text_of
from tests.test_calibration_server import (
    CLAUDE,
    RUN_OUTPUT,
    RUN_WINDOW,
    TOOL_HEAVY,
    claude_code_run,
    run_config,
)

offline_environment()



class MixedWindow(ProviderWindow):
    """A provider whose tokenizer counts JSON (a tool result that is a JSON document) at ``json_scale`` and
    other text at ``text_scale``: the ratio of the messages moves with what they hold, not only with the
    share of the tool list."""

    json_scale: float = 1.6

    def count(self, body: dict[str, Any]) -> int:
        plain = ProviderWindow(self.limit, self.text_scale, self.tool_scale).count(body)
        documents = sum(o200k_tokens(b["content"]) for m in body.get("messages", []) if isinstance(m["content"], list)
                        for b in m["content"] if b.get("type") == "tool_result" and str(b["content"]).startswith("{"))
        return round(plain + (self.json_scale - self.text_scale) * documents)


def big_read(bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same conversation, but the first file read is 28k tokens: no ratio seen before it predicts the count of
    the request after it."""
    out = []
    at = TOOL_HEAVY * 4 + 2  # the first text-heavy request's tool result, in the history of every later request
    for body in bodies:
        messages = list(body["messages"])
        if len(messages) > at:
            block = messages[at]["content"][0]
            messages[at] = {**messages[at], "content": [{**block, "content": text_of(28_000, seed=7)}]}
        out.append({**body, "messages": messages})
    return out


def json_later(bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same conversation, but from the 20th request on the files read are JSON documents."""
    def as_json(message: dict[str, Any], k: int) -> dict[str, Any]:
        blocks = [{**b, "content": json.dumps({"path": f"/srv/data/{k}.json", "rows": b["content"].split()})}
                  if b.get("type") == "tool_result" else b for b in message["content"]]
        return {**message, "content": blocks}

    out = []
    for body in bodies:
        messages = [as_json(m, i) if i >= 20 * 4 - 2 and isinstance(m["content"], list) else m
                    for i, m in enumerate(body["messages"])]
        out.append({**body, "messages": messages})
    return out


@dataclass(frozen=True)
class Run:
    tools: float
    text: float
    bodies: Callable[[list[dict[str, Any]]], list[dict[str, Any]]] = lambda bodies: bodies
    window: type[ProviderWindow] = ProviderWindow


RUNS = {
    "0.5/1.3": Run(0.5, 1.3),  # the two runs of the tests (tests/test_calibration_server.py)
    "0.2/1.4": Run(0.2, 1.4),
    "0.5/1.3, a 28k read first": Run(0.5, 1.3, big_read),
    "0.5/1.1, JSON at 1.6 later": Run(0.5, 1.1, json_later, MixedWindow),
}
WINDOW_SAMPLES = 32
MIN_SAMPLES = 3
PLAUSIBLE = (1 / 3, 3.0)
MIN_TOKENS = 256


def _ratio(provider: int, proxy: int) -> float | None:
    if proxy < MIN_TOKENS or provider <= 0 or not PLAUSIBLE[0] <= provider / proxy <= PLAUSIBLE[1]:
        return None
    return min(MAX_FACTOR, max(MIN_FACTOR, provider / proxy))


@dataclass
class Median:
    """The rule before: the median of the last 32 ratios, a dead band of 0.02 both ways."""

    default: float
    ratios: list[float] = field(default_factory=list)
    current: float | None = None

    def factor(self, tools: int, budget: int) -> float:
        if len(self.ratios) < MIN_SAMPLES:
            return self.default
        median = statistics.median(self.ratios)
        if self.current is None or abs(median - self.current) >= 0.02:
            self.current = round(median, 2)
        return self.current

    def answered(self, tools: int, proxy: int, provider: int) -> None:
        ratio = _ratio(provider, proxy)
        if ratio is not None:
            self.ratios = [*self.ratios, ratio][-WINDOW_SAMPLES:]

    def refused(self, tools: int, proxy: int, provider: int) -> None:
        ratio = _ratio(provider, proxy)
        if ratio is not None:
            ratio = math.ceil(round(ratio * 100, 6)) / 100
            self.ratios = ([r for r in self.ratios if r >= ratio] + [ratio] * MIN_SAMPLES)[-WINDOW_SAMPLES:]


@dataclass
class Envelope:
    """The shipped rule: the envelope of recent ratios, published up at once and down past a dead band."""

    default: float
    ratios: list[float] = field(default_factory=list)
    current: float | None = None

    def factor(self, tools: int, budget: int) -> float:
        if self.ratios:
            self.current = publish(envelope(self.ratios, self.default), self.current)
            return self.current
        return self.default

    def answered(self, tools: int, proxy: int, provider: int) -> None:
        ratio = _ratio(provider, proxy)
        if ratio is not None:
            self.ratios = [*self.ratios, ratio][-WINDOW_SAMPLES:]

    refused = answered


@dataclass
class Split:
    """Tool schemas and the rest apart: provider = a x tools + b x rest, by least squares; the single ratio (the
    default first) until the fit is determined."""

    default: float
    samples: list[tuple[int, int, int]] = field(default_factory=list)  # (tools, rest, provider)

    def fit(self) -> tuple[float, float] | None:
        rows = self.samples[-WINDOW_SAMPLES:]
        if len(rows) < MIN_SAMPLES:
            return None
        stt = sum(t * t for t, _, _ in rows)
        srr = sum(r * r for _, r, _ in rows)
        str_ = sum(t * r for t, r, _ in rows)
        stn = sum(t * n for t, _, n in rows)
        srn = sum(r * n for _, r, n in rows)
        det = stt * srr - str_ * str_
        if det <= 1e-9 * stt * srr:  # the same mix every time: a and b cannot be told apart
            return None
        a = (stn * srr - srn * str_) / det
        b = (srn * stt - stn * str_) / det
        return min(3.0, max(0.05, a)), min(MAX_FACTOR, max(MIN_FACTOR, b))

    def factor(self, tools: int, budget: int) -> float:
        fitted = self.fit()
        if fitted is None:
            ratios = [n / (t + r) for t, r, n in self.samples if t + r]
            return max([self.default, *ratios[-MIN_SAMPLES:]])
        a, b = fitted
        proxy_budget = tools + (budget - a * tools) / b
        return min(MAX_FACTOR, max(MIN_FACTOR, budget / proxy_budget)) if proxy_budget > 0 else MAX_FACTOR

    def answered(self, tools: int, proxy: int, provider: int) -> None:
        if proxy >= MIN_TOKENS and provider > 0:
            self.samples.append((tools, proxy - tools, provider))

    refused = answered


Way = Median | Envelope | Split
WAYS: dict[str, Callable[[float], Way]] = {"median": Median, "envelope": Envelope, "split": Split}


class Pinned:
    """A runtime calibration whose factor this script sets before each request."""

    def __init__(self) -> None:
        self.value = 1.0

    def factor(self, route: Any, tenant: str) -> float:
        return self.value

    def window(self, route: Any) -> int | None:
        return None

    async def prime(self, route: Any, tenant: str) -> None:
        """Nothing to load."""


@dataclass
class Result:
    refused: int
    errors: int
    use: list[float]

    def row(self, run: str, way: str) -> str:
        mean = statistics.mean(self.use) if self.use else 0.0
        low = min(self.use) if self.use else 0.0
        return f"| {run} | {way} | {self.refused} | {self.errors} | {mean:.0%} | {low:.0%} |"


async def measure(run: Run, way: str) -> Result:
    from proxy.serve.app import create_app
    from proxy.serve.server import make_runner
    from proxy.serve.state import STATE
    from proxy.settings import load_config

    upstream = await FakeUpstream().start()
    upstream.window = run.window(RUN_WINDOW, tool_scale=run.tools, text_scale=run.text, dialect="anthropic")
    config = load_config(run_config(upstream))
    app = create_app(config)
    runner = make_runner(app, config, shutdown_timeout=2)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    headers = {"x-api-key": "sk-bench", "anthropic-version": "2023-06-01"}
    bodies = run.bodies(claude_code_run())
    pinned, estimator = Pinned(), (WAYS[way](family_default(CLAUDE)[1]) if way != "shipped" else None)
    if estimator is not None:
        app[STATE].served.runtime.calibration = pinned  # type: ignore[assignment]
    budget = RUN_WINDOW - RUN_OUTPUT - math.ceil(0.1 * RUN_WINDOW)
    errors, use = 0, []
    try:
        async with aiohttp.ClientSession() as s:
            tools = await _tool_tokens(s, url, bodies[0], headers)
            for k, body in enumerate(bodies):
                if estimator is not None:
                    pinned.value = estimator.factor(tools, budget)
                refused_before = len(upstream.window_refused)
                async with s.post(url + "/v1/messages", json=body, headers=headers) as r:
                    await r.read()
                    status, sent = r.status, int(r.headers.get("x-ctxproxy-tokens-out", "0"))
                errors += status != 200
                if estimator is not None and sent:
                    provider = upstream.window_counts[-1]
                    if len(upstream.window_refused) > refused_before:
                        estimator.refused(tools, sent, provider)
                    else:
                        estimator.answered(tools, sent, provider)
                if status == 200 and k >= TOOL_HEAVY:
                    use.append(upstream.window_counts[-1] / (RUN_WINDOW - RUN_OUTPUT))
    finally:
        await runner.cleanup()
        await upstream.stop()
    return Result(len(upstream.window_refused), errors, use)


async def _tool_tokens(s: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]) -> int:
    """The proxy's own count of the tool list: a body with it less the same body without it (explain)."""
    counts = []
    for probe in (body, {k: v for k, v in body.items() if k != "tools"}):
        async with s.post(url + "/v1/ctxproxy/explain/messages", json=probe, headers=headers) as r:
            counts.append((await r.json())["report"]["tokens_before"])
    return int(counts[0] - counts[1])


async def main(ways: list[str]) -> None:
    logging.getLogger("ctxproxy").setLevel(logging.ERROR)  # the refusals are counted below, not logged
    print("| run (tools/text) | way | refused attempts | client errors | window use, mean | window use, min |")
    print("|---|---|---|---|---|---|")
    for name, run in RUNS.items():
        for way in ways:
            print((await measure(run, way)).row(name, way), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ways", nargs="+", default=["shipped", "median", "envelope", "split"],
                        choices=["shipped", *WAYS])
    asyncio.run(main(parser.parse_args().ways))
