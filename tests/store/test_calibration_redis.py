"""Calibration shared through one real redis-server: two replicas share the factor, a restart keeps it.

Two apps (two replicas) on one Redis; the fake upstream reports 1.3x the true o200k count. Replica A
learns the factor from its answers; replica B, which has served nothing, budgets with it on its first
request; B's answers for another tenant keep their own record and join A's samples in the pooled one; a new app on the
same Redis (a restart)
starts from it. The cost ledger is shared the same way: one report sums both replicas.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest

from proxy.store.calibration import POOLED, cache_key
from tests.conftest import RunningProxy, StartProxy
from tests.fake_upstream import FakeUpstream
from tests.redis_server import RedisServer, redis_server_fixture
from tests.store.test_calibration_server import MODEL, RESERVE, SCALE, WINDOW, config, policy, post
from tests.store.test_summaries_http import conversation

redis_server = redis_server_fixture(scope="module")
ADMIN = "sk-admin-report"


def shared_config(upstream: FakeUpstream, redis: RedisServer) -> dict[str, Any]:
    return config(upstream.base_url, cache={"backend": "redis", "url": redis.url},
                  tenants=[{"name": "acme", "keys": ["sk-client"]}, {"name": "globex", "keys": ["sk-globex"]}],
                  admin={"keys": [ADMIN]})


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait (polling the loop) until ``condition()`` holds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def samples(proxy: RunningProxy, tenant: str) -> int:
    """How many samples of ``tenant`` this replica has learned (its after-answer step may still be pending)."""
    entry = proxy.state.shared.calibration._entries.get((tenant, "fake", MODEL))
    return len(entry.samples) if entry is not None else 0


async def explain_budget(s: aiohttp.ClientSession, proxy: RunningProxy) -> dict[str, Any]:
    async with s.post(proxy.url + "/v1/ctxproxy/explain", json={"model": MODEL, "messages": conversation(5)},
                      headers={"Authorization": "Bearer sk-client"}) as r:
        assert r.status == 200
        report: dict[str, Any] = (await r.json())["report"]
        return report


async def test_two_replicas_share_the_factor_and_a_restart_keeps_it(
        upstream: FakeUpstream, start_proxy: StartProxy, redis_server: RedisServer) -> None:
    upstream.prompt_scale = SCALE
    cfg = shared_config(upstream, redis_server)
    a, b = await start_proxy(cfg), await start_proxy(cfg)
    calibrated = int((WINDOW - RESERVE - WINDOW // 10) / SCALE)
    async with aiohttp.ClientSession() as s:
        assert (await explain_budget(s, b))["hard_budget"] == WINDOW - RESERVE - WINDOW // 10  # nothing learned yet
        for n in range(3, 8):
            status, _, _ = await post(s, a, conversation(n))
            assert status == 200
        await until(lambda: samples(a, "acme") == 5)
        await a.state.shared.calibration.flush()  # A's background write to Redis
        # B read the shared record once (the explain above); once that read is older than REFRESH_SECONDS, a
        # request refreshes it in the background (and still uses what B had), and the next one uses A's factor
        store = b.state.shared.calibration
        store._entries[("acme", "fake", MODEL)].loaded = float("-inf")
        assert (await explain_budget(s, b))["calibration"] == 1.0
        await store.flush()
        report = await explain_budget(s, b)
        assert report["calibration"] == pytest.approx(SCALE, abs=0.02)
        assert report["calibration_detail"]["source"] == "learned"
        assert report["hard_budget"] == pytest.approx(calibrated, abs=60)
        # globex's answers through B: its own record, and the pooled one that holds every tenant's samples
        for n in range(8, 11):
            async with s.post(b.url + "/v1/chat/completions", json={"model": MODEL, "messages": conversation(n)},
                              headers={"Authorization": "Bearer sk-globex"}) as r:
                assert r.status == 200
        # the answer's usage is learned once the handler has finished, which may be after the client read it
        await until(lambda: samples(b, "globex") == 3)
        await b.state.shared.calibration.flush()
    record = await a.state.shared.cache.get(cache_key(POOLED, "fake", MODEL))
    assert record is not None
    assert len(record["samples"]) == 8
    own = await a.state.shared.cache.get(cache_key("globex", "fake", MODEL))
    assert own is not None and own["tenant"] == "globex" and len(own["samples"]) == 3
    assert {origin for _, _, origin in record["samples"]} == {a.state.shared.calibration.origin,
                                                              b.state.shared.calibration.origin}
    await a.runner.cleanup()  # a replica goes away: its last buckets and samples are flushed on the way out
    await b.runner.cleanup()
    c = await start_proxy(cfg)  # the restart
    async with aiohttp.ClientSession() as s:
        shown = await policy(s, c)  # acme's factor: its own five samples
        assert shown["source"] == "learned" and shown["samples"] == 5 and shown["tenant"] == "acme"
        assert shown["factor"] == pytest.approx(SCALE, abs=0.02)
        assert (await explain_budget(s, c))["hard_budget"] == pytest.approx(calibrated, abs=60)
        # the cost ledger outlived both replicas: one report sums them
        async with s.get(c.url + "/admin/report?since=1h", headers={"Authorization": f"Bearer {ADMIN}"}) as r:
            assert r.status == 200
            report = await r.json()
    rows = {(row["tenant"], row["model"]): row for row in report["rows"]}
    assert rows[("acme", MODEL)]["requests"] == 5
    assert rows[("globex", MODEL)]["requests"] == 3
    assert report["total"]["requests"] == 8
