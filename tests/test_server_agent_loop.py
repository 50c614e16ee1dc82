"""A 40-turn tool-calling agent loop through the proxy against a small (8k) model.

The test plays the agent with the official openai client: it appends the fake
upstream's replies (assistant ``tool_calls``, then a final text) and its own
tool results (~300-600 tokens of real source text), like a real agent. Every
payload the upstream received is checked with code independent of the proxy:
a tiktoken recount with OpenAI's formula against the hard budget, a tool-call
pairing checker, and the pinned parts; requests under the summary threshold
must arrive unchanged.
"""

from __future__ import annotations

import json
import random
import sysconfig
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import tiktoken

from tests.conftest import base_config
from tests.fake_upstream import FakeUpstream

Message = dict[str, Any]

WINDOW, MAX_OUT = 8000, 1000
HARD_BUDGET = WINDOW - MAX_OUT - 800  # window - reserve (the model's max output) - ceil(0.1 * window)
THRESHOLD = int(HARD_BUDGET / 1.1)  # T = B / (1 + hysteresis_ratio 0.1)
TURNS = 40

MANAGERS = {
    "sliding-window": "sliding-window",
    "stack": "stack",
    "summarising-drop": {"type": "summarising", "params": {"summarizer": "drop"}},
}

SYSTEM = {"role": "system", "content": (
    "You are a senior Python engineer working in a repository checkout. Use the tools to read files, "
    "search the code and run the tests before you answer. Quote file paths and line numbers exactly.")}

TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a slice of a file in the repository.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string"}, "start": {"type": "integer"}, "end": {"type": "integer"}},
            "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "grep", "description": "Search the repository for a regular expression.",
        "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}, "glob": {"type": "string"}},
                       "required": ["pattern"]}}},
    {"type": "function", "function": {
        "name": "run_tests", "description": "Run pytest on a path and return its output.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
]




# --- an independent token count: tiktoken o200k_base and OpenAI's per-message formula --------------------

ENC = tiktoken.get_encoding("o200k_base")
_TEXT_CACHE: dict[str, int] = {}


def ntok(text: str) -> int:
    n = _TEXT_CACHE.get(text)
    if n is None:
        n = _TEXT_CACHE[text] = len(ENC.encode_ordinary(text))
    return n


def count_message(m: Message) -> int:
    n = 3
    for key, value in m.items():
        if isinstance(value, str):
            n += ntok(value)
            if key == "name":
                n += 1
        elif key == "tool_calls":
            for call in value or []:
                n += 3 + ntok(call["function"]["name"]) + ntok(call["function"]["arguments"])
    return n


def count_payload(body: dict[str, Any]) -> int:
    tools = body.get("tools")
    schema = ntok(json.dumps(tools, separators=(",", ":"), ensure_ascii=False)) if tools else 0
    return 3 + schema + sum(count_message(m) for m in body["messages"])


# --- an independent pairing checker ---------------------------------------------------------------------


def pairing_problems(messages: list[Message]) -> list[str]:
    """Every tool call answered exactly once, in the block right after its assistant message; no strays."""
    problems: list[str] = []
    pending: list[str] = []  # ids of the open group, in call order
    answered: set[str] = set()
    in_group = False
    for i, m in enumerate(messages):
        role = m.get("role")
        if role == "tool":
            tid = m.get("tool_call_id")
            if not in_group:
                problems.append(f"[{i}] tool result {tid} is not in a block after an assistant tool_calls")
            elif tid in answered:
                problems.append(f"[{i}] tool result {tid} answers a call twice")
            elif tid not in pending:
                problems.append(f"[{i}] tool result {tid} answers no call of its assistant message")
            else:
                pending.remove(tid)
                answered.add(tid)
            continue
        if pending:
            problems.append(f"[{i}] calls {pending} got no result before a {role} message")
        pending, answered, in_group = [], set(), False
        if role == "assistant" and m.get("tool_calls"):
            ids = [c.get("id") for c in m["tool_calls"]]
            if len(set(ids)) != len(ids) or not all(isinstance(x, str) and x for x in ids):
                problems.append(f"[{i}] tool call ids missing or repeated: {ids}")
            for c in m["tool_calls"]:
                if not c.get("function", {}).get("name"):
                    problems.append(f"[{i}] a tool call has no function name")
            pending, in_group = list(ids), True
    if pending:
        problems.append(f"end: calls {pending} got no result")
    return problems


def test_pairing_checker_catches_problems() -> None:
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
        {"id": "b", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    ra, rb = ({"role": "tool", "tool_call_id": x, "content": "r"} for x in "ab")
    user = {"role": "user", "content": "q"}
    assert pairing_problems([user, call, ra, rb, user]) == []
    assert pairing_problems([user, call, rb, ra]) == []
    assert pairing_problems([user, call, ra, user])  # b unanswered
    assert pairing_problems([user, ra])  # orphan
    assert pairing_problems([user, call, ra, rb, rb])  # duplicate
    assert pairing_problems([user, call, ra, user, rb])  # separated
    assert pairing_problems([user, call])  # dangling at the end


# --- realistic tool output: slices of this Python's standard library ------------------------------------


def _sources() -> list[Path]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    names = ["asyncio/base_events.py", "asyncio/streams.py", "json/decoder.py", "json/encoder.py",
             "http/client.py", "email/message.py", "logging/__init__.py", "argparse.py", "pathlib.py",
             "shutil.py", "subprocess.py", "tempfile.py", "textwrap.py", "configparser.py"]
    return [lib / n for n in names if (lib / n).is_file()]


class Workspace:
    """Plays the tools: deterministic source slices of 300-600 tokens."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.files = {p: p.read_text(encoding="utf-8").splitlines() for p in _sources()}
        assert self.files, "no standard-library sources found"

    def output(self, name: str, args: dict[str, Any]) -> str:
        path = self.rng.choice(list(self.files))
        lines = self.files[path]
        target = self.rng.randint(300, 600)
        start = self.rng.randrange(0, max(1, len(lines) - 200))
        out: list[str] = []
        header = {"read_file": f"{path.name} lines {start + 1}-",
                  "grep": f"matches for {args.get('pattern')!r} in {path.name}:",
                  "run_tests": f"$ pytest {args.get('path')} -q\n(failure while importing {path.name})"}[name]
        for j, line in enumerate(lines[start:], start + 1):
            out.append(f"{j}:{line}" if name == "grep" else line)
            if ntok("\n".join(out)) >= target:
                break
        return header + "\n" + "\n".join(out)


def tool_call(turn: int, k: int, rng: random.Random) -> dict[str, Any]:
    name = rng.choice(["read_file", "grep", "run_tests"])
    args = {"read_file": {"path": f"src/pkg/module_{turn}.py", "start": 1, "end": 200},
            "grep": {"pattern": f"def handle_{turn}_{k}", "glob": "*.py"},
            "run_tests": {"path": f"tests/test_module_{turn}.py"}}[name]
    return {"id": f"call_{turn}_{k}_{rng.randrange(10**8):08d}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)}}


# --- the loop ---------------------------------------------------------------------------------------------


class Capture:
    """The exact bytes the openai client sent (httpx request hook)."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    async def hook(self, request: httpx.Request) -> None:
        if request.url.path.endswith("/chat/completions"):
            self.sent.append(request.content)


def check_forwarded(client_body: dict[str, Any], fwd: dict[str, Any], reported_out: int) -> int:
    """Budget, pairing and pinned parts of one forwarded payload; returns the independent count."""
    sent = fwd["messages"]
    problems = pairing_problems(sent)
    assert not problems, problems
    mine = count_payload(fwd)
    assert abs(mine - reported_out) <= 0.02 * reported_out, (mine, reported_out)
    assert mine <= HARD_BUDGET or (reported_out <= HARD_BUDGET and mine - HARD_BUDGET < 0.02 * HARD_BUDGET), \
        (mine, reported_out, HARD_BUDGET)
    assert reported_out <= HARD_BUDGET
    msgs = client_body["messages"]
    # the system band first, verbatim; the rest a contiguous tail of the client's messages (oldest dropped),
    # where summarising may have masked older tool outputs (the message otherwise as sent)
    assert sent[0] == msgs[0]
    tail = sent[1:]
    if tail and tail[0]["role"] == "system":  # summarising with drop: the values section stands for the turns dropped
        assert tail[0]["content"].startswith("[Conversation summary"), tail[0]
        tail = tail[1:]
    for got, want in zip(tail, msgs[len(msgs) - len(tail):], strict=True):
        assert got == want or (got["role"] == "tool" and got["content"].startswith("[ctxproxy removed this ")
                               and {**got, "content": ""} == {**want, "content": ""}), (got, want)
    last_user = max(i for i, m in enumerate(msgs) if m["role"] == "user")
    assert len(tail) >= len(msgs) - last_user, "the current user turn or its working memory was dropped"
    assert {k: v for k, v in fwd.items() if k != "messages"} == {k: v for k, v in client_body.items()
                                                                   if k != "messages"}
    return mine


@pytest.mark.parametrize("manager", list(MANAGERS))
async def test_agent_loop_40_turns(upstream: FakeUpstream, start_proxy: Any, manager: str) -> None:
    cfg = base_config(upstream.base_url,
                      models=[{"name": "small-model", "context_window": WINDOW, "max_output_tokens": MAX_OUT}],
                      context_manager=MANAGERS[manager])
    proxy = await start_proxy(cfg)
    async with httpx.AsyncClient() as http:  # the constants this test checks against are the proxy's own
        explained = (await http.post(proxy.url + "/v1/ctxproxy/explain", json={
            "model": "small-model", "messages": [SYSTEM, {"role": "user", "content": "hi"}], "tools": TOOLS})).json()
    assert explained["report"]["hard_budget"] == HARD_BUDGET
    assert explained["report"]["threshold"] == THRESHOLD
    upstream.mode = "script"
    rng = random.Random(7)
    tools = Workspace(seed=11)
    capture = Capture()
    messages: list[Message] = [SYSTEM]
    reports: list[tuple[int, int]] = []
    unchanged = changed = 0

    async with httpx.AsyncClient(event_hooks={"request": [capture.hook]}) as http, \
            openai.AsyncOpenAI(base_url=proxy.base_url, api_key="sk-agent", max_retries=0, http_client=http) as c:

        async def step(reply: Message) -> Message:
            upstream.script.append(reply)
            # the history goes in extra_body: identical JSON on the wire, without the client's per-message
            # typed transform (O(history) of pure-Python CPU per request, most of this test's time otherwise)
            raw = await c.chat.completions.with_raw_response.create(
                model="small-model", messages=[], tools=TOOLS, extra_body={"messages": messages})
            out = raw.parse()
            reports.append((int(raw.headers["x-ctxproxy-tokens-in"]), int(raw.headers["x-ctxproxy-tokens-out"])))
            assert raw.headers["x-ctxproxy-repairs"] == "0"
            message = out.choices[0].message.model_dump(exclude_none=True)
            assert message["role"] == "assistant"
            return message

        for turn in range(TURNS):
            messages.append({"role": "user", "content": f"Turn {turn}: " + rng.choice([
                "the CLI crashes when the config has a trailing comma; find out why and propose a fix.",
                "why does the retry loop in the HTTP client never back off? Look at the code and the tests.",
                "rename the internal helper without breaking the public API; check every caller first.",
                "the nightly test run is flaky on the streaming parser. Reproduce it and explain the cause.",
            ])})
            rounds = 2 if turn % 5 == 1 else 1
            for r in range(rounds):
                n_calls = 2 if (turn + r) % 3 == 0 else 1
                calls = [tool_call(turn, k + 10 * r, rng) for k in range(n_calls)]
                reply = await step({"role": "assistant", "content": None, "tool_calls": calls})
                assert [tc["id"] for tc in reply["tool_calls"]] == [tc["id"] for tc in calls]
                messages.append(reply)
                for tc in reply["tool_calls"]:
                    result = tools.output(tc["function"]["name"], json.loads(tc["function"]["arguments"]))
                    messages.append({"role": "tool", "tool_call_id": tc["id"], "content": result})
            final = await step({"role": "assistant", "content": f"Done with turn {turn}: the cause is in "
                                f"src/pkg/module_{turn}.py; " + "details follow. " * rng.randint(20, 80)})
            assert final.get("content")
            messages.append(final)

    assert not upstream.summaries
    assert len(upstream.chat) == len(capture.sent) == len(reports)
    assert len(upstream.chat) > 2 * TURNS
    total_client = count_payload({"messages": messages, "tools": TOOLS})
    assert total_client > 4 * HARD_BUDGET  # the conversation really outgrew the window
    for i, rec in enumerate(upstream.chat):
        client_raw = capture.sent[i]
        client_body = json.loads(client_raw)
        tokens_in, tokens_out = reports[i]
        mine_in = count_payload(client_body)
        assert abs(mine_in - tokens_in) <= 0.02 * tokens_in, (i, mine_in, tokens_in)
        check_forwarded(client_body, rec.body, tokens_out)
        if tokens_in <= THRESHOLD:
            unchanged += 1
            assert json.dumps(rec.body["messages"]) == json.dumps(client_body["messages"]), i
            assert rec.raw == client_raw, i  # under budget: the client's very bytes
        else:
            changed += 1
    assert unchanged >= 5 and changed >= 40, (unchanged, changed)
