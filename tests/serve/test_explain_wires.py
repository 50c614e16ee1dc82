"""``POST /v1/ctxproxy/explain``: which wire a body is explained as, driven from the outside (HTTP through the proxy).

With no wire named (no ``/<wire>`` suffix, no ``?wire=``), the body says: ``input`` without
``messages`` is a Responses body, anything else a Chat Completions one.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import StartProxy, base_config
from tests.fake_upstream import FakeUpstream
from tests.outside import post, share_model_map

MODEL = "gpt-4o-mini"
EXPLAIN = "/v1/ctxproxy/explain"
RESPONSES_BODY: dict[str, Any] = {"model": MODEL, "instructions": "Be brief.", "input": [
    {"role": "user", "content": "read it"},
    {"type": "function_call", "call_id": "c1", "name": "read", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c1", "output": "text"},
    {"role": "user", "content": "and now?"}]}
CHAT_BODY: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(autouse=True)
def _shared_model_map(monkeypatch: pytest.MonkeyPatch) -> None:
    share_model_map(monkeypatch)  # speed only


@pytest.mark.parametrize("path", [EXPLAIN, EXPLAIN + "/responses", EXPLAIN + "?wire=responses"])
async def test_a_responses_body_is_explained_as_responses_with_or_without_a_wire_named(
    upstream: FakeUpstream, start_proxy: StartProxy, path: str
) -> None:
    """Without the suffix it answered 400 "'messages' must be an array": the body was read as Chat Completions."""
    proxy = await start_proxy(base_config(upstream.base_url))
    status, headers, payload = await post(proxy, RESPONSES_BODY, path=path)
    assert status == 200, payload
    assert set(payload) == {"input", "report"} and payload["input"] == RESPONSES_BODY["input"]
    assert payload["report"]["wire"] == "responses" and payload["report"]["repairs"] == {}
    assert headers["x-request-id"]
    assert upstream.responses == [] and upstream.chat == []  # nothing forwarded


@pytest.mark.parametrize("body", [
    CHAT_BODY,
    {**CHAT_BODY, "input": "ignored: a Chat body that also has input"},
    {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64},  # a Messages-like body
])
async def test_any_other_body_is_still_explained_as_chat(
    upstream: FakeUpstream, start_proxy: StartProxy, body: dict[str, Any]
) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    status, _, payload = await post(proxy, body, path=EXPLAIN)
    assert status == 200, payload
    assert set(payload) == {"messages", "report"} and payload["report"]["wire"] == "chat"


async def test_a_named_wire_wins_over_the_body(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    status, _, payload = await post(proxy, RESPONSES_BODY, path=EXPLAIN + "?wire=chat")
    assert status == 400 and payload["error"]["param"] == "messages"
    status, _, payload = await post(proxy, RESPONSES_BODY, path=EXPLAIN + "/nope")
    assert status == 404 and "nope" in payload["error"]["message"]


# --------------------------------------------------------------------------- Messages: context_management emulated

CLAUDE = "claude-sonnet-4-5"
LITELLM_CLAUDE = "claude-via-litellm"
NATIVE_CLAUDE = "claude-native"  # an upstream that applies context_management itself
HEADERS = {"anthropic-version": "2023-06-01", "anthropic-beta": "context-management-2025-06-27"}
CLEAR_TOOL_USES = {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 1_000},
                   "keep": {"type": "tool_uses", "value": 2}}
CLEAR_THINKING = {"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}}
COMPACT = {"type": "compact_20260112", "trigger": {"type": "input_tokens", "value": 50_000}}


def claude_config(upstream: FakeUpstream) -> dict[str, Any]:
    """One Anthropic-compatible upstream without context_management, one with it, and a litellm route."""
    window = {"context_window": 1_000_000, "max_output_tokens": 8192}
    return {
        "upstreams": {
            "emu": {"base_url": upstream.url, "api": "anthropic", "api_key": "sk-ant-up",
                    "context_management": "emulate"},
            "native": {"base_url": upstream.url, "api": "anthropic", "api_key": "sk-ant-up"},
            "elsewhere": {"base_url": "http://127.0.0.1:9/v1", "api_key": "sk-other"},
        },
        "models": [{"name": CLAUDE, "upstream": "emu", **window},
                   {"name": NATIVE_CLAUDE, "upstream": "native", "model": CLAUDE, **window},
                   {"name": LITELLM_CLAUDE, "provider": "litellm", "upstream": "elsewhere",
                    "model": "hosted_vllm/llama", **window}],
        "cache": {"backend": "memory"}, "context_manager": {"type": "stack"},
        "summarizer": {"retry_backoff_seconds": 0},
    }


def words(n: int, seed: int = 0) -> str:
    vocabulary = ["order", "invoice", "refund", "Denver", "ticket", "balance", "parcel", "carrier", "status"]
    return " ".join(f"{vocabulary[(seed + i * 7) % len(vocabulary)]}{i % 13}" for i in range(n))


def tool_conversation() -> list[dict[str, Any]]:
    """One user turn and six tool uses, each answered, each assistant turn with a thinking block."""
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing test."}]
    for i in range(6):
        msgs.append({"role": "assistant", "content": [
            {"type": "thinking", "thinking": f"plan {i} " + words(60, i), "signature": f"sig{i}"},
            {"type": "tool_use", "id": f"toolu_{i}", "name": "Read", "input": {"path": f"f{i}.py"}}]})
        msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}",
                                                  "content": words(250, i)}]})
        msgs.append({"role": "user", "content": f"next {i}"})  # a turn of its own: thinking turns to clear
    return msgs


def long_conversation(turns: int = 30, size: int = 1_800) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    for t in range(turns):
        msgs += [{"role": "user", "content": f"question {t}: " + words(size, t)},
                 {"role": "assistant", "content": f"answer {t}: " + words(40, t)}]
    return [*msgs, {"role": "user", "content": "And finally?"}]


def messages_body(model: str, messages: list[dict[str, Any]], edits: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": model, "max_tokens": 64, "messages": messages, "context_management": {"edits": edits}}


def tool_results(messages: list[dict[str, Any]]) -> list[Any]:
    return [b["content"] for m in messages if isinstance(m["content"], list) for b in m["content"]
            if b.get("type") == "tool_result"]


def thinking_blocks(messages: list[dict[str, Any]]) -> int:
    return sum(1 for m in messages if isinstance(m["content"], list) for b in m["content"]
               if b.get("type") == "thinking")


@pytest.mark.parametrize("edit", [CLEAR_TOOL_USES, CLEAR_THINKING], ids=["clear_tool_uses", "clear_thinking"])
async def test_explain_shows_what_the_emulated_context_management_forwards(
    upstream: FakeUpstream, start_proxy: StartProxy, edit: dict[str, Any]
) -> None:
    """Explain showed the tool results (and thinking) uncleared while the real request forwarded them cleared."""
    proxy = await start_proxy(claude_config(upstream))
    body = messages_body(CLAUDE, tool_conversation(), [edit])
    status, _, explained = await post(proxy, body, path=EXPLAIN + "/messages", headers=HEADERS)
    assert status == 200, explained
    assert upstream.messages == []  # explain forwards nothing
    status, _, _ = await post(proxy, body, path="/v1/messages", headers=HEADERS)
    assert status == 200
    forwarded = upstream.messages[-1].body
    assert "context_management" not in forwarded
    assert explained["messages"] == forwarded["messages"] != body["messages"]  # what the request really forwards
    if edit is CLEAR_TOOL_USES:
        assert tool_results(explained["messages"])[4:] == tool_results(body["messages"])[4:]  # the kept 2
        assert not set(tool_results(explained["messages"])[:4]) & set(tool_results(body["messages"]))
    else:
        assert thinking_blocks(explained["messages"]) == 1 < thinking_blocks(body["messages"])
    emulation = explained["report"]["context_management"]
    assert emulation["emulated"] is True and emulation["compaction"] is None
    [applied] = emulation["applied_edits"]
    assert applied["type"] == edit["type"] and applied["cleared_input_tokens"] > 0
    assert applied.get("cleared_tool_uses", 4) == 4 and applied.get("cleared_thinking_turns", 5) == 5


async def test_explain_emulates_on_a_litellm_route_and_not_for_an_upstream_that_has_it(
    upstream: FakeUpstream, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(claude_config(upstream))
    messages = tool_conversation()
    _, _, on_litellm = await post(proxy, messages_body(LITELLM_CLAUDE, messages, [CLEAR_TOOL_USES]),
                                  path=EXPLAIN + "/messages", headers=HEADERS)
    _, _, emulated = await post(proxy, messages_body(CLAUDE, messages, [CLEAR_TOOL_USES]),
                                path=EXPLAIN + "/messages", headers=HEADERS)
    assert on_litellm["messages"] == emulated["messages"] != messages
    assert on_litellm["report"]["context_management"]["applied_edits"][0]["cleared_tool_uses"] == 4
    status, _, native = await post(proxy, messages_body(NATIVE_CLAUDE, messages, [CLEAR_TOOL_USES]),
                                   path=EXPLAIN + "/messages", headers=HEADERS)
    assert status == 200 and native["messages"] == messages  # the upstream clears: forwarded as sent
    assert "context_management" not in native["report"]


async def test_explain_compaction_looks_the_summary_up_and_never_calls_the_summariser(
    upstream: FakeUpstream, start_proxy: StartProxy
) -> None:
    """Dry-run: would_create (nobody billed); ?summarize=true makes it; then reused, as the real request does."""
    proxy = await start_proxy(claude_config(upstream))
    messages = long_conversation()
    body = messages_body(CLAUDE, messages, [COMPACT])
    status, _, dry = await post(proxy, body, path=EXPLAIN + "/messages", headers=HEADERS)
    assert status == 200, dry
    assert dry["report"]["context_management"]["compaction"] == "would_create"
    assert upstream.summaries == [] and upstream.messages == []
    assert len(dry["messages"]) == 2 and dry["messages"][-1] == messages[-1]  # a placeholder, then the current turn
    paused = messages_body(CLAUDE, messages, [{**COMPACT, "pause_after_compaction": True}])
    _, _, dry_paused = await post(proxy, paused, path=EXPLAIN + "/messages", headers=HEADERS)
    assert dry_paused["report"]["context_management"]["paused_after_compaction"] is True
    assert any("nothing would be forwarded" in w for w in dry_paused["report"]["warnings"])
    assert upstream.summaries == []

    _, _, made = await post(proxy, body, path=EXPLAIN + "/messages?summarize=true", headers=HEADERS)
    assert made["report"]["context_management"]["compaction"] == "created" and len(upstream.summaries) == 1
    _, _, again = await post(proxy, body, path=EXPLAIN + "/messages", headers=HEADERS)
    assert again["report"]["context_management"]["compaction"] == "reused"
    assert again["messages"] == made["messages"] != dry["messages"]
    status, _, _ = await post(proxy, body, path="/v1/messages", headers=HEADERS)
    assert (
        status == 200 and len(upstream.summaries) == 1 and upstream.messages[-1].body["messages"] == again["messages"]
    )


def test_explain_runs_the_hooks_the_managed_handler_runs() -> None:
    """Explain and the managed handler once kept a map of request hooks each, registered twice with two pairs of
    protocols: they read the one list (proxy.serve.hooks), so they cannot drift."""
    import importlib

    from proxy.serve.hooks import HOOKS

    explained = importlib.import_module("proxy.serve.explain").HOOKS
    handled = importlib.import_module("proxy.serve.routes").HOOKS
    assert explained is HOOKS and handled is HOOKS


async def test_explain_in_observe_mode_and_with_a_mode_asked_for(upstream: FakeUpstream,
                                                                 start_proxy: StartProxy) -> None:
    """Under a policy in observe mode explain shows the body as sent (what would be forwarded) and a report of what
    enforce would do; ``?mode=enforce`` shows what enforce would forward, with the same figures; another mode is a
    400 that names the parameter; nothing is forwarded."""
    proxy = await start_proxy(base_config(
        upstream.base_url, mode="observe", context_manager={"type": "sliding-window", "params": {"keep_turns": 2}},
        models=[{"name": MODEL, "context_window": 2_000, "max_output_tokens": 500}]))
    detail = " and its parcel" * 20
    messages = [m for t in range(40) for m in ({"role": "user", "content": f"question {t} about the order{detail}"},
                                               {"role": "assistant", "content": f"answer {t}: it shipped{detail}"})]
    body = {"model": MODEL, "messages": [*messages, {"role": "user", "content": "and now?"}]}
    status, _, observed = await post(proxy, body, path=EXPLAIN)
    assert status == 200, observed
    assert observed["messages"] == body["messages"] and observed["report"]["mode"] == "observe"
    status, _, enforced = await post(proxy, body, path=EXPLAIN + "?mode=enforce")
    assert status == 200, enforced
    assert enforced["report"]["mode"] == "enforce" and len(enforced["messages"]) < len(body["messages"])
    for key in ("tokens_before", "tokens_after", "removed", "turns_dropped"):
        assert observed["report"][key] == enforced["report"][key], key
    status, _, refused = await post(proxy, body, path=EXPLAIN + "?mode=shadow")
    assert status == 400 and refused["error"]["param"] == "mode"
    assert upstream.chat == []
