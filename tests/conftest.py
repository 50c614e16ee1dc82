"""Fixtures: a fake upstream on 127.0.0.1:0 and the proxy app started on 127.0.0.1:0."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from proxy.core.modelinfo import offline_environment
from tests.fake_upstream import FakeUpstream

offline_environment()

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class RunningProxy:
    url: str
    app: web.Application
    runner: web.AppRunner

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    @property
    def state(self) -> Any:
        from proxy.serve.state import STATE

        return self.app[STATE]


@pytest.fixture
def shared_model_map(monkeypatch: pytest.MonkeyPatch) -> None:
    """litellm's model map read once per session instead of once per app (speed only; tests.outside)."""
    from tests.outside import share_model_map  # tests.outside imports this module

    share_model_map(monkeypatch)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@pytest.fixture
async def serve_routes() -> AsyncIterator[Callable[[dict[str, Handler]], Awaitable[str]]]:
    """A purpose-built upstream: ``{"/v1/path": handler}`` on 127.0.0.1, its base URL returned."""
    runners: list[web.AppRunner] = []

    async def start(routes: dict[str, Handler]) -> str:
        app = web.Application()
        for path, handler in routes.items():
            app.router.add_route("*", path, handler)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{port}/v1"

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def slow_upstream() -> AsyncIterator[Any]:
    """A raw streaming upstream: 10 chunks, 0.1 s apart (tests.faults.SlowStreamUpstream)."""
    from tests.faults import SlowStreamUpstream  # tests.faults imports this module

    slow = await SlowStreamUpstream(chunks=10, interval=0.1).start()
    yield slow
    await slow.stop()


@pytest.fixture
async def upstream() -> AsyncIterator[FakeUpstream]:
    fake = await FakeUpstream().start()
    yield fake
    await fake.stop()


def base_config(upstream_url: str, **extra: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "upstreams": {"fake": {"base_url": upstream_url, "api_key": "sk-upstream-secret"}},
        "models": [{"name": "gpt-4o-mini", "context_window": 128000, "max_output_tokens": 16384}],
        "cache": {"backend": "memory"},
        "summarizer": {"retry_backoff_seconds": 0},
        "logging": {"level": "INFO"},
    }
    config.update(extra)
    return config


StartProxy = Callable[..., Awaitable[RunningProxy]]


@pytest.fixture
async def start_proxy() -> AsyncIterator[StartProxy]:
    from proxy.serve.app import create_app
    from proxy.serve.server import make_runner
    from proxy.settings import load_config

    runners: list[web.AppRunner] = []

    async def start(config: dict[str, Any] | Any, **kwargs: Any) -> RunningProxy:
        cfg = load_config(config) if isinstance(config, dict) else config
        app = create_app(cfg, **kwargs)
        runner = make_runner(app, cfg, shutdown_timeout=2)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return RunningProxy(f"http://127.0.0.1:{port}", app, runner)

    yield start
    for runner in runners:
        await runner.cleanup()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", default=False, help="also run tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow (make check)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
