"""The pairing pass and the payload check (proxy.pairing, docs/design.md#8-pairing-and-the-payload-check)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from proxy.core.errors import PayloadError
from proxy.core.pairing import PLACEHOLDER
from proxy.wire.chat import WIRE as CHAT
from proxy.wire.chat.shape import check_shape
from tests.conftest import StartProxy, base_config
from tests.fake_upstream import FakeUpstream
from tests.helpers import (
    assistant,
    call,
    legacy_call,
    legacy_result,
    pairing_problems,
    system,
    tau_trajectories,
    tool,
    user,
)
from tests.outside import chat_body, post
from tests.wire.chat_helpers import check_messages as check
from tests.wire.chat_helpers import is_valid
from tests.wire.chat_helpers import repair_messages as repair

Msgs = list[dict[str, Any]]


def _run(messages: Msgs) -> tuple[Msgs, dict[str, int]]:
    before = copy.deepcopy(messages)
    out, repairs = repair(messages)
    assert messages == before, "repair mutated its input"
    check(out)
    assert not pairing_problems(out)
    return out, dict(repairs)


# --------------------------------------------------------------------------- each repair kind


def test_orphan_result_is_dropped() -> None:
    msgs = [user("q"), tool("nobody", "stray"), assistant("a")]
    out, repairs = _run(msgs)
    assert repairs == {"orphan_result": 1}
    assert out == [msgs[0], msgs[2]]


def test_orphan_result_before_its_call_is_dropped() -> None:
    msgs = [user("q"), tool("c1", "early"), call(("c1", "f")), tool("c1", "on time")]
    out, repairs = _run(msgs)
    assert repairs == {"orphan_result": 1}
    assert out == [msgs[0], msgs[2], msgs[3]]


def test_duplicate_result_is_dropped_first_kept() -> None:
    msgs = [user("q"), call(("c1", "f")), tool("c1", "first"), tool("c1", "second")]
    out, repairs = _run(msgs)
    assert repairs == {"duplicate_result": 1}
    assert out == msgs[:3]
    assert out[2]["content"] == "first"


def test_result_displaced_by_a_user_message_is_moved_back() -> None:
    msgs = [user("q"), call(("c1", "f")), user("are you there?"), tool("c1", "late")]
    out, repairs = _run(msgs)
    assert repairs == {"moved_result": 1}
    assert out == [msgs[0], msgs[1], msgs[3], msgs[2]]
    assert all(a is b for a, b in zip(out, [msgs[0], msgs[1], msgs[3], msgs[2]]))


def test_result_displaced_by_another_group_is_moved_back() -> None:
    msgs = [user("q"), call(("a", "f")), call(("b", "g")), tool("b", "rb"), tool("a", "ra")]
    out, repairs = _run(msgs)
    assert repairs == {"moved_result": 1}
    assert out == [msgs[0], msgs[1], msgs[4], msgs[2], msgs[3]]


def test_missing_result_in_partially_answered_group_gets_placeholder() -> None:
    msgs = [user("q"), call(("a", "f"), ("b", "g"), ("c", "h")), tool("b", "rb"), user("next")]
    out, repairs = _run(msgs)
    assert repairs == {"missing_result": 2}
    assert out[:3] == msgs[:3]
    placeholders = out[3:5]
    assert [p["tool_call_id"] for p in placeholders] == ["a", "c"]
    assert all(p == {"role": "tool", "tool_call_id": p["tool_call_id"], "content": PLACEHOLDER} for p in placeholders)
    assert out[5] is msgs[3]


def test_unanswered_calls_keep_the_assistant_text() -> None:
    msgs = [user("q"), call(("a", "f"), content="Let me check."), user("never mind")]
    out, repairs = _run(msgs)
    assert repairs == {"unanswered_calls": 1}
    assert out == [msgs[0], {"role": "assistant", "content": "Let me check."}, msgs[2]]
    assert "tool_calls" in msgs[1]  # the client's dict is untouched


def test_unanswered_calls_without_text_drop_the_empty_assistant() -> None:
    msgs = [user("q"), call(("a", "f"), ("b", "g")), user("never mind")]
    out, repairs = _run(msgs)
    assert repairs == {"unanswered_calls": 1, "empty_assistant": 1}
    assert out == [msgs[0], msgs[2]]


@pytest.mark.parametrize("content", [None, "", "   "])
def test_empty_assistant_variants(content: str | None) -> None:
    msgs = [user("q"), call(("a", "f"), content=content)]
    out, repairs = _run(msgs)
    assert repairs == {"unanswered_calls": 1, "empty_assistant": 1}
    assert out == [msgs[0]]


def test_unanswered_calls_keep_other_keys_of_the_message() -> None:
    msgs = [user("q"), call(("a", "f"), content="Checking.", name="planner", reasoning_content="hmm"), user("x")]
    out, _ = _run(msgs)
    assert out[1] == {"role": "assistant", "content": "Checking.", "name": "planner", "reasoning_content": "hmm"}


def test_repairs_are_counted_together() -> None:
    msgs = [
        system("s"),
        tool("x", "orphan"),
        user("q"),
        call(("a", "f"), ("b", "g")),
        tool("a", "ra"),
        tool("a", "dup"),
        user("interrupt"),
        tool("b", "late"),
        call(("c", "h")),
        user("q2"),
    ]
    out, repairs = _run(msgs)
    assert repairs == {"orphan_result": 1, "duplicate_result": 1, "moved_result": 1, "unanswered_calls": 1,
                       "empty_assistant": 1}
    assert out == [msgs[0], msgs[2], msgs[3], msgs[4], msgs[7], msgs[6], msgs[9]]


# --------------------------------------------------------------------------- valid inputs untouched


VALID: dict[str, Msgs] = {
    "plain": [system("s"), user("hi"), assistant("hello")],
    "parallel-any-order": [user("q"), call(("a", "f"), ("b", "g"), ("c", "h")), tool("c", "3"), tool("a", "1"),
                           tool("b", "2"), assistant("done")],
    "same-id-two-groups": [user("q"), call(("call_1", "f")), tool("call_1", "r1"), user("again"),
                           call(("call_1", "f")), tool("call_1", "r2")],
    "same-id-adjacent-groups": [user("q"), call(("call_1", "f")), tool("call_1", "r1"), call(("call_1", "g")),
                                tool("call_1", "r2")],
    "legacy": [user("weather?"), legacy_call("get_weather", '{"city": "Paris"}'),
               legacy_result("get_weather", "sunny"), assistant("It is sunny.")],
    "legacy-twice": [user("q"), legacy_call("f"), legacy_result("f", "1"), legacy_call("f"), legacy_result("f", "2")],
    "content-parts-on-tool": [user("q"), call(("a", "f")), {"role": "tool", "tool_call_id": "a",
                                                            "content": [{"type": "text", "text": "r"}]}],
    "no-user": [system("s"), call(("a", "f")), tool("a", "r")],
    "assistant-content-null-no-calls": [user("q"), {"role": "assistant", "content": None, "tool_calls": []}],
}


@pytest.mark.parametrize("name", sorted(VALID))
def test_valid_payloads_are_untouched(name: str) -> None:
    msgs = VALID[name]
    out, repairs = _run(msgs)
    assert repairs == {}
    assert out is msgs
    assert is_valid(msgs)


def test_every_tau_bench_trajectory_is_valid_and_untouched() -> None:
    reused = 0
    for item in tau_trajectories():
        traj = item["traj"]
        ids = [c["id"] for m in traj for c in (m.get("tool_calls") or [])]
        reused += len(ids) != len(set(ids))
        out, repairs = repair(traj)
        assert repairs == {} and out is traj, item["task_id"]
        check(traj)
        assert not pairing_problems(traj)
    assert reused == 49  # per the data README: pairing must work group by group


def test_legacy_pairs_are_repaired_too() -> None:
    msgs = [user("q"), legacy_call("f"), user("x"), legacy_result("f", "late"), legacy_result("g", "orphan"),
            legacy_call("h"), user("y")]
    out, repairs = _run(msgs)
    assert repairs == {"moved_result": 1, "orphan_result": 1, "unanswered_calls": 1, "empty_assistant": 1}
    assert out == [msgs[0], msgs[1], msgs[3], msgs[2], msgs[6]]


# --------------------------------------------------------------------------- the payload check


def _code(messages: Any) -> str:
    with pytest.raises(PayloadError) as info:
        check(messages)
    assert info.value.status == 400
    body = info.value.to_openai()["error"]
    assert body["type"] == "invalid_request_error" and body["code"] == info.value.code
    return str(info.value.code)


@pytest.mark.parametrize(
    ("messages", "code", "param"),
    [
        ({"role": "user", "content": "x"}, "invalid_messages", "messages"),
        ("hello", "invalid_messages", "messages"),
        (None, "invalid_messages", "messages"),
        ([], "empty_messages", "messages"),
        (["not a dict"], "invalid_message", "messages[0]"),
        ([{"role": "robot", "content": "x"}], "invalid_role", "messages[0].role"),
        ([{"content": "x"}], "invalid_role", "messages[0].role"),
        ([user("q"), {"role": "tool", "content": "r"}], "missing_tool_call_id", "messages[1].tool_call_id"),
        ([user("q"), {"role": "function", "content": "r"}], "missing_tool_call_id", "messages[1].name"),
        ([user("q"), {"role": "assistant", "content": None,
                      "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}],
         "invalid_tool_call", "messages[1].tool_calls[0].id"),
        ([user("q"), {"role": "assistant", "content": None,
                      "tool_calls": [{"id": "a", "type": "function", "function": {"arguments": "{}"}}]}],
         "invalid_tool_call", "messages[1].tool_calls[0].function.name"),
        ([user("q"), {"role": "assistant", "content": None, "tool_calls": [{"id": "a", "type": "function"}]}],
         "invalid_tool_call", "messages[1].tool_calls[0].function.name"),
        ([user("q"), {"role": "assistant", "content": None, "tool_calls": {"id": "a"}}],
         "invalid_tool_call", "messages[1].tool_calls"),
        ([user("q"), call(("a", "f"))], "unpaired_tool_call", "messages"),
        ([user("q"), call(("a", "f"), ("b", "g")), tool("a"), user("x")], "unpaired_tool_call", "messages[3]"),
        ([user("q"), tool("a")], "unpaired_tool_result", "messages[1]"),
        ([user("q"), call(("a", "f")), tool("a"), tool("a")], "unpaired_tool_result", "messages[3]"),
        ([user("q"), call(("a", "f")), user("x"), tool("a")], "unpaired_tool_call", "messages[2]"),
        ([{"role": "user"}], "missing_content", "messages[0].content"),
        ([{"role": "user", "content": 42}], "invalid_content", "messages[0].content"),
        ([{"role": "user", "content": [{"text": "no type"}]}], "invalid_content", "messages[0].content[0]"),
    ],
)
def test_check_codes(messages: Any, code: str, param: str) -> None:
    assert _code(messages) == code
    with pytest.raises(PayloadError) as info:
        check(messages)
    assert info.value.param == param


def test_shape_errors_are_not_repaired_away() -> None:
    """A tool message without tool_call_id survives repair, so the check can name it."""
    msgs = [user("q"), call(("a", "f")), {"role": "tool", "content": "r"}]
    with pytest.raises(PayloadError) as info:
        check_shape(msgs)
    assert info.value.code == "missing_tool_call_id"
    out, _ = repair(msgs)
    assert any(m.get("role") == "tool" and "tool_call_id" not in m for m in out)
    assert _code(out) == "missing_tool_call_id"


@pytest.mark.parametrize(
    ("messages", "code"),
    [
        ("oops", "invalid_messages"),
        ([], "empty_messages"),
        ([{"role": "wizard", "content": "x"}], "invalid_role"),
        ([user("q"), {"role": "tool", "content": "r"}], "missing_tool_call_id"),
        ([user("q"), {"role": "assistant", "content": None,
                      "tool_calls": [{"type": "function", "function": {"name": "f"}}]}], "invalid_tool_call"),
        ([user("q"), {"role": "assistant", "content": None,
                      "tool_calls": [{"id": "a", "type": "function", "function": {}}]}], "invalid_tool_call"),
    ],
)
async def test_pipeline_refuses_invalid_payloads_with_their_code(messages: Any, code: str) -> None:
    from tests.helpers import MODEL, make_config, running

    config = make_config()
    async with running(config) as runtime:
        with pytest.raises(PayloadError) as info:
            await runtime.assemble(CHAT, {"model": MODEL, "messages": messages}, tenant=None)
    assert info.value.code == code
    assert set(info.value.to_openai()["error"]) == {"message", "type", "param", "code"}


# --------------------------------------------------------------------------- fast scan == precise check


from hypothesis import HealthCheck, given, settings  # noqa: E402

from tests.helpers import conversations  # noqa: E402
from tests.wire.chat_helpers import scan  # noqa: E402


@settings(max_examples=300, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(messages=conversations())
def test_fast_scan_agrees_with_the_precise_check(messages: Msgs) -> None:
    """scan() (the per-request fast path) must say 'valid' exactly when the precise check passes,
    and when it says valid the independent checker must agree."""
    assert scan(messages) == is_valid(messages)
    assert is_valid(messages) == (not pairing_problems(messages))
    repaired, _ = repair(messages)
    assert scan(repaired) and is_valid(repaired)


@pytest.mark.usefixtures("shared_model_map")
async def test_legacy_function_call_answered_by_a_tool_message_is_not_forwarded_as_paired(
    upstream: FakeUpstream, start_proxy: StartProxy
) -> None:
    """A function_call answered by {role: tool, tool_call_id: <function name>} is repaired or refused."""
    proxy = await start_proxy(base_config(upstream.base_url))
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "function_call": {"name": "get_weather", "arguments": "{}"}},
                {"role": "tool", "tool_call_id": "get_weather", "content": "sunny"},
                {"role": "user", "content": "Thanks."}]
    status, _headers, body = await post(proxy, chat_body(messages, "gpt-4o-mini"))
    if status == 400:
        return  # refused by the payload check: right
    assert status == 200, body
    forwarded = upstream.chat[-1].body["messages"]
    call_ids = {c.get("id") for m in forwarded for c in (m.get("tool_calls") or [])}
    assert all(m.get("tool_call_id") in call_ids for m in forwarded if m.get("role") == "tool"), forwarded


@pytest.mark.usefixtures("shared_model_map")
async def test_assistant_audio_survives_the_removal_of_its_unanswered_calls(
    upstream: FakeUpstream, start_proxy: StartProxy
) -> None:
    """Removing unanswered tool_calls keeps the assistant message when it still carries audio."""
    proxy = await start_proxy(base_config(upstream.base_url))
    spoken = {"role": "assistant", "content": None, "audio": {"id": "audio_abc123"},
              "tool_calls": [{"id": "call_x", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]}
    messages = [{"role": "user", "content": "Say it and look it up."}, spoken,
                {"role": "user", "content": "Go on."}]
    status, _headers, body = await post(proxy, chat_body(messages, "gpt-4o-mini"))
    assert status == 200, body
    forwarded = upstream.chat[-1].body["messages"]
    assert any(m.get("audio") == {"id": "audio_abc123"} for m in forwarded), forwarded
    assert not any(m.get("tool_calls") for m in forwarded)


@pytest.mark.usefixtures("shared_model_map")
async def test_duplicate_ids_inside_one_tool_calls_are_not_forwarded(upstream: FakeUpstream, start_proxy: StartProxy
                                                                     ) -> None:
    """An assistant message whose tool_calls repeat an id is repaired or refused, never forwarded as is."""
    proxy = await start_proxy(base_config(upstream.base_url))
    fn = {"name": "lookup", "arguments": "{}"}
    messages = [{"role": "user", "content": "Look it up twice."},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": fn},
                    {"id": "call_1", "type": "function", "function": fn}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "found"}]
    status, _headers, body = await post(proxy, chat_body(messages, "gpt-4o-mini"))
    if status == 400:
        return
    assert status == 200, body
    for m in upstream.chat[-1].body["messages"]:
        ids = [c.get("id") for c in m.get("tool_calls") or []]
        assert len(ids) == len(set(ids)), m


MODEL = "gpt-4o-mini"


def chat(messages: list[Any], model: str = MODEL, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": messages, **extra}


CROSSED = {
    "tool-call-answered-by-function": [
        {"role": "user", "content": "Look it up."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "fn:lookup", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
        {"role": "function", "name": "lookup", "content": "found it"},
        {"role": "user", "content": "Thanks, and now?"},
    ],
    "function-call-answered-by-tool": [
        {"role": "user", "content": "Look it up."},
        {"role": "assistant", "content": None, "function_call": {"name": "lookup", "arguments": "{}"}},
        {"role": "tool", "tool_call_id": "fn:lookup", "content": "found it"},
        {"role": "user", "content": "Thanks, and now?"},
    ],
}


async def test_an_unanswered_tool_call_whose_id_starts_with_fn_gets_a_tool_placeholder(
    upstream: FakeUpstream, start_proxy: StartProxy
) -> None:
    """A client's tool call id that happens to start with ``fn:`` (the prefix of legacy function-call ids) is
    still a tool call: left unanswered, it gets a tool placeholder under its own id, not a legacy one."""
    proxy = await start_proxy(base_config(upstream.base_url))
    messages = [
        {"role": "user", "content": "Look up my booking and the weather."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_booking", "arguments": "{}"}},
            {"id": "fn:lookup", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "booking ZX1Q"},
        {"role": "user", "content": "And?"},
    ]
    status, headers, body = await post(proxy, chat(messages))
    assert status == 200, body
    forwarded = upstream.chat[-1].body["messages"]
    assert headers["x-ctxproxy-repairs"] == "1"
    assert pairing_problems(forwarded) == [], forwarded
    assert forwarded[3]["role"] == "tool" and forwarded[3]["tool_call_id"] == "fn:lookup", forwarded[3]


@pytest.mark.parametrize("case", list(CROSSED))
async def test_tool_calls_and_legacy_function_calls_never_answer_each_other(
    upstream: FakeUpstream, start_proxy: StartProxy, case: str
) -> None:
    """A tool call answered by a legacy ``function`` message, or a legacy call answered by a ``tool`` message,
    is a pairing the provider refuses: repaired or refused here, never forwarded as paired."""
    proxy = await start_proxy(base_config(upstream.base_url))
    status, _, body = await post(proxy, chat(CROSSED[case]))
    if status == 400:  # refusing it is as good as repairing it
        assert body["error"]["code"] in ("unpaired_tool_call", "unpaired_tool_result", "invalid_tool_pairing")
        return
    assert status == 200, body
    forwarded = upstream.chat[-1].body["messages"]
    assert pairing_problems(forwarded) == [], forwarded
