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
    first = masking._results(turns)[0]
    assert same(first, fresh(turns))
    seen: list[int] = []

    class Counting(list[Item]):
        def __iter__(self) -> Any:
            seen.append(1)
            return super().__iter__()

    grown = [*turns, Counting(turn(2, ["a", "z"]))]
    walked = [Counting(t) for t in turns]  # (the same items in new lists, as split_turns makes them)
    grown[:20] = walked
    got = masking._results(grown)[0]
    assert len(seen) == 2  # the new turn (walked, checked for unkept items); none of the 20 known
    assert same(got, fresh(grown))
    assert masking._results(grown)[0] is not masking._results(grown)[0]  # the caller's own list


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
        assert same(masking._results(turns)[0], fresh(turns)), step


def _sized_turn(data: st.DataObject, ids: list[str]) -> list[Item]:
    """A user item, then rounds of a call and its result, with drawn token counts."""
    items = [Item({}, "user", tokens=data.draw(st.integers(1, 50)))]
    for j in range(data.draw(st.integers(0, 4))):
        cid = ids[j % len(ids)]
        items.append(Item({}, "assistant", call_ids=(cid,), key=data.draw(st.integers(1, 3)), tokens=5))
        items.append(Item({"n": j}, "tool", result_id=cid, tokens=data.draw(st.integers(1, 400)),
                          pinned=data.draw(st.integers(0, 9)) == 0))
    return items


def _shape(masking_out: Any, turns: list[list[Item]]) -> Any:
    """The masked history: the client's items by identity, masked copies by what they hold (a result answering a
    call with no content key is masked anew each time: equal copies, not the same one)."""
    if masking_out is None:
        return None
    client = {id(item) for turn in turns for item in turn}
    view = masking_out.view
    return ([[id(item) if id(item) in client else (repr(item.raw), item.tokens, item.group) for item in turn]
             for turn in view.turns], view.turn_tokens, masking_out.masked, masking_out.saved)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_what_masking_remembers_gives_what_masking_afresh_gives(data: st.DataObject) -> None:
    """What masking worked out for a walk (``_Memo``: each result's outcome, the grid, the last masked set) is read
    back by the next request that repeats the walk's turns: whatever the requests grow, edit, drop, swap or mask,
    and whatever their budget, threshold, step and kept results, the masked history is the one a request that
    remembers nothing makes."""
    from dataclasses import replace

    from plugins.base import HistoryView
    from proxy.core.budget import TrimmerParams, compute_budget
    from tests.helpers import services

    def mask(item: Item, text: str) -> Item | None:
        if item.raw.get("n") == 3:
            return None  # an output the wire cannot write as text
        return Item({"masked": text}, item.role, result_id=item.result_id, tokens=40)

    ids = ["a", "b", "c", "d"]
    turns = [_sized_turn(data, data.draw(st.permutations(ids))) for _ in range(3)]
    base = compute_budget(window=10**8, request_max_tokens=None, model_max_output=None,
                          trimmer=TrimmerParams(max_tokens=1_000), tenant_cap=None)
    for _ in range(data.draw(st.integers(1, 10))):
        step = data.draw(st.sampled_from(["grow", "grow", "grow", "edit", "drop", "swap", "mask", "same"]))
        turns = [list(t) for t in turns]
        if step == "grow":
            turns.append(_sized_turn(data, data.draw(st.permutations(ids))))
        elif step == "edit":
            t = data.draw(st.integers(0, len(turns) - 1))
            turns[t] = _sized_turn(data, data.draw(st.permutations(ids)))
        elif step == "drop" and len(turns) > 1:
            del turns[data.draw(st.integers(1, len(turns) - 1))]
        elif step == "swap" and len(turns) > 2:
            turns[1], turns[2] = turns[2], turns[1]
        elif step == "mask":
            t = data.draw(st.integers(0, len(turns) - 1))
            if len(turns[t]) > 1:
                at = data.draw(st.integers(1, len(turns[t]) - 1))
                old = turns[t][at]
                turns[t][at] = Item({}, old.role, call_ids=old.call_ids, result_id=old.result_id, tokens=old.tokens)
        tokens = [sum(item.tokens for item in turn) for turn in turns]
        budget = replace(base, threshold=data.draw(st.integers(0, max(1, sum(tokens)))),
                         hard_budget=data.draw(st.sampled_from([100, 1_000, 5_000])))
        view = HistoryView(turns=turns, turn_tokens=tokens, chain_fn=lambda: [], pinned_tokens=0, budget=budget,
                           counter=None,  # type: ignore[arg-type]
                           services=services(None), summary_item=lambda text, n: Item({}, "system"),
                           mask=mask, working_memory_results=data.draw(st.integers(0, 2)))
        keep, grid_step = data.draw(st.integers(0, 6)), data.draw(st.sampled_from([1, 2, 10]))
        holder = turns[0][0]
        remembered = holder.walk
        holder.walk = None
        afresh = _shape(masking.mask_observations(view, keep, grid_step), turns)
        holder.walk = remembered
        assert _shape(masking.mask_observations(view, keep, grid_step), turns) == afresh, step
        assert _shape(masking.mask_observations(view, keep, grid_step), turns) == afresh, step  # and read back at once
        # a look-ahead masking further on the same turns (the summarising manager's), then the request's own again
        ahead = replace(view, budget=replace(budget, threshold=data.draw(st.integers(0, max(1, sum(tokens))))))
        masking.mask_observations(ahead, keep, grid_step)
        assert _shape(masking.mask_observations(view, keep, grid_step), turns) == afresh, step
