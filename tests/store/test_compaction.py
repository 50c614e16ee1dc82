"""proxy.store.compaction: one compaction service for the summarising manager, /responses/compact and the Messages
compaction edit, with one placeholder, one rule for a ``drop`` policy and one cache.

The three were written three times with different rules: under a ``drop`` policy ``/responses/compact``
billed the default LLM while the Messages compaction declined, and a dry run forwarded one of two
placeholder texts depending on who asked.
"""

from __future__ import annotations

import re
from typing import Any

import aiohttp
import pytest

from bench.retention_data import call_values, contains
from bench.retention_metrics import strings
from plugins.base import Services
from plugins.summarizers.drop import DropParams, DropSummarizer
from plugins.summarizers.llm import LLMParams, LLMSummarizer
from proxy.core.tokens import TokenCounter
from proxy.store.compaction import DROPS_OLDER_TURNS, NO_SUMMARISER, WOULD_CREATE, Compaction, summarizer_for
from proxy.store.memory import MemoryCache
from proxy.store.summaries import SummaryService
from tests.conftest import base_config
from tests.fake_upstream import FakeUpstream
from tests.helpers import FakeEngine, tau_trajectories
from tests.helpers import recount as chat_recount
from tests.plugins.test_masking_http import WIRES, budget, padded, send
from tests.plugins.test_masking_http import config as masking_config
from tests.wire import responses_helpers as rh
from tests.wire.chat_helpers import items_of

COUNTER = TokenCounter("o200k_base")


def turns(n: int) -> list[list[Any]]:
    out = []
    for i in range(n):
        out.append(items_of([{"role": "user", "content": f"question {i}"},
                             {"role": "assistant", "content": f"answer {i}"}], COUNTER))
    return out


def service() -> tuple[Compaction, FakeEngine]:
    store = SummaryService(MemoryCache(), ttl=None, lock_wait=5, backoff_first=0, backoff_max=0)
    return Compaction(store), FakeEngine("the summary")


async def test_made_once_then_reused_and_never_made_in_a_dry_run() -> None:
    compaction, engine = service()
    llm = LLMSummarizer(LLMParams())
    history = turns(4)
    chain = [str(i) for i in range(4)]
    dry = await compaction.compact(llm, Services(engine=engine, dry_run=True, counter=COUNTER), history, chain)
    assert (dry.status, dry.text, dry.summary) == ("would_create", WOULD_CREATE, None) and engine.calls == []
    made = await compaction.compact(llm, Services(engine=engine, counter=COUNTER), history, chain)
    assert made.status == "created" and made.summary is not None and len(engine.calls) == 1
    again = await compaction.compact(llm, Services(engine=engine, dry_run=True, counter=COUNTER), history, chain)
    assert (again.status, again.text) == ("reused", made.text) and len(engine.calls) == 1


async def test_a_drop_policy_compacts_nothing_and_bills_nobody() -> None:
    compaction, engine = service()
    drop = DropSummarizer(DropParams())
    out = await compaction.compact(drop, Services(engine=engine, counter=COUNTER), turns(3), ["a", "b", "c"])
    assert (out.status, out.text, out.reason) == ("unavailable", DROPS_OLDER_TURNS, "drop") and engine.calls == []
    assert summarizer_for(drop) is drop  # whoever asks: the policy's own drop, never a stand-in LLM
    out = await compaction.compact(LLMSummarizer(LLMParams()), Services(engine=None), turns(3), ["a", "b", "c"])
    assert (out.status, out.text) == ("unavailable", NO_SUMMARISER)


def drop_config(upstream: FakeUpstream, **upstream_extra: Any) -> dict[str, Any]:
    return base_config(upstream.base_url, upstreams={"fake": {
        "base_url": upstream.base_url, "api_key": "sk-upstream-secret", **upstream_extra}},
        context_manager={"type": "summarising", "params": {"summarizer": "drop"}})


async def test_responses_compact_under_a_drop_policy_is_refused_not_billed(
        upstream: FakeUpstream, start_proxy: Any) -> None:
    proxy = await start_proxy(drop_config(upstream, responses_compact="emulate"))
    body = {"model": "gpt-4o-mini", "input": [
        {"role": "user", "content": "first"}, {"role": "assistant", "content": "one"},
        {"role": "user", "content": "second"}]}
    async with aiohttp.ClientSession() as s, s.post(proxy.base_url + "/responses/compact", json=body) as r:
        assert r.status == 400
        error = await r.json()
    assert error["error"]["code"] == "compaction_unavailable"
    assert error["error"]["message"].startswith(DROPS_OLDER_TURNS)
    assert upstream.summaries == []  # no summariser was called (and billed) for it


def long_messages(words: int = 1500) -> list[dict[str, Any]]:
    """A Messages conversation past the compaction trigger's minimum (50,000 input tokens)."""
    messages: list[dict[str, Any]] = []
    for i in range(40):
        messages += [{"role": "user", "content": f"question {i} " + "word " * words},
                     {"role": "assistant", "content": f"answer {i}"}]
    return [*messages, {"role": "user", "content": "now?"}]


COMPACT = {"edits": [{"type": "compact_20260112", "trigger": {"type": "input_tokens", "value": 50_000}}]}


async def test_messages_compaction_under_a_drop_policy_says_why_it_was_not_applied(
        upstream: FakeUpstream, start_proxy: Any) -> None:
    config = drop_config(upstream, context_management="emulate")
    proxy = await start_proxy(config)
    body = {"model": "gpt-4o-mini", "max_tokens": 64, "messages": long_messages(), "context_management": COMPACT}
    url = proxy.url + "/v1/ctxproxy/explain/messages?summarize=true"  # it would make one, were it allowed
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        assert r.status == 200
        report = (await r.json())["report"]
    assert report["context_management"]["compaction"] is None
    assert any(DROPS_OLDER_TURNS in w for w in report["warnings"])
    assert upstream.summaries == []


@pytest.mark.parametrize("path", ["/v1/ctxproxy/explain/chat", "/v1/ctxproxy/explain/messages"])
async def test_a_dry_run_forwards_one_placeholder_whoever_compacts(
        upstream: FakeUpstream, start_proxy: Any, path: str) -> None:
    config = base_config(upstream.base_url, upstreams={"fake": {
        "base_url": upstream.base_url, "api_key": "sk-upstream-secret", "context_management": "emulate"}},
        models=[{"name": "gpt-4o-mini", "context_window": 60_000, "max_output_tokens": 1024}],
        context_manager={"type": "summarising", "params": {"keep_turns": 1}})
    proxy = await start_proxy(config)
    body: dict[str, Any] = {"model": "gpt-4o-mini", "max_tokens": 64, "messages": long_messages()}
    if path.endswith("messages"):
        body["context_management"] = COMPACT
    async with aiohttp.ClientSession() as s, s.post(proxy.url + path, json=body) as r:
        assert r.status == 200
        out = await r.json()
    assert WOULD_CREATE in str(out["messages"]) and upstream.summaries == []


# --------------------------------------------------------------------------- the values section, over HTTP


GENERIC = ("- The user asked the assistant for help with their request.\n"
           "- The assistant looked up the relevant records with its tools and went through the options.")
SUMMARISED = 0  # a tau-bench conversation that is summarised on an 8k route once padded
SUMMARY_HEAD = re.compile(r"\[Conversation summary — (\d+) earlier turns\]")


def covered(messages: list[dict[str, Any]], turns: int) -> list[dict[str, Any]]:
    """The messages of the first ``turns`` user turns (a turn: a user message up to the next one)."""
    out: list[dict[str, Any]] = []
    seen = 0
    for m in messages:
        if m["role"] == "user":
            seen += 1
        if 0 < seen <= turns:
            out.append(m)
    return out


def argument_values_kept(sent: list[dict[str, Any]], forwarded: dict[str, Any]) -> tuple[int, int, int, str]:
    """(argument values of the summarised turns, those the forwarded body holds, turns summarised, summary text),
    the values as the retention benchmark defines them (``bench.retention_data.call_values``)."""
    text = "\n".join(strings(forwarded))
    head = SUMMARY_HEAD.search(text)
    if head is None:
        return 0, 0, 0, ""
    turns = int(head.group(1))
    wanted = {v for m in covered(sent, turns) if m["role"] == "assistant" for v in call_values(m)}
    kept = {v for v in wanted if contains(text, v)}
    return len(wanted), len(kept), turns, text[head.start():]


def summarising(summarizer: str = "llm") -> dict[str, Any]:
    # masking off: the summaries themselves are under test, over conversations masking alone would not fit
    return {"type": "summarising", "params": {"mask_observations": False, "keep_turns": 2,
                                              "summarizer": summarizer}}


@pytest.mark.parametrize("wire", sorted(WIRES))
async def test_a_generic_summary_still_carries_the_values_its_turns_acted_on(
        upstream: FakeUpstream, start_proxy: Any, wire: str) -> None:
    """A summariser that writes the same generic text whatever it is shown keeps no value of its own; the values
    section the compaction service appends must still bring at least 99 % of the summarised turns' tool-call
    argument values (reservation ids, flights, dates, amounts, as the retention benchmark counts them) to the
    model, on every wire, within the budget. Before it, fewer than half did (290 of 602: those the kept turns
    happened to repeat)."""
    upstream.summary_text = GENERIC
    proxy = await start_proxy(masking_config(upstream, summarising()))
    w = WIRES[wire]
    hard, threshold = budget(8_000)
    wanted = kept = conversations = sections = 0
    for k, item in enumerate(tau_trajectories()):
        messages = padded(item["traj"][: max(i for i, m in enumerate(item["traj"]) if m["role"] == "user") + 1], 3)
        if chat_recount(messages) <= threshold * 1.2:
            continue
        body = w.body(messages, w.model(8_000), k % 2 == 1)
        headers = await send(proxy, w, body)
        if headers["x-ctxproxy-summary"] not in ("created", "waited", "reused"):
            continue
        forwarded = w.forwarded(upstream)
        assert w.recount(forwarded) == int(headers["x-ctxproxy-tokens-out"]) <= hard  # the section is counted
        n, found, turns, summary = argument_values_kept(messages, forwarded)
        assert turns >= 1
        wanted, kept, conversations = wanted + n, kept + found, conversations + 1
        sections += summary.count("Values these turns acted on") == 1
    print(f"{wire}: {kept} of {wanted} argument values of the summarised turns reached the model "
          f"({conversations} conversations summarised on an 8k route)")
    assert conversations >= 20 and wanted >= 300
    assert kept >= 0.99 * wanted
    assert sections == conversations  # one values section in each summary


@pytest.mark.parametrize("wire", sorted(WIRES))
async def test_the_values_section_is_cached_with_its_summary(
        upstream: FakeUpstream, start_proxy: Any, wire: str) -> None:
    """The section is part of the cached summary: the next request of the conversation reuses it whole, with no
    second summariser call and the same forwarded prefix; the section is the same bytes every time."""
    upstream.summary_text = GENERIC
    proxy = await start_proxy(masking_config(upstream, summarising()))
    w = WIRES[wire]
    traj = tau_trajectories()[SUMMARISED]["traj"]
    messages = padded(traj[: max(i for i, m in enumerate(traj) if m["role"] == "user") + 1], 3)
    first = await send(proxy, w, w.body(messages, w.model(8_000), False))
    assert first["x-ctxproxy-summary"] == "waited" and len(upstream.summaries) >= 1
    calls = len(upstream.summaries)
    before = w.forwarded(upstream)
    grown = [*messages, {"role": "assistant", "content": "Anything else I can do?"},
             {"role": "user", "content": "No, thanks."}]
    second = await send(proxy, w, w.body(grown, w.model(8_000), True))
    assert second["x-ctxproxy-summary"] == "reused" and len(upstream.summaries) == calls
    after = w.forwarded(upstream)
    _, _, _, summary = argument_values_kept(messages, before)
    assert "Values these turns acted on (ctxproxy lists those the summary leaves out): " in summary
    assert w.units(after)[: len(w.units(before))] == w.units(before)


@pytest.mark.parametrize("wire", sorted(WIRES))
async def test_with_drop_the_values_section_replaces_the_dropped_turns(
        upstream: FakeUpstream, start_proxy: Any, wire: str) -> None:
    """A policy whose summariser is ``drop`` calls no model: the older turns are replaced by the values they acted
    on, and every tool-call argument value of the dropped turns still reaches the model."""
    proxy = await start_proxy(masking_config(upstream, summarising("drop")))
    w = WIRES[wire]
    hard, threshold = budget(8_000)
    wanted = kept = conversations = 0
    for k, item in enumerate(tau_trajectories()[:120]):
        messages = padded(item["traj"][: max(i for i, m in enumerate(item["traj"]) if m["role"] == "user") + 1], 3)
        if chat_recount(messages) <= threshold * 1.2:
            continue
        body = w.body(messages, w.model(8_000), k % 2 == 0)
        headers = await send(proxy, w, body)
        forwarded = w.forwarded(upstream)
        n, found, turns, summary = argument_values_kept(messages, forwarded)
        if not turns:
            continue
        assert headers["x-ctxproxy-summary"] == "none" and w.recount(forwarded) <= hard
        assert summary.startswith(f"[Conversation summary — {turns} earlier turns]\nValues these turns acted on "
                                  "(the turns were dropped to save context): ")
        wanted, kept, conversations = wanted + n, kept + found, conversations + 1
    print(f"{wire}, drop: {kept} of {wanted} argument values of the dropped turns reached the model "
          f"({conversations} conversations)")
    assert conversations >= 10 and kept >= 0.99 * wanted and upstream.summaries == []


async def test_an_emulated_responses_compaction_carries_the_values(
        upstream: FakeUpstream, start_proxy: Any) -> None:
    """``/responses/compact`` gets its summary from the same service: with it, the values section."""
    upstream.summary_text = GENERIC
    proxy = await start_proxy(base_config(upstream.base_url, upstreams={"fake": {
        "base_url": upstream.base_url, "api_key": "sk-upstream-secret", "responses_compact": "emulate"}}))
    traj = tau_trajectories()[0]["traj"]
    body = {"model": "gpt-4o-mini", "input": rh.chat_to_responses(traj)}
    async with aiohttp.ClientSession() as s, s.post(proxy.base_url + "/responses/compact", json=body) as r:
        assert r.status == 200, await r.text()
        out = await r.json()
    summary = out["output"][-1]["content"][0]["text"]
    wanted = {v for m in traj if m["role"] == "assistant" for v in call_values(m)}
    assert wanted and all(contains(summary, v) for v in wanted)
    assert "Values these turns acted on (ctxproxy lists those the summary leaves out): " in summary


async def test_a_compaction_builds_on_the_longer_summary_another_replica_made_a_moment_ago() -> None:
    """A compaction asked for (``/responses/compact``, a Messages compact edit) reads every longer prefix: one a lookup
    of this replica took as missing a moment ago may have been made by another since, and is built on."""
    shared = MemoryCache()

    def replica() -> Compaction:
        return Compaction(SummaryService(shared, ttl=None, lock_wait=5, backoff_first=0, backoff_max=0,
                                         local_entries=64))

    a, b = replica(), replica()
    llm = LLMSummarizer(LLMParams())
    engine_a, engine_b = FakeEngine("sum-a"), FakeEngine("sum-b")
    services_a, services_b = Services(engine=engine_a, counter=COUNTER), Services(engine=engine_b, counter=COUNTER)
    history, chain = turns(12), [f"c{i}" for i in range(12)]
    await a.compact(llm, services_a, history, chain, cut=4)  # a holds a summary of 4 turns
    narrowed = await a.lookup(llm, services_a, chain[:10])
    assert narrowed is not None and narrowed.covered_turns == 4  # the longer prefixes missing: marked
    made = await b.compact(llm, services_b, history, chain[:10], cut=8)  # b makes one of 8
    assert made.summary is not None and made.summary.covered_turns == 8
    before = len(engine_a.calls)
    await a.compact(llm, services_a, history[:11], chain[:11])
    call = engine_a.calls[before:]
    assert len(call) == 1 and "sum-b" in str(call[0])  # folded from b's 8 turns, not from its own 4
