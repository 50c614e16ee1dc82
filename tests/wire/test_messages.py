"""The Messages wire adapter through the pipeline: round trips, pairing per block, thinking,
cache breakpoints, wire-neutral summaries, hostile inputs, and property tests as for Chat Completions.

Checks use independent helpers (tests/wire/messages_helpers.py): Anthropic's pairing rules and the
documented token formula are re-implemented there, not imported from the adapter.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.core.errors import BadRequest, ContextLengthExceeded, CtxProxyError, PayloadError
from proxy.core.modelinfo import ModelMap
from proxy.core.pairing import PLACEHOLDER
from proxy.core.tokens import TokenCounter
from proxy.pipeline import Assembly, assemble, prepare
from proxy.policy import Routes, policy_for
from proxy.wire import WIRES
from proxy.wire.chat import WIRE as CHAT
from proxy.wire.messages import WIRE
from tests import media_files as mf
from tests.helpers import (
    LINEAR,
    AgentSim,
    FakeEngine,
    make_config,
    per_item_growth,
    running,
    services,
    summary_service,
)
from tests.wire.messages_helpers import (
    CLAUDE,
    assistant,
    body,
    cache_marks,
    conversations,
    from_chat,
    image,
    pairing_problems,
    recount,
    redacted,
    repaired_live_round,
    text_block,
    thinking,
    tool_result,
    tool_use,
    user,
)

COUNTER = TokenCounter("o200k_base")
MODEL_MAP = ModelMap()
MANAGERS: dict[str, Any] = {
    "summarising-drop": {"type": "summarising", "params": {"summarizer": "drop", "keep_turns": 2}},
    "summarising-llm": {"type": "summarising", "params": {"keep_turns": 2}},
    "sliding-window": {"type": "sliding-window", "params": {"keep_turns": 2}},
    "stack": {"type": "stack", "params": {"max_messages": 6}},
}
BUDGETS = (300, 700, 1_500, 4_000, 60_000)


class Setup:
    def __init__(self, manager: str, budget: int) -> None:
        config = make_config(window=200_000, max_tokens=budget, model=CLAUDE, context_manager=MANAGERS[manager])
        self.route = Routes(config, MODEL_MAP).resolve(CLAUDE)
        self.policy = policy_for(config, None, CLAUDE, None)
        self.llm = manager == "summarising-llm"

    async def go(self, request: dict[str, Any], engine: FakeEngine | None = None) -> Assembly:
        svc = services(COUNTER, engine=engine or FakeEngine(), summaries=summary_service()) if self.llm \
            else services(COUNTER)
        return await assemble(request, wire=WIRE, route=self.route, policy=self.policy, counter=COUNTER, services=svc)

    def run(self, request: dict[str, Any]) -> Assembly:
        return asyncio.run(self.go(request))


SETUPS = {(m, b): Setup(m, b) for m in MANAGERS for b in BUDGETS}


def rich_body() -> dict[str, Any]:
    """Everything a client may send that the proxy does not interpret, in a well-paired conversation."""
    return body([
        user([text_block("Read this.", cache_control={"type": "ephemeral"}), image(),
              {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0x"},
               "title": "spec.pdf", "citations": {"enabled": True}},
              {"type": "x_future_block", "anything": [1, 2.5, None, "é"]}]),
        assistant([thinking("Plan: look it up.", "EqQBCkYIBRgCKkD=="), redacted(),
                   text_block("Looking.", citations=[{"type": "page_location", "cited_text": "x",
                                                      "document_index": 0, "start_page_number": 1,
                                                      "end_page_number": 2}]),
                   tool_use("toolu_01", "Read", path="/srv/app.py")], x_client_field={"keep": True}),
        user([tool_result("toolu_01", [text_block("print('hi')"), image("AAAA")], is_error=False,
                          cache_control={"type": "ephemeral"}), text_block("Now explain it. 🚀 Zürich 東京")]),
    ], system=[{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197;"},
               {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
        tools=[{"name": "Read", "description": "read a file", "input_schema": {"type": "object"},
                "cache_control": {"type": "ephemeral"}}],
        thinking={"type": "adaptive"}, metadata={"user_id": "u"}, output_config={"effort": "high"},
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}, stream=True)


# --------------------------------------------------------------------------- round trips


def test_untouched_body_is_forwarded_as_the_clients_own_object() -> None:
    request = rich_body()
    before = orjson.dumps(request)
    a = SETUPS[("summarising-drop", 60_000)].run(request)
    assert a.changed is False and a.body is request
    assert orjson.dumps(a.body) == before
    assert a.report.repairs == {}


def test_render_of_every_parsed_item_is_byte_identical() -> None:
    request = rich_body()
    conversation = WIRE.parse(request, COUNTER)
    assert conversation.paired is True
    rendered = WIRE.render(request, conversation.items, {})
    assert orjson.dumps(rendered) == orjson.dumps(request)
    assert all(a is b for a, b in zip(rendered["messages"], request["messages"]))


def test_a_user_message_is_split_into_results_then_text() -> None:
    conversation = WIRE.parse(rich_body(), COUNTER)
    roles = [(i.role, i.source) for i in conversation.items]
    assert roles == [("user", 0), ("assistant", 1), ("tool", 2), ("user", 2)]
    assert conversation.items[1].call_ids == ("toolu_01",)
    assert conversation.items[2].result_id == "toolu_01"
    assert conversation.items[1].pinned is False  # in history: the current turn is the last user text


def test_token_counts_follow_the_documented_formula() -> None:
    request = rich_body()
    request["messages"][0]["content"] = [b for b in request["messages"][0]["content"] if b["type"] != "document"]
    conversation = WIRE.parse(request, COUNTER)
    assert conversation.fixed_tokens + sum(i.tokens for i in conversation.items) == recount(request)


# --------------------------------------------------------------------------- pairing, per block


def repaired(request: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, int]]:
    prepared = prepare(request, WIRE, COUNTER)
    return WIRE.render(request, prepared.repaired, {})["messages"], dict(prepared.repairs)


def test_an_orphan_result_is_dropped_and_the_text_beside_it_kept() -> None:
    msgs, repairs = repaired(body([user("hi"), assistant("hello"),
                                   user([tool_result("toolu_ghost", "?"), text_block("next")])]))
    assert repairs == {"orphan_result": 1}
    assert msgs[-1] == {"role": "user", "content": [text_block("next")]}
    assert not pairing_problems(msgs)


def test_a_duplicate_result_is_dropped_the_first_kept() -> None:
    msgs, repairs = repaired(body([user("hi"), assistant([tool_use("t1")]),
                                   user([tool_result("t1", "first"), tool_result("t1", "second")])]))
    assert repairs == {"duplicate_result": 1}
    assert msgs[-1]["content"] == [tool_result("t1", "first")]


def test_results_after_text_are_moved_first() -> None:
    msgs, repairs = repaired(body([user("hi"), assistant([tool_use("t1"), tool_use("t2")]),
                                   user([text_block("here"), tool_result("t1"), tool_result("t2")])]))
    assert repairs == {"moved_result": 2}
    assert [b["type"] for b in msgs[-1]["content"]] == ["tool_result", "tool_result", "text"]
    assert not pairing_problems(msgs)


def test_results_in_a_later_message_are_moved_back_next_to_their_call() -> None:
    msgs, repairs = repaired(body([user("hi"), assistant([tool_use("t1"), tool_use("t2")]),
                                   user([tool_result("t1"), text_block("more")]), user([tool_result("t2")])]))
    assert repairs == {"moved_result": 1}
    assert not pairing_problems(msgs)
    assert [b.get("tool_use_id") for b in msgs[2]["content"]] == ["t1", "t2", None]


def test_a_missing_result_gets_an_error_placeholder() -> None:
    msgs, repairs = repaired(body([user("hi"), assistant([tool_use("t1"), tool_use("t2")]),
                                   user([tool_result("t1")])]))
    assert repairs == {"missing_result": 1}
    assert msgs[-1]["content"][1] == {"type": "tool_result", "tool_use_id": "t2", "content": PLACEHOLDER,
                                      "is_error": True}


def test_unanswered_calls_are_stripped_and_a_thinking_only_message_dropped() -> None:
    msgs, repairs = repaired(body([
        user("hi"), assistant([thinking(), text_block("calling"), tool_use("t1")]), user("never mind"),
        assistant([thinking(), tool_use("t2")]), user("and again")]))
    assert repairs == {"unanswered_calls": 2, "empty_assistant": 1}
    assert msgs[1]["content"] == [thinking(), text_block("calling")]  # thinking kept with its text
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "user"]
    assert not pairing_problems(msgs)


def test_duplicate_call_ids_in_one_message_are_refused() -> None:
    with pytest.raises(PayloadError) as err:
        repaired(body([user("hi"), assistant([tool_use("t1"), tool_use("t1")]), user([tool_result("t1")])]))
    assert err.value.code in ("duplicate_tool_call_id", "unpaired_tool_call")


# --------------------------------------------------------------------------- observation masking


def test_mask_replaces_the_content_of_a_tool_result_and_keeps_its_id_and_error_flag() -> None:
    """Observation masking: a tool_result keeps tool_use_id, is_error and cache_control; its text, images and
    documents give way to the placeholder text; the client's block is never edited in place."""
    block = tool_result("t1", [text_block("line " * 80), image("AAAA"),
                               {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                                               "data": "doc " * 50}}],
                        is_error=True, cache_control={"type": "ephemeral"})
    request = body([user("hi"), assistant([thinking(), tool_use("t1")]), user([block, tool_result("t2", "x")])])
    items = WIRE.parse(request, COUNTER).items
    result = next(i for i in items if i.result_id == "t1")
    before = copy.deepcopy(block)
    masked = WIRE.mask(result, "[masked]", COUNTER)
    assert masked is not None and block == before
    assert masked.raw == {"type": "tool_result", "tool_use_id": "t1", "content": "[masked]", "is_error": True,
                          "cache_control": {"type": "ephemeral"}}
    assert masked.result_id == "t1" and masked.tokens < result.tokens and masked.key
    assert all(WIRE.mask(i, "[masked]", COUNTER) is None for i in items if i.result_id is None)


def test_a_masked_result_is_rendered_in_place_in_a_rebuilt_user_message() -> None:
    """The user message that held the result is written anew (never the client's own dict, which still
    holds the output), with its other blocks, in order, and its other keys."""
    message: dict[str, Any] = {"role": "user", "content": [tool_result("t1", "long " * 100), tool_result("t2", "kept"),
                                           text_block("and now?")], "x_meta": 1}
    request = body([user("hi"), assistant([tool_use("t1"), tool_use("t2")]), message, assistant("ok"),
                    user("next")])
    items = WIRE.parse(request, COUNTER).items
    at = next(k for k, i in enumerate(items) if i.result_id == "t1")
    masked = WIRE.mask(items[at], "[masked]", COUNTER)
    assert masked is not None
    out = WIRE.render(request, [*items[:at], masked, *items[at + 1:]], {})
    assert out["messages"][2] == {"role": "user", "x_meta": 1, "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": "[masked]"}, tool_result("t2", "kept"),
        text_block("and now?")]}
    assert out["messages"][2] is not message and message["content"][0]["content"] == "long " * 100
    assert all(out["messages"][k] is request["messages"][k] for k in (0, 1, 3, 4))
    assert not pairing_problems(out["messages"])


# --------------------------------------------------------------------------- thinking


def agent_body(turns: int, *, with_thinking: bool = True, result_words: int = 120) -> dict[str, Any]:
    """A conversation of ``turns`` user turns, each with a tool round (thinking + tool_use) and an answer,
    ending inside the last turn's tool loop."""
    from tests.helpers import words

    msgs: list[dict[str, Any]] = []
    for t in range(turns):
        msgs.append(user(f"turn {t}: " + words(30, t)))
        first: list[dict[str, Any]] = [thinking(f"turn {t} plan " + words(20, t), f"sig{t}==")] if with_thinking else []
        msgs.append(assistant([*first, tool_use(f"toolu_{t}a", "Read", n=t)]))
        msgs.append(user([tool_result(f"toolu_{t}a", words(result_words, t + 1))]))
        msgs.append(assistant([tool_use(f"toolu_{t}b", "Bash", n=t)]))
        msgs.append(user([tool_result(f"toolu_{t}b", words(result_words, t + 2))]))
        if t < turns - 1:
            msgs.append(assistant([text_block(f"answer {t}: " + words(40, t))]))
    out = body(msgs)
    if with_thinking:
        out["thinking"] = {"type": "enabled", "budget_tokens": 1024}
    return out


def test_thinking_blocks_are_forwarded_byte_for_byte_and_the_turns_thinking_is_pinned() -> None:
    request = agent_body(12)
    clients = copy.deepcopy(request)
    a = SETUPS[("stack", 1_500)].run(request)
    assert a.changed and request == clients
    forwarded = a.body["messages"]
    kept = [m for m in forwarded if m["role"] == "assistant"]
    # every kept assistant message is the client's own object: its thinking blocks (and signatures) untouched
    assert all(any(m is c for c in request["messages"]) for m in kept)
    # the current turn's first assistant message carries its thinking: never dropped
    current = request["messages"][-4]
    assert current["content"][0]["type"] == "thinking" and any(m is current for m in forwarded)
    assert not pairing_problems(forwarded)
    assert recount(a.body) <= a.report.hard_budget


def test_thinking_with_tool_use_stays_in_its_message_when_history_is_summarised() -> None:
    request = agent_body(10)
    a = SETUPS[("summarising-llm", 1_500)].run(request)
    assert a.report.summary == "created"
    forwarded = a.body["messages"]
    assert forwarded[0]["content"][0]["text"].startswith("[Conversation summary")
    for m in forwarded:
        if m["role"] == "assistant" and m["content"][0]["type"] == "thinking":
            assert any(m is c for c in request["messages"])
            assert m["content"][-1]["type"] == "tool_use"  # the thinking is still with its tool cycle


# --------------------------------------------------------------------------- cache breakpoints


def marked_body(turns: int) -> dict[str, Any]:
    """What Claude Code sends: marks on tools, system, and the last message (4 in all)."""
    request = agent_body(turns, with_thinking=False)
    request["tools"] = [{"name": "Read", "description": "read", "input_schema": {"type": "object"},
                         "cache_control": {"type": "ephemeral"}}]
    request["system"] = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197;"},
                         {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}]
    request["messages"][0]["content"] = [text_block(request["messages"][0]["content"],
                                                    cache_control={"type": "ephemeral"})]
    last = request["messages"][-1]
    last["content"] = [{**last["content"][0], "cache_control": {"type": "ephemeral"}}]
    return request


@pytest.mark.parametrize("manager", sorted(MANAGERS))
def test_breakpoints_never_exceed_four_after_compaction(manager: str) -> None:
    request = marked_body(14)
    assert cache_marks(request) == 4
    a = SETUPS[(manager, 1_500)].run(request)
    assert a.changed and a.report.tokens_after < a.report.tokens_before
    assert cache_marks(a.body) <= 4
    assert a.body["system"] is request["system"] and a.body["tools"] is request["tools"]


def test_five_breakpoints_are_refused_before_anything_is_forwarded() -> None:
    request = marked_body(2)
    request["messages"][1]["content"][0]["cache_control"] = {"type": "ephemeral"}
    with pytest.raises(PayloadError) as err:
        SETUPS[("stack", 60_000)].run(request)
    assert "A maximum of 4 blocks with cache_control" in err.value.message


# --------------------------------------------------------------------------- one summary for both wires


async def test_one_conversation_on_chat_then_on_messages_reuses_the_same_summary() -> None:
    """Summary cache keys are wire-neutral: the same history summarised on Chat is reused on Messages."""
    chat = AgentSim(system_words=40, result_words=60).requests(40)[-1]
    system, messages = from_chat(chat)
    anthropic = body(messages, system=system)
    engine = FakeEngine()
    config = make_config(window=200_000, max_tokens=3_000, context_manager={"type": "summarising",
                                                                           "params": {"keep_turns": 3}}, model=CLAUDE)
    async with running(config, engine) as runtime:
        first, _, _ = await runtime.assemble(WIRES["chat"], {"model": CLAUDE, "messages": chat}, tenant=None)
        assert first.report.summary == "created" and len(engine.calls) == 1
        second, _, _ = await runtime.assemble(WIRES["messages"], anthropic, tenant=None)
    assert second.report.summary == "reused"
    assert len(engine.calls) == 1
    assert second.report.turns_summarised == first.report.turns_summarised
    summary = second.body["messages"][0]["content"][0]["text"]
    assert "(call 1)" in summary and summary == first.body["messages"][1]["content"]


def test_the_same_conversation_yields_the_same_atoms_on_both_wires() -> None:
    chat = AgentSim(system_words=10).requests(12)[-1]
    system, messages = from_chat(chat)
    chat_atoms = [a for item in CHAT.parse({"messages": chat}, COUNTER).items if item.role != "system"
                  for a in item.atoms()]
    messages_atoms = [a for item in WIRE.parse(body(messages, system=system), COUNTER).items for a in item.atoms()]
    assert chat_atoms == messages_atoms


# --------------------------------------------------------------------------- hostile and unusual clients

BAD: list[tuple[str, dict[str, Any], str]] = [
    ("no max_tokens", {"model": CLAUDE, "messages": [user("hi")]}, "max_tokens"),
    ("messages not a list", body([]) | {"messages": {"role": "user"}}, "messages"),
    ("empty messages", body([]), "messages"),
    ("unknown role", body([{"role": "developer", "content": "x"}]), "messages.0.role"),
    ("tool_result in a system message", body([user("x"), {"role": "system", "content": [tool_result("t1")]}]),
     "messages.1.content.0"),
    ("empty content", body([user([])]), "messages.0.content"),
    ("empty string content", body([user(""), assistant("x"), user("y")]), "messages.0.content"),
    ("block without type", body([user([{"text": "x"}])]), "messages.0.content.0"),
    ("tool_use in a user message", body([user([tool_use("t1")])]), "messages.0.content.0"),
    ("tool_result in an assistant message", body([user("x"), assistant([tool_result("t1")])]),
     "messages.1.content.0"),
    ("tool_use without id", body([user("x"), assistant([{"type": "tool_use", "name": "f", "input": {}}])]),
     "messages.1.content.0.id"),
    ("tool_use input not an object", body([user("x"), assistant([{"type": "tool_use", "id": "t", "name": "f",
                                                                  "input": "{}"}])]), "messages.1.content.0.input"),
    ("tool_result without id", body([user([{"type": "tool_result", "content": "x"}])]),
     "messages.0.content.0.tool_use_id"),
    ("system not text", body([user("x")], system=42), "system"),
    ("tools not a list", body([user("x")], tools={"name": "f"}), "tools"),
]


@pytest.mark.parametrize(("name", "request_body", "param"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_refused_with_its_path_and_changes_nothing(name: str, request_body: dict[str, Any],
                                                                param: str) -> None:
    before = copy.deepcopy(request_body)
    with pytest.raises(BadRequest) as err:
        SETUPS[("stack", 60_000)].run(request_body)
    assert err.value.param == param, err.value.message
    assert request_body == before


def test_unusual_but_valid_inputs() -> None:
    setup = SETUPS[("stack", 60_000)]
    cases = [
        body([user("hi"), assistant("")]),  # an empty final assistant prefill is allowed
        body([user([text_block("a"), text_block("b")]), assistant("c"), user("d"), user("e")]),  # same-role runs
        body([assistant("I start"), user("ok")]),  # a conversation that starts with the assistant
        body([user("ünïcødé 🚀 \u0000 \ud7ff")], system=None),
        body([user("x")], system=[]),
        # Claude Code's mid-conversation system message after the current user turn (a 2026 beta)
        body([user([text_block("hi", cache_control={"type": "ephemeral"})]),
              {"role": "system", "content": "Available agent types: ..."}]),
    ]
    for request in cases:
        a = setup.run(request)
        assert a.changed is False and a.body is request


def test_a_huge_body_fits_or_is_refused_quickly() -> None:
    from tests.helpers import words

    big = body([user(words(20_000, 1)), assistant("ok"), user("short question")])
    a = SETUPS[("sliding-window", 4_000)].run(copy.deepcopy(big))
    assert a.report.tokens_after <= 4_000 and a.body["messages"][-1] == user("short question")
    with pytest.raises(ContextLengthExceeded):
        SETUPS[("sliding-window", 300)].run(body([user(words(20_000, 1))]))


# --------------------------------------------------------------------------- properties

PROPERTY = settings(max_examples=60, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.large_base_example])


def current_blocks(messages: list[dict[str, Any]]) -> list[Any]:
    """The non-result blocks of the last user message with more than tool results (the current turn)."""
    for m in reversed(messages):
        if m["role"] == "user":
            c = m["content"]
            if isinstance(c, str):
                return [m]
            others = [b for b in c if b.get("type") != "tool_result"]
            if others:
                return others
    return []


def forwarded_has(forwarded: list[dict[str, Any]], block: Any) -> bool:
    for m in forwarded:
        if m is block:
            return True
        if isinstance(m["content"], list) and any(b is block for b in m["content"]):
            return True
    return False


@pytest.mark.parametrize("manager", sorted(MANAGERS))
@PROPERTY
@given(request=conversations(), budget=st.sampled_from(BUDGETS))
def test_forwarded_body_is_paired_within_budget_and_keeps_its_pinned_parts(
        manager: str, request: dict[str, Any], budget: int) -> None:
    setup = SETUPS[(manager, budget)]
    before = copy.deepcopy(request)
    try:
        a = setup.run(request)
    except ContextLengthExceeded:
        assert request == before
        if not pairing_problems(before["messages"]):
            need = recount(body(current_only(before["messages"]), system=before.get("system"),
                                **({"tools": before["tools"]} if "tools" in before else {})))
            assert need > budget or manager == "summarising-llm" or live_round_size(before) > 0
        return
    out = a.body
    assert request == before, "the client's body was mutated"
    assert not pairing_problems(out["messages"]), pairing_problems(out["messages"])
    n = recount(out)
    assert n == a.report.tokens_after, (n, a.report.tokens_after)
    assert n <= budget
    assert cache_marks(out) <= 4
    assert out.get("system") is request.get("system") and out.get("tools") is request.get("tools")
    for block in current_blocks(request["messages"]):
        assert forwarded_has(out["messages"], block), "the current user turn was changed"
    live = repaired_live_round(request["messages"])
    if live and not pairing_problems(request["messages"]):
        assert any(m["role"] == "assistant" and isinstance(m["content"], list)
                   and [b.get("id") for b in m["content"] if b.get("type") == "tool_use"] == live
                   for m in out["messages"]), "the live tool round was dropped"


def current_only(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    blocks = current_blocks(messages)
    if blocks and isinstance(blocks[0], dict) and "role" in blocks[0]:
        return [blocks[0]]
    return [user(blocks)] if blocks else []


def live_round_size(request: dict[str, Any]) -> int:
    return len(repaired_live_round(request["messages"]))


@pytest.mark.parametrize("manager", sorted(MANAGERS))
@PROPERTY
@given(request=conversations(valid=True), budget=st.sampled_from(BUDGETS))
def test_valid_body_under_threshold_is_forwarded_as_the_clients_bytes(
        manager: str, request: dict[str, Any], budget: int) -> None:
    assert not pairing_problems(request["messages"]), pairing_problems(request["messages"])
    if recount(request) > int(budget / 1.1):
        return
    raw = orjson.dumps(request)
    a = SETUPS[(manager, budget)].run(request)
    assert a.changed is False and a.body is request and orjson.dumps(a.body) == raw
    assert a.report.repairs == {}


@PROPERTY
@given(request=conversations())
def test_repair_output_always_passes_the_independent_checker(request: dict[str, Any]) -> None:
    before = copy.deepcopy(request)
    try:
        msgs, _ = repaired(request)
    except PayloadError as exc:
        assert exc.code == "duplicate_tool_call_id"
        return
    assert request == before
    assert not pairing_problems(msgs), pairing_problems(msgs)
    again = body(msgs)
    assert prepare(again, WIRE, COUNTER).repairs == {}  # idempotent


# --------------------------------------------------------------------------- a warm request (proxy.core.warm)


def _forwarded(setup: Setup, request: dict[str, Any], counter: TokenCounter, tenant: str = "t") -> Any:
    """What the pipeline makes of ``request`` with ``counter`` (whose memory holds what it parsed before) for
    ``tenant``: the forwarded bytes, whether it changed and the report, or the refusal."""
    async def go() -> Assembly:
        svc = services(counter, engine=FakeEngine(), summaries=summary_service()) if setup.llm else services(counter)
        policy = dataclasses.replace(setup.policy, tenant=tenant)
        return await assemble(request, wire=WIRE, route=setup.route, policy=policy, counter=counter, services=svc)

    try:
        a = asyncio.run(go())
    except CtxProxyError as exc:
        return ("refused", type(exc).__name__, exc.message, exc.param)
    report = a.report.as_dict()
    report.pop("summary_wait", None)  # a time, not a decision
    return orjson.dumps(a.body), a.changed, report


@pytest.mark.parametrize("manager", sorted(MANAGERS))
@PROPERTY
@given(first=conversations(), more=conversations(max_turns=2), budget=st.sampled_from(BUDGETS),
       edit=st.sampled_from(("append", "same", "edit_middle", "truncate", "reorder", "other_tenant", "empty_prefill")),
       data=st.data())
def test_a_warm_request_forwards_what_a_cold_one_does(
        manager: str, first: dict[str, Any], more: dict[str, Any], budget: int, edit: str, data: st.DataObject) -> None:
    """A request of a conversation its tenant sent before is parsed from where that one ended (its messages checked,
    split, counted and grouped only after it): whatever the client did in between (appended turns, resent it,
    edited the middle, truncated, reordered, another tenant sent it, or the earlier one ended with an empty assistant
    prefill), it forwards the same bytes with the same report as on a fresh process, or is refused the same way."""
    setup = SETUPS[(manager, budget)]
    later = copy.deepcopy(first)
    messages = later["messages"]
    if edit in ("append", "other_tenant"):
        messages += more["messages"]
    elif edit == "empty_prefill":
        first["messages"].append({"role": "assistant", "content": ""})  # allowed as the last message only
        messages += [{"role": "assistant", "content": ""}, *more["messages"]]
    elif edit == "edit_middle":
        i = data.draw(st.integers(0, len(messages) - 1))
        messages[i] = {**messages[i], "content": "edited"}
        messages += more["messages"]
    elif edit == "truncate" and len(messages) > 1:
        del messages[data.draw(st.integers(1, len(messages) - 1)):]
    elif edit == "reorder" and len(messages) > 1:
        i, j = data.draw(st.integers(0, len(messages) - 1)), data.draw(st.integers(0, len(messages) - 1))
        messages[i], messages[j] = messages[j], messages[i]
    warm = TokenCounter("o200k_base")
    _forwarded(setup, copy.deepcopy(first), warm)
    tenant = "u" if edit == "other_tenant" else "t"
    expected = _forwarded(setup, copy.deepcopy(later), TokenCounter("o200k_base"), tenant)
    assert _forwarded(setup, copy.deepcopy(later), warm, tenant) == expected
    assert _forwarded(setup, copy.deepcopy(later), warm, tenant) == expected  # what it remembered is unchanged


def test_a_body_nested_too_deeply_is_refused_warm_as_cold() -> None:
    """Found by an outside review: a body with a message nested past 254 levels and five cache_control marks was
    refused for its nesting on the warm path (its keys are made first) but for its marks by a fresh parse."""
    deep: Any = "x"
    for _ in range(300):
        deep = {"a": deep}
    messages = [user([text_block(f"t{i}", cache_control={"type": "ephemeral"}) for i in range(5)]),
                assistant([tool_use("t1", "lookup", deep=deep)]), user([tool_result("t1")])]

    def refusal(parse: Any) -> tuple[str, str | None]:
        with pytest.raises(PayloadError) as err:
            parse(body(copy.deepcopy(messages)))
        return err.value.message, err.value.param

    cold = refusal(lambda b: WIRE.parse(b, TokenCounter("o200k_base")))
    assert refusal(lambda b: WIRE.resume(b, TokenCounter("o200k_base"), "t")) == cold
    assert "cache_control" in cold[0]


def test_a_growing_conversation_splits_and_counts_only_what_it_appends() -> None:
    """The items of the known prefix are the earlier request's; the turn's thinking is pinned on a copy, so the
    remembered item stays unpinned when a later turn no longer needs it."""
    counter = TokenCounter("o200k_base")
    base = [user("Read the file."), assistant([thinking("plan"), tool_use("t1")]), user([tool_result("t1", "ok")])]
    grown = [*copy.deepcopy(base), assistant("Done."), user("And now?")]
    first = WIRE.resume({**body(copy.deepcopy(base)), "thinking": {"type": "adaptive"}}, counter, "t")
    request = {**body(grown), "thinking": {"type": "adaptive"}}
    second = WIRE.resume(request, counter, "t")
    assert first.items[1].pinned and not second.items[1].pinned  # a new turn: the thinking is no longer pinned
    assert second.items[0] is first.items[0] and second.items[2] is first.items[2]
    assert second.items[1] is not first.items[1]  # first's pinned copy; second has the remembered original
    # rendered, each is given this request's own JSON, as on the full path (what it forwards is the client's objects)
    rendered = WIRE.render(request, second.items, {})["messages"]
    assert len(rendered) == len(grown) and all(a is b for a, b in zip(rendered, grown))
    assert second.items[2].raw is grown[2]["content"][0]
    assert [(i.role, i.pinned, i.key, i.tokens, orjson.dumps(i.raw)) for i in second.items] == [
        (i.role, i.pinned, i.key, i.tokens, orjson.dumps(i.raw))
        for i in WIRE.parse({**body(grown), "thinking": {"type": "adaptive"}}, TokenCounter("o200k_base")).items]


# --------------------------------------------------------------------------- ctxproxy assemble --wire messages


def test_assemble_cli_speaks_the_messages_wire(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    import yaml

    from proxy.cli import main

    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump({"upstreams": {"a": {"base_url": "http://127.0.0.1:9", "api": "anthropic"}},
                                   "cache": {"backend": "memory"}, "trimmer": {"max_tokens": 1_500},
                                   "context_manager": {"type": "sliding-window", "params": {"keep_turns": 2}}}))
    request = agent_body(10)
    path = tmp_path / "request.json"
    path.write_text(json.dumps(request))
    assert main(["assemble", "--offline", "--wire", "messages", "--config", str(cfg), str(path)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {"messages", "report"} and result["report"]["wire"] == "messages"
    assert result["report"]["tokens_after"] <= 1_500 and not pairing_problems(result["messages"])
    path.write_text(json.dumps({"model": CLAUDE, "messages": [user("hi")]}))  # no max_tokens
    assert main(["assemble", "--offline", "--wire", "messages", "--config", str(cfg), str(path)]) == 1
    error = json.loads(capsys.readouterr().out)
    assert error == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "max_tokens: Field required"},
    }


def test_a_user_message_with_thousands_of_results_renders_in_linear_time() -> None:
    """Render gathers the result items that answer one assistant message into one user message; it checked the
    whole gathered run again for each item, so a parallel round of thousands of calls (half of them answered:
    the other half get placeholders, so the message is rebuilt) took quadratic time. Time per result must not
    grow."""
    def setup(n: int) -> Any:
        request = {"model": CLAUDE, "max_tokens": 100, "messages": [
            {"role": "user", "content": "Read them all."},
            {"role": "assistant", "content": [{"type": "tool_use", "id": f"t{i}", "name": "read", "input": {"i": i}}
                                              for i in range(n)]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{i}", "content": "ok"}
                                         for i in range(0, n, 2)]}]}

        def step() -> Any:
            prepared = prepare(request, WIRE, COUNTER)
            out = WIRE.render(request, prepared.repaired, {})["messages"]
            assert len(out) == 3 and len(out[2]["content"]) == n
            return out
        return step

    growth = per_item_growth(setup, 1_000)
    assert growth < LINEAR, f"time per result grew {growth:.1f}x from 1,000 to 8,000 calls"


# --------------------------------------------------------------------------- media, as Anthropic bills them


def _block_cost(block: dict[str, Any]) -> int:
    """What one content block adds to a user message's count."""
    def total(content: list[dict[str, Any]]) -> int:
        conversation = WIRE.parse({"model": "claude-sonnet-4-5", "max_tokens": 100, "messages": [
            {"role": "user", "content": content}]}, COUNTER)
        return sum(i.tokens for i in conversation.items)

    text = {"type": "text", "text": "Look at this."}
    return total([text, block]) - total([text])


@pytest.mark.parametrize(("size", "tokens"), [((1, 1), 1), ((1092, 1092), 1590), ((4000, 3000), 1600)])
def test_images_count_by_their_pixels(size: tuple[int, int], tokens: int) -> None:
    """About width×height/750 after Claude's resizing: a 1×1 image is 1 token, not 1,600."""
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": mf.b64(mf.png(*size))}}
    assert _block_cost(image) == tokens
    result = {"type": "tool_result", "tool_use_id": "t", "content": [image]}  # inside a tool result too
    assert _block_cost(result) == 3 + 3 + tokens  # the result is an item of its own (3 + tool overhead 3)


def test_an_image_by_url_or_file_keeps_the_documented_default() -> None:
    assert _block_cost({"type": "image", "source": {"type": "url", "url": "https://x/cat.png"}}) == 1600
    assert _block_cost({"type": "image", "source": {"type": "file", "file_id": "file_1"}}) == 1600


def test_a_pdf_document_counts_its_text_and_a_page_image_per_page() -> None:
    pages = [mf.prose(120, i) for i in range(6)]
    document = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                               "data": mf.b64(mf.pdf(pages))}}
    assert _block_cost(document) == COUNTER.text("\n".join(pages) + "\n") + 6 * 1600
