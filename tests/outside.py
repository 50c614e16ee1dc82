"""Helpers for tests that drive the proxy only from the outside: HTTP, /metrics and independent token counts.

Nothing here imports ``proxy.*``: these helpers must keep working whatever the
proxy's internal layout becomes (the defect tests reproduce a bug from the client's side, not the code's).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import re
import signal
import sys
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import tiktoken

from tests.conftest import ROOT, RunningProxy

Message = dict[str, Any]

_MAP: dict[str, Any] = {}


def share_model_map(monkeypatch: pytest.MonkeyPatch) -> None:
    """Read litellm's model map once per session instead of once per app (speed only).

    The one touch of an internal: if a restructuring moves or renames the model map, this quietly
    does nothing and the tests only run a little slower.
    """
    try:
        from proxy.core import modelinfo

        cls = modelinfo.ModelMap
        if "data" not in _MAP:
            _MAP["data"] = cls()._data
    except (ImportError, AttributeError):
        return
    monkeypatch.setattr(cls, "_data", property(lambda self: _MAP["data"]))


async def post(
    proxy: RunningProxy, body: Any, *, path: str = "/v1/chat/completions", key: str | None = "sk-client",
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], Any]:
    """POST JSON; returns status, lower-cased response headers and the JSON (or raw text) body."""
    hdrs = dict(headers or {})
    if key is not None:
        hdrs["Authorization"] = f"Bearer {key}"
    async with aiohttp.ClientSession() as s, s.post(proxy.url + path, json=body, headers=hdrs) as r:
        raw = await r.read()
        try:
            payload: Any = json.loads(raw)
        except ValueError:
            payload = raw.decode("utf-8", "replace")
        return r.status, {k.lower(): v for k, v in r.headers.items()}, payload


async def request(
    proxy: RunningProxy, method: str, path: str, *, key: str | None = "sk-client", data: Any = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    hdrs = dict(headers or {})
    if key is not None:
        hdrs["Authorization"] = f"Bearer {key}"
    async with aiohttp.ClientSession() as s, s.request(method, proxy.url + path, data=data, headers=hdrs) as r:
        return r.status, {k.lower(): v for k, v in r.headers.items()}, await r.read()


async def scrape(proxy: RunningProxy, key: str | None = None) -> str:
    """GET /metrics (with tenants configured it needs an admin key: ``key``)."""
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    async with aiohttp.ClientSession() as s, s.get(proxy.url + "/metrics", headers=headers) as r:
        assert r.status == 200
        return await r.text()


def metric_samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample of ``name`` in a Prometheus exposition."""
    out = []
    for line in text.splitlines():
        match = re.fullmatch(rf"{re.escape(name)}(?:\{{(.*)\}})? (\S+)", line)
        if match:
            labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(1) or ""))
            out.append((labels, float(match.group(2))))
    return out


def metric_total(text: str, name: str, **labels: str) -> float:
    """The sum of ``name`` over every sample whose labels include ``labels``."""
    return sum(v for got, v in metric_samples(text, name) if all(got.get(k) == x for k, x in labels.items()))


# --------------------------------------------------------------------------- independent token counts


@functools.lru_cache(maxsize=1)
def o200k() -> tiktoken.Encoding:
    return tiktoken.get_encoding("o200k_base")


def n_tokens(text: str) -> int:
    return len(o200k().encode(text, disallowed_special=()))


def text_of(tokens: int, seed: int = 0) -> str:
    """A text of exactly ``tokens`` o200k tokens (varied words, so it is not one repeated token)."""
    words = ["order", "invoice", "refund", "Denver", "Boston", "ticket", "ZFA04Y", "balance", "parcel",
             "carrier", "tracking", "8842", "/srv/app/config.yaml", "status", "pending", "approved"]
    text = " ".join(words[(seed * 5 + i * 7) % len(words)] + str(i % 97) for i in range(tokens * 2))
    return o200k().decode(o200k().encode(text)[:tokens])


def message_tokens(messages: list[Message]) -> int:
    """OpenAI's per-message formula: 3 per message + every string value (+1 per name) + 3 priming."""
    total = 3
    for m in messages:
        total += 3
        for k, v in m.items():
            if isinstance(v, str):
                total += n_tokens(v) + (1 if k == "name" else 0)
    return total


def chat_body(messages: list[Any], model: str = "small-model", **extra: Any) -> dict[str, Any]:
    """A Chat Completions body (``small-model``: the 8k route of tests.store.test_summaries_http's config)."""
    return {"model": model, "messages": messages, **extra}


class Served:
    """A ``ctxproxy serve`` subprocess; its stderr collected line by line."""

    stop_timeout = 15.0  # seconds a SIGTERM is given before the process is killed

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._new = asyncio.Event()
        self._reader = asyncio.create_task(self._read())
        self.url = ""

    async def _read(self) -> None:
        assert self.proc.stderr is not None
        async for raw in self.proc.stderr:
            self.lines.append(raw.decode(errors="replace").rstrip("\n"))
            self._new.set()

    async def wait_for(self, pattern: str, after: int = 0, timeout: float = 30) -> re.Match[str]:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            for line in self.lines[after:]:
                match = re.search(pattern, line)
                if match:
                    return match
            if self.proc.returncode is not None and self._reader.done():
                raise AssertionError(f"ctxproxy exited ({self.proc.returncode}):\n" + "\n".join(self.lines))
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                raise AssertionError(f"no line matching {pattern!r}:\n" + "\n".join(self.lines))
            self._new.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._new.wait(), min(left, 0.5))

    async def stop(self) -> int:
        """SIGTERM, then (after ``stop_timeout``) SIGKILL; the exit code."""
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), self.stop_timeout)
            except asyncio.TimeoutError:
                self.proc.kill()
        code = await self.proc.wait()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._reader, 5)
        return code


@contextlib.asynccontextmanager
async def serve(config_path: Path, env: Mapping[str, str] | None = None) -> AsyncIterator[Served]:
    """``ctxproxy serve --config config_path`` on a free port of 127.0.0.1 (``env``: added to this process's
    environment), stopped with SIGTERM on leaving."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy.cli", "serve", "--config", str(config_path), "--host", "127.0.0.1",
        "--port", "0", cwd=ROOT, env={**os.environ, **(env or {})}, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    served = Served(proc)
    try:
        match = await served.wait_for(r"listening on (http://127\.0\.0\.1:\d+)")
        served.url = match.group(1)
        yield served
    finally:
        await served.stop()
