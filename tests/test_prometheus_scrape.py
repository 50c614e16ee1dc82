"""A real Prometheus scrapes the proxy, and the summariser's cost is read back through its HTTP API."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from tests.fake_upstream import FakeUpstream
from tests.test_observability import ADMIN_KEY, MODEL, TENANT_KEY, call, priced_config, scrape, value
from tests.test_summarisation import conversation

PROMETHEUS = Path("/usr/bin/prometheus")
WAIT = 20.0  # seconds, for each of: Prometheus ready, target up, the value scraped


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


StartPrometheus = Callable[[str], Awaitable[str]]


@pytest.fixture
async def prometheus(tmp_path: Path) -> AsyncIterator[StartPrometheus]:
    """``start(target)`` runs Prometheus scraping ``host:port`` every second; returns its base URL."""
    if not PROMETHEUS.exists():
        pytest.skip("prometheus not installed: apt-get install prometheus")
    procs: list[asyncio.subprocess.Process] = []
    log_file = tmp_path / "prometheus.log"

    async def start(target: str) -> str:
        job: dict[str, Any] = {"job_name": "ctxproxy", "metrics_path": "/metrics",
                               "static_configs": [{"targets": [target]}]}
        # with tenants configured /metrics needs an admin key: Prometheus sends it from a file, as shipped
        key_file = tmp_path / "ctxproxy-admin-key"
        key_file.write_text(ADMIN_KEY + "\n")
        job["authorization"] = {"type": "Bearer", "credentials_file": str(key_file)}
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [job],
        }
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        with log_file.open("ab") as log:
            proc = await asyncio.create_subprocess_exec(
                str(PROMETHEUS),
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
                stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log,
            )
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + WAIT
        async with aiohttp.ClientSession() as s:
            while True:
                assert proc.returncode is None, f"prometheus exited: {log_file.read_text()[-2000:]}"
                try:
                    async with s.get(url + "/-/ready") as r:
                        if r.status == 200:
                            return url
                except aiohttp.ClientError:
                    pass
                assert time.monotonic() < deadline, f"prometheus not ready: {log_file.read_text()[-2000:]}"
                await asyncio.sleep(0.2)

    yield start
    for proc in procs:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()


async def query(session: aiohttp.ClientSession, url: str, promql: str) -> list[dict[str, Any]]:
    async with session.get(url + "/api/v1/query", params={"query": promql}) as r:
        payload = await r.json()
    assert r.status == 200 and payload["status"] == "success", payload
    result = payload["data"]["result"]
    assert isinstance(result, list)
    return result


async def wait_for_value(session: aiohttp.ClientSession, url: str, promql: str,
                         ok: Callable[[float], bool]) -> float:
    """Poll an instant query until its single value satisfies ``ok`` (bounded by WAIT)."""
    deadline = time.monotonic() + WAIT
    seen: Any = None
    while time.monotonic() < deadline:
        result = await query(session, url, promql)
        seen = result
        if len(result) == 1 and ok(float(result[0]["value"][1])):
            return float(result[0]["value"][1])
        await asyncio.sleep(0.25)
    raise AssertionError(f"{promql}: no acceptable value within {WAIT}s (last result {json.dumps(seen)})")


async def test_prometheus_scrapes_summarizer_cost(
    upstream: FakeUpstream, start_proxy: Any, prometheus: StartPrometheus,
) -> None:
    tenants = [{"name": "acme", "keys": [TENANT_KEY]}]
    proxy = await start_proxy(priced_config(upstream.base_url, tenants=tenants))
    target = proxy.url.removeprefix("http://")
    assert target.startswith("127.0.0.1:") and not target.endswith(":0")
    prom = await prometheus(target)

    async with aiohttp.ClientSession() as s:
        # the target is scraped and healthy before any traffic; no summariser cost exists yet
        assert await wait_for_value(s, prom, 'up{job="ctxproxy"}', lambda v: v == 1) == 1
        assert await query(s, prom, "sum(ctxproxy_summarizer_cost_usd_total)") == []

        results = []
        for _ in range(2):
            status, headers, _ = await call(s, proxy.url, {"model": MODEL, "messages": conversation(40)})
            assert status == 200
            results.append(headers["x-ctxproxy-summary"])
        assert results == ["waited", "reused"]
        _, direct = await scrape(s, proxy.url)
        expected = value(direct, "ctxproxy_summarizer_cost_usd_total", tenant="acme", model=MODEL)
        assert expected > 0

        cost = await wait_for_value(s, prom, "sum(ctxproxy_summarizer_cost_usd_total)", lambda v: v > 0)
        assert cost == pytest.approx(expected)
        savings = await wait_for_value(
            s, prom, 'sum(ctxproxy_estimated_savings_usd_total{tenant="acme"})', lambda v: v > 0)
        assert savings == pytest.approx(value(direct, "ctxproxy_estimated_savings_usd_total",
                                              tenant="acme", model=MODEL, mode="enforce"))
        created = await query(s, prom, 'ctxproxy_summaries_total{result="created"}')
        assert [(r["metric"]["tenant"], r["value"][1]) for r in created] == [("acme", "1")]
        async with s.get(prom + "/api/v1/label/model/values") as r:
            models = (await r.json())["data"]
        assert set(models) == {MODEL}
