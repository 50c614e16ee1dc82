"""proxy.core.items: the neutral item, its atoms' digests, chained turn digests and media digests."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.items import (
    ASSISTANT,
    NO_GROUP,
    OTHER,
    SYSTEM,
    TOOL,
    USER,
    Item,
    atom_digests,
    media_digest,
    turn_digest,
)


class AtomItem(Item):
    """An item whose atoms are given (what a wire adapter's subclass computes from its JSON)."""

    __slots__ = ("_atoms",)

    def __init__(self, atoms: list[tuple[str, ...]], role: str = USER) -> None:
        super().__init__({"atoms": atoms}, role)
        self._atoms = atoms

    def atoms(self) -> Iterator[tuple[str, ...]]:
        return iter(self._atoms)


def test_defaults() -> None:
    raw = {"role": "user", "content": "hi"}
    item = Item(raw, USER)
    assert item.raw is raw
    fields = (item.call_ids, item.result_id, item.source, item.pinned, item.key, item.tokens)
    assert fields == ((), None, -1, False, 0, 0)
    assert item.group == NO_GROUP
    assert item.describe() == ""
    assert list(item.atoms()) == []
    assert atom_digests(item) == b""


def test_keyword_fields_are_kept() -> None:
    item = Item({}, ASSISTANT, call_ids=("call_1", "call_2"), source=4, pinned=True, key=99, tokens=12)
    assert item.call_ids == ("call_1", "call_2")
    assert (item.source, item.pinned, item.key, item.tokens) == (4, True, 99, 12)
    assert "assistant" in repr(item) and "call_1" in repr(item) and "src=4" in repr(item)


@pytest.mark.parametrize(("role", "starts"), [(USER, True), (SYSTEM, False), (ASSISTANT, False), (TOOL, False),
                                              (OTHER, False)])
def test_only_a_user_item_starts_a_turn(role: str, starts: bool) -> None:
    assert Item({}, role).starts_turn is starts


def test_items_have_slots_no_dict() -> None:
    item = Item({}, USER)
    with pytest.raises(AttributeError):
        item.anything = 1  # type: ignore[attr-defined]


def test_atom_digests_are_16_bytes_per_atom_and_match_an_independent_blake2b() -> None:
    atoms = [("text", "user", "Book flight HAT001"), ("call", "call_9", "search", '{"from":"BOS"}')]
    got = atom_digests(AtomItem(atoms))
    assert len(got) == 32
    for i, atom in enumerate(atoms):
        h = hashlib.blake2b(digest_size=16)
        for part in atom:
            h.update(part.encode("utf-8") + b"\x1f")
        assert got[16 * i: 16 * (i + 1)] == h.digest()


@pytest.mark.parametrize(("a", "b"), [
    (("text", "user", "ab"), ("text", "usera", "b")),  # field boundaries count
    (("text", "user", "a"), ("text", "user", "a", "")),  # an empty trailing field counts
    (("result", "call_1", "ok"), ("result", "call_1", "ok ")),
    (("call", "c1", "f", "{}"), ("call", "c1", "f", "[]")),
])
def test_different_atoms_have_different_digests(a: tuple[str, ...], b: tuple[str, ...]) -> None:
    assert atom_digests(AtomItem([a])) != atom_digests(AtomItem([b]))


def test_lone_surrogates_in_atoms_do_not_raise() -> None:
    d1 = atom_digests(AtomItem([("call", "call_\ud800", "f", "{}")]))
    d2 = atom_digests(AtomItem([("call", "call_\udc00", "f", "{}")]))
    assert len(d1) == len(d2) == 16 and d1 != d2


def test_turn_digest_is_a_chain() -> None:
    a = atom_digests(AtomItem([("text", "user", "hello")]))
    b = atom_digests(AtomItem([("text", "assistant", "hi")]))
    first = turn_digest(b"", [a, b])
    assert len(first) == 16
    assert turn_digest(b"", [a, b]) == first  # deterministic
    assert turn_digest(b"", [b, a]) != first  # order counts
    assert turn_digest(first, [a, b]) != first  # the link counts
    # digests are concatenated: how a turn's atoms are split across its items does not matter
    assert turn_digest(b"", [a + b]) == first
    assert turn_digest(b"", [a, b"", b]) == first


@given(st.lists(st.tuples(st.text(max_size=8), st.text(max_size=8)), max_size=6))
def test_atom_digest_length_is_16_per_atom(atoms: list[tuple[str, ...]]) -> None:
    assert len(atom_digests(AtomItem(atoms))) == 16 * len(atoms)


@pytest.mark.parametrize(("x", "y", "same"), [
    ("data:image/png;base64,iVBORw0KGgo=", "data:image/jpeg;base64,iVBORw0KGgo=", True),  # only the payload
    ("data:image/png;base64,iVBORw0KGgo=", "iVBORw0KGgo=", True),
    ("https://example.com/cat.png", "https://example.com/cat.png", True),
    ("https://example.com/cat.png", "https://example.com/dog.png", False),
    ("file-abc123", "file-abc124", False),
    ("data:no-comma", "data:no-comma", True),
])
def test_media_digest(x: str, y: str, same: bool) -> None:
    dx, dy = media_digest(x), media_digest(y)
    assert len(dx) == 16 and all(c in "0123456789abcdef" for c in dx)
    assert (dx == dy) is same


def test_media_digest_without_a_comma_keeps_the_whole_string() -> None:
    assert media_digest("data:abc") != media_digest("abc")
    assert media_digest("x\ud800") != media_digest("x")  # a lone surrogate is hashed, not an error


def test_items_compare_by_identity() -> None:
    """The pipeline tells a forwarded list from the received one by list equality (``final != received``): one C pass
    of identity tests, which holds only while no item class defines its own ``__eq__`` (two items with the same
    content are still two items: a masked copy is not the result it replaced)."""
    from proxy.wire.chat.items import ChatItem
    from proxy.wire.messages.items import AnthropicItem
    from proxy.wire.responses.items import ResponsesItem

    for cls in (Item, ChatItem, AnthropicItem, ResponsesItem):
        assert cls.__eq__ is object.__eq__, cls
    a, b = Item({"role": "user", "content": "x"}, "user"), Item({"role": "user", "content": "x"}, "user")
    assert [a] != [b] and [a] == [a]


def test_every_items_class_compares_and_hashes_by_identity() -> None:
    """The pipeline keeps sets and list comparisons of items (``whole_turns``, ``_keep_pinned``, "did anything
    change"): they mean "the very same item" only while no items class defines equality or a hash of its own."""
    from proxy.wire.chat.items import ChatItem
    from proxy.wire.messages.items import AnthropicItem
    from proxy.wire.responses.items import ResponsesItem

    for cls in (Item, ChatItem, AnthropicItem, ResponsesItem):
        assert cls.__eq__ is object.__eq__ and cls.__hash__ is object.__hash__, cls
    a, b = Item({"role": "user", "content": "hi"}, USER), Item({"role": "user", "content": "hi"}, USER)
    assert a != b and len({a, b}) == 2 and [a] == [a] and [a] != [b]


@given(st.lists(st.integers(0, 5), max_size=12), st.lists(st.integers(0, 5), max_size=12))
def test_same_prefix_counts_the_leading_items_that_are_the_very_same(a: list[int], b: list[int]) -> None:
    """``same_prefix``: identity, never equality (equal items that are not the same item differ)."""
    from proxy.core.items import same_prefix

    pool = [Item({"n": 0}, USER) for _ in range(6)]  # six equal-looking items, each its own
    items, known = [pool[i] for i in a], [pool[i] for i in b]
    expected = next((i for i, (x, y) in enumerate(zip(items, known)) if x is not y), min(len(items), len(known)))
    assert same_prefix(items, known) == expected


@settings(max_examples=200, deadline=None)
@given(a=st.lists(st.lists(st.integers(0, 3), max_size=3), max_size=6),
       b=st.lists(st.lists(st.integers(0, 3), max_size=3), max_size=6), copies=st.booleans())
def test_same_prefix_of_turns_counts_lists_of_the_very_same_items(a: list[list[int]], b: list[list[int]],
                                                                   copies: bool) -> None:
    """``same_prefix`` on turns (lists of items): a turn is the same as a list of the very same items, copy or not,
    on the walk to the first difference as in the one-comparison case (``chain_hashes`` reads back that many)."""
    from proxy.core.items import same_prefix

    pool = [Item({"n": 0}, USER) for _ in range(4)]
    turns = [[pool[i] for i in t] for t in a]
    # a turn of ``known`` equal to the same turn of ``turns`` is that very list, or (``copies``) a copy of it
    same = [k < len(a) and a[k] == t and not copies for k, t in enumerate(b)]
    known = [turns[k] if same[k] else [pool[i] for i in t] for k, t in enumerate(b)]
    expected = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    assert same_prefix(turns, known) == expected
