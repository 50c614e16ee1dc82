"""The Responses wire under hostile and unusual inputs, driven from the outside (HTTP through the proxy).

Each test is the regression test of a defect found by probing ``/v1/responses`` and
``/v1/responses/compact`` with inputs real clients (Codex CLI, the Agents SDK, the Vercel
AI SDK) or malicious ones send: the answer is always in OpenAI's error shape, never a 500.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.conftest import RunningProxy, StartProxy, base_config
from tests.fake_upstream import FakeUpstream
from tests.outside import post, share_model_map

MODEL = "gpt-4o-mini"
ALIAS = "small-model"  # a route whose upstream model name differs: the proxy re-serialises the body


@pytest.fixture(autouse=True)
def _shared_model_map(monkeypatch: pytest.MonkeyPatch) -> None:
    share_model_map(monkeypatch)  # speed only


def config(upstream: FakeUpstream, **extra: Any) -> dict[str, Any]:
    return base_config(upstream.base_url, models=[
        {"name": MODEL, "context_window": 128000, "max_output_tokens": 16384},
        {"name": ALIAS, "model": "upstream-small", "context_window": 8000, "max_output_tokens": 1000},
    ], **extra)


async def start(upstream: FakeUpstream, start_proxy: StartProxy, **extra: Any) -> RunningProxy:
    return await start_proxy(config(upstream, **extra))


def nested(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = [value]
    return value


async def post_raw(proxy: RunningProxy, path: str, raw: bytes, key: str = "sk-client") -> tuple[int, Any]:
    """POST the exact bytes (json= would refuse a body nested this deep); status and the parsed answer."""
    async with aiohttp.ClientSession() as s, s.post(proxy.url + path, data=raw, headers={
            "Authorization": f"Bearer {key}", "Content-Type": "application/json"}) as r:
        return r.status, json.loads(await r.read())


def assert_openai_error(status: int, payload: Any, expected: int) -> dict[str, Any]:
    assert status == expected, payload
    assert isinstance(payload, dict) and set(payload["error"]) == {"message", "type", "param", "code"}, payload
    error: dict[str, Any] = payload["error"]
    return error


# --------------------------------------------------------------------------- /v1/responses/compact


@pytest.mark.parametrize("body", [
    {"model": ALIAS, "input": [{"role": "user", "content": "a"}, {"type": "blob", "v": nested(300)}]},
    {"model": ALIAS, "input": "hi", "metadata": {"v": nested(300)}},
])
async def test_compact_relayed_under_an_alias_with_a_deeply_nested_body_is_a_400_not_a_500(
    upstream: FakeUpstream, start_proxy: StartProxy, body: dict[str, Any]
) -> None:
    """orjson reads 1024 levels but writes 254: re-serialising the body for the upstream model name raised.
    (An input item nested that deep is refused when the input is read and counted, as on /v1/responses.)"""
    proxy = await start(upstream, start_proxy)
    status, payload = await post_raw(proxy, "/v1/responses/compact", json.dumps(body).encode())
    error = assert_openai_error(status, payload, 400)
    assert error["code"] in ("invalid_json", "invalid_message") and "nested too deeply" in error["message"]
    assert upstream.compactions == []



# --------------------------------------------------------------------------- /v1/responses over budget


def deep_arguments_conversation(depth: int = 1000, turns: int = 12) -> list[dict[str, Any]]:
    """A history whose function calls carry arguments JSON nested ``depth`` levels deep (within orjson's 1024)."""
    arguments = "[" * depth + "]" * depth
    items: list[dict[str, Any]] = [{"role": "developer", "content": "Be terse."}]
    for t in range(turns):
        items += [{"role": "user", "content": f"question {t}: " + "word " * 200},
                  {"type": "function_call", "call_id": f"c{t}", "name": "f", "arguments": arguments},
                  {"type": "function_call_output", "call_id": f"c{t}", "output": "result " * 100}]
    items.append({"role": "user", "content": "now"})
    return items


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/ctxproxy/explain/responses", "/v1/responses/compact"])
async def test_call_arguments_nested_almost_1024_levels_deep_are_summarised_not_a_500(
    upstream: FakeUpstream, start_proxy: StartProxy, path: str
) -> None:
    """The summary cache key canonicalises call arguments: orjson parses them, cannot write them back, and the
    fallback (``repr``) overflowed Python's recursion limit: a 500 on every summarising path."""
    upstream.compact_mode = "404"  # /responses/compact answered by the summariser
    proxy = await start(upstream, start_proxy)
    items = deep_arguments_conversation()
    status, payload = await post_raw(proxy, path, json.dumps({"model": ALIAS, "input": items}).encode())
    assert status == 200, payload
    if path == "/v1/responses":
        assert upstream.responses[-1].body["input"][-1] == items[-1]
    elif path == "/v1/responses/compact":
        assert payload["object"] == "response.compaction" and len(upstream.summaries) >= 1
    else:
        assert payload["report"]["summary"] in ("would_create", "reused")

# --------------------------------------------------------------------------- pairing errors name the client's ids

FN_CALL = {"type": "function_call", "call_id": "x", "name": "f", "arguments": "{}"}
FN_OUT = {"type": "function_call_output", "call_id": "x", "output": "r"}
APPROVAL = {"type": "mcp_approval_request", "id": "x", "name": "f", "arguments": "{}", "server_label": "s"}
APPROVAL_OUT = {"type": "mcp_approval_response", "approval_request_id": "x", "approve": True}


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/ctxproxy/explain/responses"])
@pytest.mark.parametrize(("call", "output"), [(FN_CALL, FN_OUT), (APPROVAL, APPROVAL_OUT)], ids=["call", "approval"])
async def test_a_pairing_error_names_the_id_as_the_client_sent_it(
    upstream: FakeUpstream, start_proxy: StartProxy, path: str, call: dict[str, Any], output: dict[str, Any]
) -> None:
    """The error read ``input[2] repeats the call id 'call:x'``: an internal namespace the client never sent."""
    proxy = await start(upstream, start_proxy)
    items = [{"role": "user", "content": "go"}, call, dict(call), output]
    status, payload = await post_raw(proxy, path, json.dumps({"model": MODEL, "input": items}).encode())
    error = assert_openai_error(status, payload, 400)
    assert error["code"] == "duplicate_tool_call_id" and error["param"] == "input[2]"
    assert error["message"] == "input[2] repeats the call id 'x'"
    assert upstream.responses == []


@pytest.mark.parametrize(("item", "param"), [
    ({"type": "function_call", "call_id": "\x00approval:x", "name": "f", "arguments": "{}"}, "input[1].call_id"),
    ({"type": "function_call_output", "call_id": "\x00x", "output": "r"}, "input[1].call_id"),
    ({"type": "local_shell_call_output", "id": "\x00x", "output": "r"}, "input[1].id"),
    ({**APPROVAL, "id": "\x00x"}, "input[1].id"),
    ({**APPROVAL_OUT, "approval_request_id": "\x00x"}, "input[1].approval_request_id"),
])
async def test_a_pairing_id_starting_with_nul_is_refused(
    upstream: FakeUpstream, start_proxy: StartProxy, item: dict[str, Any], param: str
) -> None:
    """NUL starts the approvals' namespace: a call id there could answer (or be answered by) an approval."""
    proxy = await start(upstream, start_proxy)
    items = [{"role": "user", "content": "go"}, item, {"role": "user", "content": "next"}]
    status, payload = await post_raw(proxy, "/v1/responses", json.dumps({"model": MODEL, "input": items}).encode())
    error = assert_openai_error(status, payload, 400)
    assert error["code"] == "invalid_tool_call" and error["param"] == param
    assert "NUL" in error["message"] and "\x00" not in error["message"]
    assert upstream.responses == []


async def test_a_call_and_an_approval_of_the_same_id_still_do_not_pair(
    upstream: FakeUpstream, start_proxy: StartProxy
) -> None:
    """Call ids are now plain: an approval answering call ``x`` is still an orphan, not its result."""
    proxy = await start(upstream, start_proxy)
    user, nxt = {"role": "user", "content": "go"}, {"role": "user", "content": "next"}
    status, _, _ = await post(proxy, {"model": MODEL, "input": [user, FN_CALL, APPROVAL_OUT, nxt]},
                              path="/v1/responses")
    assert status == 200
    assert upstream.responses[-1].body["input"] == [user, nxt]  # the call got no output: removed, the orphan too


# --------------------------------------------------------------------------- the wire reference says how ids pair

README = Path(__file__).resolve().parents[2] / "docs" / "wires.md"  # the per-wire reference, moved from the README


def pairing_bullet() -> str:
    """The Pairing bullet of the Responses API section of docs/wires.md, on one line."""
    section = README.read_text(encoding="utf-8").split("## Responses API", 1)[1].split("\n## ", 1)[0]
    bullet = section.split("* **Pairing**", 1)[1].split("\n* ", 1)[0]
    return " ".join(bullet.split())


@pytest.mark.parametrize("call", [
    {"type": "local_shell_call", "id": "ls_1", "call_id": "a", "status": "completed",
     "action": {"type": "exec", "command": ["ls"], "env": {}}},
    {"type": "custom_tool_call", "call_id": "a", "name": "patch", "input": "*** Begin Patch"},
], ids=["local_shell_call", "custom_tool_call"])
async def test_an_output_of_another_call_kind_answers_a_call_by_its_call_id_as_the_readme_says(
    upstream: FakeUpstream, start_proxy: StartProxy, call: dict[str, Any]
) -> None:
    """The README said "an output of one kind never answers a call of another"; the code (on purpose: Codex
    answers a local_shell_call with a function_call_output) pairs every call kind's output by call_id."""
    proxy = await start(upstream, start_proxy)
    items = [{"role": "user", "content": "go"}, call, {"type": "function_call_output", "call_id": "a", "output": "r"}]
    status, headers, _ = await post(proxy, {"model": MODEL, "input": items}, path="/v1/responses")
    assert status == 200 and headers["x-ctxproxy-repairs"] == "0"
    assert upstream.responses[-1].body["input"] == items
    bullet = pairing_bullet()
    assert "never answers a call of another" not in bullet
    assert "an output of any call kind answers the call with its `call_id`" in bullet
    assert "approvals pair in a namespace of their own" in bullet


# ------------------------------------------- bodies the proxy and an upstream may read differently
# (fixed outside the wire's files: counted before forwarding, or refused)


async def test_tools_nested_too_deeply_are_not_forwarded_uncounted_past_a_tenant_cap(
    upstream: FakeUpstream, start_proxy: StartProxy
) -> None:
    proxy = await start(upstream, start_proxy, tenants=[{"name": "t", "keys": ["k-t"], "max_context_tokens": 500}])
    tools = [{"type": "function", "name": "f", "description": "word " * 20000,
              "parameters": {"type": "object", "x": nested(300)}}]
    status, payload = await post_raw(proxy, "/v1/responses",
                                     json.dumps({"model": MODEL, "input": "hi", "tools": tools}).encode(), key="k-t")
    assert status == 400, payload  # counted and refused (or refused as unserialisable), never forwarded
    assert upstream.responses == []


async def test_a_body_with_duplicate_keys_is_not_forwarded_as_bytes_the_upstream_may_read_otherwise(
    upstream: FakeUpstream, start_proxy: StartProxy
) -> None:
    """An upstream that keeps the first of a repeated key would run gpt-4o on the long input, where the proxy
    read gpt-4o-mini and "hi" (orjson keeps the last): a body repeating its model is refused."""
    proxy = await start(upstream, start_proxy, tenants=[{"name": "t", "keys": ["k-t"], "models": [MODEL],
                                                         "max_context_tokens": 300}])
    big = json.dumps([{"role": "user", "content": "word " * 5000}])
    raw = ('{"model": "gpt-4o", "input": ' + big + ', "model": "gpt-4o-mini", "input": "hi"}').encode()
    status, _payload = await post_raw(proxy, "/v1/responses", raw, key="k-t")
    forwarded = [r.raw for r in upstream.responses]
    # refused, or forwarded as the proxy read it: one model field, one input field
    assert status == 400 or (forwarded and forwarded[-1].count(b'"model"') == 1 and b"word word" not in forwarded[-1])


async def test_the_same_deep_arguments_on_chat_completions_are_not_a_500(
    upstream: FakeUpstream, start_proxy: StartProxy
) -> None:
    proxy = await start(upstream, start_proxy)
    arguments = "[" * 1000 + "]" * 1000
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be terse."}]
    for t in range(12):
        messages += [{"role": "user", "content": f"question {t}: " + "word " * 200},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": f"c{t}", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
                     {"role": "tool", "tool_call_id": f"c{t}", "content": "result " * 100}]
    messages.append({"role": "user", "content": "now"})
    status, payload = await post_raw(proxy, "/v1/chat/completions",
                                     json.dumps({"model": ALIAS, "messages": messages}).encode())
    assert status == 200, payload
