"""proxy.core.bands: system band / history / current turn / working memory, turns and atomic tool groups."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.bands import Bands, assign_groups, known_turns, split_bands, split_turns, tool_groups
from proxy.core.items import ASSISTANT, NO_GROUP, OTHER, SYSTEM, TOOL, USER, Item


def items(spec: str) -> list[Item]:
    """A compact conversation: s=system u=user a=assistant c<ids>=call(s) t<id>=result o=other.

    ``"s u c1,2 t1 t2 a"``: system, user, an assistant calling 1 and 2, their results, an answer.
    """
    out: list[Item] = []
    for i, tok in enumerate(spec.split()):
        kind, rest = tok[0], tok[1:]
        if kind == "s":
            out.append(Item({"i": i}, SYSTEM, source=i))
        elif kind == "u":
            out.append(Item({"i": i}, USER, source=i))
        elif kind == "a":
            out.append(Item({"i": i}, ASSISTANT, source=i))
        elif kind == "c":
            out.append(Item({"i": i}, ASSISTANT, call_ids=tuple(rest.split(",")), source=i))
        elif kind == "t":
            out.append(Item({"i": i}, TOOL, result_id=rest, source=i))
        elif kind == "o":
            out.append(Item({"i": i}, OTHER, source=i))
        else:  # pragma: no cover
            raise ValueError(tok)
    return out


def sources(xs: list[Item]) -> list[int]:
    return [x.source for x in xs]


@pytest.mark.parametrize(("spec", "system", "history", "current", "wm"), [
    ("s s u a u", [0, 1], [2, 3], 4, []),
    ("s u c1 t1", [0], [], 1, [2, 3]),
    ("u", [], [], 0, []),
    ("s", [0], [], None, []),
    ("s a c1 t1", [0], [], None, [1, 2, 3]),  # no user: all after the system band is working memory
    ("u s u a", [], [0, 1], 2, [3]),  # a system item after the first user is history, not the band
    ("s u a u c1 t1 a", [0], [1, 2], 3, [4, 5, 6]),
    ("o s u", [], [0, 1], 2, []),
])
def test_split_bands(spec: str, system: list[int], history: list[int], current: int | None, wm: list[int]) -> None:
    xs = items(spec)
    bands = split_bands(xs)
    assert sources(bands.system) == system
    assert sources(bands.history) == history
    assert (bands.current.source if bands.current is not None else None) == current
    assert sources(bands.working_memory) == wm
    assert bands.flatten() == xs  # the bands partition the list, in order


def test_split_bands_of_nothing() -> None:
    bands = split_bands([])
    assert bands == Bands([], [], None, [])
    assert bands.flatten() == []


def test_flatten_places_the_summary_after_the_system_band() -> None:
    xs = items("s u a u c1 t1")
    summary = Item({"summary": True}, SYSTEM)
    flat = split_bands(xs).flatten(summary)
    assert flat[0] is xs[0] and flat[1] is summary and flat[2:] == xs[1:]


@pytest.mark.parametrize(("spec", "turns"), [
    ("u a u a", [[0, 1], [2, 3]]),
    ("a c1 t1 u a", [[0, 1, 2], [3, 4]]),  # a preamble turn before the first user
    ("u", [[0]]),
    ("", []),
    ("o o", [[0, 1]]),
    ("u u u", [[0], [1], [2]]),
])
def test_split_turns(spec: str, turns: list[list[int]]) -> None:
    assert [sources(t) for t in split_turns(items(spec))] == turns


@pytest.mark.parametrize(("spec", "merge", "groups"), [
    ("u c1 t1 a", False, [[0], [1, 2], [3]]),
    ("c1,2 t1 t2", False, [[0, 1, 2]]),
    ("c1 c2 t1 t2", False, [[0], [1, 2, 3]]),  # without merging, the second call item starts a new group
    ("c1 c2 t1 t2", True, [[0, 1, 2, 3]]),  # a run of calls is one group on a merging wire
    ("c1 c2 t1 t2 c3 t3", True, [[0, 1, 2, 3], [4, 5]]),  # results close the run
    ("c1 t1 c2 t2", True, [[0, 1], [2, 3]]),
    ("t1 a", False, [[0], [1]]),  # a stray result (never after pairing) is a group of its own
    ("a t1", False, [[0], [1]]),
    ("u c1 u t1", False, [[0], [1], [2], [3]]),  # an open call group ends at a non-result item
])
def test_assign_groups_and_tool_groups(spec: str, merge: bool, groups: list[list[int]]) -> None:
    xs = items(spec)
    assign_groups(xs, merge)
    assert all(x.group != NO_GROUP for x in xs)
    assert [sources(g) for g in tool_groups(xs)] == groups


def test_group_numbers_increase() -> None:
    xs = items("s u c1 t1 a c2 t2")
    assign_groups(xs, False)
    numbers = [x.group for x in xs]
    assert numbers == sorted(numbers)
    assert len(set(numbers)) == 5


def test_tool_groups_without_groups_makes_each_item_its_own_group() -> None:
    xs = items("u c1 t1 a")
    assert [sources(g) for g in tool_groups(xs)] == [[0], [1], [2], [3]]


def test_tool_groups_of_a_sublist_with_the_same_group_number_apart() -> None:
    xs = items("c1 t1 u c2 t2")
    assign_groups(xs, False)
    # a sublist (what remains after a trim) keeps items' numbers; adjacent equal numbers form one group
    kept = [xs[0], xs[1], xs[3], xs[4]]
    assert [sources(g) for g in tool_groups(kept)] == [[0, 1], [3, 4]]


@given(st.lists(st.sampled_from(["s", "u", "a", "c1", "c1,2", "c3", "t1", "t2", "t3", "o"]), max_size=14),
       st.booleans(), st.data())
def test_numbering_from_a_start_gives_the_numbers_of_the_whole_list(tokens: list[str], merge: bool,
                                                                     data: st.DataObject) -> None:
    """A resumed conversation numbers only what it appended: the groups are those of numbering the whole list."""
    whole = items(" ".join(tokens))
    assign_groups(whole, merge)
    start = data.draw(st.integers(0, len(tokens)))
    resumed = items(" ".join(tokens))
    assign_groups(resumed[:start], merge)
    assign_groups(resumed, merge, start)
    assert [i.group for i in resumed] == [i.group for i in whole]


def _item(data: st.DataObject) -> Item:
    return Item({}, data.draw(st.sampled_from([USER, ASSISTANT, TOOL, USER])), tokens=data.draw(st.integers(0, 9)))


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_known_turns_gives_what_split_turns_gives_whatever_came_before(data: st.DataObject) -> None:
    """A history that repeats the one its first item began last time (the very items) reuses the turns that end
    before they differ; whatever the next history appends, edits, truncates or extends its last turn with, the
    turns and their tokens are those of a fresh split."""
    history = [_item(data) for _ in range(data.draw(st.integers(1, 8)))]
    for _ in range(data.draw(st.integers(1, 8))):
        edit = data.draw(st.sampled_from(["append", "append", "edit", "truncate", "same", "unkept"]))
        history = list(history)
        if edit == "append":
            history += [_item(data) for _ in range(data.draw(st.integers(1, 4)))]
        elif edit == "edit":
            history[data.draw(st.integers(0, len(history) - 1))] = _item(data)
        elif edit == "truncate":
            history = history[:data.draw(st.integers(1, len(history)))]
        elif edit == "unkept":
            new = _item(data)
            new.unkept = True
            history.append(new)
        turns, tokens = known_turns(history)
        fresh = split_turns(history)
        assert [[id(i) for i in t] for t in turns] == [[id(i) for i in t] for t in fresh], edit
        assert tokens == [sum(i.tokens for i in t) for t in fresh], edit
        if edit == "unkept":
            assert history[0].split is None or history[-1] not in history[0].split[0]


def test_known_turns_splits_only_what_follows_the_turns_it_knows() -> None:
    history = [Item({}, USER if i % 3 == 0 else ASSISTANT, tokens=1) for i in range(30)]
    first, _ = known_turns(history)
    grown = [*history, Item({}, ASSISTANT, tokens=1), Item({}, USER, tokens=1)]
    turns, tokens = known_turns(grown)
    assert all(a is b for a, b in zip(turns[:9], first))  # the turns that ended before the growth: the same lists
    assert turns[9] is not first[9] and len(turns[9]) == 4 and tokens[-2:] == [4, 1]
