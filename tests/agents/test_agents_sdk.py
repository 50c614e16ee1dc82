"""The OpenAI Agents SDK through the proxy: its default Responses model, a tool, a multi-turn loop.

Nothing in the agent changes but the base URL (``OPENAI_BASE_URL``; tracing is switched off with
``OPENAI_AGENTS_DISABLE_TRACING`` because this machine has no network). The fake upstream plays the
model: each user turn it first asks for the tool (a ``function_call``), then answers. The tool
returns ~400 tokens, so the conversation outgrows the 8k model after a dozen turns and the
proxy has to summarise. Every request the upstream received must be within the hard budget by
an independent recount, and paired.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.conftest import StartProxy, base_config
from tests.fake_upstream import FakeUpstream, function_call
from tests.helpers import words
from tests.outside import metric_total, scrape, share_model_map
from tests.wire.responses_helpers import pairing_problems, recount

agents = pytest.importorskip("agents", reason="openai-agents is not installed (pip install -e '.[dev]')")

MODEL = "agent-8k"
WINDOW, MAX_OUT = 8000, 1000
HARD_BUDGET = WINDOW - MAX_OUT - 800
TURNS = 24


@pytest.fixture(autouse=True)
def _shared_model_map(monkeypatch: pytest.MonkeyPatch) -> None:
    share_model_map(monkeypatch)


def ticket_text(ticket_id: str) -> str:
    return f"Ticket {ticket_id}: " + words(330, sum(map(ord, ticket_id)))


def script(turns: int) -> list[list[dict[str, Any]]]:
    out: list[list[dict[str, Any]]] = []
    for t in range(turns):
        out.append([function_call(f"call_{t}", "read_ticket", json.dumps({"ticket_id": f"T-{t}"}))])
        out.append([{"id": f"msg_{t}", "type": "message", "status": "completed", "role": "assistant",
                     "content": [{"type": "output_text", "text": f"Ticket T-{t} is handled: " + words(20, t),
                                  "annotations": []}]}])
    return out


async def test_agents_sdk_multi_turn_tool_loop_through_the_proxy(
    upstream: FakeUpstream, start_proxy: StartProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy = await start_proxy(base_config(upstream.base_url, models=[
        {"name": MODEL, "context_window": WINDOW, "max_output_tokens": MAX_OUT}]))
    upstream.responses_script = script(TURNS)
    monkeypatch.setenv("OPENAI_BASE_URL", proxy.base_url)  # the one change: where the agent sends its requests
    monkeypatch.setenv("OPENAI_API_KEY", "sk-agent")
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")

    calls: list[str] = []

    @agents.function_tool
    def read_ticket(ticket_id: str) -> str:
        """Read a support ticket by its id."""
        calls.append(ticket_id)
        return ticket_text(ticket_id)

    agent = agents.Agent(name="support", instructions="You resolve support tickets. Read each ticket first.",
                         tools=[read_ticket], model=MODEL)
    history: list[Any] = []
    for t in range(TURNS):
        history.append({"role": "user", "content": f"Please handle ticket T-{t}."})
        result = await agents.Runner.run(agent, history)
        assert result.final_output.startswith(f"Ticket T-{t} is handled")
        history = result.to_input_list()

    assert calls == [f"T-{t}" for t in range(TURNS)]
    assert len(upstream.responses) == 2 * TURNS
    for i, rec in enumerate(upstream.responses):
        body = rec.body
        assert recount(body) <= HARD_BUDGET, (i, recount(body))
        assert not pairing_problems(body["input"]), i
        assert body["instructions"].startswith("You resolve")
    # the full history outgrew the model: the proxy summarised it
    assert len(upstream.summaries) >= 1
    assert any(e.get("role") == "system" and "Conversation summary" in str(e.get("content"))
               for e in upstream.responses[-1].body["input"])
    text = await scrape(proxy)
    received = metric_total(text, "ctxproxy_tokens_received_total")
    forwarded = metric_total(text, "ctxproxy_tokens_forwarded_total")
    print(f"\nAgents SDK loop: {TURNS} turns, {len(upstream.responses)} requests, tokens received {received:.0f}, "
          f"forwarded {forwarded:.0f} ({forwarded / received:.0%}), summariser calls {len(upstream.summaries)}, "
          f"largest forwarded {max(recount(r.body) for r in upstream.responses)} <= B {HARD_BUDGET}")
    assert forwarded < received
