"""render_messages with its memo (an outside review's property), over sequences where the reference (fresh) render
does not re-point the items in between (its effects are undone): items keep whatever pointers the memo path left
them, as in the proxy; requests re-use the objects of older bodies (what the body reader hands out), branch, cut,
mask, summarise."""

from __future__ import annotations

import copy
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.wire.messages import translator
from proxy.wire.messages.items import AnthropicItem
from proxy.wire.messages.translator import mask_result, render_messages
from tests.wire.test_messages_render_memo import conversation, parse, summary


def fresh_undone(items: list[Any], sent: list[Any]) -> list[Any]:
    every = {id(i): i for i in items if isinstance(i, AnthropicItem)}
    for i in list(every.values()):
        for s in i.siblings:
            every[id(s)] = s
    saved = {k: (v.raw, v.message, v.blocks, v.rendered) for k, v in every.items()}
    with pytest.MonkeyPatch.context() as m:
        m.setattr(translator, "ANCHORS", 0)
        out = render_messages(items, sent)
    for k, v in every.items():
        v.raw, v.message, v.blocks, v.rendered = saved[k]
    return out


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_memo_equals_fresh(data: st.DataObject) -> None:
    messages = conversation(data.draw(st.integers(2, 10)), data.draw(st.integers(0, 9)))
    items = parse(messages)
    bodies = [messages]  # every body sent so far (their objects)
    lists = [items]
    for _ in range(data.draw(st.integers(2, 9))):
        step = data.draw(st.sampled_from(["append", "mask", "summary", "cut", "redecode", "old", "same", "branch",
                                          "olditems"]))
        if step == "append":
            messages = messages + conversation(data.draw(st.integers(1, 3)), data.draw(st.integers(0, 9)))[1:]
            items = parse(messages, len(bodies[-1]) if len(bodies[-1]) <= len(messages) else 0, items)
        elif step == "mask":
            at = data.draw(st.integers(0, len(items) - 1))
            c = mask_result(items[at], "[masked]")
            items = [*items[:at], c, *items[at + 1:]] if c is not None else items
        elif step == "summary":
            items = [summary(), *[i for i in items if i.source >= 0]]
        elif step == "cut":
            items = items[data.draw(st.integers(0, len(items) - 1)):]
        elif step == "redecode":
            messages = copy.deepcopy(messages)
        elif step == "old":  # an older body's objects for the prefix, re-used by the body reader
            old = data.draw(st.sampled_from(bodies))
            n = min(len(old), len(messages))
            if all(orjson.dumps(a) == orjson.dumps(b) for a, b in zip(old[:n], messages[:n])):
                messages = [*old[:n], *messages[n:]]
        elif step == "branch":  # the same prefix objects, another tail: items of the tail parsed anew
            n = data.draw(st.integers(2, len(messages)))
            keep = [i for i in items if i.source < n]
            if (messages[n - 1]["role"] == "user" and n == len(messages)) or all(i.source < n for i in items):
                messages = [*messages[:n], *conversation(2, 5)[1:]]
                items = parse(messages, n, keep)
        elif step == "olditems":
            prev = data.draw(st.sampled_from(lists))
            if all(i.source < len(messages) for i in prev):
                items = prev
        if any(i.source >= len(messages) for i in items):
            continue
        bodies.append(messages)
        lists.append(items)
        out = render_messages(items, messages)
        want = fresh_undone(items, messages)
        assert orjson.dumps(out) == orjson.dumps(want), step
        for got, w in zip(out, want):
            if any(w is s for s in messages):
                assert got is w, step
