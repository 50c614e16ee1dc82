"""proxy.store.refetch.removed_outputs against its definition, item by item, on random requests.

``removed_outputs`` passes over what is not a result at C speed and never makes a set of every item received; this
property holds it to the plain reading of its docstring (below), over random mixes of kept, masked, summarised,
dropped and duplicated results, with non-result items and calls in between.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.items import TOOL, Item
from proxy.store.refetch import removed_outputs


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
