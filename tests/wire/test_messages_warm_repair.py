"""A Messages conversation that needs a pairing repair after its remembered prefix (a user message whose
text comes before its tool_result, results split over two user messages, a stray or duplicate result …) paid the
warm path's work and then the full parse on every request: each of its messages after the prefix was split, keyed
and counted twice (``MessagesWire.resume`` falls back to ``parse`` after ``_split`` and ``is_paired`` of the tail).
Before the warm path such a request was parsed once; it then cost about twice as much, request after request
(found by an outside review; measured: ~38 ms against ~17 ms for ``parse`` on 6,000 messages, the token LRU warm)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

import proxy.wire.messages.translator as translator
from proxy.core.tokens import TokenCounter
from proxy.wire.messages import WIRE
from tests.helpers import words
from tests.wire.messages_helpers import assistant, body, text_block, tool_result, tool_use, user


def conversation(rounds: int) -> list[dict[str, Any]]:
    """An agent loop whose second round's user message puts a note before its result (repaired: moved_result)."""
    messages: list[dict[str, Any]] = [user("Read every file.")]
    for i in range(rounds):
        messages.append(assistant([text_block("step"), tool_use(f"toolu_{i}", "Read", path=f"/{i}")]))
        result = tool_result(f"toolu_{i}", words(50, i))
        messages.append(user([text_block("note"), result] if i == 1 else [result]))
    return messages


def test_a_request_that_needs_a_repair_is_split_no_more_than_a_cold_parse_splits_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"n": 0}
    split = translator.split_message

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        return split(*args, **kwargs)

    monkeypatch.setattr(translator, "split_message", counting)
    counter = TokenCounter("o200k_base")
    messages = conversation(200)
    WIRE.resume(body(copy.deepcopy(messages[:3])), counter, "t")  # remembered: the first round, before the repair
    grown = body([*messages, assistant("done"), user("and now?")])
    calls["n"] = 0
    WIRE.parse(copy.deepcopy(grown), counter)
    cold = calls["n"]
    calls["n"] = 0
    conversation_ = WIRE.resume(copy.deepcopy(grown), counter, "t")
    assert conversation_.paired is False  # the repair still happens (the result is the cold one)
    assert calls["n"] <= cold, f"split {calls['n']} messages where a cold parse splits {cold}"
