"""The Messages wire over HTTP with the official ``anthropic`` client (issue 14), against a fake Anthropic
upstream on 127.0.0.1 that records what it receives (tests/fake_upstream.py)."""

from __future__ import annotations

import json
import math
from typing import Any

import aiohttp
import anthropic
import pytest

from tests import media_files as mf
from tests.conftest import RunningProxy, StartProxy
from tests.fake_upstream import REPLY, FakeUpstream
from tests.helpers import words
from tests.outside import share_model_map
from tests.wire.messages_helpers import CLAUDE, cache_marks, pairing_problems, recount

UPSTREAM_KEY = "sk-ant-upstream-secret"


@pytest.fixture(autouse=True)
def _shared_model_map(monkeypatch: pytest.MonkeyPatch) -> None:
    share_model_map(monkeypatch)  # speed only


def config(upstream: FakeUpstream, *, key: str | None = UPSTREAM_KEY, api: str = "anthropic", **extra: Any
           ) -> dict[str, Any]:
    up: dict[str, Any] = {"base_url": upstream.url if api == "anthropic" else upstream.base_url, "api": api}
    if key:
        up["api_key"] = key
    out: dict[str, Any] = {
        "upstreams": {"a": up},
        "models": [{"name": CLAUDE, "context_window": 200_000, "max_output_tokens": 64_000}],
        "cache": {"backend": "memory"},
        "summarizer": {"retry_backoff_seconds": 0},
        "server": {"idle_timeout": 5},
    }
    out.update(extra)
    return out


def factor_of(proxy: RunningProxy) -> float:
    """The calibration factor the proxy applies to Claude counts (issue 15; a family default until it learns)."""
    runtime = proxy.state.runtime
    return float(runtime.calibration.factor(runtime.route(CLAUDE), "default")) if runtime.calibration is not None else 1.0


def client(proxy: RunningProxy, key: str = "sk-ant-client", **kwargs: Any) -> anthropic.AsyncAnthropic:
    # the SDK appends /v1/messages to the base URL itself
    return anthropic.AsyncAnthropic(base_url=proxy.url, api_key=key, max_retries=0, **kwargs)


async def test_create_is_managed_and_sent_to_the_anthropic_upstream_with_its_key(
        upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(config(upstream))
    async with client(proxy) as c:
        raw = await c.messages.with_raw_response.create(
            model=CLAUDE, max_tokens=64, system="Be brief.", messages=[{"role": "user", "content": "hi"}],
            extra_headers={"anthropic-version": "2023-06-01",
                           "anthropic-beta": "context-management-2025-06-27,interleaved-thinking-2025-05-14"})
        message = await raw.parse()
    assert message.content[0].type == "text" and message.content[0].text == REPLY
    assert raw.headers["x-ctxproxy-summary"] == "none" and int(raw.headers["x-ctxproxy-tokens-in"]) > 0
    sent = upstream.messages[-1]
    assert sent.path == "/v1/messages"
    headers = {k.lower(): v for k, v in sent.headers.items()}
    assert headers["x-api-key"] == UPSTREAM_KEY and "authorization" not in headers
    assert headers["anthropic-version"] == "2023-06-01"
    assert headers["anthropic-beta"] == "context-management-2025-06-27,interleaved-thinking-2025-05-14"
    assert sent.body["messages"] == [{"role": "user", "content": "hi"}] and sent.body["max_tokens"] == 64


async def test_streaming_is_relayed_event_by_event(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(config(upstream))
    async with client(proxy) as c, c.messages.stream(
            model=CLAUDE, max_tokens=64, messages=[{"role": "user", "content": "hi"}]) as stream:
        pieces = [text async for text in stream.text_stream]
        final = await stream.get_final_message()
    assert "".join(pieces) == REPLY and final.stop_reason == "end_turn"
    assert upstream.messages[-1].body["stream"] is True


@pytest.mark.parametrize("stream", [False, True])
async def test_a_tool_loop_stays_paired_and_within_budget(
        upstream: FakeUpstream, start_proxy: StartProxy, stream: bool) -> None:
    """An agent loop of 12 tool rounds on a small budget: every forwarded body is paired and fits."""
    budget = 2_500
    rounds = 12
    upstream.anthropic_script = [[{"type": "text", "text": f"step {i}"},
                                  {"type": "tool_use", "id": f"toolu_{i:03d}", "name": "Read",
                                   "input": {"path": f"/srv/{i}.py"}}] for i in range(rounds)]
    proxy = await start_proxy(config(upstream, context_manager={"type": "summarising", "params": {
        "keep_turns": 2}}, trimmer={"max_tokens": budget}))
    tools = [{"name": "Read", "description": "read a file", "input_schema": {
        "type": "object", "properties": {"path": {"type": "string"}}}}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Read every file and explain the project."}]
    async with client(proxy) as c:
        for i in range(rounds + 1):
            if stream:
                async with c.messages.stream(model=CLAUDE, max_tokens=256, tools=tools, messages=messages) as s:
                    reply = await s.get_final_message()
            else:
                reply = await c.messages.create(model=CLAUDE, max_tokens=256, tools=tools, messages=messages)
            messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
            calls = [b for b in reply.content if b.type == "tool_use"]
            if not calls:
                break
            assert i < rounds
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": b.id, "content": words(300, i)} for b in calls]})
    assert reply.content[0].text == REPLY
    sent = [r.body for r in upstream.messages]
    assert len(sent) == rounds + 1
    for body in sent:
        assert not pairing_problems(body["messages"]), pairing_problems(body["messages"])
        assert recount(body) <= budget
        assert body["messages"][0] == {"role": "user", "content": "Read every file and explain the project."}
    assert len(sent[-1]["messages"]) < len(messages)  # the working memory was trimmed on the way


async def test_count_tokens_is_relayed_to_an_upstream_that_serves_it(
        upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(config(upstream))
    async with client(proxy) as c:
        count = await c.messages.count_tokens(model=CLAUDE, messages=[{"role": "user", "content": "hi"}])
    assert count.input_tokens == upstream.count_tokens_answer
    sent = upstream.counts[-1]
    assert sent.body == {"model": CLAUDE, "messages": [{"role": "user", "content": "hi"}]}  # no max_tokens added
    assert {k.lower(): v for k, v in sent.headers.items()}["x-api-key"] == UPSTREAM_KEY


@pytest.mark.parametrize("api", ["anthropic", "openai"])
async def test_count_tokens_is_answered_locally_when_the_upstream_does_not_serve_it(
        upstream: FakeUpstream, start_proxy: StartProxy, api: str) -> None:
    """Claude Code breaks on a 404 here: the proxy counts what it would forward itself."""
    upstream.count_tokens_served = False
    proxy = await start_proxy(config(upstream, api=api))
    request = {"model": CLAUDE, "system": "Be brief.", "messages": [{"role": "user", "content": "hello there"}]}
    async with client(proxy) as c:
        count = await c.messages.count_tokens(**request)  # type: ignore[arg-type]
    # the proxy's count in the provider's units: times the model's calibration factor (issue 15)
    assert count.input_tokens == math.ceil(recount({**request, "max_tokens": 1}) * factor_of(proxy))
    assert len(upstream.counts) == (1 if api == "anthropic" else 0)


async def test_count_tokens_counts_what_would_be_forwarded_after_compaction(
        upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    upstream.count_tokens_served = False
    proxy = await start_proxy(config(upstream, context_manager={"type": "sliding-window", "params": {
        "keep_turns": 2}}, trimmer={"max_tokens": 2_000}))
    messages: list[dict[str, Any]] = []
    for t in range(20):
        messages += [{"role": "user", "content": f"question {t}: " + words(80, t)},
                     {"role": "assistant", "content": "answer " + words(60, t)}]
    messages.append({"role": "user", "content": "last question"})
    full = recount({"model": CLAUDE, "messages": messages})
    async with client(proxy) as c:
        count = await c.messages.count_tokens(model=CLAUDE, messages=messages)  # type: ignore[arg-type]
    assert count.input_tokens <= 2_000 < full


# --------------------------------------------------------------------------- errors in Anthropic's shape


@pytest.mark.parametrize(("status", "kind", "error"), [
    (400, "invalid_request_error", anthropic.BadRequestError),
    (429, "rate_limit_error", anthropic.RateLimitError),
    (529, "overloaded_error", anthropic.OverloadedError),
    (500, "api_error", anthropic.InternalServerError),
])
async def test_upstream_errors_are_relayed_with_their_status_and_body(
        upstream: FakeUpstream, start_proxy: StartProxy, status: int, kind: str, error: type[Exception]) -> None:
    upstream.mode = "status"
    upstream.status = status
    upstream.status_body = {"type": "error", "error": {"type": kind, "message": f"upstream says {kind}"},
                            "request_id": "req_up"}
    proxy = await start_proxy(config(upstream))
    async with client(proxy) as c:
        with pytest.raises(error) as caught:
            await c.messages.create(model=CLAUDE, max_tokens=16, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.status_code == status  # type: ignore[attr-defined]
    assert caught.value.body == upstream.status_body  # type: ignore[attr-defined]


@pytest.mark.parametrize("odd", [
    {"type": "error", "error": "overloaded"},
    {"type": "error"},
    {"type": "error", "error": {"type": 5, "message": None}},
])
async def test_an_upstream_error_that_only_claims_anthropics_shape_is_normalised(
        upstream: FakeUpstream, start_proxy: StartProxy, odd: dict[str, Any]) -> None:
    """Relayed as sent only when the SDK can read it as an error; otherwise in Anthropic's shape, status kept."""
    upstream.mode = "status"
    upstream.status = 529
    upstream.status_body = odd
    proxy = await start_proxy(config(upstream))
    async with client(proxy) as c:
        with pytest.raises(anthropic.APIStatusError) as caught:
            await c.messages.create(model=CLAUDE, max_tokens=16, messages=[{"role": "user", "content": "hi"}])
    body = caught.value.body
    assert caught.value.status_code == 529
    assert isinstance(body, dict) and body["type"] == "error"
    assert isinstance(body["error"]["type"], str) and isinstance(body["error"]["message"], str)


async def post(proxy: RunningProxy, payload: Any, headers: dict[str, str] | None = None,
               path: str = "/v1/messages") -> tuple[int, Any]:
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    async with aiohttp.ClientSession() as s, s.post(proxy.url + path, data=data, headers={
            "x-api-key": "sk-ant-client", "content-type": "application/json", **(headers or {})}) as r:
        return r.status, await r.json(content_type=None)


@pytest.mark.parametrize(("payload", "status", "kind"), [
    (b"{not json", 400, "invalid_request_error"),
    (b"[1, 2]", 400, "invalid_request_error"),
    ({"model": CLAUDE, "messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_request_error"),
    ({"model": CLAUDE, "max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_request_error"),
    ({"model": CLAUDE, "max_tokens": 9, "messages": []}, 400, "invalid_request_error"),
    ({"model": CLAUDE, "max_tokens": 9, "messages": [{"role": "user", "content": [{"type": "tool_use"}]}]}, 400,
     "invalid_request_error"),
    ({"max_tokens": 9, "messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_request_error"),
])
async def test_bad_requests_get_anthropics_error_shape(
        upstream: FakeUpstream, start_proxy: StartProxy, payload: Any, status: int, kind: str) -> None:
    proxy = await start_proxy(config(upstream))
    got, body = await post(proxy, payload)
    assert got == status
    assert set(body) == {"type", "error"} and body["type"] == "error"
    assert body["error"]["type"] == kind and body["error"]["message"]
    assert "Traceback" not in json.dumps(body)
    assert upstream.messages == []


async def test_a_request_that_cannot_fit_is_refused_before_the_upstream_is_called(
        upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(config(upstream, trimmer={"max_tokens": 500}))
    async with client(proxy) as c:
        with pytest.raises(anthropic.BadRequestError) as caught:
            await c.messages.create(model=CLAUDE, max_tokens=16, messages=[{"role": "user", "content": words(900)}])
    assert f"budget is {int(500 / factor_of(proxy))}" in str(caught.value)  # B in the proxy's own count
    assert upstream.messages == []


async def test_a_body_over_the_size_limit_is_413_in_anthropics_shape(
        upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(config(upstream, server={"max_body_mb": 0.01}))
    async with client(proxy) as c:
        with pytest.raises(anthropic.APIStatusError) as caught:
            await c.messages.create(model=CLAUDE, max_tokens=16, messages=[{"role": "user", "content": "x" * 20_000}])
    assert caught.value.status_code == 413
    assert caught.value.body["error"]["type"] == "request_too_large"  # type: ignore[index]


async def test_an_unreachable_upstream_is_a_502_api_error(start_proxy: StartProxy) -> None:
    proxy = await start_proxy({"upstreams": {"a": {"base_url": "http://127.0.0.1:9", "api": "anthropic"}},
                               "cache": {"backend": "memory"}})
    async with client(proxy) as c:
        with pytest.raises(anthropic.InternalServerError) as caught:
            await c.messages.create(model=CLAUDE, max_tokens=16, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.status_code == 502
    assert caught.value.body["error"]["type"] == "api_error"  # type: ignore[index]


# --------------------------------------------------------------------------- keys


def tenants(*models: str) -> list[dict[str, Any]]:
    return [{"name": "team", "keys": ["proxy-key-1"], **({"models": list(models)} if models else {})}]


async def test_with_tenants_the_proxy_key_is_accepted_in_either_header_and_never_forwarded(
        upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(config(upstream, tenants=tenants()))
    async with client(proxy, key="proxy-key-1") as c:
        await c.messages.create(model=CLAUDE, max_tokens=16, messages=[{"role": "user", "content": "hi"}])
    async with anthropic.AsyncAnthropic(base_url=proxy.url, auth_token="proxy-key-1", max_retries=0) as c:
        await c.messages.create(model=CLAUDE, max_tokens=16, messages=[{"role": "user", "content": "hi"}])
    # Claude Code sends its key as x-api-key (this SDK as Authorization: Bearer)
    status, _ = await post(proxy, {"model": CLAUDE, "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]},
                           {"x-api-key": "proxy-key-1"})
    assert status == 200 and len(upstream.messages) == 3
    for sent in upstream.messages:
        headers = {k.lower(): v for k, v in sent.headers.items()}
        assert headers["x-api-key"] == UPSTREAM_KEY and "authorization" not in headers
        assert "proxy-key-1" not in json.dumps(headers)
    async with client(proxy, key="wrong") as c:
        with pytest.raises(anthropic.AuthenticationError) as caught:
            await c.messages.create(model=CLAUDE, max_tokens=16, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]


async def test_a_model_the_tenant_may_not_use_is_404_not_found_error(
        upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(config(upstream, tenants=tenants("claude-haiku-4-5")))
    async with client(proxy, key="proxy-key-1") as c:
        with pytest.raises(anthropic.NotFoundError) as caught:
            await c.messages.create(model=CLAUDE, max_tokens=16, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]


async def test_open_proxy_without_an_upstream_key_forwards_the_clients_own(
        upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(config(upstream, key=None))
    async with client(proxy, key="sk-ant-client-own") as c:
        await c.messages.create(model=CLAUDE, max_tokens=16, messages=[{"role": "user", "content": "hi"}])
    headers = {k.lower(): v for k, v in upstream.messages[-1].headers.items()}
    # this SDK sends its key as Authorization: Bearer (older ones, and Claude Code, as x-api-key): either is forwarded
    assert headers.get("x-api-key") == "sk-ant-client-own" or headers.get("authorization") == "Bearer sk-ant-client-own"


async def test_tenant_output_cap_clamps_max_tokens(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(config(upstream, tenants=[{"name": "team", "keys": ["proxy-key-1"],
                                                          "max_output_tokens": 100}]))
    async with client(proxy, key="proxy-key-1") as c:
        await c.messages.create(model=CLAUDE, max_tokens=4096, messages=[{"role": "user", "content": "hi"}])
    assert upstream.messages[-1].body["max_tokens"] == 100


async def test_unmanaged_messages_paths_are_relayed_the_anthropic_way(
        upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """/v1/messages/batches (not managed) goes to {root}/v1/messages/batches with x-api-key, for tenants too."""
    proxy = await start_proxy(config(upstream, tenants=tenants(), relay={"allow": ["POST /v1/messages/batches"]}))
    status, _ = await post(proxy, {"requests": []}, {"x-api-key": "proxy-key-1"}, path="/v1/messages/batches")
    assert status == 200
    sent = upstream.other[-1]
    headers = {k.lower(): v for k, v in sent.headers.items()}
    assert sent.path == "/v1/messages/batches"
    assert headers["x-api-key"] == UPSTREAM_KEY and "authorization" not in headers


# --------------------------------------------------------------------------- explain, metrics, caches


async def test_explain_and_metrics_speak_the_messages_wire(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(config(upstream))
    request = {"model": CLAUDE, "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
    status, explained = await post(proxy, request, path="/v1/ctxproxy/explain/messages")
    assert status == 200 and explained["messages"] == request["messages"]
    assert explained["report"]["wire"] == "messages"
    status, refused = await post(proxy, {"model": CLAUDE, "messages": []}, path="/v1/ctxproxy/explain/messages")
    assert status == 400 and refused["type"] == "error"
    await post(proxy, request)
    async with aiohttp.ClientSession() as s, s.get(proxy.url + "/metrics") as r:
        metrics = await r.text()
    assert 'wire="messages"' in metrics


async def test_the_system_prompt_and_tools_keep_their_cache_marks_when_history_is_compacted(
        upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(config(upstream, context_manager={"type": "summarising", "params": {
        "keep_turns": 2}}, trimmer={"max_tokens": 3_000}))
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197;"},
              {"type": "text", "text": "You are Claude Code. " + words(100), "cache_control": {"type": "ephemeral"}}]
    tools = [{"name": "Read", "description": "read", "input_schema": {"type": "object"},
              "cache_control": {"type": "ephemeral"}}]
    messages: list[dict[str, Any]] = []
    for t in range(40):
        messages += [{"role": "user", "content": f"q{t} " + words(80, t)}, {"role": "assistant", "content": "a"}]
    messages.append({"role": "user", "content": [{"type": "text", "text": "last", "cache_control": {
        "type": "ephemeral"}}]})
    async with client(proxy) as c:
        raw = await c.messages.with_raw_response.create(model=CLAUDE, max_tokens=64, system=system,  # type: ignore[arg-type]
                                                        tools=tools, messages=messages)  # type: ignore[arg-type]
    assert raw.headers["x-ctxproxy-summary"] == "waited"
    sent = upstream.messages[-1].body
    assert sent["system"] == system and sent["tools"] == tools
    assert sent["messages"][0]["content"][0]["text"].startswith("[Conversation summary")
    assert cache_marks(sent) == 3
    assert len(upstream.summaries) == 1  # the summariser spoke Messages to the Anthropic upstream
    assert upstream.summaries[0].path == "/v1/messages"
    summary_headers = {k.lower(): v for k, v in upstream.summaries[0].headers.items()}
    assert summary_headers["x-api-key"] == UPSTREAM_KEY


# --------------------------------------------------------------------------- hostile and unusual clients


def nested(depth: int) -> Any:
    value: Any = "deep"
    for _ in range(depth):
        value = {"k": value}
    return value


HOSTILE: list[tuple[str, Any]] = [
    ("content is a number", {"model": CLAUDE, "max_tokens": 9, "messages": [{"role": "user", "content": 42}]}),
    ("a block is null", {"model": CLAUDE, "max_tokens": 9, "messages": [{"role": "user", "content": [None]}]}),
    ("a message is a string", {"model": CLAUDE, "max_tokens": 9, "messages": ["hi"]}),
    ("max_tokens is a string", {"model": CLAUDE, "max_tokens": "9", "messages": [{"role": "user", "content": "x"}]}),
    ("max_tokens is a bool", {"model": CLAUDE, "max_tokens": True, "messages": [{"role": "user", "content": "x"}]}),
    ("model is a number", {"model": 7, "max_tokens": 9, "messages": [{"role": "user", "content": "x"}]}),
    ("role is a list", {"model": CLAUDE, "max_tokens": 9, "messages": [{"role": ["user"], "content": "x"}]}),
    ("nested too deeply", {"model": CLAUDE, "max_tokens": 9, "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": nested(300)}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "r"}]}]}),
    ("five cache marks", {"model": CLAUDE, "max_tokens": 9, "messages": [{"role": "user", "content": [
        {"type": "text", "text": str(i), "cache_control": {"type": "ephemeral"}} for i in range(5)]}]}),
    ("context_management is a list", {"model": CLAUDE, "max_tokens": 9, "context_management": [],
                                      "messages": [{"role": "user", "content": "x"}]}),
]


@pytest.mark.parametrize(("name", "payload"), HOSTILE, ids=[h[0] for h in HOSTILE])
async def test_hostile_bodies_get_a_clear_anthropic_error_and_reach_nobody(
        upstream: FakeUpstream, start_proxy: StartProxy, name: str, payload: Any) -> None:
    proxy = await start_proxy(config(upstream, upstreams={"a": {
        "base_url": upstream.url, "api": "anthropic", "api_key": UPSTREAM_KEY, "context_management": "emulate"}}))
    status, body = await post(proxy, payload)
    assert 400 <= status < 500, (status, body)
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    assert body["error"]["message"] and "Traceback" not in body["error"]["message"]
    assert upstream.messages == []


async def test_a_large_agent_body_is_parsed_off_the_loop_and_forwarded_paired(
        upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """A 1.5 MB body with 2,000 messages (offloaded to a worker thread) through a 32k budget."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "start"}]
    for i in range(1_000):
        messages.append({"role": "assistant", "content": [{"type": "tool_use", "id": f"toolu_{i}", "name": "Read",
                                                           "input": {"path": f"/f{i}"}}]})
        messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}",
                                                      "content": "Zürich 東京 🚀 " + words(200, i)}]})
    proxy = await start_proxy(config(upstream, trimmer={"max_tokens": 32_000}))
    payload = {"model": CLAUDE, "max_tokens": 64, "messages": messages}
    assert len(json.dumps(payload)) > 1_000_000
    status, _ = await post(proxy, payload)
    assert status == 200
    sent = upstream.messages[-1].body
    assert recount(sent) <= 32_000 and not pairing_problems(sent["messages"])
    assert sent["messages"][0] == {"role": "user", "content": "start"}
    assert sent["messages"][-1] == messages[-1]


async def test_an_untouched_body_reaches_the_upstream_as_the_clients_exact_bytes(
        upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(config(upstream))
    raw = (b'{ "model" : "claude-sonnet-4-5", "max_tokens":64,\n "system":[{"type":"text","text":"Be brief.\\u00e9",'
           b'"cache_control":{"type":"ephemeral"}}], "messages":[{"role":"user","content":[{"type":"text",'
           b'"text":"hi \xf0\x9f\x9a\x80","x_unknown":1.50}]}], "metadata":{"user_id":"u"} }')
    status, _ = await post(proxy, raw)
    assert status == 200
    assert upstream.messages[-1].raw == raw


async def test_models_are_listed_from_an_anthropic_default_upstream(
        upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(config(upstream))
    async with aiohttp.ClientSession() as s, s.get(proxy.url + "/v1/models",
                                                   headers={"x-api-key": "sk-ant-client"}) as r:
        listed = await r.json()
    # the configured model, and the upstream's own list read from {API root}/v1/models
    assert {m["id"] for m in listed["data"]} == {CLAUDE, "upstream-model"}


# --------------------------------------------------------------------------- documents and images, as billed

PDF_PAGES = [words(330, seed=i) for i in range(28)]


def capped(upstream: FakeUpstream) -> dict[str, Any]:
    return config(upstream, tenants=[{"name": "t", "keys": ["sk-ant-client"], "max_context_tokens": 3000}],
                  context_manager={"type": "sliding-window", "params": {"keep_turns": 1000}})


@pytest.mark.parametrize("stream", [False, True])
async def test_a_28_page_pdf_is_counted_by_its_pages_and_never_forwarded_under_a_3000_cap(
        upstream: FakeUpstream, start_proxy: StartProxy, stream: bool) -> None:
    """A 28-page text PDF of ~27 KB bills ~12k tokens of text plus a page image per page: under a 3,000-token
    cap it is refused in the current turn, and trimmed away from history, never forwarded."""
    raw = mf.pdf(PDF_PAGES)
    assert len(raw) < 30_000  # the size the byte estimate counted as one page
    document = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": mf.b64(raw)}}
    proxy = await start_proxy(capped(upstream))
    async with client(proxy) as c:
        with pytest.raises(anthropic.BadRequestError) as caught:
            await c.messages.create(model=CLAUDE, max_tokens=100, stream=stream, messages=[
                {"role": "user", "content": [document, {"type": "text", "text": "Summarise it."}]}])
        assert caught.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
        assert upstream.messages == []
        history = [{"role": "user", "content": [document, {"type": "text", "text": "Summarise it."}]},
                   {"role": "assistant", "content": "It is a quarterly report."},
                   {"role": "user", "content": "Thanks. What is 2 + 2?"}]
        answer = await c.messages.with_raw_response.create(model=CLAUDE, max_tokens=100, messages=history)
    assert int(answer.headers["x-ctxproxy-tokens-in"]) > 28 * 1600  # text plus a page image per page
    assert int(answer.headers["x-ctxproxy-tokens-out"]) <= 3000
    assert "document" not in json.dumps(upstream.messages[-1].body)


async def test_a_tiny_image_is_counted_by_its_size(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """A 1×1 PNG is one token on Claude (width×height/750), not the 1,600 of an image of unknown size."""
    pixel = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": mf.b64(mf.png(1, 1))}}
    by_url = {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}
    proxy = await start_proxy(config(upstream))
    counts = []
    async with client(proxy) as c:
        for content in ([{"type": "text", "text": "hi"}], [pixel, {"type": "text", "text": "hi"}],
                        [by_url, {"type": "text", "text": "hi"}]):
            raw = await c.messages.with_raw_response.create(model=CLAUDE, max_tokens=16,
                                                            messages=[{"role": "user", "content": content}])
            counts.append(int(raw.headers["x-ctxproxy-tokens-in"]))
    assert counts[1] - counts[0] == 1
    assert counts[2] - counts[0] == 1600
