"""Run a throw-away ``redis-server`` for tests.

Usage::

    from tests.redis_server import RedisServer, redis_server_fixture

    redis_server = redis_server_fixture(scope="module")   # skips when redis-server is missing

    async def test_something(redis_server: RedisServer) -> None:
        cache = RedisCache(redis_server.url, ttl=None)
        ...

or directly, e.g. for down-and-back tests that need their own server::

    with RedisServer.started() as server:   # skips when redis-server is missing
        server.stop()                        # Redis is down (connections refused)
        server.start()                       # back on the SAME port
        with server.paused():                # Redis stalls (SIGSTOP): connections accepted, never answered
            ...

The server listens on 127.0.0.1 on a free port, keeps no data on disk (``--save "" --appendonly no``,
working directory in a private temp dir) and allows DEBUG (``DEBUG SLEEP`` blocks the server, handy for
cancellation tests).  Its process is always killed: on ``close()`` / context exit, and by a finaliser
at interpreter exit.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest

SKIP_REASON = "redis-server not installed; .ci/run installs it"


def _free_port() -> int:
    # redis-server does not accept port 0: take one from the kernel, then release it.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            with contextlib.suppress(Exception):
                proc.wait(timeout=5)
    procs.clear()


class RedisServer:
    """A local redis-server subprocess that can be stopped and restarted on the same port."""

    def __init__(self, executable: str | None = None, port: int | None = None) -> None:
        exe = executable or shutil.which("redis-server")
        if exe is None:
            raise FileNotFoundError("redis-server")
        self.executable = exe
        self.port = port or _free_port()
        self.host = "127.0.0.1"
        self._dir = tempfile.mkdtemp(prefix="ctxproxy-redis-")
        self._procs: list[subprocess.Popen[bytes]] = []  # the live process, if any
        self._finalizer = weakref.finalize(self, _kill, self._procs)

    @classmethod
    def require(cls) -> RedisServer:
        """A (not yet started) server, or ``pytest.skip`` when redis-server is not installed."""
        if shutil.which("redis-server") is None:
            pytest.skip(SKIP_REASON)
        return cls()

    @classmethod
    @contextlib.contextmanager
    def started(cls) -> Iterator[RedisServer]:
        server = cls.require()
        try:
            server.start()
            yield server
        finally:
            server.close()

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def running(self) -> bool:
        return bool(self._procs) and self._procs[0].poll() is None

    def _version(self) -> tuple[int, ...]:
        out = subprocess.run(
            [self.executable, "--version"], capture_output=True, text=True, check=False
        ).stdout
        m = re.search(r"v=(\d+)\.(\d+)", out)
        return (int(m.group(1)), int(m.group(2))) if m else (0, 0)

    def start(self, timeout: float = 10.0) -> None:
        """Start (or restart) the server on ``self.port`` and wait until it answers PING."""
        if self.running:
            return
        _kill(self._procs)
        args = [
            self.executable,
            "--port",
            str(self.port),
            "--bind",
            self.host,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self._dir,
            "--daemonize",
            "no",
            "--logfile",
            "",
        ]
        if self._version() >= (7, 0):
            args += ["--enable-debug-command", "yes"]
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._procs.append(proc)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {proc.returncode} (port {self.port} taken?)")
            if self.ping():
                return
            time.sleep(0.02)
        _kill(self._procs)
        raise RuntimeError(f"redis-server did not answer PING within {timeout}s")

    def ping(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        """Stop the server (connections are then refused); ``start()`` brings it back on the same port."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)  # a paused server handles SIGTERM only once it runs again
                proc.terminate()
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)
        self._procs.clear()

    def pause(self) -> None:
        """Stall the server (SIGSTOP): connections are accepted by the kernel and never answered."""
        os.kill(self._procs[0].pid, signal.SIGSTOP)

    def resume(self) -> None:
        """Undo :meth:`pause` (SIGCONT)."""
        os.kill(self._procs[0].pid, signal.SIGCONT)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Stalled for the block; answering again after it, whatever happened inside."""
        self.pause()
        try:
            yield
        finally:
            self.resume()

    def close(self) -> None:
        self.stop()
        self._finalizer()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def redis_server_fixture(scope: Any = "module", name: str | None = None) -> Callable[..., Any]:
    """Make a pytest fixture yielding a started :class:`RedisServer` (skips if redis-server is missing)."""

    @pytest.fixture(scope=scope, name=name)
    def _redis_server() -> Iterator[RedisServer]:
        with RedisServer.started() as server:
            yield server

    return _redis_server
