"""A `provider: litellm` model route: litellm.acompletion behind the proxy, its HTTP mocked with respx.

respx stands in for the provider (Anthropic's Messages API) at litellm's HTTP seam; the proxy, the
pipeline and litellm's translation back to OpenAI's shapes run for real. litellm is switched to its
httpx transport so respx can see its calls.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import httpx
import pytest

respx = pytest.importorskip("respx")
# litellm's own pydantic models warn about a TypedDict qualifier at first use; not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore:.*ReadOnly.*:UserWarning")

ANTHROPIC = "https://api.anthropic.com/v1/messages"
MESSAGE = {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-sonnet-4-5",
           "content": [{"type": "text", "text": "Hello from Claude"}], "stop_reason": "end_turn",
           "usage": {"input_tokens": 12, "output_tokens": 5}}


def _sse(events: list[tuple[str, dict[str, Any]]]) -> bytes:
    return b"".join(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode() for name, data in events)


STREAM = _sse([
    ("message_start", {"type": "message_start", "message": {**MESSAGE, "content": [], "stop_reason": None,
                                                             "usage": {"input_tokens": 12, "output_tokens": 1}}}),
    ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
    ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hello"}}),
    ("content_block_delta", {"type": "content_block_delta", "index": 0,
                             "delta": {"type": "text_delta", "text": " from Claude"}}),
    ("content_block_stop", {"type": "content_block_stop", "index": 0}),
    ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 5}}),
    ("message_stop", {"type": "message_stop"}),
])


def config() -> dict[str, Any]:
    return {
        "upstreams": {"anthropic": {"base_url": "https://api.anthropic.com", "api_key": "sk-ant-test"}},
        "models": [{"name": "claude", "provider": "litellm", "upstream": "anthropic",
                    "model": "anthropic/claude-sonnet-4-5", "context_window": 200000, "max_output_tokens": 8192}],
        "cache": {"backend": "memory"},
    }


@pytest.fixture
def litellm_httpx(monkeypatch: pytest.MonkeyPatch) -> None:
    import litellm

    monkeypatch.setattr(litellm, "disable_aiohttp_transport", True)


async def test_litellm_route_non_streaming(start_proxy: Any, litellm_httpx: None) -> None:
    proxy = await start_proxy(config())
    with respx.mock(assert_all_called=True) as mock:
        provider = mock.post(ANTHROPIC).mock(return_value=httpx.Response(200, json=MESSAGE))
        async with aiohttp.ClientSession() as s, s.post(proxy.url + "/v1/chat/completions", json={
                "model": "claude", "max_tokens": 50,
                "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]}) as r:
            assert r.status == 200
            body = await r.json()
            assert r.headers["x-ctxproxy-tokens-in"]
    assert body["object"] == "chat.completion"
    assert body["model"] == "claude"
    assert body["choices"][0]["message"]["content"] == "Hello from Claude"
    assert body["usage"]["prompt_tokens"] == 12 and body["usage"]["completion_tokens"] == 5
    sent = provider.calls.last.request
    assert sent.headers["x-api-key"] == "sk-ant-test"  # the upstream's configured key
    payload = json.loads(sent.content)
    assert payload["model"] == "claude-sonnet-4-5"
    assert payload["messages"] == [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]


async def test_litellm_route_streaming_translated_to_openai_chunks(start_proxy: Any, litellm_httpx: None) -> None:
    proxy = await start_proxy(config())
    with respx.mock(assert_all_called=True) as mock:
        mock.post(ANTHROPIC).mock(return_value=httpx.Response(
            200, content=STREAM, headers={"content-type": "text/event-stream"}))
        async with aiohttp.ClientSession() as s, s.post(proxy.url + "/v1/chat/completions", json={
                "model": "claude", "max_tokens": 50, "stream": True,
                "messages": [{"role": "user", "content": "hi"}]}) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            raw = (await r.read()).decode()
    events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "claude" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    assert text == "Hello from Claude"


async def test_litellm_route_provider_error_is_relayed_in_openai_shape(start_proxy: Any, litellm_httpx: None) -> None:
    proxy = await start_proxy(config())
    with respx.mock(assert_all_called=True) as mock:
        mock.post(ANTHROPIC).mock(return_value=httpx.Response(
            429, json={"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}))
        async with aiohttp.ClientSession() as s, s.post(proxy.url + "/v1/chat/completions", json={
                "model": "claude", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}) as r:
            body = await r.json()
            status = r.status
    assert status == 429
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert "slow down" in body["error"]["message"]


async def test_litellm_failure_mid_stream_ends_with_an_error_event_without_traceback(
        start_proxy: Any, litellm_httpx: None) -> None:
    proxy = await start_proxy(config())
    broken = STREAM.split(b"event: content_block_stop")[0] + b"event: content_block_delta\ndata: {not json\n\n"
    with respx.mock(assert_all_called=True) as mock:
        mock.post(ANTHROPIC).mock(return_value=httpx.Response(
            200, content=broken, headers={"content-type": "text/event-stream"}))
        async with aiohttp.ClientSession() as s, s.post(proxy.url + "/v1/chat/completions", json={
                "model": "claude", "max_tokens": 50, "stream": True,
                "messages": [{"role": "user", "content": "hi"}]}) as r:
            raw = (await r.read()).decode()
    assert "data: [DONE]" not in raw
    assert '"error"' in raw.splitlines()[-2] or '"error"' in raw.strip().splitlines()[-1]
    assert "Traceback" not in raw and "site-packages" not in raw


# --------------------------------------------------------------------------- the Responses wire (issue 13)


async def test_litellm_route_responses_non_streaming_through_aresponses(start_proxy: Any, litellm_httpx: None) -> None:
    """A Responses body on a litellm route goes through litellm.aresponses; the answer is a response object."""
    import openai

    proxy = await start_proxy(config())
    with respx.mock(assert_all_called=True) as mock:
        provider = mock.post(ANTHROPIC).mock(return_value=httpx.Response(200, json=MESSAGE))
        async with openai.AsyncOpenAI(base_url=proxy.base_url, api_key="sk-client", max_retries=0) as client:
            response = await client.responses.create(model="claude", max_output_tokens=50, input=[
                {"role": "user", "content": "hi"},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "42"},
                {"type": "reasoning", "id": "rs_dangling", "summary": []}])
    assert response.output_text == "Hello from Claude" and response.model == "claude"
    payload = json.loads(provider.calls.last.request.content)
    assert payload["model"] == "claude-sonnet-4-5"
    assert [m["role"] for m in payload["messages"]] == ["user", "assistant", "user"]


async def test_litellm_route_responses_streaming_named_events(start_proxy: Any, litellm_httpx: None) -> None:
    import openai

    proxy = await start_proxy(config())
    with respx.mock(assert_all_called=True) as mock:
        mock.post(ANTHROPIC).mock(return_value=httpx.Response(
            200, content=STREAM, headers={"content-type": "text/event-stream"}))
        async with openai.AsyncOpenAI(base_url=proxy.base_url, api_key="sk-client", max_retries=0) as client:
            stream = await client.responses.create(model="claude", input="hi", stream=True)
            events = [event async for event in stream]
    assert events[-1].type == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello from Claude"


async def test_litellm_route_compact_is_answered_by_the_summariser(start_proxy: Any, litellm_httpx: None) -> None:
    """litellm has no compact endpoint: /v1/responses/compact is emulated (the summariser call goes to Anthropic)."""
    import openai

    summary = {**MESSAGE, "content": [{"type": "text", "text": "- the user said hi"}]}
    proxy = await start_proxy(config())
    with respx.mock(assert_all_called=True) as mock:
        mock.post(ANTHROPIC).mock(return_value=httpx.Response(200, json=summary))
        async with openai.AsyncOpenAI(base_url=proxy.base_url, api_key="sk-client", max_retries=0) as client:
            compacted = await client.responses.compact(model="claude", input=[{"role": "user", "content": "hi"}])
    assert compacted.object == "response.compaction"
    assert "the user said hi" in compacted.output[-1].content[0].text  # type: ignore[union-attr]


@pytest.mark.parametrize("status", [401, 403])
async def test_a_refused_operator_key_is_a_gateway_error_and_never_echoed(
        start_proxy: Any, litellm_httpx: None, status: int) -> None:
    """Through litellm as on the HTTP path: the proxy's own key refused is a 502, and the key never reaches a client."""
    proxy = await start_proxy(config())
    with respx.mock(assert_all_called=True) as mock:
        mock.post(ANTHROPIC).mock(return_value=httpx.Response(status, json={
            "type": "error", "error": {"type": "authentication_error", "message": "invalid x-api-key sk-ant-test"}}))
        async with aiohttp.ClientSession() as s, s.post(proxy.url + "/v1/chat/completions", json={
                "model": "claude", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}) as r:
            raw = await r.text()
            got = r.status
    assert got == 502 and "upstream_auth_failed" in raw
    assert "sk-ant-test" not in raw


async def test_a_provider_echoing_the_key_in_a_4xx_never_shows_it(start_proxy: Any, litellm_httpx: None) -> None:
    proxy = await start_proxy(config())
    with respx.mock(assert_all_called=True) as mock:
        mock.post(ANTHROPIC).mock(return_value=httpx.Response(400, json={
            "type": "error", "error": {"type": "invalid_request_error", "message": "bad request for key sk-ant-test"}}))
        async with aiohttp.ClientSession() as s, s.post(proxy.url + "/v1/chat/completions", json={
                "model": "claude", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}) as r:
            raw = await r.text()
            got = r.status
    assert got == 400 and "sk-ant-test" not in raw and "[redacted]" in raw
