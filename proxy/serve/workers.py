"""A worker of ``ctxproxy serve --workers N``: its supervisor, and the status files the workers share.

The supervisor (``proxy.serve.supervisor``) starts every worker with ``CTXPROXY_SUPERVISOR`` (its pid)
and ``CTXPROXY_WORKERS_DIR`` (a directory it owns and removes). A worker writes ``<pid>.json`` there
once it is listening and after every reload: how many reloads it has done and what the last one said.
The supervisor reads a file's presence as "ready" and removes the file of a worker that died.

``POST /admin/reload`` reaches one worker; it asks the supervisor (SIGHUP, which the supervisor relays
to every worker, itself included) and reads the files until every worker that was there has reloaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import orjson

log = logging.getLogger("ctxproxy")

# Signals held (blocked) until a server has installed its handlers: by the supervisor before it starts a
# worker (the mask is inherited), and by `ctxproxy serve` from the start. Until then SIGHUP's default
# action would end the process; a held signal waits and is handled once the server listens.
HELD_UNTIL_READY = frozenset({signal.SIGHUP, signal.SIGTERM, signal.SIGINT, signal.SIGCHLD})
SUPERVISOR_ENV = "CTXPROXY_SUPERVISOR"
WORKERS_DIR_ENV = "CTXPROXY_WORKERS_DIR"
POLL = 0.05  # seconds between two reads of the status files while a reload is awaited


@dataclass(frozen=True)
class Status:
    """One worker's status file: when it last read the config file (``time.monotonic()``, which every
    process on the machine shares) and what that read said."""

    pid: int
    checked_at: float
    problems: list[str] = field(default_factory=list)
    restart_required: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Outcome:
    """What one worker did with a reload that every worker was asked for."""

    pid: int
    state: str  # reloaded | rejected (kept its config) | exited (before it said; a new one reads the file) | pending
    problems: list[str] = field(default_factory=list)
    restart_required: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"pid": self.pid, "state": self.state}
        if self.problems:
            out["problems"] = self.problems
        if self.state == "reloaded":
            out["restart_required"] = self.restart_required
        return out


@dataclass(frozen=True)
class Supervised:
    """This process is a worker: who supervises it, and where the workers' status files are."""

    supervisor: int
    directory: Path

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Supervised | None:
        pid, directory = environ.get(SUPERVISOR_ENV, ""), environ.get(WORKERS_DIR_ENV, "")
        if not pid.isdigit() or not directory:
            return None
        return cls(int(pid), Path(directory))

    def write(self, status: Status) -> None:
        """Replace this worker's status file whole (a reader never sees half of it)."""
        path = self.directory / f"{status.pid}.json"
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_bytes(orjson.dumps(status.__dict__))
            tmp.replace(path)
        except OSError as exc:  # the supervisor's directory is gone: nobody is waiting for this
            log.warning("cannot write this worker's status to %s: %s", self.directory, exc.strerror or exc)

    def statuses(self) -> dict[int, Status]:
        """Every live worker's status, by pid."""
        out: dict[int, Status] = {}
        for path in self.directory.glob("*.json"):
            with contextlib.suppress(OSError, ValueError, TypeError):  # removed meanwhile: that worker died
                out[int(path.stem)] = Status(**orjson.loads(path.read_bytes()))
        return out

    def supervisor_alive(self) -> bool:
        return os.getppid() == self.supervisor  # reparented: the supervisor is gone

    async def reload_all(self, timeout: float) -> list[Outcome] | None:
        """Ask the supervisor to reload every worker; wait until each has read the file since, up to ``timeout``.

        None when the status files cannot be read (this worker's own is missing): nobody could confirm.
        """
        before = set(self.statuses())
        if os.getpid() not in before:
            return None
        asked = time.monotonic()
        os.kill(self.supervisor, signal.SIGHUP)
        deadline = asked + timeout
        while True:
            now = self.statuses()
            outcomes = [_outcome(pid, now.get(pid), asked) for pid in sorted(before | set(now))]
            if all(o.state != "pending" for o in outcomes) or time.monotonic() >= deadline:
                return outcomes
            await asyncio.sleep(POLL)


def _outcome(pid: int, status: Status | None, asked: float) -> Outcome:
    if status is None:
        return Outcome(pid, "exited")
    if status.checked_at < asked:
        return Outcome(pid, "pending")
    if status.problems:
        return Outcome(pid, "rejected", problems=status.problems)
    return Outcome(pid, "reloaded", restart_required=status.restart_required)
