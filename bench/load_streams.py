#!/usr/bin/env python3
"""Streaming load: N concurrent SSE clients through ctxproxy for D seconds, on loopback only.

Two variants (``--variant``, default both):

* ``process``: starts the harness's fake upstream (``bench/fake_upstream.py``) and ``ctxproxy serve`` as
  subprocesses on free ports; samples the proxy's RSS, open file descriptors and threads from
  ``/proc/<pid>`` every ``--sample`` seconds.
* ``inprocess``: the same fake upstream subprocess, but the proxy app runs in this script's own event loop,
  so ``asyncio.all_tasks()`` can be counted (client tasks excluded) next to this process's RSS and fds.

Every client loops: POST /v1/chat/completions with ``"stream": true``, read the whole stream, check it ends
with ``data: [DONE]``. Anything else (status, no [DONE], exception) is an error; the run must have 0.
Prints a table and, with ``--json-out``, writes the figures. Everything started is stopped by PID.

    .venv/bin/python bench/load_streams.py                 # 200 clients x 60 s, both variants
    .venv/bin/python bench/load_streams.py --clients 50 --duration 10 --variant process
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
FAKE_UPSTREAM = ROOT / "bench" / "fake_upstream.py"
MODEL = "gpt-4o-mini"
BODY = {
    "model": MODEL,
    "stream": True,
    "stream_options": {"include_usage": True},
    "messages": [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy? Answer in one word."},
    ],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def proc_stats(pid: int) -> dict[str, int]:
    out = {"rss_kb": 0, "threads": 0, "fds": 0}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    out["rss_kb"] = int(line.split()[1])
                elif line.startswith("Threads:"):
                    out["threads"] = int(line.split()[1])
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        pass
    return out


@dataclass
class Sample:
    t: float
    rss_mb: float
    fds: int
    threads: int
    tasks: int | None = None
    requests: int = 0


@dataclass
class Result:
    variant: str
    clients: int
    duration: float
    requests: int = 0
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    rps: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    samples: list[Sample] = field(default_factory=list)
    settled: Sample | None = None  # after the clients stopped and their connections closed


class Load:
    def __init__(self, url: str, clients: int, duration: float) -> None:
        self.url = url + "/v1/chat/completions"
        self.clients = clients
        self.duration = duration
        self.requests = 0
        self.errors: dict[str, int] = {}
        self.latencies: list[float] = []
        self.tasks: set[asyncio.Task[Any]] = set()

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    async def client(self, session: aiohttp.ClientSession, stop_at: float) -> None:
        data = json.dumps(BODY).encode()
        headers = {"Content-Type": "application/json", "Authorization": "Bearer sk-bench"}
        while time.monotonic() < stop_at:
            started = time.perf_counter()
            try:
                async with session.post(self.url, data=data, headers=headers) as r:
                    raw = await r.read()
                    if r.status != 200:
                        self.error(f"status {r.status}")
                    elif not raw.rstrip().endswith(b"data: [DONE]"):
                        self.error("no [DONE]")
                    else:
                        self.requests += 1
                        self.latencies.append(time.perf_counter() - started)
            except Exception as exc:  # counted, never fatal: the run must report them
                self.error(type(exc).__name__)

    async def run(self, sampler: Any) -> None:
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            stop_at = time.monotonic() + self.duration
            for _ in range(self.clients):
                task = asyncio.create_task(self.client(session, stop_at))
                self.tasks.add(task)
            sampling = asyncio.create_task(sampler(self))
            self.tasks.add(sampling)
            await asyncio.gather(*[t for t in self.tasks if t is not sampling])
            sampling.cancel()
            await asyncio.gather(sampling, return_exceptions=True)


def summarise(result: Result, load: Load) -> None:
    result.requests = load.requests
    result.errors = sum(load.errors.values())
    result.error_kinds = dict(load.errors)
    result.rps = load.requests / load.duration
    if load.latencies:
        lat = sorted(load.latencies)
        result.p50_ms = statistics.median(lat) * 1000
        result.p99_ms = lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000


async def wait_http(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url) as r:
                    if r.status < 500:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def start_upstream(port: int, logs: Path) -> subprocess.Popen[bytes]:
    script = FAKE_UPSTREAM
    if not script.exists():
        raise SystemExit(f"fake upstream not found at {script}")
    with open(logs / "upstream.log", "wb") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen([sys.executable, str(script), "--host", "127.0.0.1", "--port", str(port)],
                                stdout=subprocess.DEVNULL, stderr=log)


def write_config(upstream_port: int, folder: Path) -> Path:
    path = folder / "ctxproxy.yaml"
    path.write_text(json.dumps({  # JSON is YAML
        "server": {"drain_timeout": 5},
        "upstreams": {"fake": {"base_url": f"http://127.0.0.1:{upstream_port}/v1", "api_key": "sk-upstream"}},
        "models": [{"name": MODEL, "context_window": 128000, "max_output_tokens": 16384}],
        "cache": {"backend": "memory"},
        "logging": {"level": "INFO", "requests": True},
    }))
    return path


def stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def run_process(args: argparse.Namespace, folder: Path) -> Result:
    up_port, proxy_port = free_port(), free_port()
    upstream = start_upstream(up_port, folder)
    proxy: subprocess.Popen[bytes] | None = None
    try:
        config = write_config(up_port, folder)
        env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True", LITELLM_TELEMETRY="False")
        with open(folder / "proxy.log", "wb") as log:
            proxy = subprocess.Popen([sys.executable, "-m", "proxy.cli", "serve", "--config", str(config),
                                      "--host", "127.0.0.1", "--port", str(proxy_port)], cwd=ROOT, env=env,
                                     stdout=subprocess.DEVNULL, stderr=log)
        url = f"http://127.0.0.1:{proxy_port}"
        await wait_http(f"http://127.0.0.1:{up_port}/v1/models")
        await wait_http(url + "/healthz")
        pid = proxy.pid
        result = Result("process", args.clients, args.duration)
        started = time.monotonic()

        async def sampler(load: Load) -> None:
            while True:
                st = proc_stats(pid)
                result.samples.append(Sample(round(time.monotonic() - started, 1), st["rss_kb"] / 1024, st["fds"],
                                             st["threads"], None, load.requests))
                await asyncio.sleep(args.sample)

        load = Load(url, args.clients, args.duration)
        await load.run(sampler)
        summarise(result, load)
        await asyncio.sleep(1.0)  # let the closed connections go
        st = proc_stats(pid)
        result.settled = Sample(round(time.monotonic() - started, 1), st["rss_kb"] / 1024, st["fds"], st["threads"],
                                None, load.requests)
        return result
    finally:
        stop(proxy)
        stop(upstream)


async def run_inprocess(args: argparse.Namespace, folder: Path) -> Result:
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    from aiohttp import web

    from proxy.core.tokens import use_bundled_encodings
    from proxy.serve.app import create_app
    from proxy.serve.server import setup_logging
    from proxy.settings import load_config

    use_bundled_encodings()
    up_port = free_port()
    upstream = start_upstream(up_port, folder)
    runner: web.AppRunner | None = None
    try:
        config = load_config(write_config(up_port, folder))
        setup_logging("WARNING")  # the request log would go to this terminal; the process variant keeps it
        app = create_app(config)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        url = f"http://127.0.0.1:{port}"
        await wait_http(f"http://127.0.0.1:{up_port}/v1/models")
        pid = os.getpid()
        result = Result("inprocess", args.clients, args.duration)
        started = time.monotonic()
        gc.collect()
        baseline_tasks = len(asyncio.all_tasks())
        base = proc_stats(pid)
        result.samples.append(Sample(0.0, base["rss_kb"] / 1024, base["fds"], base["threads"], baseline_tasks - 1, 0))

        async def sampler(load: Load) -> None:
            while True:
                await asyncio.sleep(args.sample)
                st = proc_stats(pid)
                proxy_tasks = len(asyncio.all_tasks() - load.tasks) - 1  # less run()'s own task
                result.samples.append(Sample(round(time.monotonic() - started, 1), st["rss_kb"] / 1024, st["fds"],
                                             st["threads"], proxy_tasks, load.requests))

        load = Load(url, args.clients, args.duration)
        await load.run(sampler)
        summarise(result, load)
        await asyncio.sleep(1.0)
        gc.collect()
        st = proc_stats(pid)
        result.settled = Sample(round(time.monotonic() - started, 1), st["rss_kb"] / 1024, st["fds"], st["threads"],
                                len(asyncio.all_tasks()) - 1, load.requests)
        return result
    finally:
        if runner is not None:
            await runner.cleanup()
        stop(upstream)


def report(result: Result) -> str:
    lines = [f"## {result.variant}: {result.clients} streaming clients x {result.duration:g}s",
             f"requests {result.requests}  errors {result.errors} {result.error_kinds or ''}  "
             f"rps {result.rps:.0f}  p50 {result.p50_ms:.1f} ms  p99 {result.p99_ms:.1f} ms",
             "",
             "| t (s) | requests | RSS (MB) | open fds | threads | asyncio tasks |",
             "|---:|---:|---:|---:|---:|---:|"]
    for s in [*result.samples, *([result.settled] if result.settled else [])]:
        tasks = "" if s.tasks is None else str(s.tasks)
        mark = " (settled)" if s is result.settled else ""
        lines.append(f"| {s.t:g}{mark} | {s.requests} | {s.rss_mb:.1f} | {s.fds} | {s.threads} | {tasks} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--sample", type=float, default=5.0, help="seconds between samples")
    ap.add_argument("--variant", choices=["process", "inprocess", "both"], default="both")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="ctxproxy-load-") as tmp:
        folder = Path(tmp)
        if args.variant in ("process", "both"):
            results.append(asyncio.run(run_process(args, folder)))
            print(report(results[-1]), flush=True)
        if args.variant in ("inprocess", "both"):
            results.append(asyncio.run(run_inprocess(args, folder)))
            print(report(results[-1]), flush=True)
    if args.json_out:
        args.json_out.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0 if all(r.errors == 0 and r.requests > 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
