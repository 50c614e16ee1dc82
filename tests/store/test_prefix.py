"""proxy.store.prefix: does a request forward the previous request's items (same conversation) as its prefix?"""

from __future__ import annotations

from proxy.core.items import ASSISTANT, SYSTEM, USER, Item
from proxy.store.prefix import PrefixTracker


def it(key: int, role: str = USER) -> Item:
    return Item({"k": key}, role, key=key)


SYS = it(1, SYSTEM)
DEV = it(2, SYSTEM)


def test_first_request_of_a_conversation_is_unknown() -> None:
    assert PrefixTracker().observe([SYS, it(10)], [SYS, it(10)]) is None


def test_empty_lists_are_unknown_and_not_remembered() -> None:
    t = PrefixTracker()
    assert t.observe([], [SYS]) is None
    assert t.observe([SYS], []) is None
    assert t.observe([SYS, it(10)], [SYS, it(10)]) is None


def test_a_growing_conversation_is_prefix_stable() -> None:
    t = PrefixTracker()
    received = [SYS, it(10)]
    assert t.observe(received, list(received)) is None
    received = [SYS, it(10), it(11, ASSISTANT), it(12)]
    assert t.observe(received, list(received)) is True
    assert t.observe(received, list(received)) is True  # the same request again: still a prefix


def test_a_compaction_that_changes_the_head_breaks_the_prefix() -> None:
    t = PrefixTracker()
    full = [SYS, it(10), it(11, ASSISTANT), it(12), it(13, ASSISTANT), it(14)]
    t.observe(full[:4], full[:4])
    summary = it(99, SYSTEM)
    assert t.observe(full, [SYS, summary, it(14)]) is False
    assert t.observe([*full, it(15, ASSISTANT), it(16)], [SYS, summary, it(14), it(15, ASSISTANT), it(16)]) is True


def test_a_shorter_forwarded_list_is_not_a_prefix_extension() -> None:
    t = PrefixTracker()
    received = [SYS, it(10), it(11, ASSISTANT), it(12)]
    t.observe(received, received)
    assert t.observe(received, received[:3]) is False


def test_conversations_are_told_apart_by_system_band_and_first_item() -> None:
    t = PrefixTracker()
    a = [SYS, DEV, it(10)]
    b = [SYS, DEV, it(20)]
    c = [DEV, it(10)]
    for conv in (a, b, c):
        assert t.observe(conv, conv) is None
    assert t.observe([*a, it(11)], [*a, it(11)]) is True
    assert t.observe([*b, it(21)], [SYS, it(21)]) is False


def test_the_tracker_is_a_bounded_lru() -> None:
    t = PrefixTracker(size=2)
    convs = [[SYS, it(100 + i)] for i in range(3)]
    for conv in convs:
        t.observe(conv, conv)
    assert t.observe(convs[0], convs[0]) is None  # evicted: seen as new
    # now held: convs[2], convs[0] (most recent last); touching convs[2] makes convs[0] the oldest
    assert t.observe(convs[2], convs[2]) is True
    t.observe([SYS, it(200)], [SYS, it(200)])  # evicts convs[0]
    assert t.observe(convs[2], convs[2]) is True
    assert t.observe(convs[0], convs[0]) is None


def test_a_system_only_request_is_its_own_conversation() -> None:
    t = PrefixTracker()
    assert t.observe([SYS], [SYS]) is None
    assert t.observe([SYS], [SYS]) is True
