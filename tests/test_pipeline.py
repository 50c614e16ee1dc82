"""The whole pipeline (proxy.pipeline.assemble) on realistic conversations and on all 200
tau-bench airline trajectories, under small windows, for every context manager.

Every forwarded payload must pass the payload check and an independent pairing checker,
fit the hard budget by an independent tiktoken recount, keep the system band and the
current user turn verbatim — or be refused with ContextLengthExceeded, and only when even
the parts that can never be dropped do not fit.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import time
from collections.abc import Callable
from typing import Any

import pytest

from proxy.core.errors import ContextLengthExceeded, PayloadError
from proxy.core.modelinfo import ModelMap
from proxy.core.tokens import TokenCounter
from proxy.pipeline import Assembly, assemble
from proxy.policy import Routes, policy_for
from proxy.wire.chat import WIRE as CHAT
from proxy.wire.messages import WIRE as MESSAGES
from proxy.wire.responses import WIRE as RESPONSES
from tests.conftest import StartProxy, base_config
from tests.fake_upstream import FakeUpstream
from tests.helpers import (
    LINEAR,
    MANAGERS,
    MODEL,
    AgentSim,
    assembly_problems,
    assistant,
    call,
    config_dict,
    developer,
    hard_budget,
    image_user,
    last_tool_group,
    leading_system,
    legacy_call,
    legacy_result,
    make_config,
    minimal_payload,
    per_item_growth,
    recount,
    services,
    system,
    tau_trajectories,
    tool,
    user,
    words,
)
from tests.outside import (
    Message,
    chat_body,
    message_tokens,
    n_tokens,
    post,
    text_of,
)
from tests.store.test_summaries_http import config as summarising_config
from tests.wire.chat_helpers import repair_messages as repair

WINDOWS = (2_000, 4_000, 8_000)
COUNTER = TokenCounter("o200k_base")  # one counter: per-message counts are LRU-cached
MODEL_MAP = ModelMap()


class Harness:
    """route + policy + services for one config, run against the shared counter."""

    def __init__(self, **config: Any) -> None:
        self.config = make_config(**config)
        self.budget = config.get("max_tokens") or hard_budget(config.get("window", 128_000))
        self.route = Routes(self.config, MODEL_MAP).resolve(MODEL)
        self.policy = policy_for(self.config, None, MODEL, None)
        self.services = services(COUNTER)

    async def run(self, body: dict[str, Any]) -> Assembly:
        return await assemble(body, wire=CHAT, route=self.route, policy=self.policy, counter=COUNTER,
                              services=self.services)


async def check_case(h: Harness, messages: list[dict[str, Any]], **body: Any) -> tuple[str, list[str]]:
    """Run one request; return (outcome, problems)."""
    before = copy.deepcopy(messages)
    try:
        a = await h.run({"model": MODEL, "messages": messages, **body})
    except ContextLengthExceeded as exc:
        err = exc.to_openai()["error"]
        problems = []
        if err["code"] != "context_length_exceeded" or err["type"] != "invalid_request_error":
            problems.append(f"bad refusal body {err}")
        need = recount(minimal_payload(repair(before)[0]))
        if need <= h.budget:
            problems.append(f"refused although the unremovable part needs only {need} <= {h.budget}")
        if messages != before:
            problems.append("the client's messages were mutated")
        return "refused", problems
    problems = assembly_problems(before, messages, a)
    wm_group = last_tool_group(_wm(repair(before)[0]))
    if wm_group and not _contains(a.messages, wm_group):
        problems.append("last working-memory tool group was dropped")
    return ("changed" if a.changed else "unchanged"), problems


def _wm(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "user":
            return messages[i + 1 :]
    return messages[len(leading_system(messages)) :]


def _contains(haystack: list[dict[str, Any]], needle: list[dict[str, Any]]) -> bool:
    k = len(needle)
    return any(haystack[i : i + k] == needle for i in range(len(haystack) - k + 1))


# --------------------------------------------------------------------------- realistic tables


def _chat(turns: int) -> list[dict[str, Any]]:
    msgs = [system("You are a travel agent. " + words(60))]
    for t in range(turns):
        msgs += [user(f"question {t}: " + words(40, t)), assistant(f"answer {t}: " + words(80, t + 1))]
    return [*msgs, user("and finally, what is my reservation id?")]


def _agent(turns: int, mid_round: bool) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [system(words(120)), developer("Use tools when needed.")]
    for t in range(turns):
        msgs.append(user(f"turn {t}: " + words(30, t)))
        for r in range(3):
            tid = f"call_{t}_{r}"
            msgs += [call((tid, "search_flights")), tool(tid, words(90, t * 3 + r))]
        msgs.append(assistant(f"done {t}: " + words(40, t)))
    msgs.append(user("now rebook the second leg"))
    if mid_round:
        msgs += [call(("call_x1", "get_reservation"), ("call_x2", "search_flights")),
                 tool("call_x2", words(60, 5)), tool("call_x1", words(60, 6))]
        msgs += [call(("call_y", "book_reservation")), tool("call_y", words(30, 9))]
    return msgs


def _parallel(turns: int) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [system("You are an agent.")]
    for t in range(turns):
        ids = [f"p{t}_{k}" for k in range(4)]
        msgs += [user(words(20, t)), call(*[(i, "fetch") for i in ids], content="Fetching all four.")]
        msgs += [tool(i, words(50, t + k), name="fetch") for k, i in enumerate(reversed(ids))]
        msgs.append(assistant(words(30, t)))
    return [*msgs, user("summarise the four results")]


def _multimodal(turns: int) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [system("Describe images.")]
    for t in range(turns):
        msgs += [image_user(f"what is in picture {t}?", detail=("low" if t % 2 else None)),
                 assistant(words(60, t))]
    return [*msgs, image_user("and this one?", detail="low")]


def _legacy(turns: int) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [system("Legacy functions API.")]
    for t in range(turns):
        msgs += [user(words(25, t)), legacy_call("get_weather", '{"city": "Paris"}'),
                 legacy_result("get_weather", words(70, t)), assistant(words(30, t))]
    return [*msgs, user("and tomorrow?"), legacy_call("get_weather", '{"city": "Paris", "day": 2}'),
            legacy_result("get_weather", "rain")]


def _unknown_keys(turns: int) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [
        system("Cached system prompt. " + words(50), cache_control={"type": "ephemeral"}),
        developer("Be terse.", name="policy"),
    ]
    for t in range(turns):
        msgs += [user(words(30, t), name="alice", cache_control={"type": "ephemeral"}),
                 assistant(words(50, t), refusal=None, reasoning_content="thinking " + words(20, t))]
    return [*msgs, user("last question", name="alice")]


def _prefill(turns: int) -> list[dict[str, Any]]:
    msgs = _agent(turns, mid_round=True)
    return [*msgs, assistant("Based on the results, the best option is")]


def _no_user(turns: int) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [system("Autonomous agent: no user turns.")]
    for t in range(turns):
        msgs += [call((f"a{t}", "step")), tool(f"a{t}", words(80, t))]
    return msgs


def _reused_ids() -> list[dict[str, Any]]:
    return tau_trajectories()[0]["traj"]


CONVERSATIONS = {
    "chat-5": lambda: _chat(5),
    "chat-40": lambda: _chat(40),
    "agent-6": lambda: _agent(6, mid_round=False),
    "agent-10-mid-round": lambda: _agent(10, mid_round=True),
    "parallel-8": lambda: _parallel(8),
    "multimodal-6": lambda: _multimodal(6),
    "legacy-8": lambda: _legacy(8),
    "unknown-keys-12": lambda: _unknown_keys(12),
    "prefill-4": lambda: _prefill(4),
    "no-user-12": lambda: _no_user(12),
    "tau-task-0-reused-ids": _reused_ids,
}


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("manager", sorted(MANAGERS))
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
async def test_realistic_conversations(conversation: str, manager: str, window: int) -> None:
    h = Harness(window=window, context_manager=MANAGERS[manager])
    outcome, problems = await check_case(h, CONVERSATIONS[conversation]())
    assert not problems, (outcome, problems)


@pytest.mark.parametrize("manager", sorted(MANAGERS))
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
async def test_large_window_forwards_unchanged(conversation: str, manager: str) -> None:
    """Valid and under threshold: the exact list, the exact dicts, changed False."""
    h = Harness(window=1_000_000, context_manager=MANAGERS[manager])
    messages = CONVERSATIONS[conversation]()
    a = await h.run({"model": MODEL, "messages": messages})
    assert a.changed is False
    assert a.messages == messages and all(x is y for x, y in zip(a.messages, messages))
    assert len(a.messages) == len(messages)
    assert a.report.tokens_after == a.report.tokens_before == recount(messages)
    assert a.body_changes == {}


# --------------------------------------------------------------------------- tau-bench matrix


def _variants(traj: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    """The whole trajectory (ends on a user turn) and, when it has tools, the request made mid-round
    (cut right after its last tool result: a current user turn with live working memory)."""
    out = [("full", traj)]
    tools = [i for i, m in enumerate(traj) if m["role"] == "tool"]
    if tools:
        out.append(("mid-round", traj[: tools[-1] + 1]))
        out.append(("damaged", _damage(traj, tools)))
    return out


def _damage(traj: list[dict[str, Any]], tools: list[int]) -> list[dict[str, Any]]:
    """The trajectory with pairing defects: an orphan result, the first result lost, the last one
    displaced past the message after it, and the second one duplicated."""
    msgs = list(traj)
    last = tools[-1]
    if last + 1 < len(msgs):
        msgs[last], msgs[last + 1] = msgs[last + 1], msgs[last]
    if len(tools) > 2:
        msgs.insert(tools[1] + 1, {**msgs[tools[1]], "content": "duplicate"})
    del msgs[tools[0]]
    msgs.insert(1, {"role": "tool", "tool_call_id": "call_orphan", "content": "stray"})
    return msgs


@pytest.fixture(scope="module")
def tau_matrix() -> dict[str, Any]:
    """Runs 200 trajectories x 3 variants x 3 windows x 4 managers once; tests read the results."""

    async def run() -> dict[str, Any]:
        results: dict[tuple[str, int], dict[str, Any]] = {}
        trajectories = tau_trajectories()
        start = time.perf_counter()
        for manager, binding in MANAGERS.items():
            for window in WINDOWS:
                h = Harness(window=window, context_manager=binding)
                stats: dict[str, Any] = {"refused": 0, "changed": 0, "unchanged": 0, "problems": []}
                for item in trajectories:
                    for variant, messages in _variants(item["traj"]):
                        outcome, problems = await check_case(h, messages)
                        stats[outcome] += 1
                        if problems:
                            stats["problems"].append((item["task_id"], variant, problems[:3]))
                results[(manager, window)] = stats
        requests = sum(len(_variants(item["traj"])) for item in trajectories)
        return {"results": results, "elapsed": time.perf_counter() - start, "count": len(trajectories),
                "requests": requests}

    return asyncio.run(run())


def test_tau_bench_has_200_trajectories(tau_matrix: dict[str, Any]) -> None:
    assert tau_matrix["count"] == 200


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("manager", sorted(MANAGERS))
def test_tau_bench_matrix(tau_matrix: dict[str, Any], manager: str, window: int) -> None:
    stats = tau_matrix["results"][(manager, window)]
    print(f"{manager:28} {window:5}: changed={stats['changed']} unchanged={stats['unchanged']} "
          f"refused={stats['refused']}")
    assert not stats["problems"], stats["problems"][:5]
    assert stats["changed"] + stats["unchanged"] + stats["refused"] == tau_matrix["requests"]
    if window == 2_000:
        assert stats["changed"] > 150  # the small window really compacts
    if window >= 4_000:
        assert stats["refused"] == 0  # a 1.3k-token system prompt + a turn always fit 4k


@pytest.mark.slow
def test_tau_bench_matrix_runtime(tau_matrix: dict[str, Any]) -> None:
    print(f"tau-bench matrix: {tau_matrix['elapsed']:.1f}s")
    assert tau_matrix["elapsed"] < 60


# --------------------------------------------------------------------------- specific behaviour


async def test_request_fields_and_unknown_keys_survive_trimming() -> None:
    msgs = _unknown_keys(30)
    h = Harness(window=2_000, context_manager="stack")
    body = {"model": MODEL, "messages": msgs, "tools": [{"type": "function", "function": {"name": "f"}}]}
    a = await h.run(body)
    assert a.changed
    kept = [m for m in a.messages if m.get("role") == "assistant"]
    assert kept and all("reasoning_content" in m and "refusal" in m for m in kept)
    assert a.messages[0]["cache_control"] == {"type": "ephemeral"}
    assert a.body_changes == {}


async def test_tool_schemas_are_counted() -> None:
    msgs = _chat(2)
    tools = [{"type": "function", "function": {"name": "search_flights", "description": words(40),
                                               "parameters": {"type": "object", "properties": {}}}}]
    h = Harness(window=100_000)
    plain = await h.run({"model": MODEL, "messages": msgs})
    with_tools = await h.run({"model": MODEL, "messages": msgs, "tools": tools})
    import json

    expected = recount([{"content": json.dumps(tools, separators=(",", ":"))}]) - 6
    assert with_tools.report.tokens_before - plain.report.tokens_before == expected


async def test_refusal_when_system_band_alone_exceeds_budget() -> None:
    h = Harness(window=2_000)
    msgs = [system(words(2_000)), user("hi")]
    with pytest.raises(ContextLengthExceeded) as info:
        await h.run({"model": MODEL, "messages": msgs})
    body = info.value.to_openai()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == "context_length_exceeded"
    assert info.value.status == 400


async def test_refusal_when_current_turn_alone_exceeds_budget_even_with_short_history() -> None:
    h = Harness(window=4_000, context_manager="sliding-window")
    msgs = [system("s"), user("old"), assistant("old answer"), user(words(4_000))]
    with pytest.raises(ContextLengthExceeded):
        await h.run({"model": MODEL, "messages": msgs})


async def test_last_wm_group_kept_and_older_wm_groups_dropped_when_history_is_exhausted() -> None:
    msgs: list[dict[str, Any]] = [system("s"), user("go")]
    for r in range(8):
        msgs += [call((f"w{r}", "step")), tool(f"w{r}", words(300, r))]
    h = Harness(window=2_000, context_manager="stack")
    before = copy.deepcopy(msgs)
    a = await h.run({"model": MODEL, "messages": msgs})
    assert not assembly_problems(before, msgs, a)
    assert a.messages[-2:] == msgs[-2:]
    assert a.report.wm_rows_dropped > 0


async def test_working_memory_cap_is_applied_in_whole_groups() -> None:
    cm = {"type": "summarising", "params": {"summarizer": "drop", "working_memory_messages": 5}}
    msgs: list[dict[str, Any]] = [system("s"), user(words(300)), assistant(words(900)), user("go")]
    for r in range(6):
        msgs += [call((f"a{r}", "f"), (f"b{r}", "g")), tool(f"a{r}", words(20)), tool(f"b{r}", words(20))]
    h = Harness(window=2_000, context_manager=cm)
    a = await h.run({"model": MODEL, "messages": msgs})
    wm = a.messages[a.messages.index(msgs[3]) + 1 :]
    assert len(wm) == 3  # one 3-row group fits the cap of 5; a second would not
    assert wm == msgs[-3:]
    assert a.report.wm_rows_dropped == 15


async def test_working_memory_cap_moves_on_a_grid_so_a_tool_loop_keeps_its_prefix() -> None:
    """A tool loop under one user message grows two rows a round: a cap that dropped exactly what it had to moved
    the forwarded prefix every round (the provider's prompt cache missed every time). Rows are dropped in steps
    of a quarter of the cap, counted from the working memory's start: the cap still holds, and most rounds only
    append to what the previous request forwarded."""
    cm = {"type": "summarising", "params": {"summarizer": "drop", "working_memory_messages": 20,
                                            "summary_threshold": 1}}  # over T from the start: the cap applies
    h = Harness(window=60_000, context_manager=cm)
    msgs: list[dict[str, Any]] = [system("s"), user("fix the bug")]
    previous: list[Any] | None = None
    kept = moved = 0
    for r in range(60):
        msgs = [*msgs, call((f"c{r}", "read")), tool(f"c{r}", words(40, r))]
        a = await h.run({"model": MODEL, "messages": msgs})
        wm = a.messages[2:]
        assert len(wm) <= 20
        if previous is not None and a.report.wm_rows_dropped:
            if a.messages[: len(previous)] == previous:
                kept += 1
            else:
                moved += 1
        previous = list(a.messages)
    print(f"\nprefix kept on {kept} of {kept + moved} capped requests")
    assert kept + moved > 40
    assert moved <= (kept + moved) // 2  # one move in every (20/4)/2 rounds at most: here 1 in 2 or fewer


async def test_repair_under_threshold_changes_only_what_it_repairs() -> None:
    msgs = [system("s"), user("q"), call(("c1", "f")), user("displaced"), tool("c1", "r"), tool("zz", "orphan")]
    h = Harness(window=100_000)
    a = await h.run({"model": MODEL, "messages": msgs})
    assert a.changed
    assert a.report.repairs == {"moved_result": 1, "orphan_result": 1}
    assert a.messages == [msgs[0], msgs[1], msgs[2], msgs[4], msgs[3]]
    assert all(any(m is x for x in msgs) for m in a.messages)


async def test_pairing_strict_refuses_payloads_that_need_repair() -> None:
    cfg = config_dict(pairing="strict")
    from proxy.settings import load_config

    config = load_config(cfg, env={})
    route = Routes(config, MODEL_MAP).resolve(MODEL)
    policy = policy_for(config, None, MODEL, None)
    msgs = [user("q"), call(("c1", "f"))]
    with pytest.raises(PayloadError) as info:
        await assemble({"model": MODEL, "messages": msgs}, wire=CHAT, route=route, policy=policy, counter=COUNTER,
                       services=services(COUNTER))
    assert info.value.code == "invalid_tool_pairing"


@pytest.mark.parametrize(
    ("trimmer", "body", "reserve"),
    [
        ({"reserve_tokens": 100}, {"max_tokens": 999}, 100),
        ({}, {"max_tokens": 999}, 999),
        ({}, {"max_tokens": 999, "max_completion_tokens": 555}, 555),
        ({}, {}, 4096),  # the model's max output tokens
    ],
)
async def test_reserve_precedence(trimmer: dict[str, Any], body: dict[str, Any], reserve: int) -> None:
    from proxy.settings import load_config

    raw = config_dict(window=50_000, reserve=None)
    raw["trimmer"] = trimmer
    config = load_config(raw, env={})
    route = Routes(config, MODEL_MAP).resolve(MODEL)
    a = await assemble({"model": MODEL, "messages": [user("x")], **body}, wire=CHAT, route=route,
                       policy=policy_for(config, None, MODEL, None), counter=COUNTER, services=services(COUNTER))
    assert a.report.reserve == reserve
    assert a.report.margin == 5_000
    assert a.report.hard_budget == 50_000 - reserve - 5_000
    assert a.report.threshold == int(a.report.hard_budget / 1.1)


@pytest.mark.parametrize(("ratio", "margin"), [(0.0, 0), (0.25, 2_500), (0.9, 5_000), (-1.0, 0)])
async def test_safety_margin_ratio_is_clamped(ratio: float, margin: int) -> None:
    from proxy.settings import load_config

    raw = config_dict(window=10_000)
    raw["trimmer"]["safety_margin_ratio"] = ratio
    config = load_config(raw, env={})
    route = Routes(config, MODEL_MAP).resolve(MODEL)
    a = await assemble({"model": MODEL, "messages": [user("x")]}, wire=CHAT, route=route,
                       policy=policy_for(config, None, MODEL, None), counter=COUNTER, services=services(COUNTER))
    assert a.report.margin == margin
    assert a.report.hard_budget == 10_000 - 256 - margin


async def test_explicit_max_tokens_is_the_hard_budget() -> None:
    h = Harness(window=100_000, max_tokens=1_500, context_manager="stack")
    msgs = _agent(8, mid_round=True)
    before = copy.deepcopy(msgs)
    a = await h.run({"model": MODEL, "messages": msgs})
    assert a.report.hard_budget == 1_500
    assert not assembly_problems(before, msgs, a)


async def test_sim_requests_grow_by_appending() -> None:
    """The agent simulator used by the prefix-stability tests: each request extends the previous."""
    reqs = AgentSim().requests(20)
    assert all(b[: len(a)] == a and len(b) > len(a) for a, b in itertools.pairwise(reqs))
    h = Harness(window=1_000_000)
    for r in reqs:
        assert not (await h.run({"model": MODEL, "messages": r})).changed


def _prefill_request() -> list[dict[str, Any]]:
    return [system("You are an agent."), user("what does the lookup say?"), call(("c1", "lookup")),
            tool("c1", words(400)), assistant("Based on the lookup result, the answer is")]


async def test_trim_keeps_last_tool_round_before_a_prefill() -> None:
    h = Harness(window=100_000, max_tokens=300, context_manager="stack")
    msgs = _prefill_request()
    try:
        a = await h.run({"model": MODEL, "messages": msgs})
    except ContextLengthExceeded:
        return  # refusing is correct: the live tool round does not fit
    assert _contains(a.messages, msgs[2:4]), [m["role"] for m in a.messages]


async def test_wm_cap_keeps_last_tool_round_before_a_prefill() -> None:
    cm = {"type": "summarising", "params": {"summarizer": "drop", "summary_threshold": 10,
                                            "working_memory_messages": 2}}
    h = Harness(window=100_000, context_manager=cm)
    msgs = _prefill_request()
    a = await h.run({"model": MODEL, "messages": msgs})
    assert _contains(a.messages, msgs[2:4]), [m["role"] for m in a.messages]


async def test_refusal_message_explains_an_explicit_budget_correctly() -> None:
    import re

    h = Harness(window=128_000, max_tokens=500)
    with pytest.raises(ContextLengthExceeded) as info:
        await h.run({"model": MODEL, "messages": [system(words(800)), user("hi")]})
    message = info.value.message
    assert "500" in message
    m = re.search(r"window (\d+) - completion reserve (\d+) - safety margin (\d+)", message)
    assert m is None or int(m[1]) - int(m[2]) - int(m[3]) == 500, message


# --------------------------------------------------------------------------- a cut keeps whole turns, over HTTP

ANSWER = "Done, I read it."
SHORT_TURNS = [
    ("user", "Read this file and tell me when you have read it.\n" + text_of(700)),
    ("assistant", ANSWER),
    ("user", "Now list the three largest invoices. " + text_of(60, seed=1)),
    ("assistant", "Invoices 12, 7 and 3."),
    ("user", "And the smallest one?"),
]
WIRE_CALLS: dict[str, tuple[str, Callable[[list[dict[str, str]]], dict[str, Any]],
                            Callable[[FakeUpstream], list[dict[str, Any]]]]] = {
    "chat": ("/v1/chat/completions",
             lambda turns: {"model": "gpt-4o-mini", "messages": [{"role": "system", "content": "Be terse."}, *turns]},
             lambda up: up.chat[-1].body["messages"][1:]),
    "responses": ("/v1/responses",
                  lambda turns: {"model": "gpt-4o-mini", "instructions": "Be terse.", "input": turns},
                  lambda up: up.responses[-1].body["input"]),
    "messages": ("/v1/messages",
                 lambda turns: {"model": "gpt-4o-mini", "max_tokens": 100, "system": "Be terse.", "messages": turns},
                 lambda up: up.messages[-1].body["messages"]),
}


@pytest.mark.parametrize("wire", sorted(WIRE_CALLS))
async def test_trim_over_http_never_forwards_an_answer_whose_question_it_dropped(
    wire: str, upstream: FakeUpstream, start_proxy: StartProxy
) -> None:
    """The trimmer drops the oldest groups; a user message is a group of its own, so a cut between a question
    and its answer left "Done, I read it." at the head of the forwarded history, answering nothing. The rest
    of a turn whose user message was cut goes with it, on every wire."""
    proxy = await start_proxy(base_config(upstream.base_url, context_manager={
        "type": "summarising", "params": {"summarizer": "drop", "trimmer": {"max_tokens": 400}}}))
    path, make, forwarded_of = WIRE_CALLS[wire]
    status, headers, payload = await post(proxy, make([{"role": r, "content": t} for r, t in SHORT_TURNS]), path=path)
    assert status == 200, payload
    assert int(headers["x-ctxproxy-tokens-out"]) <= 400 < int(headers["x-ctxproxy-tokens-in"])
    forwarded = forwarded_of(upstream)
    assert [m["role"] for m in forwarded] == ["user", "assistant", "user"]
    assert forwarded[0]["content"] == SHORT_TURNS[2][1] and ANSWER not in str(forwarded)


# --------------------------------------------------------------------------- linear in the items


def _chat_loop(n: int, displaced: bool = False) -> dict[str, Any]:
    msgs: list[dict[str, Any]] = [system("You are an agent."), user("Read every file.")]
    results = [tool(f"c{i}", f"line {i}: ok") for i in range(n)]
    for i in range(n):
        msgs.append(call((f"c{i}", "read_file", f'{{"path": "src/m{i}.py"}}')))
        if not displaced:
            msgs.append(results[i])
        elif i:
            msgs.append(results[i - 1])  # each result one call late: the repair moves it back
    return {"model": MODEL, "messages": msgs + (results[-1:] if displaced else [])}


def _responses_loop(n: int, displaced: bool = False) -> dict[str, Any]:
    items: list[dict[str, Any]] = [{"role": "user", "content": "Read every file."}]
    outputs = [{"type": "function_call_output", "call_id": f"c{i}", "output": f"line {i}: ok"} for i in range(n)]
    for i in range(n):
        items.append({"type": "function_call", "call_id": f"c{i}", "name": "read_file",
                      "arguments": f'{{"path": "src/m{i}.py"}}'})
        if not displaced:
            items.append(outputs[i])
        elif i:
            items += [{"role": "assistant", "content": "next"}, outputs[i - 1]]
    return {"model": MODEL, "input": items + (outputs[-1:] if displaced else [])}


def _messages_loop(n: int, displaced: bool = False) -> dict[str, Any]:
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "Read every file."}]
    for i in range(n):
        msgs.append({"role": "assistant", "content": [
            {"type": "tool_use", "id": f"t{i}", "name": "read_file", "input": {"path": f"src/m{i}.py"}}]})
        result = {"type": "tool_result", "tool_use_id": f"t{i}", "content": f"ok {i}"}
        msgs.append({"role": "user", "content": [result]})
    return {"model": MODEL, "max_tokens": 1000, "messages": msgs}


def _chat_turns(n: int, displaced: bool = False) -> dict[str, Any]:
    msgs: list[dict[str, Any]] = [system("You are an agent.")]
    for i in range(n):
        msgs += [user(f"question {i}"), call((f"c{i}", "f")), tool(f"c{i}", f"result {i}"), assistant(f"answer {i}")]
    return {"model": MODEL, "messages": [*msgs, user("current")]}


def _chat_parallel_calls(n: int, displaced: bool = False) -> dict[str, Any]:
    """One earlier turn whose assistant message made ``n`` calls at once, each answered: masking names each
    masked output's tool from that one message."""
    calls = [(f"c{i}", "read_file", f'{{"path": "src/m{i}.py"}}') for i in range(n)]
    results = [tool(f"c{i}", f"line {i}: " + "ok " * 60) for i in range(n)]
    return {"model": MODEL, "messages": [system("You are an agent."), user("Read every file."), call(*calls),
                                         *results, assistant("Read."), user("current")]}


LADDERS: dict[str, tuple[Any, Callable[..., dict[str, Any]], bool, Any]] = {
    # name: (wire, body of n pairs, displaced, context manager)
    "chat-tool-loop": (CHAT, _chat_loop, False, None),
    "chat-displaced-results": (CHAT, _chat_loop, True, None),
    "responses-tool-loop": (RESPONSES, _responses_loop, False, None),
    "responses-displaced-outputs": (RESPONSES, _responses_loop, True, None),
    "messages-tool-loop": (MESSAGES, _messages_loop, False, None),
    "chat-turns-stack": (CHAT, _chat_turns, False, {"type": "stack", "params": {"max_messages": 40}}),
    "chat-parallel-calls-masked": (CHAT, _chat_parallel_calls, False, {"type": "observation-masking",
                                                                       "params": {"keep_recent": 10}}),
    "chat-turns-trimmed": (CHAT, _chat_turns, False, {"type": "summarising", "params": {"summarizer": "drop",
                                                                                        "keep_turns": 100_000}}),
}


@pytest.mark.parametrize("case", sorted(LADDERS))
def test_a_long_conversation_is_assembled_in_linear_time(case: str) -> None:
    """Thousands of small tool groups (a long agent loop in one turn, or a long history) must cost the same per
    item at any size: the working-memory cap dropped one group per pass over all groups, so 8,000 pairs took
    16 s and 12,000 took 31 s while the event loop waited. Time per item over a size ladder must not grow."""
    wire, make, displaced, manager = LADDERS[case]
    config = make_config(window=8_000, context_manager=manager) if manager else make_config(window=8_000)
    route = Routes(config, MODEL_MAP).resolve(MODEL)
    policy = policy_for(config, None, MODEL, None)

    def setup(n: int) -> Callable[[], object]:
        body = make(n, displaced)

        def step() -> Assembly:
            return asyncio.run(assemble(body, wire=wire, route=route, policy=policy, counter=COUNTER,
                                        services=services(COUNTER)))
        assert step().report.tokens_after < step().report.tokens_before  # the ladder exercises the cuts
        return step

    growth = per_item_growth(setup, 500)
    assert growth < LINEAR, f"time per item grew {growth:.1f}x from 500 to 4,000 pairs"


def prefill() -> Message:
    """An assistant prefill of ~260 tokens."""
    return {"role": "assistant", "content": 'Here is the JSON: {"notes": "' + text_of(250, 9)}


def tool_round(call_id: str, result: str) -> list[Message]:
    return [{"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": "fetch", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": call_id, "content": result}]


@pytest.mark.usefixtures("shared_model_map")
async def test_trimmer_never_forwards_without_the_assistant_prefill(upstream: FakeUpstream, start_proxy: StartProxy
                                                                    ) -> None:
    """The last WM group (an assistant prefill) is never dropped: kept, or the request is refused."""
    # B = 4000 - 500 - 400 = 3100; system + question + live round ~2950 fit; + prefill (~250) does not
    cfg = base_config(upstream.base_url, models=[{"name": "tiny", "context_window": 4000, "max_output_tokens": 500}])
    proxy = await start_proxy(cfg)
    system, question = {"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": "Fetch both."}
    live = tool_round("call_b", text_of(2900, 2))
    last = prefill()
    messages = [system, question, *tool_round("call_a", text_of(1000, 1)), *live, last]
    pinned = message_tokens([system, question, *live]) + 20  # + the call's name, arguments and overhead
    assert pinned < 3100 < pinned + n_tokens(last["content"])
    status, _headers, body = await post(proxy, chat_body(messages, "tiny"))
    if status == 400:  # never dropping the prefill may leave nothing that fits: a refusal is right
        assert body["error"]["code"] == "context_length_exceeded", body
        return
    assert status == 200, body
    assert upstream.chat[-1].body["messages"][-1] == last


@pytest.mark.usefixtures("shared_model_map")
async def test_working_memory_cap_keeps_the_assistant_prefill(upstream: FakeUpstream, start_proxy: StartProxy
                                                              ) -> None:
    """With working_memory_messages 2, the older round goes and the prefill stays last."""
    cfg = summarising_config(upstream.base_url, context_manager={"type": "summarising", "params": {
        "keep_turns": 4, "working_memory_messages": 2}})
    proxy = await start_proxy(cfg)
    # B = 8000 - 1000 - 800 = 6200, T = 5636: a 5700-token system prompt puts the request over T, under B
    messages = [{"role": "system", "content": text_of(5700, 3)}, {"role": "user", "content": "Fetch both."},
                *tool_round("call_a", "a is 1"), *tool_round("call_b", "b is 2"),
                {"role": "assistant", "content": "Here is the JSON: {"}]
    status, _headers, body = await post(proxy, chat_body(messages))
    assert status == 200, body
    forwarded = upstream.chat[-1].body["messages"]
    assert forwarded[-1] == messages[-1]
    assert forwarded[-3:-1] == messages[-3:-1]  # and the live tool round before it


HI = [{"role": "user", "content": "hi"}]


def tenant(policy: str = "clamp") -> dict[str, Any]:
    return {"name": "t", "keys": ["sk-t"], "max_output_tokens": 100, "max_output_policy": policy}


@pytest.mark.parametrize(("extra", "sent"), [
    ({"n": 4, "max_tokens": 100}, {"max_tokens": 25}),
    ({"n": 4}, {"max_tokens": 25}),
    ({"n": 3, "max_completion_tokens": 90}, {"max_completion_tokens": 33}),
    ({"n": 4, "max_tokens": 20}, {"max_tokens": 20}),  # within its share: untouched
    ({"n": 1, "max_tokens": 100}, {"max_tokens": 100}),
])
async def test_output_cap_clamped_to_each_choices_share(start_proxy: StartProxy, upstream: FakeUpstream,
                                                          extra: dict[str, Any], sent: dict[str, int]) -> None:
    """A tenant's max_output_tokens covers the whole output: with ``n`` choices each gets its share (``n: 128``
    with ``max_tokens`` at the cap used to buy 128 times the output the key allows)."""
    proxy = await start_proxy(base_config(upstream.base_url, tenants=[tenant()]))
    status, _, body = await post(proxy, {"model": "gpt-4o-mini", "messages": HI, **extra}, key="sk-t")
    assert status == 200, body
    forwarded = upstream.chat[-1].body
    for key, value in sent.items():
        assert forwarded[key] == value
    assert forwarded.get("n", 1) * max(forwarded.get(k, 0) for k in ("max_tokens", "max_completion_tokens")) <= 100


@pytest.mark.parametrize(("policy", "extra"), [
    ("clamp", {"n": 101}),  # not even one token per choice
    ("refuse", {"n": 2, "max_tokens": 80}),
    # pydantic-based upstreams (vLLM, llama-cpp-python, LiteLLM's proxy) read these as 4: never one choice here
    ("clamp", {"n": 4.0, "max_tokens": 100}),
    ("clamp", {"n": "4", "max_tokens": 100}),
    ("clamp", {"n": True, "max_tokens": 100}),
    ("clamp", {"n": 0}),
])
async def test_output_cap_refused_when_a_choices_share_cannot_hold(start_proxy: StartProxy, upstream: FakeUpstream,
                                                                   policy: str, extra: dict[str, Any]) -> None:
    """When ``n`` choices cannot each get an output share, the request is refused (or, by policy, ``n`` is), never
    forwarded over the tenant's cap."""
    proxy = await start_proxy(base_config(upstream.base_url, tenants=[tenant(policy)]))
    status, _, body = await post(proxy, {"model": "gpt-4o-mini", "messages": HI, **extra}, key="sk-t")
    assert status == 400, body
    assert body["error"]["code"] in ("max_tokens_exceeded", "invalid_n"), body
    assert upstream.chat == []


async def test_a_stray_n_on_another_wire_does_not_shrink_its_cap(
    start_proxy: StartProxy, upstream: FakeUpstream
) -> None:
    """``n`` means choices on Chat Completions only: a stray ``n`` on a Responses body leaves its cap whole."""
    proxy = await start_proxy(base_config(upstream.base_url, tenants=[tenant()]))
    status, _, body = await post(proxy, {"model": "gpt-4o-mini", "input": "hi", "n": 4}, key="sk-t",
                                 path="/v1/responses")
    assert status == 200, body
    assert upstream.responses[-1].body["max_output_tokens"] == 100


async def test_requests_that_use_one_summary_forward_the_very_same_summary_item() -> None:
    """Consecutive requests of a conversation that use the same cached summary forward the very item made for the
    first (remembered by the history's first item): what the pipeline reads back from the forwarded list's first
    items (the pairing it checked) then reaches past the summary. A summary of other turns is an item of its own."""
    from tests.helpers import FakeEngine, summary_service

    h = Harness(window=200_000, max_tokens=1_500, context_manager={"type": "summarising",
                                                                   "params": {"keep_turns": 2}})
    counter = TokenCounter("o200k_base")
    svc = services(counter, engine=FakeEngine(), summaries=summary_service())
    messages = [system()]
    for i in range(12):
        messages += [user(words(60, seed=i)), assistant(words(60, seed=100 + i))]

    async def run(messages: list[dict[str, Any]]) -> Assembly:
        return await assemble({"model": MODEL, "messages": copy.deepcopy([*messages, user("next?")])}, wire=CHAT,
                              route=h.route, policy=h.policy, counter=counter, services=svc)

    def summary_of(a: Assembly) -> Any:
        (item,) = [i for i in a.items if str(i.raw.get("content")).startswith("[Conversation summary")]
        return item

    first = await run(messages)
    second = await run(messages)
    assert first.report.summary in ("created", "waited") and second.report.summary == "reused"
    assert summary_of(second) is summary_of(first)
    assert first.body == second.body
    messages += [user(words(300, seed=50)), assistant(words(300, seed=51))] * 3  # past B: a new summary is made
    third = await run(messages)
    assert third.report.summary in ("created", "waited")
    assert summary_of(third) is not summary_of(first)
    assert summary_of(third).raw["content"] != summary_of(first).raw["content"]
