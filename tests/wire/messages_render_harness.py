"""Review harness: a warm proxy vs a fresh proxy per request, raw bytes sent (formatting under control)."""
from __future__ import annotations

import json
import random
from typing import Any

import aiohttp
import orjson

from tests.helpers import words
from tests.wire.messages_helpers import assistant, text_block, thinking, tool_result, tool_use, user

CLAUDE = "claude-sonnet-4-5"


def config(upstream_url: str, manager: Any = None, budget: int | None = None, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "upstreams": {"a": {"base_url": upstream_url, "api": "anthropic", "api_key": "sk-ant-up"}},
        "models": [{"name": CLAUDE, "context_window": 200_000, "max_output_tokens": 64_000,
                    "tokenizer": "o200k_base", "calibration": "off"}],
        "cache": {"backend": "memory"},
        "summarizer": {"retry_backoff_seconds": 0},
        "server": {"idle_timeout": 5},
        "tenants": [{"name": "a", "keys": ["sk-a"]}, {"name": "b", "keys": ["sk-b"]}],
    }
    if manager is not None:
        out["context_manager"] = manager
    if budget is not None:
        out["trimmer"] = {"max_tokens": budget}
    out.update(extra)
    return out


def encode(body: dict[str, Any], style: int) -> bytes:
    if style == 0:
        return orjson.dumps(body)
    if style == 1:
        return json.dumps(body, indent=1).encode()
    return json.dumps(body, separators=(", ", ": ")).encode()


async def send(url: str, upstream: Any, raw: bytes, key: str = "sk-a", path: str = "/v1/messages") -> dict[str, Any]:
    before = len(upstream.messages) + len(upstream.counts)
    headers = {"x-api-key": key, "anthropic-version": "2023-06-01", "content-type": "application/json"}
    async with aiohttp.ClientSession() as s, s.post(url + path, data=raw, headers=headers) as r:
        got = await r.read()
        out: dict[str, Any] = {"status": r.status, "headers": {
            k.lower(): v for k, v in r.headers.items()
            if k.lower().startswith("x-ctxproxy") and k.lower() != "x-ctxproxy-overhead-ms"}}
        if r.status != 200:
            out["answer"] = got
    after = upstream.messages + upstream.counts
    out["forwarded"] = after[-1].raw if len(after) > before else None
    return out


def agent(seed: int, rounds: int, size: int, features: set[str]) -> list[dict[str, Any]]:
    """A tool loop with the features asked for."""
    r = random.Random(seed)
    messages: list[dict[str, Any]] = [user("Investigate. " + words(20, seed))]
    k = 0
    for i in range(rounds):
        if "turns" in features and r.random() < 0.25 and messages[-1]["role"] == "user":
            messages.append(assistant("answer " + words(10, i)))
            messages.append(user("next question " + words(8, i)))
        ids = [f"toolu_{k + j:03d}" for j in range(r.choice([1, 2, 3]))]
        k += len(ids)
        blocks = [thinking(words(5, i))] if "thinking" in features and r.random() < 0.5 else []
        if "text" in features and r.random() < 0.3:
            blocks.append(text_block("calling " + str(i)))
        messages.append(assistant([*blocks, *(tool_use(x, r.choice(["Read", "Grep", "Bash"]), p=x) for x in ids)]))
        results: list[Any] = [tool_result(x, words(r.choice([40, 150, 300]) * size, i + j)) for j, x in enumerate(ids)]
        if "trailing" in features and r.random() < 0.3:
            results.append(text_block(f"also {i}"))
        if "before" in features and r.random() < 0.15:
            results.insert(0, text_block(f"first {i}"))
        if "split" in features and len(ids) > 1 and r.random() < 0.4:
            messages.append(user(results[:1]))
            messages.append(user(results[1:]))
        else:
            messages.append(user(results, **({"x_extra": i} if r.random() < 0.1 else {})))
        if "system" in features and r.random() < 0.1:
            messages.append({"role": "system", "content": "mid reminder " + str(i)})
    return messages


def body(messages: list[dict[str, Any]], big: bool, **extra: Any) -> dict[str, Any]:
    system = "Be brief. " + (words(4000, 3) if big else "")
    return {"model": CLAUDE, "max_tokens": 256, "system": system, "messages": messages, **extra}
