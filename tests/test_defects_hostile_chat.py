"""Hostile inputs on the Chat Completions path, tenant overrides and the ``/v1/*`` relay, from the outside.

Each test drives the proxy over HTTP (the ``start_proxy`` / ``upstream`` fixtures, the real
aiohttp fake upstream) and checks what a client and the upstream see. Every one failed before
its fix:

* an override that switches ``summarising`` to ``sliding-window`` with a large ``cut_step``
  kept every turn verbatim (a window that never moves), though the tenant's policy keeps 3;
* a ``tool_call_id`` (or a ``tool_calls`` id) spelled in the proxy's internal namespace of
  legacy ``function_call`` ids (a NUL prefix) paired a tool result with a legacy call, and the
  invalid pairing was forwarded;
* relayed bodies whose ``model`` a lenient upstream parser reads but orjson does not (a BOM,
  UTF-16, NaN, 1e400, a lone surrogate), or that form parsers read differently (two boundaries,
  two ``Content-Disposition`` headers, two ``name`` parameters), escaped the tenant's model
  allow-list and were relayed with the operator's key;
* ``/v1/ctxproxy%2Fpolicy`` (the proxy's own namespace, spelled with an encoded slash) was relayed.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.conftest import StartProxy, base_config
from tests.fake_upstream import FakeUpstream
from tests.outside import Message, post, request
from tests.test_defects_security import (  # noqa: F401  (_shared_model_map: an autouse fixture)
    MODEL,
    OVERRIDE,
    TENANT_KEY,
    _shared_model_map,
    tenant_config,
    twenty_turns,
)

# the same proxy set-up and conversation as the security defects' (a tenant with a key, the shared model map)


def error_of(payload: Any) -> dict[str, Any]:
    assert isinstance(payload, dict) and set(payload) == {"error"}, payload
    error = payload["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    return dict(error)


# =========================================================================== overrides: cut_step on a type change


POLICY = {"type": "summarising", "params": {"keep_turns": 3}}  # derived threshold; the cap makes it summarise


async def forwarded(upstream: FakeUpstream, start_proxy: StartProxy, override: str | None
                    ) -> tuple[int, int, dict[str, str]]:
    """(tokens out, user messages forwarded, answer headers) for the 20-turn conversation."""
    proxy = await start_proxy(tenant_config(upstream.base_url, context_manager=POLICY, max_context_tokens=6000))
    status, headers, body = await post(proxy, {"model": MODEL, "messages": twenty_turns()}, key=TENANT_KEY,
                                       headers={OVERRIDE: override} if override else {})
    assert status == 200, body
    users = sum(1 for m in upstream.chat[-1].body["messages"] if m["role"] == "user")
    return int(headers["x-ctxproxy-tokens-out"]), users, headers


@pytest.mark.parametrize("override", [
    {"type": "sliding-window", "params": {"cut_step": 1000}},
    {"type": "sliding-window", "params": {"keep_turns": 1, "cut_step": 1000}},
    {"type": "sliding-window", "params": {"keep_turns": 3, "cut_step": 3}},
], ids=["cut_step-1000", "keep-1-cut_step-1000", "cut_step-3"])
async def test_a_switch_to_a_sliding_window_may_not_widen_it_with_cut_step(
    upstream: FakeUpstream, start_proxy: StartProxy, override: dict[str, Any]
) -> None:
    """The policy keeps 3 turns (its own window: at most 3 + 2 - 1); a larger cut_step is ignored with a warning."""
    baseline, base_users, _ = await forwarded(upstream, start_proxy, None)
    tokens, users, headers = await forwarded(upstream, start_proxy, json.dumps(override))
    warning = headers.get("x-ctxproxy-warning", "")
    assert warning.startswith("x-ctxproxy-context-manager ignored") and "cut_step" in warning, warning
    assert (tokens, users) == (baseline, base_users)


async def test_a_switch_to_a_sliding_window_within_the_policys_window_applies(
    upstream: FakeUpstream, start_proxy: StartProxy
) -> None:
    """Control: sliding-window with the policy's keep_turns (and its default cut_step), or a narrower one, applies."""
    for override, most in (("sliding-window", 3 + 2 - 1),
                           (json.dumps({"type": "sliding-window", "params": {"keep_turns": 2, "cut_step": 1}}), 2)):
        _tokens, users, headers = await forwarded(upstream, start_proxy, override)
        assert "x-ctxproxy-warning" not in headers, headers
        assert users - 1 <= most  # history turns kept, plus the current one


# =========================================================================== the legacy-call namespace


def legacy_call(name: str = "get_weather") -> Message:
    return {"role": "assistant", "content": None, "function_call": {"name": name, "arguments": "{}"}}


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "Weather?"}, legacy_call(),
     {"role": "tool", "tool_call_id": "\u0000fn:get_weather", "content": "sunny"},
     {"role": "user", "content": "Thanks."}],
    [{"role": "user", "content": "Weather?"},
     {"role": "assistant", "content": None, "tool_calls": [
         {"id": "\u0000fn:get_weather", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
     {"role": "function", "name": "get_weather", "content": "sunny"},
     {"role": "user", "content": "Thanks."}],
    [{"role": "user", "content": "Run it."},
     {"role": "assistant", "content": None, "tool_calls": [
         {"id": "\u0000x", "type": "custom", "custom": {"name": "code_exec", "input": "print(1)"}}]},
     {"role": "tool", "tool_call_id": "\u0000x", "content": "1"}],
], ids=["tool-result-for-a-legacy-call", "legacy-result-for-a-tool-call", "custom-call"])
async def test_ids_in_the_legacy_namespace_are_refused(upstream: FakeUpstream, start_proxy: StartProxy,
                                                       messages: list[Message]) -> None:
    """A NUL-prefixed id could pair a tool result with a legacy function_call: refused, never forwarded."""
    proxy = await start_proxy(base_config(upstream.base_url))
    for stream in (False, True):
        status, _headers, body = await post(proxy, {"model": MODEL, "messages": messages, "stream": stream})
        assert status == 400, body
        assert error_of(body)["code"] == "invalid_tool_call"
    assert upstream.chat == []


# =========================================================================== relay: bodies parsers read differently


def multipart(parts: list[tuple[bytes, bytes]], boundary: bytes = b"BB") -> bytes:
    out = b""
    for headers, value in parts:
        out += b"--" + boundary + b"\r\n" + headers + b"\r\n\r\n" + value + b"\r\n"
    return out + b"--" + boundary + b"--\r\n"


MP = "multipart/form-data; boundary=BB"
HOSTILE_BODIES = {
    # JSON orjson refuses and Python's json (FastAPI, vLLM, a LiteLLM proxy) reads, model and all
    "json-bom": (b'\xef\xbb\xbf{"model": "whisper-1", "input": "x"}', "application/json"),
    "json-utf16": ('{"model": "whisper-1", "input": "x"}'.encode("utf-16"), "application/json"),
    "json-nan": (b'{"model": "whisper-1", "input": "x", "temperature": NaN}', "application/json"),
    "json-1e400": (b'{"model": "whisper-1", "input": "x", "t": 1e400}', "application/json"),
    "json-lone-surrogate": (b'{"model": "whisper-1", "input": "\\ud800"}', "application/json"),
    # a first-wins parser reads the first of two model keys
    "json-duplicate-model": (b'{"model": "whisper-1", "model": "gpt-4o-mini"}', "application/json"),
    "json-octet-stream-bom": (b'\xef\xbb\xbf{"model": "whisper-1"}', "application/octet-stream"),
    # python-multipart reads the last name / header / boundary, the stdlib's parser the first
    "multipart-two-names": (multipart([(b'Content-Disposition: form-data; name="x"; name="model"', b"whisper-1")]),
                            MP),
    "multipart-two-dispositions": (multipart([(b'Content-Disposition: form-data; name="x"\r\n'
                                               b'Content-Disposition: form-data; name="model"', b"whisper-1")]), MP),
    "multipart-two-boundaries": (multipart([(b'Content-Disposition: form-data; name="model"', b"whisper-1")],
                                           b"B2"), "multipart/form-data; boundary=B1; boundary=B2"),
}


@pytest.mark.parametrize("name", list(HOSTILE_BODIES))
async def test_relayed_bodies_parsers_read_differently_never_escape_the_model_list(
    upstream: FakeUpstream, start_proxy: StartProxy, name: str
) -> None:
    """A tenant limited to gpt-4o-mini: a body a lenient or another form parser reads as whisper-1 is refused."""
    raw, content_type = HOSTILE_BODIES[name]
    proxy = await start_proxy(tenant_config(upstream.base_url, models=[MODEL]))
    status, _headers, answer = await request(proxy, "POST", "/v1/audio/transcriptions", key=TENANT_KEY, data=raw,
                                             headers={"Content-Type": content_type})
    assert status in (400, 404), answer[:300]
    assert error_of(json.loads(answer))["code"] in ("model_not_found", "ambiguous_form_field", "invalid_json")
    assert upstream.other == []


async def test_plain_relayed_bodies_still_pass(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """Control: an allowed model in plain JSON, in escaped JSON and in a plain multipart field is relayed."""
    proxy = await start_proxy(tenant_config(upstream.base_url, models=[MODEL]))
    bodies = [(json.dumps({"model": MODEL, "input": "héllo"}).encode(), "application/json"),  # \u00e9: the slow path
              (multipart([(b'Content-Disposition: form-data; name="model"', MODEL.encode()),
                          (b'Content-Disposition: form-data; name="file"; filename="a.wav"\r\n'
                           b"Content-Type: audio/wav", b"RIFF")]), MP)]
    for raw, content_type in bodies:
        status, _headers, answer = await request(proxy, "POST", "/v1/audio/transcriptions", key=TENANT_KEY, data=raw,
                                                 headers={"Content-Type": content_type})
        assert status == 200, answer[:300]
    assert len(upstream.other) == 2


# =========================================================================== relay: the proxy's own namespace


@pytest.mark.parametrize("path", ["/v1/ctxproxy%2Fpolicy", "/v1/ctxproxy%2fexplain", "/v1//ctxproxy/policy"])
async def test_the_proxys_namespace_is_never_relayed_however_spelled(upstream: FakeUpstream, start_proxy: StartProxy,
                                                                    path: str) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))  # no tenants: every other path is relayed
    for method in ("GET", "POST"):
        status, _headers, answer = await request(proxy, method, path, data=b"{}" if method == "POST" else None)
        assert status == 404, answer[:300]
        error_of(json.loads(answer))
    assert upstream.other == []
