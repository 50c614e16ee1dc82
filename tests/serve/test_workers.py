"""Several workers behind one port: a reload reaches every one of them, and a per-process report says so."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.fake_upstream import FakeUpstream
from tests.serve.test_supervisor import chat_statuses, fleet, workers_config, write

ADMIN = "adm-workers-8c1d"
OLD, NEW = "sk-tenant-old-40f2", "sk-tenant-new-93ab"

pytestmark = pytest.mark.timeout(180)


def tenant_config(upstream: FakeUpstream, key: str, **extra: Any) -> dict[str, Any]:
    return workers_config(upstream, admin={"keys": [ADMIN]}, tenants=[{"name": "team", "keys": [key]}], **extra)


async def admin(url: str, method: str, path: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.request(method, url + path,
                                                       headers={"Authorization": f"Bearer {ADMIN}"}) as r:
        return r.status, await r.json(content_type=None) if "json" in r.content_type else await r.text()


async def test_admin_reload_rotates_a_key_on_every_worker(upstream: FakeUpstream, tmp_path: Path) -> None:
    """Only the worker that received POST /admin/reload used to reload: the revoked key kept working on
    the others (22 x 200) and the new one was refused there (19 x 401), under {"reloaded": true}."""
    path = write(tmp_path / "c.yaml", tenant_config(upstream, OLD))
    async with fleet(path, 3) as served:
        await served.ready(3)
        pids = sorted(served.listening())
        assert await chat_statuses(served.url, 6, OLD) == [200] * 6
        write(path, tenant_config(upstream, NEW))
        status, body = await admin(served.url, "POST", "/admin/reload")
        assert status == 200, body
        assert body == {"reloaded": True, "restart_required": [],
                        "workers": [{"pid": pid, "state": "reloaded", "restart_required": []} for pid in pids]}
        # every request on its own connection: SO_REUSEPORT spreads them over the three workers
        assert await chat_statuses(served.url, 30, OLD) == [401] * 30
        assert await chat_statuses(served.url, 30, NEW) == [200] * 30
        assert sum("config reloaded from" in line for line in served.lines) == 3
        assert await served.stop() == 0
    log = "\n".join(served.lines)
    assert OLD not in log and NEW not in log and ADMIN not in log


async def test_an_invalid_config_reaches_no_worker(upstream: FakeUpstream, tmp_path: Path) -> None:
    path = write(tmp_path / "c.yaml", tenant_config(upstream, OLD))
    async with fleet(path, 2) as served:
        await served.ready(2)
        write(path, {**tenant_config(upstream, NEW), "cache": {"backend": "redis", "url": "http://cache"}})
        mark = len(served.lines)
        status, body = await admin(served.url, "POST", "/admin/reload")
        assert status == 400 and body["reloaded"] is False
        assert body["problems"][0].startswith("cache.url: "), body
        await asyncio.sleep(0.3)
        assert not any("SIGHUP" in line or "reload" in line for line in served.lines[mark:]), served.lines[mark:]
        assert await chat_statuses(served.url, 10, OLD) == [200] * 10


async def test_a_reload_names_what_every_worker_keeps_until_a_restart(upstream: FakeUpstream,
                                                                    tmp_path: Path) -> None:
    path = write(tmp_path / "c.yaml", tenant_config(upstream, OLD))
    async with fleet(path, 2) as served:
        await served.ready(2)
        write(path, tenant_config(upstream, NEW, cache={"backend": "disk", "path": str(tmp_path / "cache")}))
        status, body = await admin(served.url, "POST", "/admin/reload")
        assert status == 200 and body["reloaded"] is True
        assert body["restart_required"] == ["cache.backend", "cache.path"]
        assert [w["restart_required"] for w in body["workers"]] == [["cache.backend", "cache.path"]] * 2
        assert await chat_statuses(served.url, 10, NEW) == [200] * 10


async def test_sighup_to_the_supervisor_reloads_every_worker(upstream: FakeUpstream, tmp_path: Path) -> None:
    path = write(tmp_path / "c.yaml", tenant_config(upstream, OLD))
    async with fleet(path, 2) as served:
        await served.ready(2)
        write(path, tenant_config(upstream, NEW))
        mark = len(served.lines)
        served.proc.send_signal(signal.SIGHUP)
        for _ in range(2):
            await served.wait_for("config reloaded from", after=mark)
            mark = next(i for i in range(mark, len(served.lines)) if "config reloaded" in served.lines[i]) + 1
        assert await chat_statuses(served.url, 20, OLD) == [401] * 20
        assert await chat_statuses(served.url, 20, NEW) == [200] * 20


async def test_a_report_from_a_worker_with_a_memory_cache_says_it_covers_that_worker(
        upstream: FakeUpstream, tmp_path: Path) -> None:
    """With cache.backend memory each worker keeps its own ledger: /admin/report showed 46 or 54 of 100."""
    path = write(tmp_path / "c.yaml", tenant_config(upstream, OLD))
    async with fleet(path, 2) as served:
        await served.ready(2)
        assert await chat_statuses(served.url, 10, OLD) == [200] * 10
        status, report = await admin(served.url, "GET", "/admin/report")
        assert status == 200
        assert report["scope"]["workers"] == 2 and report["scope"]["worker_pid"] in served.listening()
        assert "only worker" in report["warning"] and "disk or redis" in report["warning"]
        assert report["total"]["requests"] <= 10
        status, text = await admin(served.url, "GET", "/admin/report?format=text")
        assert status == 200 and "warning: cache.backend is memory and 2 workers" in text
    assert any("cache.backend is memory: each of the 2 workers" in line for line in served.lines)


async def test_a_report_from_a_shared_cache_has_no_such_warning(upstream: FakeUpstream, tmp_path: Path) -> None:
    path = write(tmp_path / "c.yaml", tenant_config(upstream, OLD, cache={"backend": "disk",
                                                                          "path": str(tmp_path / "cache")}))
    async with fleet(path, 2) as served:
        await served.ready(2)
        assert await chat_statuses(served.url, 10, OLD) == [200] * 10
        for _ in range(300):  # the other worker writes its ledger every 10 s
            status, report = await admin(served.url, "GET", "/admin/report")
            assert status == 200 and "warning" not in report and "scope" not in report
            if report["total"]["requests"] == 10:
                break
            await asyncio.sleep(0.1)
        assert report["total"]["requests"] == 10
