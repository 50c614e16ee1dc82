"""The Responses wire adapter: parse/render, pairing per item type, reasoning adjacency, pinned items,
property tests over generated conversations, and real tau-bench trajectories as Responses items.

Every forwarded payload is judged by checkers written in ``tests/wire/responses_helpers.py`` (pairing,
reasoning adjacency, the documented token formula), not by the adapter's own code.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import time
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.core.errors import ContextLengthExceeded, PayloadError
from proxy.core.modelinfo import ModelMap
from proxy.core.tokens import TokenCounter
from proxy.pipeline import Assembly, assemble
from proxy.policy import Routes, policy_for
from proxy.wire import WIRES
from proxy.wire.chat import WIRE as CHAT
from proxy.wire.responses import WIRE as RESPONSES
from proxy.wire.responses.items import COMPACT_PREFIX
from proxy.wire.responses.translator import items_of as responses_items
from tests import media_files as mf
from tests.helpers import (
    MANAGERS,
    MODEL,
    FakeEngine,
    make_config,
    services,
    summary_service,
    tau_trajectories,
    words,
)
from tests.wire.responses_helpers import (
    OUTPUTS,
    chat_to_responses,
    conversations,
    current_user,
    kind,
    last_compaction,
    pairing_problems,
    reasoning_problems,
    recount,
    ref_item_tokens,
    system_band,
)

COUNTER = TokenCounter("o200k_base")
MODEL_MAP = ModelMap()
ALL_MANAGERS = {**MANAGERS, "summarising-fake-engine": {"type": "summarising", "params": {"keep_turns": 2}}}


class Setup:
    def __init__(self, manager: Any = None, *, budget: int | None = None, window: int = 200_000, **extra: Any) -> None:
        binding = ALL_MANAGERS.get(manager, manager) if isinstance(manager, str) else manager
        config = make_config(window=window, max_tokens=budget, context_manager=binding, **extra)
        self.route = Routes(config, MODEL_MAP).resolve(MODEL)
        self.policy = policy_for(config, None, MODEL, None)
        self.engine = FakeEngine() if manager == "summarising-fake-engine" else None
        self.summaries = summary_service() if self.engine is not None else None

    async def run(self, body: dict[str, Any], wire: Any = RESPONSES) -> Assembly:
        svc = services(COUNTER, engine=self.engine, summaries=self.summaries)
        return await assemble(body, wire=wire, route=self.route, policy=self.policy, counter=COUNTER, services=svc)

    def run_sync(self, body: dict[str, Any]) -> Assembly:
        return asyncio.run(self.run(body))


def body_of(items: Any, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": items, **extra}


def problems_of(before_body: dict[str, Any], body: dict[str, Any], a: Assembly) -> list[str]:
    """Every invariant of a forwarded Responses payload, checked independently."""
    problems: list[str] = []
    if body != before_body:
        problems.append("the client's body was mutated")
    before = body["input"] if isinstance(body["input"], list) else [body["input"]]
    out_input = a.body["input"]
    after = out_input if isinstance(out_input, list) else [out_input]
    problems += [f"pairing: {p}" for p in pairing_problems(after)]
    problems += [f"reasoning: {p}" for p in reasoning_problems(before, after)]
    n = recount(a.body)
    if n != a.report.tokens_after:
        problems.append(f"tokens_after {a.report.tokens_after} != independent recount {n}")
    if n > a.report.hard_budget:
        problems.append(f"{n} tokens > hard budget {a.report.hard_budget}")
    band = system_band(before)
    if any(x is not y for x, y in zip(after, band)) or len(after) < len(band):
        problems.append("system band not forwarded verbatim at the start")
    for pinned, what in ((current_user(before), "current user item"), (last_compaction(before), "last compaction")):
        if pinned is not None and not any(e is pinned for e in after):
            problems.append(f"{what} missing")
    # kept items keep their order (outputs aside: a displaced output is moved back next to its call)
    kept_originals = [e for e in after if kind(e) not in OUTPUTS and any(e is x for x in before)]
    order = [next(i for i, x in enumerate(before) if x is e) for e in kept_originals]
    if order != sorted(order):
        problems.append("kept items were reordered")
    return problems


# --------------------------------------------------------------------------- parse / render


ALL_KINDS = [
    {"role": "developer", "content": "Be terse."},
    {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "sys"}], "x_extra": {"k": [1]}},
    {"role": "user", "content": "héllo 東京 🚀", "unknown_field": True},
    {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "plan"}],
     "encrypted_content": "Z0FBQUFBQm9fZW5jcnlwdGVk", "status": "completed"},
    {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed", "phase": "commentary",
     "content": [{"type": "output_text", "text": "Looking.", "annotations": [], "logprobs": []}]},
    {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "read", "arguments": "{\"p\": 1}",
     "status": "completed", "namespace": "files"},
    {"type": "custom_tool_call", "call_id": "c2", "name": "patch", "input": "*** Begin Patch"},
    {"type": "function_call_output", "call_id": "c1", "output": "file text"},
    {"type": "custom_tool_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "ok"}]},
    {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"type": "search", "query": "q"}},
    {"type": "mcp_call", "id": "mcp_1", "name": "n", "arguments": "{}", "server_label": "s", "output": "o"},
    {"type": "a_type_from_the_future", "id": "fx_1", "blob": {"deep": [[{"x": None}]]}},
    {"type": "compaction", "id": "cmp_1", "encrypted_content": "Y29tcGFjdGVk"},
    {"type": "item_like_thing_without_pairing", "call_id": "zz"},
    {"role": "user", "content": [{"type": "input_text", "text": "now"},
                                 {"type": "input_file", "file_id": "file_1", "filename": "a.pdf"}]},
]


def test_round_trip_is_byte_identical_for_untouched_inputs() -> None:
    body = body_of(copy.deepcopy(ALL_KINDS), instructions="Be helpful.", store=False, include=["x"],
                   tools=[{"type": "function", "name": "read", "parameters": {}}], unknown_top_level={"a": 1})
    raw = orjson.dumps(body)
    conversation = RESPONSES.parse(body, COUNTER)
    assert conversation.paired and not conversation.repairs and conversation.unmanaged is None
    rendered = RESPONSES.render(body, conversation.items, {})
    assert orjson.dumps(rendered) == raw
    assert all(a is b for a, b in zip(rendered["input"], body["input"]))
    a = Setup().run_sync(body)
    assert a.changed is False and a.body is body


def test_reasoning_travels_with_its_follower_and_compaction_is_pinned() -> None:
    items = RESPONSES.parse(body_of(copy.deepcopy(ALL_KINDS)), COUNTER).items
    reasoning = [i for i in items if isinstance(i.raw, list)]
    assert len(reasoning) == 1 and [kind(e) for e in reasoning[0].raw] == ["reasoning", "message"]
    assert [i.pinned for i in items if not isinstance(i.raw, list) and kind(i.raw) == "compaction"] == [True]
    calls = [i for i in items if i.call_ids]
    assert [c.call_ids for c in calls] == [("c1",), ("c2",)]


def test_only_the_last_compaction_is_pinned() -> None:
    items = [{"role": "user", "content": "a"}, {"type": "compaction", "encrypted_content": "QQ=="},
             {"role": "user", "content": "b"}, {"type": "compaction", "encrypted_content": "Qg=="},
             {"role": "user", "content": "c"}]
    parsed = RESPONSES.parse(body_of(items), COUNTER).items
    assert [i.pinned for i in parsed] == [False, False, False, True, False]


def test_string_input_is_one_user_turn_kept_as_a_string() -> None:
    body = body_of("what is 2+2?", max_output_tokens=50)
    conversation = RESPONSES.parse(body, COUNTER)
    assert [i.role for i in conversation.items] == ["user"]
    assert RESPONSES.render(body, conversation.items, {"max_output_tokens": 10}) == {**body, "max_output_tokens": 10}
    assert recount(body) == conversation.fixed_tokens + conversation.items[0].tokens


def test_a_string_input_rendered_beside_other_items_becomes_a_user_message() -> None:
    body = body_of("what is 2+2?")
    conversation = RESPONSES.parse(body, COUNTER)
    summary = RESPONSES.summary("earlier: nothing", 0, COUNTER)
    rendered = RESPONSES.render(body, [summary, *conversation.items], {})
    assert rendered["input"] == [summary.raw, {"role": "user", "content": "what is 2+2?"}]


def test_trailing_reasoning_is_dropped_as_a_counted_repair() -> None:
    items = [{"role": "user", "content": "hi"}, {"type": "reasoning", "id": "rs_9", "summary": []}]
    a = Setup().run_sync(body_of(items))
    assert a.report.repairs == {"orphan_reasoning": 1}
    assert a.changed and a.body["input"] == items[:1]
    with pytest.raises(PayloadError) as info:
        Setup(pairing="strict").run_sync(body_of(items))
    assert info.value.code == "invalid_tool_pairing"


def test_encrypted_content_is_estimated_not_counted_as_text() -> None:
    blob = "QUJD" * 10_000  # 40 kB of base64: 30 kB decoded
    item = {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": blob}
    parsed = RESPONSES.parse(body_of([item, {"role": "user", "content": "x"}]), COUNTER).items
    assert parsed[0].tokens - (3 + 1 + 1) == 30_000 // 4
    assert recount(body_of([item, {"role": "user", "content": "x"}])) == RESPONSES.parse(
        body_of([item, {"role": "user", "content": "x"}]), COUNTER).fixed_tokens + parsed[0].tokens


# --------------------------------------------------------------------------- pairing repair per item type

ROUNDS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "function_call": ({"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
                      {"type": "function_call_output", "call_id": "a", "output": "r"}),
    "custom_tool_call": ({"type": "custom_tool_call", "call_id": "a", "name": "f", "input": "x"},
                         {"type": "custom_tool_call_output", "call_id": "a", "output": "r"}),
    "computer_call": ({"type": "computer_call", "call_id": "a", "action": {"type": "click"}},
                      {"type": "computer_call_output", "call_id": "a",
                       "output": {"type": "computer_screenshot", "image_url": "data:image/png;base64,AA=="}}),
    "local_shell_call": ({"type": "local_shell_call", "call_id": "a", "id": "ls_1",
                          "action": {"type": "exec", "command": ["ls"], "env": {}}},
                         {"type": "local_shell_call_output", "id": "a", "output": "r"}),
    "shell_call": ({"type": "shell_call", "call_id": "a", "action": {"commands": ["ls"]}},
                   {"type": "shell_call_output", "call_id": "a", "output": []}),
    "apply_patch_call": ({"type": "apply_patch_call", "call_id": "a",
                          "operation": {"type": "delete_file", "path": "x"}},
                         {"type": "apply_patch_call_output", "call_id": "a", "status": "completed"}),
    "mcp_approval_request": ({"type": "mcp_approval_request", "id": "a", "name": "f", "arguments": "{}",
                              "server_label": "s"},
                             {"type": "mcp_approval_response", "approval_request_id": "a", "approve": True}),
    "program": ({"type": "program", "id": "p1", "call_id": "a", "code": "1", "fingerprint": "f"},
                {"type": "program_output", "id": "po1", "call_id": "a", "result": "1", "status": "completed"}),
    "tool_search_call": ({"type": "tool_search_call", "call_id": "a", "arguments": {"q": 1}, "execution": "client"},
                         {"type": "tool_search_output", "call_id": "a", "tools": []}),
}
PLACEHOLDER_OK = {"function_call", "custom_tool_call", "local_shell_call", "apply_patch_call"}


@pytest.mark.parametrize("call_kind", sorted(ROUNDS))
def test_pairing_repair_per_item_type(call_kind: str) -> None:
    call, output = ROUNDS[call_kind]
    setup = Setup()
    user = {"role": "user", "content": "go"}
    # paired: forwarded as sent
    a = setup.run_sync(body_of([user, call, output]))
    assert not a.changed and not a.report.repairs
    # orphan output: dropped
    a = setup.run_sync(body_of([user, output, {"role": "user", "content": "next"}]))
    assert a.report.repairs == {"orphan_result": 1} and a.body["input"] == [user, {"role": "user", "content": "next"}]
    # a result displaced behind the next user message: moved back
    nxt = {"role": "user", "content": "next"}
    a = setup.run_sync(body_of([user, call, nxt, output]))
    assert a.report.repairs == {"moved_result": 1} and a.body["input"] == [user, call, output, nxt]
    # duplicate output: the first is kept
    a = setup.run_sync(body_of([user, call, output, dict(output), nxt]))
    assert a.report.repairs == {"duplicate_result": 1} and a.body["input"] == [user, call, output, nxt]
    # an unanswered call alone: removed with the reasoning that led to it
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": []}
    a = setup.run_sync(body_of([user, reasoning, call, nxt]))
    assert a.body["input"] == [user, nxt] and a.report.repairs.get("unanswered_calls") == 1
    # a run of two calls, one answered: a placeholder where the output can be a string, else the call goes
    other = {"type": "function_call", "call_id": "b", "name": "g", "arguments": "{}"}
    other_out = {"type": "function_call_output", "call_id": "b", "output": "r2"}
    a = setup.run_sync(body_of([user, call, other, other_out, nxt]))
    assert not pairing_problems(a.body["input"])
    if call_kind in PLACEHOLDER_OK:
        assert a.report.repairs == {"missing_result": 1}
        placeholder = a.body["input"][4]  # after the output that was given, in the run's output block
        expected = "function_call_output" if call_kind == "local_shell_call" else output["type"]
        assert kind(placeholder) == expected and "no result was recorded" in json.dumps(placeholder)
    else:
        assert call not in a.body["input"] and a.report.repairs.get("unanswered_calls") == 1


def test_call_ids_share_one_namespace_as_codex_uses_them() -> None:
    """Codex answers a local_shell_call with a function_call_output: the same call_id pairs them."""
    call = {"type": "local_shell_call", "id": "ls_1", "call_id": "a", "status": "completed",
            "action": {"type": "exec", "command": ["ls"], "env": {}}}
    out = {"type": "function_call_output", "call_id": "a", "output": "README.md"}
    a = Setup().run_sync(body_of([{"role": "user", "content": "go"}, call, out]))
    assert not a.changed and not a.report.repairs
    # an MCP approval id is not a call id
    approval = {"type": "mcp_approval_response", "approval_request_id": "a", "approve": True}
    a = Setup().run_sync(body_of([{"role": "user", "content": "go"}, call, out, approval,
                                  {"role": "user", "content": "n"}]))
    assert a.report.repairs == {"orphan_result": 1}


def test_ids_reused_in_one_run_are_refused_and_across_groups_are_fine() -> None:
    c = {"type": "function_call", "call_id": "same", "name": "f", "arguments": "{}"}
    o = {"type": "function_call_output", "call_id": "same", "output": "r"}
    user = {"role": "user", "content": "u"}
    ok = Setup().run_sync(body_of([user, c, o, dict(c), dict(o), user]))
    assert not ok.changed
    with pytest.raises(PayloadError) as info:
        Setup().run_sync(body_of([user, c, dict(c), o, dict(o)]))
    assert info.value.code == "duplicate_tool_call_id" and info.value.param and info.value.param.startswith("input")


# --------------------------------------------------------------------------- observation masking

MASKED = "[masked]"
CALL = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}


@pytest.mark.parametrize(("output", "masked"), [
    ({"type": "function_call_output", "call_id": "c", "output": "result " * 40, "status": "completed", "id": "fo_1"},
     {"type": "function_call_output", "call_id": "c", "output": MASKED, "status": "completed", "id": "fo_1"}),
    ({"type": "function_call_output", "call_id": "c", "output": [
        {"type": "input_text", "text": "see"}, {"type": "input_image", "image_url": "https://x.test/a.png"}]},
     {"type": "function_call_output", "call_id": "c", "output": MASKED}),
    ({"type": "custom_tool_call_output", "call_id": "c", "output": "patched " * 40},
     {"type": "custom_tool_call_output", "call_id": "c", "output": MASKED}),
    ({"type": "local_shell_call_output", "id": "c", "output": "ls -la " * 40, "status": "completed"},
     {"type": "local_shell_call_output", "id": "c", "output": MASKED, "status": "completed"}),
    ({"type": "apply_patch_call_output", "call_id": "c", "status": "failed", "output": "hunk 1 failed " * 9},
     {"type": "apply_patch_call_output", "call_id": "c", "status": "failed", "output": MASKED}),
    ({"type": "shell_call_output", "call_id": "c", "max_output_length": 9, "output": [
        {"stdout": "a" * 300, "stderr": "", "outcome": {"type": "exit", "exit_code": 0}},
        {"stdout": "", "stderr": "warn", "outcome": {"type": "exit", "exit_code": 2}}]},
     {"type": "shell_call_output", "call_id": "c", "max_output_length": 9, "output": [
         {"stdout": MASKED, "stderr": "", "outcome": {"type": "exit", "exit_code": 2}}]}),
])
def test_mask_replaces_only_the_output_of_an_output_item(output: dict[str, Any], masked: dict[str, Any]) -> None:
    """Observation masking: an output item keeps its type, call id, status and other keys; its output (text,
    parts, shell chunks) gives way to the placeholder text; the client's item is never edited in place."""
    counter = COUNTER
    items = responses_items([{"role": "user", "content": "go"}, CALL, output], counter)
    before = copy.deepcopy(output)
    out = RESPONSES.mask(items[2], MASKED, counter)
    assert out is not None and output == before
    assert out.raw == masked and out.result_id == items[2].result_id and out.source == 2
    assert out.key and out.tokens == ref_item_tokens(masked)


def test_mask_keeps_reasoning_that_travels_with_an_output() -> None:
    counter = COUNTER
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "ZW5j"}
    output = {"type": "function_call_output", "call_id": "c", "output": "r " * 100}
    items = responses_items([{"role": "user", "content": "go"}, CALL, reasoning, output], counter)
    out = RESPONSES.mask(items[2], MASKED, counter)
    assert out is not None and out.raw == [reasoning, {**output, "output": MASKED}]


@pytest.mark.parametrize("output", [
    {"type": "computer_call_output", "call_id": "c", "output": {"type": "computer_screenshot", "image_url": "x"}},
    {"type": "mcp_approval_response", "approval_request_id": "c", "approve": True},
    {"type": "tool_search_output", "call_id": "c", "tools": []},
    {"type": "shell_call_output", "call_id": "c", "output": []},
])
def test_outputs_that_cannot_be_text_are_never_masked(output: dict[str, Any]) -> None:
    counter = COUNTER
    calls = {"computer_call_output": {"type": "computer_call", "call_id": "c", "action": {"type": "screenshot"}},
             "mcp_approval_response": {"type": "mcp_approval_request", "id": "c", "name": "f", "arguments": "{}",
                                       "server_label": "s"},
             "tool_search_output": {"type": "tool_search_call", "call_id": "c", "arguments": {}},
             "shell_call_output": {"type": "shell_call", "call_id": "c", "action": {"commands": ["ls"]}}}
    items = responses_items([{"role": "user", "content": "go"}, calls[output["type"]], output], counter)
    assert items[2].result_id is not None
    assert RESPONSES.mask(items[2], MASKED, counter) is None
    assert RESPONSES.mask(items[1], MASKED, counter) is None  # a call is never masked
    assert RESPONSES.mask(items[0], MASKED, counter) is None


# --------------------------------------------------------------------------- bad inputs: clear 400s


@pytest.mark.parametrize(("input_value", "param"), [
    (5, "input"),
    ({"role": "user"}, "input"),
    (["hi"], "input[0]"),
    ([{"content": "no role, no type"}], "input[0].type"),
    ([{"type": 7, "role": "user", "content": "x"}], "input[0].type"),
    ([{"role": "tool", "content": "x"}], "input[0].role"),
    ([{"role": {"a": 1}, "content": "x"}], "input[0].role"),
    ([{"role": "user"}], "input[0].content"),
    ([{"role": "user", "content": 5}], "input[0].content"),
    ([{"role": "user", "content": ["x"]}], "input[0].content[0]"),
    ([{"type": "function_call", "name": "f", "arguments": "{}"}], "input[0].call_id"),
    ([{"type": "function_call", "call_id": "a", "arguments": "{}"}], "input[0].name"),
    ([{"type": "function_call", "call_id": "a", "name": "f", "arguments": {"k": 1}}], "input[0].arguments"),
    ([{"type": "function_call_output", "output": "r"}], "input[0].call_id"),
    ([{"type": "function_call_output", "call_id": "a", "output": 3}], "input[0].output"),
    ([{"type": "mcp_approval_response", "approve": True}], "input[0].approval_request_id"),
])
def test_bad_inputs_are_clear_400s(input_value: Any, param: str) -> None:
    body = body_of(input_value)
    before = copy.deepcopy(body)
    with pytest.raises(PayloadError) as info:
        Setup().run_sync(body)
    error = info.value.to_openai()["error"]
    assert info.value.status == 400 and error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert body == before


def test_instructions_must_be_a_string() -> None:
    with pytest.raises(PayloadError) as info:
        Setup().run_sync(body_of("hi", instructions=["a"]))
    assert info.value.param == "instructions"


# --------------------------------------------------------------------------- provider-held state


@pytest.mark.parametrize("state", [{"previous_response_id": "resp_1"}, {"conversation": "conv_1"},
                                   {"conversation": {"id": "conv_1"}}])
def test_provider_held_state_is_forwarded_unchanged(state: dict[str, Any]) -> None:
    # outputs for calls the provider holds: no pairing repair, nothing dropped, even over budget
    items = [{"type": "function_call_output", "call_id": "held", "output": words(3000)},
             {"type": "reasoning", "id": "rs_1", "summary": []}]
    body = body_of(items, **state)
    a = Setup(budget=500).run_sync(body)
    assert a.body is body and not a.changed
    assert a.report.unmanaged == next(iter(state)) and a.report.repairs == {}
    assert any(next(iter(state)) in w for w in a.report.warnings)
    capped = Setup(budget=500, model="other-model").run_sync({**body, "model": "other-model", "max_output_tokens": 5})
    assert capped.body["input"] is items


def test_item_references_make_the_request_unmanaged() -> None:
    items = [{"type": "item_reference", "id": "fc_123"}, {"type": "function_call_output", "call_id": "x",
                                                            "output": "r"}]
    a = Setup().run_sync(body_of(items))
    assert a.report.unmanaged == "item_reference" and a.body["input"] is items


# --------------------------------------------------------------------------- budget, summaries, pins


def _agent_conversation(turns: int) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent. " + words(80)}]
    for t in range(turns):
        msgs.append({"role": "user", "content": f"turn {t}: " + words(30, t)})
        for r in range(2):
            cid = f"call_{t}_{r}"
            msgs.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": cid, "type": "function", "function": {"name": "search", "arguments": json.dumps({"t": t})}}]})
            msgs.append({"role": "tool", "tool_call_id": cid, "content": words(150, t + r)})
        msgs.append({"role": "assistant", "content": f"done {t}: " + words(40, t)})
    msgs.append({"role": "user", "content": "and now?"})
    return msgs


async def test_one_conversation_as_chat_then_as_responses_shares_one_summary() -> None:
    """The summary cache key is wire-neutral: a summary made for Chat Completions is reused on Responses."""
    setup = Setup("summarising-fake-engine", budget=3_000)
    messages = _agent_conversation(12)
    chat = await setup.run({"model": MODEL, "messages": messages}, wire=CHAT)
    assert chat.report.summary == "created" and setup.engine is not None and len(setup.engine.calls) == 1
    items = chat_to_responses(messages)
    responses = await setup.run(body_of(items))
    assert responses.report.summary == "reused", responses.report
    assert len(setup.engine.calls) == 1
    summary = responses.body["input"][1]
    assert summary["type"] == "message" and summary["role"] == "system" and "(call 1)" in summary["content"]
    assert responses.body["input"][0] is items[0]


async def test_compaction_and_compact_summaries_survive_every_manager() -> None:
    for manager in ALL_MANAGERS:
        items = chat_to_responses(_agent_conversation(10))
        cmp = {"type": "compaction", "id": "cmp_1", "encrypted_content": "Y29tcGFjdGVk"}
        ours = {"type": "message", "role": "user",
                "content": [{"type": "input_text", "text": f"{COMPACT_PREFIX}\nearlier: " + words(20)}]}
        items[3:3] = [ours]
        items[8:8] = [cmp]
        a = await Setup(manager, budget=2_500).run(body_of(items))
        assert a.changed
        assert any(e is cmp for e in a.body["input"]), manager
        assert not any(e is ours for e in a.body["input"]), "only the last compaction-like item is pinned"
        items2 = [e for e in items if e is not cmp]
        b = await Setup(manager, budget=2_500).run(body_of(items2))
        assert any(e is ours for e in b.body["input"]), manager


async def test_refusal_names_the_input_field_and_max_output_tokens() -> None:
    with pytest.raises(ContextLengthExceeded) as info:
        await Setup(budget=300).run(body_of([{"role": "user", "content": words(1000)}]))
    assert info.value.param == "input" and "max_output_tokens" in info.value.message


def test_wires_registry_and_explain_field() -> None:
    assert WIRES["responses"] is RESPONSES and RESPONSES.field == "input"
    assert RESPONSES.output_field("gpt-4o") == "max_output_tokens"


# --------------------------------------------------------------------------- property tests

BUDGETS = (150, 400, 900, 2_000, 5_000, 60_000)
SETUPS = {(m, b): Setup(m, budget=b) for m in ALL_MANAGERS for b in BUDGETS}
PROPERTY = settings(max_examples=60, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.large_base_example])


@pytest.mark.parametrize("manager", sorted(ALL_MANAGERS))
@PROPERTY
@given(items=conversations(), budget=st.sampled_from(BUDGETS), instructions=st.sampled_from([None, "Be brief."]))
def test_forwarded_payload_is_paired_adjacent_within_budget_and_keeps_pinned_items(
    manager: str, items: list[dict[str, Any]], budget: int, instructions: str | None
) -> None:
    setup = SETUPS[(manager, budget)]
    body = body_of(items, **({"instructions": instructions} if instructions else {}))
    before = copy.deepcopy(body)
    try:
        a = setup.run_sync(body)
    except ContextLengthExceeded:
        assert body == before
        return
    except PayloadError as exc:
        # ids reused inside one run of calls cannot be repaired; a conversation of nothing but unpaired
        # items is empty after the repair (and refused rather than forwarded empty)
        assert exc.code in ("duplicate_tool_call_id", "empty_after_repair"), exc
        if exc.code == "empty_after_repair":
            assert current_user(items) is None and not system_band(items)
        return
    problems = problems_of(before, body, a)
    assert not problems, problems
    assert a.report.hard_budget == budget


@pytest.mark.parametrize("manager", sorted(ALL_MANAGERS))
@PROPERTY
@given(items=conversations(valid=True), budget=st.sampled_from(BUDGETS))
def test_valid_input_under_threshold_is_forwarded_as_the_clients_bytes(
    manager: str, items: list[dict[str, Any]], budget: int
) -> None:
    assert not pairing_problems(items)
    body = body_of(items)
    if recount(body) > int(budget / 1.1):
        return
    raw = orjson.dumps(body)
    a = SETUPS[(manager, budget)].run_sync(body)
    assert a.changed is False and a.body is body and orjson.dumps(a.body) == raw
    assert a.report.repairs == {} and a.report.tokens_after == recount(body)


# --------------------------------------------------------------------------- tau-bench as Responses items


TAU_WINDOWS: dict[int, int | None] = {8_000: None, 4_000: 256}


def _variants(traj: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    items = chat_to_responses(traj, parts=True)
    out = [("full", items)]
    outputs = [i for i, e in enumerate(items) if kind(e) == "function_call_output"]
    if outputs:
        out.append(("mid-round", items[: outputs[-1] + 1]))
        damaged = list(items)
        last = outputs[-1]
        if last + 1 < len(damaged):
            damaged[last], damaged[last + 1] = damaged[last + 1], damaged[last]
        del damaged[outputs[0]]
        damaged.insert(1, {"type": "function_call_output", "call_id": "call_orphan", "output": "stray"})
        damaged.append({"type": "reasoning", "id": "rs_trailing", "summary": []})
        out.append(("damaged", damaged))
    return out


@pytest.fixture(scope="module")
def tau_matrix() -> dict[str, Any]:
    """200 trajectories x 3 variants as Responses items over an 8k model, for every context manager."""

    async def run() -> dict[str, Any]:
        results: dict[tuple[str, int], dict[str, Any]] = {}
        start = time.perf_counter()
        trajectories = tau_trajectories()
        for manager, window in itertools.product(ALL_MANAGERS, TAU_WINDOWS):
            # the 8k model reserves its whole max output (B = 8000 - 4096 - 800); the 4k one 256 tokens
            setup = Setup(manager, window=window, reserve=TAU_WINDOWS[window])
            stats: dict[str, Any] = {"refused": 0, "changed": 0, "unchanged": 0, "problems": []}
            for traj in trajectories:
                for variant, items in _variants(traj["traj"]):
                    body = body_of(items)
                    before = copy.deepcopy(body)
                    try:
                        a = await setup.run(body)
                    except ContextLengthExceeded:
                        stats["refused"] += 1
                        continue
                    stats["changed" if a.changed else "unchanged"] += 1
                    problems = problems_of(before, body, a)
                    if problems:
                        stats["problems"].append((traj["task_id"], variant, problems[:3]))
            results[(manager, window)] = stats
        return {"results": results, "elapsed": time.perf_counter() - start}

    return asyncio.run(run())


@pytest.mark.parametrize("window", sorted(TAU_WINDOWS))
@pytest.mark.parametrize("manager", sorted(ALL_MANAGERS))
def test_tau_bench_as_responses_items(tau_matrix: dict[str, Any], manager: str, window: int) -> None:
    stats = tau_matrix["results"][(manager, window)]
    print(f"{manager:28} {window:5}: changed={stats['changed']} unchanged={stats['unchanged']} "
          f"refused={stats['refused']}")
    assert not stats["problems"], stats["problems"][:5]
    assert stats["refused"] == 0
    assert stats["changed"] > 200  # the 8k window really compacts (and every damaged variant is repaired)


@pytest.mark.slow
def test_tau_bench_matrix_runtime(tau_matrix: dict[str, Any]) -> None:
    print(f"tau-bench Responses matrix: {tau_matrix['elapsed']:.1f}s")
    assert tau_matrix["elapsed"] < 90


@PROPERTY
@given(items=conversations())
def test_the_parse_pass_pairing_verdict_agrees_with_the_pairing_check(items: list[dict[str, Any]]) -> None:
    from proxy.core.pairing import is_paired

    conversation = RESPONSES.parse(body_of(items), COUNTER)
    assert conversation.paired == is_paired(conversation.items, True)


@pytest.mark.parametrize("body", [
    {"model": MODEL, "input": [{"type": "function_call_output", "call_id": "a", "output": "stray"}]},
    {"model": MODEL, "input": [{"type": "reasoning", "id": "rs_1", "summary": []}]},
    {"model": MODEL, "messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
])
def test_a_conversation_repaired_to_nothing_is_refused_not_forwarded_empty(body: dict[str, Any]) -> None:
    wire = CHAT if "messages" in body else RESPONSES
    with pytest.raises(PayloadError) as info:
        asyncio.run(Setup().run(body, wire=wire))
    assert info.value.code == "empty_after_repair" and info.value.param == wire.field


# --------------------------------------------------------------------------- media, as OpenAI bills them


def _media_cost(part: dict[str, Any]) -> int:
    """What one content part adds to a user message's count."""
    def total(content: list[dict[str, Any]]) -> int:
        conversation = RESPONSES.parse({"model": "gpt-4o", "input": [
            {"role": "user", "content": content}]}, COUNTER)
        return sum(i.tokens for i in conversation.items)

    text = {"type": "input_text", "text": "Look at this."}
    return total([text, part]) - total([text])


def test_images_count_by_their_size_and_pdfs_by_their_pages_on_responses() -> None:
    """input_image by its tiles (file ids keep 765), input_file PDFs by text plus a page image per page."""
    pages = [mf.prose(120, i) for i in range(4)]
    pdf = "data:application/pdf;base64," + mf.b64(mf.pdf(pages, object_streams=True))
    text = COUNTER.text("\n".join(pages) + "\n")
    assert _media_cost({"type": "input_image", "image_url": "data:image/png;base64," + mf.b64(mf.png(1, 1))}) == 255
    assert _media_cost({"type": "input_image", "image_url": "data:image/webp;base64," + mf.b64(mf.webp(1024, 1024)),
                        "detail": "high"}) == 765
    assert _media_cost({"type": "input_image", "file_id": "file-1"}) == 765
    assert _media_cost({"type": "input_file", "filename": "r.pdf", "file_data": pdf}) == text + 4 * 765
    assert _media_cost({"type": "input_file", "filename": "r.pdf", "file_data": pdf, "detail": "low"}) == text + 4 * 85
    assert _media_cost({"type": "input_file", "file_id": "file-1"}) == 6_000


def test_a_screenshot_and_a_generated_image_count_by_their_size() -> None:
    shot = {"type": "computer_call_output", "call_id": "c1",
            "output": {"type": "computer_screenshot", "image_url": "data:image/png;base64," + mf.b64(mf.png(512, 512))}}
    generated = {"type": "image_generation_call", "id": "ig_1", "status": "completed",
                 "result": mf.b64(mf.png(1, 1))}
    call = {"type": "computer_call", "call_id": "c1", "action": {"type": "screenshot"}}
    conversation = RESPONSES.parse({"model": "gpt-4o", "input": [
        {"role": "user", "content": "go"}, call, shot, generated]}, COUNTER)
    by_kind = {i.raw.get("type") if isinstance(i.raw, dict) else "pair": i.tokens for i in conversation.items}
    assert by_kind["computer_call_output"] == 3 + 255  # one tile
    assert by_kind["image_generation_call"] == 3 + 255


def _parsed(conversation: Any, elements: list[Any]) -> Any:
    """Everything a parse gives, with each item's JSON compared to the request's own elements (and the tokens in
    all a resumed parse gives, checked against its items')."""
    assert conversation.tokens is None or conversation.tokens == sum(i.tokens for i in conversation.items)
    def own(item: Any) -> bool:
        raw = item.raw
        if isinstance(raw, list):
            return all(a is b for a, b in zip(raw, elements[item.source - len(raw) + 1:item.source + 1]))
        return raw is elements[item.source]
    return ([(i.role, i.call_ids, i.result_id, i.source, i.pinned, i.key, i.tokens, own(i), orjson.dumps(i.raw))
             for i in conversation.items], conversation.fixed_tokens, conversation.paired,
            dict(conversation.repairs), conversation.notes, conversation.unmanaged)


def _outcome(parse: Any, elements: list[Any]) -> Any:
    try:
        return _parsed(parse(body_of(elements, instructions="Be brief.")), elements)
    except PayloadError as exc:
        return ("refused", exc.message, exc.param)


@PROPERTY
@given(first=conversations(), more=conversations(), edit=st.sampled_from(
    ("append", "same", "edit_middle", "truncate", "reorder", "compaction", "other_tenant")), data=st.data())
def test_resume_gives_what_parse_gives_after_any_edit(first: list[Any], more: list[Any], edit: str,
                                                      data: st.DataObject) -> None:
    """A request of a conversation its tenant sent before is parsed from where that one ended: whatever the client
    did in between (appended items, resent, edited the middle, truncated, reordered, compacted, or another tenant
    sent it), the items, counts, pinning, pairing and every item's JSON are what a full parse gives."""
    counter = TokenCounter("o200k_base")
    later = copy.deepcopy(first)
    if edit == "append":
        later += more
    elif edit == "edit_middle" and later:
        i = data.draw(st.integers(0, len(later) - 1))
        later[i] = {**later[i], "id": "edited"} if isinstance(later[i], dict) else later[i]
        later += more
    elif edit == "truncate" and later:
        later = later[: data.draw(st.integers(0, len(later) - 1))]
    elif edit == "reorder" and len(later) > 1:
        i, j = data.draw(st.integers(0, len(later) - 1)), data.draw(st.integers(0, len(later) - 1))
        later[i], later[j] = later[j], later[i]
    elif edit == "compaction":
        later += [{"type": "compaction", "id": "cmp_2", "encrypted_content": "x"}, *more]
    _outcome(lambda body: RESPONSES.resume(body, counter, "t"), copy.deepcopy(first))
    tenant = "u" if edit == "other_tenant" else "t"
    warm = _outcome(lambda body: RESPONSES.resume(body, counter, tenant), later)
    assert warm == _outcome(lambda body: RESPONSES.parse(body, TokenCounter("o200k_base")), later)


def test_resume_parses_only_what_a_growing_conversation_appends() -> None:
    """The items of the known prefix are the earlier request's, each given this request's JSON (with the reasoning
    that travels with it); only the appended items are new."""
    counter = TokenCounter("o200k_base")
    base = [{"role": "user", "content": "Read the file."},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "abc"},
            {"type": "function_call", "call_id": "c1", "name": "read_file", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "contents " * 40}]
    grown = [*copy.deepcopy(base), {"role": "user", "content": "Next."},
             {"type": "function_call", "call_id": "c2", "name": "read_file", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c2", "output": "more"}]
    first = RESPONSES.resume(body_of(copy.deepcopy(base)), counter, "t")
    second = RESPONSES.resume(body_of(grown), counter, "t")
    assert all(a is b for a, b in zip(second.items[:3], first.items))
    assert second.items[1].raw[0] is grown[1] and second.items[1].raw[1] is grown[2]
    assert _parsed(second, grown) == _parsed(RESPONSES.parse(body_of(grown), TokenCounter("o200k_base")), grown)
