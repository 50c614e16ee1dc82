"""Observation masking over HTTP on each wire, with real tau-bench conversations (tests/data) padded with tool
outputs of the kind tau-bench's own tools return (flight records), against the fake upstream.

On an 8k route a conversation over its threshold is answered within budget by masking alone: every message
and every call reaches the upstream as sent, the oldest outputs carry the placeholder, the last
``keep_recent`` outputs are verbatim. A growing conversation (several tau-bench tasks of one support session,
one request each time the agent calls the model) keeps its forwarded prefix between consecutive requests at
least 90 % of the time with the default grid.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from tests.conftest import RunningProxy, StartProxy
from tests.fake_upstream import FakeUpstream
from tests.helpers import recount as chat_recount
from tests.helpers import tau_trajectories
from tests.outside import metric_total, scrape, share_model_map
from tests.wire import messages_helpers as mh
from tests.wire import responses_helpers as rh

MAX_TOKENS = 512
PLACEHOLDER = "[ctxproxy removed this "
AIRPORTS = ["JFK", "SEA", "ORD", "LAX", "DFW", "ATL", "MIA", "DEN", "BOS", "PHX", "IAH", "EWR", "LAS", "MCO"]
Message = dict[str, Any]


@pytest.fixture(autouse=True)
def _shared_model_map(monkeypatch: pytest.MonkeyPatch) -> None:
    share_model_map(monkeypatch)  # speed only


def budget(window: int) -> tuple[int, int]:
    """(B, T) of a route of ``window`` tokens for a request asking for MAX_TOKENS, computed here."""
    b = window - MAX_TOKENS - math.ceil(0.1 * window)
    return b, int(b / 1.1)


def config(upstream: FakeUpstream, manager: Any) -> dict[str, Any]:
    models = []
    for window in (8_000, 32_000):
        common = {"context_window": window, "max_output_tokens": 4_096, "tokenizer": "o200k_base",
                  "calibration": "off"}
        models += [{"name": f"gpt-{window // 1000}k", **common},
                   {"name": f"claude-{window // 1000}k", "upstream": "anthropic", **common}]
    return {
        "upstreams": {"openai": {"base_url": upstream.base_url},
                      "anthropic": {"base_url": upstream.url, "api": "anthropic", "api_key": "sk-ant-upstream"}},
        "default_upstream": "openai",
        "models": models,
        "cache": {"backend": "memory"},
        "context_manager": manager,
    }


# --------------------------------------------------------------------------- tau-bench, padded


def pad_output(content: str, seed: int, records: int) -> str:
    """A tau-bench tool output with ``records`` more flight records of the shape its search tools return."""
    rnd = random.Random(seed)
    extra = [{"flight_number": f"HAT{rnd.randint(1, 300):03}", "origin": rnd.choice(AIRPORTS),
              "destination": rnd.choice(AIRPORTS), "status": "available",
              "scheduled_departure_time_est": f"{rnd.randint(0, 23):02}:00:00",
              "available_seats": {"basic_economy": rnd.randint(0, 20), "economy": rnd.randint(0, 20),
                                  "business": rnd.randint(0, 20)},
              "prices": {"basic_economy": rnd.randint(50, 100), "economy": rnd.randint(100, 200),
                         "business": rnd.randint(200, 500)}} for _ in range(records)]
    try:
        parsed = json.loads(content)
    except ValueError:
        return content + "\n" + json.dumps(extra)
    if isinstance(parsed, list):
        return json.dumps(parsed + extra)
    return json.dumps({"result": parsed, "related_flights": extra})


def padded(messages: list[Message], records: int) -> list[Message]:
    return [{**m, "content": pad_output(m["content"], i, records)} if m["role"] == "tool" else m
            for i, m in enumerate(messages)]


def at_last_user_turn(traj: list[Message], history_results: int) -> list[Message] | None:
    """The conversation up to the last user message that follows at least ``history_results`` tool results."""
    for u in range(len(traj) - 1, 0, -1):
        if traj[u]["role"] == "user" and sum(1 for m in traj[:u] if m["role"] == "tool") >= history_results:
            return traj[: u + 1]
    return None


# --------------------------------------------------------------------------- the three wires


@dataclass(frozen=True)
class Wire:
    name: str
    path: str
    model: Callable[[int], str]
    body: Callable[[list[Message], str, bool], dict[str, Any]]
    units: Callable[[dict[str, Any]], list[Any]]  # elements at the level masking replaces
    output: Callable[[Any], Any]  # a result unit's output (None: not a result)
    recount: Callable[[dict[str, Any]], int]
    forwarded: Callable[[FakeUpstream], dict[str, Any]]


def _messages_body(messages: list[Message], model: str, stream: bool) -> dict[str, Any]:
    system, converted = mh.from_chat(messages)
    return {"model": model, "max_tokens": MAX_TOKENS, "system": system, "messages": converted, "stream": stream}


def _blocks(body: dict[str, Any]) -> list[Any]:
    out: list[Any] = []
    for m in body["messages"]:
        out.extend([m] if isinstance(m["content"], str) else m["content"])
    return out


WIRES = {
    "chat": Wire("chat", "/v1/chat/completions", lambda w: f"gpt-{w // 1000}k",
                 lambda m, model, s: {"model": model, "messages": m, "max_tokens": MAX_TOKENS, "stream": s},
                 lambda b: list(b["messages"]), lambda u: u["content"] if u.get("role") == "tool" else None,
                 lambda b: chat_recount(b["messages"]), lambda up: up.chat[-1].body),
    "responses": Wire("responses", "/v1/responses", lambda w: f"gpt-{w // 1000}k",
                      lambda m, model, s: {"model": model, "input": rh.chat_to_responses(m),
                                           "max_output_tokens": MAX_TOKENS, "stream": s},
                      lambda b: list(b["input"]),
                      lambda u: u.get("output") if u.get("type") == "function_call_output" else None,
                      rh.recount, lambda up: up.responses[-1].body),
    "messages": Wire("messages", "/v1/messages", lambda w: f"claude-{w // 1000}k", _messages_body, _blocks,
                     lambda u: u.get("content") if u.get("type") == "tool_result" else None,
                     mh.recount, lambda up: up.messages[-1].body),
}


async def send(proxy: RunningProxy, wire: Wire, body: dict[str, Any]) -> dict[str, str]:
    headers = {"Authorization": "Bearer sk-client", "x-api-key": "sk-client", "anthropic-version": "2023-06-01"}
    async with aiohttp.ClientSession() as s, s.post(proxy.url + wire.path, json=body, headers=headers) as r:
        text = await r.text()
        assert r.status == 200, text[:500]
        assert "error" not in text[:200] or body.get("stream"), text[:500]
        return {k.lower(): v for k, v in r.headers.items()}


def masking_problems(wire: Wire, sent: dict[str, Any], forwarded: dict[str, Any], keep: int) -> tuple[list[str], int]:
    """Everything sent is forwarded, in order; only outputs may differ, and then only as the placeholder, oldest
    first, never the last ``keep``. Returns the problems and the number masked."""
    before, after = wire.units(sent), wire.units(forwarded)
    if len(before) != len(after):
        return [f"{len(after)} elements forwarded, {len(before)} sent"], 0
    masked: list[bool] = []
    problems = []
    for i, (a, b) in enumerate(zip(before, after)):
        output = wire.output(a)
        if output is None:
            if a != b:
                problems.append(f"element {i} changed: {str(b)[:120]}")
            continue
        out = wire.output(b)
        if out == output:
            masked.append(False)
        elif isinstance(out, str) and out.startswith(PLACEHOLDER) and {**b, "content": 0, "output": 0} == {
                **a, "content": 0, "output": 0}:
            masked.append(True)
        else:
            problems.append(f"result {i} changed otherwise: {str(b)[:120]}")
    n = sum(masked)
    if masked != [True] * n + [False] * (len(masked) - n):
        problems.append(f"masked outputs are not the oldest: {masked}")
    if len(masked) - n < min(keep, len(masked)):
        problems.append(f"only {len(masked) - n} outputs verbatim, keep_recent is {keep}")
    return problems, n


# --------------------------------------------------------------------------- over budget on an 8k route


@pytest.mark.parametrize("wire", sorted(WIRES))
@pytest.mark.parametrize("manager", ["observation-masking", "summarising"])
async def test_tau_bench_over_budget_on_an_8k_route_is_answered_by_masking_alone(
        upstream: FakeUpstream, start_proxy: StartProxy, wire: str, manager: str) -> None:
    """Masking alone, and summarising masking first: no summariser is called when masking is enough."""
    keep, step = 3, 1
    proxy = await start_proxy(config(upstream, {"type": manager, "params": {"keep_recent": keep, "mask_step": step}}))
    w = WIRES[wire]
    hard, threshold = budget(8_000)
    answered = 0
    for k, item in enumerate(tau_trajectories()):
        traj = at_last_user_turn(item["traj"], history_results=keep + 2)
        if traj is None:
            continue
        messages = padded(traj, records=3)
        # over the threshold as sent; under it (with room) with every output but the last keep replaced by a
        # placeholder of ~40 tokens (reckoned here with 60): masking alone must then be enough
        tools = [i for i, m in enumerate(messages) if m["role"] == "tool"]
        reckoned = [{**m, "content": "x " * 60} if i in tools[:-keep] else m for i, m in enumerate(messages)]
        if chat_recount(messages) <= threshold * 1.05 or chat_recount(reckoned) > threshold * 0.95:
            continue
        body = w.body(messages, w.model(8_000), k % 2 == 1)
        headers = await send(proxy, w, body)
        forwarded = w.forwarded(upstream)
        problems, n = masking_problems(w, body, forwarded, keep)
        assert not problems, (item["task_id"], problems[:3])
        assert n >= 1 and headers["x-ctxproxy-summary"] == "none"
        assert w.recount(forwarded) == int(headers["x-ctxproxy-tokens-out"]) <= hard
        assert int(headers["x-ctxproxy-tokens-in"]) > threshold
        answered += 1
    print(f"{wire}, {manager}: {answered} tau-bench conversations over budget on 8k answered by masking alone")
    assert answered >= 30 and upstream.summaries == []
    text = await scrape(proxy)
    assert metric_total(text, "ctxproxy_tokens_removed_total", how="masked") > 0
    assert metric_total(text, "ctxproxy_tokens_removed_total", how="trimmed") == 0


# --------------------------------------------------------------------------- a growing conversation


def support_session(tasks: int, records: int) -> list[Message]:
    """One support session: the first ``tasks`` tau-bench conversations after one system prompt, padded."""
    trajectories = tau_trajectories()
    messages: list[Message] = [trajectories[0]["traj"][0]]
    for item in trajectories[:tasks]:
        messages += item["traj"][1:]
    return padded(messages, records)


def request_points(messages: list[Message]) -> list[int]:
    """Lengths at which the agent called the model: before every assistant message, and at the end."""
    return [*[i for i in range(1, len(messages)) if messages[i]["role"] == "assistant"], len(messages)]


@pytest.mark.parametrize("wire", sorted(WIRES))
async def test_a_growing_conversation_keeps_its_forwarded_prefix(
        upstream: FakeUpstream, start_proxy: StartProxy, wire: str) -> None:
    """From the first request over the threshold on, at least 90 % of consecutive requests forward the previous
    request's conversation unchanged as their prefix (the default grid: 10 results masked at a time)."""
    proxy = await start_proxy(config(upstream, "observation-masking"))
    w = WIRES[wire]
    _, threshold = budget(32_000)
    session = support_session(tasks=12, records=2)
    previous: list[Any] | None = None
    kept: list[bool] = []
    masked = 0
    for n in request_points(session):
        body = w.body(session[:n], w.model(32_000), n % 3 == 0)
        headers = await send(proxy, w, body)
        forwarded = w.units(w.forwarded(upstream))
        if int(headers["x-ctxproxy-tokens-in"]) > threshold and previous is not None:
            kept.append(forwarded[: len(previous)] == previous)
        previous = forwarded
        masked = sum(1 for u in forwarded if str(w.output(u) or "").startswith(PLACEHOLDER))
    share = sum(kept) / len(kept)
    print(f"{wire}: forwarded prefix kept on {share:.1%} of {len(kept)} consecutive requests over T; "
          f"{masked} outputs masked at the end")
    assert len(kept) >= 80 and masked >= 30
    assert share >= 0.90
