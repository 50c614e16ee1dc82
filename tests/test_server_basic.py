"""The server on the wire: the official openai client and raw aiohttp against the proxy and a real fake upstream."""

from __future__ import annotations

import json
import re
from typing import Any

import aiohttp
import openai
import pytest
from yarl import URL

from tests import media_files as mf
from tests.conftest import base_config
from tests.fake_upstream import REPLY, USAGE, FakeUpstream

MODEL = "gpt-4o-mini"
MESSAGES = [
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "Say hello to Ada."},
]




def client(proxy: Any, key: str = "sk-client-key", **kw: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=proxy.base_url, api_key=key, **kw)


async def post_raw(url: str, data: bytes, headers: dict[str, str] | None = None) -> tuple[int, Any, bytes]:
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    async with aiohttp.ClientSession() as s, s.post(url, data=data, headers=hdrs) as r:
        return r.status, r.headers, await r.read()


def sent_headers(rec: Any) -> dict[str, str]:
    """What the upstream received, by lower-case name."""
    return {k.lower(): v for k, v in rec.headers.items()}


def turns(n: int, words: int = 200) -> list[dict[str, Any]]:
    """A plain n-turn conversation (each message ~`words` words) ending with a user message."""
    out: list[dict[str, Any]] = [{"role": "system", "content": "You are a planning assistant."}]
    for i in range(n):
        out.append({"role": "user", "content": f"Turn {i}: " + " ".join(f"item{i}-{j}" for j in range(words))})
        out.append({"role": "assistant", "content": f"Answer {i}: " + "noted " * words})
    out.append({"role": "user", "content": "And now the final question."})
    return out


# --- answers arrive intact -----------------------------------------------------------------------


async def test_non_streaming_answer_intact(upstream: FakeUpstream, start_proxy: Any) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    async with client(proxy) as c:
        out = await c.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert out.choices[0].message.content == REPLY
    assert out.choices[0].finish_reason == "stop"
    assert out.usage is not None
    assert out.usage.prompt_tokens == USAGE["prompt_tokens"]
    assert out.usage.completion_tokens == USAGE["completion_tokens"]
    assert out.usage.total_tokens == USAGE["total_tokens"]
    assert out.usage.prompt_tokens_details is not None
    assert out.usage.prompt_tokens_details.cached_tokens == 4
    assert len(upstream.chat) == 1


async def test_streaming_answer_intact_with_usage(upstream: FakeUpstream, start_proxy: Any) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    async with client(proxy) as c:
        stream = await c.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                                 stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == REPLY
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == ["stop"]
    usage = [ch.usage for ch in chunks if ch.usage is not None]
    assert len(usage) == 1
    assert usage[0].prompt_tokens == 10 and usage[0].completion_tokens == 12
    assert usage[0].prompt_tokens_details is not None and usage[0].prompt_tokens_details.cached_tokens == 4
    assert upstream.chat[-1].body["stream_options"] == {"include_usage": True}


async def test_sse_keepalive_comments_and_headers_relayed(upstream: FakeUpstream, start_proxy: Any) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    body = json.dumps({"model": MODEL, "messages": MESSAGES, "stream": True}).encode()
    status, headers, raw = await post_raw(proxy.url + "/v1/chat/completions", body)
    assert status == 200
    assert headers["Content-Type"].startswith("text/event-stream")
    assert headers["Cache-Control"] == "no-cache"
    assert headers["X-Accel-Buffering"] == "no"
    assert b"\n: keep-alive\n\n" in raw
    assert raw.endswith(b"data: [DONE]\n\n")
    assert raw.count(b"data: [DONE]") == 1


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/chat/completions"])
async def test_both_chat_paths(upstream: FakeUpstream, start_proxy: Any, path: str) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    status, _, raw = await post_raw(proxy.url + path, json.dumps({"model": MODEL, "messages": MESSAGES}).encode())
    assert status == 200
    assert json.loads(raw)["choices"][0]["message"]["content"] == REPLY
    assert upstream.chat[-1].path == "/v1/chat/completions"


async def test_openai_client_without_v1_prefix(upstream: FakeUpstream, start_proxy: Any) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    async with openai.AsyncOpenAI(base_url=proxy.url, api_key="k") as c:
        out = await c.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert out.choices[0].message.content == REPLY


# --- report headers and request ids ---------------------------------------------------------------


async def test_report_headers(upstream: FakeUpstream, start_proxy: Any) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    async with client(proxy) as c:
        raw = await c.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES)
    h = raw.headers
    assert int(h["x-ctxproxy-tokens-in"]) > 0
    assert h["x-ctxproxy-tokens-out"] == h["x-ctxproxy-tokens-in"]  # nothing removed under budget
    assert h["x-ctxproxy-summary"] == "none"
    assert h["x-ctxproxy-repairs"] == "0"
    assert float(h["x-ctxproxy-overhead-ms"]) >= 0
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", h["x-request-id"])
    assert "x-ctxproxy-warning" not in h
    assert raw.parse().choices[0].message.content == REPLY


async def test_report_headers_on_stream(upstream: FakeUpstream, start_proxy: Any) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    async with client(proxy) as c:
        raw = await c.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, stream=True)
        chunks = [ch async for ch in raw.parse()]
    assert chunks
    for name in ("tokens-in", "tokens-out", "summary", "repairs", "overhead-ms"):
        assert f"x-ctxproxy-{name}" in raw.headers
    assert raw.headers["x-request-id"] == sent_headers(upstream.chat[-1])["x-request-id"]


async def test_request_id_given_is_kept_and_sent_upstream(upstream: FakeUpstream, start_proxy: Any) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    async with client(proxy) as c:
        raw = await c.chat.completions.with_raw_response.create(
            model=MODEL, messages=MESSAGES, extra_headers={"X-Request-Id": "req-Ada_42.7:x"})
    assert raw.headers["x-request-id"] == "req-Ada_42.7:x"
    assert sent_headers(upstream.chat[-1])["x-request-id"] == "req-Ada_42.7:x"


async def test_request_id_generated_and_sent_upstream(upstream: FakeUpstream, start_proxy: Any) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    ids = []
    async with client(proxy) as c:
        for _ in range(2):
            raw = await c.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES)
            ids.append(raw.headers["x-request-id"])
    assert ids[0] != ids[1]
    assert [sent_headers(r)["x-request-id"] for r in upstream.chat] == ids


async def test_request_id_invalid_is_replaced(upstream: FakeUpstream, start_proxy: Any) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    body = json.dumps({"model": MODEL, "messages": MESSAGES}).encode()
    _, headers, _ = await post_raw(proxy.url + "/v1/chat/completions", body, {"X-Request-Id": "bad id <script>"})
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", headers["x-request-id"])
    assert sent_headers(upstream.chat[-1])["x-request-id"] == headers["x-request-id"]


# --- forwarded untouched ---------------------------------------------------------------------------


async def test_under_budget_forwarded_byte_identical(upstream: FakeUpstream, start_proxy: Any) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    # odd spacing, key order, unicode escapes and unknown keys: any re-serialisation would show
    raw = (b'{ "messages" :[{"role":"system","content":"Be brief.\\u00e9","cache_control":{"type":"ephemeral"}},\n'
           b'  {"role": "user", "name": "ada", "content": "Hi \xc3\xa9t\xc3\xa9"},'
           b'{"role":"assistant","content":null,"refusal":null,"reasoning_content":"hmm","tool_calls":'
           b'[{"id":"call_1","type":"function","function":{"name":"lookup","arguments":"{\\"q\\": 1}"}}]},'
           b'{"role":"tool","tool_call_id":"call_1","content":"42"}],\n'
           b'  "model":"gpt-4o-mini","temperature":0.20, "seed": 7 , "x_vendor_field": {"a": [1, 2.50]}}')
    status, _, _ = await post_raw(proxy.url + "/v1/chat/completions", raw)
    assert status == 200
    assert upstream.chat[-1].raw == raw


async def test_other_request_fields_forwarded_untouched(upstream: FakeUpstream, start_proxy: Any) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    tools = [{"type": "function", "function": {
        "name": "read_file", "description": "Read a file", "strict": True,
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"],
                       "additionalProperties": False}}}]
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}}}
    async with client(proxy) as c:
        await c.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=tools, tool_choice="auto", parallel_tool_calls=False,
            response_format=response_format, temperature=0.3, max_tokens=77, user="u-1",
            metadata={"k": "v"}, extra_body={"unknown_vendor_key": {"nested": [1, "two", None]}, "top_k": 5},
        )
    body = upstream.chat[-1].body
    assert body["tools"] == tools
    assert body["tool_choice"] == "auto"
    assert body["parallel_tool_calls"] is False
    assert body["response_format"] == response_format
    assert body["temperature"] == 0.3
    assert body["max_tokens"] == 77
    assert body["user"] == "u-1"
    assert body["metadata"] == {"k": "v"}
    assert body["unknown_vendor_key"] == {"nested": [1, "two", None]}
    assert body["top_k"] == 5
    assert body["messages"] == MESSAGES


async def test_changed_payload_keeps_other_fields(upstream: FakeUpstream, start_proxy: Any) -> None:
    """Even when the history is cut, only messages change: every other field is forwarded as sent."""
    cfg = base_config(upstream.base_url, models=[{"name": "small", "context_window": 4000, "max_output_tokens": 500}],
                      context_manager="sliding-window")
    proxy = await start_proxy(cfg)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    async with client(proxy) as c:
        raw = await c.chat.completions.with_raw_response.create(
            model="small", messages=turns(20), tools=tools, temperature=0.1,
            extra_body={"unknown_vendor_key": [1, 2]})
    assert int(raw.headers["x-ctxproxy-tokens-out"]) < int(raw.headers["x-ctxproxy-tokens-in"])
    body = upstream.chat[-1].body
    assert body["tools"] == tools and body["temperature"] == 0.1 and body["unknown_vendor_key"] == [1, 2]
    assert body["model"] == "small"
    assert len(body["messages"]) < len(turns(20))


# --- models, relays, health --------------------------------------------------------------------------


async def test_models_lists_configured_and_upstream(upstream: FakeUpstream, start_proxy: Any) -> None:
    cfg = base_config(upstream.base_url, models=[
        {"name": "gpt-4o-mini", "context_window": 128000}, {"name": "my-alias", "model": "gpt-4o"}])
    proxy = await start_proxy(cfg)
    async with client(proxy) as c:
        page = await c.models.list()
        ids = [m.id async for m in page]
    assert ids[:2] == ["gpt-4o-mini", "my-alias"]
    assert "upstream-model" in ids
    assert len(ids) == len(set(ids))


async def test_relay_post_embeddings_untouched(upstream: FakeUpstream, start_proxy: Any) -> None:
    cfg = base_config(upstream.base_url)
    cfg["upstreams"]["fake"].pop("api_key")
    proxy = await start_proxy(cfg)
    raw = b'{"model": "text-embedding-3-small",  "input": ["a", "b"], "x": 1.50}'
    status, headers, out = await post_raw(proxy.url + "/v1/embeddings", raw,
                                          {"Authorization": "Bearer sk-client", "X-Custom": "yes"})
    assert status == 200
    got = upstream.other[-1]
    assert got.path == "/v1/embeddings"
    assert got.raw == raw
    assert got.headers["X-Custom"] == "yes"
    assert got.headers["Authorization"] == "Bearer sk-client"
    assert json.loads(out) == {"object": "list", "path": "/v1/embeddings", "echo": raw.decode()}
    assert headers["Content-Type"].startswith("application/json")


async def test_relay_openai_client_embeddings(upstream: FakeUpstream, start_proxy: Any) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    async with client(proxy) as c:
        raw = await c.embeddings.with_raw_response.create(model="text-embedding-3-small", input="hi")
    assert raw.status_code == 200
    assert json.loads(upstream.other[-1].raw)["input"] == "hi"
    assert upstream.other[-1].headers["Authorization"] == "Bearer sk-upstream-secret"


async def test_relay_get_with_query_untouched(upstream: FakeUpstream, start_proxy: Any) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    async with aiohttp.ClientSession() as s, s.get(proxy.url + "/v1/files?x=1&purpose=fine-tune") as r:
        assert r.status == 200
        out = await r.json()
    assert upstream.other[-1].path == "/v1/files?x=1&purpose=fine-tune"
    assert out["path"] == "/v1/files?x=1&purpose=fine-tune"
    assert upstream.other[-1].raw == b""


async def test_relay_encoded_query_delimiters_untouched(upstream: FakeUpstream, start_proxy: Any) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    path_qs = "/v1/files?q=a%26b&n=1%2B1&after=file-1"
    async with aiohttp.ClientSession() as s, s.get(URL(proxy.url + path_qs, encoded=True)) as r:
        assert r.status == 200
    assert upstream.other[-1].path == path_qs


async def test_relay_encoded_slash_in_path_untouched(upstream: FakeUpstream, start_proxy: Any) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    path = "/v1/files/file-a%2Fb/content"
    async with aiohttp.ClientSession() as s, s.get(URL(proxy.url + path, encoded=True)) as r:
        assert r.status == 200
    assert upstream.other[-1].path == path


async def test_relay_streaming_path(upstream: FakeUpstream, start_proxy: Any) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    async with aiohttp.ClientSession() as s, s.post(proxy.url + "/v1/stream-test", data=b"{}") as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = [line async for line in r.content]
    assert b"".join(events) == b"data: 0\n\ndata: 1\n\ndata: 2\n\ndata: [DONE]\n\n"


async def test_health_and_ready(upstream: FakeUpstream, start_proxy: Any) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    async with aiohttp.ClientSession() as s:
        async with s.get(proxy.url + "/healthz") as r:
            assert r.status == 200
            assert (await r.json())["status"] == "ok"
        async with s.get(proxy.url + "/readyz") as r:
            assert r.status == 200
            assert (await r.json())["status"] == "ready"
    assert not upstream.chat and not upstream.other


# --- auth and forwarded headers ------------------------------------------------------------------------


async def test_client_auth_forwarded_without_upstream_key(upstream: FakeUpstream, start_proxy: Any) -> None:
    cfg = base_config(upstream.base_url)
    cfg["upstreams"]["fake"].pop("api_key")
    proxy = await start_proxy(cfg)
    async with client(proxy, key="sk-client-own-key") as c:
        await c.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert upstream.chat[-1].headers["Authorization"] == "Bearer sk-client-own-key"


async def test_upstream_key_replaces_client_key(upstream: FakeUpstream, start_proxy: Any) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    async with client(proxy, key="sk-client-own-key") as c:
        await c.chat.completions.create(model=MODEL, messages=MESSAGES,
                                        extra_headers={"api-key": "sk-client-az", "x-api-key": "sk-client-x"})
    sent = upstream.chat[-1].headers
    assert sent["Authorization"] == "Bearer sk-upstream-secret"
    assert "sk-client" not in json.dumps(sent)
    lower = {k.lower() for k in sent}
    assert "api-key" not in lower and "x-api-key" not in lower


async def test_hop_by_hop_and_proxy_headers_not_forwarded(upstream: FakeUpstream, start_proxy: Any) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    body = json.dumps({"model": MODEL, "messages": MESSAGES}).encode()
    status, _, _ = await post_raw(proxy.url + "/v1/chat/completions", body, {
        "Proxy-Authorization": "Basic c2VjcmV0", "Keep-Alive": "timeout=5", "TE": "trailers",
        "x-ctxproxy-debug": "1", "X-Ctxproxy-Context-Manager": "stack", "X-Kept": "kept",
    })
    assert status == 200
    lower = sent_headers(upstream.chat[-1])
    for name in ("proxy-authorization", "keep-alive", "te", "x-ctxproxy-debug", "x-ctxproxy-context-manager"):
        assert name not in lower, name
    assert lower["x-kept"] == "kept"


async def test_connection_listed_headers_not_forwarded(upstream: FakeUpstream, start_proxy: Any) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    body = json.dumps({"model": MODEL, "messages": MESSAGES}).encode()
    status, _, _ = await post_raw(proxy.url + "/v1/chat/completions", body, {
        "Connection": "keep-alive, X-Hop-Secret", "X-Hop-Secret": "do-not-forward", "X-Kept": "kept"})
    assert status == 200
    lower = sent_headers(upstream.chat[-1])
    assert lower["x-kept"] == "kept"
    assert "x-hop-secret" not in lower


# --- per-request override -----------------------------------------------------------------------------


def _small_model_config(upstream: FakeUpstream) -> dict[str, Any]:
    return base_config(upstream.base_url, models=[{"name": "small", "context_window": 6000, "max_output_tokens": 500}])


def _user_turns(messages: list[dict[str, Any]]) -> int:
    return sum(1 for m in messages if m["role"] == "user")


async def test_override_sliding_window_applied(upstream: FakeUpstream, start_proxy: Any) -> None:
    proxy = await start_proxy(_small_model_config(upstream))
    convo = turns(16, words=60)
    async with client(proxy) as c:
        base = await c.chat.completions.with_raw_response.create(model="small", messages=convo)
        over = await c.chat.completions.with_raw_response.create(
            model="small", messages=convo, extra_headers={"x-ctxproxy-context-manager": "sliding-window"})
    # the default (summarising) calls the summariser; the override drops turns instead
    assert base.headers["x-ctxproxy-summary"] == "waited"
    assert upstream.summaries  # in one or more chunks: the small model's window is the summariser's too
    assert over.headers["x-ctxproxy-summary"] == "none"
    assert "x-ctxproxy-warning" not in over.headers
    sent = upstream.chat[-1].body["messages"]
    assert not any("Conversation summary" in str(m.get("content")) for m in sent)
    assert _user_turns(sent) <= 10 + 5 - 1 + 1  # keep_turns 10 (moving 5 at a time) + the current turn
    assert sent[0] == convo[0] and sent[-1] == convo[-1]
    assert sent[1:] == convo[len(convo) - len(sent) + 1:]  # system band + a contiguous tail
    assert int(over.headers["x-ctxproxy-tokens-out"]) < int(over.headers["x-ctxproxy-tokens-in"])


async def test_override_json_binding_applied(upstream: FakeUpstream, start_proxy: Any) -> None:
    proxy = await start_proxy(_small_model_config(upstream))
    convo = turns(16, words=60)
    async with client(proxy) as c:
        raw = await c.chat.completions.with_raw_response.create(
            model="small", messages=convo,
            extra_headers={"x-ctxproxy-context-manager": '{"type": "sliding-window", "params": {"keep_turns": 2}}'})
    assert "x-ctxproxy-warning" not in raw.headers
    assert _user_turns(upstream.chat[-1].body["messages"]) <= 3
    assert not upstream.summaries


@pytest.mark.parametrize("value", ["{bad json", "42", "nonexistent", '{"type": "stack", "ref": "os:path"}'])
async def test_malformed_override_ignored_with_warning(upstream: FakeUpstream, start_proxy: Any, value: str) -> None:
    proxy = await start_proxy(_small_model_config(upstream))
    async with client(proxy) as c:
        raw = await c.chat.completions.with_raw_response.create(
            model="small", messages=MESSAGES, extra_headers={"x-ctxproxy-context-manager": value})
    assert raw.status_code == 200
    warning = raw.headers["x-ctxproxy-warning"]
    assert warning.startswith("x-ctxproxy-context-manager ignored")
    assert raw.parse().choices[0].message.content == REPLY
    assert upstream.chat[-1].body["messages"] == MESSAGES


async def test_malformed_override_falls_back_to_default_policy(upstream: FakeUpstream, start_proxy: Any) -> None:
    """Ignored means the default applies: over budget, summarising runs as without any header."""
    proxy = await start_proxy(_small_model_config(upstream))
    async with client(proxy) as c:
        raw = await c.chat.completions.with_raw_response.create(
            model="small", messages=turns(16, words=60), extra_headers={"x-ctxproxy-context-manager": "{bad json"})
    assert "x-ctxproxy-warning" in raw.headers
    assert raw.headers["x-ctxproxy-summary"] == "waited"
    assert upstream.summaries


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_media_are_counted_as_billed(upstream: FakeUpstream, start_proxy: Any, stream: bool) -> None:
    """Chat Completions follows OpenAI's formulas: an image by its tiles, a PDF file by its text and pages (a
    28-page PDF of ~27 KB is refused under a 3,000-token cap, not forwarded as one page)."""
    from tests.helpers import words
    from tests.outside import post

    proxy = await start_proxy(base_config(upstream.base_url, tenants=[
        {"name": "t", "keys": ["sk-client"], "max_context_tokens": 3000}]))
    counts = []
    for image in (None, mf.png(1, 1), mf.gif(4000, 3000)):
        content: list[dict[str, Any]] = [{"type": "text", "text": "hi"}]
        if image is not None:
            content.append({"type": "image_url", "image_url": {"url": "data:image/png;base64," + mf.b64(image)}})
        status, headers, _ = await post(proxy, {"model": "gpt-4o-mini", "messages": [
            {"role": "user", "content": content}], "stream": stream})
        assert status == 200
        counts.append(int(headers["x-ctxproxy-tokens-in"]))
    assert (counts[1] - counts[0], counts[2] - counts[0]) == (85 + 170, 765)
    pdf = mf.pdf([words(330, seed=i) for i in range(28)])
    assert len(pdf) < 30_000
    part = {"type": "file", "file": {"filename": "r.pdf", "file_data": "data:application/pdf;base64," + mf.b64(pdf)}}
    sent = len(upstream.chat)
    status, _, body = await post(proxy, {"model": "gpt-4o-mini", "stream": stream, "messages": [
        {"role": "user", "content": [part, {"type": "text", "text": "Summarise it."}]}]})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert len(upstream.chat) == sent
