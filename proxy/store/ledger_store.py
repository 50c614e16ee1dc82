"""Where the cost ledger is kept: beside the summary cache, never inside its eviction.

The summary cache is a cache: size-limited on disk, TTL'd (and so evictable under an LRU policy) in
Redis. The ledger is a record, and it must not be evicted by the summaries it counts. So it has its
own store:

- **disk**: an SQLite database of its own, ``<cache.path>/ledger.db`` (one row per hour and replica),
  with no size limit and no eviction; only the ledger prunes it (31 days).
- **redis**: the cache's Redis, keys ``ctxproxy:ledger:v2:*`` written **without a TTL**: a hash per hour
  (one field per replica), a sorted set of the hours written, and a marker that the ledger exists.
  Redis's ``volatile-*`` policies and ``noeviction`` never evict a key without a TTL; the ``allkeys-*``
  policies may (a warning is logged when the server says it runs one). The ledger prunes itself.
- **memory**: in the server process (only ``GET /admin/report`` can read it).

Every failure raises ``LedgerUnavailable`` naming where and why (never a password): a writer keeps
its figures and writes them again later; a reader reports that it cannot read instead of reporting zero.
A reader never creates anything: a ledger that does not exist is an error, not an empty report.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sqlite3
import stat
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar
from urllib.parse import quote, urlsplit

import orjson
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from proxy.core.errors import LedgerUnavailable

__all__ = ["DiskLedgerStore", "LedgerStore", "MemoryLedgerStore", "RedisLedgerStore"]

log = logging.getLogger("ctxproxy.ledger")

T = TypeVar("T")
Rows = list[dict[str, Any]]
DB_NAME = "ledger.db"
REDIS_PREFIX = "ctxproxy:ledger:v2:"


class LedgerStore(Protocol):
    """Buckets of rows by (hour, replica); each replica is the only writer of its buckets."""

    where: str
    """Where the ledger lives, for messages: a path, or a Redis address without its credentials."""

    async def create(self) -> None:
        """Make the ledger exist (the writer, once), so a reader can tell "no traffic" from "no ledger here"."""
        ...

    async def write(self, hour: int, replica: str, rows: Rows) -> None:
        """Replace this replica's bucket of ``hour``; raises ``LedgerUnavailable`` unless it is written."""
        ...

    async def read(self, first: int, last: int) -> list[Rows]:
        """Every replica's bucket of the hours ``first`` to ``last``; raises ``LedgerUnavailable``."""
        ...

    async def prune(self, before: int) -> None:
        """Delete the buckets of the hours before ``before``."""
        ...

    async def close(self) -> None:
        ...


def _rows(raw: bytes | str) -> Rows:
    """A stored bucket; one that is not a list of objects is empty (it must not hide the others)."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return []
    return [row for row in value if isinstance(row, dict)] if isinstance(value, list) else []


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class MemoryLedgerStore:
    """The ledger in the server process (the memory cache backend)."""

    where = "the server process's memory"

    def __init__(self) -> None:
        self._buckets: dict[tuple[int, str], bytes] = {}

    async def create(self) -> None:
        return None

    async def write(self, hour: int, replica: str, rows: Rows) -> None:
        self._buckets[(hour, replica)] = orjson.dumps(rows)

    async def read(self, first: int, last: int) -> list[Rows]:
        return [_rows(raw) for (hour, _), raw in self._buckets.items() if first <= hour <= last]

    async def prune(self, before: int) -> None:
        for key in [key for key in self._buckets if key[0] < before]:
            del self._buckets[key]

    async def close(self) -> None:
        self._buckets.clear()


class DiskLedgerStore:
    """``<directory>/ledger.db``: SQLite, one row per (hour, replica), no size limit, no eviction.

    The writer (``create=True``, the server) makes the directory (0700) and the database (0600); a reader
    (``ctxproxy report``) opens an existing database read-only and creates nothing, so a mistyped path is
    an error. All SQLite work runs in one worker thread, never on the loop.
    """

    def __init__(self, directory: str, *, create: bool, timeout: float = 2.0) -> None:
        self.directory = os.path.abspath(os.path.expanduser(directory))
        self.where = os.path.join(self.directory, DB_NAME)
        self._create = create
        self._timeout = timeout
        self._db: sqlite3.Connection | None = None  # only touched from the worker thread
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ctxproxy-ledger")
        self._closed = False

    # -- worker-thread side -------------------------------------------------------------------
    def _open(self) -> sqlite3.Connection:
        if not self._create:
            if not os.path.isdir(self.directory):
                problem = "is not a directory" if os.path.exists(self.directory) else "does not exist"
                raise LedgerUnavailable(f"{self.directory} {problem} (cache.path)")
            if not os.path.isfile(self.where):
                raise LedgerUnavailable(f"no cost ledger at {self.where}: no ctxproxy server has recorded anything "
                                        "there (cache.path)")
            return sqlite3.connect(f"file:{quote(self.where)}?mode=ro", uri=True, timeout=self._timeout,
                                   isolation_level=None)
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        st = os.stat(self.directory)
        if st.st_uid == os.geteuid():
            if stat.S_IMODE(st.st_mode) != 0o700:
                os.chmod(self.directory, 0o700)
        elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise LedgerUnavailable(f"refusing {self.directory}: not ours and writable by others")
        os.close(os.open(self.where, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600))
        db = sqlite3.connect(self.where, timeout=self._timeout, isolation_level=None)
        try:
            db.execute("CREATE TABLE IF NOT EXISTS buckets (hour INTEGER NOT NULL, replica TEXT NOT NULL, "
                       "rows BLOB NOT NULL, PRIMARY KEY (hour, replica))")
        except BaseException:
            db.close()
            raise
        return db

    def _call(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        try:
            if self._db is None:
                self._db = self._open()
            return fn(self._db)
        except LedgerUnavailable:
            raise
        except (sqlite3.Error, OSError) as exc:
            db, self._db = self._db, None  # reopen on the next call
            if db is not None:
                with contextlib.suppress(Exception):
                    db.close()
            raise LedgerUnavailable(f"{self.where}: {type(exc).__name__}: {exc}") from exc

    # -- loop side ----------------------------------------------------------------------------
    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        # shielded: a caller that is cancelled never leaves the connection half-used by another call
        if self._closed:
            raise LedgerUnavailable(f"{self.where}: closed")
        loop = asyncio.get_running_loop()
        return await asyncio.shield(loop.run_in_executor(self._executor, self._call, fn))

    async def create(self) -> None:
        await self._run(lambda db: None)

    async def write(self, hour: int, replica: str, rows: Rows) -> None:
        data = orjson.dumps(rows)
        await self._run(lambda db: db.execute(
            "INSERT OR REPLACE INTO buckets (hour, replica, rows) VALUES (?, ?, ?)", (hour, replica, data)))

    async def read(self, first: int, last: int) -> list[Rows]:
        def op(db: sqlite3.Connection) -> list[bytes]:
            query = "SELECT rows FROM buckets WHERE hour BETWEEN ? AND ?"
            return [raw for (raw,) in db.execute(query, (first, last)).fetchall()]

        return [_rows(raw) for raw in await self._run(op)]

    async def prune(self, before: int) -> None:
        await self._run(lambda db: db.execute("DELETE FROM buckets WHERE hour < ?", (before,)))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True

        def shut() -> None:
            db, self._db = self._db, None
            if db is not None:
                db.close()

        with contextlib.suppress(Exception):
            await asyncio.get_running_loop().run_in_executor(self._executor, shut)
        self._executor.shutdown(wait=False)


def redis_address(url: str) -> str:
    """``url`` without its user name and password (the ledger's place, as messages name it)."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return f"{parts.scheme}://{host}{parts.path}"


class RedisLedgerStore:
    """The ledger in Redis, under keys without a TTL (``volatile-*`` policies never evict them).

    ``<prefix>hour:<hour>`` is a hash of the hour's buckets, one field per replica (each replica writes
    only its own field: no read-modify-write, no lock); ``<prefix>hours`` lists the hours written (for
    pruning); ``<prefix>created`` says the ledger exists. Commands run shielded to completion, so a
    cancelled caller never leaves a pooled connection with an unread reply.
    """

    def __init__(self, url: str, *, timeout: float = 1.0, prefix: str = REDIS_PREFIX) -> None:
        self.where = redis_address(url)
        self._prefix = prefix
        self._client = aioredis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=min(timeout, 1.0), protocol=2,
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)))
        self._execute: Callable[..., Awaitable[Any]] = self._client.execute_command
        self._inflight: set[asyncio.Future[Any]] = set()

    async def _run(self, make: Callable[[], Awaitable[T]]) -> T:
        fut = asyncio.ensure_future(make())
        self._inflight.add(fut)
        fut.add_done_callback(self._done)
        try:
            return await asyncio.shield(fut)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            raise LedgerUnavailable(f"{self.where}: {type(exc).__name__}: {exc}") from exc

    def _done(self, fut: asyncio.Future[Any]) -> None:
        self._inflight.discard(fut)
        if not fut.cancelled():
            fut.exception()  # retrieved: a failure whose caller was cancelled is not "never retrieved"

    def _hour(self, hour: int) -> str:
        return f"{self._prefix}hour:{hour}"

    async def create(self) -> None:
        await self._run(lambda: self._client.set(self._prefix + "created", str(time.time()), nx=True))
        with contextlib.suppress(LedgerUnavailable):  # CONFIG may be disabled (managed Redis): then say nothing
            reply = await self._run(lambda: self._execute("CONFIG", "GET", "maxmemory-policy"))
            name = _text(reply[1]) if isinstance(reply, (list, tuple)) and len(reply) == 2 else ""
            if name.startswith("allkeys-"):
                log.warning("Redis at %s runs maxmemory-policy %s, which may evict the cost ledger's keys: use a "
                            "volatile-* policy or noeviction (they never evict keys without a TTL)", self.where, name)

    async def write(self, hour: int, replica: str, rows: Rows) -> None:
        async def op() -> Any:
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.hset(self._hour(hour), replica, orjson.dumps(rows))
                pipe.zadd(self._prefix + "hours", {str(hour): hour})
                return await pipe.execute()

        await self._run(op)

    async def read(self, first: int, last: int) -> list[Rows]:
        async def op() -> list[Any]:
            async with self._client.pipeline(transaction=False) as pipe:
                pipe.exists(self._prefix + "created", self._prefix + "hours")
                for hour in range(first, last + 1):
                    pipe.hvals(self._hour(hour))
                return list(await pipe.execute())

        exists, *hours = await self._run(op)
        if not exists:
            raise LedgerUnavailable(f"no cost ledger in {self.where}: no ctxproxy server has recorded anything "
                                    "there (cache.url)")
        return [_rows(raw) for values in hours for raw in values]

    async def prune(self, before: int) -> None:
        old = await self._run(lambda: self._client.zrangebyscore(self._prefix + "hours", "-inf", f"({before}"))
        if not old:
            return
        hours = [int(_text(h)) for h in old]

        async def op() -> Any:
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.delete(*[self._hour(h) for h in hours])
                pipe.zremrangebyscore(self._prefix + "hours", "-inf", f"({before}")
                return await pipe.execute()

        await self._run(op)

    async def close(self) -> None:
        if self._inflight:
            await asyncio.wait(set(self._inflight), timeout=2.0)
        await self._client.aclose()
