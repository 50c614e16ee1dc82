"""Summaries made in the background, before a request needs them (docs/design.md#summaries-off-the-critical-path).

A request whose conversation nears the point where it will need a summary hands the job here
(``submit``) and goes on at once. A task of this process makes the summary through the summary
store (single flight with any request that needs the same one, the same cache, the same cost path),
so the request that crosses the threshold later finds it ready.

Bounded, and never blocking a request: at most ``concurrency`` summaries are made at once, at most
``queue`` more wait for a place, and a conversation has at most one job queued or running. Past those
limits a job is skipped (counted) and the conversation asks again on a later request.

What becomes of each job, reported to ``observer.background_summary(tenant, result)``:

- ``started``: accepted (running now, or queued);
- ``skipped``: not accepted (the queue was full, or the process is stopping), or dropped when it was
  its turn because the summariser is backing off for that conversation;
- ``made``: its task made the summary and cached it (not when the cache already had it, or a request
  made it meanwhile: the request then counts it, as ``created``);
- ``failed``: the summariser failed (the summary store counts why and backs off);
- ``used``: a summary it made was first forwarded by a request of this process;
- ``wasted``: a summary it made that no request of this process used within ``unused_after`` seconds,
  or before the process stopped;
- ``abandoned``: still queued or being made when the process stopped (nothing was cached for it).

``made`` splits into ``used`` and ``wasted`` (a summary made here and used by another replica counts as
wasted here: the count is per process). Graceful shutdown (``close``) lets running jobs finish within
the time it is given and cancels the rest; a summary is cached whole by one write after the
summariser's answer, so a cancelled job leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from plugins.base import CachedSummary, Completion
from proxy.core.errors import SummaryUnavailable
from proxy.store.guard import own_budget

log = logging.getLogger("ctxproxy.summaries")

BACKGROUND_RESULTS = frozenset({"started", "skipped", "made", "failed", "used", "wasted", "abandoned"})
UNUSED_TRACKED = 10_000  # made summaries watched for their first use; past it the oldest counts as wasted

# a job: the summary, and whether this call made it (False: the cache had it, or another made it); None: no
# longer needed (a longer summary of the conversation is cached)
Make = Callable[[], Awaitable[tuple[CachedSummary, bool] | None]]


class BackgroundObserver(Protocol):
    """Where the outcomes go (``proxy.serve.metrics.Metrics``)."""

    def background_summary(self, tenant: str, result: str) -> None: ...

    def background_summary_made(self, tenant: str, model: str, made: Completion | None) -> None:
        """A summary this process made in the background: its cost, for the model of the request that started it."""


@dataclass
class _Job:
    key: str  # the summary's cache key
    conversation: str
    tenant: str
    model: str
    make: Make
    used: bool = False  # a request used the summary while it was being made
    task: asyncio.Task[None] | None = field(default=None, repr=False)


class BackgroundSummaries:
    """The per-process runner of background summaries (``Shared.background``)."""

    def __init__(self, *, concurrency: int, queue: int, unused_after: float,
                 observer: BackgroundObserver | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.observer = observer
        self.clock = clock
        self._queue: deque[_Job] = deque()
        self._jobs: dict[str, _Job] = {}  # by key: queued or running
        self._conversations: dict[str, str] = {}  # conversation -> the key of its job
        self._running: set[asyncio.Task[None]] = set()
        self._unused: OrderedDict[str, tuple[str, float]] = OrderedDict()  # key -> (tenant, made at)
        self._accepting = True
        self.configure(concurrency=concurrency, queue=queue, unused_after=unused_after)

    def configure(self, *, concurrency: int, queue: int, unused_after: float) -> None:
        """The limits a reload may change (jobs already queued or running are kept)."""
        self.concurrency = max(0, concurrency)
        self.queue_size = max(0, queue)
        self.unused_after = unused_after
        if not self.enabled:  # turned off: what is queued would never run
            self._drop_queued()
        self._start_queued()

    @property
    def enabled(self) -> bool:
        """Configured to make summaries in the background (``summarizer.background_summaries`` > 0)."""
        return self.concurrency > 0

    def busy(self, conversation: str) -> bool:
        """Whether a job of this conversation is queued or running."""
        return conversation in self._conversations

    def submit(self, key: str, conversation: str, tenant: str, model: str, make: Make) -> str:
        """Queue ``make`` (the summary under ``key``) and return at once: started, skipped or busy (the
        conversation already has a job: nothing is counted)."""
        self._sweep()
        if conversation in self._conversations:
            return "busy"
        full = len(self._running) >= self.concurrency and len(self._queue) >= self.queue_size
        if not self._accepting or not self.enabled or full:
            self._event(tenant, "skipped")
            return "skipped"
        job = _Job(key, conversation, tenant, model, make)
        self._jobs[key] = job
        self._conversations[conversation] = key
        self._queue.append(job)
        self._event(tenant, "started")
        self._start_queued()
        return "started"

    def used(self, key: str) -> None:
        """A request forwarded the summary cached under ``key``: the first use of one made here counts."""
        job = self._jobs.get(key)
        if job is not None:
            job.used = True
            return
        made = self._unused.pop(key, None)
        if made is not None:
            self._event(made[0], "used")
        self._sweep()

    def _start_queued(self) -> None:
        while self._queue and len(self._running) < self.concurrency:
            job = self._queue.popleft()
            job.task = asyncio.create_task(self._run(job))
            self._running.add(job.task)
            job.task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._running.discard(task)
        if self._accepting:
            self._start_queued()

    async def _run(self, job: _Job) -> None:
        result = "failed"
        try:
            with own_budget():  # not the cache-time budget of the request that submitted it
                out = await job.make()
            result = "found"
            if out is not None and out[1]:
                result = "made"
                self._made(job, out[0])
        except SummaryUnavailable as exc:
            result = "skipped" if exc.reason == "backoff" else "failed"
        except asyncio.CancelledError:
            result = "abandoned"
            raise
        except Exception:  # a bug must not kill the runner, nor reach anyone
            log.error("background summary failed unexpectedly", exc_info=True)
        finally:
            self._jobs.pop(job.key, None)
            if self._conversations.get(job.conversation) == job.key:
                del self._conversations[job.conversation]
            if result != "found":
                self._event(job.tenant, result)

    def _made(self, job: _Job, summary: CachedSummary) -> None:
        if self.observer is not None:
            self.observer.background_summary_made(job.tenant, job.model, summary.made_with)
        if job.used:  # a request that needed it waited for this very job
            self._event(job.tenant, "used")
            return
        self._unused[job.key] = (job.tenant, self.clock())
        self._unused.move_to_end(job.key)
        while len(self._unused) > UNUSED_TRACKED:
            _key, (tenant, _at) = self._unused.popitem(last=False)
            self._event(tenant, "wasted")

    def _sweep(self, everything: bool = False) -> None:
        """Count as wasted the made summaries nobody used in time (all of them: the process is stopping)."""
        limit = self.clock() - self.unused_after
        while self._unused:
            key, (tenant, at) = next(iter(self._unused.items()))
            if not everything and at > limit:
                break
            del self._unused[key]
            self._event(tenant, "wasted")

    async def idle(self) -> None:
        """Return once no job is queued or running (a test, or a run that models a user's think time)."""
        while self._running:
            await asyncio.wait(set(self._running))

    def drain(self) -> None:
        """The process is stopping: accept nothing more and drop what is queued (running jobs go on)."""
        self._accepting = False
        self._drop_queued()

    def _drop_queued(self) -> None:
        while self._queue:
            job = self._queue.popleft()
            self._jobs.pop(job.key, None)
            self._conversations.pop(job.conversation, None)
            self._event(job.tenant, "abandoned")

    async def close(self, timeout: float) -> None:
        """Let running jobs finish within ``timeout`` seconds, cancel the rest; count what was never used."""
        self.drain()
        if self._running:
            _done, pending = await asyncio.wait(set(self._running), timeout=max(0.0, timeout))
            for task in pending:
                task.cancel()
            for task in pending:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if pending:
                log.info("shutdown: %d background summaries abandoned (nothing cached for them)", len(pending))
        self._sweep(everything=True)

    def _event(self, tenant: str, result: str) -> None:
        if self.observer is not None:
            self.observer.background_summary(tenant, result)
