"""A ~400k-token request being assembled must not stall the event loop for everybody else."""

from __future__ import annotations

import asyncio
import functools
import gzip
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import tiktoken

from tests.conftest import base_config
from tests.fake_upstream import FakeUpstream

HUGE = Path(__file__).resolve().parents[1] / "bench" / "payloads" / "agent_huge.json.gz"  # 1.6 MB gzip-compressed
MODEL = "gpt-4o-mini"
WINDOW, MAX_OUT = 128_000, 16_384
HARD_BUDGET = WINDOW - MAX_OUT - 12_800  # window - the model's max output - ceil(0.1 * window)
SMALL = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "ping"}]}).encode()
PROMPT_LIMIT = 0.150  # seconds




@functools.lru_cache(maxsize=1)
def huge_body() -> bytes:
    return gzip.decompress(HUGE.read_bytes())


def recount(body: dict[str, Any]) -> int:
    """OpenAI's formula with tiktoken o200k_base, independent of the proxy's counter."""
    enc = tiktoken.get_encoding("o200k_base")
    texts: list[str] = []
    n = 3
    if body.get("tools"):
        texts.append(json.dumps(body["tools"], separators=(",", ":"), ensure_ascii=False))
    for m in body["messages"]:
        n += 3
        for key, value in m.items():
            if isinstance(value, str):
                texts.append(value)
                n += key == "name"
            elif key == "tool_calls":
                for call in value:
                    n += 3
                    texts += [call["function"]["name"], call["function"]["arguments"]]
    return n + sum(len(t) for t in enc.encode_ordinary_batch(texts, num_threads=2))


async def post(session: aiohttp.ClientSession, url: str, data: bytes) -> tuple[int, Any, bytes]:
    async with session.post(url, data=data, headers={"Content-Type": "application/json"}) as r:
        return r.status, r.headers, await r.read()


class Prober:
    """Fires a small request every 10 ms without waiting for the previous one, so any stall of the
    proxy's event loop longer than the limit shows up as at least one slow small request."""

    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.session, self.url = session, url
        self.latencies: list[float] = []
        self.failures: list[int] = []
        self._tasks: list[asyncio.Task[None]] = []

    async def _one(self) -> None:
        t0 = time.perf_counter()
        status, _, _ = await post(self.session, self.url, SMALL)
        self.latencies.append(time.perf_counter() - t0)
        if status != 200:
            self.failures.append(status)

    async def run_until(self, done: asyncio.Future[Any]) -> None:
        while not done.done():
            self._tasks.append(asyncio.ensure_future(self._one()))
            await asyncio.sleep(0.01)
        await asyncio.gather(*self._tasks)


async def huge_request(upstream: FakeUpstream, start_proxy: Any, config: dict[str, Any]) -> dict[str, Any]:
    """Warm up, send the huge request, time one small request 20 ms later, then probe until it is answered."""
    huge = huge_body()
    proxy = await start_proxy(config)
    url = proxy.url + "/v1/chat/completions"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        for _ in range(2):  # warm-up: tokenizer, connection pools
            assert (await post(s, url, SMALL))[0] == 200
        sent = time.perf_counter()
        big = asyncio.ensure_future(post(s, url, huge))
        await asyncio.sleep(0.02)
        t0 = time.perf_counter()
        status, _, _ = await post(s, url, SMALL)
        t1 = time.perf_counter()
        first_running = not big.done()
        prober = Prober(s, url)
        await prober.run_until(big)
        big_status, big_headers, big_raw = await big
        big_time = time.perf_counter() - sent
    print(f"\nsmall 20 ms into huge: {1000 * (t1 - t0):.1f} ms ({1000 * (t1 - sent):.1f} ms since huge sent); "
          f"huge took {1000 * big_time:.0f} ms; {len(prober.latencies)} probes, "
          f"max {1000 * max(prober.latencies, default=0):.1f} ms")
    assert status == 200 and not prober.failures
    assert first_running, "the huge request finished before the small one: the test measured nothing"
    return {"small": t1 - t0, "probes": prober.latencies, "status": big_status, "headers": big_headers,
            "raw": big_raw}


def check_big_answer(out: dict[str, Any], upstream: FakeUpstream) -> None:
    body = json.loads(huge_body())
    assert out["status"] == 200, out["raw"][:500]
    assert json.loads(out["raw"])["choices"][0]["message"]["content"]
    tokens_in, tokens_out = int(out["headers"]["x-ctxproxy-tokens-in"]), int(out["headers"]["x-ctxproxy-tokens-out"])
    assert tokens_in > 300_000
    assert tokens_out <= HARD_BUDGET
    forwarded = max(upstream.chat, key=lambda r: len(r.raw))
    assert len(forwarded.body["messages"]) < len(body["messages"])
    mine = recount(forwarded.body)
    assert abs(mine - tokens_out) <= 0.02 * tokens_out, (mine, tokens_out)
    assert mine <= HARD_BUDGET * 1.02


async def test_small_request_not_stalled_by_huge_one(upstream: FakeUpstream, start_proxy: Any) -> None:
    """The default policy (summarising, llm summariser): gpt-4o-mini with a 128k window, memory cache."""
    out = await huge_request(upstream, start_proxy, base_config(upstream.base_url))
    assert out["small"] < PROMPT_LIMIT, f"a small request took {1000 * out['small']:.0f} ms during a huge one"
    check_big_answer(out, upstream)
    assert out["headers"]["x-ctxproxy-summary"] == "created"


async def test_no_stall_anywhere_in_huge_request_without_summariser(upstream: FakeUpstream,
                                                                    start_proxy: Any) -> None:
    config = base_config(upstream.base_url, context_manager={"type": "summarising", "params": {"summarizer": "drop"}})
    out = await huge_request(upstream, start_proxy, config)
    worst = max(out["probes"])
    assert worst < PROMPT_LIMIT, f"a small request took {1000 * worst:.0f} ms during a huge one"
    check_big_answer(out, upstream)


async def test_no_stall_anywhere_in_huge_request_with_llm_summariser(upstream: FakeUpstream,
                                                                     start_proxy: Any) -> None:
    out = await huge_request(upstream, start_proxy, base_config(upstream.base_url))
    check_big_answer(out, upstream)
    worst = max(out["probes"])
    assert worst < PROMPT_LIMIT, f"a small request took {1000 * worst:.0f} ms during a huge one"
