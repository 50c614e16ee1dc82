"""The Responses wire over HTTP (issue 13): the official ``openai`` client against the proxy and a fake upstream.

``client.responses.create`` (streaming and not) and ``client.responses.compact`` are driven
exactly as users drive them; the fake upstream records what it receives, and every
forwarded payload is judged by the independent checkers of ``tests/wire/responses_helpers.py``.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import openai
import pytest

from tests import media_files as mf
from tests.conftest import RunningProxy, StartProxy, base_config
from tests.fake_upstream import REPLY, FakeUpstream
from tests.helpers import words
from tests.outside import metric_total, post, scrape, share_model_map, text_of
from tests.wire.responses_helpers import chat_to_responses, pairing_problems, recount

MODEL = "gpt-4o-mini"
SMALL = "small-model"
WINDOW, MAX_OUT = 8000, 1000
HARD_BUDGET = WINDOW - MAX_OUT - 800
PREFIX = "[ctxproxy compaction summary]"


@pytest.fixture(autouse=True)
def _shared_model_map(monkeypatch: pytest.MonkeyPatch) -> None:
    share_model_map(monkeypatch)  # speed only


def config(upstream: FakeUpstream, **extra: Any) -> dict[str, Any]:
    return base_config(upstream.base_url, models=[
        {"name": MODEL, "context_window": 128000, "max_output_tokens": 16384},
        {"name": SMALL, "model": "upstream-small", "context_window": WINDOW, "max_output_tokens": MAX_OUT},
    ], **extra)


async def start(upstream: FakeUpstream, start_proxy: StartProxy, **extra: Any) -> RunningProxy:
    return await start_proxy(config(upstream, **extra))


def client(proxy: RunningProxy, key: str = "sk-client") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=proxy.base_url, api_key=key, max_retries=0)


def long_conversation(turns: int = 24) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a support agent. " + words(60)}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"question {t}: " + words(40, t)})
        cid = f"call_{t}"
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": "lookup", "arguments": json.dumps({"t": t})}}]})
        messages.append({"role": "tool", "tool_call_id": cid, "content": words(220, t)})
        messages.append({"role": "assistant", "content": f"answer {t}: " + words(50, t)})
    messages.append({"role": "user", "content": "What did we decide?"})
    return chat_to_responses(messages)


# --------------------------------------------------------------------------- create


async def test_create_through_the_pipeline_under_budget_forwards_the_clients_bytes(
    upstream: FakeUpstream, start_proxy: StartProxy
) -> None:
    proxy = await start(upstream, start_proxy)
    raw = ('{"model": "gpt-4o-mini",  "input": [{"role": "developer", "content": "Be terse."}, '
           '{"role": "user", "content": "h\\u00e9llo \u6771\u4eac", "x_unknown": [1, {"a": null}]}], '
           '"store": false, "include": ["reasoning.encrypted_content"]}').encode()
    async with aiohttp.ClientSession() as s, s.post(proxy.base_url + "/responses", data=raw, headers={
            "Authorization": "Bearer sk-client", "Content-Type": "application/json"}) as r:
        assert r.status == 200
        assert r.headers["x-ctxproxy-summary"] == "none" and int(r.headers["x-ctxproxy-tokens-in"]) > 0
    assert upstream.responses[-1].raw == raw
    assert upstream.responses[-1].path == "/v1/responses"
    async with client(proxy) as c:
        response = await c.responses.create(model=MODEL, input="hi", instructions="Be brief.")
    assert response.output_text == REPLY
    assert upstream.responses[-1].body == {"model": MODEL, "input": "hi", "instructions": "Be brief."}


async def test_create_streaming_is_relayed_event_by_event(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    proxy = await start(upstream, start_proxy)
    async with client(proxy) as c:
        stream = await c.responses.create(model=MODEL, input=[{"role": "user", "content": "hi"}], stream=True)
        events = [event async for event in stream]
    assert events[-1].type == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == REPLY
    text = await scrape(proxy)
    assert metric_total(text, "ctxproxy_requests_total", wire="responses", status="200") == 1


async def test_a_failure_after_the_stream_started_raises_in_the_sdk(upstream: FakeUpstream,
                                                                    start_proxy: StartProxy) -> None:
    upstream.wire_mode = "break"
    proxy = await start(upstream, start_proxy)
    async with client(proxy) as c:
        with pytest.raises(openai.APIError):
            stream = await c.responses.create(model=MODEL, input="hi", stream=True)
            async for _event in stream:
                pass


async def test_over_budget_the_history_is_summarised_paired_and_within_budget(
    upstream: FakeUpstream, start_proxy: StartProxy
) -> None:
    proxy = await start(upstream, start_proxy)
    items = long_conversation()
    tools = [{"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}]
    async with client(proxy) as c:
        raw = await c.responses.with_raw_response.create(model=SMALL, input=items, tools=tools)  # type: ignore[arg-type]
        assert raw.headers["x-ctxproxy-summary"] == "waited"
        assert raw.parse().output_text == REPLY
        made = len(upstream.summaries)  # (in chunks: the summariser is the 8k model itself)
        assert made >= 1
        again = await c.responses.with_raw_response.create(model=SMALL, input=items, tools=tools)  # type: ignore[arg-type]
        assert again.headers["x-ctxproxy-summary"] == "reused"
    assert len(upstream.summaries) == made
    for rec in upstream.responses:
        body = rec.body
        assert body["model"] == "upstream-small"
        assert recount(body) <= HARD_BUDGET
        assert not pairing_problems(body["input"])
        assert body["input"][0] == items[0]  # the system band, then the summary
        assert body["input"][1]["role"] == "system" and "Conversation summary" in body["input"][1]["content"]
        assert body["input"][-1] == items[-1]


async def test_bad_input_is_a_clear_400_and_nothing_is_forwarded(upstream: FakeUpstream,
                                                                 start_proxy: StartProxy) -> None:
    proxy = await start(upstream, start_proxy)
    async with client(proxy) as c:
        with pytest.raises(openai.BadRequestError) as info:
            await c.responses.create(model=MODEL, input=[{"role": "user", "content": 5}])  # type: ignore[list-item]
    assert info.value.code == "invalid_content" and info.value.param == "input[0].content"
    for body, param in ((
            {"model": MODEL, "input": 12}, "input"),
            ({"model": MODEL, "input": ["a string where an item belongs"]}, "input[0]"),
            ({"model": MODEL, "input": "hi", "max_output_tokens": "10"}, "max_output_tokens"),
            ({"model": MODEL, "input": [{"type": "function_call", "call_id": "x", "name": "f", "arguments": "{}"},
                                        {"type": "function_call", "call_id": "x", "name": "f", "arguments": "{}"},
                                        {"type": "function_call_output", "call_id": "x", "output": "r"}]}, "input")):
        status, _headers, payload = await post(proxy, body, path="/v1/responses")
        assert status == 400, payload
        assert set(payload["error"]) == {"message", "type", "param", "code"}
        assert (payload["error"]["param"] or "").startswith(param), payload
    assert upstream.responses == []


async def test_hostile_inputs(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """Many items, odd and unknown item types, unicode ids, a reasoning item last, a deeply nested field."""
    proxy = await start(upstream, start_proxy)
    many = [{"role": "user", "content": f"m{i}"} for i in range(4000)]
    status, headers, _ = await post(proxy, {"model": SMALL, "input": many}, path="/v1/responses")
    assert status == 200 and headers["x-ctxproxy-summary"] in ("waited", "reused")
    assert recount(upstream.responses[-1].body) <= HARD_BUDGET
    odd = [{"role": "user", "content": "go"},
           {"type": "function_call", "call_id": "ü-🚀-東", "name": "f", "arguments": "{}"},
           {"type": "function_call_output", "call_id": "ü-🚀-東", "output": "ok"},
           {"type": "totally_new_item", "payload": {"x": [1, 2]}},
           {"type": "reasoning", "id": "rs_last", "summary": []}]
    status, headers, _ = await post(proxy, {"model": MODEL, "input": odd}, path="/v1/responses")
    assert status == 200 and headers["x-ctxproxy-repairs"] == "1"
    assert upstream.responses[-1].body["input"] == odd[:-1]
    nested: Any = "x"
    for _ in range(400):
        nested = [nested]
    status, _h, payload = await post(proxy, {"model": MODEL, "input": [{"role": "user", "content": "a"},
                                                                      {"type": "blob", "v": nested}]},
                                     path="/v1/responses")
    assert status == 400 and "error" in payload


# --------------------------------------------------------------------------- provider-held state, tenants


async def test_previous_response_id_is_forwarded_unchanged_flagged_and_counted(
    upstream: FakeUpstream, start_proxy: StartProxy
) -> None:
    proxy = await start(upstream, start_proxy)
    raw = json.dumps({"model": MODEL, "previous_response_id": "resp_123",
                      "input": [{"type": "function_call_output", "call_id": "held_by_provider", "output": "42"}]}
                     ).encode()
    async with aiohttp.ClientSession() as s, s.post(proxy.base_url + "/responses", data=raw, headers={
            "Authorization": "Bearer sk-client", "Content-Type": "application/json"}) as r:
        assert r.status == 200
        assert "previous_response_id" in r.headers["x-ctxproxy-warning"]
    assert upstream.responses[-1].raw == raw
    text = await scrape(proxy)
    assert metric_total(text, "ctxproxy_unmanaged_requests_total", wire="responses",
                        reason="previous_response_id") == 1


async def test_tenant_caps_and_allow_list_hold_on_responses_also_with_provider_state(
    upstream: FakeUpstream, start_proxy: StartProxy
) -> None:
    proxy = await start(upstream, start_proxy, tenants=[
        {"name": "t", "keys": ["k-t"], "models": [SMALL], "max_output_tokens": 100}])
    async with client(proxy, "k-t") as c:
        await c.responses.create(model=SMALL, input="hi", max_output_tokens=5000)
        await c.responses.create(model=SMALL, input="hi")
        await c.responses.create(model=SMALL, input="hi", previous_response_id="resp_1", max_output_tokens=9000)
        with pytest.raises(openai.NotFoundError):
            await c.responses.create(model=MODEL, input="hi", previous_response_id="resp_1")
    assert [(r.body["max_output_tokens"], r.body["model"]) for r in upstream.responses] == [
        (100, "upstream-small")] * 3
    assert upstream.responses[2].body["previous_response_id"] == "resp_1"
    assert upstream.responses[0].headers["Authorization"] == "Bearer sk-upstream-secret"


async def test_explain_and_the_unprefixed_path(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    proxy = await start(upstream, start_proxy)
    items = long_conversation()
    status, _h, out = await post(proxy, {"model": SMALL, "input": items}, path="/v1/ctxproxy/explain/responses")
    assert status == 200 and out["report"]["wire"] == "responses"
    assert out["report"]["summary"] == "would_create" and recount({"input": out["input"]}) <= HARD_BUDGET
    assert upstream.responses == [] and upstream.summaries == []
    status, headers, _ = await post(proxy, {"model": MODEL, "input": "hi"}, path="/responses")
    assert status == 200 and "x-ctxproxy-tokens-in" in headers
    status, headers, _ = await post(proxy, {"model": MODEL, "input": "hi"}, path="/v1/responses/")
    assert status == 200 and "x-ctxproxy-tokens-in" in headers
    assert len(upstream.responses) == 2


# --------------------------------------------------------------------------- compact


async def test_compact_is_relayed_and_the_compaction_item_is_pinned_later(
    upstream: FakeUpstream, start_proxy: StartProxy
) -> None:
    proxy = await start(upstream, start_proxy)
    items = long_conversation()
    async with client(proxy) as c:
        compacted = await c.responses.compact(model=SMALL, input=items)  # type: ignore[arg-type]
        assert compacted.object == "response.compaction"
        assert compacted.output[-1].type == "compaction"
        assert upstream.compactions[-1].body["model"] == "upstream-small"
        carried = [item.model_dump(exclude_none=True, warnings=False) for item in compacted.output]
        later = [items[0], *carried, *items[1:]]  # the whole old history too: over budget, trimmed around it
        await c.responses.create(model=SMALL, input=later)  # type: ignore[arg-type]
    forwarded = upstream.responses[-1].body["input"]
    assert [e for e in forwarded if e.get("type") == "compaction"] == [carried[-1]]
    assert recount(upstream.responses[-1].body) <= HARD_BUDGET


async def test_compact_is_emulated_when_the_upstream_answers_404(upstream: FakeUpstream,
                                                                 start_proxy: StartProxy) -> None:
    upstream.compact_mode = "404"
    proxy = await start(upstream, start_proxy)
    items = long_conversation()
    async with client(proxy) as c:
        raw = await c.responses.with_raw_response.compact(model=SMALL, input=items)  # type: ignore[arg-type]
        assert raw.headers["x-ctxproxy-compact"] == "emulated" and "404" in raw.headers["x-ctxproxy-warning"]
        compacted = raw.parse()
        assert compacted.object == "response.compaction" and compacted.usage.input_tokens > 0
        users = [e for e in items if e.get("role") == "user"]
        assert len(compacted.output) == len(users) + 1
        summary = compacted.output[-1]
        assert summary.type == "message" and summary.role == "user"  # type: ignore[union-attr]
        text = summary.content[0].text  # type: ignore[union-attr]
        assert text.startswith(PREFIX) and upstream.summary_text in text
        made = len(upstream.summaries)
        assert made >= 1
        await c.responses.compact(model=SMALL, input=items)  # type: ignore[arg-type]
        assert len(upstream.summaries) == made  # the same conversation: the cached summary
        # the compacted history goes on as input: the summary is carried, pinned and forwarded
        carried = [item.model_dump(exclude_none=True, warnings=False) for item in compacted.output]
        history = [items[0], *carried, *long_conversation(10)[1:]]
        await c.responses.create(model=SMALL, input=history)  # type: ignore[arg-type]
    forwarded = upstream.responses[-1].body["input"]
    assert carried[-1] in forwarded
    assert recount(upstream.responses[-1].body) <= HARD_BUDGET and not pairing_problems(forwarded)


async def test_compact_emulate_and_relay_settings(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    proxy = await start(upstream, start_proxy)
    emulating = await start_proxy(config(upstream, upstreams={"fake": {
        "base_url": upstream.base_url, "api_key": "sk-upstream-secret", "responses_compact": "emulate"}}))
    async with client(emulating) as c:
        out = await c.responses.compact(model=SMALL, input="remember: the code is 8842")
        assert out.output[0].type == "message" and out.output[-1].content[0].text.startswith(PREFIX)  # type: ignore[union-attr]
        with pytest.raises(openai.BadRequestError) as info:
            await c.responses.compact(model=SMALL, input="x", previous_response_id="resp_1")
        assert info.value.code == "unsupported_compaction"
    assert upstream.compactions == []
    relaying = await start_proxy(config(upstream, upstreams={"fake": {
        "base_url": upstream.base_url, "api_key": "sk-upstream-secret", "responses_compact": "relay"}}))
    upstream.compact_mode = "404"
    async with client(relaying) as c:
        with pytest.raises(openai.NotFoundError):
            await c.responses.compact(model=SMALL, input="x")
    async with client(proxy) as c:
        with pytest.raises(openai.BadRequestError):
            await c.responses.compact(model=SMALL, input=[{"role": "nobody", "content": "x"}])  # type: ignore[list-item]
    # the 404 relayed; never the emulate one, nor a malformed input (read and counted first, refused here)
    assert len(upstream.compactions) == 1


async def test_compact_when_the_summariser_fails_is_a_502_in_openai_shape(upstream: FakeUpstream,
                                                                          start_proxy: StartProxy) -> None:
    upstream.compact_mode, upstream.summary_mode = "404", "status"
    proxy = await start(upstream, start_proxy)
    status, _headers, payload = await post(proxy, {"model": SMALL, "input": long_conversation(4)},
                                           path="/v1/responses/compact")
    assert status == 502 and payload["error"]["code"] == "summarizer_failed", payload
    assert set(payload["error"]) == {"message", "type", "param", "code"}


def test_ctxproxy_assemble_on_the_responses_wire(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    from proxy.cli import main

    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump({"upstreams": {"u": {"base_url": "http://127.0.0.1:9"}},
                                   "cache": {"backend": "memory"}, "context_manager": "sliding-window",
                                   "models": [{"name": SMALL, "context_window": WINDOW, "max_output_tokens": MAX_OUT}]}))
    req = tmp_path / "request.json"
    items = long_conversation()
    req.write_text(json.dumps({"model": SMALL, "input": items}))
    assert main(["assemble", "--offline", "--wire", "responses", "--config", str(cfg), str(req)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {"input", "report"} and result["report"]["wire"] == "responses"
    assert result["report"]["tokens_after"] == recount({"input": result["input"]}) <= HARD_BUDGET
    assert result["input"][0] == items[0] and result["input"][-1] == items[-1]
    assert not pairing_problems(result["input"])


# --------------------------------------------------------------------------- a tenant's context cap on every path

CAPPED_KEY = "sk-capped-tenant-key"
CAP = 3000


def capped(upstream: FakeUpstream, **extra: Any) -> dict[str, Any]:
    return config(upstream, tenants=[{"name": "capped", "keys": [CAPPED_KEY], "max_context_tokens": CAP}], **extra)


def input_of(tokens: int) -> list[dict[str, Any]]:
    """A short conversation of about ``tokens`` tokens, ending with a user question."""
    return [{"role": "user", "content": "Summarise this log.\n" + text_of(tokens)},
            {"role": "assistant", "content": "It lists failed logins."},
            {"role": "user", "content": "Which accounts?"}]


HELD: dict[str, tuple[dict[str, Any], list[Any]]] = {
    "previous_response_id": ({"previous_response_id": "resp_123"}, []),
    "conversation": ({"conversation": {"id": "conv_123"}}, []),
    "item_reference": ({}, [{"type": "item_reference", "id": "msg_123"}]),
}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("held", sorted(HELD))
async def test_a_tenants_context_cap_holds_when_the_provider_holds_part_of_the_conversation(
    upstream: FakeUpstream, start_proxy: StartProxy, held: str, stream: bool
) -> None:
    """A history the provider holds is forwarded unmanaged, but max_context_tokens is a hard cap on what is
    forwarded: the part ctxproxy can see is counted against it (what the provider holds cannot be) and a body
    over it is refused, not forwarded, as a plain /v1/responses body is."""
    proxy = await start_proxy(capped(upstream))
    fields, extra = HELD[held]
    status, _, payload = await post(proxy, {"model": MODEL, "input": input_of(12_000) + extra, "stream": stream,
                                            **fields}, path="/v1/responses", key=CAPPED_KEY)
    assert status == 400, payload
    error = payload["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "input"
    assert "max_context_tokens" in error["message"] and f"({held}) is not counted" in error["message"]
    assert upstream.responses == []
    # under the cap the same shape is forwarded as sent
    status, _, payload = await post(proxy, {"model": MODEL, "input": input_of(1_000) + extra, **fields},
                                    path="/v1/responses", key=CAPPED_KEY)
    assert status == 200, payload
    assert upstream.responses[-1].body["input"] == input_of(1_000) + extra


@pytest.mark.parametrize("mode", ["relay", "emulate"])
async def test_a_tenants_context_cap_holds_for_compact(upstream: FakeUpstream, start_proxy: StartProxy,
                                                       mode: str) -> None:
    """/responses/compact sends the whole input to a model (the upstream's, or ctxproxy's summariser): the
    tenant's max_context_tokens holds there too, relayed or emulated."""
    proxy = await start_proxy(capped(upstream, upstreams={"fake": {
        "base_url": upstream.base_url, "api_key": "sk-upstream-secret", "responses_compact": mode}}))
    status, _, payload = await post(proxy, {"model": MODEL, "input": input_of(12_000)},
                                    path="/v1/responses/compact", key=CAPPED_KEY)
    assert status == 400, payload
    assert payload["error"]["code"] == "context_length_exceeded" and "max_context_tokens" in payload["error"]["message"]
    assert upstream.compactions == [] and upstream.summaries == []
    status, _, payload = await post(proxy, {"model": MODEL, "input": input_of(1_000)},
                                    path="/v1/responses/compact", key=CAPPED_KEY)
    assert status == 200 and payload["object"] == "response.compaction", payload
    assert len(upstream.compactions if mode == "relay" else upstream.summaries) == 1


# --------------------------------------------------------------------------- files and images, as billed


@pytest.mark.parametrize("stream", [False, True])
async def test_a_28_page_pdf_is_counted_by_its_pages_and_never_forwarded_under_a_3000_cap(
        upstream: FakeUpstream, start_proxy: StartProxy, stream: bool) -> None:
    """input_file: a 28-page text PDF of ~27 KB is its text plus a 765-token page image per page (OpenAI's file
    inputs), not one page by its size: refused in the current turn under a 3,000 cap, trimmed from history."""
    raw = mf.pdf([words(330, seed=i) for i in range(28)])
    assert len(raw) < 30_000
    part = {"type": "input_file", "filename": "report.pdf", "file_data": "data:application/pdf;base64," + mf.b64(raw)}
    proxy = await start(upstream, start_proxy, tenants=[{"name": "t", "keys": ["sk-client"], "max_context_tokens": 3000}],
                        context_manager={"type": "sliding-window", "params": {"keep_turns": 1000}})
    first = {"role": "user", "content": [part, {"type": "input_text", "text": "Summarise it."}]}
    status, _, body = await post(proxy, {"model": MODEL, "input": [first], "stream": stream}, path="/v1/responses")
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert upstream.responses == []
    history = [first, {"role": "assistant", "content": "It is a quarterly report."},
               {"role": "user", "content": "Thanks. What is 2 + 2?"}]
    status, headers, _ = await post(proxy, {"model": MODEL, "input": history}, path="/v1/responses")
    assert status == 200
    assert int(headers["x-ctxproxy-tokens-in"]) > 28 * 765
    assert int(headers["x-ctxproxy-tokens-out"]) <= 3000
    assert "input_file" not in json.dumps(upstream.responses[-1].body)


async def test_images_are_counted_by_their_tiles(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    proxy = await start(upstream, start_proxy)
    counts = []
    for image in (None, mf.png(1, 1), mf.jpeg(2048, 4096)):
        content: list[dict[str, Any]] = [{"type": "input_text", "text": "hi"}]
        if image is not None:
            content.append({"type": "input_image", "image_url": "data:image/png;base64," + mf.b64(image)})
        status, headers, _ = await post(proxy, {"model": MODEL, "input": [{"role": "user", "content": content}]},
                                        path="/v1/responses")
        assert status == 200
        counts.append(int(headers["x-ctxproxy-tokens-in"]))
    assert (counts[1] - counts[0], counts[2] - counts[0]) == (85 + 170, 85 + 170 * 6)
