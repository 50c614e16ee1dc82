"""Hostile and unusual inputs against the restructured proxy: each defect found, reproduced.

Mostly from the outside (``start_proxy`` / ``upstream`` fixtures, the official
``openai`` client, raw aiohttp, small purpose-built upstreams on 127.0.0.1); a few
at the seam where the defect lives (the neutral pairing repair, the summary
store's lock loop). Every test is marked ``xfail(strict=True)``: it fails on
today's code for the reason in its ``reason`` (check with ``--runxfail``); once
the defect is fixed it turns into an error and the mark must go.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from tests.conftest import StartProxy, base_config
from tests.fake_upstream import FakeUpstream, responses_events
from tests.helpers import pairing_problems
from tests.outside import Message, metric_samples, post, request, scrape, share_model_map
from tests.test_summarisation import config as summarising_config
from tests.test_summarisation import conversation

MODEL = "gpt-4o-mini"
SMALL = "small-model"  # tests.test_summarisation: 8k window, keep_turns 4, summariser gpt-4o-mini
TENANT_KEY = "sk-tenant-acme-7f3a"
OVERRIDE = "x-ctxproxy-context-manager"


@pytest.fixture(autouse=True)
def _shared_model_map(monkeypatch: pytest.MonkeyPatch) -> None:
    share_model_map(monkeypatch)  # speed only


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[dict[str, Handler]], Awaitable[str]]]:
    """A purpose-built upstream: ``{"/v1/path": handler}`` on 127.0.0.1, its base URL returned."""
    runners: list[web.AppRunner] = []

    async def start(routes: dict[str, Handler]) -> str:
        app = web.Application()
        for path, handler in routes.items():
            app.router.add_route("*", path, handler)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{port}/v1"

    yield start
    for runner in runners:
        await runner.cleanup()


def chat(messages: list[Any], model: str = MODEL, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": messages, **extra}


# =========================================================================== token encodings


@pytest.mark.parametrize("model", ["davinci", "openai/babbage", "gpt2"])
async def test_a_client_chosen_model_name_never_makes_the_proxy_fetch_an_encoding(
    upstream: FakeUpstream, start_proxy: StartProxy, monkeypatch: pytest.MonkeyPatch, model: str
) -> None:
    import tiktoken.load

    fetched: list[str] = []

    def no_network(url: str) -> bytes:
        fetched.append(url)
        raise OSError(f"network disabled in this test: {url}")

    monkeypatch.setattr(tiktoken.load, "read_file", no_network)
    proxy = await start_proxy(base_config(upstream.base_url))
    status, _, body = await post(proxy, chat([{"role": "user", "content": "hi"}], model=model))
    assert fetched == [], f"the proxy fetched {fetched}"
    assert status == 200, body


# =========================================================================== pairing: the legacy id namespace


async def test_an_unanswered_tool_call_whose_id_starts_with_fn_gets_a_tool_placeholder(
    upstream: FakeUpstream, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    messages = [
        {"role": "user", "content": "Look up my booking and the weather."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_booking", "arguments": "{}"}},
            {"id": "fn:lookup", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "booking ZX1Q"},
        {"role": "user", "content": "And?"},
    ]
    status, headers, body = await post(proxy, chat(messages))
    assert status == 200, body
    forwarded = upstream.chat[-1].body["messages"]
    assert headers["x-ctxproxy-repairs"] == "1"
    assert pairing_problems(forwarded) == [], forwarded
    assert forwarded[3]["role"] == "tool" and forwarded[3]["tool_call_id"] == "fn:lookup", forwarded[3]


CROSSED = {
    "tool-call-answered-by-function": [
        {"role": "user", "content": "Look it up."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "fn:lookup", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
        {"role": "function", "name": "lookup", "content": "found it"},
        {"role": "user", "content": "Thanks, and now?"},
    ],
    "function-call-answered-by-tool": [
        {"role": "user", "content": "Look it up."},
        {"role": "assistant", "content": None, "function_call": {"name": "lookup", "arguments": "{}"}},
        {"role": "tool", "tool_call_id": "fn:lookup", "content": "found it"},
        {"role": "user", "content": "Thanks, and now?"},
    ],
}


@pytest.mark.parametrize("case", list(CROSSED))
async def test_tool_calls_and_legacy_function_calls_never_answer_each_other(
    upstream: FakeUpstream, start_proxy: StartProxy, case: str
) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    status, _, body = await post(proxy, chat(CROSSED[case]))
    if status == 400:  # refusing it is as good as repairing it
        assert body["error"]["code"] in ("unpaired_tool_call", "unpaired_tool_result", "invalid_tool_pairing")
        return
    assert status == 200, body
    forwarded = upstream.chat[-1].body["messages"]
    assert pairing_problems(forwarded) == [], forwarded


@pytest.mark.parametrize("messages", [
    [{"role": "tool", "tool_call_id": "call_9", "content": "stale result"}],
    [{"role": "function", "name": "lookup", "content": "ok"},
     {"role": "tool", "tool_call_id": "call_1", "content": "ok"}],
    [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}],
], ids=["stray-tool", "stray-results", "unanswered-call-only"])
async def test_a_repair_that_leaves_nothing_is_refused_not_forwarded(
    upstream: FakeUpstream, start_proxy: StartProxy, messages: list[Message]
) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    status, _, body = await post(proxy, chat(messages))
    assert status == 400, (status, [r.body["messages"] for r in upstream.chat])
    assert body["error"]["type"] == "invalid_request_error"
    assert upstream.chat == []


# =========================================================================== summary cache keys


def spoken(transcript: str, audio_id: str) -> Message:
    return {"role": "assistant", "content": None, "audio": {"id": audio_id, "transcript": transcript}}


async def test_conversations_differing_only_in_a_spoken_answer_do_not_share_a_summary(
    upstream: FakeUpstream, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(summarising_config(upstream.base_url))

    def with_spoken(transcript: str, audio_id: str) -> list[Message]:
        messages = conversation(40)
        messages[4] = spoken(transcript, audio_id)  # turn 0's answer, long summarised by turn 39
        return messages

    a = with_spoken("Your flight UA0 to JFK is cancelled; rebook before Friday.", "audio_a1")
    b = with_spoken("Your flight UA0 to JFK is confirmed; seat 14C, boarding 07:40.", "audio_b2")
    status, headers, _ = await post(proxy, chat(a, model=SMALL))
    assert (status, headers["x-ctxproxy-summary"]) == (200, "waited")
    assert "is cancelled" in json.dumps(upstream.summaries[-1].body)
    status, headers, _ = await post(proxy, chat(b, model=SMALL))
    assert status == 200
    assert headers["x-ctxproxy-summary"] == "waited", "B was served A's summary (its flight is 'cancelled')"
    assert "is confirmed" in json.dumps(upstream.summaries[-1].body)


# =========================================================================== streams


async def test_a_connection_lost_after_the_terminal_event_adds_nothing_to_a_complete_stream(
    serve: Callable[[dict[str, Handler]], Awaitable[str]], start_proxy: StartProxy
) -> None:
    sent = b"".join(responses_events(MODEL))

    async def responses(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        await resp.write(sent)
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.close()  # the stream is complete; the connection ends without the last chunk
        return resp

    base = await serve({"/v1/responses": responses})
    proxy = await start_proxy(base_config(base, server={"idle_timeout": 5}))
    async with aiohttp.ClientSession() as s, s.post(proxy.base_url + "/responses", json={
            "model": MODEL, "input": "hi", "stream": True}, headers={"Authorization": "Bearer sk-client"}) as r:
        raw = await r.read()
    assert raw == sent, raw[len(sent):]
    client = openai.AsyncOpenAI(base_url=proxy.base_url, api_key="sk-client", max_retries=0)
    async with client:
        stream = await client.responses.create(model=MODEL, input="hi", stream=True)
        events = [event async for event in stream]
    assert events[-1].type == "response.completed"


# =========================================================================== responses the upstream shapes


async def test_the_clients_x_ctxproxy_headers_are_the_proxys_own(
    serve: Callable[[dict[str, Handler]], Awaitable[str]], start_proxy: StartProxy
) -> None:
    spoofed = {"x-ctxproxy-summary": "created", "x-ctxproxy-tokens-out": "1", "x-ctxproxy-warning": "from upstream"}

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("user") == "fail":
            return web.json_response({"error": {"message": "slow down"}}, status=429, headers=spoofed)
        return web.json_response({"id": "chatcmpl-1", "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]},
            headers=spoofed)

    base = await serve({"/v1/chat/completions": completions})
    proxy = await start_proxy(base_config(base))
    for user in ("ok", "fail"):
        async with aiohttp.ClientSession() as s, s.post(proxy.base_url + "/chat/completions", json=chat(
                [{"role": "user", "content": "hi"}], user=user), headers={"Authorization": "Bearer sk-client"}) as r:
            assert r.headers.getall("x-ctxproxy-summary", []) == ["none"], (user, r.headers)
            assert r.headers.getall("x-ctxproxy-tokens-out") != ["1"], (user, r.headers)
            assert "x-ctxproxy-warning" not in r.headers, (user, r.headers)


# =========================================================================== the relay


async def test_the_stored_chat_completions_list_is_relayed_without_tenants(
    upstream: FakeUpstream, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    status, _, raw = await request(proxy, "GET", "/v1/chat/completions?limit=2&model=gpt-4o-mini")
    assert status == 200, raw[:300]
    assert [r.path for r in upstream.other] == ["/v1/chat/completions?limit=2&model=gpt-4o-mini"]


@pytest.mark.parametrize("kind", ["multipart", "urlencoded"])
async def test_a_body_with_two_model_fields_is_held_to_the_tenants_allow_list(
    upstream: FakeUpstream, start_proxy: StartProxy, kind: str
) -> None:
    proxy = await start_proxy(base_config(upstream.base_url, tenants=[
        {"name": "acme", "keys": [TENANT_KEY], "models": ["whisper-1"]}]))
    data: Any
    if kind == "multipart":
        data = aiohttp.FormData()
        data.add_field("model", "whisper-1")
        data.add_field("model", "gpt-4o-transcribe")
        data.add_field("file", b"RIFF\x00\x00\x00\x00WAVEfmt ", filename="a.wav", content_type="audio/wav")
    else:
        data = aiohttp.FormData([("model", "whisper-1"), ("model", "gpt-4o-transcribe")])
    status, _, raw = await request(proxy, "POST", "/v1/audio/transcriptions", key=TENANT_KEY, data=data)
    assert status in (400, 403, 404), raw[:300]
    assert upstream.other == []


# =========================================================================== per-request overrides


@pytest.mark.parametrize("tenants", [False, True], ids=["no-tenants", "tenants"])
async def test_an_override_header_never_imports_a_module(
    upstream: FakeUpstream, start_proxy: StartProxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tenants: bool
) -> None:
    name = f"ctxproxy_probe_{uuid.uuid4().hex}"
    marker = tmp_path / "imported"
    (tmp_path / f"{name}.py").write_text(f"open({str(marker)!r}, 'w').write('side effect')\nclass Plugin: pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    extra: dict[str, Any] = {"tenants": [{"name": "acme", "keys": [TENANT_KEY]}]} if tenants else {}
    proxy = await start_proxy(base_config(upstream.base_url, **extra))
    header = json.dumps({"type": "summarising", "params": {"summarizer": {"ref": f"{name}:Plugin"}}})
    try:
        status, headers, body = await post(proxy, chat([{"role": "user", "content": "hi"}]),
                                           key=TENANT_KEY if tenants else "sk-client", headers={OVERRIDE: header})
        assert status == 200, body
        assert "ignored" in headers.get("x-ctxproxy-warning", "")
        assert not marker.exists(), "the client's override imported a module of its choosing"
        assert name not in sys.modules
    finally:
        sys.modules.pop(name, None)


# =========================================================================== the summariser failing


async def test_an_empty_summariser_answer_is_counted_as_empty(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(summarising_config(upstream.base_url))
    upstream.summary_mode = "empty"
    status, headers, _ = await post(proxy, chat(conversation(40), model=SMALL))
    assert (status, headers["x-ctxproxy-summary"]) == (200, "failed")
    samples = metric_samples(await scrape(proxy), "ctxproxy_summarizer_failures_total")
    reasons = {labels["reason"]: value for labels, value in samples if value > 0}
    assert reasons == {"empty": 1.0}


@pytest.mark.parametrize("answer", [b"<html>upstream gateway page</html>", b'{"choices": [{"message": {"con'])
async def test_a_garbage_summariser_answer_is_reported_like_every_other_failure(
    upstream: FakeUpstream, serve: Callable[[dict[str, Handler]], Awaitable[str]], start_proxy: StartProxy,
    caplog: pytest.LogCaptureFixture, answer: bytes
) -> None:
    async def garbage(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=answer, content_type="application/json")

    summariser = await serve({"/v1/chat/completions": garbage})
    cfg = summarising_config(upstream.base_url)
    cfg["upstreams"]["summariser-gw"] = {"base_url": summariser}
    cfg["models"] = [m if m["name"] != MODEL else {**m, "upstream": "summariser-gw"} for m in cfg["models"]]
    proxy = await start_proxy(cfg)
    caplog.set_level(logging.WARNING, logger="ctxproxy.summaries")
    status, headers, _ = await post(proxy, chat(conversation(40), model=SMALL))
    assert (status, headers["x-ctxproxy-summary"]) == (200, "failed")
    lines = [r.getMessage() for r in caplog.records if "summariser failed" in r.getMessage()]
    assert lines, caplog.text
    assert f"route '{MODEL}'" in lines[0] and "summariser request" in lines[0], lines[0]


async def test_lock_wait_zero_does_not_spin_on_the_cache(upstream: FakeUpstream) -> None:
    from plugins.base import Completion, SummaryScope
    from proxy.serve.state import build_shared
    from proxy.settings import load_config
    from proxy.store.memory import MemoryCache
    from proxy.store.summaries import summary_key

    class Counting(MemoryCache):
        acquires = 0

        async def _try_acquire(self, lock_key: str, token: str, ttl: float) -> bool:
            Counting.acquires += 1
            return await super()._try_acquire(lock_key, token, ttl)

    cfg = load_config(summarising_config(upstream.base_url, summarizer={"lock_wait_seconds": 0}), env={})
    cache = Counting()
    shared = build_shared(cfg, cache=cache)
    scope = SummaryScope("default", "llm/v2/gpt-4o-mini/x")
    chain = ["0" * 32, "1" * 32]
    key = summary_key(scope, chain[1])

    async def never(previous: str | None, turns: Any) -> Completion:  # pragma: no cover - never called
        raise AssertionError("another replica holds the lock")

    try:
        async with cache.lock("lock:" + key, ttl=30, wait=0) as held:  # another replica, alive, summarising
            assert held.acquired
            Counting.acquires = 0
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(shared.summaries.obtain(scope, chain, 2, [[], []], None, never), 0.5)
            assert Counting.acquires < 100, f"{Counting.acquires} lock attempts in 0.5 s"
    finally:
        await shared.close()


# =========================================================================== the neutral pairing repair


def test_repair_of_a_merged_run_without_placeholders_is_paired() -> None:
    from proxy.core.errors import PayloadError
    from proxy.core.items import ASSISTANT, TOOL, USER, Item
    from proxy.core.pairing import check, repair

    class Factory:
        def without_calls(self, item: Item) -> Item | None:
            return Item({"reasoning": item.raw["reasoning"]}, ASSISTANT, source=item.source)

        def placeholder(self, call: Item, call_id: str) -> Item | None:
            return None  # e.g. a hosted tool's call: no result can be made up for it

    items = [Item({}, USER, source=0),
             Item({"reasoning": "r1"}, ASSISTANT, call_ids=("fc_1",), source=1),
             Item({"reasoning": "r2"}, ASSISTANT, call_ids=("ws_2",), source=2),
             Item({}, TOOL, result_id="fc_1", source=3)]
    repaired, _ = repair(items, Factory(), merge_call_runs=True)
    try:
        check(repaired, merge_call_runs=True)
    except PayloadError as exc:
        pytest.fail(f"repair's own output is refused: {exc.code}: {exc} -> {repaired}")


# =========================================================================== keys in the summariser's answer


async def test_an_echoed_upstream_key_never_reaches_a_tenant_through_a_summary(
    upstream: FakeUpstream, serve: Callable[[dict[str, Handler]], Awaitable[str]], start_proxy: StartProxy
) -> None:
    secret = "sk-summariser-gw-9d8c7b6a"

    async def echo(request: web.Request) -> web.Response:
        body = await request.json()
        text = f"- debug: called with {request.headers.get('Authorization')}; user asked about booking ZX0Q"
        return web.json_response({"id": "chatcmpl-s", "object": "chat.completion", "model": body["model"],
                                  "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                               "finish_reason": "stop"}],
                                  "usage": {"prompt_tokens": 900, "completion_tokens": 40}})

    gateway = await serve({"/v1/chat/completions": echo})
    cfg = summarising_config(upstream.base_url, tenants=[{"name": "acme", "keys": [TENANT_KEY]}])
    cfg["upstreams"]["summariser-gw"] = {"base_url": gateway, "api_key": secret}
    cfg["models"] = [m if m["name"] != MODEL else {**m, "upstream": "summariser-gw"} for m in cfg["models"]]
    proxy = await start_proxy(cfg)
    messages = conversation(40)
    status, headers, _ = await post(proxy, chat(messages, model=SMALL), key=TENANT_KEY)
    assert (status, headers["x-ctxproxy-summary"]) == (200, "waited")
    assert secret not in json.dumps(upstream.chat[-1].body), "the summariser's key was forwarded to another provider"
    status, _, explained = await post(proxy, chat(messages, model=SMALL), path="/v1/ctxproxy/explain", key=TENANT_KEY)
    assert status == 200
    assert explained["report"]["summary"] == "reused"
    assert secret not in json.dumps(explained), "explain showed the tenant the operator's summariser key"


# =========================================================================== a stream cut inside a line


def cut_stream(head: bytes) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(head)
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.close()
        return resp

    return handler


CHUNK = (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":0,"model":"gpt-4o-mini",'
         b'"choices":[{"index":0,"delta":{"content":"Hello"},"finish_reason":null}]}\n\n')


@pytest.mark.parametrize("cut", [10, 40, len(CHUNK) - 1], ids=["in-data-prefix", "mid-json", "before-blank-line"])
async def test_an_error_event_after_a_cut_inside_a_line_is_its_own_event(
    serve: Callable[[dict[str, Handler]], Awaitable[str]], start_proxy: StartProxy, cut: int
) -> None:
    base = await serve({"/v1/chat/completions": cut_stream(CHUNK + CHUNK[:cut])})
    proxy = await start_proxy(base_config(base, server={"idle_timeout": 5}))
    client = openai.AsyncOpenAI(base_url=proxy.base_url, api_key="sk-client", max_retries=0)
    async with client:
        stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                      stream=True)
        with pytest.raises(openai.APIError) as err:
            async for _ in stream:
                pass
    assert "closed the stream" in str(err.value)


@pytest.mark.parametrize("disposition", ["name*=UTF-8''model", "name*=utf-8''%6Dodel", 'name="mod\\el"'])
async def test_every_spelling_of_a_multipart_model_field_is_held_to_the_allow_list(
    serve: Callable[[dict[str, Handler]], Awaitable[str]], start_proxy: StartProxy, disposition: str
) -> None:
    used: list[Any] = []

    async def transcriptions(request: web.Request) -> web.Response:
        form = await request.post()
        used.append(form.get("model"))
        return web.json_response({"text": "hello"})

    base = await serve({"/v1/audio/transcriptions": transcriptions})
    proxy = await start_proxy(base_config(base, tenants=[
        {"name": "acme", "keys": [TENANT_KEY], "models": ["whisper-1"]}]))
    boundary = "----ctxproxyBoundary7MA4YWxk"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; {disposition}\r\n\r\ngpt-4o-transcribe\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n"
            f"Content-Type: audio/wav\r\n\r\nRIFF\x00\x00\x00\x00WAVEfmt \r\n--{boundary}--\r\n").encode()
    status, _, raw = await request(proxy, "POST", "/v1/audio/transcriptions", key=TENANT_KEY, data=body,
                                   headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    assert status in (400, 403, 404), (raw[:300], "the upstream used model", used)
    assert used == []


# =========================================================================== explain and the event loop


async def loop_lag_until(done: asyncio.Future[Any], tick: float = 0.005) -> float:
    """The longest the event loop (shared by this test's client and the proxy) was held up while ``done`` ran."""
    loop = asyncio.get_running_loop()
    worst, last = 0.0, loop.time()
    while not done.done():
        await asyncio.sleep(tick)
        now = loop.time()
        worst, last = max(worst, now - last - tick), now
    return worst


async def test_a_large_explain_call_does_not_stall_the_event_loop(upstream: FakeUpstream, start_proxy: StartProxy
                                                                   ) -> None:
    from tests.test_server_nostall import PROMPT_LIMIT, SMALL, huge_body
    from tests.test_server_nostall import post as post_raw

    proxy = await start_proxy(base_config(upstream.base_url))  # a fresh proxy: the big body's counts are cold
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        for _ in range(2):  # warm-up: tokenizer, connection pools
            assert (await post_raw(s, proxy.url + "/v1/chat/completions", SMALL))[0] == 200
        big = asyncio.ensure_future(post_raw(s, proxy.url + "/v1/ctxproxy/explain", huge_body()))
        worst = await loop_lag_until(big)
        status, _, raw = await big
    assert status == 200, raw[:300]
    # the same body on the chat path holds the loop for ~30 ms (tests/test_server_nostall.py)
    assert worst < PROMPT_LIMIT, f"the event loop was held for {1000 * worst:.0f} ms by one explain call"
