"""proxy.store.refetch: the model repeating a call whose output ctxproxy removed is counted once, by how.

The online signal of what compaction forgot: a high re-fetch rate tells a team its budget is too tight.
Over HTTP on each wire, a conversation whose first outputs were masked, summarised or dropped; the model
then repeats the first call (same tool, same arguments, written in another key order): the metric, the
request log line and the cost report count it once, with the right ``how``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp
import pytest

from proxy.core.items import Item
from proxy.core.tokens import TokenCounter
from proxy.store.refetch import RefetchTracker, removed_outputs
from tests.fake_upstream import FakeUpstream
from tests.helpers import assistant, call, system, tool, user, words
from tests.outside import metric_total, scrape
from tests.plugins.test_masking_http import WIRES, send
from tests.plugins.test_masking_http import config as wires_config
from tests.wire.chat_helpers import items_of

ADMIN = "sk-admin"
COUNTER = TokenCounter("o200k_base")
Message = dict[str, Any]


def output(t: int, records: int) -> str:
    return json.dumps({"reservation_id": f"R{t:04d}X", "flights": [
        {"flight_number": f"HAT{t:02d}{i:02d}", "origin": "JFK", "destination": "SEA",
         "date": f"2024-05-{i % 28 + 1:02d}", "price": 100 + i, "status": "available"} for i in range(records)]})


def session(turns: int, records: int = 40, chat: int = 0) -> list[Message]:
    """A support session: each turn looks a reservation up (a large output) and answers; ``chat``: words of
    small talk in each question."""
    msgs: list[Message] = [system("You are an airline agent.")]
    for t in range(turns):
        arguments = json.dumps({"reservation_id": f"R{t:04d}X", "verbose": True})
        msgs += [user(f"Question {t}: what about reservation R{t:04d}X? " + words(chat, t)),
                 call((f"c{t}", "get_reservation_details", arguments)), tool(f"c{t}", output(t, records)),
                 assistant(f"Reservation R{t:04d}X is confirmed.")]
    return [*msgs, user("And what was on the first reservation again?")]


def repeat_first(msgs: list[Message], ident: str = "again1", arguments: str | None = None) -> list[Message]:
    """The model's answer: the first call again (its arguments in another order and spacing), and its output."""
    again = arguments or '{"verbose":true, "reservation_id":"R0000X"}'
    return [*msgs, call((ident, "get_reservation_details", again)), tool(ident, output(0, 40))]


# --------------------------------------------------------------------------- the tracker


def items(msgs: list[Message]) -> list[Item]:
    return items_of(msgs, COUNTER)  # counted: items get their content keys


def test_removed_outputs_says_how_each_was_removed() -> None:
    received = items([user("q"), call(("a", "f"), ("b", "f")), tool("a", "x" * 100), tool("b", "y"),
                      call(("c", "g")), tool("c", "z"), tool("c", "dup")])
    masked_copy = Item({"role": "tool"}, "tool", result_id="a")
    forwarded = [received[0], received[1], masked_copy, received[4], received[5]]  # b dropped; dup repaired away
    assert [(r.result_id, how) for r, how in removed_outputs(received, forwarded, [])] == [
        ("a", "masked"), ("b", "dropped")]
    assert [(r.result_id, how) for r, how in removed_outputs(received, forwarded, received[:4])] == [
        ("a", "masked"), ("b", "summarised")]
    assert removed_outputs(received, received, []) == []


def observe(tracker: RefetchTracker, msgs: list[Message], drop_first: bool = True,
            tenant: str = "acme") -> dict[str, int]:
    """One request of ``msgs`` whose forwarded list lacks the first call's output (dropped)."""
    received = items(msgs)
    forwarded = [i for i in received if not (drop_first and i.result_id == "c0")]
    return tracker.observe(tenant, received, forwarded)


def test_a_repeated_call_is_counted_once() -> None:
    tracker = RefetchTracker()
    first = session(3)
    assert observe(tracker, first) == {}  # the first request of a conversation: nothing to compare with
    second = repeat_first(first)
    assert observe(tracker, second) == {"dropped": 1}
    assert observe(tracker, second) == {}  # the same request again (a client's retry): no new call
    third = [*second, assistant("It is confirmed."), user("Thanks."), *repeat_first([], "again2")[0:2]]
    assert observe(tracker, third) == {}  # the same output again: it was re-fetched once already


def test_only_the_same_tool_with_the_same_arguments_is_a_refetch() -> None:
    tracker = RefetchTracker()
    first = session(3)
    observe(tracker, first)
    assert observe(tracker, repeat_first(first, arguments='{"reservation_id": "R0000X"}')) == {}
    observe(tracker, first)  # start again from the first request
    assert observe(tracker, repeat_first(first, arguments='{"reservation_id": "R0001X", "verbose": true}')) == {}


def test_a_call_whose_output_was_kept_is_no_refetch() -> None:
    tracker = RefetchTracker()
    first = session(3)
    observe(tracker, first, drop_first=False)
    assert observe(tracker, repeat_first(first)) == {}


def test_an_edited_history_and_another_tenant_count_nothing() -> None:
    tracker = RefetchTracker()
    first = session(3)
    observe(tracker, first)
    edited = [first[0], user("A different question 0"), *repeat_first(first)[2:]]
    assert observe(tracker, edited) == {}  # another conversation (its first turn differs)
    observe(tracker, first)
    assert observe(tracker, repeat_first(first), tenant="other") == {}  # never shared across tenants
    assert observe(tracker, repeat_first(first)) == {"dropped": 1}


def test_the_tracker_is_bounded() -> None:
    tracker = RefetchTracker(conversations=2, per_conversation=3)
    sessions = [[system(f"agent {i}"), *session(6)[1:]] for i in range(3)]
    for s in sessions:
        received = items(s)
        tracker.observe("acme", received, [i for i in received if i.result_id is None])  # every output dropped
    kept = tracker.conversations("acme")
    assert len(kept) == 2
    assert list(kept[0].removed) == [hash("c3"), hash("c4"), hash("c5")]  # the newest removals of the conversation


def test_one_tenants_traffic_never_evicts_another_tenants_conversations() -> None:
    """The bound is per tenant: a tenant sending thousands of conversations keeps another tenant's re-fetches
    counted; requests that removed nothing start no entry, and remembered signatures are bounded too."""
    tracker = RefetchTracker(conversations=8, signatures=10)
    first = session(3)
    observe(tracker, first)
    for i in range(50):  # another tenant's flood, half of it removing something
        flood = items([system(f"s{i}"), *session(2)[1:]])
        tracker.observe("flood", flood, [] if i % 2 else flood)
        tracker.observe("flood", items([system(f"quiet {i}"), user("hi")]), [])
    assert len(tracker.conversations("flood")) <= 8
    assert sum(len(c.removed) + len(c.refetched) for c in tracker.conversations("flood")) <= 10
    assert observe(tracker, repeat_first(first)) == {"dropped": 1}
    quiet = RefetchTracker()
    received = items(session(2))
    quiet.observe("acme", received, received)  # nothing removed: nothing remembered
    assert quiet.conversations("acme") == []


def test_the_bound_on_signatures_counts_the_ids_counted_as_refetched() -> None:
    """What a conversation holds counts against its tenant's bound, its counted re-fetches included: a conversation
    whose re-fetch was counted holds one id, so another's removal takes the tenant past a bound of one."""
    tracker = RefetchTracker(signatures=1)
    first = [system("one"), user("go"), call(("a", "read", "{}")), tool("a", "x")]
    received = items(first)
    tracker.observe("acme", received, [item for item in received if item.result_id is None])  # its output dropped
    again = items([*first, call(("b", "read", "{}"))])
    assert tracker.observe("acme", again, again) == {"dropped": 1}
    [held] = tracker.conversations("acme")
    assert (dict(held.removed), list(held.refetched)) == ({}, [hash("a")])
    other = items([system("two"), user("go"), call(("c", "read", "{}")), tool("c", "y")])
    tracker.observe("acme", other, [item for item in other if item.result_id is None])
    assert [list(c.removed) for c in tracker.conversations("acme")] == [[hash("c")]]  # the first one evicted


# --------------------------------------------------------------------------- over HTTP, on each wire


MANAGERS = {
    "masked": {"type": "observation-masking", "params": {"keep_recent": 2, "mask_step": 1}},
    "summarised": {"type": "summarising", "params": {"mask_observations": False, "keep_turns": 2}},
    "dropped": {"type": "sliding-window", "params": {"keep_turns": 2, "cut_step": 1}},
}


def config(upstream: FakeUpstream, manager: dict[str, Any]) -> dict[str, Any]:
    out = wires_config(upstream, manager)
    out["admin"] = {"keys": [ADMIN]}
    return out


async def report(proxy_url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.get(proxy_url + "/admin/report?since=1h",
                                                   headers={"Authorization": f"Bearer {ADMIN}"}) as r:
        assert r.status == 200
        out: dict[str, Any] = await r.json()
        return out


@pytest.mark.parametrize("wire", sorted(WIRES))
@pytest.mark.parametrize("how", sorted(MANAGERS))
async def test_a_repeated_call_whose_output_was_removed_is_counted_once_by_how(
        upstream: FakeUpstream, start_proxy: Any, caplog: pytest.LogCaptureFixture, wire: str, how: str) -> None:
    """The first request removes the first outputs (masked, summarised or dropped, by the manager); the model
    then calls the first tool again with the same arguments: one re-fetch with that ``how``, in the metric,
    the request's log line and the cost report; the requests after it add none."""
    caplog.set_level(logging.INFO, logger="ctxproxy.requests")
    proxy = await start_proxy(config(upstream, MANAGERS[how]))
    w = WIRES[wire]
    first = session(6)
    await send(proxy, w, w.body(first, w.model(8_000), False))
    second = repeat_first(first)
    await send(proxy, w, w.body(second, w.model(8_000), True))
    third = [*second, assistant("It is confirmed."), user("Thanks, and reservation R0005X?")]
    await send(proxy, w, w.body(third, w.model(8_000), False))
    await asyncio.sleep(0.05)  # a request's line is written once its answer is on its way
    text = await scrape(proxy)
    assert metric_total(text, "ctxproxy_refetch_total", how=how) == 1
    assert metric_total(text, "ctxproxy_refetch_total") == 1
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "ctxproxy.requests"]
    assert [line.get("refetched") for line in lines] == [None, {how: 1}, None]
    total = (await report(proxy.url))["total"]
    assert total[f"refetched_{how}"] == total["refetched"] == 1
    assert "ctxproxy_refetch" in text and "R0000X" not in text  # no argument text in the exposition


@pytest.mark.parametrize("wire", sorted(WIRES))
async def test_an_output_masked_then_summarised_is_a_summarised_refetch(
        upstream: FakeUpstream, start_proxy: Any, wire: str) -> None:
    """The hybrid masks first and summarises when masking is not enough: an output both masked and then covered
    by the summary was forgotten by the summary (the model saw the summary, not the placeholder)."""
    manager = {"type": "summarising", "params": {"keep_turns": 2, "keep_recent": 1, "mask_step": 1}}
    proxy = await start_proxy(config(upstream, manager))
    w = WIRES[wire]
    first = session(6, chat=700)  # long questions: masking the outputs alone does not fit
    headers = await send(proxy, w, w.body(first, w.model(8_000), False))
    assert headers["x-ctxproxy-summary"] == "waited"
    await send(proxy, w, w.body(repeat_first(first), w.model(8_000), False))
    text = await scrape(proxy)
    assert metric_total(text, "ctxproxy_tokens_removed_total", how="masked") > 0
    assert metric_total(text, "ctxproxy_refetch_total", how="summarised") == 1
    assert metric_total(text, "ctxproxy_refetch_total") == 1
