"""Token counting with the model's tiktoken encoding, cached per content key.

A wire adapter supplies the per-item formula (``proxy.wire``): the counter only
encodes text and remembers each item's count under its content key in a bounded
LRU, so a growing conversation only encodes its new items. A request adds
``REPLY_PRIMING`` tokens and the JSON of its tool schemas (``tools``).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import orjson
from xxhash import xxh3_128_intdigest

from proxy.core.errors import PayloadError
from proxy.core.modelinfo import offline_environment
from proxy.core.warm import Conversations, Known

REPLY_PRIMING = 3
# keys looked up per hold of a counter's lock: a worker thread counting a large body lets a small request on
# the event loop in between chunks, instead of holding the lock for the whole body
LOCK_CHUNK = 1024

O200K = "o200k_base"
CL100K = "cl100k_base"
# the encodings litellm ships (nothing else can be loaded offline); any other maps to o200k_base
BUNDLED_ENCODINGS = frozenset({"o200k_base", "o200k_harmony", "cl100k_base", "p50k_base", "p50k_edit"})
Formula = Callable[["TokenCounter", Any], int]


def encoding_for(model: str, override: str | None = None) -> str:
    """tiktoken's encoding for an OpenAI model (``provider/`` prefixes ignored); o200k_base for any other.

    o200k_base is the closest public encoding for current non-OpenAI models too; the
    usage calibration corrects what it gets wrong (``proxy.store.calibration``).
    """
    if override:
        return override
    import tiktoken

    name = model.rsplit("/", 1)[-1].lower()
    try:
        encoding = tiktoken.encoding_name_for_model(name)
    except KeyError:
        return O200K
    return encoding if encoding in BUNDLED_ENCODINGS else O200K


def use_bundled_encodings() -> None:
    """Point tiktoken at the encodings litellm ships, so nothing is fetched at run time."""
    offline_environment()


def content_key(raw: Any) -> int:
    """A 128-bit key of one item's content (its JSON as sent, key order included).

    xxh3 is stable across processes and hosts, so the same key serves the token LRU,
    prefix tracking and the chained hashes that address cached summaries; it runs at
    memory speed, so hashing a 1.6 MB conversation costs about a millisecond.
    """
    try:
        data = orjson.dumps(raw)
    except TypeError as exc:
        if "Recursion limit" in str(exc):
            # orjson reads 1024 levels of nesting but writes only 254: such a message could never be forwarded
            raise PayloadError("An item of the conversation is nested too deeply (more than 254 levels).",
                               code="invalid_message") from None
        data = repr(raw).encode()
    return xxh3_128_intdigest(data)


def content_keys(raws: list[Any], salt: int = 0) -> list[int]:
    """``content_key(raw) ^ salt`` of every element of ``raws``, in one pass (the same keys)."""
    dumps, digest = orjson.dumps, xxh3_128_intdigest
    try:
        return [digest(dumps(raw)) ^ salt for raw in raws]
    except TypeError:  # an element orjson cannot write: content_key says what that means
        return [content_key(raw) ^ salt for raw in raws]


def sized_content_keys(raws: list[Any], salt: int = 0) -> tuple[list[int], int] | None:
    """``content_keys`` and the bytes of the elements' JSON in all (what remembering them holds, about); None when
    an element cannot be keyed (nested too deeply): the full parse then refuses the body, in its own order."""
    dumps, digest = orjson.dumps, xxh3_128_intdigest
    keys: list[int] = []
    size = 0
    for raw in raws:  # one element's JSON at a time: a 200k-message body is not held twice
        try:
            data = dumps(raw)
        except TypeError:  # an element orjson cannot write (an integer beyond 64 bits): content_key's own way
            try:
                keys.append(content_key(raw) ^ salt)
            except PayloadError:
                return None
            size += len(repr(raw))  # its size all the same: remembering it must count it
            continue
        size += len(data)
        keys.append(digest(data) ^ salt)
    return keys, size


def resumed_content_keys(memory: Conversations, tenant: str, wire: str, raws: list[Any],
                         salt: int = 0) -> tuple[list[int], int, Known | None] | None:
    """``sized_content_keys(raws, salt)``, with the keys of the leading elements that are the very objects a
    remembered request of the conversation had (``Conversations.shared``) read from it; and that request when
    ``raws`` begins with all of its elements (its items' elements are then this request's already)."""
    first = sized_content_keys(raws[:2], salt)
    if first is None:
        return None
    shared = memory.shared(tenant, wire, raws, first[0]) if len(raws) >= 2 else None
    if shared is None:  # the first two keyed once, not twice
        after = sized_content_keys(raws[2:], salt)
        return None if after is None else (first[0] + after[0], first[1] + after[1], None)
    known, n = shared
    rest = sized_content_keys(raws[n:], salt)
    dropped = sized_content_keys(list(known.elements[n:]), salt)  # what it sends anew: keyed once already
    if rest is None or dropped is None:
        return None
    return known.keys[:n] + rest[0], known.size - dropped[1] + rest[1], known if n == len(known.elements) else None


class TokenCounter:
    """Counts tokens for one encoding, caching per-item counts by content key (bounded LRU)."""

    def __init__(self, encoding: str, cache_size: int = 100_000) -> None:
        import tiktoken

        use_bundled_encodings()
        self.encoding_name = encoding
        self._enc = tiktoken.get_encoding(encoding)
        self._cache: OrderedDict[int, int] = OrderedDict()
        self._digests: OrderedDict[int, bytes] = OrderedDict()
        self._cache_size = cache_size
        self._small: dict[str, int] = {}
        self._lock = threading.Lock()
        # what earlier requests of each conversation parsed, per tenant (its items hold counts of this encoding)
        self.conversations = Conversations(max(1, cache_size // 2))
        # chained-hash links by (the link before, the turn's content keys): a growing conversation's chain is
        # read back rather than digested again (``proxy.pipeline.chain_hashes``); cleared when full
        self.links: dict[tuple[bytes, tuple[int, ...]], bytes] = {}

    def clear(self) -> None:
        """Forget every cached count and digest (benchmarks use it to measure a cold request)."""
        with self._lock:
            self._cache.clear()
            self._digests.clear()
            self._small.clear()
            self.links.clear()
        self.conversations.clear()

    def text(self, text: str) -> int:
        if len(text) <= 16:
            n = self._small.get(text)
            if n is None:
                n = len(self._enc.encode_ordinary(text))
                if len(self._small) < 4096:
                    self._small[text] = n
            return n
        return len(self._enc.encode_ordinary(text))

    def json(self, value: Any) -> int:
        """Tokens of a value's compact JSON (what a provider sees of structured content)."""
        try:
            return self.text(orjson.dumps(value).decode())
        except TypeError:
            return 0

    def cached(self, key: int, raw: Any, formula: Formula) -> int:
        """``formula(self, raw)``, remembered under ``key``."""
        with self._lock:
            n = self._cache.get(key)
            if n is not None:
                self._cache.move_to_end(key)
                return n
        n = formula(self, raw)
        with self._lock:
            self._cache[key] = n
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return n

    def many(self, keys: list[int], raws: list[Any], formula: Formula) -> list[int]:
        """Counts for many items (cached ones cost a dict lookup under one lock).

        Texts are encoded one by one on purpose: tiktoken's threaded batch encoder was
        slower here (it holds the GIL), and per-call encoding lets other threads run in between.
        """
        out: list[int] = []
        missing: list[int] = []
        cache = self._cache
        for start in range(0, len(keys), LOCK_CHUNK):  # a large body holds the lock a chunk at a time
            with self._lock:
                for i in range(start, min(start + LOCK_CHUNK, len(keys))):
                    key = keys[i]
                    n = cache.get(key)
                    if n is None:
                        missing.append(i)
                        out.append(0)
                    else:
                        cache.move_to_end(key)
                        out.append(n)
        for i in missing:
            out[i] = self.cached(keys[i], raws[i], formula)
        return out

    def many_digests(self, keys: list[int], compute: Callable[[int], bytes]) -> list[bytes]:
        """Wire-neutral digests remembered per content key (chained summary-cache hashes reuse them), for many keys
        under one lock; ``compute(i)`` makes the i-th (key 0: never kept)."""
        out: list[bytes | None] = []
        cache = self._digests
        for start in range(0, len(keys), LOCK_CHUNK):
            with self._lock:
                for key in keys[start:start + LOCK_CHUNK]:
                    d = cache.get(key) if key else None
                    if d is not None:
                        cache.move_to_end(key)
                    out.append(d)
        missing = [i for i, d in enumerate(out) if d is None]
        if missing:
            made = [(i, compute(i)) for i in missing]
            for start in range(0, len(made), LOCK_CHUNK):
                with self._lock:
                    for i, d in made[start:start + LOCK_CHUNK]:
                        out[i] = d
                        if keys[i]:
                            cache[keys[i]] = d
                    while len(cache) > self._cache_size:
                        cache.popitem(last=False)
        return out  # type: ignore[return-value]  # every None was filled

    def tools(self, tools: Any, field: str = "tools") -> int:
        """A request's tool schemas, counted as their JSON (cached: agents resend the same tools)."""
        if not tools:
            return 0
        try:
            raw: bytes | None = orjson.dumps(tools)
        except TypeError:
            raw = _deep_json(tools, field)
        if raw is None:
            return 0  # not JSON at all (only a caller's own value can be that)
        return self.cached(xxh3_128_intdigest(raw), raw, _count_json_bytes)


def output_schema(response_format: Any) -> Any:
    """The JSON schema a structured-output request carries (Chat ``response_format``, Responses ``text.format``):
    providers put it in the prompt, so it counts like tool schemas; plain text or JSON mode count nothing."""
    if isinstance(response_format, dict) and response_format.get("type") == "json_schema":
        return response_format.get("json_schema", response_format)  # Chat nests it; Responses does not
    return None


def _deep_json(value: Any, field: str) -> bytes | None:
    """Compact JSON of a value nested deeper than orjson writes (254 levels; a body may hold 1024): such
    tools are still forwarded as the client's bytes when nothing changed, so they must be counted."""
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
    except RecursionError:
        raise PayloadError(f"The request's '{field}' is nested too deeply to be counted.", param=field,
                           code="invalid_tools") from None
    except (TypeError, ValueError):
        return None


def _count_json_bytes(counter: TokenCounter, raw: bytes) -> int:
    return counter.text(raw.decode())


class Tokenizers:
    """One TokenCounter per encoding, created on first use (the app owns one instance)."""

    def __init__(self, cache_size: int = 100_000) -> None:
        self._counters: dict[str, TokenCounter] = {}
        self._cache_size = cache_size

    def get(self, encoding: str) -> TokenCounter:
        counter = self._counters.get(encoding)
        if counter is None:
            counter = self._counters[encoding] = TokenCounter(encoding, self._cache_size)
        return counter

    def loaded(self, encoding: str) -> TokenCounter | None:
        """The counter of ``encoding`` when it is loaded already (None: ``counter`` loads it)."""
        return self._counters.get(encoding)

    async def counter(self, encoding: str) -> TokenCounter:
        """``get`` for a request: an encoding not loaded yet is loaded in a worker thread (reading and checking
        its ranks takes 0.15-0.25 s, which on the event loop would hold up every other request)."""
        counter = self.loaded(encoding)
        return counter if counter is not None else await asyncio.to_thread(self.get, encoding)
