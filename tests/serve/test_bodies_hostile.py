"""Hostile bodies against reading a body from where it differs (an outside review's reproductions): each must read
as a whole parse reads it, in bounded time and memory."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import orjson

from proxy.core.errors import CtxProxyError
from proxy.serve.bodies import MAX_BUCKETS, KnownBodies, read_json_body


def outcome(parse: Callable[[], dict[str, Any]]) -> Any:
    try:
        return ("ok", parse())
    except CtxProxyError as exc:
        return ("refused", exc.status, exc.code, str(exc))


def warm_and_fresh(memory: KnownBodies, raw: bytes, tenant: str = "t") -> tuple[Any, Any]:
    return (outcome(lambda: memory.parse(raw, tenant, "chat", "messages", read_json_body)),
            outcome(lambda: read_json_body(raw)[0]))


def head() -> list[dict[str, Any]]:
    return [{"role": "system", "content": "s" * 2000},
            *({"role": "user" if i % 2 else "assistant", "content": f"turn {i}"} for i in range(5))]


def test_window_edge_string_gives_unproven_cuts_that_accept_invalid_json() -> None:
    """The last element is a string that crosses the 32 KiB backward window's start: _BACKWARD has no lone-quote
    alternative, so the string's content inside the window is tokenized as structure ('{' and ',' in it become
    depth changes and cuts). The body that reuses the array's ']' proves only that place; _continued keeps the
    bogus places before it as proven. A third body cut at one of them (inside the string) is accepted."""
    big = "A" * 40000 + ",a,b,c{" + "z" * 100
    raw_a = orjson.dumps({"model": "gpt-4o", "messages": [*head(), {"role": "user", "content": big}],
                          "stream": False})
    memory = KnownBodies(min_bytes=0)
    for _ in range(2):  # read back, then proven (at the ']')
        warm, fresh = warm_and_fresh(memory, raw_a)
        assert warm == fresh
    cut = raw_a.index(b",c{")  # a comma inside the big string
    raw_c = raw_a[:cut] + b',{"role":"user","content":"injected"}' + raw_a[raw_a.rindex(b"]"):]
    warm, fresh = warm_and_fresh(memory, raw_c)
    assert fresh[0] == "refused" and fresh[2] == "invalid_json"  # not JSON: the big string is never closed
    assert warm == fresh, f"warm parse accepted invalid JSON: last message {warm[1]['messages'][-1]!r}"


def nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


def grow(extra: list[Any]) -> bytes:
    return orjson.dumps({"model": "gpt-4o", "messages": [*head(), *extra], "stream": False})


def deep_bytes(depth: int) -> bytes:
    return b"[" * depth + b"0" + b"]" * depth


def test_new_element_one_level_too_deep_for_a_whole_parse() -> None:
    """`[null` + new + `]` is one level shallower than the body (whose array sits in the top object): an element
    nested 1023 levels is read warm, while orjson refuses the whole body (1025 > 1024 levels)."""
    memory = KnownBodies(min_bytes=0)
    for n in (1, 2):
        warm, fresh = warm_and_fresh(memory, grow([{"role": "user", "content": f"m{i}"} for i in range(n)]))
        assert warm == fresh
    base = grow([{"role": "user", "content": f"m{i}"} for i in range(2)])
    cut = base.rindex(b"]")
    raw = base[:cut] + b"," + deep_bytes(1023) + base[cut:]
    warm, fresh = warm_and_fresh(memory, raw)
    assert fresh[0] == "refused" and fresh[2] == "invalid_json"
    assert warm == fresh, "warm accepted a body a whole parse refuses as too deep"


def test_new_deep_element_with_a_repeated_model_string() -> None:
    """check_repeated_fields decodes the whole body with json (RecursionError near 1000 levels) when '"model"' occurs
    twice anywhere; the warm path never runs it for the new elements."""
    memory = KnownBodies(min_bytes=0)
    for n in (1, 2):
        warm, fresh = warm_and_fresh(memory, grow([{"role": "user", "content": f"m{i}"} for i in range(n)]))
        assert warm == fresh
    base = grow([{"role": "user", "content": f"m{i}"} for i in range(2)])
    cut = base.rindex(b"]")
    raw = base[:cut] + b',{"role":"user","content":"model","x":' + deep_bytes(1000) + b"}" + base[cut:]
    raw = raw.replace(b'"content":"model"', b'"content":"x","model":1', 1)  # '"model"' twice in the bytes
    warm, fresh = warm_and_fresh(memory, raw)
    assert fresh[0] == "refused" and fresh[2] == "ambiguous_field", fresh
    assert warm == fresh, "warm accepted a body a whole parse refuses (ambiguous_field)"


def test_backward_read_is_quadratic_on_escaped_quotes_across_the_window_edge() -> None:
    """A 40 KB body (below server.offload_bytes: parsed on the event loop) whose last string is escaped quotes and
    crosses the 32 KiB window's start with the window cutting between a backslash and its quote: _BACKWARD retries
    an unclosable string at every escaped quote, O(window^2). The first body of any new bucket is read back."""
    import time

    worst = 0.0
    for pad in ("", "x", "xx"):  # one of the two alignments of the window's start
        raw = orjson.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"},
                            {"role": "user", "content": '"' * 20_000}], "stream": pad or False})
        start = time.perf_counter()
        warm, fresh = warm_and_fresh(KnownBodies(), raw)
        worst = max(worst, time.perf_counter() - start)
        assert warm == fresh
    assert worst < 0.5, f"KnownBodies.parse took {worst:.1f} s for a {len(raw)} byte body (a whole parse: < 1 ms)"


def test_buckets_of_bodies_never_remembered_are_never_dropped() -> None:
    """Every miss creates its bucket (for its miss count) even when nothing is remembered in it (a Responses body whose
    input is a string, an empty array, a body too large to keep, a backward read that finds nothing); eviction
    runs only when remembered bytes exceed max_bytes, so these buckets accumulate without bound."""
    memory = KnownBodies(max_bytes=100_000)
    pad = "p" * 17_000  # above MIN_BYTES
    for i in range(5_000):  # each with another first kilobyte (e.g. a request id or date in the instructions)
        raw = orjson.dumps({"model": "gpt-4o", "instructions": f"session {i} " + pad, "input": "hello"})
        memory.parse(raw, "t", "responses", "input", read_json_body)
    assert memory.size == 0
    assert len(memory._buckets) <= MAX_BUCKETS, f"{len(memory._buckets)} buckets kept for 0 remembered bytes"


def test_threads_parsing_interleaved_conversations_read_what_a_whole_parse_reads() -> None:
    import random
    import threading

    memory = KnownBodies(min_bytes=0, max_bytes=400_000)
    failures: list[Any] = []

    def worker(seed: int) -> None:
        r = random.Random(seed)
        convo = r.randrange(3)  # three conversations that begin alike: one bucket
        msgs: list[dict[str, Any]] = [{"role": "system", "content": "s" * 1100}]
        for step in range(60):
            if r.random() < 0.15 and len(msgs) > 3:
                msgs = msgs[:r.randrange(2, len(msgs))]  # truncated / branched
            msgs.append({"role": "user", "content": f"c{convo} s{step} " + "x" * r.randrange(0, 300),
                         "n": r.choice([1, 1.0, -0.0, 10**18, "1", None, True])})
            if r.random() < 0.3:
                msgs[-1] = {**msgs[-1], "cache_control": {"type": "ephemeral"}}
            raw = orjson.dumps({"model": "m", "messages": msgs, "convo": convo})
            if r.random() < 0.5:
                raw = json.dumps(json.loads(raw), indent=r.choice([None, 1])).encode()
            warm, fresh = warm_and_fresh(memory, raw, tenant=r.choice(["a", "b"]))
            if repr(warm) != repr(fresh):
                failures.append((seed, step))

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[:5]


def test_the_memory_bound_counts_raw_bytes_but_the_parses_are_kept_too() -> None:
    """max_bytes bounds the remembered raw bytes; each Known also keeps its parse (Python objects), uncounted.
    For bodies of many small blocks (an agent's tool rounds) the parses weigh about 10x the bytes: the default
    16 MiB bound holds ~170 MB."""
    import tracemalloc

    tracemalloc.start()
    try:
        memory = KnownBodies(max_bytes=8 * 1024 * 1024)
        base = tracemalloc.get_traced_memory()[0]
        for conversation in range(60):
            msgs = [{"role": "system", "content": f"conversation {conversation} " + "s" * 1100},
                    *({"role": "user", "content": [{"type": "text", "text": f"w{i}"}] * 20} for i in range(60))]
            for _ in range(2):  # (a body is read back the second time it is seen)
                memory.parse(orjson.dumps({"model": "m", "messages": msgs}), "t", "chat", "messages", read_json_body)
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert 0 < held <= memory.size <= 8 * 1024 * 1024, (held, memory.size)
