"""What reading a body from where it differs costs at worst (an outside review's reproductions): the forward read of
new elements and the backward read of the last ones step through tokens in Python (~100+ ns a token, where a whole
orjson decode costs ~1-3 ns a byte), so both stop at ``_limit`` tokens and the body is decoded whole. A body of
220 KB (below server.offload_bytes, so parsed on the event loop) whose new element is made of tiny tokens cost
10-40x a whole decode before. The timed checks run with ``make check``; the limits themselves in every run."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from proxy.serve import bodies as module
from proxy.serve.bodies import KnownBodies, read_json_body


def body(extra: list[dict[str, Any]]) -> bytes:
    msgs = [{"role": "system", "content": "s" * 20000}] + [{"role": "user", "content": f"m{i}"} for i in range(4)]
    return orjson.dumps({"model": "gpt-4o", "messages": msgs + extra, "stream": False})


def best(f: Callable[[], object], n: int = 3) -> float:
    out = 1e9
    for _ in range(n):
        t = time.perf_counter()
        f()
        out = min(out, time.perf_counter() - t)
    return out


SHAPES = {
    "zeros": lambda n: b"[" + b",".join([b"0"] * (n // 2)) + b"]",
    "empty_strings": lambda n: b"[" + b",".join([b'""'] * (n // 3)) + b"]",
    "empty_objects": lambda n: b"[" + b",".join([b"{}"] * (n // 3)) + b"]",
}


def warmed() -> KnownBodies:
    memory = KnownBodies()
    for k in range(3):  # miss, miss (read back), proven
        memory.parse(body([{"role": "user", "content": f"k{j}"} for j in range(k)]), "t", "chat", "messages",
                     read_json_body)
    assert memory.reused == 1
    return memory


@pytest.mark.slow
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_new_element_of_tiny_tokens_costs_about_a_whole_decode(shape: str) -> None:
    base = body([{"role": "user", "content": "k0"}, {"role": "user", "content": "k1"}])
    cut = base.rindex(b"]")
    raw = base[:cut] + b',{"role":"user","content":' + SHAPES[shape](200_000) + b"}" + base[cut:]
    assert len(raw) < 262_144  # parsed on the event loop
    whole = best(lambda: read_json_body(raw))

    memories: list[KnownBodies] = []

    def warm() -> None:
        memory = warmed()
        memory.parse(raw, "t", "chat", "messages", read_json_body)
        memories.append(memory)

    setup = best(warmed)
    warm_time = best(warm) - setup
    assert memories[-1].parse(raw, "t", "chat", "messages", read_json_body) == read_json_body(raw)[0]
    assert warm_time < 5 * whole + 0.002, f"{shape}: warm {warm_time * 1e3:.1f} ms vs whole {whole * 1e3:.1f} ms"


@pytest.mark.slow
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_reading_back_last_elements_of_tiny_tokens_costs_about_a_whole_decode(shape: str) -> None:
    """The second sight of a bucket's body reads it back: every token of its last elements, in Python."""
    base = body([])
    cut = base.rindex(b"]")
    raw = base[:cut] + b',{"role":"user","content":' + SHAPES[shape](200_000) + b"}" + base[cut:]
    whole = best(lambda: read_json_body(raw))

    def twice() -> None:
        memory = KnownBodies()
        for _ in range(2):
            memory.parse(raw, "t", "chat", "messages", read_json_body)

    took = best(twice)
    assert took < 5 * 2 * whole + 0.002, f"{shape}: two parses {took * 1e3:.1f} ms vs whole {whole * 1e3:.1f} ms"


@pytest.mark.slow
def test_reading_back_a_string_of_escaped_quotes_costs_about_a_whole_decode() -> None:
    """No Python loop here: _BACKWARD's per-escaped-quote lookahead (~50 ns a byte), run over the 32 KiB window and
    again over 256 KiB (the string crosses the first window's start)."""
    raw = orjson.dumps({"model": "m", "messages": [{"role": "system", "content": "s" * 1100},
                        {"role": "user", "content": "hi"}, {"role": "user", "content": '"' * 120_000}],
                        "stream": False})
    whole = best(lambda: read_json_body(raw))

    def twice() -> None:
        memory = KnownBodies()
        for _ in range(2):
            memory.parse(raw, "t", "chat", "messages", read_json_body)

    extra = best(twice) - 2 * whole  # what the read back costs on top of the two whole decodes
    assert extra < 3 * whole + 0.001, f"read back {extra * 1e3:.1f} ms vs whole {whole * 1e3:.2f} ms"


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_new_elements_of_more_tokens_than_the_limit_are_decoded_whole(shape: str) -> None:
    base = body([{"role": "user", "content": "k0"}, {"role": "user", "content": "k1"}])
    cut = base.rindex(b"]")
    raw = base[:cut] + b',{"role":"user","content":' + SHAPES[shape](200_000) + b"}" + base[cut:]
    memory = warmed()
    reused = memory.reused
    assert memory.parse(raw, "t", "chat", "messages", read_json_body) == read_json_body(raw)[0]
    assert memory.reused == reused  # decoded whole: more tokens than reading them is worth


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_backward_read_stops_at_the_limit(shape: str) -> None:
    base = body([])
    cut = base.rindex(b"]")
    raw = base[:cut] + b',{"role":"user","content":' + SHAPES[shape](200_000) + b"}" + base[cut:]
    parsed = read_json_body(raw)[0]
    assert module._read_back(raw, parsed, "messages") is None  # its last element holds more tokens than the limit
    assert module._read_back(base, read_json_body(base)[0], "messages") is not None
