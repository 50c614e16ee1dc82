"""proxy.core.items.ItemKeys: a request's content keys and the hashes of their prefixes, made once and shared by
the trackers that compare the request with its conversation's previous one (prefix, prompt cache, re-fetches).

The trackers must read the same whether they make the keys themselves or are handed the request's
(``Assembly.item_keys``): the second property runs two of each side by side over random conversations.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.items import ASSISTANT, SYSTEM, TOOL, USER, Item, ItemKeys, keys_of
from proxy.core.usage import Usage
from proxy.store.prefix import PrefixTracker
from proxy.store.promptcache import PromptCacheTracker
from proxy.store.refetch import RefetchTracker

KEYS = st.lists(st.integers(-(2**64), 2**64), max_size=30)


def items(keys: list[int], role: str = USER) -> list[Item]:
    return [Item({"k": key}, role, key=key) for key in keys]


@settings(max_examples=300, deadline=None)
@given(KEYS, KEYS, st.lists(st.integers(0, 40), max_size=10))
def test_digests_and_extends_are_the_hashes_of_the_prefixes(keys: list[int], before: list[int],
                                                           asked: list[int]) -> None:
    made = ItemKeys(items(keys))
    assert made.keys == tuple(keys) and len(made) == len(keys)
    for n in [*asked, *asked]:  # in any order, and again (remembered)
        assert made.digest(n) == hash(tuple(keys[:n]))
    assert made.digest() == hash(tuple(keys))
    assert made.extends(len(before), hash(tuple(before))) is (keys[:len(before)] == before)
    assert made.extends(len(keys) + 1, made.digest()) is False  # longer than these keys: never


def test_the_received_and_forwarded_keys_are_one_object_when_nothing_changed() -> None:
    received = items([1, 2, 3])
    same, also = keys_of(received, received)
    assert same is also
    first, other = keys_of(received, list(received))
    assert first is not other and first.keys == other.keys


@st.composite
def conversation(draw: st.DrawFn) -> list[tuple[list[Item], list[Item]]]:
    """Requests of one conversation: growing, sent again, edited in the middle, truncated; each forwarded as sent
    (the very list), as a copy, or with some items left out or replaced (a summary, a masked output)."""
    history = [Item({"s": 1}, SYSTEM, key=1), Item({"u": 2}, USER, key=2)]
    out = []
    for step in range(draw(st.integers(1, 8))):
        change = draw(st.sampled_from(["grow", "grow", "same", "edit", "truncate"]))
        if change == "grow":
            history = [*history, *(Item({"n": step, "k": k}, draw(st.sampled_from([USER, ASSISTANT, TOOL])),
                                        key=100 * step + k, result_id=f"c{k}") for k in range(draw(st.integers(1, 3))))]
        elif change == "edit" and len(history) > 2:
            at = draw(st.integers(1, len(history) - 1))
            history = [*history[:at], Item({"edited": step}, USER, key=-step - 1), *history[at + 1:]]
        elif change == "truncate" and len(history) > 2:
            history = history[:draw(st.integers(2, len(history)))]
        fate = draw(st.sampled_from(["as sent", "copy", "managed"]))
        if fate == "as sent":
            forwarded = history
        elif fate == "copy":
            forwarded = list(history)
        else:
            kept = [item for item in history if draw(st.booleans())] or history[:1]
            forwarded = [Item({"summary": step}, USER, key=-1000 - step), *kept]
        out.append((list(history), forwarded if forwarded is not history else None))
    return [(received, received if forwarded is None else forwarded) for received, forwarded in out]


@settings(max_examples=300, deadline=None)
@given(conversation())
def test_trackers_handed_the_keys_read_as_the_ones_that_make_them(
        requests: list[tuple[list[Item], list[Item]]]) -> None:
    prefix, prefix_handed = PrefixTracker(), PrefixTracker()
    cache, cache_handed = PromptCacheTracker(), PromptCacheTracker()
    refetch, refetch_handed = RefetchTracker(), RefetchTracker()
    for n, (received, forwarded) in enumerate(requests):
        keys = keys_of(received, forwarded)  # one pair for the three, as the server shares them
        assert prefix_handed.observe(received, forwarded, "acme", keys[1]) == \
            prefix.observe(received, forwarded, "acme")
        assert refetch_handed.observe("acme", received, forwarded, (), keys[0]) == \
            refetch.observe("acme", received, forwarded)
        usage = Usage(input_tokens=1000 + n, cached_tokens=500, cache_write_tokens=0, output_tokens=1)
        assert cache_handed.observe("acme", received, forwarded, usage, 10, keys) == \
            cache.observe("acme", received, forwarded, usage, 10)
    assert [vars(c) for c in refetch_handed.conversations("acme")] == \
        [vars(c) for c in refetch.conversations("acme")]
