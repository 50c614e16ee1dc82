"""Summaries shared through a real redis-server: two proxy processes, Redis down and back."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from tests.conftest import ROOT
from tests.redis_server import RedisServer
from tests.test_summarisation import config, conversation, post


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
