"""proxy.serve.admin over HTTP: who may read ``/metrics`` on the main listener."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from tests.conftest import StartProxy, base_config
from tests.fake_upstream import FakeUpstream

ADMIN = "sk-admin-metrics"
TENANTS = [{"name": "acme", "keys": ["sk-acme"]}, {"name": "globex", "keys": ["sk-globex"]}]


async def get_metrics(url: str, headers: dict[str, str]) -> tuple[int, str, Any]:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics", headers=headers) as r:
        return r.status, r.headers.get("Content-Type", ""), await r.text()


async def test_metrics_stay_open_without_tenants(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    status, content_type, text = await get_metrics(proxy.url, {})
    assert status == 200 and content_type.startswith("text/plain") and "ctxproxy_requests_total" in text


@pytest.mark.parametrize("headers", [
    {}, {"Authorization": "Bearer sk-acme"}, {"x-api-key": "sk-globex"}, {"Authorization": "Bearer sk-wrong"},
    {"Authorization": f"Basic {ADMIN}"},
], ids=["no-key", "tenant-key", "tenant-x-api-key", "wrong-key", "not-bearer"])
async def test_with_tenants_metrics_need_an_admin_key(upstream: FakeUpstream, start_proxy: StartProxy,
                                                     headers: dict[str, str]) -> None:
    """/metrics lists every tenant by name with its traffic and cost: with tenants configured it used to need no
    key at all; now any other key, or none, gets a 401 in OpenAI's shape that names no tenant."""
    proxy = await start_proxy(base_config(upstream.base_url, tenants=TENANTS, admin={"keys": [ADMIN]}))
    status, content_type, text = await get_metrics(proxy.url, headers)
    assert status == 401 and content_type.startswith("application/json")
    assert "admin.keys" in text and "server.metrics_port" in text
    assert "acme" not in text and "globex" not in text


@pytest.mark.parametrize("headers", [{"Authorization": f"Bearer {ADMIN}"}, {"x-api-key": ADMIN}])
async def test_an_admin_key_reads_the_metrics(upstream: FakeUpstream, start_proxy: StartProxy,
                                              headers: dict[str, str]) -> None:
    proxy = await start_proxy(base_config(upstream.base_url, tenants=TENANTS, admin={"keys": [ADMIN]}))
    async with aiohttp.ClientSession() as s, s.post(proxy.url + "/v1/chat/completions", json={
            "model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]},
            headers={"Authorization": "Bearer sk-acme"}) as r:
        assert r.status == 200
    status, _, text = await get_metrics(proxy.url, headers)
    assert status == 200 and 'tenant="acme"' in text


async def test_with_tenants_and_no_admin_key_configured_metrics_are_closed(upstream: FakeUpstream,
                                                                          start_proxy: StartProxy) -> None:
    """No admin key configured: nobody reads them here (the separate metrics listener is the way)."""
    proxy = await start_proxy(base_config(upstream.base_url, tenants=TENANTS))
    for headers in ({}, {"Authorization": "Bearer sk-acme"}):
        status, _, _ = await get_metrics(proxy.url, headers)
        assert status == 401
