"""proxy.store.background: summaries made before a request needs them, so that no request waits for one.

Before it, the request whose conversation crossed the summary threshold T called the summariser and
waited for its answer: with a summariser taking 1.5 s, an agent saw a 1.5 s stall every time a
summary was due while every other request took milliseconds. Here the summary is started in the
background once the conversation reaches ``summary_prefetch_ratio`` x T, the request that crosses T
finds it ready, and a request waits only when nothing else fits under B (``x-ctxproxy-summary: waited``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from plugins.base import CachedSummary, Completion, SummaryScope
from proxy.core.errors import SummaryUnavailable
from proxy.store.background import BackgroundSummaries
from proxy.store.guard import Guard, cache_budget
from proxy.store.memory import MemoryCache
from proxy.store.summaries import SummaryService
from tests.fake_upstream import FakeUpstream
from tests.helpers import assistant, system, user, words
from tests.outside import metric_total, scrape
from tests.plugins.test_masking_http import WIRES, Wire, budget, send
from tests.plugins.test_masking_http import config as wires_config

WINDOW = 8_000
HARD, THRESHOLD = budget(WINDOW)
StartProxy = Callable[..., Awaitable[Any]]


def config(upstream: FakeUpstream, **params: Any) -> dict[str, Any]:
    """An 8k route on each wire; the summariser is a 32k chat route (every summary goes through the fake's
    chat summariser, whatever the wire)."""
    cfg = wires_config(upstream, {"type": "summarising", "params": {"keep_turns": 4, **params}})
    cfg["summarizer_model"] = "gpt-32k"
    cfg["summarizer"] = {"retry_backoff_seconds": 0, "timeout_seconds": 30, "max_summary_tokens": 300}
    return cfg


def requests_of(n: int) -> list[list[dict[str, Any]]]:
    """A growing conversation with no tool outputs (masking cannot help: every compaction is a summary): request
    i holds i + 1 user turns, the last one unanswered."""
    messages: list[dict[str, Any]] = [system("You are a careful assistant. " + words(60, 1))]
    out = []
    for i in range(n):
        messages.append(user(f"turn {i}: " + words(130, 3 * i)))
        out.append(list(messages))
        messages.append(assistant(f"answer {i}: " + words(150, 5 * i + 1)))
    return out


async def answered(proxy: Any, wire: Wire, messages: list[dict[str, Any]], stream: bool) -> dict[str, str]:
    """The response's headers; a request that waits for the (blocked) summariser fails here instead of hanging."""
    return await asyncio.wait_for(send(proxy, wire, wire.body(messages, wire.model(WINDOW), stream)), 20)


@pytest.mark.parametrize("wire", sorted(WIRES))
async def test_no_request_waits_for_a_summary_made_in_the_background(
        upstream: FakeUpstream, start_proxy: StartProxy, wire: str) -> None:
    """The summariser blocks until the test releases it, so a request that waited for it could not be answered:
    every request of a growing conversation is answered while it is blocked, within B, and the summaries made
    meanwhile in the background are used by the requests after (the user's think time is the release)."""
    w = WIRES[wire]
    upstream.summary_gate = asyncio.Event()
    proxy = await start_proxy(config(upstream))
    background = proxy.state.shared.background
    statuses: list[str] = []
    for n, messages in enumerate(requests_of(40)):
        headers = await answered(proxy, w, messages, stream=n % 2 == 1)  # answered with the summariser blocked
        statuses.append(headers["x-ctxproxy-summary"])
        assert int(headers["x-ctxproxy-tokens-out"]) <= HARD, n
        # think time: what the background started is made while the user reads the answer
        upstream.summary_gate.set()
        await background.idle()
        upstream.summary_gate = asyncio.Event()
    text = await scrape(proxy)
    made = metric_total(text, "ctxproxy_background_summaries_total", result="made")
    used = metric_total(text, "ctxproxy_background_summaries_total", result="used")
    assert "waited" not in statuses and "created" not in statuses, statuses
    print(statuses)
    assert statuses.count("reused") >= 10, statuses
    assert made >= 2 and used >= 2 and metric_total(text, "ctxproxy_summaries_total", result="created") == 0
    assert metric_total(text, "ctxproxy_summary_wait_seconds_count") == 0


async def test_a_summary_not_ready_in_time_is_not_waited_for_while_the_payload_fits(
        upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """A conversation whose background summary is still being made goes on being served, whole and within B,
    with status pending; only once nothing else fits under B does a request wait for it, and it says so."""
    w = WIRES["chat"]
    upstream.summary_gate = asyncio.Event()
    proxy = await start_proxy(config(upstream))
    statuses: list[str] = []
    for messages in requests_of(40):
        task = asyncio.create_task(send(proxy, w, w.body(messages, w.model(WINDOW), False)))
        done, _ = await asyncio.wait({task}, timeout=5)
        if not done:  # it waits for the blocked summariser: its payload no longer fits under B without it
            assert statuses and statuses[-1] == "pending", statuses
            upstream.summary_gate.set()
            headers = await task
            assert headers["x-ctxproxy-summary"] == "waited"
            assert int(headers["x-ctxproxy-tokens-out"]) <= HARD
            assert len(upstream.summaries) == 1  # it joined the summary under way: no second summariser call
            break
        headers = task.result()
        statuses.append(headers["x-ctxproxy-summary"])
        assert int(headers["x-ctxproxy-tokens-out"]) <= HARD
    else:
        pytest.fail(f"no request needed the summary: {statuses}")
    assert statuses.count("pending") >= 2, statuses
    text = await scrape(proxy)
    assert metric_total(text, "ctxproxy_summary_wait_seconds_count") == 1


@pytest.mark.parametrize("wire", sorted(WIRES))
async def test_a_failing_summariser_is_not_waited_for_and_the_trimmer_serves(
        upstream: FakeUpstream, start_proxy: StartProxy, wire: str) -> None:
    """The summariser fails (500) in the background: no request waits for it, the ones over B are trimmed
    within B as on any summariser failure (status failed), and the failures are counted."""
    w = WIRES[wire]
    upstream.summary_mode, upstream.summary_status = "status", 500
    proxy = await start_proxy(config(upstream))
    background = proxy.state.shared.background
    statuses: list[str] = []
    for n, messages in enumerate(requests_of(40)):
        headers = await answered(proxy, w, messages, stream=n % 2 == 0)
        statuses.append(headers["x-ctxproxy-summary"])
        assert int(headers["x-ctxproxy-tokens-out"]) <= HARD, n
        await background.idle()
    text = await scrape(proxy)
    assert "waited" not in statuses and statuses.count("failed") >= 10, statuses
    assert metric_total(text, "ctxproxy_background_summaries_total", result="failed") >= 1
    assert metric_total(text, "ctxproxy_summary_wait_seconds_count") == 0


async def test_with_the_ratio_at_zero_the_crossing_request_waits_as_before(
        upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """``summary_prefetch_ratio: 0`` turns it off: the request that needs a summary makes it and waits."""
    w = WIRES["chat"]
    proxy = await start_proxy(config(upstream, summary_prefetch_ratio=0))
    statuses = [(await answered(proxy, w, m, False))["x-ctxproxy-summary"] for m in requests_of(20)]
    assert "pending" not in statuses and "waited" in statuses, statuses
    assert metric_total(await scrape(proxy), "ctxproxy_background_summaries_total") == 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ok", "status"])
async def test_a_slow_summariser_and_a_user_who_thinks_never_stall_a_request(
        upstream: FakeUpstream, start_proxy: StartProxy, mode: str) -> None:
    """The figures of the issue: a summariser taking 1.5 s, 2 s between requests: no request takes longer than
    0.5 s, summaries are made and used (or, failing, fall back to the trimmer), every one within B."""
    w = WIRES["chat"]
    upstream.summary_delay, upstream.summary_mode = 1.5, mode
    proxy = await start_proxy(config(upstream))
    await answered(proxy, w, [user("warm up: load the tokenizer")], False)  # a fresh process's first request
    latencies: list[float] = []
    statuses: list[str] = []
    for n, messages in enumerate(requests_of(36)):
        if n:
            await asyncio.sleep(2.0)
        began = time.perf_counter()
        headers = await answered(proxy, w, messages, False)
        latencies.append(time.perf_counter() - began)
        statuses.append(headers["x-ctxproxy-summary"])
        assert int(headers["x-ctxproxy-tokens-out"]) <= HARD
    print(f"\n{mode}: slowest request {1000 * max(latencies):.0f} ms; statuses {statuses}")
    assert max(latencies) < 0.5, latencies
    assert "waited" not in statuses
    text = await scrape(proxy)
    if mode == "ok":
        assert metric_total(text, "ctxproxy_background_summaries_total", result="used") >= 2
    else:
        assert "failed" in statuses


# --------------------------------------------------------------------------- the runner itself


class Counted:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.made: list[str] = []

    def background_summary(self, tenant: str, result: str) -> None:
        self.events.append((tenant, result))

    def background_summary_made(self, tenant: str, model: str, made: Completion | None) -> None:
        self.made.append(model)

    def count(self, result: str) -> int:
        return sum(1 for _, r in self.events if r == result)


def summary(key: str) -> CachedSummary:
    return CachedSummary(covered_turns=1, chain=key, text="s")


async def test_bounded_a_full_queue_skips_and_never_blocks() -> None:
    """One at a time and one queued: a third conversation is skipped at once (counted), a conversation with a
    job under way is not queued twice, and the queued one runs when the first is done."""
    seen = Counted()
    runner = BackgroundSummaries(concurrency=1, queue=1, unused_after=60, observer=seen)
    release = asyncio.Event()

    def job(key: str) -> Callable[[], Awaitable[tuple[CachedSummary, bool] | None]]:
        async def make() -> tuple[CachedSummary, bool] | None:
            await release.wait()
            return summary(key), True
        return make

    assert runner.submit("k1", "c1", "t", "m", job("k1")) == "started"
    assert runner.submit("k1b", "c1", "t", "m", job("k1b")) == "busy"
    assert runner.submit("k2", "c2", "t", "m", job("k2")) == "started"  # queued
    began = time.perf_counter()
    assert runner.submit("k3", "c3", "t", "m", job("k3")) == "skipped"
    assert time.perf_counter() - began < 0.05
    release.set()
    await runner.idle()
    await runner.idle()
    assert (seen.count("started"), seen.count("skipped"), seen.count("made")) == (2, 1, 2)
    runner.used("k2")
    runner.used("k2")  # the first use only
    await runner.close(1.0)
    assert (seen.count("used"), seen.count("wasted")) == (1, 1)


async def test_a_background_summary_never_spends_the_cache_budget_of_the_request_that_started_it() -> None:
    """Sharing it, a request that had spent its budget left the job without a cache (its lock failing open: a
    second summary on another replica), and the job's slow cache operations were charged to the request."""
    guard = Guard("redis", timeout=1, threshold=2, cooldown=1)
    runner = BackgroundSummaries(concurrency=1, queue=0, unused_after=60, observer=Counted())
    allowed: list[float | None] = []

    async def probe() -> None:
        return None

    async def make() -> tuple[CachedSummary, bool] | None:
        allowed.append(guard.admit(probe))  # raises when the budget it runs on is spent
        guard.charge(5.0)  # the cache was slow while it worked
        return summary("k"), True

    with cache_budget(1.0) as budget:
        assert budget is not None
        budget.spent = 2.0
        assert runner.submit("k", "c", "t", "m", make) == "started"
        await runner.idle()
    assert allowed and allowed[0] is not None and allowed[0] > 1.0
    assert budget.spent == 2.0
    await runner.close(1.0)


async def test_wasted_is_a_summary_nobody_used_in_time() -> None:
    now = [0.0]
    seen = Counted()
    runner = BackgroundSummaries(concurrency=2, queue=0, unused_after=60, observer=seen, clock=lambda: now[0])

    async def make() -> tuple[CachedSummary, bool] | None:
        return summary("k"), True

    runner.submit("k", "c", "t", "m", make)
    await runner.idle()
    now[0] = 61.0
    runner.used("other")  # any later call sweeps
    assert seen.count("wasted") == 1
    runner.used("k")  # too late: already counted as wasted
    assert seen.count("used") == 0


async def test_a_summariser_backing_off_is_skipped_not_failed() -> None:
    seen = Counted()
    runner = BackgroundSummaries(concurrency=1, queue=0, unused_after=60, observer=seen)

    async def make() -> tuple[CachedSummary, bool] | None:
        raise SummaryUnavailable("backing off", reason="backoff")

    runner.submit("k", "c", "t", "m", make)
    await runner.idle()
    assert (seen.count("skipped"), seen.count("failed")) == (1, 0)


async def test_shutdown_abandons_what_does_not_finish_and_caches_nothing_half_made() -> None:
    """A summary still being made when the drain timeout ends is cancelled: nothing of it is in the cache, the
    queued ones are abandoned, and nothing more is accepted."""
    cache = MemoryCache()
    store = SummaryService(cache, ttl=None, lock_wait=5, backoff_first=0, backoff_max=0)
    seen = Counted()
    runner = BackgroundSummaries(concurrency=1, queue=4, unused_after=60, observer=seen)
    scope = SummaryScope("t", "settings")
    hang = asyncio.Event()

    async def summarize(previous: str | None, turns: Any) -> Completion:
        await hang.wait()
        return Completion("never", "m", 1, 1)

    def job(chain: list[str]) -> Callable[[], Awaitable[tuple[CachedSummary, bool] | None]]:
        async def make() -> tuple[CachedSummary, bool] | None:
            return await store.obtain(scope, chain, len(chain), [[] for _ in chain], None, summarize)
        return make

    runner.submit("a", "ca", "t", "m", job(["a1", "a2"]))
    runner.submit("b", "cb", "t", "m", job(["b1", "b2"]))
    await asyncio.sleep(0.01)
    began = time.perf_counter()
    await runner.close(0.2)
    assert time.perf_counter() - began < 1.0
    assert (seen.count("abandoned"), seen.count("made")) == (2, 0)
    assert await store.lookup(scope, ["a1", "a2"]) is None
    assert runner.submit("c", "cc", "t", "m", job(["c1"])) == "skipped"


async def test_turned_off_by_a_reload_drops_what_is_queued() -> None:
    """``background_summaries: 0`` on a reload: the queued jobs, which would never run, are abandoned and their
    conversations may ask again (the request then makes its own summary)."""
    seen = Counted()
    runner = BackgroundSummaries(concurrency=1, queue=2, unused_after=60, observer=seen)
    release = asyncio.Event()

    async def make() -> tuple[CachedSummary, bool] | None:
        await release.wait()
        return None

    runner.submit("k1", "c1", "t", "m", make)
    runner.submit("k2", "c2", "t", "m", make)
    runner.configure(concurrency=0, queue=2, unused_after=60)
    assert seen.count("abandoned") == 1 and not runner.busy("c2") and runner.busy("c1")
    assert runner.submit("k3", "c3", "t", "m", make) == "skipped"
    release.set()
    await runner.idle()
    assert not runner.busy("c1")
