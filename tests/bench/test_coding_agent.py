"""bench/coding_agent.py: seeded coding-agent sessions whose planted dependencies are what they claim to be."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from bench.coding_agent import conversations, loops, session
from bench.retention_data import Conversation, bounded, message_text
from proxy.core.tokens import Tokenizers, use_bundled_encodings


@pytest.fixture(scope="module")
def sessions() -> list[Conversation]:
    return conversations(10)


def test_the_same_seed_gives_the_same_conversations_byte_for_byte(sessions: list[Conversation]) -> None:
    again = conversations(10)
    assert json.dumps([c.messages for c in again]) == json.dumps([c.messages for c in sessions])
    assert [c.dependencies for c in again] == [c.dependencies for c in sessions]
    assert session(1).messages != session(2).messages


def test_every_session_is_longer_than_the_largest_budget(sessions: list[Conversation]) -> None:
    use_bundled_encodings()
    counter = Tokenizers().get("o200k_base")
    sizes = [sum(counter.text(json.dumps(m)) for m in c.messages) for c in sessions]
    assert min(sizes) > 32_000


def test_every_call_is_answered_right_after_it(sessions: list[Conversation]) -> None:
    for c in sessions:
        for i, m in enumerate(c.messages):
            if m.get("tool_calls"):
                ids = [call["id"] for call in m["tool_calls"]]
                answers = [r.get("tool_call_id") for r in c.messages[i + 1: i + 1 + len(ids)]]
                assert answers == ids


def test_a_planted_value_is_held_by_its_source_alone_until_a_later_turn_uses_it(sessions: list[Conversation]) -> None:
    """The source (a tool output, or the user's message for a ticket) holds the value as a whole token; no other
    message before the use does; the use is an assistant message of a later user turn that contains it."""
    kinds: Counter[str] = Counter()
    for c in sessions:
        texts = [message_text(m) for m in c.messages]
        turn_of, turn = [], -1
        for m in c.messages:
            turn += m["role"] == "user"
            turn_of.append(turn)
        assert len(c.dependencies) >= 8
        for dep in c.dependencies:
            kinds[dep.kind] += 1
            pattern = bounded(dep.value)
            assert pattern.search(texts[dep.source])
            assert c.messages[dep.source]["role"] == ("user" if dep.kind == "ticket" else "tool")
            assert not [i for i in range(dep.use) if i != dep.source and pattern.search(texts[i])]
            assert c.messages[dep.use]["role"] == "assistant" and pattern.search(texts[dep.use])
            assert turn_of[dep.use] > turn_of[dep.source]
    assert set(kinds) == {"grep_line", "commit", "port", "error_code", "deployment", "config", "ticket"}


def test_the_tool_outputs_look_like_a_coding_agents(sessions: list[Conversation]) -> None:
    calls = Counter(
        call["function"]["name"] for c in sessions for m in c.messages for call in m.get("tool_calls") or []
    )
    assert set(calls) == {"read_file", "grep", "run_tests", "shell", "http_get", "edit_file"}
    outputs = [m["content"] for c in sessions for m in c.messages if m["role"] == "tool"]
    assert any("=================================== FAILURES" in o for o in outputs)
    assert any(o.startswith("CONTAINER ID") for o in outputs)
    assert any(json.loads(o).get("deployments") for o in outputs if o.startswith("{\n"))
    assert max(len(o) for o in outputs) > 6000  # a long file read or JSON document


def test_a_tool_loop_is_one_user_turn_whose_later_calls_use_earlier_outputs() -> None:
    """The SWE-agent shape: one task, then only tool rounds (ctxproxy's working memory) until the closing answer;
    a planted value is used 3 or more rounds after its output, and no message in between holds it."""
    runs = loops(4)
    assert json.dumps([c.messages for c in runs]) == json.dumps([c.messages for c in loops(4)])
    for c in runs:
        roles = [m["role"] for m in c.messages]
        assert roles[:2] == ["system", "user"] and roles.count("user") == 1 and roles[-1] == "assistant"
        texts = [message_text(m) for m in c.messages]
        assert len(c.dependencies) >= 5
        for dep in c.dependencies:
            pattern = bounded(dep.value)
            assert dep.use - dep.source >= 5 and pattern.search(texts[dep.use])
            assert not [i for i in range(dep.use) if i != dep.source and pattern.search(texts[i])]
