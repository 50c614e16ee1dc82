"""Graceful shutdown of a real ``ctxproxy serve`` under load: SIGTERM lets in-flight streams finish.

A slow upstream streams 10 chunks over ~2 s. With 50 streams open, SIGTERM must: stop accepting new
connections at once, let all 50 finish completely (with ``[DONE]``) within ``server.drain_timeout``, and
exit 0. Streams longer than the drain timeout are cut at it (no ``[DONE]``) and the process still exits 0.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from tests.conftest import ROOT, base_config
from tests.faults import SlowStreamUpstream

MODEL = "gpt-4o-mini"
STREAMS = 50


async def start_serve(cfg: dict[str, Any], tmp_path: Path) -> tuple[subprocess.Popen[str], str, int]:
    path = tmp_path / "ctxproxy.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "serve", "--config", str(path), "--port", "0"],
        cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
        env=dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True", LITELLM_TELEMETRY="False"),
    )
    assert proc.stderr is not None
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = await loop.run_in_executor(None, proc.stderr.readline)
        match = re.search(r"listening on (http://\S+)", line)
        if match:
            url = match.group(1)
            return proc, url, int(url.rsplit(":", 1)[1])
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError("ctxproxy serve did not start")


async def open_stream(session: aiohttp.ClientSession, url: str) -> aiohttp.ClientResponse:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "stream please"}], "stream": True}
    r = await session.post(url + "/v1/chat/completions", json=body)
    assert r.status == 200
    first = await asyncio.wait_for(r.content.readuntil(b"\n\n"), 10)
    assert first.startswith(b"data: ")
    return r


async def read_rest(r: aiohttp.ClientResponse) -> tuple[bytes, bool]:
    """The rest of the stream, and whether it ended cleanly."""
    try:
        return await r.read(), True
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
        return b"", False


async def refused(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return True
    writer.close()
    return False


async def wait_exit(proc: subprocess.Popen[str], timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return proc.returncode
        await asyncio.sleep(0.05)
    return proc.poll()


async def test_sigterm_drains_50_streams_then_exits_0(tmp_path: Path) -> None:
    slow = await SlowStreamUpstream(chunks=10, interval=0.2).start()  # ~2 s per stream
    drain = 8.0
    cfg = base_config(slow.base_url)
    cfg["server"] = {"drain_timeout": drain}
    cfg["logging"] = {"level": "INFO", "requests": False}
    proc, url, port = await start_serve(cfg, tmp_path)
    try:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as s:
            streams = await asyncio.gather(*(open_stream(s, url) for _ in range(STREAMS)))
            assert slow.active == STREAMS
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            rests = [asyncio.ensure_future(read_rest(r)) for r in streams]
            # new connections are refused while the 50 streams are still running
            deadline = time.monotonic() + 1.5
            while not await refused(port) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert await refused(port), "still accepting connections after SIGTERM"
            assert slow.active > 0, "the streams ended before the refusal was observed"
            results = await asyncio.gather(*rests)
            finished = time.monotonic() - signalled
        code = await wait_exit(proc, drain + 5)
        exited = time.monotonic() - signalled
        print(f"\nSIGTERM with {STREAMS} streams: all finished {finished:.2f}s after, exit {code} "
              f"after {exited:.2f}s (drain_timeout {drain:g}s)")
        for raw, clean in results:
            assert clean
            events = [line for line in raw.split(b"\n") if line.startswith(b"data:")]
            assert events[-1] == b"data: [DONE]" and len(events) == 10  # 9 more pieces + [DONE]
        assert finished < drain
        assert code == 0
        assert exited < drain + 2
        stderr = proc.stderr.read() if proc.stderr else ""
        assert "Traceback" not in stderr, stderr
        assert "draining" in stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        await slow.stop()


async def test_sigterm_cuts_streams_longer_than_the_drain_timeout(tmp_path: Path) -> None:
    slow = await SlowStreamUpstream(chunks=40, interval=0.2).start()  # ~8 s per stream
    drain = 1.0
    cfg = base_config(slow.base_url)
    cfg["server"] = {"drain_timeout": drain}
    cfg["logging"] = {"level": "INFO", "requests": False}
    proc, url, _port = await start_serve(cfg, tmp_path)
    try:
        async with aiohttp.ClientSession() as s:
            streams = await asyncio.gather(*(open_stream(s, url) for _ in range(10)))
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            results = await asyncio.gather(*(read_rest(r) for r in streams))
        code = await wait_exit(proc, drain + 5)
        exited = time.monotonic() - signalled
        assert code == 0
        assert exited < drain + 2.5
        for raw, _clean in results:  # cut: never a [DONE] the upstream did not send
            assert b"data: [DONE]" not in raw
        assert await _eventually_idle(slow)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        await slow.stop()


async def _eventually_idle(slow: SlowStreamUpstream, timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if slow.active == 0:
            return True
        await asyncio.sleep(0.05)
    return slow.active == 0


@pytest.mark.slow
async def test_sigterm_under_load_repeated(tmp_path: Path) -> None:
    """Three more rounds of the 50-stream drain (catches order-dependent flakiness in the shutdown path)."""
    for i in range(3):
        round_dir = tmp_path / f"round{i}"
        round_dir.mkdir()
        await test_sigterm_drains_50_streams_then_exits_0(round_dir)
