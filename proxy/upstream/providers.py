"""Which provider serves a route: chosen once per (upstream, provider kind), the only such branch."""

from __future__ import annotations

from proxy.policy import ModelRoute
from proxy.settings import Config
from proxy.upstream.anthropic import AnthropicProvider
from proxy.upstream.base import Provider
from proxy.upstream.http import HTTPProvider, UpstreamPool


class Providers:
    """The providers of one config over one connection pool (rebuilt on reload; the pool is kept)."""

    def __init__(self, config: Config, pool: UpstreamPool) -> None:
        self.config = config
        self.pool = pool
        self._made: dict[tuple[str, str], Provider] = {}

    def for_route(self, route: ModelRoute) -> Provider:
        key = (route.upstream, route.provider)
        provider = self._made.get(key)
        if provider is None:
            provider = self._made[key] = self._make(route)
        return provider

    def _make(self, route: ModelRoute) -> Provider:
        upstreams = self.config.settings.upstreams
        if route.provider == "litellm":
            from proxy.upstream.litellm import LiteLLMProvider

            return LiteLLMProvider(upstreams.get(route.upstream), self.pool.server)
        upstream = upstreams[route.upstream]
        forward = self.config.forwards_client_auth(upstream)
        if upstream.api == "anthropic":
            return AnthropicProvider(upstream, self.pool, forward_client_auth=forward)
        return HTTPProvider(upstream, self.pool, forward_client_auth=forward)
