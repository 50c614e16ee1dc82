"""``context_management`` emulated for an upstream that lacks it, compared with Anthropic's documented
semantics (https://platform.claude.com/docs/en/build-with-claude/context-editing and .../compaction; request and
response types of the official SDK), and forwarded unchanged to one that has it.

The fake Anthropic upstream is configured ``context_management: emulate`` (an Anthropic-compatible server without
the beta); the client is the official SDK's beta API.
"""

from __future__ import annotations

from typing import Any

import anthropic
import pytest

from proxy.core.tokens import TokenCounter
from proxy.serve.context_management.edits import CLEAR_TOOL_USES, CLEARED, MARKER, Edit, clear_tool_uses
from tests.conftest import RunningProxy, StartProxy
from tests.fake_upstream import REPLY, FakeUpstream
from tests.helpers import LINEAR, per_item_growth, words
from tests.outside import share_model_map
from tests.wire.messages_helpers import CLAUDE, pairing_problems, recount

BETA = ["context-management-2025-06-27"]


@pytest.fixture(autouse=True)
def _shared_model_map(monkeypatch: pytest.MonkeyPatch) -> None:
    share_model_map(monkeypatch)  # speed only


def config(upstream: FakeUpstream, emulate: bool = True, **extra: Any) -> dict[str, Any]:
    up: dict[str, Any] = {"base_url": upstream.url, "api": "anthropic", "api_key": "sk-ant-up"}
    if emulate:
        up["context_management"] = "emulate"
    out: dict[str, Any] = {"upstreams": {"a": up}, "cache": {"backend": "memory"},
                           "models": [{"name": CLAUDE, "context_window": 1_000_000, "max_output_tokens": 8192}],
                           "context_manager": {"type": "stack"}, "summarizer": {"retry_backoff_seconds": 0}}
    out.update(extra)
    return out


def factor_of(proxy: RunningProxy) -> float:
    """The calibration factor the proxy applies to Claude counts (a family default until it learns)."""
    runtime = proxy.state.runtime
    return (
        float(runtime.calibration.factor(runtime.route(CLAUDE), "default")) if runtime.calibration is not None else 1.0
    )


def client(proxy: RunningProxy) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=proxy.url, api_key="sk-client", max_retries=0)


TOOLS = ["Read", "Bash", "Read", "Grep", "Read", "Bash"]


def tool_conversation(result_words: int = 250) -> list[dict[str, Any]]:
    """One user turn and six tool uses (Read, Bash, Read, Grep, Read, Bash), each answered."""
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing test."}]
    for i, name in enumerate(TOOLS):
        msgs.append({"role": "assistant", "content": [
            {"type": "text", "text": f"step {i}"},
            {"type": "tool_use", "id": f"toolu_{i}", "name": name, "input": {"arg": f"value {i} " + words(20, i)}}]})
        msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}",
                                                  "content": words(result_words, i)}]})
    return msgs


def results(body: dict[str, Any]) -> dict[str, Any]:
    return {b["tool_use_id"]: b["content"] for m in body["messages"] if isinstance(m["content"], list)
            for b in m["content"] if b.get("type") == "tool_result"}


def inputs(body: dict[str, Any]) -> dict[str, Any]:
    return {b["id"]: b["input"] for m in body["messages"] if isinstance(m["content"], list)
            for b in m["content"] if b.get("type") == "tool_use"}


async def create(proxy: RunningProxy, messages: list[Any], edits: list[dict[str, Any]], *,
                 stream: bool = False, **extra: Any) -> Any:
    async with client(proxy) as c:
        kwargs: dict[str, Any] = {"model": CLAUDE, "max_tokens": 64, "messages": messages, "betas": BETA,
                                  "context_management": {"edits": edits}, **extra}
        if stream:
            async with c.beta.messages.stream(**kwargs) as s:
                return await s.get_final_message()
        return await c.beta.messages.create(**kwargs)


# --------------------------------------------------------------------------- clear_tool_uses_20250919


@pytest.mark.parametrize("stream", [False, True])
async def test_clear_tool_uses_clears_the_oldest_results_and_reports_it(
        upstream: FakeUpstream, start_proxy: StartProxy, stream: bool) -> None:
    """Documented: past the trigger the oldest tool results are replaced by placeholder text, keeping the
    ``keep`` most recent tool uses; the answer reports cleared_tool_uses and cleared_input_tokens."""
    proxy = await start_proxy(config(upstream))
    messages = tool_conversation()
    edit = {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 1_000},
            "keep": {"type": "tool_uses", "value": 2}}
    reply = await create(proxy, messages, [edit], stream=stream)
    sent = upstream.messages[-1].body
    assert "context_management" not in sent  # the upstream lacks it: never sent
    got = results(sent)
    assert [got[f"toolu_{i}"] == CLEARED for i in range(6)] == [True] * 4 + [False] * 2
    assert got["toolu_5"] == messages[-1]["content"][0]["content"]
    assert inputs(sent) == inputs({"messages": messages})  # inputs kept by default
    assert not pairing_problems(sent["messages"])
    assert reply.content[0].text == REPLY
    applied = reply.context_management.applied_edits
    assert len(applied) == 1 and applied[0].type == "clear_tool_uses_20250919"
    assert applied[0].cleared_tool_uses == 4
    full = recount({"model": CLAUDE, "max_tokens": 64, "messages": messages})
    factor = factor_of(proxy)  # reported in the provider's units: the proxy's count times the model's factor
    assert applied[0].cleared_input_tokens == round((full - recount(sent)) * factor)  # exactly what left the prompt
    assert messages == tool_conversation()  # the client's own objects were not touched


async def test_in_observe_mode_the_clients_own_edits_are_still_applied(
        upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """Observe mode forwards what the client asked for, and a request's own ``context_management`` is part of
    that: for an upstream without it the proxy still applies the edits (and strips the field it would refuse),
    while its own context manager only reports."""
    proxy = await start_proxy(config(upstream, mode="observe"))
    edit = {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 1_000},
            "keep": {"type": "tool_uses", "value": 2}}
    reply = await create(proxy, tool_conversation(), [edit])
    sent = upstream.messages[-1].body
    assert "context_management" not in sent
    assert [results(sent)[f"toolu_{i}"] == CLEARED for i in range(6)] == [True] * 4 + [False] * 2
    assert reply.context_management.applied_edits[0].cleared_tool_uses == 4


async def test_below_the_trigger_nothing_is_cleared_and_the_report_is_empty(
        upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(config(upstream))
    reply = await create(proxy, tool_conversation(), [{"type": "clear_tool_uses_20250919"}])  # default: 100k
    assert results(upstream.messages[-1].body) == results({"messages": tool_conversation()})
    assert reply.context_management.applied_edits == []


async def test_exclude_tools_and_clear_tool_inputs(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """Documented: exclude_tools are never cleared; clear_tool_inputs true clears the calls' inputs too, a list
    only those tools' inputs."""
    proxy = await start_proxy(config(upstream))
    edit = {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 100},
            "keep": {"type": "tool_uses", "value": 1}, "exclude_tools": ["Bash"], "clear_tool_inputs": ["Read"]}
    reply = await create(proxy, tool_conversation(), [edit])
    sent = upstream.messages[-1].body
    cleared = [i for i in range(6) if results(sent)[f"toolu_{i}"] == CLEARED]
    assert cleared == [0, 2, 3, 4]  # not the Bash ones (1, 5), not the kept last one (5)
    emptied = [i for i in range(6) if inputs(sent)[f"toolu_{i}"] == {}]
    assert emptied == [0, 2, 4]  # the Read calls among the cleared ones
    assert reply.context_management.applied_edits[0].cleared_tool_uses == 4


async def test_clear_at_least_leaves_the_context_alone_when_too_little_would_go(
        upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """Documented: the context is only modified if at least clear_at_least tokens can be removed."""
    proxy = await start_proxy(config(upstream))
    edit = {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 100},
            "clear_at_least": {"type": "input_tokens", "value": 50_000}}
    reply = await create(proxy, tool_conversation(), [edit])
    assert CLEARED not in results(upstream.messages[-1].body).values()
    assert reply.context_management.applied_edits == []


async def test_a_tool_uses_trigger_counts_tool_uses(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(config(upstream))
    edit = {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 5},
            "keep": {"type": "tool_uses", "value": 3}}
    await create(proxy, tool_conversation(), [edit])
    assert sum(v == CLEARED for v in results(upstream.messages[-1].body).values()) == 3
    await create(proxy, tool_conversation()[:-2], [edit])  # five tool uses: not more than the trigger
    assert CLEARED not in results(upstream.messages[-1].body).values()


# --------------------------------------------------------------------------- clear_thinking_20251015


def thinking_conversation(turns: int = 4) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    for t in range(turns):
        msgs.append({"role": "user", "content": f"question {t}"})
        msgs.append({"role": "assistant", "content": [
            {"type": "thinking", "thinking": f"thought {t} " + words(50, t), "signature": f"sig{t}"},
            {"type": "tool_use", "id": f"toolu_{t}", "name": "Read", "input": {"n": t}}]})
        msgs.append(
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{t}", "content": "ok"}]}
        )
        msgs.append({"role": "assistant", "content": [{"type": "redacted_thinking", "data": "ZGF0YQ=="},
                                                      {"type": "text", "text": f"answer {t}"}]})
    msgs.append({"role": "user", "content": "next"})
    return msgs


@pytest.mark.parametrize(("keep", "kept_turns"), [(None, [3]), ({"type": "thinking_turns", "value": 2}, [2, 3]),
                                                  ("all", [0, 1, 2, 3])])
async def test_clear_thinking_keeps_the_last_assistant_turns(
        upstream: FakeUpstream, start_proxy: StartProxy, keep: Any, kept_turns: list[int]) -> None:
    """Documented: thinking blocks of older assistant turns are removed, keeping the last ``keep`` turns (default 1;
    "all" keeps every one); an assistant turn spans its tool loop."""
    proxy = await start_proxy(config(upstream))
    edit: dict[str, Any] = {"type": "clear_thinking_20251015"}
    if keep is not None:
        edit["keep"] = keep
    reply = await create(proxy, thinking_conversation(), [edit], thinking={"type": "enabled", "budget_tokens": 1024})
    sent = upstream.messages[-1].body["messages"]
    with_thinking = sorted({int(b["thinking"].split()[1]) if b["type"] == "thinking" else -1
                            for m in sent if m["role"] == "assistant" for b in m["content"]
                            if b["type"] in ("thinking",)})
    assert with_thinking == kept_turns
    redacted = sum(
        1 for m in sent if m["role"] == "assistant" for b in m["content"] if b["type"] == "redacted_thinking"
    )
    assert redacted == len(kept_turns)
    assert not pairing_problems(sent)
    report = reply.context_management.applied_edits[0]
    assert report.type == "clear_thinking_20251015" and report.cleared_thinking_turns == 4 - len(kept_turns)
    assert (report.cleared_input_tokens > 0) == (len(kept_turns) < 4)


# --------------------------------------------------------------------------- compact_20260112


def long_conversation(turns: int = 30, size: int = 1_800) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    for t in range(turns):
        msgs += [{"role": "user", "content": f"question {t}: " + words(size, t)},
                 {"role": "assistant", "content": f"answer {t}: " + words(40, t)}]
    msgs.append({"role": "user", "content": "And finally?"})
    return msgs


COMPACT = {"type": "compact_20260112", "trigger": {"type": "input_tokens", "value": 50_000}}


@pytest.mark.parametrize("stream", [False, True])
async def test_compaction_answers_with_a_compaction_block_and_a_later_request_resumes_from_it(
        upstream: FakeUpstream, start_proxy: StartProxy, stream: bool) -> None:
    """Documented: past the trigger the conversation is summarised and the answer starts with a compaction block;
    later requests drop everything before it. Here the summary comes from the proxy's cached summariser."""
    proxy = await start_proxy(config(upstream))
    messages = long_conversation()
    assert recount({"model": CLAUDE, "max_tokens": 64, "messages": messages}) > 50_000
    reply = await create(proxy, messages, [COMPACT], stream=stream)
    assert [b.type for b in reply.content] == ["compaction", "text"]
    block = reply.content[0]
    # the summary, and the values of the compacted turns it leaves out (the compaction service's values section)
    assert block.content == (f"{upstream.summary_text}\n\nValues these turns acted on (ctxproxy lists those the "
                             "summary leaves out): user=ZFA04Y")
    assert block.encrypted_content == f"{MARKER}{len(messages) - 1}"
    assert len(upstream.summaries) == 1
    first = upstream.messages[-1].body
    assert first["messages"] == [{"role": "user", "content": [{"type": "text", "text": block.content}]},
                                 {"role": "user", "content": "And finally?"}]
    # the client appends the answer (compaction block included) and asks again
    messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
    messages.append({"role": "user", "content": "Thanks. One more thing?"})
    await create(proxy, messages, [COMPACT], stream=stream)
    second = upstream.messages[-1].body
    assert second["messages"][:2] == first["messages"]  # the same prefix: the provider's prompt cache holds
    assert second["messages"][2] == {"role": "assistant", "content": [{"type": "text", "text": REPLY}]}
    assert second["messages"][3] == {"role": "user", "content": "Thanks. One more thing?"}
    assert len(upstream.summaries) == 1  # nothing new to summarise


async def test_pause_after_compaction_answers_with_the_block_alone(
        upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """Documented: with pause_after_compaction the answer is the compaction block alone (stop_reason
    "compaction"); the client sends it back to continue."""
    proxy = await start_proxy(config(upstream))
    messages = long_conversation()
    for stream in (False, True):
        reply = await create(proxy, messages, [{**COMPACT, "pause_after_compaction": True}], stream=stream)
        assert reply.stop_reason == "compaction" and [b.type for b in reply.content] == ["compaction"]
    assert upstream.messages == [] and len(upstream.summaries) == 1  # one summary, reused; no upstream answer yet
    messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
    reply = await create(proxy, messages, [{**COMPACT, "pause_after_compaction": True}])
    assert reply.content[0].text == REPLY
    assert upstream.messages[-1].body["messages"][-1] == {"role": "user", "content": "And finally?"}


async def test_a_compaction_block_from_elsewhere_drops_everything_before_it(
        upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(config(upstream))
    messages = [{"role": "user", "content": "old question"}, {"role": "assistant", "content": [
        {"type": "text", "text": "old answer"}, {"type": "compaction", "content": "Summary from Anthropic."},
        {"type": "text", "text": "and then"}]}, {"role": "user", "content": "new question"}]
    await create(proxy, messages, [COMPACT])
    assert upstream.messages[-1].body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "Summary from Anthropic."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "and then"}]},
        {"role": "user", "content": "new question"}]


@pytest.mark.parametrize(("edit", "message"), [
    ({"type": "compact_20260112", "trigger": {"type": "input_tokens", "value": 1_000}}, "at least 50000"),
    ({"type": "clear_tool_uses_20250919", "keep": {"type": "tokens", "value": 3}}, "keep"),
    ({"type": "forget_everything"}, "must be one of"),
])
async def test_invalid_edits_are_refused_in_anthropics_shape(
        upstream: FakeUpstream, start_proxy: StartProxy, edit: dict[str, Any], message: str) -> None:
    proxy = await start_proxy(config(upstream))
    with pytest.raises(anthropic.BadRequestError) as caught:
        await create(proxy, [{"role": "user", "content": "hi"}], [edit])
    assert message in caught.value.body["error"]["message"]  # type: ignore[index]
    assert upstream.messages == []


async def test_an_upstream_with_context_management_gets_it_unchanged(
        upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(config(upstream, emulate=False))
    edits = [{"type": "clear_thinking_20251015", "keep": "all"}, {"type": "clear_tool_uses_20250919"}]
    reply = await create(proxy, tool_conversation(), edits)
    sent = upstream.messages[-1]
    assert sent.body["context_management"] == {"edits": edits}
    assert {k.lower(): v for k, v in sent.headers.items()}["anthropic-beta"] == "context-management-2025-06-27"
    assert reply.context_management is None  # the upstream's answer, untouched


def test_clearing_thousands_of_results_in_one_message_takes_linear_time() -> None:
    """clear_tool_uses_20250919 replaced each cleared result in a fresh copy of its whole message, so a user
    message with thousands of results (a parallel round) took quadratic time; a message is now copied once.
    Time per result must not grow, and the client's own objects stay untouched."""
    counter = TokenCounter("o200k_base")
    edit = Edit(CLEAR_TOOL_USES, {"type": CLEAR_TOOL_USES, "keep": {"type": "tool_uses", "value": 1},
                                  "clear_tool_inputs": True})

    def setup(n: int) -> Any:
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": "Read them all."},
            {"role": "assistant", "content": [{"type": "tool_use", "id": f"t{i}", "name": "read", "input": {"i": i}}
                                              for i in range(n)]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{i}", "content": "done"}
                                         for i in range(n)]}]

        def step() -> Any:
            out, report = clear_tool_uses(messages, edit, counter, input_tokens=10**6)
            assert report is not None and report["cleared_tool_uses"] == n - 1
            assert out[2]["content"][0]["content"] == CLEARED and messages[2]["content"][0]["content"] == "done"
            return out
        return step

    growth = per_item_growth(setup, 2_000)
    assert growth < LINEAR, f"time per result grew {growth:.1f}x from 2,000 to 16,000 results"
