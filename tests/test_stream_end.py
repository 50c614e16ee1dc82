"""Issue 18: a stream's end is the wire's business.

Chat Completions ends with ``data: [DONE]``; the Responses API with a terminal
``response.completed`` / ``response.incomplete`` / ``response.failed`` event and
no ``[DONE]``; Anthropic Messages with ``event: message_stop``; any other relayed
SSE stream when the upstream closes cleanly. For relayed paths the proxy must pass
the upstream's bytes through unchanged and add nothing after a clean end; only a
truncated stream (connection lost, framing error, idle timeout) gets an error
event, in the wire's own shape.

Driven from the outside only: the official ``openai`` and ``anthropic`` clients
(and raw aiohttp for byte-exact checks) against the proxy, with the fake upstream
ending its streams exactly as the providers do (``tests/fake_upstream.py``).
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import anthropic
import openai
import pytest

from tests.conftest import RunningProxy, StartProxy, base_config
from tests.fake_upstream import REPLY, FakeUpstream
from tests.outside import share_model_map

MODEL = "gpt-4o-mini"
CLAUDE = "claude-sonnet-4-5"
TERMINAL = ("response.completed", "response.incomplete", "response.failed")

Event = tuple[str | None, Any]


@pytest.fixture(autouse=True)
def _shared_model_map(monkeypatch: pytest.MonkeyPatch) -> None:
    share_model_map(monkeypatch)  # speed only


async def proxy_for(upstream: FakeUpstream, start_proxy: StartProxy, **server: Any) -> RunningProxy:
    return await start_proxy(base_config(upstream.base_url, server={"idle_timeout": 5, **server}))


def parse_sse(raw: bytes) -> list[Event]:
    """(event name or None, parsed data or the raw data string) for every SSE event in ``raw``."""
    out: list[Event] = []
    for block in raw.replace(b"\r\n", b"\n").split(b"\n\n"):
        name: str | None = None
        data: list[str] = []
        for line in block.decode("utf-8", "replace").split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
        if name is None and not data:
            continue
        text = "\n".join(data)
        try:
            out.append((name, json.loads(text)))
        except ValueError:
            out.append((name, text))
    return out


async def post_stream(url: str, body: dict[str, Any], headers: dict[str, str] | None = None
                      ) -> tuple[int, bytes, BaseException | None]:
    """POST and read the whole streamed body; a cut connection is returned, not raised."""
    hdrs = {"Authorization": "Bearer sk-client", **(headers or {})}
    async with aiohttp.ClientSession() as s, s.post(url, json=body, headers=hdrs) as r:
        chunks: list[bytes] = []
        try:
            async for chunk in r.content.iter_any():
                chunks.append(chunk)
        except aiohttp.ClientError as exc:
            return r.status, b"".join(chunks), exc
        return r.status, b"".join(chunks), None


def openai_client(proxy: RunningProxy) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=proxy.base_url, api_key="sk-client", max_retries=0)


def anthropic_client(proxy: RunningProxy) -> anthropic.AsyncAnthropic:
    # the SDK appends /v1/messages itself
    return anthropic.AsyncAnthropic(base_url=proxy.url, api_key="sk-ant-client", max_retries=0)


ANTHROPIC_BODY: dict[str, Any] = {"model": CLAUDE, "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}


# --------------------------------------------------------------------------- Chat Completions (control)


async def test_chat_completions_stream_still_ends_with_done_and_nothing_after(
    upstream: FakeUpstream, start_proxy: StartProxy
) -> None:
    """Issue 18 control: the Chat Completions wire keeps ending with data: [DONE] and nothing after it."""
    proxy = await proxy_for(upstream, start_proxy)
    status, raw, cut = await post_stream(proxy.base_url + "/chat/completions", {
        "model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]})
    assert (status, cut) == (200, None)
    assert raw.endswith(b"data: [DONE]\n\n")
    assert not any(isinstance(d, dict) and "error" in d for _, d in parse_sse(raw))


# --------------------------------------------------------------------------- Responses API


@pytest.mark.parametrize("end", TERMINAL)
async def test_responses_stream_with_the_openai_client_completes(
    upstream: FakeUpstream, start_proxy: StartProxy, end: str
) -> None:
    """Issue 18: client.responses.create(stream=True) through the relay ends at the terminal event, no error."""
    upstream.responses_end = end
    proxy = await proxy_for(upstream, start_proxy)
    async with openai_client(proxy) as client:
        stream = await client.responses.create(model=MODEL, input="hi", stream=True)
        events = [event async for event in stream]
    assert [e.type for e in events][-1] == end
    text = "".join(getattr(e, "delta", "") for e in events if e.type == "response.output_text.delta")
    assert text == REPLY
    assert len(upstream.responses) == 1


async def test_responses_stream_bytes_pass_through_unchanged(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """Issue 18: a relayed Responses stream reaches the client byte for byte, with nothing after response.completed."""
    proxy = await proxy_for(upstream, start_proxy)
    async with openai_client(proxy) as client, client.responses.with_streaming_response.create(
        model=MODEL, input="hi", stream=True
    ) as response:
        raw = b"".join([chunk async for chunk in response.iter_bytes()])
    assert parse_sse(upstream.sent)[-1][0] == "response.completed"  # as OpenAI ends it: no [DONE]
    assert b"[DONE]" not in upstream.sent
    assert raw == upstream.sent


async def test_truncated_responses_stream_surfaces_as_an_error_in_the_sdk(
    upstream: FakeUpstream, start_proxy: StartProxy
) -> None:
    """Issue 18 (passes today): a Responses stream cut mid-way never looks complete to the openai SDK."""
    upstream.wire_mode = "break"
    proxy = await proxy_for(upstream, start_proxy)
    events: list[Any] = []
    async with openai_client(proxy) as client:
        try:
            stream = await client.responses.create(model=MODEL, input="hi", stream=True)
            async for event in stream:
                events.append(event)
        except openai.APIError:
            return  # surfaced as an error: good
    # or, in the wire's own shape, a last event that says so
    assert events and events[-1].type in ("error", "response.failed"), [e.type for e in events]


async def test_truncated_responses_stream_ends_with_an_error_event_in_the_responses_shape(
    upstream: FakeUpstream, start_proxy: StartProxy
) -> None:
    """Issue 18: after a cut, the client gets the upstream's bytes, then one named Responses error event."""
    upstream.wire_mode = "break"
    proxy = await proxy_for(upstream, start_proxy)
    status, raw, _cut = await post_stream(proxy.base_url + "/responses", {"model": MODEL, "input": "hi",
                                                                          "stream": True})
    assert status == 200
    assert raw.startswith(upstream.sent)
    added = parse_sse(raw[len(upstream.sent):])
    assert len(added) == 1, added
    name, data = added[0]
    # OpenAI's Responses error event: event: error, data {"type": "error", "code", "message", ...}
    # (a response.failed event with response.status "failed" is the other shape the wire knows)
    assert name in ("error", "response.failed"), added
    assert isinstance(data, dict) and data.get("type") == name, added


# --------------------------------------------------------------------------- Anthropic Messages


async def test_anthropic_stream_with_the_anthropic_client_gets_the_whole_message(
    upstream: FakeUpstream, start_proxy: StartProxy
) -> None:
    """Issue 18 (passes today: the SDK ignores the appended event): messages.stream through the relay."""
    proxy = await proxy_for(upstream, start_proxy)
    async with anthropic_client(proxy) as client, client.messages.stream(**ANTHROPIC_BODY) as stream:
        message = await stream.get_final_message()
    assert message.content[0].text == REPLY  # type: ignore[union-attr]
    assert message.stop_reason == "end_turn"
    assert len(upstream.messages) == 1
    assert upstream.messages[0].headers["Authorization"] == "Bearer sk-upstream-secret"


async def test_anthropic_stream_bytes_end_with_message_stop(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """Issue 18: client.messages.create(stream=True) sees the upstream's bytes and nothing after message_stop."""
    proxy = await proxy_for(upstream, start_proxy)
    async with anthropic_client(proxy) as client, client.messages.with_streaming_response.create(
        **ANTHROPIC_BODY, stream=True
    ) as response:
        raw = b"".join([chunk async for chunk in response.iter_bytes()])
    assert upstream.sent.endswith(b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
    assert raw == upstream.sent
    assert parse_sse(raw)[-1][0] == "message_stop"


async def test_truncated_anthropic_stream_raises_in_the_anthropic_client(
    upstream: FakeUpstream, start_proxy: StartProxy
) -> None:
    """Issue 18: a cut Anthropic stream ends with event: error ({"type": "error", "error": {...}}); the SDK raises."""
    upstream.wire_mode = "break"
    proxy = await proxy_for(upstream, start_proxy)
    async with anthropic_client(proxy) as client:
        with pytest.raises(anthropic.APIError):
            stream = await client.messages.create(**ANTHROPIC_BODY, stream=True)
            async for _event in stream:
                pass
    status, raw, _cut = await post_stream(proxy.url + "/v1/messages", {**ANTHROPIC_BODY, "stream": True},
                                          {"anthropic-version": "2023-06-01"})
    assert status == 200
    name, data = parse_sse(raw)[-1]
    assert name == "error"
    assert isinstance(data, dict) and data.get("type") == "error" and isinstance(data.get("error"), dict)


# --------------------------------------------------------------------------- unknown relayed SSE


async def test_unknown_relayed_sse_stream_ends_on_clean_close(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """Issue 18: an unknown relayed SSE path ends when the upstream closes cleanly: bytes unchanged, nothing added."""
    proxy = await proxy_for(upstream, start_proxy)
    status, raw, cut = await post_stream(proxy.base_url + "/sse-clean-close", {"job": 1})
    assert (status, cut) == (200, None)
    assert upstream.sent and raw == upstream.sent


async def test_truncated_unknown_relayed_sse_stream_still_surfaces_an_error(
    upstream: FakeUpstream, start_proxy: StartProxy
) -> None:
    """Issue 18 (passes today): an unknown relayed SSE stream cut mid-way is never presented as complete."""
    upstream.wire_mode = "break"
    proxy = await proxy_for(upstream, start_proxy)
    status, raw, cut = await post_stream(proxy.base_url + "/sse-clean-close", {"job": 1})
    assert status == 200
    assert raw.startswith(upstream.sent)
    added = parse_sse(raw[len(upstream.sent):])
    # either an error event after the upstream's bytes, or the client's connection is cut too
    assert cut is not None or any(isinstance(d, dict) and ("error" in d or d.get("type") == "error")
                                  for _, d in added), added
