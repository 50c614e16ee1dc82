"""proxy.serve.scope: every handler of a wire lives one request's life the same way.

The managed, compact, count_tokens and explain handlers each hand-rolled the request id, the error
shape, authentication, the body, the model check, the record, the log line and the metrics, and
they disagreed: count_tokens wrote no log line and counted no finished request, compact answered
OpenAI's error shape whatever its wire, and the missing-model message differed. One scope owns all
of it now; these tests hold the handlers to agreeing.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict

from tests.conftest import base_config
from tests.fake_upstream import FakeUpstream

KEY = "sk-team"
CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hello"}]}
RESPONSES = {"model": "gpt-4o-mini", "input": [{"role": "user", "content": "hello"}]}
MESSAGES = {"model": "gpt-4o-mini", "max_tokens": 20, "messages": [{"role": "user", "content": "hello"}]}
# path, body, the event the log line names, whether it counts as one of the wire's requests, the wire
HANDLERS = [
    ("/v1/chat/completions", CHAT, "request", True, "chat"),
    ("/v1/responses", RESPONSES, "request", True, "responses"),
    ("/v1/messages", MESSAGES, "request", True, "messages"),
    ("/v1/responses/compact", RESPONSES, "compact", True, "responses"),
    ("/v1/messages/count_tokens", MESSAGES, "count_tokens", True, "messages"),
    ("/v1/ctxproxy/explain/messages", MESSAGES, "explain", False, "messages"),
]


async def post(url: str, body: Any, key: str = KEY) -> tuple[int, CIMultiDict[str], Any]:
    headers = {"Authorization": f"Bearer {key}", "x-request-id": "rid-scope-1"}
    async with aiohttp.ClientSession() as s, s.post(url, json=body, headers=headers) as r:
        return r.status, CIMultiDict(r.headers), await r.json(content_type=None)


def lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "ctxproxy.requests"]


@pytest.mark.parametrize(("path", "body", "event", "counted", "wire"), HANDLERS,
                         ids=[h[0] for h in HANDLERS])
async def test_each_handler_logs_one_line_and_counts_one_finished_request(
        upstream: FakeUpstream, start_proxy: Any, caplog: pytest.LogCaptureFixture,
        path: str, body: dict[str, Any], event: str, counted: bool, wire: str) -> None:
    caplog.set_level(logging.INFO, logger="ctxproxy.requests")
    proxy = await start_proxy(base_config(upstream.base_url, tenants=[{"name": "team", "keys": [KEY]}]))
    status, headers, _ = await post(proxy.url + path, body)
    await asyncio.sleep(0.05)  # a managed request's line is written once its answer is on its way
    assert status == 200 and headers["x-request-id"] == "rid-scope-1"
    (line,) = lines(caplog)
    assert (line["event"], line["wire"], line["tenant"], line["status"], line["request_id"]) == (
        event, wire, "team", 200, "rid-scope-1")
    assert line["model"] == "gpt-4o-mini"
    registry = proxy.state.metrics.registry
    finished = registry.get_sample_value("ctxproxy_requests_total", {
        "tenant": "team", "model": "gpt-4o-mini", "wire": wire, "status": "200"})
    assert finished == (1.0 if counted else None)


@pytest.mark.parametrize(("path", "body", "event", "counted", "wire"), HANDLERS,
                         ids=[h[0] for h in HANDLERS])
async def test_a_refused_request_is_logged_counted_and_answered_in_the_wires_shape(
        upstream: FakeUpstream, start_proxy: Any, caplog: pytest.LogCaptureFixture,
        path: str, body: dict[str, Any], event: str, counted: bool, wire: str) -> None:
    caplog.set_level(logging.INFO, logger="ctxproxy.requests")
    proxy = await start_proxy(base_config(upstream.base_url, tenants=[{"name": "team", "keys": [KEY]}]))
    status, _, error = await post(proxy.url + path, body, key="sk-wrong")
    assert status == 401
    if wire == "messages":
        assert error["type"] == "error" and error["error"]["type"] == "authentication_error"
    else:
        assert error["error"]["code"] == "invalid_api_key"
    (line,) = lines(caplog)
    assert (line["event"], line["status"], line["error"]) == (event, 401, "invalid_api_key")
    finished = proxy.state.metrics.registry.get_sample_value("ctxproxy_requests_total", {
        "tenant": "other", "model": "other", "wire": wire, "status": "401"})  # no tenant, and no body was read
    assert finished == (1.0 if counted else None)


@pytest.mark.parametrize(("path", "body", "event", "counted", "wire"), HANDLERS,
                         ids=[h[0] for h in HANDLERS])
async def test_one_refusal_for_a_request_without_a_model(
        upstream: FakeUpstream, start_proxy: Any,
        path: str, body: dict[str, Any], event: str, counted: bool, wire: str) -> None:
    proxy = await start_proxy(base_config(upstream.base_url, tenants=[{"name": "team", "keys": [KEY]}]))
    status, _, error = await post(proxy.url + path, {k: v for k, v in body.items() if k != "model"})
    assert status == 400
    message = "'model' is required and must be a string"
    if wire == "messages":
        assert error == {"type": "error", "error": {"type": "invalid_request_error", "message": message}}
    else:
        assert (error["error"]["message"], error["error"]["code"], error["error"]["param"]) == (
            message, "missing_model", "model")
