"""A streaming Messages request on a ``provider: litellm`` route to Anthropic's own API (``anthropic/…``).

litellm streams those with code that imports its proxy server (the ``litellm[proxy]`` extra, not installed
here); the import failed after the request had been sent: billed, and answered 502. Now the request is asked for
whole and told to the client as a stream of its events: what the official ``anthropic`` SDK builds from them is
the message a non-streaming request gets. A real fake upstream on 127.0.0.1 speaks Anthropic's API.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import anthropic
import pytest

from proxy.upstream.litellm import _streams_messages
from proxy.wire.messages.stream import message_events
from tests.conftest import StartProxy, base_config
from tests.fake_upstream import FakeUpstream

pytestmark = pytest.mark.filterwarnings("ignore:.*ReadOnly.*:UserWarning")

BLOCKS: list[dict[str, Any]] = [
    {"type": "thinking", "thinking": "The user wants the weather.", "signature": "sig-abc"},
    {"type": "text", "text": "Let me look that up."},
    {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Zürich", "days": [1, 2]}},
]


@pytest.fixture(scope="module")
def told() -> None:
    """Where litellm's proxy extra is installed, litellm streams Anthropic's API itself: not what is tested here."""
    if _streams_messages("anthropic/claude-sonnet-4-5"):
        pytest.skip("litellm can stream Anthropic's Messages API here (its proxy extra is installed)")


def config(url: str) -> dict[str, Any]:
    return base_config(url, models=[{"name": "claude", "upstream": "fake", "provider": "litellm",
                                     "model": "anthropic/claude-sonnet-4-5", "context_window": 200000,
                                     "max_output_tokens": 8192}])


@pytest.mark.usefixtures("told")
async def test_a_stream_litellm_cannot_make_is_the_whole_message_told_as_events(
        start_proxy: StartProxy, upstream: FakeUpstream, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="ctxproxy")
    proxy = await start_proxy(config(upstream.url))  # (litellm adds /v1/messages itself)
    client = anthropic.AsyncAnthropic(base_url=proxy.url, api_key="sk-client", max_retries=0)
    messages: Any = [{"role": "user", "content": "Weather in Zürich?"}]
    upstream.anthropic_script = [BLOCKS, BLOCKS, BLOCKS]
    whole = await client.messages.create(model="claude", max_tokens=500, messages=messages)
    for _ in range(2):
        async with client.messages.stream(model="claude", max_tokens=500, messages=messages) as stream:
            streamed = await stream.get_final_message()
        assert streamed.model_dump(exclude={"id"}) == whole.model_dump(exclude={"id"})
    assert [block.type for block in streamed.content] == ["thinking", "text", "tool_use"]
    assert streamed.stop_reason == "tool_use" and streamed.usage.output_tokens == 12
    assert len(upstream.messages) == 3  # each request sent once, never a second time after a failure
    warned = [r for r in caplog.records if "cannot stream" in r.getMessage()]
    assert len(warned) == 1 and "litellm[proxy]" in warned[0].getMessage()  # once per model


def test_message_events_build_the_message_back() -> None:
    """What a stream consumer accumulates from ``message_events`` is the message, block by block."""
    message = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
               "content": [*BLOCKS, {"type": "redacted_thinking", "data": "opaque"}], "stop_reason": "refusal",
               "stop_sequence": None, "stop_details": {"type": "refusal", "category": "cyber"},
               "container": {"id": "c1", "expires_at": "2026-12-05T00:00:00Z"},
               "usage": {"input_tokens": 30, "output_tokens": 12, "cache_read_input_tokens": 5}}
    events = [json.loads(e.split(b"\ndata: ", 1)[1]) for e in message_events(message)]
    built: dict[str, Any] = {}
    partial: dict[int, str] = {}
    for event in events:
        if event["type"] == "message_start":
            built = event["message"]
        elif event["type"] == "content_block_start":
            built["content"].append(event["content_block"])
        elif event["type"] == "content_block_delta":
            block, delta = built["content"][event["index"]], event["delta"]
            if delta["type"] == "input_json_delta":
                partial[event["index"]] = partial.get(event["index"], "") + delta["partial_json"]
            else:
                field = {"text_delta": "text", "thinking_delta": "thinking", "signature_delta": "signature"}
                key = field[delta["type"]]
                block[key] += delta[key]
        elif event["type"] == "content_block_stop" and event["index"] in partial:
            built["content"][event["index"]]["input"] = json.loads(partial[event["index"]])
        elif event["type"] == "message_delta":
            built.update(event["delta"])
            built["usage"].update(event["usage"])
    assert events[-1] == {"type": "message_stop"}
    assert built == message
    start = json.loads(message_events(message)[0].split(b"\ndata: ", 1)[1])["message"]  # (told at the end)
    assert (start["stop_reason"], start["stop_details"], start["container"]) == (None, None, None)


@pytest.mark.usefixtures("told")
async def test_many_first_streams_at_once_find_once(start_proxy: StartProxy, upstream: FakeUpstream,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """Whether litellm can stream a model is found once (in a thread), however many first requests come at once."""
    caplog.set_level(logging.WARNING, logger="ctxproxy")
    proxy = await start_proxy(config(upstream.url))
    client = anthropic.AsyncAnthropic(base_url=proxy.url, api_key="sk-client", max_retries=0)

    async def one(i: int) -> str:
        async with client.messages.stream(model="claude", max_tokens=10,
                                          messages=[{"role": "user", "content": f"hi {i}"}]) as stream:
            return await stream.get_final_text()

    assert len(set(await asyncio.gather(*(one(i) for i in range(20))))) == 1
    assert len(upstream.messages) == 20
    warned = [r for r in caplog.records if "cannot stream" in r.getMessage()]
    assert len(warned) == 1
