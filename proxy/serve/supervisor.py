"""``ctxproxy serve --workers N``: N worker processes on one port (SO_REUSEPORT), kept running.

The supervisor blocks the signals it handles before it starts a worker, and the worker inherits that
mask: a SIGHUP (or SIGTERM) that arrives while a worker still imports waits until the worker has
installed its handlers, instead of killing it. The supervisor takes its own signals with
``sigtimedwait`` (no handler runs between two system calls): SIGHUP is relayed to every worker (each
reloads the config), SIGTERM and SIGINT too (each drains), then it waits for them, killing any still
there ``drain_timeout`` + 10 s later. A worker that dies is logged and replaced after a back-off that
doubles while replacements die young (0.5 s up to 30 s). Before any worker has ever been ready, a
worker that exits is a start-up failure (a port that cannot be bound, a config that no longer loads):
the supervisor stops the others and exits with its code.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from proxy.serve.workers import HELD_UNTIL_READY, SUPERVISOR_ENV, WORKERS_DIR_ENV
from proxy.settings import Config

log = logging.getLogger("ctxproxy")

RESPAWN_FIRST = 0.5  # seconds before a dead worker is replaced; doubles for each replacement in a row that died young
RESPAWN_MAX = 30.0
STABLE = 30.0  # a worker that lived this long resets the back-off
TICK = 1.0  # the longest the supervisor sleeps without looking at its workers
KILL_GRACE = 10.0  # seconds past drain_timeout before a worker that will not stop is killed


@dataclass
class Slot:
    """One of the N workers: its current process, and the back-off of its replacements."""

    index: int
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    replacements: int = 0  # started since the slot's first worker died
    died_young: int = 0  # replacements in a row that died within STABLE seconds
    respawn_at: float | None = None


def supervise(config: Config, host: str, port: int, workers: int) -> int:
    if port == 0:
        print("--workers needs a fixed port", file=sys.stderr)
        return 2
    signal.pthread_sigmask(signal.SIG_BLOCK, HELD_UNTIL_READY)
    run_dir = Path(tempfile.mkdtemp(prefix="ctxproxy-"))
    metrics_dir, workers_dir = run_dir / "metrics", run_dir / "workers"
    metrics_dir.mkdir()
    workers_dir.mkdir()
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(metrics_dir), **{
        SUPERVISOR_ENV: str(os.getpid()), WORKERS_DIR_ENV: str(workers_dir)})
    cmd = [sys.executable, "-m", "proxy.cli", "serve", "--config", config.source, "--host", host,
           "--port", str(port), "--workers", str(workers)]
    if config.settings.cache.backend == "memory":
        log.warning("cache.backend is memory: each of the %d workers keeps its own summaries and cost ledger "
                    "(GET /admin/report shows one worker's); use disk or redis to share them", workers)
    try:
        return Supervisor(cmd, env, workers_dir, workers, config.settings.server.drain_timeout).run()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


class Supervisor:
    def __init__(self, cmd: list[str], env: dict[str, str], workers_dir: Path, workers: int, drain: float) -> None:
        self.cmd, self.env, self.workers_dir, self.drain = cmd, env, workers_dir, drain
        self.slots = [Slot(i) for i in range(workers)]
        self.ever_ready = False

    def run(self) -> int:
        pids = [self._start(slot) for slot in self.slots]
        log.info("supervisor (pid %d) started %d workers: %s", os.getpid(), len(pids), ", ".join(map(str, pids)))
        while True:
            info = signal.sigtimedwait(HELD_UNTIL_READY, self._sleep())
            signo = info.si_signo if info is not None else None
            if signo in (signal.SIGTERM, signal.SIGINT):
                return self._stop(signal.Signals(signo))
            if signo == signal.SIGHUP:
                sent = self._relay(signal.SIGHUP)
                log.info("SIGHUP: every worker reloads the config (%d signalled)", sent)
            failed = self._reap()
            if failed is not None:
                self._stop(signal.SIGTERM)
                return failed
            self._respawn_due()

    def _sleep(self) -> float:
        due = [s.respawn_at for s in self.slots if s.respawn_at is not None]
        return max(0.01, min([TICK, *(at - time.monotonic() for at in due)]))

    def _start(self, slot: Slot) -> int:
        slot.proc = subprocess.Popen(self.cmd, env=self.env)
        slot.started, slot.respawn_at = time.monotonic(), None
        return slot.proc.pid

    def _relay(self, signum: signal.Signals) -> int:
        sent = 0
        for slot in self.slots:
            if slot.proc is not None and slot.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    slot.proc.send_signal(signum)
                    sent += 1
        return sent

    def _ready(self, pid: int) -> bool:
        return (self.workers_dir / f"{pid}.json").exists()

    def _reap(self) -> int | None:
        """Note the workers that exited; the exit code that ends the server when one failed to start."""
        now = time.monotonic()
        self.ever_ready = self.ever_ready or any(s.proc is not None and self._ready(s.proc.pid) for s in self.slots)
        for slot in self.slots:
            proc = slot.proc
            if proc is None:
                continue
            code = proc.poll()
            if code is None:
                continue
            ready = self._ready(proc.pid)
            with contextlib.suppress(FileNotFoundError):
                (self.workers_dir / f"{proc.pid}.json").unlink()
            slot.proc = None
            if not self.ever_ready and not ready:
                log.error("worker %d (pid %d) exited with %s before it was ready; stopping", slot.index, proc.pid,
                          _exit(code))
                return code if code > 0 else 1
            lived = now - slot.started
            slot.died_young = slot.died_young + 1 if slot.replacements and lived < STABLE else 0
            delay = min(RESPAWN_MAX, RESPAWN_FIRST * 2.0 ** min(slot.died_young, 16))
            slot.respawn_at = now + delay
            log.warning("worker %d (pid %d) exited with %s after %.1fs; starting a new one in %.1fs",
                        slot.index, proc.pid, _exit(code), lived, delay)
        return None

    def _respawn_due(self) -> None:
        now = time.monotonic()
        for slot in self.slots:
            if slot.proc is None and slot.respawn_at is not None and now >= slot.respawn_at:
                slot.replacements += 1
                log.info("worker %d restarted (pid %d)", slot.index, self._start(slot))

    def _stop(self, signum: signal.Signals) -> int:
        """Relay ``signum`` so every worker drains; wait for them; kill what is left after the grace."""
        self._relay(signum)
        deadline = time.monotonic() + self.drain + KILL_GRACE
        codes: list[int] = []
        for slot in self.slots:
            if slot.proc is None:
                continue
            try:
                codes.append(slot.proc.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                log.error("worker %d (pid %d) did not stop within %.0fs; killing it", slot.index, slot.proc.pid,
                          self.drain + KILL_GRACE)
                slot.proc.kill()
                codes.append(slot.proc.wait())
        return 0 if all(code == 0 for code in codes) else 1


def _exit(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return signal.Signals(-code).name
    return f"code {code}"
