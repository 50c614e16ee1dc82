"""Bodies read from where they differ (``proxy.serve.bodies``): always what a whole parse gives, refused as it refuses,
and decoded whole only when nothing known can be reused."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from proxy.core.errors import CtxProxyError
from proxy.serve.bodies import KnownBodies, read_json_body

Serialize = Callable[[Any], bytes]

SERIALIZERS: dict[str, Serialize] = {
    "python": lambda v: json.dumps(v).encode(),
    "compact": lambda v: json.dumps(v, separators=(",", ":"), ensure_ascii=False).encode(),
    "indented": lambda v: json.dumps(v, indent=2).encode(),
    "orjson": orjson.dumps,
}


class Counted:
    """``read_json_body``, counting the bodies it decodes whole."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, raw: bytes) -> tuple[dict[str, Any], bool]:
        self.calls += 1
        return read_json_body(raw)


def outcome(parse: Callable[[], dict[str, Any]]) -> Any:
    try:
        return ("ok", parse())
    except CtxProxyError as exc:
        return ("refused", exc.status, exc.code, str(exc))


def same_as_whole(memory: KnownBodies, raw: bytes, whole: Counted | None = None, tenant: str = "t",
                  field: str = "messages") -> Any:
    """What ``memory`` reads from ``raw`` equals what a whole parse reads (a refusal included)."""
    got = outcome(lambda: memory.parse(raw, tenant, "chat", field, whole or Counted()))
    assert got == outcome(lambda: read_json_body(raw)[0])
    return got


def message(i: int, size: int = 400) -> dict[str, Any]:
    return {"role": "user" if i % 2 else "assistant", "content": f"turn {i} " + "w" * size}


def agent_body(n: int, **extra: Any) -> dict[str, Any]:
    return {"model": "gpt-4o", "messages": [message(i) for i in range(n)],
            "tools": [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}],
            "stream": False, **extra}


@pytest.mark.parametrize("style", sorted(SERIALIZERS))
def test_a_growing_conversation_is_decoded_whole_three_times_then_only_its_new_turns(style: str) -> None:
    dump = SERIALIZERS[style]
    memory, whole = KnownBodies(min_bytes=0), Counted()
    for n in range(3, 40):  # (a body shorter than the 1 kB that names its bucket is in a bucket of its own)
        same_as_whole(memory, dump(agent_body(n)), whole)
    # the first body is decoded whole, the second too (and its places found, reading it backwards), the third whole
    # with the probe that proves them; from then on only what is new
    assert whole.calls == 3


def test_the_same_body_again_is_not_decoded_again() -> None:
    memory, whole = KnownBodies(min_bytes=0), Counted()
    raw = orjson.dumps(agent_body(30))
    for _ in range(5):
        same_as_whole(memory, raw, whole)
    assert whole.calls == 3


def test_a_client_that_sends_its_last_messages_anew_is_read_from_before_them() -> None:
    """A client that moves a cache mark to the last message changes the message that had it."""
    memory, whole = KnownBodies(min_bytes=0), Counted()
    for n in range(3, 30):
        body = agent_body(n)
        body["messages"][-1] = {**body["messages"][-1], "cache_control": {"type": "ephemeral"}}
        same_as_whole(memory, json.dumps(body).encode(), whole)
    assert whole.calls == 3


def test_another_tenant_or_wire_reuses_nothing() -> None:
    memory, whole = KnownBodies(min_bytes=0), Counted()
    raw = orjson.dumps(agent_body(20))
    same_as_whole(memory, raw, whole)
    same_as_whole(memory, raw, whole)
    calls = whole.calls
    same_as_whole(memory, raw, whole, tenant="other")
    assert memory.parse(raw, "t", "messages", "messages", whole) == read_json_body(raw)[0]
    assert whole.calls == calls + 2


@pytest.mark.parametrize("tail", [
    b',"messages":[{"role":"user","content":"replaced"}]}',  # a repeated key replaces the array the probe is in
    b',"model":"other"}',  # a repeated guarded field: refused
    b',"stream":true}',
    b',"n":12345678901234567890123}',  # an integer read exactly
    b',"x":"],\\"messages\\":[1]"}',
])
def test_a_body_whose_tail_changes_or_repeats_a_field_is_read_as_a_whole_parse_reads_it(tail: bytes) -> None:
    memory = KnownBodies(min_bytes=0)
    for n in (10, 11, 12):
        raw = orjson.dumps(agent_body(n))
        same_as_whole(memory, raw)
        same_as_whole(memory, raw[:-1] + tail)


@pytest.mark.parametrize("new", [
    b',{"role":"user","content":"a"',  # not closed
    b',12345678901234567890123',  # a run of digits: read exactly by the whole parse
    b'{"role":"user"}',  # no comma
    b',',
    b',"x"]',
    b',{"a":1}],"messages":[{"b":2}',
    b',null',
    b',{"content":"\\u00e9\\"]}"}',
])
def test_new_bytes_that_are_not_elements_are_read_as_a_whole_parse_reads_them(new: bytes) -> None:
    memory = KnownBodies(min_bytes=0)
    for n in (5, 6, 7):
        same_as_whole(memory, orjson.dumps(agent_body(n)))
    raw = orjson.dumps(agent_body(7))
    cut = raw.index(b'],"tools"')
    same_as_whole(memory, raw[:cut] + new + raw[cut:])


def test_a_bucket_whose_bodies_never_match_is_read_backwards_less_and_less() -> None:
    memory = KnownBodies(min_bytes=0)
    reads = []
    for i in range(20):
        body = agent_body(5, temperature=i / 10)  # the tail changes every time: nothing matches
        same_as_whole(memory, orjson.dumps(body))
        reads.append(sum(len(b.bodies) for b in memory._buckets.values()))
    assert reads[-1] <= 5  # read back at misses 1, 2, 4, 8, 16 only


def test_memory_is_bounded() -> None:
    memory = KnownBodies(max_bytes=200_000, min_bytes=0)
    for conversation in range(30):
        for n in (10, 11, 12):
            body = agent_body(n)
            body["messages"][0] = {"role": "system", "content": f"conversation {conversation} " + "s" * 2000}
            same_as_whole(memory, orjson.dumps(body))
        assert memory.size <= 200_000


TEXT = st.text(alphabet=st.sampled_from([*'ab "\\]}[{,:é\n\t', "\u2028", "\x00"]), max_size=12)
VALUE = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | TEXT,
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                     max_leaves=6)
PADDING = {"role": "system", "content": "p" * 1100}
ELEMENT = st.dictionaries(TEXT, VALUE, max_size=3) | VALUE


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(head=st.dictionaries(st.sampled_from(["model", "a", "b", "tools"]), VALUE, max_size=3),
       tail=st.dictionaries(st.sampled_from(["stream", "c", "d", "tools"]), VALUE, max_size=3),
       elements=st.lists(ELEMENT, min_size=1, max_size=12),
       style=st.sampled_from(sorted(SERIALIZERS)),
       steps=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 5)), min_size=1, max_size=8))
def test_any_sequence_of_bodies_reads_as_a_whole_parse_reads_each(
        head: dict[str, Any], tail: dict[str, Any], elements: list[Any], style: str,
        steps: list[tuple[int, int, int]]) -> None:
    memory, whole = KnownBodies(min_bytes=0), Counted()
    sent = 1
    for grow, resend, other_tail in steps:
        sent = min(len(elements), sent + grow)
        messages = [PADDING, *elements[:sent]]  # the same first kilobyte: one bucket
        for i in range(max(0, sent - resend), sent):  # the last few sent anew
            messages[i] = {"again": messages[i]}
        body = {**{k: v for k, v in head.items() if k not in tail}, "messages": messages,
                **(tail if other_tail else {**tail, "d": sent})}
        same_as_whole(memory, SERIALIZERS[style](body), whole)
    event(f"decoded whole {whole.calls} of {len(steps)}")


@pytest.mark.parametrize("style", ["python", "compact"])
def test_a_string_longer_than_the_window_read_backwards_is_read_whole(style: str) -> None:
    """The end of a body is read backwards in a window that grows when a string crosses its edge: a last message
    and tools of 60 kB each of brackets, commas, escaped quotes and backslashes are still read exactly."""
    dump = SERIALIZERS[style]
    tricky = '],"x":[{"y":"\\\\"}]},' * 2800  # ~60 kB
    memory, whole = KnownBodies(min_bytes=0), Counted()
    for n in range(5, 11):  # (its first kilobyte, which names its bucket, holds no message sent anew)
        body = agent_body(n)
        body["messages"][-1] = {"role": "tool", "content": tricky + str(n)}
        body["tools"] = [{"name": tricky}]  # after the array, and longer than the window too
        same_as_whole(memory, dump(body), whole)
    assert whole.calls == 3


def test_places_a_probe_does_not_prove_are_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    """Places the backward read got wrong (here made so: in 'tools' rather than 'messages') are not used: the probe
    lands outside the conversation's array, the body is read as decoded whole, and the places are forgotten rather
    than tried (and the body decoded twice) again."""
    from proxy.serve import bodies

    raw = orjson.dumps(agent_body(10)).replace(b'"stream"', b'"more":[{"a":1},{"b":2}],"stream"')
    wrong = raw.index(b',{"b":2}')

    def misread(raw: bytes, body: dict[str, Any], field_name: str) -> bodies.Known:
        return bodies.Known(raw, body, [(wrong, 9)], raw.index(b"]", wrong), False, len(raw))

    monkeypatch.setattr(bodies, "_read_back", misread)
    memory, whole = KnownBodies(min_bytes=0), Counted()
    for _ in range(6):
        same_as_whole(memory, raw, whole)
    # 1: seen; 2: read back; 3: the probe and the whole parse; 4: read back again (the 4th miss); 5: as 3; 6: seen
    assert whole.calls == 8
