"""Context-manager plugins: stack, sliding-window, summarising, prefix stability (docs/design.md#5-context-managers)."""

from __future__ import annotations

import asyncio
import copy
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from plugins.base import CachedSummary, Completion, HistoryView, Services, SummaryScope
from plugins.registry import BindingError, default_registry
from proxy.core.bands import assign_groups, split_bands, split_turns
from proxy.core.budget import TrimmerParams, compute_budget
from proxy.core.errors import ContextLengthExceeded
from proxy.core.items import USER, Item
from proxy.core.modelinfo import ModelMap
from proxy.core.tokens import TokenCounter
from proxy.pipeline import Assembly, assemble, chain_hashes
from proxy.policy import Routes, policy_for
from proxy.wire.chat import WIRE as CHAT
from tests.conftest import ROOT, StartProxy
from tests.fake_upstream import FakeUpstream
from tests.helpers import (
    LINEAR,
    MODEL,
    AgentSim,
    FakeEngine,
    assembly_problems,
    assistant,
    call,
    make_config,
    pairing_problems,
    per_item_growth,
    recount,
    running,
    services,
    summary_service,
    system,
    tool,
    user,
    words,
)
from tests.outside import (
    Message,
    chat_body,
    post,
    text_of,
)
from tests.store.test_summaries_http import config as summarising_config
from tests.wire.chat_helpers import items_of

COUNTER = TokenCounter("o200k_base")
REGISTRY = default_registry()


def manager(binding: Any) -> Any:
    return REGISTRY.resolve("context_manager", binding, "context_manager").create()


def view(messages: list[dict[str, Any]], *, hard: int = 100_000, threshold: int = 0,
         svc: Services | None = None) -> HistoryView:
    """A HistoryView as the pipeline builds it, for calling a plugin directly."""
    items = items_of(messages, COUNTER)
    assign_groups(items, merge_call_runs=False)
    bands = split_bands(items)
    turns = split_turns(bands.history)
    pinned = 3 + sum(item.tokens for item in [*bands.system, *bands.working_memory])
    if bands.current is not None:
        pinned += bands.current.tokens
    budget = compute_budget(window=10**7, request_max_tokens=None, model_max_output=None,
                            trimmer=TrimmerParams(max_tokens=hard), tenant_cap=None, summary_threshold=threshold)
    return HistoryView(
        turns=turns, turn_tokens=[sum(item.tokens for item in t) for t in turns],
        chain_fn=lambda: chain_hashes(turns),
        pinned_tokens=pinned, budget=budget, counter=COUNTER, services=svc or services(COUNTER),
        summary_item=lambda text, covered: CHAT.summary(text, covered, COUNTER),
    )



def agent_history(turns: int, rounds: int = 2, parallel: bool = True) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [system("You are an agent.")]
    for t in range(turns):
        msgs.append(user(f"turn {t}"))
        for r in range(rounds):
            ids = [f"c{t}_{r}_a", f"c{t}_{r}_b"] if parallel and r % 2 == 0 else [f"c{t}_{r}"]
            msgs.append(call(*[(i, "f") for i in ids]))
            msgs += [tool(i, f"result {i}") for i in ids]
        msgs.append(assistant(f"answer {t}"))
    return [*msgs, user("current question")]


def flat(turns: Sequence[Sequence[Any]]) -> list[dict[str, Any]]:
    """The client's messages of item turns, in order."""
    return [item.raw for t in turns for item in t]


class Pipe:
    """assemble() with one config, shared counter; optional fake engine + summary cache."""

    def __init__(self, engine: FakeEngine | None = None, **config: Any) -> None:
        cfg = make_config(**config)
        self.route = Routes(cfg, ModelMap()).resolve(MODEL)
        self.policy = policy_for(cfg, None, MODEL, None)
        self.engine = engine
        self.services = services(COUNTER, engine=engine, summaries=summary_service() if engine else None)

    async def __call__(self, messages: list[dict[str, Any]]) -> Assembly:
        return await assemble({"model": MODEL, "messages": messages}, wire=CHAT, route=self.route, policy=self.policy,
                              counter=COUNTER, services=self.services)


# --------------------------------------------------------------------------- stack


@pytest.mark.parametrize("cap", range(1, 40))
async def test_stack_cuts_at_a_group_boundary(cap: int) -> None:
    msgs = agent_history(5, rounds=2)
    v = view(msgs)
    history = flat(v.turns)
    result = await manager({"type": "stack", "params": {"max_messages": cap, "cut_step": 1}}).manage_history(v)
    kept = flat(result.turns)
    assert len(kept) <= cap
    assert kept == history[len(history) - len(kept) :]  # a suffix, same objects
    assert all(a is b for a, b in zip(kept, history[len(history) - len(kept) :]))
    if kept:
        assert kept[0]["role"] != "tool"
    assert not pairing_problems(kept)
    # the longest group-aligned suffix within the cap: one more group would exceed it
    cut = len(history) - len(kept)
    prev = cut - 1
    while prev > 0 and history[prev]["role"] == "tool":
        prev -= 1
    assert cut == 0 or len(history) - prev > cap
    assert result.turns_dropped == sum(1 for m in history[:cut] if m["role"] == "user")


async def test_stack_without_cap_or_under_cap_is_unchanged() -> None:
    msgs = agent_history(3)
    v = view(msgs)
    assert (await manager("stack").manage_history(v)).turns is v.turns
    assert (await manager({"type": "full-history", "params": {"max_messages": 500}}).manage_history(v)).turns is v.turns


@pytest.mark.parametrize("cap", [4, 9, 17, 30])
async def test_stack_default_step_cuts_on_a_grid(cap: int) -> None:
    msgs = agent_history(8)
    v = view(msgs)
    history = flat(v.turns)
    kept = flat((await manager({"type": "stack", "params": {"max_messages": cap}}).manage_history(v)).turns)
    step = math.ceil(cap / 4)
    want = math.ceil((len(history) - cap) / step) * step
    assert len(history) - len(kept) >= want
    assert kept[0]["role"] != "tool"


async def test_stack_through_the_pipeline_never_forwards_a_leading_tool_message() -> None:
    """The stack cuts at a group boundary, which may fall inside a turn: what it keeps of a turn whose user
    message it cut goes too, so the forwarded history opens with a user message (or is empty)."""
    pipe = Pipe(window=3_000, context_manager={"type": "stack", "params": {"max_messages": 7}})
    msgs = agent_history(12, rounds=3)
    msgs[1]["content"] = words(1_500)  # push the payload over the threshold
    before = copy.deepcopy(msgs)
    a = await pipe(msgs)
    assert not assembly_problems(before, msgs, a)
    history = a.messages[1:-1]
    assert len(history) <= 7
    assert not history or history[0]["role"] == "user"


# --------------------------------------------------------------------------- sliding-window


@pytest.mark.parametrize("keep", [1, 2, 3, 5, 8, 12])
async def test_sliding_window_keeps_last_turns(keep: int) -> None:
    msgs = agent_history(10)
    v = view(msgs)
    result = await manager({"type": "sliding-window", "params": {"keep_turns": keep, "cut_step": 1}}).manage_history(v)
    assert result.turns == v.turns[-keep:] if keep < 10 else result.turns == v.turns
    assert result.turns_dropped == max(0, 10 - keep)
    assert result.summary is None
    # default step: on a grid of ceil(keep/2) turns: at least keep turns, fewer than keep + step
    default = await manager({"type": "sliding-window", "params": {"keep_turns": keep}}).manage_history(v)
    step = math.ceil(keep / 2)
    assert min(keep, 10) <= len(default.turns) < min(keep + step, 10 + 1)
    assert default.turns == v.turns[len(v.turns) - len(default.turns) :]


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"keep_turns": 2}, 2),
        ({"window_size": 3}, 3),
        ({"max_turns": 4}, 4),
        ({"keep_turns": 2, "window_size": 3, "max_turns": 4}, 2),
        ({"window_size": 3, "max_turns": 4}, 3),
        ({"keep_turns": 5, "max_turns": 4}, 5),
        ({}, 10),
    ],
)
@pytest.mark.parametrize("name", ["sliding-window", "sliding_window"])
async def test_sliding_window_aliases_and_precedence(name: str, params: dict[str, int], expected: int) -> None:
    binding = REGISTRY.resolve("context_manager", {"type": name, "params": params}, "cm")
    assert binding.type == "sliding-window"
    assert binding.params.keep_turns == expected
    msgs = agent_history(12)
    v = view(msgs)
    params_step = {**params, "cut_step": 1}
    result = await manager({"type": name, "params": params_step}).manage_history(v)
    assert len(result.turns) == expected


async def test_sliding_window_through_config_aliases() -> None:
    cfg = make_config(context_manager={"type": "sliding_window", "params": {"max_turns": 7, "window_size": 6}})
    assert cfg.context_manager.type == "sliding-window"
    assert cfg.context_manager.params.keep_turns == 6


async def test_sliding_window_through_the_pipeline() -> None:
    pipe = Pipe(window=4_000, context_manager={"type": "sliding-window", "params": {"keep_turns": 3, "cut_step": 1}})
    msgs = agent_history(20, rounds=2)
    for m in msgs:
        if m["role"] == "tool":
            m["content"] = words(40)
    before = copy.deepcopy(msgs)
    a = await pipe(msgs)
    assert not assembly_problems(before, msgs, a)
    users = [m for m in a.messages if m["role"] == "user"]
    assert [u["content"] for u in users] == ["turn 17", "turn 18", "turn 19", "current question"]
    assert a.report.turns_dropped == 17


# --------------------------------------------------------------------------- summarising


async def test_summarising_under_threshold_is_unchanged() -> None:
    msgs = agent_history(6)
    v = view(msgs, hard=100_000)
    result = await manager("summarising").manage_history(v)
    assert result.turns is v.turns and result.summary is None and result.summary_status == "none"
    a = await Pipe(engine=FakeEngine(), window=100_000)(msgs)
    assert a.changed is False and a.messages == msgs
    assert a.report.summary == "none"


@pytest.mark.parametrize("summarizer", ["drop", "llm"])
async def test_summarising_over_threshold_without_engine_drops_older_turns(summarizer: str) -> None:
    """Without a summariser older turns are dropped, and their values section alone takes their place: no model
    is called, yet every call argument of the dropped turns still reaches the model."""
    msgs = agent_history(10)
    total = view(msgs).payload_tokens()
    v = view(msgs, hard=total + 50, threshold=total - 200)
    binding = {"type": "summarising", "params": {"summarizer": summarizer, "keep_turns": 4, "cut_step": 1}}
    result = await manager(binding).manage_history(v)
    assert result.turns == v.turns[-4:]
    assert result.turns_dropped == 6 and result.turns_summarised == 0 and result.summary_status == "none"
    assert result.summary is not None and result.summary.role == "system"
    text = result.summary.raw["content"]
    assert text.startswith("[Conversation summary — 6 earlier turns]\nValues these turns acted on (the turns were "
                           "dropped to save context): q=c0_0_a, c0_0_b, c0_1, c1_0_a")
    assert all(f"c{t}_1" in text for t in range(6)) and "c6_" not in text
    assert result.detail == {"turns": 6, "values_only": True, "values": 18, "values_left_out": 0}
    dropped = sum(v.turn_tokens[:6])
    assert result.removed == {"windowed": dropped - result.summary.tokens}


def _summary_history(turns: int) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [system("You are an airline agent."), {"role": "developer", "content": "Be brief."}]
    for t in range(turns):
        msgs += [user(f"turn {t}: reservation ZFA0{t} " + words(60, t)), call((f"c{t}", "get_reservation")),
                 tool(f"c{t}", words(120, t)), assistant(f"answer {t}: " + words(40, t))]
    return [*msgs, user("which reservations did we discuss?")]


async def test_summarising_with_engine_places_one_summary_after_the_system_band() -> None:
    engine = FakeEngine()
    config = make_config(window=4_000, context_manager={"type": "summarising", "params": {"keep_turns": 2}})
    msgs = _summary_history(12)
    before = copy.deepcopy(msgs)
    async with running(config, engine) as runtime:
        a, _, _ = await runtime.assemble(CHAT, {"model": MODEL, "messages": msgs}, tenant=None)
    assert not assembly_problems(before, msgs, a)
    # the summariser's own window is the 4k model's: the aged part is summarised in chunks that fit it,
    # each folding the previous chunk's summary in
    assert a.report.summary == "created" and len(engine.calls) >= 2
    assert (
        "Previous summary:\n- the user booked flight HAT001 (reservation ZFA04Y) (call 1)"
        in engine.calls[1][1]["content"]
    )
    assert all(recount(call) + 1024 <= 4_000 for call in engine.calls)  # prompt + answer fit the window
    n = a.report.turns_summarised
    assert n >= 10
    out = a.messages
    assert out[0] is msgs[0] and out[1] is msgs[1]
    summary = out[2]
    assert summary["role"] == "system"
    assert summary["content"].startswith(f"[Conversation summary — {n} earlier turns]\n")
    # the summariser's text, then the values of the summarised turns it leaves out (its ZFA04Y is not ZFA04)
    _text, values = summary["content"].split(f"(call {len(engine.calls)})\n\n")
    listed = ", ".join(f"ZFA0{t}" for t in range(n))
    assert values == (f"Values these turns acted on (ctxproxy lists those the summary leaves out): user={listed}; "
                      f"q={', '.join(f'c{t}' for t in range(n))}")
    assert sum(1 for m in out if m["role"] == "system") == 2
    kept_users = [m for m in out if m["role"] == "user"]
    assert kept_users[-1] is msgs[-1]
    assert kept_users[0]["content"].startswith(f"turn {n}:")
    assert out[3:] == msgs[2 + 4 * n :]  # the kept turns verbatim, nothing else
    # the summariser was asked to keep identifiers and saw the aged turns
    prompt, body = engine.calls[0]
    assert prompt["role"] == "system" and all(w in prompt["content"] for w in ("ids", "names", "numbers", "paths"))
    assert "ZFA00" in body["content"] and f"ZFA0{n - 1}" in engine.calls[-1][1]["content"]


async def test_summary_is_reused_then_extended_incrementally() -> None:
    engine = FakeEngine()
    pipe = Pipe(engine=engine, window=4_000, context_manager={"type": "summarising", "params": {"keep_turns": 2}})
    base = _summary_history(12)
    first = await pipe(base)
    assert first.report.summary == "created"
    grown = [*base, assistant("answer"), user("one more short question")]
    second = await pipe(grown)
    assert second.report.summary == "reused" and len(engine.calls) == 1
    assert second.messages[: len(first.messages) - 1] == first.messages[:-1]
    longer = list(grown)
    for t in range(12, 20):
        longer += [call((f"c{t}", "get_reservation")), tool(f"c{t}", words(300, t)), assistant("ok"), user(f"t{t}")]
    third = await pipe(longer)
    assert third.report.summary == "created" and len(engine.calls) == 2
    assert "Previous summary:" in engine.calls[1][1]["content"]  # incremental: old summary + aged turns
    assert third.report.turns_summarised > first.report.turns_summarised


class FakeStore:
    """A SummaryStore that keeps summaries in a dict and counts calls."""

    def __init__(self) -> None:
        self.made: dict[tuple[str, str], CachedSummary] = {}
        self.lookups = 0

    async def lookup(self, scope: SummaryScope, chain: Sequence[str], *, recheck: bool = False) -> CachedSummary | None:
        self.lookups += 1
        best = None
        for _k, link in enumerate(chain, 1):
            found = self.made.get((scope.settings_id, link))
            if found is not None:
                best = found
        return best

    async def obtain(self, scope: SummaryScope, chain: Sequence[str], cut: int, turns: Any, previous: Any,
                     summarize: Any, request_id: str = "", model: str = "") -> tuple[CachedSummary, bool]:
        completion = await summarize(None, turns[:cut])
        made = CachedSummary(cut, chain[cut - 1], completion.text)
        self.made[(scope.settings_id, chain[cut - 1])] = made
        return made, True

    async def call_once(self, tenant: str, material: bytes, call: Any) -> Completion:
        return await call()


async def test_summarising_with_a_fake_summary_store() -> None:
    engine = FakeEngine("short summary")
    store = FakeStore()
    msgs = _summary_history(10)
    v = view(msgs, hard=1_500, svc=services(COUNTER, engine=engine, summaries=store))
    result = await manager({"type": "summarising", "params": {"keep_turns": 2}}).manage_history(v)
    assert result.summary_status == "created" and store.lookups == 1 and len(engine.calls) == 1
    n = result.turns_summarised
    assert result.turns == v.turns[n:] and n >= 8
    assert result.summary is not None and result.summary.raw["role"] == "system"
    # the summariser's text, with the values section the compaction service appended (cached with it)
    assert result.summary.raw["content"].startswith(
        f"[Conversation summary — {n} earlier turns]\nshort summary (call 1)\n\nValues these turns acted on "
        "(ctxproxy lists those the summary leaves out): user=ZFA00, ")
    assert result.summary.raw["content"].endswith(f"; q={', '.join(f'c{t}' for t in range(n))}")
    again = await manager({"type": "summarising", "params": {"keep_turns": 2}}).manage_history(v)
    assert again.summary_status == "reused" and len(engine.calls) == 1


async def test_summariser_failure_is_served_by_the_trimmer() -> None:
    class Broken(FakeEngine):
        async def complete(self, *a: Any, **k: Any) -> Any:
            raise TimeoutError("upstream timed out")

    pipe = Pipe(engine=Broken(), window=4_000, context_manager={"type": "summarising", "params": {"keep_turns": 2}})
    msgs = _summary_history(12)
    before = copy.deepcopy(msgs)
    a = await pipe(msgs)
    assert a.report.summary == "failed"
    assert not assembly_problems(before, msgs, a)
    assert not any(str(m.get("content", "")).startswith("[Conversation summary") for m in a.messages)


async def test_summary_that_does_not_fit_is_not_forced() -> None:
    engine = FakeEngine(words(550))
    binding = {"type": "summarising", "params": {"keep_turns": 2}}
    msgs = _summary_history(6)
    msgs[-1] = user(words(1_500))  # a large current turn: 1.5k of a 2k budget
    drop = await Pipe(max_tokens=2_000, context_manager={**binding, "params": {"summarizer": "drop",
                                                                               "keep_turns": 2}})(msgs)
    assert drop.report.tokens_after <= 2_000  # the request fits without the summary
    pipe = Pipe(engine=engine, max_tokens=2_000, context_manager=binding)
    try:
        a = await pipe(msgs)
    except ContextLengthExceeded as exc:
        pytest.fail(f"refused: {exc}")
    assert a.report.tokens_after <= 2_000


async def test_summarising_aliases_and_bad_params() -> None:
    b = REGISTRY.resolve("context_manager", {"type": "summarizing", "params": {"window_size": 4}}, "cm")
    assert b.type == "summarising" and b.params.keep_turns == 4 and b.summarizer and b.summarizer.type == "llm"
    b = REGISTRY.resolve("context_manager", {"type": "summarising", "params": {"summarizer": "drop"}}, "cm")
    assert b.summarizer and b.summarizer.type == "drop"
    with pytest.raises(BindingError) as info:
        REGISTRY.resolve("context_manager", {"type": "summarising", "params": {"summarizer": "gpt"}}, "cm")
    assert info.value.problems[0][0] == "cm.params.summarizer.type"


# --------------------------------------------------------------------------- prefix stability

SIM_WINDOW = 14_000  # B = 12,344 tokens; the simulated agent grows ~200 tokens a request (1.6% of B)


async def _prefix_share(pipe: Pipe, requests: list[list[dict[str, Any]]]) -> tuple[float, int, int, list[Assembly]]:
    """(share of requests forwarding the previous request's messages as a prefix, breaks, changed, assemblies)."""
    out: list[Assembly] = []
    stable = breaks = 0
    for messages in requests:
        before = copy.deepcopy(messages)
        a = await pipe(messages)
        assert not assembly_problems(before, messages, a)
        if out:
            prev = out[-1].messages
            if a.messages[: len(prev)] == prev:
                stable += 1
            else:
                breaks += 1
        out.append(a)
    return stable / (len(requests) - 1), breaks, sum(a.changed for a in out), out


PREFIX_CASES = {
    "summarising-fake-engine": {"type": "summarising"},
    "sliding-window": {"type": "sliding-window"},
    "stack-max-messages": {"type": "stack", "params": {"max_messages": 80}},
    "trimmer-alone": {"type": "stack"},
    "observation-masking": {"type": "observation-masking"},
    "summarising-no-masking": {"type": "summarising", "params": {"mask_observations": False}},
}


@pytest.mark.parametrize("case", sorted(PREFIX_CASES))
async def test_prefix_stability_over_100_requests(case: str) -> None:
    requests = AgentSim().requests(100)
    engine = FakeEngine() if case.startswith("summarising") else None
    pipe = Pipe(engine=engine, window=SIM_WINDOW, context_manager=PREFIX_CASES[case])
    share, breaks, changed, out = await _prefix_share(pipe, requests)
    print(f"prefix stability {case}: {share:.1%} ({breaks} breaks, {changed} of 100 requests compacted"
          + (f", {len(engine.calls)} summariser calls)" if engine else ")"))
    assert changed >= 30, "the simulated conversation must actually outgrow the budget"
    assert share >= 0.90
    if engine is not None:
        statuses = [a.report.summary for a in out]
        assert statuses.count("reused") >= 2 * statuses.count("created")
        assert len(engine.calls) == statuses.count("created") <= breaks


async def test_trimmer_alone_breaks_the_prefix_only_on_its_grid() -> None:
    """Between two grid lines (steps of hysteresis_ratio x B) the cut point does not move."""
    requests = AgentSim().requests(100)
    pipe = Pipe(window=SIM_WINDOW, context_manager="stack")
    _, breaks, _, out = await _prefix_share(pipe, requests)
    b = out[-1].report.hard_budget
    step = math.ceil(0.1 * b)
    worst = max(a.report.tokens_before for a in out) - b
    assert 0 < breaks <= math.ceil(worst / step)


async def test_explicit_summary_threshold_is_t() -> None:
    cm = {"type": "summarising", "params": {"summarizer": "drop", "summary_threshold": 700, "keep_turns": 2,
                                            "cut_step": 1}}
    pipe = Pipe(window=100_000, context_manager=cm)
    msgs = _summary_history(6)
    a = await pipe(msgs)
    assert a.report.threshold == 700
    assert a.report.tokens_before > 700 and a.report.turns_dropped == 4
    small = await pipe(_summary_history(1))
    assert small.report.tokens_before <= 700 and not small.changed


def test_summarising_finds_its_cut_in_linear_time() -> None:
    """The summarising manager tries cut points one turn at a time while the rest does not fit; each try summed
    every kept turn again, so a history of many short turns (and a large keep_turns) took quadratic time.
    The view's payload_tokens answers from suffix sums: time per turn must not grow with the history."""
    summarising = manager({"type": "summarising", "params": {"keep_turns": 10**9}})
    svc = services(COUNTER, engine=FakeEngine(), summaries=summary_service(), dry_run=True)

    def setup(n: int) -> Callable[[], object]:
        turns = [[Item({"role": "user", "content": str(i)}, USER, tokens=50)] for i in range(n)]
        budget = compute_budget(window=10**7, request_max_tokens=None, model_max_output=None,
                                trimmer=TrimmerParams(max_tokens=5_000), tenant_cap=None)

        def step() -> object:
            v = HistoryView(turns=turns, turn_tokens=[50] * n, chain_fn=lambda: [str(i) for i in range(n)],
                            pinned_tokens=0, budget=budget, counter=COUNTER, services=svc,
                            summary_item=lambda text, covered: CHAT.summary(text, covered, COUNTER))
            result = asyncio.run(summarising.manage_history(v))
            assert result.summary_status == "would_create" and len(result.turns) < 100
            return result
        return step

    growth = per_item_growth(setup, 2_000)
    assert growth < LINEAR, f"time per turn grew {growth:.1f}x from 2,000 to 16,000 turns"


@pytest.mark.usefixtures("shared_model_map")
async def test_sliding_window_cut_step_default_is_the_documented_one(upstream: FakeUpstream, start_proxy: StartProxy
                                                                     ) -> None:
    """The sliding window moves by the cut_step default the README documents (read from the README)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    row = re.search(r"^\s*\|\s*`sliding-window`.*$", readme, re.MULTILINE)
    assert row, "README has no sliding-window row"
    match = re.search(r"cut_step`?[^|]*?default ⌈\s*keep_turns\s*/\s*(\d+)\s*⌉", row.group(0))
    assert match, row.group(0)
    keep = 8
    step = math.ceil(keep / int(match.group(1)))
    # 8000 window, max output 1000: B = 6200, T = 5636. A 5700-token system prompt puts every request over T;
    # the turns are small, so the window alone decides what is kept (no trimming)
    cfg = summarising_config(upstream.base_url, context_manager={"type": "sliding-window",
                                                                "params": {"keep_turns": keep}})
    proxy = await start_proxy(cfg)
    system = {"role": "system", "content": text_of(5700, 4)}
    observed, expected = [], []
    for n in range(keep + 1, keep + 9):  # n history turns, then the current question
        messages: list[Message] = [system]
        for i in range(n):
            messages += [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
        messages.append({"role": "user", "content": "now?"})
        status, _headers, body = await post(proxy, chat_body(messages))
        assert status == 200, body
        observed.append(sum(1 for m in upstream.chat[-1].body["messages"] if m["role"] == "user") - 1)
        expected.append(n - (n - keep) // step * step)  # kept: keep .. keep + step - 1
    assert observed == expected, (step, observed, expected)
