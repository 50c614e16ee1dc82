"""Hostile bodies over HTTP (an outside review's reproductions): a proxy that read earlier bodies of the
conversation answers and forwards what a fresh one does, and no body stalls the event loop."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from tests.conftest import RunningProxy, StartProxy, base_config
from tests.fake_upstream import USAGE, _completion
from tests.outside import share_model_map


@pytest.fixture(autouse=True)
def _shared_model_map(monkeypatch: pytest.MonkeyPatch) -> None:
    share_model_map(monkeypatch)


class RawUpstream:
    """Records the exact bytes of each chat request, JSON or not, and answers a fixed completion."""

    def __init__(self) -> None:
        self.received: list[bytes] = []

    async def chat(self, request: web.Request) -> web.Response:
        self.received.append(await request.read())
        return web.json_response(_completion("gpt-4o-mini", "ok", USAGE))


async def post(proxy: RunningProxy, up: RawUpstream, raw: bytes) -> dict[str, Any]:
    before = len(up.received)
    headers = {"Authorization": "Bearer sk-client", "Content-Type": "application/json"}
    async with aiohttp.ClientSession() as s, s.post(proxy.url + "/v1/chat/completions", data=raw,
                                                   headers=headers) as r:
        answer = await r.read()
        out: dict[str, Any] = {"status": r.status}
        if r.status != 200:
            out["answer"] = orjson.loads(answer)
    out["forwarded"] = up.received[-1] if len(up.received) > before else None
    return out


def head() -> list[dict[str, Any]]:
    return [{"role": "system", "content": "s" * 2000},
            *({"role": "user" if i % 2 else "assistant", "content": f"turn {i}"} for i in range(5))]


Routes = Callable[[dict[str, Any]], Awaitable[str]]


async def test_invalid_json_is_forwarded_after_a_window_edge_string(serve_routes: Routes,
                                                                    start_proxy: StartProxy) -> None:
    up = RawUpstream()
    cfg = base_config(await serve_routes({"/v1/chat/completions": up.chat}))
    big = "A" * 40000 + ",a,b,c{" + "z" * 100
    raw_a = orjson.dumps({"model": "gpt-4o-mini", "messages": [*head(), {"role": "user", "content": big}],
                          "stream": False})
    cut = raw_a.index(b",c{")
    raw_c = raw_a[:cut] + b',{"role":"user","content":"injected"}' + raw_a[raw_a.rindex(b"]"):]
    warm = await start_proxy(cfg)
    for _ in range(2):
        first = await post(warm, up, raw_a)
        assert first["status"] == 200, first
    got = await post(warm, up, raw_c)
    fresh = await post(await start_proxy(cfg), up, raw_c)
    assert fresh["status"] == 400 and fresh["forwarded"] is None
    assert got == fresh, (got["status"], (got["forwarded"] or b"")[-150:])


async def test_too_deep_element_refused_differently_warm(serve_routes: Routes, start_proxy: StartProxy) -> None:
    up = RawUpstream()
    cfg = base_config(await serve_routes({"/v1/chat/completions": up.chat}))
    msgs = [*head(), *({"role": "user" if i % 2 else "assistant", "content": "x" * 3000} for i in range(6))]
    base = orjson.dumps({"model": "gpt-4o-mini", "messages": msgs, "stream": False})
    cut = base.rindex(b"]")
    raw = base[:cut] + b',{"role":"user","content":' + b"[" * 1022 + b"]" * 1022 + b"}" + base[cut:]
    warm = await start_proxy(cfg)
    for _ in range(2):
        first = await post(warm, up, base)
        assert first["status"] == 200, first
    got = await post(warm, up, raw)
    fresh = await post(await start_proxy(cfg), up, raw)
    assert fresh["status"] == 400
    assert got == fresh


async def test_one_40kb_body_blocks_the_event_loop_for_seconds(serve_routes: Routes, start_proxy: StartProxy) -> None:
    """The backward read's quadratic case (see test_bodies_review) on the event loop: a tiny concurrent request of
    another client waits for it."""
    import asyncio
    import time

    up = RawUpstream()
    cfg = base_config(await serve_routes({"/v1/chat/completions": up.chat}))
    proxy = await start_proxy(cfg)
    bad = orjson.dumps({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"},
                        {"role": "user", "content": '"' * 20_000}], "stream": "xx"})
    small = orjson.dumps({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]})

    began = time.perf_counter()

    async def timed(raw: bytes, delay: float) -> float:  # (the client shares the proxy's loop: time from the start)
        await asyncio.sleep(delay)
        assert (await post(proxy, up, raw))["status"] == 200
        return time.perf_counter() - began

    slow, quick = await asyncio.gather(timed(bad, 0), timed(small, 0.3))
    assert quick < 1.5, f"a tiny request took {quick:.1f} s behind one {len(bad)} byte body ({slow:.1f} s)"
