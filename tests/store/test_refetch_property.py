"""proxy.store.refetch against its plain reading, on random requests.

``removed_outputs`` passes over what is not a result at C speed and never makes a set of every item received; the
first property holds it to the plain reading of its docstring (below), over random mixes of kept, masked,
summarised, dropped and duplicated results, with non-result items and calls in between.

``RefetchTracker.observe`` reuses what the previous request of the conversation found (a removed result's
signature, whether it was counted already) and reads a request's calls only when it must; the second property
holds it to a tracker that reads everything every time, over growing conversations whose calls repeat, with
random fates for each output on each request and a small bound on what a conversation remembers.
"""

from __future__ import annotations

import json
from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.items import TOOL, Item, ItemKeys
from proxy.core.tokens import TokenCounter
from proxy.store.refetch import RefetchTracker, calls_of, removed_outputs
from tests.helpers import assistant, call, system, tool, user
from tests.wire.chat_helpers import items_of

COUNTER = TokenCounter("o200k_base")


def removed_by_definition(received: list[Item], forwarded: list[Item],
                          summarised: list[Item]) -> list[tuple[Item, str]]:
    """Each received result not forwarded as the very same item, unless a received result with its id still is:
    masked when a forwarded item that was not received answers its id, else summarised when in ``summarised``,
    else dropped."""
    out: list[tuple[Item, str]] = []
    for item in received:
        if item.role != TOOL or item.result_id is None or any(f is item for f in forwarded):
            continue
        if any(f.role == TOOL and f.result_id == item.result_id and any(f is r for r in received) for f in forwarded):
            continue
        if any(f.role == TOOL and f.result_id == item.result_id and not any(f is r for r in received)
               for f in forwarded):
            how = "masked"
        elif any(s is item for s in summarised):
            how = "summarised"
        else:
            how = "dropped"
        out.append((item, how))
    return out


KINDS = st.sampled_from(["user", "assistant", "call", "tool"])
FATES = st.sampled_from(["kept", "masked", "summarised", "dropped", "summarised-masked"])


@st.composite
def requests(draw: st.DrawFn) -> tuple[list[Item], list[Item], list[Item]]:
    received: list[Item] = []
    forwarded: list[Item] = []
    summarised: list[Item] = []
    for n, (kind, fate) in enumerate(draw(st.lists(st.tuples(KINDS, FATES), max_size=40))):
        ident = f"c{draw(st.integers(0, 8))}"  # ids repeat: duplicates and results of the same call
        if kind == "tool":
            item = Item({"role": "tool", "n": n}, TOOL, result_id=ident)
        elif kind == "call":
            item = Item({"role": "assistant", "n": n}, "assistant", call_ids=(ident,))
        else:
            item = Item({"role": kind, "n": n}, kind)
        received.append(item)
        if fate.startswith("summarised"):
            summarised.append(item)
        if fate == "kept":
            forwarded.append(item)
        elif "masked" in fate and kind == "tool":
            forwarded.append(Item({"role": "tool", "masked": n}, TOOL, result_id=ident))
    if draw(st.booleans()):
        forwarded.insert(0, Item({"role": "user", "summary": True}, "user"))  # a summary item
    return received, forwarded, summarised


@settings(max_examples=400, deadline=None)
@given(requests())
def test_removed_outputs_is_its_definition(request: tuple[list[Item], list[Item], list[Item]]) -> None:
    received, forwarded, summarised = request
    assert removed_outputs(received, forwarded, summarised) == removed_by_definition(received, forwarded, summarised)
    assert removed_outputs(received, received, summarised) == []
    # ``summarised`` as any collection (a set) or a one-pass iterable reads the same
    expected = removed_by_definition(received, forwarded, summarised)
    assert removed_outputs(received, forwarded, set(summarised)) == expected
    assert removed_outputs(received, forwarded, iter(summarised)) == expected  # type: ignore[arg-type]
    for last in (0, 1, 2, 5):  # the last ones only, found from the end
        assert removed_outputs(received, forwarded, summarised, last) == (expected[-last:] if last else [])


class PlainTracker:
    """One conversation's re-fetches as ``RefetchTracker`` documents them, everything read again on every request."""

    def __init__(self, per_conversation: int) -> None:
        self.per = per_conversation
        self.keys: list[int] = []
        self.removed: dict[int, tuple[int, str]] = {}
        self.refetched: list[int] = []

    def observe(self, received: list[Item], forwarded: list[Item], summarised: list[Item]) -> dict[str, int]:
        keys = [item.key for item in received]
        extends = bool(self.removed) and keys[:len(self.keys)] == self.keys
        new = [c for item in received[len(self.keys):] if item.call_ids for c in calls_of(item)] if extends else []
        calls = {call_id: item for item in received if item.call_ids for call_id in item.call_ids}
        remembered: dict[int, tuple[int, str]] = {}
        for result, how in removed_by_definition(received, forwarded, summarised)[-self.per:]:
            ident = hash(result.result_id)
            if ident in self.removed:
                remembered[ident] = (self.removed[ident][0], how)
                continue
            made = list(calls_of(calls[result.result_id])) if result.result_id in calls else []
            sigs = [sig for call_id, sig in made if call_id == result.result_id] or [sig for _, sig in made[:1]] * (
                len(made) == 1)
            if sigs:
                remembered[ident] = (sigs[0], how)
        counts: dict[str, int] = {}
        refetched = OrderedDict.fromkeys(self.refetched)
        for _, sig in new:
            hits = [ident for ident, (made, _) in self.removed.items() if made == sig and ident not in refetched]
            if hits:
                how = self.removed[hits[-1]][1]
                counts[how] = counts.get(how, 0) + 1
                refetched.update(OrderedDict.fromkeys(hits))
        kept = list(refetched)[-self.per:]
        remembered = {ident: value for ident, value in remembered.items() if ident not in kept}
        self.keys, self.removed, self.refetched = (keys, remembered, kept) if remembered or kept else ([], {}, [])
        return counts


FATES_OF_OUTPUTS = st.sampled_from(["kept", "masked", "summarised", "dropped"])


@st.composite
def conversations(draw: st.DrawFn) -> tuple[int, list[tuple[list[Item], list[Item], list[Item]]]]:
    """A conversation's requests, each one turn longer than the last (or the same again); its calls repeat."""
    messages = [system("agent"), user("go")]
    requests = []
    for turn in range(draw(st.integers(1, 14))):
        if draw(st.integers(0, 3)):  # a turn of the tool loop: one call or two, then their outputs
            # (some agents give every call one of a few ids: a result's id then names outputs of several turns)
            made = [(f"c{draw(st.integers(0, 2))}" if draw(st.booleans()) else f"t{turn}c{k}",
                     f"tool{draw(st.integers(0, 1))}", json.dumps({"q": draw(st.integers(0, 1))}))
                    for k in range(draw(st.integers(1, 2)))]
            messages += [call(*made), *(tool(ident, f"output {turn}") for ident, _, _ in made)]
        elif draw(st.booleans()):
            messages += [assistant(f"answer {turn}"), user(f"question {turn}")]
        else:  # an output whose call the request does not hold (one id of the few, or its own)
            messages += [tool(draw(st.sampled_from(["c0", "c1", f"orphan{turn}"])), f"stray {turn}")]
        for _ in range(draw(st.integers(1, 2))):  # a client may send the same request twice
            received = items_of(messages, COUNTER)
            forwarded: list[Item] = []
            summarised: list[Item] = []
            for item in received:
                fate = draw(FATES_OF_OUTPUTS) if item.result_id is not None else "kept"
                if fate == "kept":
                    forwarded.append(item)
                elif fate == "masked":
                    forwarded.append(Item({"role": "tool", "masked": True}, TOOL, result_id=item.result_id))
                elif fate == "summarised":
                    summarised.append(item)
            requests.append((received, forwarded, summarised))
    return draw(st.integers(1, 3)), requests


@settings(max_examples=200, deadline=None)
@given(conversations(), st.booleans())
def test_the_tracker_counts_what_reading_everything_again_counts(
        conversation: tuple[int, list[tuple[list[Item], list[Item], list[Item]]]], handed: bool) -> None:
    per, requests = conversation
    tracker, plain = RefetchTracker(per_conversation=per), PlainTracker(per)
    for received, forwarded, summarised in requests:
        keys = ItemKeys(received) if handed else None  # the request's keys, as the server hands them, or its own
        assert tracker.observe("acme", received, forwarded, summarised, keys) == plain.observe(received, forwarded,
                                                                                                summarised)
        kept = tracker.conversations("acme")
        assert [(list(c.removed.items()), list(c.refetched)) for c in kept] == \
            ([(list(plain.removed.items()), plain.refetched)] if plain.removed or plain.refetched else [])
