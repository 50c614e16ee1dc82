"""Summariser calls made once across requests and replicas (``SummaryService.call_once``), from the outside.

A summary whose aged turns exceed the summariser's window is folded in chunks; two summaries of overlapping turns
(a longer and a shorter one of one conversation, two forks of one history, on one replica or two) share each
chunk's call. Found by an outside review of that change: one upstream call billed twice in one process, a request
made to wait through a failing shorter summary and then its own, a slow Redis costing several budgets, a damaged
cached answer failing every summary until its TTL, and a cache error that ended a lock wait left uncounted.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from typing import Any

import aiohttp
import pytest
import redis as sync_redis

from proxy.store.cache import SafeCache
from proxy.store.guard import Guard
from proxy.store.redis import RedisCache
from tests.conftest import StartProxy
from tests.fake_upstream import FakeUpstream
from tests.outside import chat_body, metric_total, scrape
from tests.outside import post as send
from tests.redis_server import RedisServer, redis_server_fixture
from tests.store.test_summaries_http import config, conversation, post

redis_server = redis_server_fixture(scope="module")


# --------------------------------------------------------------------------- billed once

@pytest.mark.usefixtures("shared_model_map")
async def test_one_process_longer_then_shorter_summary_bills_each_upstream_call_once(
        upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    cfg = config(upstream.base_url, summarizer_model="small-model")  # an 8k summariser window: chunks
    cfg["models"][0].update(input_cost_per_token=1e-6, output_cost_per_token=2e-6)
    proxy = await start_proxy(cfg)
    await send(proxy, chat_body([{"role": "user", "content": "hi"}]))
    upstream.summary_delay = 0.5
    longer = asyncio.ensure_future(send(proxy, chat_body(conversation(46))))
    while not upstream.summaries:  # the longer summary is folding its first chunk
        await asyncio.sleep(0.01)
    shorter = await send(proxy, chat_body(conversation(40)))  # folds the same first chunk, in the same process
    results = [await longer, shorter]
    assert [s for s, _, _ in results] == [200, 200]
    text = await scrape(proxy)
    paid = sum(u["prompt_tokens"] for u in upstream.summary_usages)
    billed = metric_total(text, "ctxproxy_summarizer_tokens_total", kind="prompt")
    print("calls", len(upstream.summaries), "paid", paid, "billed", billed,
          [h.get("x-ctxproxy-summary") for _, h, _ in results])
    paid_usd = sum(u["prompt_tokens"] * 1e-6 + u["completion_tokens"] * 2e-6 for u in upstream.summary_usages)
    billed_usd = metric_total(text, "ctxproxy_summarizer_cost_usd_total")
    print("paid usd", paid_usd, "billed usd", billed_usd)
    assert abs(billed_usd - paid_usd) < 1e-9, (paid_usd, billed_usd)
    assert billed == paid, f"upstream charged {paid} prompt tokens, ctxproxy counted {billed}"


@pytest.mark.usefixtures("shared_model_map")
async def test_two_forks_of_one_history_at_once_bill_each_upstream_call_once(
        upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """Two sub-agents forked from one long history (same first turns, then their own), sent at once."""
    cfg = config(upstream.base_url, summarizer_model="small-model")
    proxy = await start_proxy(cfg)
    await send(proxy, chat_body([{"role": "user", "content": "hi"}]))
    upstream.summary_delay = 0.3
    forks = []
    for name in ("alpha", "beta"):
        messages = conversation(46)
        for m in messages[-70:]:
            if isinstance(m.get("content"), str):
                m["content"] += f" [{name}]"
        forks.append(messages)
    results = await asyncio.gather(*(send(proxy, chat_body(f)) for f in forks))
    assert [s for s, _, _ in results] == [200, 200]
    text = await scrape(proxy)
    paid = sum(u["prompt_tokens"] for u in upstream.summary_usages)
    billed = metric_total(text, "ctxproxy_summarizer_tokens_total", kind="prompt")
    print("forks: calls", len(upstream.summaries), "paid", paid, "billed", billed)
    assert billed == paid, f"upstream charged {paid} prompt tokens, ctxproxy counted {billed}"


# --------------------------------------------------------------------------- a failing summary is not waited for twice


@pytest.mark.usefixtures("shared_model_map")
async def test_a_request_waiting_behind_a_failing_shorter_summary_is_not_made_to_wait_twice(
        upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(config(upstream.base_url))  # summariser timeout_seconds: 2
    await send(proxy, chat_body([{"role": "user", "content": "hi"}]))
    upstream.summary_mode = "hang"
    shorter = asyncio.ensure_future(send(proxy, chat_body(conversation(40))))
    while not upstream.summaries:
        await asyncio.sleep(0.01)
    begun = time.perf_counter()
    status, headers, _ = await send(proxy, chat_body(conversation(80)))
    took = time.perf_counter() - begun
    first = await shorter
    print(f"longer took {took:.2f}s; statuses {first[1]['x-ctxproxy-summary']} {headers['x-ctxproxy-summary']}; "
          f"{len(upstream.summaries)} summariser calls")
    assert status == 200 and headers["x-ctxproxy-summary"] == "failed"
    # the summariser times out after 2 s: the request should not wait for one timeout and then another
    assert took < 3.0, f"waited {took:.2f}s"


# --------------------------------------------------------------------------- a slow cache


DELAY = 0.3  # every Redis reply arrives this late: slower than the 50 ms free, faster than the 1 s timeout


class SlowTcp:
    """127.0.0.1 TCP proxy to Redis whose replies are each held ``delay`` seconds (set ``delay`` at any time)."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.delay = 0.0
        self.server: asyncio.AbstractServer | None = None
        self.port = 0

    async def start(self) -> SlowTcp:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, slow: bool) -> None:
            try:
                while data := await src.read(65536):
                    if slow and self.delay:
                        await asyncio.sleep(self.delay)
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pump(reader, up_w, False), pump(up_r, writer, True))

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()


@pytest.mark.slow  # a timing bound: `make check`, not the suite
@pytest.mark.usefixtures("shared_model_map")
async def test_a_slow_redis_costs_a_summarised_request_at_most_about_its_budget(
        upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    with RedisServer.started() as redis:
        slow = await SlowTcp(int(redis.url.rsplit(":", 1)[1].split("/")[0])).start()
        url = f"redis://127.0.0.1:{slow.port}/0"
        cfg: dict[str, Any] = config(upstream.base_url, summarizer_model="small-model",
                                     cache={"backend": "redis", "url": url})
        proxy = await start_proxy(cfg)
        await send(proxy, chat_body([{"role": "user", "content": "hi"}]))
        begun = time.perf_counter()
        other = conversation(46)
        other[1]["content"] += " (another trip)"
        status, headers, _ = await send(proxy, chat_body(other))  # the same work, a healthy Redis
        assert headers["x-ctxproxy-summary"] == "waited"
        healthy = time.perf_counter() - begun
        slow.delay = DELAY
        begun = time.perf_counter()
        status, headers, _ = await send(proxy, chat_body(conversation(46)))
        took = time.perf_counter() - begun
        slow.delay = 0
        calls = len(upstream.summaries)
        await slow.stop()
    print(f"healthy {healthy:.2f}s, slow redis {took:.2f}s, {headers['x-ctxproxy-summary']}, {calls} summariser calls")
    assert status == 200
    # the request's own budget (1 s) and that of the summary it makes (1 s), not one per cache operation
    assert took < healthy + 2 * 1.0 + 0.5, f"{took:.2f}s with a 1 s cache budget"


# --------------------------------------------------------------------------- damaged records, errors


VARIANTS = {
    "not-json": b"\xff\x00garbage",
    "json-list": b"[1, 2, 3]",
    "text-int": b'{"text": 5, "model": "m"}',
    "text-empty": b'{"text": "", "model": "m"}',
    "text-blank": b'{"text": "   ", "model": "m"}',
    "no-model": b'{"text": "a chunk summary"}',
    "tokens-str": b'{"text": "a chunk summary", "model": "m", "prompt_tokens": "x", "completion_tokens": null}',
    "huge-int": b'{"text": "a chunk summary", "model": "m", "prompt_tokens": 100000000000000000000000}',
}


@pytest.mark.usefixtures("shared_model_map")
@pytest.mark.parametrize("variant", [*VARIANTS, "hash-type"])
async def test_a_corrupt_call_record_is_not_a_500_nor_a_traceback_and_heals(
        variant: str, upstream: FakeUpstream, start_proxy: StartProxy, caplog: pytest.LogCaptureFixture) -> None:
    with RedisServer.started() as server:
        cfg = config(upstream.base_url, summarizer_model="small-model", cache={"backend": "redis", "url": server.url})
        a = await start_proxy(cfg)
        status, headers, _ = await send(a, chat_body(conversation(40)))
        assert (status, headers["x-ctxproxy-summary"]) == (200, "waited")
        r = sync_redis.Redis.from_url(server.url)
        calls = r.keys("ctxproxy:call:*")
        assert calls
        for key in calls:
            if variant == "hash-type":
                r.delete(key)
                r.hset(key, "text", "x")
            else:
                r.set(key, VARIANTS[variant])
        for key in r.keys("ctxproxy:sum:*"):
            r.delete(key)
        made = len(upstream.summaries)
        caplog.clear()
        b = await start_proxy(cfg)  # a replica with nothing in its own memory
        results = [await send(b, chat_body(conversation(40))) for _ in range(2)]
        errors = [rec for rec in caplog.records if rec.levelno >= logging.ERROR or rec.exc_info]
        print(variant, [(s, h.get("x-ctxproxy-summary")) for s, h, _ in results], len(upstream.summaries) - made,
              [rec.getMessage()[:120] for rec in caplog.records if rec.levelno >= logging.WARNING])
        assert [s for s, _, _ in results] == [200, 200]
        assert not errors, [e.getMessage() for e in errors]
        # the corrupt record is a miss: the summary is made again (and then reused), not failed for good
        assert [h["x-ctxproxy-summary"] for _, h, _ in results] == ["waited", "reused"]




async def test_a_lock_wait_ended_by_a_cache_error_counts_the_error(redis_server: RedisServer,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    errors: list[tuple[str, str]] = []
    guard = Guard("redis", timeout=0.2, threshold=2, cooldown=60)
    holder = SafeCache(RedisCache(redis_server.url, None, prefix="lockerr:", socket_timeout=0.2))
    waiter = SafeCache(RedisCache(redis_server.url, None, prefix="lockerr:", socket_timeout=0.2, guard=guard),
                       on_error=lambda op, exc: errors.append((op, type(exc).__name__)))
    try:
        async with holder.lock("k", ttl=30, wait=0) as held:
            assert held.acquired
            waiting = asyncio.create_task(waiter.lock("k", ttl=30, wait=10).__aenter__())
            await asyncio.sleep(0.1)  # the waiter has seen the lock held
            with redis_server.paused():
                handle = await asyncio.wait_for(waiting, 5)
        print("handle", handle.acquired, handle.failed_open, "errors", errors,
              [r.getMessage()[:90] for r in caplog.records])
        assert not handle.acquired
        assert errors, "the lock attempt that failed was never reported (ctxproxy_cache_errors_total)"
        assert not any("recovered" in r.getMessage() for r in caplog.records)
    finally:
        await holder.close()
        await waiter.close()


@pytest.mark.parametrize("chunked", [False, True])
async def test_client_gone_then_summary_fails_logs_nothing_unretrieved(upstream, start_proxy, caplog, chunked):
    extra = {"summarizer_model": "small-model"} if chunked else {}
    proxy = await start_proxy(config(upstream.base_url, **extra))
    gate = asyncio.Event()
    upstream.summary_gate = gate
    upstream.summary_mode = "status"
    async with aiohttp.ClientSession() as s:
        req = asyncio.ensure_future(post(s, proxy.url, conversation(46)))
        while not upstream.summaries:
            await asyncio.sleep(0.01)
        req.cancel()  # the client goes away
        with pytest.raises(asyncio.CancelledError):
            await req
    await asyncio.sleep(0.2)
    gate.set()
    await asyncio.sleep(0.5)
    gc.collect()
    await asyncio.sleep(0.1)
    bad = [r.getMessage() for r in caplog.records if "never retrieved" in r.getMessage()]
    assert not bad, bad
