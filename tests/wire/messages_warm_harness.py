"""Differential harness: the same Messages request through a warm proxy and through a fresh one."""

from __future__ import annotations

import copy
from typing import Any

import aiohttp

from tests.conftest import RunningProxy, StartProxy
from tests.fake_upstream import FakeUpstream

CLAUDE = "claude-sonnet-4-5"


def config(
    upstream: FakeUpstream, *, manager: Any = None, budget: int | None = None, tenants: bool = True, **extra: Any
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "upstreams": {"a": {"base_url": upstream.url, "api": "anthropic", "api_key": "sk-ant-up"}},
        "models": [
            {
                "name": CLAUDE,
                "context_window": 200_000,
                "max_output_tokens": 64_000,
                "tokenizer": "o200k_base",
                "calibration": "off",
            }
        ],
        "cache": {"backend": "memory"},
        "summarizer": {"retry_backoff_seconds": 0},
        "server": {"idle_timeout": 5},
    }
    if manager is not None:
        out["context_manager"] = manager
    if budget is not None:
        out["trimmer"] = {"max_tokens": budget}
    if tenants:
        out["tenants"] = [{"name": "a", "keys": ["sk-a"]}, {"name": "b", "keys": ["sk-b"]}]
    out.update(extra)
    return out


async def send(
    proxy: RunningProxy, upstream: FakeUpstream, body: Any, key: str = "sk-a", path: str = "/v1/messages"
) -> dict[str, Any]:
    """Status, the x-ctxproxy-* headers (timings aside), the answer's JSON when an error, and the bytes the
    upstream received for it (None: nothing was forwarded)."""
    before = len(upstream.messages) + len(upstream.counts)
    headers = {"x-api-key": key, "anthropic-version": "2023-06-01"}
    async with aiohttp.ClientSession() as s, s.post(proxy.url + path, json=body, headers=headers) as r:
        raw = await r.read()
        out: dict[str, Any] = {
            "status": r.status,
            "headers": {
                k.lower(): v
                for k, v in r.headers.items()
                if k.lower().startswith("x-ctxproxy") and k.lower() != "x-ctxproxy-overhead-ms"
            },
        }
        if r.status != 200 or path.endswith("count_tokens"):
            out["answer"] = raw
    after = upstream.messages + upstream.counts
    out["forwarded"] = after[-1].raw if len(after) > before else None
    return out


async def cold(
    start_proxy: StartProxy,
    cfg: dict[str, Any],
    upstream: FakeUpstream,
    body: Any,
    key: str = "sk-a",
    path: str = "/v1/messages",
) -> dict[str, Any]:
    fresh = await start_proxy(cfg)
    return await send(fresh, upstream, copy.deepcopy(body), key, path)


async def compare(
    start_proxy: StartProxy,
    cfg: dict[str, Any],
    upstream: FakeUpstream,
    requests: list[tuple[Any, str]],
    path: str = "/v1/messages",
) -> list[tuple[int, Any, Any]]:
    """Send ``requests`` (body, key) in order through one proxy, then each through a fresh one: the differences."""
    warm = await start_proxy(cfg)
    results = [await send(warm, upstream, copy.deepcopy(b), k, path) for b, k in requests]
    diffs = []
    for i, ((b, k), w) in enumerate(zip(requests, results)):
        c = await cold(start_proxy, cfg, upstream, b, k, path)
        if c != w:
            diffs.append((i, w, c))
    return diffs
