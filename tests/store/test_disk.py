"""proxy.store.disk under faults: a cache directory that is unusable, a database corrupt or full, a tiny size limit.

Each keeps the proxy serving, counts the failures and logs one warning per streak, through the real server."""

from __future__ import annotations

import logging
import os
import re
import sqlite3
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.conftest import RunningProxy, base_config
from tests.fake_upstream import FakeUpstream
from tests.faults import CHAT_MODEL, send_chat

SMALL = "small-model"


def hanging_config(upstream: FakeUpstream, **extra: Any) -> dict[str, Any]:
    cfg = base_config(
        upstream.base_url,
        models=[{"name": SMALL, "context_window": 8000, "max_output_tokens": 1000},
                {"name": CHAT_MODEL, "context_window": 128000, "max_output_tokens": 16384}],
        summarizer_model=CHAT_MODEL,
        context_manager={"type": "summarising", "params": {"keep_turns": 4}},
        summarizer={"retry_backoff_seconds": 0, "timeout_seconds": 2, "max_summary_tokens": 300},
    )
    cfg.update(extra)
    return cfg


def tagged_conversation(turns: int, tag: str = "") -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a travel agent assistant."}]
    for i in range(turns - 1):
        messages += [
            {"role": "user", "content": f"{tag}Turn {i}: please check booking ZX{i}Q and its seat."},
            {"role": "assistant", "content": f"Booking ZX{i}Q: seat 14C, price 412.{i % 60:02d} USD. " * 12},
        ]
    messages.append({"role": "user", "content": f"Turn {turns - 1}: anything else?"})
    return messages


CACHE_WARNING = re.compile(r"cache backend 'disk': \w+ failed")


async def _metric(proxy: RunningProxy, name: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(proxy.url + "/metrics") as r:
        text = await r.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def _three_summarised_requests(proxy: RunningProxy) -> list[str]:
    out = []
    async with aiohttp.ClientSession() as s:
        for n in (40, 41, 42):
            status, headers, raw = await send_chat(s, proxy.url, {"model": SMALL, "messages": tagged_conversation(n)})
            assert status == 200, raw[:300]
            assert int(headers["x-ctxproxy-tokens-out"]) <= 8000 - 1000 - 800
            out.append(headers["x-ctxproxy-summary"])
    return out


def _cache_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "ctxproxy.cache" and r.levelno >= logging.WARNING and CACHE_WARNING.search(r.getMessage())]


async def _assert_served_counted_logged_once(proxy: RunningProxy, caplog: pytest.LogCaptureFixture,
                                             errors: int = 3) -> None:
    statuses = await _three_summarised_requests(proxy)
    assert set(statuses) <= {"waited", "reused"}, statuses  # it waited for the summary it needed
    assert await _metric(proxy, "ctxproxy_cache_errors_total") >= errors
    warnings = _cache_warnings(caplog)
    assert len(warnings) == 1, warnings


async def _metric_labels(proxy: RunningProxy, name: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(proxy.url + "/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for m in re.finditer(name + r'\{operation="(\w+)"\} (\S+)', text):
        out[m.group(1)] = float(m.group(2))
    return out


async def test_cache_directory_unusable(upstream: FakeUpstream, start_proxy: Any, tmp_path: Path,
                                        caplog: pytest.LogCaptureFixture) -> None:
    # we may be root, for whom chmod 000 is no obstacle: put the cache directory "under" a regular file
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("x")
    caplog.set_level(logging.DEBUG)
    proxy = await start_proxy(hanging_config(upstream, cache={"backend": "disk", "path": str(blocker / "c")}))
    await _assert_served_counted_logged_once(proxy, caplog)
    async with aiohttp.ClientSession() as s, s.get(proxy.url + "/readyz") as r:
        assert r.status == 503
        assert (await r.json())["cache"] == "unavailable"


async def test_cache_database_corrupt_at_start(upstream: FakeUpstream, start_proxy: Any, tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "cache"
    path.mkdir(mode=0o700)
    (path / "cache.db").write_bytes(os.urandom(64 * 1024))
    caplog.set_level(logging.DEBUG)
    proxy = await start_proxy(hanging_config(upstream, cache={"backend": "disk", "path": str(path)}))
    await _assert_served_counted_logged_once(proxy, caplog)
    # removing the corrupt file heals the cache without a restart
    for name in os.listdir(path):
        os.unlink(path / name)
    statuses = await _three_summarised_requests(proxy)
    assert statuses[-1] == "reused"
    assert any("recovered" in r.getMessage() for r in caplog.records if r.name == "ctxproxy.cache")


async def test_cache_database_corrupted_while_running(upstream: FakeUpstream, start_proxy: Any, tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "cache"
    caplog.set_level(logging.DEBUG)
    proxy = await start_proxy(hanging_config(upstream, cache={"backend": "disk", "path": str(path)}))
    async with aiohttp.ClientSession() as s:
        status, headers, _ = await send_chat(s, proxy.url, {"model": SMALL, "messages": tagged_conversation(40)})
    assert (status, headers["x-ctxproxy-summary"]) == (200, "waited")
    for name in os.listdir(path):  # garbage over the database and its WAL while the proxy has them open
        with open(path / name, "r+b") as f:
            size = max(f.seek(0, 2), 4096)
            f.seek(0)
            f.write(os.urandom(size))
    async with aiohttp.ClientSession() as s:
        for n in (50, 51, 52):
            status, headers, raw = await send_chat(s, proxy.url, {"model": SMALL, "messages": tagged_conversation(n)})
            assert status == 200, raw[:300]
    assert await _metric(proxy, "ctxproxy_cache_errors_total") >= 1
    assert len(_cache_warnings(caplog)) == 1, _cache_warnings(caplog)


async def test_cache_database_full(upstream: FakeUpstream, start_proxy: Any, tmp_path: Path,
                                   caplog: pytest.LogCaptureFixture) -> None:
    """SQLITE_FULL, the error a full disk gives: the database is filled up to a page limit it may not pass."""
    import diskcache

    from proxy.store.disk import _JSONBytesDisk

    path = tmp_path / "cache"
    stock = diskcache.Cache(str(path), disk=_JSONBytesDisk)
    pages = stock._sql("PRAGMA page_count").fetchall()[0][0] + 4
    # diskcache applies stored sqlite_* settings as pragmas at every open: the limit holds for the proxy too
    stock._sql("INSERT INTO Settings VALUES ('sqlite_max_page_count', ?)", (pages,))
    stock._sql(f"PRAGMA max_page_count = {pages}")
    for i in range(100_000):  # fill every page
        try:
            stock.set(f"filler-{i}", b"{}")
        except sqlite3.OperationalError as exc:
            assert "full" in str(exc)
            break
    stock.close()
    caplog.set_level(logging.DEBUG)
    proxy = await start_proxy(hanging_config(upstream, cache={"backend": "disk", "path": str(path)}))
    # the first request's lock and write fail; the others reuse its summary from the process's memory
    await _assert_served_counted_logged_once(proxy, caplog, errors=2)
    ops = await _metric_labels(proxy, "ctxproxy_cache_errors_total")
    assert ops.get("set", 0) >= 1 and ops.get("get", 0) == 0, ops  # reads work, writes fail


async def test_cache_size_limit_tiny(upstream: FakeUpstream, start_proxy: Any, tmp_path: Path,
                                     caplog: pytest.LogCaptureFixture) -> None:
    """size_limit_mb 1, and the cache already holds 3 MB: diskcache evicts the oldest entries instead of
    failing -- served, the new summary is stored and reused, no errors, and the file stays bounded."""
    import diskcache

    from proxy.store.disk import _JSONBytesDisk

    path = tmp_path / "cache"
    stock = diskcache.Cache(str(path), disk=_JSONBytesDisk)
    for i in range(60):
        stock.set(f"filler-{i}", b'{"x": "' + b"f" * 50_000 + b'"}')
    stock.close()
    caplog.set_level(logging.DEBUG)
    proxy = await start_proxy(hanging_config(upstream, cache={"backend": "disk", "path": str(path),
                                                                  "size_limit_mb": 1}))
    statuses = await _three_summarised_requests(proxy)
    assert statuses[0] == "waited" and statuses[-1] == "reused", statuses
    assert await _metric(proxy, "ctxproxy_cache_errors_total") == 0
    assert not _cache_warnings(caplog)
    await proxy.runner.cleanup()
    stock = diskcache.Cache(str(path), disk=_JSONBytesDisk)
    try:
        assert stock.volume() < 4 * 1024 * 1024
        assert sum(1 for k in stock.iterkeys() if str(k).startswith("filler-")) < 60  # culled
    finally:
        stock.close()
