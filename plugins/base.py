"""Plugin contracts: context managers and summarisers (docs/design.md#5-context-managers).

A context manager owns the recency policy: ``manage_history`` gets the
committed history as turns of wire-neutral items (``proxy.core.items.Item``, with
their token counts and chained content hashes) and returns the history to send,
and optionally one summary item that the pipeline places right after the system
band. A summariser only turns turns into text; the summarising manager owns
keep_turns and hysteresis, and the summary cache (``SummaryStore``) owns reuse,
single flight and cost. Plugins never see a wire's JSON: the same plugin serves
Chat Completions, the Responses API and Anthropic's Messages API.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from pydantic import BaseModel, ConfigDict

from proxy.core.budget import TrimmerParams
from proxy.core.errors import SummaryUnavailable as SummaryUnavailable  # re-exported: plugins raise it
from proxy.core.items import Item
from proxy.core.values import Section

if TYPE_CHECKING:
    from proxy.core.budget import Budget
    from proxy.core.tokens import TokenCounter


class PluginParams(BaseModel):
    """Base of every plugin's params model: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")


Params = PluginParams


@dataclass(frozen=True)
class Completion:
    """What an engine returns for one summariser call.

    ``model`` is the name the call was routed by (a label); ``upstream_model`` the model the
    provider ran, which is what the call is priced on.
    """

    text: str
    model: str
    prompt_tokens: int
    completion_tokens: int
    upstream_model: str = ""

    @property
    def priced_model(self) -> str:
        return self.upstream_model or self.model


class Engine(Protocol):
    """The seam to a model: the proxy's own upstream routes in the server, a fake in tests.

    ``messages`` are Chat Completions messages (the summariser's own prompt, not a client's).
    ``request_id`` is the client request the call is made for (for logs); the call gets its own id.
    """

    async def complete(
        self, model: str, messages: list[dict[str, Any]], *, max_tokens: int, timeout: float, purpose: str,
        request_id: str = "",
    ) -> Completion: ...


@dataclass(frozen=True)
class SummaryScope:
    """Who may share a summary: tenant + summariser settings (model, instructions, prompt version)."""

    tenant: str
    settings_id: str


@dataclass(frozen=True)
class CachedSummary:
    covered_turns: int
    chain: str
    text: str
    # the summariser call(s) that made it, on the request that made it
    made_with: Completion | None = field(default=None, compare=False)
    # found without asking the shared cache for every longer prefix (some were missing there a moment ago): a
    # longer summary may exist; ``lookup(..., recheck=True)`` asks before one is made or scheduled
    narrowed: bool = field(default=False, compare=False)


class SummaryStore(Protocol):
    """The summary cache seam (``proxy.store.summaries.SummaryService`` in the proxy)."""

    async def lookup(self, scope: SummaryScope, chain: Sequence[str], *,
                     recheck: bool = False) -> CachedSummary | None:
        """The cached summary of the longest known prefix of this history, or None (constant cache ops).
        ``recheck``: ask the shared cache again for what it lately answered missing (before making a summary)."""

    async def obtain(
        self,
        scope: SummaryScope,
        chain: Sequence[str],
        cut: int,
        turns: Sequence[Sequence[Item]],
        previous: CachedSummary | None,
        summarize: SummarizeFn,
        request_id: str = "",
        model: str = "",
    ) -> tuple[CachedSummary, bool]:
        """A summary of ``turns[:cut]``, and whether this call made it (False: it came from the cache).

        Made at most once across requests and replicas (single flight), incrementally from
        ``previous`` plus the newly aged turns. Raises ``SummaryUnavailable`` when the summariser
        fails or is backing off after a failure.
        """

    def making(self, scope: SummaryScope, chain: Sequence[str]) -> int:
        """How many turns the longest summary of this history being made now covers (0: none is)."""

    def failing(self, scope: SummaryScope, chain: Sequence[str]) -> str | None:
        """``backoff`` or ``failed`` when this conversation's last summary failed (None: it did not)."""

    async def call_once(self, tenant: str, material: bytes, call: Callable[[], Awaitable[Completion]]) -> Completion:
        """``call()``, a summariser call whose exact request is ``material``, made at most once at a time across
        requests and replicas; a reused answer has no tokens (it was billed where it was made)."""


class SummarizeFn(Protocol):
    async def __call__(self, previous: str | None, turns: Sequence[Sequence[Item]]) -> Completion: ...


# what a compaction came to (``Compacted.status``)
COMPACTION_STATUSES = frozenset({"reused", "created", "would_create", "unavailable", "failed", "pending"})


@dataclass(frozen=True)
class Compacted:
    """What a compaction came to: ``status`` (``COMPACTION_STATUSES``), the summary when there is one, and
    ``text``: the summary's text, the placeholder a dry run forwards (``would_create``), or why there is none."""

    status: str
    text: str
    summary: CachedSummary | None = None
    reason: str = ""  # a bounded reason when there is no summary (drop, backoff, pending, …)


class Compactor(Protocol):
    """The one compaction service (``proxy.store.compaction.Compaction``): turns -> a summary's text, for the
    summarising context manager, ``/responses/compact`` and Anthropic's ``context_management`` alike."""

    def unavailable(self, summarizer: Summarizer | None, services: Services) -> str | None:
        """Why ``summarizer`` makes no summaries for this request (None: it does)."""

    async def lookup(self, summarizer: Summarizer, services: Services, chain: Sequence[str], *,
                     recheck: bool = False) -> CachedSummary | None:
        """The cached summary of the longest known prefix of this history (``chain``), or None. ``recheck``: ask
        the shared cache again for what it lately answered missing (``SummaryStore.lookup``)."""

    async def compact(self, summarizer: Summarizer | None, services: Services, turns: Sequence[Sequence[Item]],
                      chain: Sequence[str], *, cut: int | None = None,
                      found: CachedSummary | None = None, looked: bool = False) -> Compacted:
        """The summary of ``turns[:cut]`` (all by default): cached, else made once, else why not; in a dry
        run never made. ``looked``: ``found`` is the lookup's answer already."""

    async def values_section(self, services: Services, turns: Sequence[Sequence[Item]], link: str, lead: str,
                             *, offload: bool = False) -> tuple[Section, int]:
        """The values section of ``turns`` (``proxy.core.values``: all the values they acted on, within
        ``services.values_tokens``, after ``lead``) and its tokens; ``link`` is the chained hash of ``turns``
        (the same turns give the same section: it is remembered under it)."""

    @property
    def background(self) -> bool:
        """Summaries can be made in the background (``prefetch``) in this process."""

    def prefetch(self, summarizer: Summarizer, services: Services, turns: Sequence[Sequence[Item]],
                 chain: Sequence[str], cut: int) -> str:
        """Start the summary of ``turns[:cut]`` in the background and return at once: ``started``, ``skipped``
        (no room: the queue is full), ``busy`` (one of this conversation is under way) or ``backoff``."""

    def making(self, summarizer: Summarizer, services: Services, chain: Sequence[str]) -> int:
        """How many turns the longest summary of this history being made now covers (0: none is)."""

    def failing(self, summarizer: Summarizer, services: Services, chain: Sequence[str]) -> str | None:
        """``backoff`` or ``failed`` when this conversation's last summary failed (None: it did not)."""

    def used(self, summarizer: Summarizer, services: Services, summary: CachedSummary) -> None:
        """A request forwards ``summary`` (counts the first use of one made in the background)."""


@dataclass
class Services:
    """What the pipeline lends a plugin for one request (all optional: the CLI may run offline)."""

    engine: Engine | None = None
    summaries: SummaryStore | None = None
    compaction: Compactor | None = None  # the summaries of turns, over ``summaries`` (None: none are made)
    tenant: str = "default"
    model: str = ""
    summarizer_model: str | None = None
    summary_tokens: int = 1024
    values_tokens: int = 1024  # cap on a summary's values section (``proxy.core.values``), on top of summary_tokens
    summarizer_timeout: float = 60.0
    summarizer_window: int = 128_000
    window_of: Callable[[str], int] | None = None  # a model name's input window (the summariser's own)
    summarizer_max_calls: int = 8
    counter: TokenCounter | None = None
    request_id: str = ""
    dry_run: bool = False  # explain/assemble: look summaries up, never call the summariser


@dataclass
class HistoryView:
    """The committed history of one request, as the pipeline prepared it.

    A context manager reads it and returns new lists (``HistoryResult``): it never changes the turns' lists or
    their items in place (a turn's list may be one that observation masking remembers for the next request).
    """

    turns: list[list[Item]]
    turn_tokens: list[int]
    chain_fn: Callable[[], list[str]]
    pinned_tokens: int
    budget: Budget
    counter: TokenCounter
    services: Services
    summary_item: Callable[[str, int], Item]  # (text, covered turns) -> the wire's own summary item, counted
    offload: bool = False  # a large conversation: do any work on its items off the event loop
    # (result, text) -> the wire's copy of a result with ``text`` as its output, counted (None: it cannot be
    # masked); None when the caller offers no masking (observation masking is then skipped)
    mask: Callable[[Item, str], Item | None] | None = None
    working_memory_results: int = 0  # tool results in the working memory (never masked; they count as recent)

    @cached_property
    def chain(self) -> list[str]:
        """chain[i] is a stable hash of turns[0..i] (computed on first use: only the summary cache needs it)."""
        return self.chain_fn()

    async def chain_hashes(self) -> list[str]:
        """``chain``, computed in a worker thread for a large conversation (the first time digests every item)."""
        if "chain" not in self.__dict__ and self.offload:
            self.__dict__["chain"] = await asyncio.to_thread(self.chain_fn)
        return self.chain

    _suffix_tokens: list[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # _suffix_tokens[i] = sum(turn_tokens[i:]), so a plugin may try every cut point in linear time
        self._suffix_tokens = list(accumulate(reversed(self.turn_tokens), initial=0))
        self._suffix_tokens.reverse()

    def payload_tokens(self, start: int = 0, extra: int = 0) -> int:
        """Tokens of the request if it kept turns[start:] plus ``extra`` (a summary); O(1) after the first call."""
        n = len(self.turn_tokens)
        start = min(start, n) if start >= 0 else max(0, n + start)  # as turn_tokens[start:] reads it
        return self.pinned_tokens + extra + self._suffix_tokens[start]


@dataclass
class HistoryResult:
    """What ``manage_history`` returns."""

    turns: list[list[Item]]
    summary: Item | None = None
    turns_summarised: int = 0
    turns_dropped: int = 0
    summary_status: str = "none"
    removed: dict[str, int] = field(default_factory=dict)
    detail: dict[str, Any] = field(default_factory=dict)  # for explain: what was (or would be) summarised
    masked: list[dict[str, Any]] = field(default_factory=list)  # for explain: {call_id, tool, tokens_removed}
    waited: float | None = None  # seconds the request waited for a summariser (None: it did not wait)
    background: str = ""  # a summary asked for in the background: started | skipped | busy | backoff

    @classmethod
    def unchanged(cls, view: HistoryView) -> HistoryResult:
        return cls(turns=view.turns)


class ContextManager(ABC):
    """A context-manager plugin (registry type ``context_manager``)."""

    name: ClassVar[str]
    Params: ClassVar[type[PluginParams]]

    def __init__(self, params: PluginParams, summarizer: Summarizer | None = None) -> None:
        self.params = params
        self.summarizer = summarizer

    @abstractmethod
    async def manage_history(self, view: HistoryView) -> HistoryResult:
        """Return the history to send for this request."""

    def look_ahead_point(self, budget: Budget) -> int | None:
        """The payload from which a request under T should call ``look_ahead`` (None: never)."""
        return None

    async def look_ahead(self, view: HistoryView) -> str:
        """A request under T whose payload reached ``look_ahead_point``: start, in the background, what a later
        request will need, and return at once what was done (``HistoryResult.background``; "": nothing)."""
        return ""

    @property
    def hysteresis_ratio(self) -> float:
        return float(getattr(self.params, "hysteresis_ratio", 0.1))

    @property
    def summary_threshold(self) -> int:
        return int(getattr(self.params, "summary_threshold", 0))

    @property
    def working_memory_messages(self) -> int | None:
        value = getattr(self.params, "working_memory_messages", None)
        return int(value) if value is not None else None

    @property
    def trimmer(self) -> TrimmerParams | None:
        return getattr(self.params, "trimmer", None)


class Summarizer(ABC):
    """A summariser plugin (registry type ``summarizer``); only bound on ``summarising``."""

    name: ClassVar[str]
    Params: ClassVar[type[PluginParams]]

    def __init__(self, params: PluginParams) -> None:
        self.params = params

    def settings_id(self, services: Services) -> str:
        """Identifies what the summary depends on besides the turns (model, instructions, prompt version)."""
        return self.name

    def bind(self, services: Services) -> SummarizeFn | None:
        """A summarise function for this request, or None to drop older turns instead."""
        return None


def window(view: HistoryView, keep: int, step: int | None) -> HistoryResult:
    """The last ``keep`` turns (at least), older ones dropped ``step`` turns at a time (default ⌈keep/2⌉)."""
    cut = keep_at_least(len(view.turns), keep, step or max(1, -(-max(keep, 1) // 2)))
    if cut == 0:
        return HistoryResult.unchanged(view)
    return HistoryResult(turns=view.turns[cut:], turns_dropped=cut, removed={"windowed": sum(view.turn_tokens[:cut])})


def keep_at_least(turns: int, keep: int, step: int) -> int:
    """How many leading turns to drop so that at least ``keep`` remain, moving only in whole ``step`` s.

    The cut is ``turns - keep`` rounded down to a multiple of ``step`` counted from the
    start of the conversation, so between ``keep`` and ``keep + step - 1`` turns are kept and
    the forwarded prefix changes once every ``step`` new turns, not on every turn.
    """
    if turns <= keep:
        return 0
    step = max(1, step)
    return (turns - keep) // step * step


def stable_cut(excess: int, step: int, limit: int) -> int:
    """How many leading items to cut: ``excess`` rounded up to a multiple of ``step`` (at most ``limit``).

    Cutting on a fixed grid counted from the start of the conversation keeps the
    forwarded prefix identical between consecutive requests until the next grid
    line is crossed, so providers' prompt caches keep hitting.
    """
    if excess <= 0:
        return 0
    step = max(1, step)
    return min(limit, -(-excess // step) * step)
