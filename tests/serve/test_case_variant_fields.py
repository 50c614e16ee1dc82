"""A key that differs from a field the proxy reads only by case is refused, on managed and relayed paths.

Go's encoding/json (behind Ollama, LocalAI, one-api and other gateways) matches object keys
case-insensitively, the last one winning: ``{"model": "allowed", "Model": "gpt-4o"}`` would run gpt-4o,
and ``"Max_Tokens"`` would lift a tenant's output cap, past checks made on the exact keys.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import StartProxy, base_config
from tests.fake_upstream import FakeUpstream
from tests.outside import post, request

HI = [{"role": "user", "content": "hi"}]
TENANT = {"name": "t", "keys": ["sk-t"], "models": ["gpt-4o-mini"], "max_output_tokens": 50}


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"model": "gpt-4o-mini", "Model": "gpt-4o", "messages": HI}),
    ("/v1/chat/completions", {"model": "gpt-4o-mini", "messages": HI, "max_tokens": 50, "MAX_TOKENS": 100000}),
    ("/v1/responses", {"model": "gpt-4o-mini", "input": "hi", "Max_Output_Tokens": 100000}),
    ("/v1/messages", {"model": "gpt-4o-mini", "max_tokens": 50, "messages": HI, "mODEL": "gpt-4o"}),
    ("/v1/embeddings", {"model": "gpt-4o-mini", "Model": "text-embedding-3-large", "input": "hi"}),  # relayed
    ("/v1/embeddings", {"Model": "text-embedding-3-large", "input": "hi"}),  # the only model key, relayed
    # Go folds the long s (U+017F) onto "s" and the Kelvin sign onto "k"
    ("/v1/chat/completions", {"model": "gpt-4o-mini", "messages": HI, "max_tokens": 50, "max_token\u017f": 10**5}),
    ("/v1/chat/completions", {"model": "gpt-4o-mini", "messages": HI, "max_to\u212aens": 10**5}),
    # inside conversation items: content a Go upstream reads that the proxy would never count
    ("/v1/chat/completions", {"model": "gpt-4o-mini", "messages": [
        {"role": "user", "content": "hi", "Content": [{"type": "text", "text": "word " * 5000}]}]}),
    ("/v1/chat/completions", {"model": "gpt-4o-mini", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi", "Text": "word " * 5000}]}]}),
    ("/v1/responses", {"model": "gpt-4o-mini", "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi", "TEXT": "w " * 5000}]}]}),
    ("/v1/messages", {"model": "gpt-4o-mini", "max_tokens": 50, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi", "Text": "word " * 5000}]}]}),
])
async def test_case_variants_of_interpreted_fields_are_refused(
        start_proxy: StartProxy, upstream: FakeUpstream, path: str, body: dict[str, Any]) -> None:
    proxy = await start_proxy(base_config(upstream.base_url, tenants=[TENANT]))
    status, _, answer = await post(proxy, body, path=path, key="sk-t")
    assert status in (400, 404), answer  # refused, or a model outside the list (the relay reads every spelling)
    assert upstream.chat == [] and upstream.other == []


async def test_other_keys_keep_their_case(start_proxy: StartProxy, upstream: FakeUpstream) -> None:
    proxy = await start_proxy(base_config(upstream.base_url, tenants=[TENANT]))
    status, _, answer = await post(proxy, {"model": "gpt-4o-mini", "messages": HI, "X-Custom": 1, "User": "u"},
                                   key="sk-t")
    assert status == 200, answer


@pytest.mark.parametrize(("path", "raw"), [
    ("/v1/chat/completions",
     b'{"model":"gpt-4o-mini","max_tokens":100000,"messages":[{"role":"user","content":"hi"}],"max_tokens":50}'),
    ("/v1/chat/completions", b'{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}],"model":"gpt-4o-mini"}'),
    ("/v1/responses", b'{"model":"gpt-4o-mini","max_output_tokens":9999,"input":"hi","max_output_tokens":50}'),
    ("/v1/messages",
     b'{"model":"gpt-4o-mini","max_tokens":100000,"messages":[{"role":"user","content":"hi"}],"max_tokens":50}'),
    ("/v1/messages/count_tokens",
     b'{"model":"gpt-4o","model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}]}'),
])
async def test_a_repeated_model_or_output_cap_is_refused(
        start_proxy: StartProxy, upstream: FakeUpstream, path: str, raw: bytes) -> None:
    """A JSON decoder keeps a repeated key's last value, as ctxproxy's does; an upstream that keeps the first
    would run the model, or the output limit, the tenant's policy never checked. Refused in the wire's shape,
    nothing forwarded."""
    proxy = await start_proxy(base_config(upstream.base_url, tenants=[TENANT]))
    status, _, answer = await request(proxy, "POST", path, key="sk-t", data=raw,
                                      headers={"Content-Type": "application/json"})
    assert status == 400, answer
    assert b"more than once" in answer  # (Anthropic's error shape carries no code)
    assert upstream.chat == [] and upstream.responses == [] and upstream.messages == [] and upstream.other == []


async def test_a_guarded_name_nested_in_the_body_is_not_a_repeat(start_proxy: StartProxy,
                                                                 upstream: FakeUpstream) -> None:
    """A tool whose parameters include a "model" or "max_tokens" property is an ordinary request."""
    proxy = await start_proxy(base_config(upstream.base_url, tenants=[TENANT]))
    tools = [{"type": "function", "function": {"name": "pick", "parameters": {"type": "object", "properties": {
        "model": {"type": "string"}, "max_tokens": {"type": "integer"}}}}}]
    status, _, answer = await post(proxy, {"model": "gpt-4o-mini", "max_tokens": 50, "messages": HI,
                                           "tools": tools}, key="sk-t")
    assert status == 200, answer
    assert upstream.chat[-1].body["tools"] == tools
