"""proxy.upstream.providers: a route's provider is chosen once per (upstream, kind); credentials policy."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from proxy.core.errors import BadRequest
from proxy.core.modelinfo import ModelMap
from proxy.policy import Routes
from proxy.settings import Config, ServerSettings, load_config
from proxy.upstream.base import Outgoing
from proxy.upstream.http import HTTPProvider, UpstreamPool
from proxy.upstream.litellm import LiteLLMProvider
from proxy.upstream.providers import Providers


def config(*, tenants: bool = False, key: str | None = None) -> Config:
    raw: dict[str, Any] = {
        "upstreams": {"openai": {"base_url": "http://127.0.0.1:9/v1", **({"api_key": key} if key else {})},
                      "local": {"base_url": "http://127.0.0.1:10/v1", "api_key": "sk-local"}},
        "models": [{"name": "gpt-4o-mini", "context_window": 128000},
                   {"name": "llama", "upstream": "local", "model": "llama3", "context_window": 8192},
                   {"name": "claude", "provider": "litellm", "model": "anthropic/claude-3-5-haiku",
                    "context_window": 200000},
                   {"name": "claude-local", "provider": "litellm", "upstream": "local", "model": "openai/x",
                    "context_window": 8192}],
        "cache": {"backend": "memory"},
    }
    if tenants:
        raw["tenants"] = [{"name": "acme", "keys": ["sk-acme"]}]
    return load_config(raw, env={})


@pytest.fixture
async def pool() -> AsyncIterator[UpstreamPool]:
    p = UpstreamPool(ServerSettings())
    yield p
    await p.close()


def routes(cfg: Config) -> Routes:
    return Routes(cfg, ModelMap())


async def test_an_openai_route_gets_the_http_provider_of_its_upstream(pool: UpstreamPool) -> None:
    cfg = config()
    providers = Providers(cfg, pool)
    r = routes(cfg)
    a = providers.for_route(r.resolve("gpt-4o-mini"))
    assert isinstance(a, HTTPProvider)
    assert a.upstream.base_url == "http://127.0.0.1:9/v1" and a.pool is pool
    assert a.url("/chat/completions") == "http://127.0.0.1:9/v1/chat/completions"
    b = providers.for_route(r.resolve("llama"))
    assert isinstance(b, HTTPProvider) and b.upstream.base_url == "http://127.0.0.1:10/v1"
    assert providers.for_route(r.resolve("unknown-model")) is a  # unknown names go to the default upstream


async def test_providers_are_made_once_per_upstream_and_kind(pool: UpstreamPool) -> None:
    cfg = config()
    providers = Providers(cfg, pool)
    r = routes(cfg)
    assert providers.for_route(r.resolve("gpt-4o-mini")) is providers.for_route(r.resolve("gpt-4o"))
    assert providers.for_route(r.resolve("claude")) is not providers.for_route(r.resolve("gpt-4o-mini"))
    assert providers.for_route(r.resolve("claude")) is providers.for_route(r.resolve("claude"))


async def test_a_litellm_route_gets_the_litellm_provider_with_its_upstream(pool: UpstreamPool) -> None:
    cfg = config()
    providers = Providers(cfg, pool)
    r = routes(cfg)
    p = providers.for_route(r.resolve("claude"))
    assert isinstance(p, LiteLLMProvider)
    assert p.upstream is not None and p.upstream.base_url == "http://127.0.0.1:9/v1"  # the default upstream
    local = providers.for_route(r.resolve("claude-local"))
    assert isinstance(local, LiteLLMProvider) and local.upstream is not None
    assert local.upstream.api_key == "sk-local"


@pytest.mark.parametrize(("tenants", "key", "forward"), [
    (False, None, True),  # no tenants, no key: the client's own credentials go upstream
    (False, "sk-operator", False),
    (True, None, False),  # tenants: never the client's (a proxy key) credentials
    (True, "sk-operator", False),
])
async def test_client_credentials_are_forwarded_only_without_tenants_and_key(
    pool: UpstreamPool, tenants: bool, key: str | None, forward: bool
) -> None:
    cfg = config(tenants=tenants, key=key)
    p = Providers(cfg, pool).for_route(routes(cfg).resolve("gpt-4o-mini"))
    assert isinstance(p, HTTPProvider)
    assert p.forward_client_auth is forward


async def test_the_litellm_provider_refuses_a_wire_it_does_not_serve() -> None:
    cfg = config()
    route = routes(cfg).resolve("claude")
    call = Outgoing("no-such-wire", "/nowhere", {"model": "claude", "input": "hi"}, b"{}", False, {}, "r")
    with pytest.raises(BadRequest) as err:
        await LiteLLMProvider(None).send(route, call)
    assert err.value.code == "unsupported_wire"
    assert err.value.param == "model"
