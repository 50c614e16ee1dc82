"""proxy.core.pairing: the neutral repair and check on items, with a fake wire factory.

The chat-specific behaviour (messages, legacy function calls) is in tests/wire/test_chat_pairing.py;
here only items: calls by id, results by id, merged runs of calls (Responses-style
wires) and factories that cannot make placeholders or leave nothing after stripping.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.errors import PayloadError
from proxy.core.items import ASSISTANT, SYSTEM, TOOL, USER, Item
from proxy.core.pairing import (
    CALLS_DROPPED,
    DUPLICATE,
    EMPTY_DROPPED,
    MOVED,
    ORPHAN,
    PLACEHOLDER,
    PLACEHOLDER_FILLED,
    REPAIR_KINDS,
    check,
    check_known,
    is_paired,
    repair,
)
from tests.conftest import StartProxy, base_config
from tests.fake_upstream import FakeUpstream
from tests.outside import Message, post


class Factory:
    """A wire's two edits: ``placeholders`` False = this kind of call has none; ``texts`` False = a call
    item is nothing but its calls (stripping leaves nothing)."""

    def __init__(self, placeholders: bool = True, texts: bool = True) -> None:
        self.placeholders = placeholders
        self.texts = texts
        self.stripped: list[Item] = []
        self.made: list[tuple[Item, str]] = []

    def without_calls(self, item: Item) -> Item | None:
        if not self.texts or not item.raw.get("text"):
            return None
        out = Item({"text": item.raw["text"], "stripped": True}, ASSISTANT, source=item.source)
        self.stripped.append(out)
        return out

    def placeholder(self, call: Item, call_id: str) -> Item | None:
        self.made.append((call, call_id))
        if not self.placeholders:
            return None
        return Item({"placeholder": call_id, "content": PLACEHOLDER}, TOOL, result_id=call_id, source=call.source)


def items(spec: str) -> list[Item]:
    """s=system u=user a=assistant c<ids>=call item (``c1,2``; ``c1+`` has text too) t<id>=result."""
    out: list[Item] = []
    for i, tok in enumerate(spec.split()):
        kind, rest = tok[0], tok[1:]
        if kind == "s":
            out.append(Item({"i": i}, SYSTEM, source=i))
        elif kind == "u":
            out.append(Item({"i": i}, USER, source=i))
        elif kind == "a":
            out.append(Item({"i": i, "text": "answer"}, ASSISTANT, source=i))
        elif kind == "c":
            text = rest.endswith("+")
            ids = tuple(rest.rstrip("+").split(","))
            out.append(Item({"i": i, "text": "let me look" if text else ""}, ASSISTANT, call_ids=ids, source=i))
        elif kind == "t":
            out.append(Item({"i": i}, TOOL, result_id=rest, source=i))
        else:  # pragma: no cover
            raise ValueError(tok)
    return out


def show(xs: list[Item]) -> str:
    """The inverse of ``items`` (placeholders as p<id>, stripped call items as x<source>)."""
    out = []
    for x in xs:
        if "placeholder" in x.raw:
            out.append(f"p{x.result_id}")
        elif x.raw.get("stripped"):
            out.append(f"x{x.source}")
        elif x.call_ids:
            out.append("c" + ",".join(x.call_ids))
        elif x.result_id is not None:
            out.append(f"t{x.result_id}")
        else:
            out.append({SYSTEM: "s", USER: "u", ASSISTANT: "a"}[x.role])
    return " ".join(out)


# --------------------------------------------------------------------------- repair, one group per call item


@pytest.mark.parametrize(("spec", "expected", "repairs"), [
    ("u c1 t1 a", "u c1 t1 a", {}),
    ("u t1 a", "u a", {ORPHAN: 1}),
    ("u t1 c1 t1", "u c1 t1", {ORPHAN: 1}),  # a result before its call is an orphan; the later one pairs
    ("u c1 t1 t1", "u c1 t1", {DUPLICATE: 1}),
    ("u c1 u t1", "u c1 t1 u", {MOVED: 1}),
    ("u c1,2 t1 c3 t2 t3", "u c1,2 t1 t2 c3 t3", {MOVED: 1}),
    ("u c1,2 t2", "u c1,2 t2 p1", {PLACEHOLDER_FILLED: 1}),
    ("u c1,2,3 t3", "u c1,2,3 t3 p1 p2", {PLACEHOLDER_FILLED: 2}),
    ("u c1+ a", "u x1 a", {CALLS_DROPPED: 1}),
    ("u c1 a", "u a", {CALLS_DROPPED: 1, EMPTY_DROPPED: 1}),
    ("u c1 c1 t1", "u c1 t1", {CALLS_DROPPED: 1, EMPTY_DROPPED: 1}),  # the later call with that id gets it
    ("u c1 t1 c1 t1", "u c1 t1 c1 t1", {}),  # the same id in two groups is fine
    ("u c1 t1 c1 t1 t1", "u c1 t1 c1 t1", {DUPLICATE: 1}),
    ("u c1 t2 t1", "u c1 t1", {ORPHAN: 1}),
    ("c1 t1", "c1 t1", {}),
])
def test_repair_one_group_per_call_item(spec: str, expected: str, repairs: dict[str, int]) -> None:
    xs = items(spec)
    out, got = repair(xs, Factory())
    assert show(out) == expected
    assert dict(got) == repairs
    assert set(got) <= REPAIR_KINDS
    check(out)


def test_nothing_to_repair_returns_the_same_list_object() -> None:
    xs = items("s u c1,2 t2 t1 a u")
    out, got = repair(xs, Factory())
    assert out is xs
    assert not got


def test_repair_never_mutates_its_input() -> None:
    xs = items("u t9 c1,2 t2 u c3 t3 t3")
    before = [(x.raw, x.call_ids, x.result_id) for x in xs]
    repair(xs, Factory())
    assert [(x.raw, x.call_ids, x.result_id) for x in xs] == before


def test_placeholders_are_the_factorys_and_follow_the_received_results() -> None:
    factory = Factory()
    xs = items("u c1,2,3 t2")
    out, _ = repair(xs, factory)
    assert [cid for _, cid in factory.made] == ["1", "3"]
    assert all(call is xs[1] for call, _ in factory.made)
    assert out[2] is xs[2]
    assert [x.result_id for x in out[3:]] == ["1", "3"]


# --------------------------------------------------------------------------- a factory without placeholders


def test_unanswered_calls_without_placeholders_are_dropped() -> None:
    out, got = repair(items("u c1+ t9 a"), Factory(placeholders=False))
    assert show(out) == "u x1 a"
    assert dict(got) == {ORPHAN: 1, CALLS_DROPPED: 1}


def test_a_partly_answered_call_item_without_placeholders_is_refused() -> None:
    with pytest.raises(PayloadError) as err:
        repair(items("u c1,2 t1"), Factory(placeholders=False))
    assert err.value.code == "unpaired_tool_call"
    assert err.value.status == 400
    assert "'2'" in err.value.message


def test_without_placeholders_an_answered_item_in_a_group_is_kept() -> None:
    out, got = repair(items("u c1 t1 a"), Factory(placeholders=False))
    assert show(out) == "u c1 t1 a"
    assert not got


# --------------------------------------------------------------------------- merged runs of call items


@pytest.mark.parametrize(("spec", "expected", "repairs"), [
    ("u c1 c2 t1 t2 a", "u c1 c2 t1 t2 a", {}),
    ("u c1 c2 t2 t1", "u c1 c2 t2 t1", {}),  # results of a run in any order
    ("u c1 c2 t1", "u c1 c2 t1 p2", {PLACEHOLDER_FILLED: 1}),
    ("u c1 c2 t2", "u c1 c2 t2 p1", {PLACEHOLDER_FILLED: 1}),
    ("u c1 c2 a", "u a", {CALLS_DROPPED: 2, EMPTY_DROPPED: 2}),
    ("u c1+ c2 a", "u x1 a", {CALLS_DROPPED: 2, EMPTY_DROPPED: 1}),
    ("u c1 c2 t1 t2 c3 t3", "u c1 c2 t1 t2 c3 t3", {}),  # a result closes the run
    ("u c1 t1 c2 t2", "u c1 t1 c2 t2", {}),
    ("u c1 c2 u t1 t2", "u c1 c2 t1 t2 u", {MOVED: 2}),
    ("u c1 c2 t2 c3 t1 t3", "u c1 c2 t2 t1 c3 t3", {MOVED: 1}),
    ("u c1,2 c3 t3 t1 t2", "u c1,2 c3 t3 t1 t2", {}),
])
def test_repair_merged_runs(spec: str, expected: str, repairs: dict[str, int]) -> None:
    out, got = repair(items(spec), Factory(), merge_call_runs=True)
    assert show(out) == expected
    assert dict(got) == repairs
    check(out, merge_call_runs=True)


@pytest.mark.parametrize("spec", ["u c1 c2 t1 t2", "u c1 c2 t2 t1 a"])
def test_a_valid_merged_run_is_not_paired_without_merging(spec: str) -> None:
    xs = items(spec)
    assert is_paired(xs, merge_call_runs=True)
    assert not is_paired(xs, merge_call_runs=False)


def test_merged_run_without_placeholders_first_call_unanswered() -> None:
    out, got = repair(items("u c1 c2 t2"), Factory(placeholders=False, texts=False), merge_call_runs=True)
    assert show(out) == "u c2 t2"
    assert dict(got) == {CALLS_DROPPED: 1, EMPTY_DROPPED: 1}
    check(out, merge_call_runs=True)


def test_merged_run_without_placeholders_last_call_unanswered_and_nothing_left() -> None:
    out, got = repair(items("u c1 c2 t1"), Factory(placeholders=False, texts=False), merge_call_runs=True)
    assert show(out) == "u c1 t1"
    assert dict(got) == {CALLS_DROPPED: 1, EMPTY_DROPPED: 1}
    check(out, merge_call_runs=True)


def test_duplicate_ids_in_a_merged_run_survive_repair_and_are_refused_by_check() -> None:
    out, _ = repair(items("u c1 c1 t1"), Factory(), merge_call_runs=True)
    with pytest.raises(PayloadError) as err:
        check(out, merge_call_runs=True)
    assert err.value.code == "duplicate_tool_call_id"


# --------------------------------------------------------------------------- check


@pytest.mark.parametrize(("spec", "merge", "code", "param"), [
    ("u t1", False, "unpaired_tool_result", "messages[1]"),
    ("u c1 u t1", False, "unpaired_tool_call", "messages[2]"),
    ("u c1", False, "unpaired_tool_call", "messages"),
    ("u c1,1 t1", False, "duplicate_tool_call_id", "messages[1]"),
    ("u c1 t1 t1", False, "unpaired_tool_result", "messages[3]"),
    ("u c1 c2 t1 t2", False, "unpaired_tool_call", "messages[2]"),
    ("u c1 c1 t1", True, "duplicate_tool_call_id", "messages[2]"),
    ("u c1 t2", False, "unpaired_tool_result", "messages[2]"),
    ("t1 c1", False, "unpaired_tool_result", "messages[0]"),
])
def test_check_codes_and_params(spec: str, merge: bool, code: str, param: str) -> None:
    with pytest.raises(PayloadError) as err:
        check(items(spec), merge)
    assert (err.value.code, err.value.param) == (code, param)
    assert not is_paired(items(spec), merge)


def test_check_names_its_field_and_items_without_a_source() -> None:
    xs = items("u t1")
    with pytest.raises(PayloadError) as err:
        check(xs, where="input")
    assert err.value.param == "input[1]"
    xs[1].source = -1
    with pytest.raises(PayloadError) as err:
        check(xs, where="input")
    assert err.value.param == "input"


def test_check_shortens_hostile_ids() -> None:
    xs = [Item({}, USER), Item({}, TOOL, result_id="x" * 10_000)]
    with pytest.raises(PayloadError) as err:
        check(xs)
    assert len(err.value.message) < 300


@pytest.mark.parametrize("spec", ["", "s", "u a u a", "s u c1 t1 c2,3 t3 t2 a u"])
def test_check_accepts_valid_lists(spec: str) -> None:
    check(items(spec))
    assert is_paired(items(spec))


# --------------------------------------------------------------------------- property: repair then check


@st.composite
def item_lists(draw: Any) -> list[Item]:
    """Random items where every call id is unique (duplicates are refused by design, not repaired)."""
    out: list[Item] = [Item({}, USER, source=0)]
    next_id = 0
    issued: list[str] = []
    for _ in range(draw(st.integers(0, 14))):
        kind = draw(st.sampled_from(["u", "a", "c", "c", "t", "t", "t"]))
        src = len(out)
        if kind == "u":
            out.append(Item({}, USER, source=src))
        elif kind == "a":
            out.append(Item({"text": "hi"}, ASSISTANT, source=src))
        elif kind == "c":
            n = draw(st.integers(1, 3))
            ids = tuple(f"call_{next_id + k}" for k in range(n))
            next_id += n
            issued.extend(ids)
            text = "thinking" if draw(st.booleans()) else ""
            out.append(Item({"text": text}, ASSISTANT, call_ids=ids, source=src))
        else:
            pool = [*issued, "call_orphan"]
            out.append(Item({}, TOOL, result_id=draw(st.sampled_from(pool)), source=src))
    return out


@settings(max_examples=300, deadline=None)
@given(item_lists(), st.booleans(), st.booleans())
def test_repair_output_always_passes_check(xs: list[Item], merge: bool, texts: bool) -> None:
    out, got = repair(xs, Factory(texts=texts), merge_call_runs=merge)
    check(out, merge_call_runs=merge)
    assert (out is xs) == (not got)
    assert is_paired(xs, merge) == (not got)


def _outcome(run: Any, *args: Any) -> Any:
    try:
        run(*args)
    except PayloadError as exc:
        return (exc.code, exc.param, exc.message)
    return "valid"


@settings(max_examples=500, deadline=None)
@given(st.lists(st.tuples(item_lists(), st.integers(0, 16), st.integers(0, 3)), min_size=1, max_size=5),
       st.booleans(), st.data())
def test_check_known_gives_what_check_gives_whatever_was_checked_before(
        steps: list[tuple[list[Item], int, int]], merge: bool, data: st.DataObject) -> None:
    """Consecutive lists of one conversation share a prefix of the very same items, then differ (an appended round,
    an edit, a masked copy in the middle, a different summary): whatever was checked before with the same first
    item, ``check_known`` refuses or passes exactly as ``check`` does, with the same error."""
    first = Item({}, SYSTEM, source=0)
    previous: list[Item] = [first]
    for fresh, keep, drop in steps:
        if data.draw(st.booleans()):  # mostly valid lists: those are the ones remembered
            fresh = repair(fresh, Factory(), merge_call_runs=merge)[0]
        kept = previous[1:1 + keep]
        kept = kept[:max(0, len(kept) - drop)] if data.draw(st.booleans()) else kept
        xs = [first, *kept, *fresh[1:]] if data.draw(st.booleans()) else [first, *fresh]
        assert _outcome(check_known, xs, merge) == _outcome(check, xs, merge)
        previous = xs
    valid = [first, *items("u c1 t1 a u c2,3 t2 t3")]
    check_known(valid, merge)
    assert first.verified == valid
    broken = [*valid[:5], Item({}, TOOL, result_id="9", source=9)]  # shares a verified prefix, then is refused
    assert _outcome(check_known, broken, merge) == _outcome(check, broken, merge) != "valid"
    assert first.verified == valid  # a refused list is not remembered


def test_check_known_does_not_remember_a_list_with_unkept_items() -> None:
    xs = items("s u c1 t1 a")
    xs[-1].unkept = True
    check_known(xs)
    assert xs[0].verified is None


@settings(max_examples=300, deadline=None)
@given(item_lists(), st.booleans())
def test_repair_without_placeholders_refuses_or_pairs(xs: list[Item], merge: bool) -> None:
    """A wire whose calls have no placeholder and leave nothing behind: repaired output is paired, or refused."""
    try:
        out, _ = repair(xs, Factory(placeholders=False, texts=False), merge_call_runs=merge)
    except PayloadError as exc:
        assert exc.code == "unpaired_tool_call"
        return
    check(out, merge_call_runs=merge)


@pytest.mark.parametrize(("neutral", "shown"), [("\x00fn:book_flight", "'book_flight'"), ("\x00approval:a1", "'a1'")])
def test_errors_name_ids_as_the_client_sent_them(neutral: str, shown: str) -> None:
    """Wires keep internal namespaces behind a NUL (legacy function calls, MCP approvals): never shown."""
    with pytest.raises(PayloadError) as caught:
        check([Item({}, USER, source=0), Item({}, TOOL, result_id=neutral, source=1)])
    assert shown in caught.value.message and "\x00" not in caught.value.message and "fn:" not in caught.value.message


MODEL = "gpt-4o-mini"


def chat(messages: list[Any], model: str = MODEL, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": messages, **extra}


@pytest.mark.parametrize("messages", [
    [{"role": "tool", "tool_call_id": "call_9", "content": "stale result"}],
    [{"role": "function", "name": "lookup", "content": "ok"},
     {"role": "tool", "tool_call_id": "call_1", "content": "ok"}],
    [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}],
], ids=["stray-tool", "stray-results", "unanswered-call-only"])
async def test_a_repair_that_leaves_nothing_is_refused_not_forwarded(
    upstream: FakeUpstream, start_proxy: StartProxy, messages: list[Message]
) -> None:
    """When pairing repair removes every message (stray results, an unanswered call alone), the request is refused
    with 400: an empty conversation is never forwarded."""
    proxy = await start_proxy(base_config(upstream.base_url))
    status, _, body = await post(proxy, chat(messages))
    assert status == 400, (status, [r.body["messages"] for r in upstream.chat])
    assert body["error"]["type"] == "invalid_request_error"
    assert upstream.chat == []


def test_repair_of_a_merged_run_without_placeholders_is_paired() -> None:
    """Repair over a merged run of calls (Responses items) whose call cannot get a placeholder (a hosted tool's)
    yields items the check accepts: repair's own output is never refused."""
    from proxy.core.errors import PayloadError
    from proxy.core.items import ASSISTANT, TOOL, USER, Item
    from proxy.core.pairing import check, repair

    class Factory:
        def without_calls(self, item: Item) -> Item | None:
            return Item({"reasoning": item.raw["reasoning"]}, ASSISTANT, source=item.source)

        def placeholder(self, call: Item, call_id: str) -> Item | None:
            return None  # e.g. a hosted tool's call: no result can be made up for it

    items = [Item({}, USER, source=0),
             Item({"reasoning": "r1"}, ASSISTANT, call_ids=("fc_1",), source=1),
             Item({"reasoning": "r2"}, ASSISTANT, call_ids=("ws_2",), source=2),
             Item({}, TOOL, result_id="fc_1", source=3)]
    repaired, _ = repair(items, Factory(), merge_call_runs=True)
    try:
        check(repaired, merge_call_runs=True)
    except PayloadError as exc:
        pytest.fail(f"repair's own output is refused: {exc.code}: {exc} -> {repaired}")


EMPTIED: list[list[dict[str, Any]]] = [
    [{"role": "assistant", "function_call": {"name": "lookup"}}],
    [{"role": "assistant", "content": None,
      "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}],
    [{"role": "tool", "tool_call_id": "nowhere", "content": "orphan"}],
]


@pytest.mark.parametrize("messages", EMPTIED)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/ctxproxy/explain"])
async def test_a_payload_emptied_by_repair_is_refused(upstream: FakeUpstream, start_proxy: StartProxy,
                                                      messages: list[dict[str, Any]], path: str) -> None:
    """A payload that pairing repair empties (an unanswered legacy call alone) is refused with
    ``empty_after_repair``, never forwarded (or explained) as ``"messages": []``; fuzzing found it."""
    proxy = await start_proxy(base_config(upstream.base_url))
    status, _, body = await post(proxy, {"model": "gpt-4o-mini", "messages": messages}, path=path)
    assert status == 400
    assert body["error"]["code"] == "empty_after_repair" and body["error"]["param"] == "messages"
    assert upstream.chat == []
