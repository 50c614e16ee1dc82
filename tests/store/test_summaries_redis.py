"""Summaries shared through a real redis-server: two proxy processes, Redis down and back."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from tests.conftest import ROOT, StartProxy
from tests.fake_upstream import FakeUpstream
from tests.outside import chat_body, metric_total, scrape
from tests.outside import post as send
from tests.redis_server import RedisServer
from tests.store.test_summaries_http import config, conversation, post


def _start_process(cfg: dict[str, Any], tmp_path: Path, name: str) -> tuple[subprocess.Popen[str], str]:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "serve", "--config", str(path), "--port", "0"],
        cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
        env=dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True"),
    )
    assert proc.stderr is not None
    for _ in range(200):
        line = proc.stderr.readline()
        match = re.search(r"listening on (http://\S+)", line)
        if match:
            return proc, match.group(1)
    proc.kill()
    raise AssertionError("proxy process did not start")


async def test_two_proxy_processes_on_one_redis_share_one_summary(upstream, tmp_path):
    with RedisServer.started() as redis:
        cfg = config(upstream.base_url, cache={"backend": "redis", "url": redis.url})
        procs = [_start_process(cfg, tmp_path, f"p{i}") for i in range(2)]
        try:
            async with aiohttp.ClientSession() as s:
                results = await asyncio.gather(*(post(s, url, conversation(40)) for _, url in procs * 3))
            assert [r[0] for r in results] == [200] * 6
            assert len(upstream.summaries) == 1
            # each needed the summary to fit: those that came while it was being made waited for that one call
            statuses = [r[1]["x-ctxproxy-summary"] for r in results]
            assert set(statuses) <= {"waited", "reused"} and "waited" in statuses, statuses
        finally:
            for proc, _ in procs:
                proc.terminate()
                proc.wait(timeout=15)


async def test_redis_down_then_back(upstream, start_proxy):
    with RedisServer.started() as redis:
        # every request over T goes to the summary cache: no masking first (it would keep some requests from it)
        proxy = await start_proxy(config(upstream.base_url, cache={"backend": "redis", "url": redis.url},
                                         context_manager={"type": "summarising",
                                                          "params": {"keep_turns": 4, "mask_observations": False}}))
        async with aiohttp.ClientSession() as s:
            status, headers, _ = await post(s, proxy.url, conversation(30))
            assert (status, headers["x-ctxproxy-summary"]) == (200, "waited")
            redis.stop()
            for n in (31, 32):
                status, headers, _ = await post(s, proxy.url, conversation(n))
                assert status == 200  # served without the cache
            async with s.get(proxy.url + "/readyz") as r:
                assert r.status == 503
            async with s.get(proxy.url + "/metrics") as r:
                text = await r.text()
            assert re.search(r'ctxproxy_cache_errors_total\{operation="get"\} [1-9]', text)
            redis.start()
            calls = len(upstream.summaries)
            other = conversation(40)  # a conversation this process has not summarised (none in its memory)
            other[1]["content"] += " (the other trip)"
            status, headers, _ = await post(s, proxy.url, other)
            assert (status, headers["x-ctxproxy-summary"]) == (200, "waited")
            status, headers, _ = await post(s, proxy.url, other)
            assert (status, headers["x-ctxproxy-summary"]) == (200, "reused")
            # it went to Redis: a replica with nothing in its own memory reuses it
            replica = await start_proxy(config(upstream.base_url, cache={"backend": "redis", "url": redis.url}))
            status, headers, _ = await post(s, replica.url, other)
            assert (status, headers["x-ctxproxy-summary"]) == (200, "reused")
            assert len(upstream.summaries) == calls + 1
            async with s.get(proxy.url + "/readyz") as r:
                assert r.status == 200


@pytest.mark.usefixtures("shared_model_map")
async def test_single_flight_across_replicas_outlasts_the_lock_wait(upstream: FakeUpstream, start_proxy: StartProxy
                                                                    ) -> None:
    """Two replicas on one Redis, a 1 s summary, lock_wait 0.2 s: one summariser call, one 'created'."""
    with RedisServer.started() as redis:
        cfg = config(upstream.base_url, cache={"backend": "redis", "url": redis.url})
        cfg["summarizer"]["lock_wait_seconds"] = 0.2
        replicas = [await start_proxy(cfg), await start_proxy(cfg)]
        # warm both replicas up (tokenizer, model map): the second must reach the lock while the first summarises
        await asyncio.gather(*(send(r, chat_body([{"role": "user", "content": "hi"}])) for r in replicas))
        upstream.summary_delay = 1.0  # longer than lock_wait_seconds
        first = asyncio.ensure_future(send(replicas[0], chat_body(conversation(40))))
        while not upstream.summaries:  # replica 0 holds the lock and is summarising
            await asyncio.sleep(0.01)
        second = await send(replicas[1], chat_body(conversation(40)))
        results = [await first, second]
        made = [metric_total(await scrape(r), "ctxproxy_summaries_total", result="created") for r in replicas]
        reused = [metric_total(await scrape(r), "ctxproxy_summaries_total", result="reused") for r in replicas]
    assert [s for s, _, _ in results] == [200, 200]
    assert len(upstream.summaries) == 1
    assert [h["x-ctxproxy-summary"] for _, h, _ in results] == ["waited", "waited"]  # both needed it to fit
    assert (made, reused) == ([1, 0], [0, 1])


@pytest.mark.usefixtures("shared_model_map")
async def test_two_replicas_summarising_overlapping_turns_fold_each_chunk_once(
        upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """`make check` found replicas making one summariser call two and three times: a summary folded in chunks
    (its aged turns exceed the summariser's window) and a longer one of the same conversation, made at once on
    two replicas, began with the same chunk. Each distinct summariser request is now made once."""
    with RedisServer.started() as redis:
        cfg = config(upstream.base_url, summarizer_model="small-model",  # an 8k summariser window: chunks
                     cache={"backend": "redis", "url": redis.url})
        replicas = [await start_proxy(cfg), await start_proxy(cfg)]
        await asyncio.gather(*(send(r, chat_body([{"role": "user", "content": "hi"}])) for r in replicas))
        upstream.summary_delay = 0.5
        first = asyncio.ensure_future(send(replicas[0], chat_body(conversation(40))))
        while not upstream.summaries:  # replica 0 is folding its first chunk
            await asyncio.sleep(0.01)
        second = await send(replicas[1], chat_body(conversation(46)))  # more turns aged: a longer summary
        results = [await first, second]
    assert [s for s, _, _ in results] == [200, 200]
    bodies = Counter(json.dumps(c.body["messages"], sort_keys=True) for c in upstream.summaries)
    assert len(upstream.summaries) >= 3 and max(bodies.values()) == 1, sorted(bodies.values())
