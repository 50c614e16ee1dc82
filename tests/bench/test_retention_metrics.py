"""bench/retention_metrics.py: which forwarded elements count as kept, and which values count at all."""

from __future__ import annotations

from bench.retention_data import Conversation, Dependency
from bench.retention_metrics import Subject, kept_positions, strings


def test_an_element_replaced_in_place_is_not_kept_and_its_neighbours_are() -> None:
    assert kept_positions([b"s", b"u", b"c", b"r", b"a"], [b"s", b"u", b"c", b"R", b"a"]) == [True] * 3 + [False, True]


def test_a_summary_in_front_of_the_kept_turns_leaves_them_kept() -> None:
    assert kept_positions([b"s", b"u1", b"a1", b"u2", b"a2"], [b"s", b"S", b"u2", b"a2"]) == \
        [True, False, False, True, True]


def test_a_repeated_message_is_matched_in_its_own_place() -> None:
    """"Go on." sent twice: the first copy was dropped, the second kept; aligning greedily would keep the first and
    lose everything after it."""
    received = [b"s", b"go", b"t1", b"x", b"go", b"t2"]
    forwarded = [b"s", b"x", b"go", b"t2"]
    assert kept_positions(received, forwarded) == [True, False, False, True, True, True]


def test_strings_read_call_arguments_as_json() -> None:
    message = {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"amount": 250, "id": "NO6JO3"}'}}]}
    found = list(strings(message))
    assert "NO6JO3" in found and "250" in found and "assistant" not in found and "function" not in found


def test_values_the_system_prompt_holds_do_not_count() -> None:
    """A value the pinned system prompt holds is always forwarded: counting it would credit every strategy."""
    call = {
        "id": "c",
        "type": "function",
        "function": {"name": "f", "arguments": '{"date": "2024-05-15", "id": "ZX81Q"}'},
    }
    conversation = Conversation("x", [{"role": "system", "content": "Today is 2024-05-15."},
                                      {"role": "user", "content": "Go."},
                                      {"role": "assistant", "content": None, "tool_calls": [call]}],
                                [Dependency("ZX81Q", 1, 2)])
    subject = Subject(conversation)
    assert subject.acted[2] == frozenset({"ZX81Q"})
    assert subject.arguments[2] == frozenset({"ZX81Q"})
    assert subject.present(b"k", {"role": "user", "content": "ids ZX81Q, ZX81QQ"}) == frozenset({"ZX81Q"})
