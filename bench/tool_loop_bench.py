#!/usr/bin/env python3
"""A long, well-formed tool loop over HTTP: time per request and how long a concurrent GET /healthz waits.

The body's current turn holds N small call/result pairs (one user message, then N pairs), on the
three managed wires and on explain with the results displaced after their calls. The proxy (default
policy: summarising, working-memory cap 20) runs as ``ctxproxy serve`` in its own process, against a
fake upstream in this one, both on 127.0.0.1; while the big request is in flight a /healthz probe is
sent every 10 ms and the slowest is reported.

    .venv/bin/python -m bench.tool_loop_bench --pairs 4000 8000 16000 32000 --wires responses messages chat

Prints one markdown row per (wire, N): body size, request time, worst /healthz latency, status.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from proxy.core.modelinfo import offline_environment
from tests.conftest import base_config
from tests.fake_upstream import FakeUpstream

offline_environment()

MODEL = "gpt-4o-mini"


def responses_body(n: int, displaced: bool = False) -> dict[str, Any]:
    calls = [{"type": "function_call", "call_id": f"call_{i}", "name": "read_file",
              "arguments": json.dumps({"path": f"src/mod_{i}.py"})} for i in range(n)]
    outputs = [{"type": "function_call_output", "call_id": f"call_{i}", "output": f"line {i}: ok"}
               for i in range(n)]
    items: list[Any] = [{"role": "user", "content": "Read every file and tell me what they do."}]
    if displaced:  # every output one pair late: each is moved back by the pairing repair
        items += [calls[0]]
        for i in range(1, n):
            items += [calls[i], outputs[i - 1]]
        items += [outputs[n - 1]]
    else:
        for c, o in zip(calls, outputs):
            items += [c, o]
    return {"model": MODEL, "input": items}


def messages_body(n: int) -> dict[str, Any]:
    msgs: list[Any] = [{"role": "user", "content": "Read every file and tell me what they do."}]
    for i in range(n):
        msgs.append({"role": "assistant", "content": [
            {"type": "tool_use", "id": f"toolu_{i}", "name": "read_file", "input": {"path": f"src/mod_{i}.py"}}]})
        msgs.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": f"line {i}: ok"}]})
    return {"model": MODEL, "max_tokens": 1024, "messages": msgs}


def chat_body(n: int) -> dict[str, Any]:
    msgs: list[Any] = [{"role": "user", "content": "Read every file and tell me what they do."}]
    for i in range(n):
        msgs.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{i}", "type": "function",
             "function": {"name": "read_file", "arguments": json.dumps({"path": f"src/mod_{i}.py"})}}]})
        msgs.append({"role": "tool", "tool_call_id": f"call_{i}", "content": f"line {i}: ok"})
    return {"model": MODEL, "messages": msgs}


SHAPES = {
    "responses": ("/v1/responses", responses_body),
    "messages": ("/v1/messages", messages_body),
    "chat": ("/v1/chat/completions", chat_body),
    "explain-displaced": ("/v1/ctxproxy/explain/responses", lambda n: responses_body(n, displaced=True)),
}


async def one(session: aiohttp.ClientSession, base: str, path: str, data: bytes) -> dict[str, Any]:
    worst = 0.0
    done = asyncio.Event()

    async def probe() -> None:
        nonlocal worst
        while not done.is_set():
            t0 = time.perf_counter()
            async with session.get(base + "/healthz") as r:
                await r.read()
            worst = max(worst, time.perf_counter() - t0)
            await asyncio.sleep(0.01)

    prober = asyncio.ensure_future(probe())
    t0 = time.perf_counter()
    async with session.post(base + path, data=data, headers={"Content-Type": "application/json",
                                                            "Authorization": "Bearer sk-client"}) as r:
        await r.read()
        status = r.status
    took = time.perf_counter() - t0
    done.set()
    await prober
    return {"status": status, "seconds": took, "healthz": worst}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def wait_up(base: str, proc: subprocess.Popen[bytes]) -> None:
    async with aiohttp.ClientSession() as session:
        for _ in range(600):
            if proc.poll() is not None:
                raise SystemExit(f"ctxproxy exited with {proc.returncode}")
            try:
                async with session.get(base + "/healthz") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise SystemExit("ctxproxy did not come up")


async def main(pairs: list[int], wires: list[str], rounds: int) -> None:
    upstream = await FakeUpstream().start()
    port = free_port()
    config = base_config(upstream.base_url, server={"host": "127.0.0.1", "port": port})
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ctxproxy.json"  # JSON is YAML
        path.write_text(json.dumps(config))
        ctl = Path(sys.executable).with_name("ctxproxy")
        proc = subprocess.Popen([str(ctl), "serve", "--config", str(path)], env={**os.environ},
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            base = f"http://127.0.0.1:{port}"
            await wait_up(base, proc)
            await run(base, pairs, wires, rounds)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            await upstream.stop()


async def run(base: str, pairs: list[int], wires: list[str], rounds: int) -> None:
    print("| wire | pairs | body MB | request s | s per 1k pairs | worst /healthz ms | status |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for wire in wires:
            path, make = SHAPES[wire]
            await one(session, base, path, json.dumps(make(50)).encode())  # warm-up
            for n in pairs:
                data = json.dumps(make(n)).encode()
                runs = [await one(session, base, path, data) for _ in range(rounds)]
                best = min(runs, key=lambda r: r["seconds"])
                print(f"| {wire} | {n} | {len(data) / 1e6:.2f} | {best['seconds']:.2f} | "
                      f"{1000 * best['seconds'] / n:.3f} | {1000 * best['healthz']:.0f} | {best['status']} |",
                      flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, nargs="+", default=[4000, 8000, 16000, 32000])
    parser.add_argument("--wires", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    asyncio.run(main(args.pairs, args.wires, args.rounds))
