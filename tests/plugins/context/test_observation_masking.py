"""Observation masking (plugins/masking.py): the ``observation-masking`` manager and ``summarising``'s hybrid.

Over the summary threshold the outputs of older tool calls give way to a placeholder naming the tool, the
call id and the size removed; the calls, every message, the current turn and the working memory stay as
the client sent them, and so do the last ``keep_recent`` results. The number masked moves on a grid of
``mask_step`` results counted from the conversation's first result.
"""

from __future__ import annotations

import copy
import json
import math
import re
from typing import Any

import pytest

from plugins.masking import MASK_STEP, placeholder
from plugins.registry import BindingError, default_registry
from proxy.core.modelinfo import ModelMap
from proxy.core.tokens import TokenCounter
from proxy.pipeline import Assembly, assemble
from proxy.policy import Routes, policy_for
from proxy.wire.chat import WIRE as CHAT
from proxy.wire.chat.items import count_message
from tests.helpers import (
    MODEL,
    FakeEngine,
    assembly_problems,
    assistant,
    call,
    make_config,
    services,
    summary_service,
    system,
    tool,
    user,
    words,
)

COUNTER = TokenCounter("o200k_base")
MASKED = re.compile(r"^\[ctxproxy removed this (\S+) output \((\S+), ([\d,]+) tokens\) to save context; "
                    r"call the tool again if you need it\]$")


class Pipe:
    def __init__(self, manager: Any, window: int = 8_000, engine: FakeEngine | None = None) -> None:
        cfg = make_config(window=window, context_manager=manager)
        self.route = Routes(cfg, ModelMap()).resolve(MODEL)
        self.policy = policy_for(cfg, None, MODEL, None)
        self.engine = engine
        self.services = services(COUNTER, engine=engine, summaries=summary_service() if engine else None)

    async def __call__(self, messages: list[dict[str, Any]]) -> Assembly:
        before = copy.deepcopy(messages)
        a = await assemble({"model": MODEL, "messages": messages}, wire=CHAT, route=self.route, policy=self.policy,
                           counter=COUNTER, services=self.services)
        problems = assembly_problems(before, messages, a)
        assert not problems, problems
        return a


def support_chat(turns: int, result_words: int = 300, *, current: bool = True) -> list[dict[str, Any]]:
    """A support conversation: each user turn gets one tool call with a large result, then an answer."""
    msgs: list[dict[str, Any]] = [system("You are an airline agent. " + words(60))]
    for t in range(turns):
        msgs.append(user(f"question {t}: " + words(20, t)))
        msgs.append(call((f"call_{t:03}", "get_reservation_details", json.dumps({"reservation_id": f"R{t:05}"}))))
        msgs.append(tool(f"call_{t:03}", f"reservation R{t:05}: " + words(result_words, t)))
        msgs.append(assistant(f"answer {t}: " + words(30, t)))
    if current:
        msgs.append(user("What did we book first?"))
    return msgs


def is_masked(message: dict[str, Any]) -> bool:
    return message.get("role") == "tool" and isinstance(message.get("content"), str) \
        and MASKED.match(message["content"]) is not None


def masked_ids(messages: list[dict[str, Any]]) -> list[str]:
    return [m["tool_call_id"] for m in messages if is_masked(m)]


def grid_lines(results: list[dict[str, Any]], step: int, tokens: int) -> list[int]:
    """Where the masked count may stop, reckoned here: after every run of at least ``step`` results holding at
    least ``tokens`` tokens (the hysteresis step), counted from the first result."""
    lines, count, size = [0], 0, 0
    for k, message in enumerate(results):
        count, size = count + 1, size + count_message(COUNTER, message)
        if count >= step and size >= tokens:
            lines.append(k + 1)
            count = size = 0
    return lines


def same_but_outputs(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> list[str]:
    """Everything but tool outputs forwarded as sent: same messages, in order; masked ones differ only in content."""
    problems = []
    if len(before) != len(after):
        return [f"{len(after)} messages forwarded, {len(before)} sent"]
    for i, (a, b) in enumerate(zip(before, after)):
        if is_masked(b):
            if a.get("role") != "tool" or {**a, "content": b["content"]} != b:
                problems.append(f"messages[{i}] masked but otherwise changed")
        elif a is not b:
            problems.append(f"messages[{i}] is not the client's own object")
    return problems


# --------------------------------------------------------------------------- the manager


async def test_under_the_threshold_nothing_is_masked() -> None:
    pipe = Pipe("observation-masking", window=128_000)
    msgs = support_chat(20)
    a = await pipe(msgs)
    assert not a.changed and a.messages is msgs and a.report.masked == []


async def test_over_the_threshold_older_outputs_are_masked_and_everything_else_kept() -> None:
    pipe = Pipe({"type": "observation-masking", "params": {"keep_recent": 3, "mask_step": 1}})
    msgs = support_chat(20)
    a = await pipe(msgs)
    out = a.messages
    assert not same_but_outputs(msgs, out), same_but_outputs(msgs, out)
    ids = masked_ids(out)
    assert ids and ids == [f"call_{t:03}" for t in range(len(ids))]  # oldest first
    assert len(ids) <= 20 - 3  # the last keep_recent results are verbatim
    assert a.report.tokens_before > a.report.threshold >= a.report.tokens_after  # masking alone was enough
    assert a.report.removed == {"masked": sum(m["tokens_removed"] for m in a.report.masked)}
    assert [m["call_id"] for m in a.report.masked] == ids
    assert {m["tool"] for m in a.report.masked} == {"get_reservation_details"}
    # the placeholder names the tool, the call id and the size removed
    first = next(m for m in out if is_masked(m))
    match = MASKED.match(first["content"])
    assert match is not None
    assert match.groups() == ("get_reservation_details", "call_000", f"{count_message(COUNTER, msgs[3]):,}")


async def test_a_growing_conversation_masks_each_result_once() -> None:
    """A request that resumes its conversation (proxy.core.warm) reuses the masked copies the earlier one made for
    the same results, and forwards what a request on a fresh counter forwards."""
    pipe = Pipe({"type": "observation-masking", "params": {"keep_recent": 3, "mask_step": 1}})
    first = await pipe(support_chat(20))
    grown = [*support_chat(20), assistant("R00000, on the first day."), user("And the second?")]
    second = await pipe(copy.deepcopy(grown))
    before = {item.result_id: item for item in first.items if is_masked(item.raw)}
    again = [item for item in second.items if item.result_id in before and is_masked(item.raw)]
    assert again and all(item is before[item.result_id] for item in again)
    cold = await assemble({"model": MODEL, "messages": copy.deepcopy(grown)}, wire=CHAT, route=pipe.route,
                          policy=pipe.policy, counter=TokenCounter("o200k_base"), services=pipe.services)
    assert json.dumps(second.messages) == json.dumps(cold.messages) and second.report == cold.report


async def test_masking_stops_at_the_first_grid_line_under_the_threshold() -> None:
    """With mask_step 1 and no hysteresis (a step of one token) every result is a grid line: the fewest outputs
    are masked, and one fewer would leave the request over T."""
    pipe = Pipe({"type": "observation-masking", "params": {"keep_recent": 1, "mask_step": 1,
                                                           "hysteresis_ratio": 0.0}})
    msgs = support_chat(20)
    a = await pipe(msgs)
    n = len(a.report.masked)
    assert 0 < n < 19 and a.report.tokens_after <= a.report.threshold
    assert a.report.tokens_after + a.report.masked[-1]["tokens_removed"] > a.report.threshold


@pytest.mark.parametrize("result_words", [60, 150, 400])
async def test_a_grid_line_holds_at_least_one_hysteresis_step_of_output(result_words: int) -> None:
    """Small outputs are masked several at a time: each move of the masked set frees at least the trimmer's step
    (hysteresis_ratio x B tokens) of output, so a large budget does not break the prefix every few requests."""
    pipe = Pipe({"type": "observation-masking", "params": {"keep_recent": 0, "mask_step": 1}}, window=6_000)
    msgs = support_chat(60, result_words=result_words)
    a = await pipe(msgs)
    size = count_message(COUNTER, msgs[3])  # every output has about this size
    per_line = max(1, math.ceil(math.ceil(0.1 * a.report.hard_budget) / size))
    n = len(a.report.masked)
    assert n > 0 and n % per_line == 0, (n, per_line)


@pytest.mark.parametrize("step", [1, 2, 3, 4, 5])
async def test_the_number_masked_moves_on_a_grid_as_the_conversation_grows(step: int) -> None:
    """Counted from the conversation's first result, the number masked is always a multiple of mask_step,
    never decreases as the conversation grows, and never reaches into the last keep_recent results; between
    two grid lines consecutive requests forward the same masked prefix."""
    pipe = Pipe({"type": "observation-masking", "params": {"keep_recent": 2, "mask_step": step}})
    full = support_chat(24, current=False)
    counts: list[int] = []
    previous: list[dict[str, Any]] | None = None
    for end in range(5, len(full) + 1, 4):
        msgs = [*full[:end], user("and now?")]
        a = await pipe(msgs)
        n = len(masked_ids(a.messages))
        results = [m for m in msgs if m["role"] == "tool"]
        assert n in grid_lines(results, step, math.ceil(0.1 * a.report.hard_budget)) and n <= max(0, len(results) - 2)
        if counts and n == counts[-1] and previous is not None:
            assert a.messages[: len(previous) - 1] == previous[:-1]  # the same prefix, grown at the end
        counts.append(n)
        previous = a.messages
    assert counts == sorted(counts) and counts[-1] > 0


async def test_the_default_grid_masks_up_to_its_last_line_before_keep_recent() -> None:
    pipe = Pipe("mask-observations", window=9_000)
    msgs = support_chat(40, result_words=120)
    a = await pipe(msgs)
    assert a.report.context_manager == "observation-masking"
    n = len(masked_ids(a.messages))
    results = [m for m in msgs if m["role"] == "tool"]
    lines = grid_lines(results, MASK_STEP, math.ceil(0.1 * a.report.hard_budget))
    assert n in lines and n == max(line for line in lines if line <= 40 - 10)  # as far as keep_recent allows
    assert a.report.removed.get("trimmed", 0) == 0


async def test_results_in_the_working_memory_are_never_masked_and_count_as_recent() -> None:
    msgs = support_chat(10, current=False)
    msgs.append(user("Check all three flights."))
    for k in range(3):  # the agent's live tool loop: working memory
        msgs.append(call((f"wm_{k}", "get_flight_status", json.dumps({"flight": f"HAT{k:03}"}))))
        msgs.append(tool(f"wm_{k}", words(300, 50 + k)))
    pipe = Pipe({"type": "observation-masking", "params": {"keep_recent": 4, "mask_step": 1}})
    a = await pipe(msgs)
    ids = masked_ids(a.messages)
    assert not any(i.startswith("wm_") for i in ids)
    assert all(a.messages[-6 + k] is msgs[-6 + k] for k in range(6))
    # 3 of the 4 recent results are in the working memory: only the history's last one is protected
    assert "call_009" not in ids and len(ids) <= 9
    assert a.report.tokens_after <= a.report.threshold


async def test_a_result_the_placeholder_would_not_shrink_is_left_alone() -> None:
    msgs = support_chat(12)
    msgs[3] = tool("call_000", "ok")
    pipe = Pipe({"type": "observation-masking", "params": {"keep_recent": 0, "mask_step": 1}}, window=6_000)
    a = await pipe(msgs)
    ids = masked_ids(a.messages)
    assert "call_000" not in ids and "call_001" in ids
    assert a.messages[3] is msgs[3]


async def test_when_masking_is_not_enough_the_trimmer_drops_whole_groups() -> None:
    pipe = Pipe({"type": "observation-masking", "params": {"keep_recent": 6, "mask_step": 2}}, window=5_000)
    msgs = support_chat(30)
    a = await pipe(msgs)
    assert a.report.removed["masked"] > 0 and a.report.removed["trimmed"] > 0
    assert a.report.tokens_after <= a.report.hard_budget
    # what is left: whole turns, the newest ones; their last six results verbatim
    tools = [m for m in a.messages if m["role"] == "tool"]
    assert all(m is msgs[msgs.index(m)] for m in tools[-6:])


async def test_every_wire_masks_the_same_results() -> None:
    """The manager is wire-neutral: the same conversation on Chat, Responses and Messages masks the same calls."""
    from proxy.wire.messages import WIRE as MESSAGES
    from proxy.wire.responses import WIRE as RESPONSES
    from tests.wire.messages_helpers import from_chat
    from tests.wire.responses_helpers import chat_to_responses

    msgs = support_chat(20)
    pipe = Pipe({"type": "observation-masking", "params": {"keep_recent": 4, "mask_step": 2}})
    seen = []
    for wire, body in ((CHAT, {"model": MODEL, "messages": msgs}),
                       (RESPONSES, {"model": MODEL, "input": chat_to_responses(msgs)}),
                       (MESSAGES, {"model": MODEL, "max_tokens": 256, "system": from_chat(msgs)[0],
                                   "messages": from_chat(msgs)[1]})):
        a = await assemble(body, wire=wire, route=pipe.route, policy=pipe.policy, counter=COUNTER,
                           services=pipe.services)
        seen.append([m["call_id"] for m in a.report.masked])
    assert seen[0] and seen[0] == seen[1] == seen[2]


def test_the_placeholder_is_about_40_tokens() -> None:
    """Names and ids are shortened so a placeholder stays small whatever the client named things."""
    cases = [("search_flights", "call_abc123", 1_234),
             ("get_reservation_details", "call_9fXyT2kLmN0pQrS7uVwX1yZ3", 23_553),
             ("Bash", "toolu_01A09q90qw90lq917835lq9", 812),
             ("x" * 500, "y" * 500, 10**9), ("", "\x00fn:lookup", 5)]
    for tool_name, call_id, tokens in cases:
        text = placeholder(tool_name, call_id, tokens)
        assert COUNTER.text(text) <= 45, text
        assert "\x00" not in text and "call the tool again" in text
    assert "fn:lookup" in placeholder("lookup", "\x00fn:lookup", 5)


def test_params_are_validated_and_the_alias_resolves() -> None:
    registry = default_registry()
    binding = registry.resolve("context_manager", "mask-observations", "cm")
    assert binding.type == "observation-masking"
    assert (binding.params.keep_recent, binding.params.mask_step) == (10, MASK_STEP)
    for bad in ({"keep_recent": -1}, {"mask_step": 0}, {"keep_turns": 3}):
        with pytest.raises(BindingError):
            registry.resolve("context_manager", {"type": "observation-masking", "params": bad}, "cm")


# --------------------------------------------------------------------------- summarising: mask first


async def test_summarising_masks_first_and_calls_no_summariser_when_that_is_enough() -> None:
    engine = FakeEngine()
    pipe = Pipe({"type": "summarising", "params": {"keep_turns": 2, "keep_recent": 3, "mask_step": 1}},
                engine=engine)
    a = await pipe(support_chat(20))
    assert a.report.summary == "none" and not engine.calls
    assert a.report.removed.keys() == {"masked"} and masked_ids(a.messages)


async def test_summarising_summarises_the_unmasked_turns_when_masking_is_not_enough() -> None:
    """The summariser sees the turns it summarises as the client sent them; the turns kept verbatim after the
    summary are the masked ones; the summary is cached under the client's turns, so the same history
    without masking reuses it."""
    engine = FakeEngine()
    pipe = Pipe({"type": "summarising", "params": {"keep_turns": 6, "keep_recent": 2, "mask_step": 1}},
                window=4_000, engine=engine)
    msgs = support_chat(30, result_words=120)
    a = await pipe(msgs)
    assert a.report.summary == "created" and len(engine.calls) >= 1
    prompt = json.dumps(engine.calls[0])
    assert "reservation R00000: " in prompt and "ctxproxy removed" not in prompt
    assert a.report.removed["masked"] > 0 and a.report.removed["summarised"] > 0
    kept = a.messages[2:]  # system band, summary, then the kept turns
    assert masked_ids(kept)
    assert a.report.masked and a.report.tokens_after <= a.report.hard_budget
    # the same summary, found under the client's own turns by a manager that does not mask
    plain = Pipe({"type": "summarising", "params": {"keep_turns": 6, "mask_observations": False}},
                 window=4_000, engine=engine)
    plain.services = pipe.services
    calls = len(engine.calls)
    b = await plain(msgs)
    assert b.report.summary == "reused" and len(engine.calls) == calls


async def test_summarising_without_masking_is_as_before() -> None:
    engine = FakeEngine()
    pipe = Pipe({"type": "summarising", "params": {"keep_turns": 2, "mask_observations": False}}, engine=engine)
    a = await pipe(support_chat(20))
    assert a.report.summary == "created" and not masked_ids(a.messages) and "masked" not in a.report.removed


def test_masking_is_linear_in_the_results() -> None:
    """Masking walks the results once (grid lines, the tool names, the copies): time per result must not grow
    with the history (a history of one long turn included, where every copy lands in the same turn)."""
    from plugins.base import HistoryView
    from plugins.context.observation_masking import ObservationMasking, ObservationMaskingParams
    from proxy.core.bands import assign_groups, split_bands, split_turns
    from proxy.core.budget import TrimmerParams, compute_budget
    from tests.helpers import LINEAR, per_item_growth
    from tests.wire.chat_helpers import items_of

    masking = ObservationMasking(ObservationMaskingParams.model_validate({"keep_recent": 10}))

    def setup(n: int) -> Any:
        msgs: list[dict[str, Any]] = [system("s"), user("go")]
        for t in range(n):
            msgs += [call((f"c{t}", "lookup", json.dumps({"t": t}))), tool(f"c{t}", words(120, t))]
        msgs.append(user("now"))
        items = items_of(msgs, COUNTER)
        assign_groups(items, merge_call_runs=False)
        turns = split_turns(split_bands(items).history)
        budget = compute_budget(window=10**8, request_max_tokens=None, model_max_output=None,
                                trimmer=TrimmerParams(max_tokens=1_000), tenant_cap=None)

        def step() -> object:
            view = HistoryView(turns=turns, turn_tokens=[sum(i.tokens for i in t) for t in turns],
                               chain_fn=lambda: [], pinned_tokens=0, budget=budget, counter=COUNTER,
                               services=services(COUNTER), summary_item=lambda text, n: CHAT.summary(text, n, COUNTER),
                               mask=lambda item, text: CHAT.mask(item, text, COUNTER))
            return masking._mask(view)
        return step

    growth = per_item_growth(setup, 500)
    assert growth < LINEAR, f"time per result grew {growth:.1f}x from 500 to 4,000 results"
