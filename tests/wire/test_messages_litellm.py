"""Messages requests on a ``provider: litellm`` route go through litellm's Anthropic-messages interface, after
the pipeline, to any provider. The providers' HTTP is mocked with respx at litellm's seam; the proxy,
the pipeline and litellm's translation run for real; the client is the official ``anthropic`` SDK."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import pytest

from tests.conftest import StartProxy
from tests.helpers import words

respx = pytest.importorskip("respx")
pytestmark = pytest.mark.filterwarnings("ignore:.*ReadOnly.*:UserWarning")

ANTHROPIC = "https://api.anthropic.com/v1/messages"
VLLM = "http://vllm.test/v1/chat/completions"
MESSAGE = {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-sonnet-4-5",
           "content": [{"type": "text", "text": "Hello from Claude"}], "stop_reason": "end_turn",
           "stop_sequence": None, "usage": {"input_tokens": 12, "output_tokens": 5}}
CHAT = {"id": "c1", "object": "chat.completion", "created": 0, "model": "llama",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant",
                                                                      "content": "Hello from Llama"}}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}


def _chat_stream() -> bytes:
    chunks = [{"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "llama",
               "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hello"}, "finish_reason": None}]},
              {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "llama",
               "choices": [{"index": 0, "delta": {"content": " from Llama"}, "finish_reason": "stop"}]}]
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def config(**extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "upstreams": {"anthropic": {"base_url": "https://api.anthropic.com", "api_key": "sk-ant-test"},
                      "vllm": {"base_url": "http://vllm.test/v1", "api_key": "sk-vllm"}},
        "models": [
            {"name": "claude", "provider": "litellm", "upstream": "anthropic", "model": "anthropic/claude-sonnet-4-5",
             "context_window": 200000, "max_output_tokens": 8192},
            {"name": "llama", "provider": "litellm", "upstream": "vllm", "model": "hosted_vllm/llama",
             "context_window": 8000, "max_output_tokens": 1024},
        ],
        "cache": {"backend": "memory"},
    }
    out.update(extra)
    return out


@pytest.fixture
def litellm_httpx(monkeypatch: pytest.MonkeyPatch) -> None:
    import litellm

    monkeypatch.setattr(litellm, "disable_aiohttp_transport", True)


def mock() -> Any:
    router = respx.mock(assert_all_called=False)
    router.route(host="127.0.0.1").pass_through()  # the SDK's own calls to the proxy
    return router


async def test_messages_to_anthropic_through_litellm(start_proxy: StartProxy, litellm_httpx: None) -> None:
    proxy = await start_proxy(config())
    with mock() as m:
        provider = m.post(ANTHROPIC).mock(return_value=httpx.Response(200, json=MESSAGE))
        async with anthropic.AsyncAnthropic(base_url=proxy.url, api_key="sk-client", max_retries=0) as c:
            reply = await c.messages.create(model="claude", max_tokens=50, system="Be brief.",
                                            messages=[{"role": "user", "content": "hi"}])
    assert reply.content[0].text == "Hello from Claude"  # type: ignore[union-attr]
    sent = provider.calls.last.request
    assert sent.headers["x-api-key"] == "sk-ant-test"
    payload = json.loads(sent.content)
    assert payload["model"] == "claude-sonnet-4-5" and payload["messages"] == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("stream", [False, True])
async def test_messages_to_another_provider_through_litellm(
        start_proxy: StartProxy, litellm_httpx: None, stream: bool) -> None:
    """An Anthropic client talks to a chat-completions model: litellm translates both ways, after the pipeline."""
    proxy = await start_proxy(config(context_manager={"type": "sliding-window", "params": {"keep_turns": 2}}))
    messages: list[dict[str, Any]] = []
    for t in range(20):
        messages += [{"role": "user", "content": f"q{t} " + words(400, t)}, {"role": "assistant", "content": f"a{t}"}]
    messages.append({"role": "user", "content": "last question"})
    with mock() as m:
        answer = httpx.Response(200, content=_chat_stream(), headers={"content-type": "text/event-stream"}) \
            if stream else httpx.Response(200, json=CHAT)
        provider = m.post(VLLM).mock(return_value=answer)
        async with anthropic.AsyncAnthropic(base_url=proxy.url, api_key="sk-client", max_retries=0) as c:
            if stream:
                async with c.messages.stream(model="llama", max_tokens=100, messages=messages) as s:  # type: ignore[arg-type]
                    reply = await s.get_final_message()
            else:
                reply = await c.messages.create(model="llama", max_tokens=100, messages=messages)  # type: ignore[arg-type]
    assert reply.content[0].text == "Hello from Llama"  # type: ignore[union-attr]
    sent = json.loads(provider.calls.last.request.content)
    assert sent["model"] == "llama"
    assert provider.calls.last.request.headers["authorization"] == "Bearer sk-vllm"
    assert len(sent["messages"]) < len(messages)  # the pipeline windowed the history first
    assert sent["messages"][-1] == {"role": "user", "content": "last question"}


async def test_provider_errors_come_back_in_anthropics_shape(start_proxy: StartProxy, litellm_httpx: None) -> None:
    proxy = await start_proxy(config())
    with mock() as m:
        m.post(ANTHROPIC).mock(return_value=httpx.Response(
            429, json={"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}))
        async with anthropic.AsyncAnthropic(base_url=proxy.url, api_key="sk-client", max_retries=0) as c:
            with pytest.raises(anthropic.RateLimitError) as caught:
                await c.messages.create(model="claude", max_tokens=50, messages=[{"role": "user", "content": "hi"}])
    body = caught.value.body
    assert isinstance(body, dict) and body["type"] == "error" and body["error"]["type"] == "rate_limit_error"
    assert "slow down" in body["error"]["message"] and "Traceback" not in body["error"]["message"]


async def test_context_management_is_emulated_on_a_litellm_route(start_proxy: StartProxy, litellm_httpx: None) -> None:
    """The provider behind litellm has no context editing: the proxy clears the old tool results itself, sends
    no context_management field, and the answer carries the report Anthropic would have written."""
    from proxy.serve.context_management.edits import CLEARED

    proxy = await start_proxy(config())
    messages: list[dict[str, Any]] = [{"role": "user", "content": "look everything up"}]
    for i in range(4):
        messages.append({"role": "assistant", "content": [{"type": "tool_use", "id": f"toolu_{i}", "name": "Read",
                                                           "input": {"n": i}}]})
        messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}",
                                                      "content": words(200, i)}]})
    edit = {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 100},
            "keep": {"type": "tool_uses", "value": 1}}
    with mock() as m:
        provider = m.post(VLLM).mock(return_value=httpx.Response(200, json=CHAT))
        async with anthropic.AsyncAnthropic(base_url=proxy.url, api_key="sk-client", max_retries=0) as c:
            reply = await c.beta.messages.create(model="llama", max_tokens=100, messages=messages,  # type: ignore[arg-type]
                                                 context_management={"edits": [edit]},  # type: ignore[list-item]
                                                 betas=["context-management-2025-06-27"])
    sent = json.loads(provider.calls.last.request.content)
    assert "context_management" not in sent
    results = [m["content"] for m in sent["messages"] if m["role"] == "tool"]
    assert results[:3] == [CLEARED] * 3 and results[3] == words(200, 3)
    assert reply.context_management is not None
    assert reply.context_management.applied_edits[0].cleared_tool_uses == 3  # type: ignore[union-attr]
