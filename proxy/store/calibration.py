"""Token-count calibration: the provider's input count over ctxproxy's, learned per tenant and (upstream, model).

ctxproxy counts with tiktoken: exact for OpenAI's models, an estimate for every other tokenizer. Each
answer that reports usage says how many input tokens the *provider* counted for the payload ctxproxy
forwarded; their ratio to ctxproxy's own count of that payload (``Report.tokens_after``, fixed tokens
included) is one sample. The factor is applied to the budget (``compute_budget`` divides B by it), so
the forwarded payload fits the window as the provider counts it.

How the factor is kept (the design choices, each for a reason):

- **A conservative bound that tightens at once and loosens slowly**, not a median or a mean: the factor
  is the top of an *envelope* of the last ``WINDOW`` samples (``envelope``), in which every sample keeps
  its full weight until ``HOLD`` newer samples have arrived and then loses ``1 - STEP`` (10 %) of it for
  every ``HOLD`` more; the family default is the oldest sample of all. A ratio above the factor in use
  raises it with the very next request (a payload that the provider counts higher than the proxy did is
  the one that overflows); a lower one lowers it only after ``HOLD`` consistent samples, and by at most
  10 % every ``HOLD`` samples, never below the last ``HOLD`` ratios. The price: one odd request the
  provider counts high (an image it prices differently) narrows the budget at once, for about fifteen
  requests when it was 1.5 times the usual ratio. A factor learned on one mix of
  content (a 15k-token tool list the provider counts at half the proxy's count) therefore cannot widen
  the budget for the next mix (text, counted at 1.3x) faster than the evidence; the median of the samples
  did, and put a text-heavy payload 35 % over B. ``spread`` (the highest recent ratio less the lowest)
  is kept and shown beside the factor. docs/cost.md#calibration compares this with calibrating tool schemas
  and messages apart, on two runs.
- **Samples are filtered, then clamped.** Not a sample: no usage, a provider count of 0, a forwarded
  payload under ``MIN_SAMPLE_TOKENS`` (fixed per-request overheads dominate small requests), a request
  whose provider count includes input ctxproxy cannot see (``hidden_input``: Responses
  ``previous_response_id``/``conversation``/``prompt``, server-side tools), or a ratio outside
  ``PLAUSIBLE`` (no tokenizer is 3x another on the same text: the provider counted something else).
  A plausible ratio is clamped to [``MIN_FACTOR``, ``MAX_FACTOR``].
- **Learned after ``MIN_SAMPLES`` samples**: from then on the tenant's own envelope alone sets its factor;
  before, the highest of the family default (``family_default``), the tenant's first samples and the
  pooled factor (below).
- **A published factor, rounded up to 0.01, with a dead band for loosening**: the factor in use rises to
  the envelope at once and falls only when the envelope is ``DEADBAND`` or more below it. Budgets (and the
  trimmer's prefix-stable grid, which is a function of B) do not jitter from request to request, and
  every replica publishes the same value.
- **Shared through the cache backend** (``Cache.get/set``, one JSON object per key), so replicas and
  restarts share it: a replica merges its own new samples with the stored ones (by origin and time) and
  writes the result back in the background; concurrent writers can lose a few samples (a lost high one
  comes back with the next answer of the same mix).
- **Read through an in-process table**: the request path reads a dict (``factor``); a key seen for the
  first time is loaded once (``load``, awaited), and an entry older than ``REFRESH_SECONDS`` is refreshed
  in the background while the current value keeps serving. The table is a bounded LRU (model names can
  come from clients).
- **Per tenant, and shared evidence only tightens.** A tenant's traffic (images, documents, languages)
  moves the ratio, so each tenant learns its own factor (the key includes the tenant; without tenants
  configured it is ``default``). Every sample also joins a pooled record of all tenants (``POOLED``),
  which a tenant without a learned factor of its own uses only above the family default: evidence from
  other tenants can make a budget smaller, never larger. A factor below the default comes only from the
  tenant's own samples, so no tenant can widen another's budget or cap.
- **A refusal for length is evidence** (``proxy.core.refusal``): the provider counted more than its
  window, so the ratio is at least window / ctxproxy's count of the payload (exactly the provider's stated
  count / ctxproxy's, when the message states it). It is a sample like any other, and as the newest it
  sets the factor from the next request on (``proxy.serve.overflow`` re-assembles the refused request
  with it at once).
- **The provider's real window** (``proxy.store.windows``), learned from its refusals, is kept in the
  pooled record of (upstream, model) and shared and persisted with it; ``window`` reads it.

Per model, the config may pin the factor or switch calibration off (``models[].calibration``); the
config's view is ``ConfiguredCalibration``, which the runtime uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import operator
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from proxy.core.deadline import deadline
from proxy.core.errors import CacheBackendError
from proxy.store.cache import Cache, SafeCache
from proxy.store.windows import LearnedWindow, from_record
from proxy.store.windows import merged as merged_window

if TYPE_CHECKING:
    from proxy.policy import ModelRoute
    from proxy.settings import Config

log = logging.getLogger("ctxproxy.calibration")

MIN_FACTOR, MAX_FACTOR = 0.5, 2.0
PLAUSIBLE = (1 / 3, 3.0)
MIN_SAMPLE_TOKENS = 256
MIN_SAMPLES = 3
WINDOW = 32
HOLD = 3  # samples a ratio keeps its full weight for, and then between two of its steps down
STEP = 0.9  # what a ratio keeps of its weight at each step down
QUANTUM = 0.01
DEADBAND = 0.02
REFRESH_SECONDS = 30.0
# how long a changed record waits before it is written to the shared cache: the samples of that time make one write
# (a write an answer read and wrote both records through the cache: 1.45 M instructions an agent_long request,
# more than the rest of the request; docs/benchmarks.md, eleventh stop). ``flush`` writes at once.
WRITE_DELAY = 2.0
TTL_SECONDS = 30 * 24 * 3600.0
LOCAL_ENTRIES = 1024
KEY_PREFIX = "calib:v1:"
TENANT_KEY_PREFIX = "calib:v1:t:"
POOLED = "*"  # the tenant of the pooled record (tenant names are [A-Za-z0-9_.-]+: no collision)

# The default of a model never seen, by family (matched on the upstream model name, provider prefix
# dropped). OpenAI's own models are counted with their exact encoding: 1.0. The others are set a little
# above what is known of their tokenizers against o200k, so that a first request errs on the safe side
# (a smaller budget) until the provider's own counts take over:
#  - a field run against a real server (SmolLM2, 49k vocabulary, via llama.cpp's server; bench/real_server.py)
#    measured 1.07-1.16, rising with the share of JSON tool output: small-vocabulary tokenizers default to
#    1.20, the top of that range plus the chat template's per-message tokens.
#  - Claude (Anthropic publishes no tokenizer; its count for the same English/code text runs ~10-25 %
#    above o200k, and tool use adds a hidden system prompt): 1.20.
#  - Mistral/Mixtral/Codestral (32k SentencePiece vocabularies; Tekken's 131k for the newest): 1.20.
#  - Gemini/Gemma (256k SentencePiece), Llama 3 (128k BPE), Qwen (151k BPE), DeepSeek (100k-128k BPE):
#    large vocabularies close to o200k on English, a few per cent more on code and JSON, plus the chat
#    template: 1.15.
#  - An unknown name: 1.0. There is no evidence either way, the safety margin (10 % of the window)
#    covers the first requests, and the provider's counts take over after MIN_SAMPLES answers.
FAMILY_DEFAULTS: tuple[tuple[str, str, float], ...] = (
    ("claude", r"claude", 1.20),
    ("mistral", r"mistral|mixtral|codestral|ministral|pixtral|magistral|devstral", 1.20),
    ("small-vocabulary", r"smollm|phi-?[1-3]\b|tinyllama|llama-?2|vicuna|falcon", 1.20),
    ("gemini", r"gemini|gemma", 1.15),
    ("llama", r"llama", 1.15),
    ("qwen", r"qwen|qwq", 1.15),
    ("deepseek", r"deepseek", 1.15),
    ("other-open", r"command-r|cohere|grok|glm|yi-|olmo|granite|nemotron|phi", 1.15),
)
_FAMILIES = tuple((name, re.compile(pattern), factor) for name, pattern, factor in FAMILY_DEFAULTS)

# Body fields whose presence means the provider counts input the request does not carry.
HIDDEN_FIELDS = ("previous_response_id", "conversation", "prompt", "mcp_servers", "container")
CLIENT_TOOL_TYPES = frozenset({"function", "custom"})


def family_default(upstream_model: str) -> tuple[str, float]:
    """The family of a model and the factor it starts from (see ``FAMILY_DEFAULTS``)."""
    name = upstream_model.rsplit("/", 1)[-1].lower()
    if _openai(name):
        return "openai", 1.0
    for family, pattern, factor in _FAMILIES:
        if pattern.search(name):
            return family, factor
    return "unknown", 1.0


def _openai(name: str) -> bool:
    import tiktoken

    try:
        tiktoken.encoding_name_for_model(name)
    except KeyError:
        return False
    return True


def hidden_input(body: Mapping[str, Any] | None) -> str | None:
    """Why the provider's input count of this body includes tokens ctxproxy cannot see, or None.

    Provider-held state (Responses ``previous_response_id``, ``conversation``, a stored ``prompt``;
    Anthropic's ``container``/``mcp_servers``) and server-side or built-in tools (any tool whose type is
    not a plain function: web search, file search, code execution, computer use, ...: the provider adds
    their definitions and results itself). Such a request is not a calibration sample.
    """
    if type(body) is not dict and not isinstance(body, Mapping):  # (a dict: no ABC check)
        return None
    for key in HIDDEN_FIELDS:
        if body.get(key):
            return key
    tools = body.get("tools")
    if isinstance(tools, list):
        for tool in tools:
            kind = tool.get("type") if type(tool) is dict or isinstance(tool, Mapping) else None
            if isinstance(kind, str) and kind not in CLIENT_TOOL_TYPES:
                return "server_tools"
    return None


@dataclass(frozen=True)
class Sample:
    """What one answer taught: ``result`` is ``used`` or why it was not a sample (a bounded label)."""

    result: str
    ratio: float | None = None


SAMPLE_RESULTS = frozenset({"used", "refused", "no_usage", "zero", "small", "hidden_input", "implausible"})


def sample_of(provider_tokens: int | None, proxy_tokens: int, hidden: str | None = None) -> Sample:
    """Whether (provider count, proxy count) of one forwarded payload is a calibration sample."""
    if provider_tokens is None:
        return Sample("no_usage")
    if provider_tokens <= 0:
        return Sample("zero")
    if hidden is not None:
        return Sample("hidden_input")
    if proxy_tokens < MIN_SAMPLE_TOKENS:
        return Sample("small")
    ratio = provider_tokens / proxy_tokens
    if not PLAUSIBLE[0] <= ratio <= PLAUSIBLE[1]:
        return Sample("implausible", ratio)
    return Sample("used", min(MAX_FACTOR, max(MIN_FACTOR, ratio)))


def refusal_sample(provider_tokens: int | None, limit: int, proxy_tokens: int, hidden: str | None = None) -> Sample:
    """A refusal for length as a sample: the provider's stated count over ctxproxy's, or the bound limit over
    ctxproxy's."""
    if hidden is not None:
        return Sample("hidden_input")
    if proxy_tokens < MIN_SAMPLE_TOKENS:
        return Sample("small")
    ratio = (provider_tokens if provider_tokens is not None else limit) / proxy_tokens
    if not PLAUSIBLE[0] <= ratio <= PLAUSIBLE[1]:
        return Sample("implausible", ratio)
    ratio = math.ceil(round(ratio / QUANTUM, 6)) * QUANTUM  # a lower bound: rounded up, never below it
    return Sample("refused", round(min(MAX_FACTOR, max(MIN_FACTOR, ratio)), 2))


def envelope(ratios: list[float], default: float) -> float:
    """The conservative bound on recent ratios (oldest first) that a budget uses, the default the oldest of all.

    Each ratio counts at its full value until ``HOLD`` newer ones have arrived, then at ``STEP`` of it for
    every ``HOLD`` more; the bound is the highest of them. A new high raises it at once; lower ratios bring it
    down only as they accumulate: by at most ``1 - STEP`` every ``HOLD`` samples, and never below themselves.
    """
    n = len(ratios)
    if n >= len(_WEIGHTS):  # (more than a record keeps: not on an answer's path)
        top = default * STEP ** (n // HOLD)
        for i, ratio in enumerate(ratios):
            top = max(top, ratio * STEP ** ((n - 1 - i) // HOLD))
        return top
    # the same products, each weight made once: the newest ratio is 0 samples old, the oldest n - 1
    products: tuple[float, ...] = (default * _WEIGHTS[n], *map(operator.mul, ratios, _WEIGHTS[n - 1::-1] if n else ()))
    return max(products)


_WEIGHTS = tuple(STEP ** (age // HOLD) for age in range(4 * WINDOW + 1))  # a ratio's weight by its age in samples


def publish(bound: float, current: float | None) -> float:
    """The factor to use: ``bound`` rounded up to 0.01 when it is above ``current`` (tighten at once), or when it
    is ``DEADBAND`` or more below it (loosen); ``current`` otherwise."""
    bound = min(MAX_FACTOR, max(MIN_FACTOR, bound))
    rounded = round(math.ceil(round(bound / QUANTUM, 6)) * QUANTUM, 2)
    if current is None or rounded > current or current - bound >= DEADBAND:
        return rounded
    return current


def _choose(default: float, learned: float | None, samples: int, shared: float | None) -> tuple[float, str]:
    """A tenant's factor and its source, from its family's default, its own samples and the pooled factor."""
    if learned is not None and samples >= MIN_SAMPLES:
        return learned, "learned"
    # until its own samples rule, a tenant's factor is the highest of the default, its first samples and the
    # pool: other tenants' evidence can tighten its budget, never widen it
    if shared is not None and shared > max(default, learned or 0.0):
        return shared, "shared"
    if learned is not None and learned > default:
        return learned, "learned"
    return default, "default"


def spread(ratios: list[float]) -> float | None:
    """How far apart the recent ratios are (the highest less the lowest; None below two)."""
    return round(max(ratios) - min(ratios), 2) if len(ratios) >= 2 else None


@dataclass(frozen=True)
class Calibrated:
    """A tenant's factor and where it comes from, for explain, policy and the gauge: ``learned`` (its own
    samples), ``shared`` (the pooled factor of all tenants, above the default) or ``default``."""

    factor: float
    source: str
    samples: int  # the tenant's own
    family: str
    default: float
    learned: float | None  # the factor of the tenant's own samples (None: none yet)
    shared: float | None = None  # the pooled learned factor of all tenants (None: not enough samples)
    spread: float | None = None  # the tenant's recent ratios: the highest less the lowest


Key = tuple[str, str, str]  # (tenant, upstream, upstream model)


class _Mark(NamedTuple):
    """What identifies a shared record: its write's sequence number (each write the one it read plus one; None in
    records of earlier versions) and writer (a process's ``origin``), its factor and time."""

    seq: int | None
    writer: Any
    factor: Any
    updated: Any


@dataclass
class _Entry:
    tenant: str
    upstream: str
    model: str
    family: str
    default: float
    samples: list[tuple[float, float, str]] = field(default_factory=list)  # (ratio, unix time, origin)
    published: float | None = None  # the factor of these samples (None: no sample yet)
    window: LearnedWindow | None = None  # the provider's real window (the pooled record of a model only)
    loaded: float = -math.inf  # monotonic time of the last read from the cache
    dirty: bool = False
    synced: _Mark | None = None  # the newest shared record this entry merged or wrote

    @property
    def learned(self) -> float | None:
        return self.published if len(self.samples) >= MIN_SAMPLES else None

    @property
    def ratios(self) -> list[float]:
        return [ratio for ratio, _, _ in self.samples]

    def recompute(self, stored: float | None = None) -> None:
        if not self.samples:
            self.published = None
            return
        self.published = publish(envelope(self.ratios, self.default),
                                 stored if stored is not None else self.published)


FactorHook = Callable[[str, str, str, float], None]  # (tenant, upstream, upstream model, factor in effect)


class CalibrationStore:
    """The learned factors of this process, backed by the shared cache (one per app: ``Shared.calibration``)."""

    def __init__(
        self,
        cache: Cache | SafeCache,
        *,
        refresh: float = REFRESH_SECONDS,
        ttl: float = TTL_SECONDS,
        on_factor: FactorHook | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        max_entries: int = LOCAL_ENTRIES,
        write_delay: float = WRITE_DELAY,
    ) -> None:
        self.cache = cache
        self.refresh = refresh
        self.ttl = ttl
        self.on_factor = on_factor
        self.clock = clock
        self.monotonic = monotonic
        self.max_entries = max_entries
        self.write_delay = write_delay
        self._hurry: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None  # set while ``flush`` waits
        self._evicted: dict[Key, _Entry] = {}  # entries the LRU let go with samples their pending write must carry
        self.origin = uuid.uuid4().hex[:12]  # this process, in the samples it contributes
        self._entries: OrderedDict[Key, _Entry] = OrderedDict()
        self._by_model: dict[tuple[str, str], set[str]] = {}  # (upstream, model) -> the tenants of its entries
        self._loads: dict[Key, asyncio.Task[None]] = {}
        self._writes: dict[Key, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    # -- the request path ------------------------------------------------------------------------

    def get(self, tenant: str, upstream: str, model: str) -> Calibrated:
        """The factor in effect for a tenant on (upstream, model), and why: two dict lookups."""
        own = self._entries.get((tenant, upstream, model))
        pooled = self._entries.get((POOLED, upstream, model))
        family, default = (own.family, own.default) if own is not None else family_default(model)
        learned = own.published if own is not None else None
        shared = pooled.learned if pooled is not None else None
        samples = len(own.samples) if own is not None else 0
        factor, source = _choose(default, learned, samples, shared)
        return Calibrated(factor, source, samples, family, default, learned, shared,
                          spread(own.ratios) if own is not None else None)

    def factor(self, tenant: str, upstream: str, model: str) -> float:
        """``get``'s factor alone (every request's budget needs it; explain the rest)."""
        own = self._entries.get((tenant, upstream, model))
        pooled = self._entries.get((POOLED, upstream, model))
        if own is None:
            return _choose(family_default(model)[1], None, 0, pooled.learned if pooled is not None else None)[0]
        return _choose(own.default, own.published, len(own.samples), pooled.learned if pooled is not None else None)[0]

    async def load(self, tenant: str, upstream: str, model: str) -> None:
        """Make sure the tenant's and the pooled record are known: awaited the first time, refreshed in the
        background after."""
        loading = self.loading(tenant, upstream, model)
        if loading is not None:
            await loading

    def loading(self, tenant: str, upstream: str, model: str) -> Awaitable[object] | None:
        """What to await before the tenant's and the pooled record are known (None: both are; a stale one is
        refreshed in the background)."""
        own = self._load_key((tenant, upstream, model))
        pooled = self._load_key((POOLED, upstream, model))
        if own is None and pooled is None:
            return None
        return asyncio.shield(asyncio.gather(*(task for task in (own, pooled) if task is not None)))

    def _load_key(self, key: Key) -> asyncio.Task[None] | None:
        """Start loading ``key`` if it is unknown or stale; the task to await if it is unknown."""
        entry = self._entries.get(key)
        if entry is not None and self.monotonic() - entry.loaded < self.refresh:
            return None
        task = self._loads.get(key)
        if task is None:
            task = asyncio.ensure_future(self._load(key))
            self._loads[key] = task
            self._track(task)
            task.add_done_callback(lambda _t: self._loads.pop(key, None))
        return task if entry is None else None

    # -- after an answer ---------------------------------------------------------------------------

    def observe(self, tenant: str, upstream: str, model: str, provider_tokens: int | None, proxy_tokens: int,
                hidden: str | None = None) -> Sample:
        """Record one answer's counts for the tenant and the pool; the shared records are updated in the background."""
        sample = sample_of(provider_tokens, proxy_tokens, hidden)
        if sample.result == "used" and sample.ratio is not None:
            self._record(tenant, upstream, model, sample.ratio)
        return sample

    def refused(self, tenant: str, upstream: str, model: str, provider_tokens: int | None, limit: int,
                proxy_tokens: int, hidden: str | None = None) -> Sample:
        """Record a refusal for length: its ratio is the newest sample, so the factor is at least that from now on."""
        sample = refusal_sample(provider_tokens, limit, proxy_tokens, hidden)
        if sample.result == "refused" and sample.ratio is not None:
            self._record(tenant, upstream, model, sample.ratio)
        return sample

    def window(self, upstream: str, model: str, configured: int) -> int | None:
        """The provider's real window for (upstream, model) where it narrows ``configured`` (None: it does not)."""
        pooled = self._entries.get((POOLED, upstream, model))
        found = pooled.window if pooled is not None else None
        return found.limit if found is not None and found.serves(configured, self.clock()) else None

    def learn_window(self, upstream: str, model: str, limit: int, configured: int, source: str) -> int:
        """Remember the provider's real window for (upstream, model) (shared in the background); the window now
        in effect for a route configured with ``configured``."""
        entry = self._entry((POOLED, upstream, model))
        learned = LearnedWindow(max(1, limit), configured, source, self.clock())
        current = entry.window if entry.window is not None and entry.window.serves(configured, learned.at) else None
        entry.window = merged_window(current, learned)
        entry.dirty = True
        self._schedule_write((POOLED, upstream, model))
        return min(configured, entry.window.limit) if entry.window is not None else configured

    def _record(self, tenant: str, upstream: str, model: str, ratio: float) -> None:
        before = self._before(upstream, model)
        for key in ((tenant, upstream, model), (POOLED, upstream, model)):
            entry = self._entry(key)
            now = self.clock()
            entry.samples.append((ratio, now, self.origin))
            del entry.samples[:-WINDOW]
            entry.recompute()
            entry.dirty = True
            self._schedule_write(key)
        self._changed(upstream, model, before)

    def entries(self) -> list[tuple[str, str, str, Calibrated]]:
        """Every tenant's factor known here (the pooled records aside)."""
        return [(e.tenant, e.upstream, e.model, self.get(e.tenant, e.upstream, e.model))
                for e in list(self._entries.values()) if e.tenant != POOLED]

    async def flush(self) -> None:
        """Write what is pending now, and wait for the pending loads and writes (tests, shutdown)."""
        hurry = self._hurry_event()
        hurry.set()
        try:
            while self._tasks:
                await asyncio.gather(*list(self._tasks), return_exceptions=True)
        finally:
            hurry.clear()

    async def close(self) -> None:
        pending = [*self._entries.items(), *self._evicted.items()]
        for key in [k for k, e in pending if e.dirty and k not in self._writes]:
            self._schedule_write(key)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.flush(), timeout=2.0)

    # -- internals ---------------------------------------------------------------------------------

    def _entry(self, key: Key) -> _Entry:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._evicted.pop(key, None)  # its samples, not yet written: not lost
            if entry is None:
                family, default = family_default(key[2])
                entry = _Entry(*key, family, default)
            self._entries[key] = entry
            if key[0] != POOLED:
                self._by_model.setdefault((key[1], key[2]), set()).add(key[0])
            while len(self._entries) > self.max_entries:
                (tenant, upstream, model), old = self._entries.popitem(last=False)
                if old.dirty and (tenant, upstream, model) in self._writes:
                    self._evicted[(tenant, upstream, model)] = old  # its write, waiting, takes it back
                known = self._by_model.get((upstream, model))
                if known is not None:
                    known.discard(tenant)
                    if not known:
                        del self._by_model[(upstream, model)]
        self._entries.move_to_end(key)
        return entry

    def _hurry_event(self) -> asyncio.Event:
        """The event ``flush`` sets, of the running loop (a store may outlive a loop: tests, tools)."""
        loop = asyncio.get_running_loop()
        if self._hurry is None or self._hurry[0] is not loop:
            self._hurry = (loop, asyncio.Event())
        return self._hurry[1]

    def _track(self, task: asyncio.Task[None]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _tenants_of(self, upstream: str, model: str) -> set[str]:
        """The tenants known here for (upstream, model): the factors a change of the pooled record can move."""
        return set(self._by_model.get((upstream, model), ()))

    def _changed(self, upstream: str, model: str, before: dict[str, float]) -> None:
        """Tell the hook of every tenant factor that moved (a new tenant's first factor included)."""
        if self.on_factor is None:
            return
        for tenant in self._tenants_of(upstream, model):
            after = self.factor(tenant, upstream, model)
            if before.get(tenant) != after:
                try:
                    self.on_factor(tenant, upstream, model, after)
                except Exception:
                    log.exception("calibration factor hook failed")

    def _before(self, upstream: str, model: str) -> dict[str, float]:
        return {t: self.factor(t, upstream, model) for t in self._tenants_of(upstream, model)}

    async def _load(self, key: Key) -> None:
        try:
            stored = await self.cache.get(cache_key(*key))
        except (CacheBackendError, OSError) as exc:  # a bare backend (SafeCache already swallows): serve what is known
            log.debug("calibration read failed: %s", exc)
            stored = None
        before = self._before(key[1], key[2])
        entry = self._entry(key)
        entry.loaded = self.monotonic()
        self._merge(entry, stored)
        self._changed(key[1], key[2], before)

    def _merge(self, entry: _Entry, stored: dict[str, Any] | None) -> None:
        if not isinstance(stored, dict) or stored.get("upstream") != entry.upstream \
                or stored.get("model") != entry.model or stored.get("tenant", POOLED) != entry.tenant:
            return  # missing, unreadable, or (a hash collision) another key's record
        theirs = _samples(stored.get("samples"))
        seen = {(origin, t) for _, t, origin in entry.samples}
        merged = entry.samples + [s for s in theirs if (s[2], s[1]) not in seen]
        merged.sort(key=lambda s: s[1])
        entry.samples = merged[-WINDOW:]
        if entry.tenant == POOLED:
            entry.window = merged_window(entry.window, from_record(stored.get("window")))
        factor = stored.get("factor")
        current = float(factor) if isinstance(factor, (int, float)) and not isinstance(factor, bool) \
            and MIN_FACTOR <= factor <= MAX_FACTOR else None
        # the record's factor is another writer's only when the record is newer than any this entry merged or
        # wrote: its own (written up to ``write_delay`` ago, or read while its own write was on its way) is older
        # than what it has published since
        mark = _mark(stored)
        newer = _newer(mark, entry.synced, self.origin)
        if newer:
            entry.synced = mark
        entry.recompute(current if newer else None)

    def _schedule_write(self, key: Key) -> None:
        if key in self._writes:
            return  # the pending write will carry this sample too (it reads the entry when it runs)
        task = asyncio.ensure_future(self._write(key))
        self._writes[key] = task
        self._track(task)
        task.add_done_callback(lambda t: self._writes.pop(key) if self._writes.get(key) is t else None)

    async def _write(self, key: Key) -> None:
        try:
            # a sample that arrives while the record is on its way (after it was built) finds this write still
            # pending and does not start another: this one writes again for it
            while True:
                await self._store(key)
                entry = self._entries.get(key) or self._evicted.get(key)
                if entry is None or not entry.dirty:
                    break
        except (CacheBackendError, OSError) as exc:
            # a bare backend (SafeCache already swallows): the samples stay local
            log.debug("calibration write failed: %s", exc)
        finally:
            if self._writes.get(key) is asyncio.current_task():
                del self._writes[key]  # now: a sample or an eviction of the next loop turn sees no write pending
            self._evicted.pop(key, None)

    async def _store(self, key: Key) -> None:
        # the samples of the next ``write_delay`` seconds join the write (unless ``flush`` wants it now)
        hurry = self._hurry_event()
        if self.write_delay > 0 and not hurry.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                async with deadline(self.write_delay):
                    await hurry.wait()
        else:
            await asyncio.sleep(0)  # the samples of this loop iteration
        stored = await self.cache.get(cache_key(*key))
        before = self._before(key[1], key[2])
        entry = self._entry(key)
        self._merge(entry, stored)
        entry.loaded = self.monotonic()
        entry.dirty = False
        record: dict[str, Any] = {"upstream": entry.upstream, "model": entry.model, "factor": entry.published,
                                  "samples": [[r, t, o] for r, t, o in entry.samples], "updated": self.clock()}
        record["seq"] = ((_mark(stored).seq if isinstance(stored, dict) else None) or 0) + 1  # the record it follows
        record["writer"] = self.origin
        if entry.tenant != POOLED:
            record["tenant"] = entry.tenant
        elif entry.window is not None:
            record["window"] = entry.window.as_record()
        entry.synced = _Mark(record["seq"], self.origin, record["factor"], record["updated"])
        await self.cache.set(cache_key(*key), record, self.ttl)
        self._changed(key[1], key[2], before)


def cache_key(tenant: str, upstream: str, model: str) -> str:
    """The shared record of a tenant's samples; the pooled record keeps the key of the per-model records of
    earlier versions (they were pooled over all tenants too, so they serve as such)."""
    if tenant == POOLED:
        return KEY_PREFIX + hashlib.sha256(f"{upstream}\x00{model}".encode()).hexdigest()[:40]
    return TENANT_KEY_PREFIX + hashlib.sha256(f"{tenant}\x00{upstream}\x00{model}".encode()).hexdigest()[:40]


def _mark(stored: dict[str, Any]) -> _Mark:
    seq = stored.get("seq")
    seq = seq if isinstance(seq, int) and not isinstance(seq, bool) and seq >= 0 else None
    return _Mark(seq, stored.get("writer"), stored.get("factor"), stored.get("updated"))


def _newer(mark: _Mark, synced: _Mark | None, origin: str) -> bool:
    """Whether a record (``mark``) holds another writer's newer factor than the one this entry last synced."""
    if synced is None:
        return True  # nothing known of it: the record is all there is
    if mark.writer == origin:
        return False  # its own, however late it was read: older than what it has published since
    if mark.seq is None or synced.seq is None:  # a record of a version without ``seq``
        return (mark.factor, mark.updated) != (synced.factor, synced.updated)
    return mark.seq > synced.seq or (mark.seq == synced.seq and mark.writer != synced.writer)


def _samples(raw: Any) -> list[tuple[float, float, str]]:
    """Stored samples, each checked: a shared record is data from another process, maybe another version."""
    out: list[tuple[float, float, str]] = []
    if not isinstance(raw, list):
        return out
    for item in raw[-WINDOW * 4:]:
        if not (isinstance(item, list) and len(item) == 3):
            continue
        ratio, t, origin = item
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not MIN_FACTOR <= ratio <= MAX_FACTOR:
            continue
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
            continue
        if not isinstance(origin, str) or len(origin) > 64:
            continue
        out.append((float(ratio), float(t), origin))
    return out


@dataclass(frozen=True)
class Effective:
    """The factor a tenant's budget uses on a route, and why: ``learned``, ``shared``, ``default``, ``pinned``
    or ``off``."""

    factor: float
    source: str
    calibrated: Calibrated
    tenant: str
    upstream: str
    upstream_model: str
    provider_window: int | None = None  # the provider's real window, learned from its refusals (None: none known)

    def describe(self) -> dict[str, Any]:
        c = self.calibrated
        return {"factor": self.factor, "source": self.source, "tenant": self.tenant, "upstream": self.upstream,
                "upstream_model": self.upstream_model, "family": c.family, "family_default": c.default,
                "learned": c.learned, "samples": c.samples, "shared": c.shared, "spread": c.spread,
                "provider_window": self.provider_window}


class ConfiguredCalibration:
    """``proxy.runtime.Calibration`` for one config: ``models[].calibration`` over the shared store."""

    def __init__(self, store: CalibrationStore, config: Config) -> None:
        self.store = store
        self._modes: dict[str, str | float] = {m.name: m.calibration for m in config.settings.models}

    def mode(self, route: ModelRoute) -> str | float:
        return self._modes.get(route.name, "auto")

    def factor(self, route: ModelRoute, tenant: str) -> float:
        mode = self._modes.get(route.name, "auto")
        if mode == "auto":
            return self.store.factor(tenant, route.upstream, route.upstream_model)
        return 1.0 if mode == "off" else float(mode)

    def prime(self, route: ModelRoute, tenant: str) -> Awaitable[object] | None:
        """What to await to know the tenant's factor and the route's learned window, whatever the mode: a pinned
        factor does not make the provider's window any larger (None: both are known)."""
        return self.store.loading(tenant, route.upstream, route.upstream_model)

    def window(self, route: ModelRoute) -> int | None:
        """The provider's real window where it is narrower than the route's (learned from its refusals)."""
        return self.store.window(route.upstream, route.upstream_model, route.window)

    def effective(self, route: ModelRoute, tenant: str) -> Effective:
        mode = self.mode(route)
        calibrated = self.store.get(tenant, route.upstream, route.upstream_model)
        if mode == "auto":
            factor, source = calibrated.factor, calibrated.source
        elif mode == "off":
            factor, source = 1.0, "off"
        else:
            factor, source = float(mode), "pinned"
        return Effective(factor, source, calibrated, tenant, route.upstream, route.upstream_model, self.window(route))
