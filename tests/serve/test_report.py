"""The cost report (proxy.serve.report) tells "no traffic" from "cannot read the ledger".

Both ways of asking: ``GET /admin/report`` on a live proxy and ``ctxproxy report`` as a process. A report
that cannot read its ledger used to print an all-zero table and exit 0 (200 on the endpoint); a mistyped
disk path did the same and created the folder. Now it fails, naming why: exit 1, 503 in the wire's shape.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
import yaml

from tests.conftest import ROOT, StartProxy
from tests.fake_upstream import FakeUpstream
from tests.outside import metric_total, scrape
from tests.redis_server import RedisServer
from tests.store.test_summaries_http import config, conversation, post

ADMIN = "sk-admin"
PASSWORD = "s3cret-redis-pw"


def report_cli(tmp_path: Path, cache: dict[str, Any], *args: str) -> subprocess.CompletedProcess[str]:
    """``ctxproxy report`` as its own process, on a config with this cache section."""
    path = tmp_path / "report.yaml"
    path.write_text(yaml.safe_dump(config("http://127.0.0.1:9/v1", cache=cache)))
    return subprocess.run([sys.executable, "-m", "proxy.cli", "report", "--config", str(path), "--since", "2h", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A TCP port that accepts connections and never answers (a stalled Redis, as the network sees it)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    try:
        yield int(listener.getsockname()[1])
    finally:
        listener.close()


async def get_report(proxy_url: str, query: str = "") -> tuple[int, str, bytes]:
    async with aiohttp.ClientSession() as s, s.get(proxy_url + "/admin/report?since=1h" + query,
                                                   headers={"Authorization": f"Bearer {ADMIN}"}) as r:
        return r.status, r.content_type, await r.read()


def unreadable(raw: bytes) -> str:
    """The 503's message, after checking its shape (OpenAI's error, no traceback)."""
    assert b"Traceback" not in raw and b'File "' not in raw
    body = json.loads(raw)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == "ledger_unavailable"
    message: str = body["error"]["message"]
    return message


# ---------------------------------------------------------------------------- the CLI


def test_cli_report_fails_when_redis_refuses(tmp_path: Path) -> None:
    port = free_port()
    done = report_cli(tmp_path, {"backend": "redis", "url": f"redis://:{PASSWORD}@127.0.0.1:{port}/0"})
    assert done.returncode == 1, done
    assert done.stdout == ""
    assert "cannot read the cost ledger" in done.stderr and f"redis://127.0.0.1:{port}/0" in done.stderr
    assert "ConnectionError" in done.stderr
    assert PASSWORD not in done.stderr


def test_cli_report_fails_when_redis_stalls(tmp_path: Path, silent_server: int) -> None:
    done = report_cli(tmp_path, {"backend": "redis", "url": f"redis://127.0.0.1:{silent_server}/0",
                                 "timeout_seconds": 0.5})
    assert done.returncode == 1, done
    assert "cannot read the cost ledger" in done.stderr and "Timeout" in done.stderr


def test_cli_report_on_a_mistyped_path_fails_and_creates_nothing(tmp_path: Path) -> None:
    typo = tmp_path / "cahce" / "ctxproxy"
    done = report_cli(tmp_path, {"backend": "disk", "path": str(typo)}, "--json")
    assert done.returncode == 1, done
    assert done.stdout == "" and f"{typo} does not exist" in done.stderr
    assert not (tmp_path / "cahce").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    done = report_cli(tmp_path, {"backend": "disk", "path": str(empty)})
    assert done.returncode == 1 and "no cost ledger at" in done.stderr, done
    assert list(empty.iterdir()) == []


async def test_no_traffic_is_an_empty_report_not_an_error(upstream: FakeUpstream, start_proxy: StartProxy,
                                                          tmp_path: Path) -> None:
    """A server that has answered nothing yet: 200 and exit 0, all zeros (the ledger exists, empty)."""
    cache = {"backend": "disk", "path": str(tmp_path / "cache")}
    proxy = await start_proxy(config(upstream.base_url, admin={"keys": [ADMIN]}, cache=cache))
    status, _, raw = await get_report(proxy.url)
    assert status == 200 and json.loads(raw)["total"]["requests"] == 0
    done = await asyncio.to_thread(report_cli, tmp_path, cache, "--json")
    assert done.returncode == 0, done
    assert json.loads(done.stdout)["total"]["requests"] == 0 and json.loads(done.stdout)["rows"] == []


# ---------------------------------------------------------------------------- the admin endpoint


async def test_admin_report_is_503_while_its_redis_is_down_then_complete(
        upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """Redis down: 503 naming why (the process holds figures it cannot write, and cannot read the others');
    back: 200, and the figures the process kept meanwhile are all there."""
    with RedisServer.started() as server:
        client = aioredis.Redis.from_url(server.url)
        await client.config_set("requirepass", PASSWORD)
        await client.aclose()
        url = f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0"
        proxy = await start_proxy(config(upstream.base_url, admin={"keys": [ADMIN]},
                                         cache={"backend": "redis", "url": url}))
        async with aiohttp.ClientSession() as s:
            for n in (30, 31, 32):
                assert (await post(s, proxy.url, conversation(n)))[0] == 200
        server.stop()
        async with aiohttp.ClientSession() as s:
            assert (await post(s, proxy.url, conversation(33)))[0] == 200  # served without the cache
        for query in ("", "&format=text"):
            status, content_type, raw = await get_report(proxy.url, query)
            assert (status, content_type) == (503, "application/json")
            message = unreadable(raw)
            assert f"redis://127.0.0.1:{server.port}/0" in message and "ConnectionError" in message
            assert PASSWORD not in message
        server.start()  # back, empty (no persistence): this process writes its whole buckets again
        client = aioredis.Redis.from_url(server.url)
        await client.config_set("requirepass", PASSWORD)
        await client.aclose()
        status, _, raw = await get_report(proxy.url)
        assert status == 200, raw
        text = await scrape(proxy)
        assert json.loads(raw)["total"]["requests"] == metric_total(text, "ctxproxy_requests_total") == 4
