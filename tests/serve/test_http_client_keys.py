"""A client may send its key in more than one header: the first that names a tenant authenticates it.

Claude Code sends ``Authorization: Bearer`` (``ANTHROPIC_AUTH_TOKEN``) and ``x-api-key``
(``ANTHROPIC_API_KEY``); with both set, one may be a key for something else. Over HTTP, on a keyed proxy.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from tests.conftest import StartProxy, base_config
from tests.fake_upstream import FakeUpstream

CHAT = ("/v1/chat/completions", {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]})
MESSAGES = ("/v1/messages", {"model": "gpt-4o-mini", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]})


@pytest.mark.parametrize(("headers", "status"), [
    ({"Authorization": "Bearer sk-something-else", "x-api-key": "sk-team"}, 200),
    ({"Authorization": "Bearer ", "x-api-key": "sk-team"}, 200),
    ({"Authorization": "Bearer sk-team", "x-api-key": "sk-something-else"}, 200),
    ({"api-key": "sk-team"}, 200),
    ({"Authorization": "Bearer sk-wrong", "x-api-key": "sk-wrong-too"}, 401),
    ({"Authorization": "Bearer "}, 401),
    ({}, 401),
])
@pytest.mark.parametrize(("path", "body"), [CHAT, MESSAGES], ids=["chat", "messages"])
async def test_the_first_key_that_names_a_tenant_authenticates(
        start_proxy: StartProxy, upstream: FakeUpstream, headers: dict[str, str], status: int, path: str,
        body: dict[str, Any]) -> None:
    proxy = await start_proxy(base_config(upstream.base_url, tenants=[{"name": "team", "keys": ["sk-team"]}]))
    async with aiohttp.ClientSession() as s, s.post(proxy.url + path, json=body, headers=headers) as r:
        got = r.status
        text = await r.text()
    assert got == status, text
    for rec in upstream.chat + upstream.other:  # the proxy key is never forwarded, whichever header held it
        assert "sk-team" not in str(dict(rec.headers))


async def test_an_admin_key_in_any_header_is_accepted(start_proxy: StartProxy, upstream: FakeUpstream) -> None:
    proxy = await start_proxy(base_config(upstream.base_url, tenants=[{"name": "team", "keys": ["sk-team"]}],
                                          admin={"keys": ["sk-admin"]}))
    async with aiohttp.ClientSession() as s:
        async with s.get(proxy.url + "/admin/report", headers={"Authorization": "Bearer sk-junk",
                                                                "x-api-key": "sk-admin"}) as r:
            assert r.status == 200, await r.text()
        async with s.get(proxy.url + "/admin/report", headers={"x-api-key": "sk-team"}) as r:
            assert r.status == 401  # a tenant key is not an admin key


async def test_a_key_header_that_is_not_utf8_is_a_wrong_key(start_proxy: StartProxy, upstream: FakeUpstream) -> None:
    """Raw bytes 0xff 0xfe in x-api-key (aiohttp decodes them to surrogates): 401, never a 500."""
    import asyncio
    from urllib.parse import urlsplit

    proxy = await start_proxy(base_config(upstream.base_url, tenants=[{"name": "team", "keys": ["sk-team"]}],
                                          admin={"keys": ["sk-admin"]}))
    where = urlsplit(proxy.url)
    for head in (b"POST /v1/chat/completions HTTP/1.1", b"GET /admin/report HTTP/1.1"):
        reader, writer = await asyncio.open_connection(where.hostname, where.port)
        writer.write(head + b"\r\nHost: x\r\nx-api-key: \xff\xfe-key\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), 10)
        writer.close()
        assert b" 401 " in status_line, status_line
