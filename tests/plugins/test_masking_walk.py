"""Observation masking's remembered walk of a history (``Item.walk``): whatever a later request's turns share with
the walked ones, grow, edit, reorder or mask, the results found are those a fresh walk finds, and a history that
only grows walks only its new turns."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from plugins import masking
from proxy.core.items import Item


def fresh(turns: list[list[Item]]) -> list[Any]:
    calls: dict[str, Item] = {}
    out: list[Any] = []
    for t, turn in enumerate(turns):
        for i, item in enumerate(turn):
            for call_id in item.call_ids:
                calls[call_id] = item
            if item.result_id is not None and item.role == "tool":
                out.append((t, i, item, calls.get(item.result_id)))
    return out


def turn(n: int, ids: list[str]) -> list[Item]:
    """A user item, then ``n`` rounds of a call and its result (ids drawn from ``ids``: repeated ids answer the
    latest call)."""
    items = [Item({}, "user")]
    for j in range(n):
        cid = ids[j % len(ids)]
        items.append(Item({}, "assistant", call_ids=(cid,)))
        items.append(Item({}, "tool", result_id=cid))
    return items


def same(a: list[Any], b: list[Any]) -> bool:
    return [(t, i, id(r), id(c)) for t, i, r, c in a] == [(t, i, id(r), id(c)) for t, i, r, c in b]


def test_a_growing_history_walks_only_its_new_turns() -> None:
    turns = [turn(3, ["a", "b", "c"]) for _ in range(20)]
    first = masking._results(turns)
    assert same(first, fresh(turns))
    seen: list[int] = []

    class Counting(list[Item]):
        def __iter__(self) -> Any:
            seen.append(1)
            return super().__iter__()

    grown = [*turns, Counting(turn(2, ["a", "z"]))]
    walked = [Counting(t) for t in turns]  # (the same items in new lists, as split_turns makes them)
    grown[:20] = walked
    got = masking._results(grown)
    assert len(seen) == 3  # the new turn (walked, checked for unkept items, remembered); none of the 20 known
    assert same(got, fresh(grown))
    assert masking._results(grown) is not masking._results(grown)  # the caller's own list


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_sequence_of_walks_finds_what_a_fresh_walk_finds(data: st.DataObject) -> None:
    ids = ["a", "b", "c", "d"]
    turns = [turn(data.draw(st.integers(0, 3)), data.draw(st.permutations(ids))) for _ in range(3)]
    for _ in range(data.draw(st.integers(1, 8))):
        step = data.draw(st.sampled_from(["grow", "edit", "drop", "swap", "mask", "extend_last", "same"]))
        turns = [list(t) for t in turns]  # every request has lists of its own
        if step == "grow":
            turns.append(turn(data.draw(st.integers(0, 3)), data.draw(st.permutations(ids))))
        elif step == "edit" and turns:
            t = data.draw(st.integers(0, len(turns) - 1))
            turns[t] = turn(data.draw(st.integers(0, 3)), data.draw(st.permutations(ids)))
        elif step == "drop" and len(turns) > 1:
            del turns[data.draw(st.integers(1, len(turns) - 1))]
        elif step == "swap" and len(turns) > 2:
            turns[1], turns[2] = turns[2], turns[1]
        elif step == "mask" and turns:
            t = data.draw(st.integers(0, len(turns) - 1))
            if len(turns[t]) > 1:
                at = data.draw(st.integers(1, len(turns[t]) - 1))
                old = turns[t][at]
                turns[t][at] = Item({}, old.role, call_ids=old.call_ids, result_id=old.result_id)
        elif step == "extend_last" and turns:
            turns[-1] = [*turns[-1], *turn(1, ["a"])[1:]]
        assert same(masking._results(turns), fresh(turns)), step
