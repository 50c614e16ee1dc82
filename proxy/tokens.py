"""Token counting with the model's tiktoken encoding and OpenAI's per-message formula.

Per message: 3 tokens, plus the tokens of every string field (``role``,
``content``, ``tool_call_id``, ``refusal``, ...), plus 1 for ``name``. Content
parts count their text; an image part costs a fixed ``IMAGE_TOKENS_LOW`` (85)
with ``detail: low`` and ``IMAGE_TOKENS`` (765, a 1024x1024 high-detail image)
otherwise; other part kinds count their JSON. Each tool call counts its
function name and arguments plus ``TOOL_CALL_OVERHEAD``. A request adds 3
priming tokens and the JSON of its ``tools`` schemas.

Counts per message are cached by content digest in a bounded LRU, so a growing
conversation only encodes its new messages.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import orjson
from xxhash import xxh3_128_intdigest

from proxy.errors import PayloadError
from proxy.messages import Message

TOKENS_PER_MESSAGE = 3
TOKENS_PER_NAME = 1
REPLY_PRIMING = 3
IMAGE_TOKENS = 765
IMAGE_TOKENS_LOW = 85
TOOL_CALL_OVERHEAD = 3

O200K = "o200k_base"
CL100K = "cl100k_base"
_O200K_PREFIXES = ("gpt-4o", "gpt-4.1", "gpt-4.5", "gpt-5", "o1", "o3", "o4", "chatgpt-4o", "gpt-oss")
_CL100K_PREFIXES = ("gpt-4", "gpt-3.5", "gpt-35", "text-embedding")


def encoding_for(model: str, override: str | None = None) -> str:
    """o200k_base for gpt-4o / gpt-4.1 / o-series / gpt-5; cl100k_base for gpt-4 / gpt-3.5; else o200k_base."""
    if override:
        return override
    name = model.rsplit("/", 1)[-1].lower()
    if name.startswith("ft:"):  # fine-tuned: ft:<base model>:<org>::<id>
        name = name.split(":")[1]
    if name.startswith(_O200K_PREFIXES):
        return O200K
    if name.startswith(_CL100K_PREFIXES):
        return CL100K
    return O200K


def use_bundled_encodings() -> None:
    """Point tiktoken at the encodings litellm ships, so nothing is fetched at run time."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    if os.environ.get("TIKTOKEN_CACHE_DIR"):
        return
    spec = find_spec("litellm")
    if spec is None or not spec.submodule_search_locations:
        return
    folder = Path(next(iter(spec.submodule_search_locations))) / "litellm_core_utils" / "tokenizers"
    if folder.is_dir():
        os.environ["TIKTOKEN_CACHE_DIR"] = str(folder)


def content_key(message: Message) -> int:
    """A 128-bit key of one message's content (its JSON as sent, key order included).

    xxh3 is stable across processes and hosts, so the same key serves the token LRU,
    prefix tracking and the chained hashes that address cached summaries; it runs at
    memory speed, so hashing a 1.6 MB conversation costs about a millisecond.
    """
    try:
        raw = orjson.dumps(message)
    except TypeError as exc:
        if "Recursion limit" in str(exc):
            # orjson reads 1024 levels of nesting but writes only 254: such a message could never be forwarded
            raise PayloadError("A message is nested too deeply (more than 254 levels).", param="messages",
                               code="invalid_message") from None
        raw = repr(message).encode()
    return xxh3_128_intdigest(raw)


class TokenCounter:
    """Counts tokens for one encoding, caching per-message counts by digest (bounded LRU)."""

    def __init__(self, encoding: str, cache_size: int = 100_000) -> None:

        use_bundled_encodings()
        self.encoding_name = encoding
        self._enc = _private_encoding(encoding)
        self._cache: OrderedDict[int, int] = OrderedDict()
        self._cache_size = cache_size
        self._small: dict[str, int] = {}
        self._lock = threading.Lock()

    def clear(self) -> None:
        """Forget every cached count (benchmarks use it to measure a cold request)."""
        with self._lock:
            self._cache.clear()

    def text(self, text: str) -> int:
        if len(text) <= 16:
            n = self._small.get(text)
            if n is None:
                n = len(self._enc.encode_ordinary(text))
                if len(self._small) < 4096:
                    self._small[text] = n
            return n
        return len(self._enc.encode_ordinary(text))

    def message(self, message: Message, key: int | None = None) -> int:
        if key is None:
            key = content_key(message)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
        n = self._count(message)
        with self._lock:
            self._cache[key] = n
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return n

    def messages(self, messages: list[Message], keys: list[int] | None = None) -> list[int]:
        """Counts for many messages (cached ones cost a dict lookup).

        Texts are encoded one by one on purpose: tiktoken's threaded batch encoder was
        slower here (it holds the GIL), and per-call encoding lets other threads run in between.
        """
        if keys is None:
            keys = [content_key(m) for m in messages]
        out: list[int] = []
        missing: list[int] = []
        with self._lock:
            cache = self._cache
            for i, key in enumerate(keys):
                n = cache.get(key)
                if n is None:
                    missing.append(i)
                    out.append(0)
                else:
                    cache.move_to_end(key)
                    out.append(n)
        for i in missing:
            out[i] = self.message(messages[i], keys[i])
        return out

    def _count(self, message: Message) -> int:
        n = TOKENS_PER_MESSAGE
        for key, value in message.items():
            if isinstance(value, str):
                n += self.text(value)
                if key == "name":
                    n += TOKENS_PER_NAME
            elif key == "content" and isinstance(value, list):
                n += self._parts(value)
            elif key == "tool_calls" and isinstance(value, list):
                for call in value:
                    fn = call.get("function") if isinstance(call, dict) else None
                    if isinstance(fn, dict):
                        n += TOOL_CALL_OVERHEAD
                        for part in (fn.get("name"), fn.get("arguments")):
                            if isinstance(part, str):
                                n += self.text(part)
            elif key == "function_call" and isinstance(value, dict):
                for part in (value.get("name"), value.get("arguments")):
                    if isinstance(part, str):
                        n += self.text(part)
        return n

    def _parts(self, parts: list[Any]) -> int:
        n = 0
        for part in parts:
            if not isinstance(part, dict):
                continue
            kind = part.get("type")
            if kind == "text" and isinstance(part.get("text"), str):
                n += self.text(part["text"])
            elif kind == "image_url":
                image = part.get("image_url")
                low = isinstance(image, dict) and image.get("detail") == "low"
                n += IMAGE_TOKENS_LOW if low else IMAGE_TOKENS
            else:
                n += self.text(orjson.dumps(part).decode())
        return n

    def tools(self, tools: Any) -> int:
        """The request's tool schemas (``tools`` / legacy ``functions``), counted as their JSON."""
        if not tools:
            return 0
        try:
            raw = orjson.dumps(tools)
        except TypeError:
            return 0
        key = xxh3_128_intdigest(raw)
        with self._lock:
            cached = self._cache.get(key)
        if cached is None:
            cached = self.text(raw.decode())
            with self._lock:
                self._cache[key] = cached
        return cached


def _private_encoding(name: str) -> Any:
    """A tiktoken Encoding of our own, without its Python copy of the BPE ranks.

    The ranks (~30 MB for o200k) are only needed to pickle or extend an Encoding;
    counting runs in tiktoken's Rust core. Building a private instance (instead of
    emptying the shared one from ``tiktoken.get_encoding``) leaves other users of
    tiktoken in the process unaffected.
    """
    import tiktoken

    try:
        from tiktoken_ext.openai_public import ENCODING_CONSTRUCTORS
    except ImportError:  # pragma: no cover - tiktoken without its OpenAI plugin
        return tiktoken.get_encoding(name)
    constructor = ENCODING_CONSTRUCTORS.get(name)
    if constructor is None:
        return tiktoken.get_encoding(name)
    encoding = tiktoken.Encoding(**constructor())
    encoding._mergeable_ranks = {}
    return encoding


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
