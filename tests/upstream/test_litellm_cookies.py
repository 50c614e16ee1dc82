"""No cookie a provider sets on one request goes out with another, on either kind of route, on any wire.

A provider behind a CDN answers with a session cookie (``Set-Cookie``). The proxy pools its clients for every
tenant, so a cookie kept by a pooled client would go out with the next tenant's request: the HTTP route's
session has no jar (``proxy.upstream.http``); litellm's clients for OpenAI's SDK kept one, and now do not
(``proxy.upstream.litellm``). A real fake upstream on 127.0.0.1 sets a new cookie on every answer; two
tenants take turns.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import StartProxy, base_config
from tests.fake_upstream import FakeUpstream, Received
from tests.outside import post

pytestmark = pytest.mark.filterwarnings("ignore:.*ReadOnly.*:UserWarning")

WINDOW = {"context_window": 128000, "max_output_tokens": 1000}
USER = {"role": "user", "content": "hi"}
# wire: (path, body)
WIRES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"messages": [USER]}),
    "responses": ("/v1/responses", {"input": "hi"}),
    "messages": ("/v1/messages", {"messages": [USER], "max_tokens": 50}),
}
# route: the model entry, and per wire the fake upstream's record of the calls it makes (litellm sends a Messages
# request for an openai/ model to the Responses API)
ROUTES: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
    "http": ({}, {"chat": "chat", "responses": "responses", "messages": "messages"}),
    "litellm-openai": ({"provider": "litellm", "model": "openai/gpt-4o-mini"},
                       {"chat": "chat", "responses": "responses", "messages": "responses"}),
    "litellm-anthropic": ({"provider": "litellm", "model": "anthropic/claude-sonnet-4-5"},
                          {"chat": "messages", "responses": "messages", "messages": "messages"}),
}


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("route", ROUTES)
async def test_a_cookie_the_provider_set_never_goes_out_again(
        start_proxy: StartProxy, upstream: FakeUpstream, route: str, wire: str) -> None:
    model, recorded = ROUTES[route]
    url = upstream.url if "anthropic" in route else upstream.base_url  # (litellm adds /v1/messages itself)
    cfg = base_config(url, models=[{"name": "m", "upstream": "fake", **WINDOW, **model}],
                      tenants=[{"name": "a", "keys": ["sk-a"]}, {"name": "b", "keys": ["sk-b"]}])
    upstream.set_cookie = True
    proxy = await start_proxy(cfg)
    path, body = WIRES[wire]
    for key in ("sk-a", "sk-b", "sk-a", "sk-b"):
        status, headers, answer = await post(proxy, {"model": "m", **body}, path=path, key=key,
                                             headers={"Cookie": "client=own", "Cookie2": '$Version="1"'})
        assert status == 200, answer
        assert "set-cookie" not in headers and "set-cookie2" not in headers  # nor does a client get the provider's
    calls: list[Received] = getattr(upstream, recorded[wire])
    assert len(calls) == 4
    assert [(call.headers.get("Cookie"), call.headers.get("Cookie2")) for call in calls] == [(None, None)] * 4
