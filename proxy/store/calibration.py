"""Token-count calibration: the provider's input count over ctxproxy's, learned per (upstream, upstream model).

ctxproxy counts with tiktoken: exact for OpenAI's models, an estimate for every other tokenizer. Each
answer that reports usage says how many input tokens the *provider* counted for the payload ctxproxy
forwarded; their ratio to ctxproxy's own count of that payload (``Report.tokens_after``, fixed tokens
included) is one sample. The factor is applied to the budget (``compute_budget`` divides B by it), so
the forwarded payload fits the window as the provider counts it.

How the factor is kept (the design choices, each for a reason):

- **A windowed median**, not an EWMA: the last ``WINDOW`` samples, so one odd request (a provider that
  added a hidden system prompt, an image priced differently) moves nothing, and a real change (a new
  tokenizer behind the same name) takes over after ``WINDOW / 2`` requests.
- **Samples are filtered, then clamped.** Not a sample: no usage, a provider count of 0, a forwarded
  payload under ``MIN_SAMPLE_TOKENS`` (fixed per-request overheads dominate small requests), a request
  whose provider count includes input ctxproxy cannot see (``hidden_input``: Responses
  ``previous_response_id``/``conversation``/``prompt``, server-side tools), or a ratio outside
  ``PLAUSIBLE`` (no tokenizer is 3x another on the same text: the provider counted something else).
  A plausible ratio is clamped to [``MIN_FACTOR``, ``MAX_FACTOR``].
- **Learned only after ``MIN_SAMPLES`` samples**; until then the family default applies
  (``family_default``).
- **A published factor with a dead band**: the factor in use moves only when the median differs from it
  by ``DEADBAND`` or more, and is rounded to 0.01. Budgets (and the trimmer's prefix-stable grid, which
  is a function of B) do not jitter from request to request, and every replica publishes the same value.
- **Shared through the cache backend** (``Cache.get/set``, one JSON object per key), so replicas and
  restarts share it: a replica merges its own new samples with the stored ones (by origin and time) and
  writes the result back in the background; concurrent writers can lose a few samples, which a median
  does not notice.
- **Read through an in-process table**: the request path reads a dict (``factor``); a key seen for the
  first time is loaded once (``load``, awaited), and an entry older than ``REFRESH_SECONDS`` is refreshed
  in the background while the current value keeps serving. The table is a bounded LRU (model names can
  come from clients).

Per model, the config may pin the factor or switch calibration off (``models[].calibration``); the
config's view is ``ConfiguredCalibration``, which the runtime uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from proxy.core.errors import CacheBackendError
from proxy.store.cache import Cache, SafeCache

if TYPE_CHECKING:
    from proxy.policy import ModelRoute
    from proxy.settings import Config

log = logging.getLogger("ctxproxy.calibration")

MIN_FACTOR, MAX_FACTOR = 0.5, 2.0
PLAUSIBLE = (1 / 3, 3.0)
MIN_SAMPLE_TOKENS = 256
MIN_SAMPLES = 3
WINDOW = 32
QUANTUM = 0.01
DEADBAND = 0.02
REFRESH_SECONDS = 30.0
TTL_SECONDS = 30 * 24 * 3600.0
LOCAL_ENTRIES = 1024
KEY_PREFIX = "calib:v1:"

# The default of a model never seen, by family (matched on the upstream model name, provider prefix
# dropped). OpenAI's own models are counted with their exact encoding: 1.0. The others are set a little
# above what is known of their tokenizers against o200k, so that a first request errs on the safe side
# (a smaller budget) until the provider's own counts take over:
#  - issue 17's field run (SmolLM2, 49k vocabulary, via llama.cpp's server) measured 1.07-1.16, rising
#    with the share of JSON tool output: small-vocabulary tokenizers default to 1.20, the top of that
#    range plus the chat template's per-message tokens.
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
    if not isinstance(body, Mapping):
        return None
    for key in HIDDEN_FIELDS:
        if body.get(key):
            return key
    tools = body.get("tools")
    if isinstance(tools, list):
        for tool in tools:
            kind = tool.get("type") if isinstance(tool, Mapping) else None
            if isinstance(kind, str) and kind not in CLIENT_TOOL_TYPES:
                return "server_tools"
    return None


@dataclass(frozen=True)
class Sample:
    """What one answer taught: ``result`` is ``used`` or why it was not a sample (a bounded label)."""

    result: str
    ratio: float | None = None


SAMPLE_RESULTS = frozenset({"used", "no_usage", "zero", "small", "hidden_input", "implausible"})


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


def publish(median: float, current: float | None) -> float:
    """The factor to use: ``current`` while the median stays within the dead band of it."""
    median = min(MAX_FACTOR, max(MIN_FACTOR, median))
    if current is not None and abs(median - current) < DEADBAND:
        return current
    return round(round(median / QUANTUM) * QUANTUM, 2)


@dataclass(frozen=True)
class Calibrated:
    """A factor and where it comes from (``learned`` or ``default``), for explain, policy and the gauge."""

    factor: float
    source: str
    samples: int
    family: str
    default: float
    learned: float | None  # the published learned factor (None: fewer than MIN_SAMPLES samples)


@dataclass
class _Entry:
    upstream: str
    model: str
    family: str
    default: float
    samples: list[tuple[float, float, str]] = field(default_factory=list)  # (ratio, unix time, origin)
    published: float | None = None
    loaded: float = -math.inf  # monotonic time of the last read from the cache
    dirty: bool = False

    def calibrated(self) -> Calibrated:
        learned = self.published if len(self.samples) >= MIN_SAMPLES else None
        if learned is None:
            return Calibrated(self.default, "default", len(self.samples), self.family, self.default, None)
        return Calibrated(learned, "learned", len(self.samples), self.family, self.default, learned)

    def recompute(self, stored: float | None = None) -> None:
        if len(self.samples) < MIN_SAMPLES:
            self.published = None
            return
        ratios = sorted(ratio for ratio, _, _ in self.samples)
        mid = len(ratios) // 2
        median = ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2
        self.published = publish(median, stored if stored is not None else self.published)


FactorHook = Callable[[str, str, float], None]  # (upstream, upstream model, factor in effect)


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
    ) -> None:
        self.cache = cache
        self.refresh = refresh
        self.ttl = ttl
        self.on_factor = on_factor
        self.clock = clock
        self.monotonic = monotonic
        self.max_entries = max_entries
        self.origin = uuid.uuid4().hex[:12]  # this process, in the samples it contributes
        self._entries: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
        self._loads: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._writes: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    # -- the request path ------------------------------------------------------------------------

    def get(self, upstream: str, model: str) -> Calibrated:
        """The factor in effect for (upstream, model): one dict lookup."""
        entry = self._entries.get((upstream, model))
        if entry is None:
            family, default = family_default(model)
            return Calibrated(default, "default", 0, family, default, None)
        return entry.calibrated()

    def factor(self, upstream: str, model: str) -> float:
        entry = self._entries.get((upstream, model))
        if entry is not None:
            if entry.published is not None and len(entry.samples) >= MIN_SAMPLES:
                return entry.published
            return entry.default
        return family_default(model)[1]

    async def load(self, upstream: str, model: str) -> None:
        """Make sure (upstream, model) is known: awaited the first time, refreshed in the background after."""
        key = (upstream, model)
        entry = self._entries.get(key)
        if entry is not None and self.monotonic() - entry.loaded < self.refresh:
            return
        task = self._loads.get(key)
        if task is None:
            task = asyncio.ensure_future(self._load(key))
            self._loads[key] = task
            self._track(task)
            task.add_done_callback(lambda _t: self._loads.pop(key, None))
        if entry is None:
            await asyncio.shield(task)

    # -- after an answer ---------------------------------------------------------------------------

    def observe(self, upstream: str, model: str, provider_tokens: int | None, proxy_tokens: int,
                hidden: str | None = None) -> Sample:
        """Record one answer's counts; the shared record is updated in the background."""
        sample = sample_of(provider_tokens, proxy_tokens, hidden)
        if sample.result != "used" or sample.ratio is None:
            return sample
        entry = self._entry((upstream, model))
        before = entry.calibrated().factor
        entry.samples.append((sample.ratio, self.clock(), self.origin))
        del entry.samples[:-WINDOW]
        entry.recompute()
        entry.dirty = True
        self._changed(entry, before)
        self._schedule_write((upstream, model))
        return sample

    def entries(self) -> list[tuple[str, str, Calibrated]]:
        return [(e.upstream, e.model, e.calibrated()) for e in self._entries.values()]

    async def flush(self) -> None:
        """Wait for pending loads and writes (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        for key in [k for k, e in self._entries.items() if e.dirty and k not in self._writes]:
            self._schedule_write(key)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.flush(), timeout=2.0)

    # -- internals ---------------------------------------------------------------------------------

    def _entry(self, key: tuple[str, str]) -> _Entry:
        entry = self._entries.get(key)
        if entry is None:
            family, default = family_default(key[1])
            entry = self._entries[key] = _Entry(key[0], key[1], family, default)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        self._entries.move_to_end(key)
        return entry

    def _track(self, task: asyncio.Task[None]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _changed(self, entry: _Entry, before: float | None) -> None:
        after = entry.calibrated().factor
        if self.on_factor is not None and after != before:
            try:
                self.on_factor(entry.upstream, entry.model, after)
            except Exception:
                log.exception("calibration factor hook failed")

    async def _load(self, key: tuple[str, str]) -> None:
        try:
            stored = await self.cache.get(cache_key(*key))
        except (CacheBackendError, OSError) as exc:  # a bare backend (SafeCache already swallows): serve what is known
            log.debug("calibration read failed: %s", exc)
            stored = None
        existed = key in self._entries
        entry = self._entry(key)
        before = entry.calibrated().factor if existed else None
        entry.loaded = self.monotonic()
        self._merge(entry, stored)
        self._changed(entry, before)

    def _merge(self, entry: _Entry, stored: dict[str, Any] | None) -> None:
        if not isinstance(stored, dict) or stored.get("upstream") != entry.upstream or stored.get("model") != entry.model:
            return  # missing, unreadable, or (a hash collision) another key's record
        theirs = _samples(stored.get("samples"))
        seen = {(origin, t) for _, t, origin in entry.samples}
        merged = entry.samples + [s for s in theirs if (s[2], s[1]) not in seen]
        merged.sort(key=lambda s: s[1])
        entry.samples = merged[-WINDOW:]
        factor = stored.get("factor")
        current = float(factor) if isinstance(factor, (int, float)) and not isinstance(factor, bool) \
            and MIN_FACTOR <= factor <= MAX_FACTOR else None
        entry.recompute(current)

    def _schedule_write(self, key: tuple[str, str]) -> None:
        if key in self._writes:
            return  # the pending write will carry this sample too (it reads the entry when it runs)
        task = asyncio.ensure_future(self._write(key))
        self._writes[key] = task
        self._track(task)
        task.add_done_callback(lambda _t: self._writes.pop(key, None))

    async def _write(self, key: tuple[str, str]) -> None:
        try:
            await self._store(key)
        except (CacheBackendError, OSError) as exc:  # a bare backend (SafeCache already swallows): the samples stay local
            log.debug("calibration write failed: %s", exc)

    async def _store(self, key: tuple[str, str]) -> None:
        await asyncio.sleep(0)  # let the samples of this loop iteration join the write
        stored = await self.cache.get(cache_key(*key))
        entry = self._entry(key)
        before = entry.calibrated().factor
        self._merge(entry, stored)
        entry.loaded = self.monotonic()
        entry.dirty = False
        record = {"upstream": entry.upstream, "model": entry.model, "factor": entry.published,
                  "samples": [[r, t, o] for r, t, o in entry.samples],
                  "updated": self.clock()}
        await self.cache.set(cache_key(*key), record, self.ttl)
        self._changed(entry, before)


def cache_key(upstream: str, model: str) -> str:
    digest = hashlib.sha256(f"{upstream}\x00{model}".encode()).hexdigest()[:40]
    return KEY_PREFIX + digest


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
    """The factor a route's budget uses, and why: ``learned``, ``default``, ``pinned`` or ``off``."""

    factor: float
    source: str
    calibrated: Calibrated
    upstream: str
    upstream_model: str

    def describe(self) -> dict[str, Any]:
        c = self.calibrated
        return {"factor": self.factor, "source": self.source, "upstream": self.upstream,
                "upstream_model": self.upstream_model, "family": c.family, "family_default": c.default,
                "learned": c.learned, "samples": c.samples}


class ConfiguredCalibration:
    """``proxy.runtime.Calibration`` for one config: ``models[].calibration`` over the shared store."""

    def __init__(self, store: CalibrationStore, config: Config) -> None:
        self.store = store
        self._modes: dict[str, str | float] = {m.name: m.calibration for m in config.settings.models}

    def mode(self, route: ModelRoute) -> str | float:
        return self._modes.get(route.name, "auto")

    def factor(self, route: ModelRoute) -> float:
        mode = self._modes.get(route.name, "auto")
        if mode == "auto":
            return self.store.factor(route.upstream, route.upstream_model)
        return 1.0 if mode == "off" else float(mode)

    async def prime(self, route: ModelRoute) -> None:
        if self._modes.get(route.name, "auto") == "auto":
            await self.store.load(route.upstream, route.upstream_model)

    def effective(self, route: ModelRoute) -> Effective:
        mode = self.mode(route)
        calibrated = self.store.get(route.upstream, route.upstream_model)
        if mode == "auto":
            factor, source = calibrated.factor, calibrated.source
        elif mode == "off":
            factor, source = 1.0, "off"
        else:
            factor, source = float(mode), "pinned"
        return Effective(factor, source, calibrated, route.upstream, route.upstream_model)
