"""Helpers for the ``make check`` tests that drive ctxproxy and real servers as processes.

Everything here talks to 127.0.0.1 only. Processes are started with their own process group and
killed by id (never by name) when a test ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[2]
READY = re.compile(r"ctxproxy listening on http://([\d.]+):(\d+)")
RESULTS = Path(os.environ.get("CTXPROXY_CHECK_RESULTS") or ROOT / ".cache" / "check-results")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ctxproxy_command() -> list[str]:
    """The console script beside this interpreter (as ``pyproject.toml`` installs it), else ``-m proxy.cli``."""
    script = Path(sys.executable).parent / "ctxproxy"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "proxy.cli"]


def record(name: str, figures: dict[str, Any]) -> Path:
    """Write one check's measured figures as JSON (``make check`` prints them at the end)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    print(f"\n[{name}] " + json.dumps(figures, sort_keys=True))
    return path


class Process:
    """A subprocess whose output is read to the end (the pipe never fills) and kept in ``lines``."""

    def __init__(self, proc: asyncio.subprocess.Process, name: str, ready: re.Pattern[str] | None) -> None:
        self.proc = proc
        self.name = name
        self.lines: list[str] = []
        self.ready_line: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._ready = ready
        self._reader = asyncio.ensure_future(self._read())

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def log(self) -> str:
        return "\n".join(self.lines)

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        async for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            self.lines.append(line)
            if self._ready is not None and not self.ready_line.done() and self._ready.search(line):
                self.ready_line.set_result(line)
        if not self.ready_line.done():
            self.ready_line.set_exception(RuntimeError(f"{self.name} exited before it was ready:\n{self.log}"))

    async def wait_ready(self, timeout: float) -> str:
        try:
            return await asyncio.wait_for(asyncio.shield(self.ready_line), timeout)
        except asyncio.TimeoutError:
            raise AssertionError(f"{self.name} not ready after {timeout}s:\n{self.log}") from None

    def send_signal(self, sig: int) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(sig)

    async def wait(self, timeout: float) -> int:
        code = await asyncio.wait_for(self.proc.wait(), timeout)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._reader, 5)
        return code

    async def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int | None:
        if self.proc.returncode is None:
            self.proc.send_signal(sig)
            try:
                return await self.wait(timeout)
            except asyncio.TimeoutError:
                self.proc.kill()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.proc.wait(), 10)
        self._reader.cancel()
        return self.proc.returncode


def _die_with_parent() -> None:
    """In the child: SIGKILL when the test process dies (Linux), so nothing outlives a killed run."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


async def start_process(argv: Sequence[str], name: str, *, ready: str | re.Pattern[str] | None = None,
                        env: dict[str, str] | None = None, cwd: Path | None = None) -> Process:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env=env, cwd=str(cwd or ROOT), preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    pattern = re.compile(ready) if isinstance(ready, str) else ready
    return Process(proc, name, pattern)


@contextlib.asynccontextmanager
async def processes() -> AsyncIterator[list[Process]]:
    """A list the test appends its processes to; each is stopped (then killed) at the end."""
    started: list[Process] = []
    try:
        yield started
    finally:
        await asyncio.gather(*(p.stop(timeout=10) for p in reversed(started)), return_exceptions=True)


async def wait_http(url: str, timeout: float, status: int = 200) -> float:
    """Poll ``url`` until it answers ``status``; returns the seconds it took."""
    started = time.monotonic()
    deadline = started + timeout
    async with aiohttp.ClientSession() as s:
        while True:
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with s.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == status:
                        return time.monotonic() - started
            if time.monotonic() > deadline:
                raise AssertionError(f"{url} did not answer {status} within {timeout}s")
            await asyncio.sleep(0.1)


def env(**extra: str) -> dict[str, str]:
    out = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True", LITELLM_TELEMETRY="False", PYTHONUNBUFFERED="1")
    out.update(extra)
    return out
