"""``ctxproxy serve --workers N`` as real processes: signals while workers start, dead workers replaced."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from tests.conftest import ROOT
from tests.fake_upstream import FakeUpstream
from tests.outside import Served

MODEL = "gpt-4o-mini"
LISTENING = re.compile(r"listening on http://\S+ \(pid (\d+)\)")

pytestmark = pytest.mark.timeout(120)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def workers_config(upstream: FakeUpstream, **extra: Any) -> dict[str, Any]:
    return {
        "server": {"host": "127.0.0.1", "drain_timeout": 3},
        "upstreams": {"fake": {"base_url": upstream.base_url, "api_key": "sk-upstream-secret"}},
        "models": [{"name": MODEL, "context_window": 128000, "max_output_tokens": 16384}],
        "cache": {"backend": "memory"},
        "logging": {"level": "INFO", "requests": False},
        **extra,
    }


def children(pid: int) -> set[int]:
    """The processes whose parent is ``pid`` (read from /proc)."""
    out: set[int] = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                out.add(int(stat.parent.name))
    return out


class Fleet(Served):
    """A ``ctxproxy serve --workers N`` process (the supervisor) and its log, read line by line."""

    stop_timeout = 30.0

    def __init__(self, proc: asyncio.subprocess.Process, port: int) -> None:
        super().__init__(proc)
        self.port = port
        self.url = f"http://127.0.0.1:{port}"

    def listening(self) -> list[int]:
        """The pids of the workers that said they listen, in order."""
        return [int(m.group(1)) for line in self.lines if (m := LISTENING.search(line))]

    async def ready(self, n: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while len(self.listening()) < n:
            await self.wait_for(LISTENING.pattern, after=len(self.lines), timeout=max(0.1, deadline - time.monotonic()))


@contextlib.asynccontextmanager
async def fleet(config_path: Path, workers: int, port: int | None = None) -> AsyncIterator[Fleet]:
    port = port or free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy.cli", "serve", "--config", str(config_path), "--port", str(port),
        "--workers", str(workers), cwd=ROOT, env=dict(os.environ), stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE)
    running = Fleet(proc, port)
    try:
        yield running
    finally:
        if proc.returncode is None:
            for pid in children(proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.kill()
            await proc.wait()
        running._reader.cancel()


def write(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


async def chat_statuses(url: str, n: int, key: str = "sk-client") -> list[int]:
    """``n`` chat requests, each on its own connection (so SO_REUSEPORT spreads them over the workers)."""
    statuses = []
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    for _ in range(n):
        async with aiohttp.ClientSession() as s, s.post(url + "/v1/chat/completions", json=body,
                                                        headers={"Authorization": f"Bearer {key}"}) as r:
            await r.read()
            statuses.append(r.status)
    return statuses


async def started_workers(supervisor: int, n: int, timeout: float = 30) -> set[int]:
    """Wait until the supervisor has ``n`` children (the workers exist, still importing)."""
    deadline = time.monotonic() + timeout
    while len(found := children(supervisor)) < n:
        assert time.monotonic() < deadline, "the workers were never started"
        await asyncio.sleep(0.005)
    return found


# --------------------------------------------------------------------------- signals while workers start


async def test_a_sighup_while_workers_start_is_handled_once_they_listen(upstream: FakeUpstream,
                                                                     tmp_path: Path) -> None:
    """A SIGHUP in the first second used to kill the workers (its default action) and the server exited 255."""
    path = write(tmp_path / "c.yaml", workers_config(upstream))
    async with fleet(path, 2) as served:
        workers = await started_workers(served.proc.pid, 2)
        served.proc.send_signal(signal.SIGHUP)
        for pid in workers:  # and one sent to a worker itself, still importing
            os.kill(pid, signal.SIGHUP)
        await served.ready(2)
        assert set(served.listening()) == workers
        for _ in range(2):  # each worker reloads once it listens (the two held SIGHUPs count once)
            await served.wait_for("config reloaded from", after=0)
        assert await chat_statuses(served.url, 10) == [200] * 10
        assert served.proc.returncode is None
        assert await served.stop() == 0
    assert sum("config reloaded from" in line for line in served.lines) >= 2
    assert "Traceback" not in "\n".join(served.lines)


async def test_a_sigterm_while_workers_start_stops_them_cleanly(upstream: FakeUpstream, tmp_path: Path) -> None:
    """The workers finish starting, then drain and exit 0 (they used to die of the signal: exit 241)."""
    path = write(tmp_path / "c.yaml", workers_config(upstream))
    async with fleet(path, 2) as served:
        await started_workers(served.proc.pid, 2)
        served.proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(served.proc.wait(), 60) == 0
    assert "Traceback" not in "\n".join(served.lines)


# --------------------------------------------------------------------------- dead workers


async def test_a_dead_worker_is_replaced_with_a_growing_back_off_and_logged(upstream: FakeUpstream,
                                                                          tmp_path: Path) -> None:
    """A worker that died was never replaced and nothing was logged: the port served at half capacity."""
    path = write(tmp_path / "c.yaml", workers_config(upstream))
    async with fleet(path, 2) as served:
        await served.ready(2)
        first, second = served.listening()
        os.kill(second, signal.SIGKILL)
        match = await served.wait_for(rf"worker (\d) \(pid {second}\) exited with SIGKILL after [\d.]+s; "
                                      r"starting a new one in 0\.5s")
        slot = match.group(1)
        replacement = int((await served.wait_for(rf"worker {slot} restarted \(pid (\d+)\)")).group(1))
        await served.ready(3)
        assert served.listening()[-1] == replacement
        os.kill(replacement, signal.SIGKILL)  # it died young: the next one waits longer
        await served.wait_for(rf"worker {slot} \(pid {replacement}\) exited with SIGKILL after [\d.]+s; "
                              r"starting a new one in 1\.0s")
        await served.ready(4)
        assert children(served.proc.pid) == {first, served.listening()[-1]}
        assert await chat_statuses(served.url, 20) == [200] * 20
        assert await served.stop() == 0


async def test_workers_that_cannot_start_end_the_server(upstream: FakeUpstream, tmp_path: Path) -> None:
    """Before any worker was ever ready, a worker that exits is a start-up failure, not one to replace forever."""
    path = write(tmp_path / "c.yaml", workers_config(upstream))
    with socket.socket() as holder:  # the port is taken by a socket without SO_REUSEPORT
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        async with fleet(path, 2, port=holder.getsockname()[1]) as served:
            code = await asyncio.wait_for(served.proc.wait(), 60)
            await asyncio.wait_for(served._reader, 5)
    assert code != 0
    assert any("before it was ready; stopping" in line for line in served.lines), served.lines
    assert not any("restarted" in line for line in served.lines)
