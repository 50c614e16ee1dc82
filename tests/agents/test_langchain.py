"""An agent framework (LangChain's ChatOpenAI) through the proxy, with nothing changed but base_url."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tests.conftest import base_config
from tests.fake_upstream import FakeUpstream

pytest.importorskip("langchain_openai")

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

ORDERS = {"A-1001": "shipped 2024-05-02 via DHL, tracking 00340434161234567890",
          "A-1002": "awaiting payment since 2024-05-03"}


@tool
def lookup_order(order_id: str) -> str:
    """Look up the status of an order by its id."""
    return f"Order {order_id}: {ORDERS.get(order_id, 'not found')}. " + "Audit trail: ok. " * 150


@tool
def refund(order_id: str, amount: float) -> str:
    """Refund an amount on an order."""
    return f"Refunded {amount:.2f} EUR on {order_id}; reference R-{order_id[-4:]}."


TOOLS = {t.name: t for t in (lookup_order, refund)}




def call(cid: str, name: str, **args: Any) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def script() -> list[dict[str, Any]]:
    """What the 'model' answers, in order: two agent turns with parallel and sequential tool calls."""
    return [
        {"role": "assistant", "content": None, "tool_calls": [
            call("call_a1", "lookup_order", order_id="A-1001"), call("call_a2", "lookup_order", order_id="A-1002")]},
        {"role": "assistant", "content": None, "tool_calls": [call("call_a3", "refund", order_id="A-1002",
                                                                    amount=19.5)]},
        {"role": "assistant", "content": "A-1001 has shipped; A-1002 was refunded 19.50 EUR (R-1002)."},
        {"role": "assistant", "content": None, "tool_calls": [call("call_b1", "lookup_order", order_id="A-1001")]},
        {"role": "assistant", "content": "It is still with DHL, tracking 00340434161234567890."},
    ]


def pairing_problems(messages: list[dict[str, Any]]) -> list[str]:
    """Every tool call answered exactly once, in the block right after its assistant message; no strays."""
    problems: list[str] = []
    pending: set[str] = set()
    in_group = False
    for i, m in enumerate(messages):
        if m.get("role") == "tool":
            if not in_group or m.get("tool_call_id") not in pending:
                problems.append(f"[{i}] stray or duplicate result {m.get('tool_call_id')}")
            pending.discard(m.get("tool_call_id"))
            continue
        if pending:
            problems.append(f"[{i}] unanswered calls {sorted(pending)}")
        calls = m.get("tool_calls") if m.get("role") == "assistant" else None
        pending, in_group = {c["id"] for c in calls or []}, bool(calls)
    if pending:
        problems.append(f"end: unanswered calls {sorted(pending)}")
    return problems


async def agent_turn(llm: Any, messages: list[BaseMessage], question: str) -> AIMessage:
    """The usual LangChain tool loop: invoke, run the requested tools, feed results back, until a text answer."""
    messages.append(HumanMessage(question))
    for _ in range(6):
        ai = await llm.ainvoke(messages)
        messages.append(ai)
        if not ai.tool_calls:
            return ai
        for tc in ai.tool_calls:
            output = await asyncio.to_thread(TOOLS[tc["name"]].invoke, tc["args"])
            messages.append(ToolMessage(output, tool_call_id=tc["id"]))
    raise AssertionError("the tool loop did not finish")


@pytest.mark.parametrize("window", [128000, 3000], ids=["roomy", "tight"])
async def test_langchain_tool_loop_through_proxy(upstream: FakeUpstream, start_proxy: Any, window: int) -> None:
    cfg = base_config(upstream.base_url,
                      models=[{"name": "gpt-4o-mini", "context_window": window, "max_output_tokens": 500}])
    proxy = await start_proxy(cfg)
    upstream.mode = "script"
    upstream.script = script()
    llm = ChatOpenAI(base_url=proxy.base_url, api_key="sk-langchain", model="gpt-4o-mini", max_retries=0)
    bound = llm.bind_tools(list(TOOLS.values()))
    messages: list[BaseMessage] = [SystemMessage("You are a support agent for an online shop.")]

    first = await agent_turn(bound, messages, "Where are orders A-1001 and A-1002? Refund A-1002 if unpaid.")
    assert "R-1002" in first.content
    second = await agent_turn(bound, messages, "And where is A-1001 now?")
    assert "00340434161234567890" in second.content
    assert not upstream.script  # every canned answer was used

    assert len(upstream.chat) == 5
    for rec in upstream.chat:
        assert not pairing_problems(rec.body["messages"]), pairing_problems(rec.body["messages"])
        assert rec.body["model"] == "gpt-4o-mini"
        assert {t["function"]["name"] for t in rec.body["tools"]} == {"lookup_order", "refund"}
        assert rec.headers["Authorization"] == "Bearer sk-upstream-secret"
    sizes = [len(rec.body["messages"]) for rec in upstream.chat]
    if window == 128000:
        # under budget nothing is touched: the upstream saw LangChain's whole list each time
        assert sizes == [2, 5, 7, 9, 11]
        assert upstream.chat[-1].body["messages"][0] == {"role": "system",
                                                         "content": "You are a support agent for an online shop."}
    else:
        # 3000-token window: the long tool results of the first turn must have been cut, pairing intact
        assert sizes[-1] < 11
        last = upstream.chat[-1].body["messages"]
        assert last[0]["role"] == "system" and last[-1]["role"] == "tool"
        assert any(m["role"] == "user" and "where is A-1001 now" in m["content"] for m in last)


async def test_langchain_sync_client_in_thread(upstream: FakeUpstream, start_proxy: Any) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    upstream.mode = "script"
    upstream.script = [{"role": "assistant", "content": None,
                        "tool_calls": [call("call_s1", "lookup_order", order_id="A-1001")]}]
    llm = ChatOpenAI(base_url=proxy.base_url, api_key="sk-langchain", model="gpt-4o-mini",
                     max_retries=0).bind_tools([lookup_order])
    ai = await asyncio.to_thread(llm.invoke, "Where is A-1001?")
    assert ai.tool_calls == [{"name": "lookup_order", "args": {"order_id": "A-1001"}, "id": "call_s1",
                              "type": "tool_call"}]
    messages = ["Where is A-1001?", ai, ToolMessage(lookup_order.invoke({"order_id": "A-1001"}),
                                                    tool_call_id="call_s1")]
    final = await asyncio.to_thread(llm.invoke, messages)
    assert final.content
    assert not pairing_problems(upstream.chat[-1].body["messages"])
