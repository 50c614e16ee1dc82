"""proxy.core.tokens: encodings by model name (tiktoken's public API), content keys, the counter's LRUs.

The per-message formulas are the wire's (tests/wire/test_chat.py); counts against tiktoken's
reference are in tests/wire/test_chat_tokens.py.
"""

from __future__ import annotations

import functools
import json
import threading
from typing import Any

import orjson
import pytest
import tiktoken

from proxy.core.errors import PayloadError
from proxy.core.tokens import CL100K, O200K, TokenCounter, Tokenizers, content_key, encoding_for
from tests.conftest import StartProxy, base_config
from tests.fake_upstream import FakeUpstream
from tests.outside import post


@pytest.mark.parametrize(("model", "encoding"), [
    ("gpt-4o-mini", O200K),
    ("GPT-4O-MINI", O200K),  # case does not matter
    ("Gpt-4o", O200K),
    ("openai/gpt-4o", O200K),  # provider prefixes are ignored, however many
    ("openrouter/openai/gpt-4o-mini", O200K),
    ("azure/GPT-35-TURBO", CL100K),
    ("bedrock/converse/gpt-4", CL100K),
    ("ft:gpt-4o-mini-2024-07-18:acme::9abc", O200K),  # fine-tuned models by their base
    ("ft:gpt-3.5-turbo-0125:acme:support:8xyz", CL100K),
    ("openai/ft:gpt-4o-2024-08-06:acme::abc", O200K),
    ("gpt-4o-realtime-preview", O200K),
    ("o1-preview", O200K),
    ("o3-mini-2025-01-31", O200K),
    ("gpt-4.5-preview", O200K),
    ("gpt-4-32k", CL100K),
    ("text-embedding-3-large", CL100K),
    ("claude-3-7-sonnet-20250219", O200K),  # not OpenAI: the closest public encoding
    ("anthropic/claude-sonnet-4", O200K),
    ("gemini/gemini-2.0-flash", O200K),
    ("mistral-large-latest", O200K),
    ("meta-llama/Llama-3.3-70B-Instruct", O200K),
    ("", O200K),
    ("/", O200K),
    ("gpt-4o/", O200K),
    ("ft:", O200K),
    ("💥", O200K),
])
def test_encoding_for(model: str, encoding: str) -> None:
    assert encoding_for(model) == encoding


@pytest.mark.parametrize("model", ["gpt-4o", "gpt-4", "gpt-3.5-turbo", "text-davinci-003", "gpt-4o-mini-2024-07-18",
                                   "ft:gpt-4-0613:org::id"])
def test_encoding_for_is_tiktokens_public_answer(model: str) -> None:
    assert encoding_for(model) == tiktoken.encoding_name_for_model(model)
    assert encoding_for("provider/" + model.upper()) == tiktoken.encoding_name_for_model(model)


def test_an_override_wins_even_for_unknown_names() -> None:
    assert encoding_for("anything", "cl100k_base") == CL100K
    assert encoding_for("gpt-4o", "") == O200K  # an empty override is no override


# --------------------------------------------------------------------------- content keys


def test_content_key_is_stable_and_order_sensitive() -> None:
    a = {"role": "user", "content": "hi"}
    assert content_key(a) == content_key({"role": "user", "content": "hi"})
    assert content_key(a) != content_key({"content": "hi", "role": "user"})  # key order is part of the JSON sent
    assert content_key(a) != content_key({"role": "user", "content": "hi "})
    assert 0 <= content_key(a) < 2**128
    # stable across processes and hosts: xxh3 of orjson's bytes
    from xxhash import xxh3_128_intdigest

    assert content_key(a) == xxh3_128_intdigest(orjson.dumps(a))


def test_content_key_of_something_json_cannot_hold_uses_its_repr() -> None:
    assert content_key({"x": {1, 2}}) == content_key({"x": {1, 2}})
    assert isinstance(content_key(object), int)


def nested(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = [value]
    return value


def test_content_key_refuses_what_could_never_be_forwarded() -> None:
    content_key({"content": nested(250)})
    with pytest.raises(PayloadError) as err:
        content_key({"content": nested(300)})
    assert err.value.code == "invalid_message"
    assert err.value.status == 400


# --------------------------------------------------------------------------- TokenCounter


@pytest.fixture(scope="module")
def counter() -> TokenCounter:
    return TokenCounter(O200K)


@pytest.mark.parametrize("text", ["", "a", "hello world", "Zürich 東京 🚀", "<|endoftext|>", "x" * 17, "word " * 200])
def test_text_matches_tiktoken_ordinary_encoding(counter: TokenCounter, text: str) -> None:
    enc = tiktoken.get_encoding(O200K)
    assert counter.text(text) == len(enc.encode_ordinary(text))
    assert counter.text(text) == counter.text(text)  # the small-text cache answers the same


def test_json_counts_compact_json(counter: TokenCounter) -> None:
    value = {"city": "Zürich", "days": [1, 2]}
    assert counter.json(value) == counter.text(orjson.dumps(value).decode())
    assert counter.json({1, 2}) == 0  # not JSON: nothing to count


class Formula:
    def __init__(self) -> None:
        self.calls: list[Any] = []

    def __call__(self, counter: TokenCounter, raw: Any) -> int:
        self.calls.append(raw)
        return len(str(raw))


def test_cached_is_a_bounded_lru() -> None:
    c = TokenCounter(O200K, cache_size=2)
    f = Formula()
    assert c.cached(1, "a", f) == 1
    assert c.cached(2, "bb", f) == 2
    assert c.cached(1, "ignored: cached", f) == 1  # a hit, and 1 becomes the most recent
    c.cached(3, "ccc", f)  # evicts 2, the least recently used
    assert c.cached(1, "x", f) == 1
    assert c.cached(2, "bb", f) == 2  # recomputed
    assert f.calls == ["a", "bb", "ccc", "bb"]


def test_many_uses_the_cache_and_fills_it_in_order() -> None:
    c = TokenCounter(O200K)
    f = Formula()
    c.cached(10, "zz", f)
    assert c.many([10, 11, 12, 11], ["ignored", "a", "bbb", "a"], f) == [2, 1, 3, 1]
    assert f.calls == ["zz", "a", "bbb"]


def test_clear_forgets_counts() -> None:
    c = TokenCounter(O200K)
    f = Formula()
    c.cached(1, "a", f)
    c.clear()
    c.cached(1, "a", f)
    assert f.calls == ["a", "a"]


def test_digests_are_remembered_per_key_in_a_bounded_lru() -> None:
    c = TokenCounter(O200K, cache_size=2)
    made: list[int] = []

    def digests(keys: list[int], values: list[int]) -> list[bytes]:
        def compute(i: int) -> bytes:
            made.append(values[i])
            return bytes([values[i]]) * 16
        return c.many_digests(keys, compute)

    assert digests([1], [1]) == [b"\x01" * 16]
    assert digests([1], [99]) == [b"\x01" * 16]  # remembered, not recomputed
    digests([2], [2])
    digests([1], [1])  # 1 is now the most recent
    digests([3], [3])  # evicts 2
    digests([2], [2])
    assert made == [1, 2, 3, 2]
    assert digests([3, 0, 2, 0], [3, 7, 2, 8]) == [b"\x03" * 16, b"\x07" * 16, b"\x02" * 16, b"\x08" * 16]
    assert made[-2:] == [7, 8]  # key 0 (an item without a content key) is computed every time, never kept


def test_digests_and_counts_are_separate_caches() -> None:
    c = TokenCounter(O200K)
    c.cached(5, "abc", Formula())
    assert c.many_digests([5], lambda i: b"d" * 16) == [b"d" * 16]


@pytest.mark.parametrize("tools", [None, [], {}])
def test_no_tools_cost_nothing(counter: TokenCounter, tools: Any) -> None:
    assert counter.tools(tools) == 0


def test_tools_are_counted_as_their_json_and_cached(counter: TokenCounter) -> None:
    tools = [{"type": "function", "function": {"name": "search_flights", "parameters": {
        "type": "object", "properties": {"origin": {"type": "string"}}}}}]
    n = counter.tools(tools)
    assert n == counter.text(orjson.dumps(tools).decode())
    assert counter.tools(tools) == n
    assert counter.tools([{"x": {1}}]) == 0  # not JSON


def _digest_at(key: int, i: int) -> bytes:
    return bytes([(key + i) % 256]) * 16


def test_counter_is_thread_safe_enough_for_the_offload_pool() -> None:
    c = TokenCounter(O200K, cache_size=50)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            for i in range(300):
                key = (seed * 1000 + i) % 120
                assert c.cached(key, "x" * (key % 7), lambda _c, raw: len(raw)) == key % 7
                assert c.many_digests([key, key + 1], functools.partial(_digest_at, key)) == [
                    bytes([key % 256]) * 16, bytes([(key + 1) % 256]) * 16]
        except BaseException as exc:  # collected for the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_tokenizers_make_one_counter_per_encoding() -> None:
    t = Tokenizers(cache_size=10)
    a = t.get(O200K)
    assert t.get(O200K) is a
    b = t.get(CL100K)
    assert b is not a and b.encoding_name == CL100K
    assert b.text("hello world") == len(tiktoken.get_encoding(CL100K).encode_ordinary("hello world"))


@pytest.mark.parametrize("model", ["gpt-4o", "gpt-4", "text-davinci-003", "gpt-oss-120b", "claude-3-5-haiku"])
def test_every_encoding_a_known_model_maps_to_loads_offline(model: str) -> None:
    """litellm ships cl100k, o200k and p50k; o200k_harmony is built on o200k."""
    TokenCounter(encoding_for(model)).text("hello")


def test_tools_nested_deeper_than_orjson_writes_are_still_counted(counter: TokenCounter) -> None:
    """Forwarded as the client's bytes when nothing changed, so never uncounted (a tenant's cap holds)."""
    deep: object = "leaf " * 50
    for _ in range(600):
        deep = {"x": deep}
    tools = [{"type": "function", "function": {"name": "f", "parameters": deep}}]
    assert counter.tools(tools) == counter.text(json.dumps(tools, separators=(",", ":")))


class _CountingLock:
    """A lock that counts how often it is taken."""

    def __init__(self) -> None:
        self.lock, self.taken = threading.Lock(), 0

    def __enter__(self) -> None:
        self.lock.acquire()
        self.taken += 1

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


def test_counting_a_large_body_lets_go_of_the_lock_between_chunks() -> None:
    """A large body is counted in a worker thread while small requests are counted on the event loop, with the
    same counter: holding its lock across all of a body's items made the event loop wait for the whole body.
    The lock is taken a chunk of items at a time, for counts and for digests alike."""
    counter = TokenCounter(O200K)
    raws = [f"message {i}" for i in range(10_000)]
    keys = [content_key(r) for r in raws]
    counter.many(keys, raws, lambda c, raw: c.text(raw))
    counter.many_digests(keys, lambda i: raws[i].encode())
    lock = _CountingLock()
    counter._lock = lock  # type: ignore[assignment]
    assert counter.many(keys, raws, lambda c, raw: c.text(raw)) == [counter.text(r) for r in raws]
    assert lock.taken >= 5, lock.taken  # all cached: lookups only, in several holds of the lock
    lock.taken = 0
    assert counter.many_digests(keys, lambda i: b"") == [r.encode() for r in raws]
    assert lock.taken >= 5, lock.taken


MODEL = "gpt-4o-mini"


def chat(messages: list[Any], model: str = MODEL, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": messages, **extra}


@pytest.mark.parametrize("model", ["davinci", "openai/babbage", "gpt2"])
async def test_a_client_chosen_model_name_never_makes_the_proxy_fetch_an_encoding(
    upstream: FakeUpstream, start_proxy: StartProxy, monkeypatch: pytest.MonkeyPatch, model: str
) -> None:
    """A model name the client picks (an old GPT-3 or GPT-2 name) never makes the proxy download a tiktoken encoding:
    counting stays offline, whatever the body names."""
    import tiktoken.load

    fetched: list[str] = []

    def no_network(url: str) -> bytes:
        fetched.append(url)
        raise OSError(f"network disabled in this test: {url}")

    monkeypatch.setattr(tiktoken.load, "read_file", no_network)
    proxy = await start_proxy(base_config(upstream.base_url))
    status, _, body = await post(proxy, chat([{"role": "user", "content": "hi"}], model=model))
    assert fetched == [], f"the proxy fetched {fetched}"
    assert status == 200, body
