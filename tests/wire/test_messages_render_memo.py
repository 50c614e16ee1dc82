"""A Messages render remembered with its conversation (``render_messages``'s memo): whatever a later request
shares with it, edits, masks, summarises or re-decodes, the messages rendered are those a fresh render gives,
byte for byte, with the client's own objects wherever a fresh render sends them; and a request that appends turns
to a remembered conversation reuses what was rendered instead of making it again."""

from __future__ import annotations

import copy
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.items import Item
from proxy.wire.messages import translator
from proxy.wire.messages.items import AnthropicItem
from proxy.wire.messages.translator import mask_result, render_messages, split_message
from tests.wire.messages_helpers import assistant, text_block, tool_result, tool_use, user

Message = dict[str, Any]


def conversation(rounds: int, seed: int = 0) -> list[Message]:
    messages: list[Message] = [user(f"Investigate {seed}.")]
    for i in range(rounds):
        ids = [f"toolu_{i}_{j}" for j in range(1 + (i + seed) % 3)]
        messages.append(assistant([text_block(f"step {i}"), *(tool_use(x, "Read", p=x) for x in ids)]))
        results: list[Any] = [tool_result(x, f"output {x} " * 5) for x in ids]
        if (i + seed) % 4 == 1:
            results.append(text_block(f"also {i}"))
        messages.append(user(results))
        if (i + seed) % 5 == 2:
            messages.append(assistant(f"done {i}"))
            messages.append(user(f"next {i}"))
    return messages


def parse(messages: list[Message], start: int = 0, known: list[Item] | None = None) -> list[Item]:
    """Items of ``messages[start:]`` after ``known`` (an earlier request's, resumed), remembered as the wire does."""
    items: list[Item] = list(known or [])
    for i in range(start, len(messages)):
        before = messages[i - 1]["role"] if i > 0 else None
        for item in split_message(messages[i], i, after_assistant=before == "assistant"):
            item.remembered = True
            items.append(item)
            root = items[0]
            assert isinstance(root, AnthropicItem)
            item.root = root
    return items


def summary(text: str = "summary") -> AnthropicItem:
    raw: Message = {"role": "user", "content": [{"type": "text", "text": text}]}
    return AnthropicItem(raw, "user", message=raw, blocks=raw["content"])


def fresh(items: list[Item], sent: list[Any], monkeypatch: pytest.MonkeyPatch) -> list[Message]:
    with monkeypatch.context() as m:
        m.setattr(translator, "ANCHORS", 0)
        return render_messages(items, sent)


def same_as_fresh(items: list[Item], sent: list[Any], monkeypatch: pytest.MonkeyPatch) -> list[Message]:
    """Render with the memo first (so a re-pointing it skipped is not done for it), then fresh; they must agree."""
    out = render_messages(items, sent)
    expected = fresh(items, sent, monkeypatch)
    assert orjson.dumps(out) == orjson.dumps(expected)
    for got, want in zip(out, expected):
        if any(want is s for s in sent):  # the client's own message: sent as that very object
            assert got is want
    return out


def test_an_appended_conversation_reuses_its_rendered_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    messages = conversation(30)
    items = parse(messages)
    masked = [(mask_result(item, "[masked]") if item.role == "tool" and item.source < 40 else None) or item
              for item in items]
    first = same_as_fresh([summary(), *masked], messages, monkeypatch)
    longer = messages + conversation(3, seed=7)[1:]
    items2 = parse(longer, len(messages), masked)
    runs: list[int] = []
    made = translator._user_message

    def counted(run: list[AnthropicItem]) -> Message:
        runs.append(len(run))
        return made(run)

    monkeypatch.setattr(translator, "_user_message", counted)
    second = render_messages([summary(), *items2], longer)
    # made anew: the summary's message, the last one before the new turns, and the new turns' user messages
    assert len(runs) == 2 + sum(1 for m in longer[len(messages):] if m["role"] == "user")
    assert all(a is b for a, b in zip(first[1:-1], second[1:]))
    monkeypatch.undo()
    assert orjson.dumps(second) == orjson.dumps(fresh([summary(), *items2], longer, monkeypatch))


def test_a_re_decoded_body_renders_its_own_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    messages = conversation(12)
    items = parse(messages)
    same_as_fresh(items, messages, monkeypatch)
    again = copy.deepcopy(messages)  # the same conversation decoded whole: equal, not the same objects
    out = same_as_fresh(items, again, monkeypatch)
    assert not any(m is s for m in out for s in messages)


def test_a_changed_middle_is_rendered_anew(monkeypatch: pytest.MonkeyPatch) -> None:
    messages = conversation(12)
    items = parse(messages)
    same_as_fresh(items, messages, monkeypatch)
    edited = list(messages)
    edited[5] = copy.deepcopy(messages[5])
    edited[5]["content"][0]["content"] = "changed"
    items2 = parse(edited, 5, items[: next(i for i, it in enumerate(items) if it.source == 5)])
    same_as_fresh(items2, edited, monkeypatch)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_any_sequence_of_renders_is_a_fresh_render(data: st.DataObject) -> None:
    messages = conversation(data.draw(st.integers(2, 12)), data.draw(st.integers(0, 9)))
    items = parse(messages)
    with pytest.MonkeyPatch.context() as monkeypatch:
        for _ in range(data.draw(st.integers(1, 6))):
            step = data.draw(st.sampled_from(["append", "mask", "summary", "cut", "redecode", "edit", "same"]))
            sent = messages
            if step == "append":
                messages = messages + conversation(data.draw(st.integers(1, 3)), data.draw(st.integers(0, 9)))[1:]
                items = parse(messages, len(sent), items)
                sent = messages
            elif step == "mask":
                at = data.draw(st.integers(0, len(items) - 1))
                copy_ = mask_result(items[at], "[masked]")
                items = [*items[:at], copy_, *items[at + 1:]] if copy_ is not None else items
            elif step == "summary":
                items = [summary(), *items]
            elif step == "cut":
                items = items[data.draw(st.integers(0, len(items) - 1)):]
            elif step == "redecode":
                sent = messages = copy.deepcopy(messages)
            elif step == "edit":
                at = data.draw(st.integers(0, len(messages) - 1))
                messages = [*messages[:at], copy.deepcopy(messages[at]), *messages[at + 1:]]
                sent = messages
            same_as_fresh(items, sent, monkeypatch)
