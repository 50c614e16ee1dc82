"""Three ctxproxy replicas on one real redis-server behind a real nginx: the deployment
the docs recommend for more than one process.

nginx runs the shipped ``deploy/nginx/ctxproxy.conf`` (only the replica addresses and the listen port
are rewritten to this test's free ports on 127.0.0.1). Six agents hold growing conversations through
nginx, in pairs that share a history (as a retried or forked agent does), so two replicas need the same
summary at the same moment and single flight across replicas is what keeps it to one call. One replica
is SIGKILLed while requests are in flight on it; the client retries only requests that failed.

Shown: no client error except requests in flight on the killed replica (each succeeds on retry), one
completed summariser call per distinct summarised content across all replicas, and /metrics of every
live replica counting requests.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from tests.check._support import ROOT, ctxproxy_command, env, free_port, processes, record, start_process
from tests.redis_server import RedisServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NGINX_CONF = ROOT / "deploy" / "nginx" / "ctxproxy.conf"
MODEL = "agent-model"
REPLICAS = 3
HISTORIES = 3              # distinct conversations; each is driven by two agents at once
AGENTS = 2 * HISTORIES
STEPS = 15                 # growing requests per agent
SUMMARY_DELAY = 0.8        # seconds a summariser call takes at the fake upstream
CHAT_DELAY = 0.5           # seconds a chat answer takes (non-streaming), spread over chunks when streaming
KILL_AFTER = 2 * AGENTS * STEPS // 5   # completed requests before the kill (~40 % into the run)
READY = re.compile(r"ctxproxy listening on http://[\d.]+:(\d+)")


# --------------------------------------------------------------------------- the fake provider


@dataclass
class Call:
    replica: int
    purpose: str
    request_id: str
    content: str = ""
    state: str = "active"  # active | done | cancelled


@dataclass
class Provider:
    """An OpenAI-shaped fake that tells replicas apart by their upstream key (sk-replica-N)."""

    calls: list[Call] = field(default_factory=list)
    url: str = ""
    _runner: web.AppRunner | None = None

    async def start(self) -> Provider:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1"  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def active(self, replica: int, purpose: str) -> int:
        return sum(1 for c in self.calls if c.replica == replica and c.purpose == purpose and c.state == "active")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        key = request.headers.get("Authorization", "").rsplit("-", 1)[-1]
        purpose = request.headers.get("x-ctxproxy-purpose", "chat")
        call = Call(int(key) if key.isdigit() else -1, purpose, request.headers.get("X-Request-Id", ""))
        self.calls.append(call)
        try:
            if purpose == "summarize":
                call.content = hashlib.sha256(json.dumps(body["messages"], sort_keys=True).encode()).hexdigest()
                await asyncio.sleep(SUMMARY_DELAY)
                text = f"Summary {call.content[:12]}: the user (ids, refs and prices kept) asked about bookings."
                usage = {"prompt_tokens": 900, "completion_tokens": 40, "total_tokens": 940}
                response: web.StreamResponse = web.json_response(_completion(text, usage))
            elif body.get("stream"):
                response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await response.prepare(request)
                await response.write(_chunk({"role": "assistant", "content": ""}))
                for piece in ("Checked.", " Seat 14C", " is confirmed", " for you."):
                    await asyncio.sleep(CHAT_DELAY / 4)
                    await response.write(_chunk({"content": piece}))
                await response.write(_chunk({}, "stop", {"prompt_tokens": 10, "completion_tokens": 8,
                                                         "total_tokens": 18}))
                await response.write(b"data: [DONE]\n\n")
                await response.write_eof()
            else:
                await asyncio.sleep(CHAT_DELAY)
                response = web.json_response(_completion("Checked. Seat 14C is confirmed for you.",
                                                         {"prompt_tokens": 10, "completion_tokens": 8,
                                                          "total_tokens": 18}))
            call.state = "done"
            return response
        except asyncio.CancelledError:
            call.state = "cancelled"
            raise


def _completion(text: str, usage: dict[str, int]) -> dict[str, Any]:
    return {"id": "chatcmpl-x", "object": "chat.completion", "created": 0, "model": MODEL, "usage": usage,
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}]}


def _chunk(delta: dict[str, Any], finish: str | None = None, usage: Any = None) -> bytes:
    d: dict[str, Any] = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
                         "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage:
        d["usage"] = usage
    return b"data: " + json.dumps(d).encode() + b"\n\n"


# --------------------------------------------------------------------------- conversations


def turn(h: int, i: int) -> list[dict[str, Any]]:
    ref, call_id = f"H{h}R{i:03d}", f"call_{h}_{i}"
    tool = (f"Reservation {ref}: flight HAT{100 + i} SFO-JFK on 2024-05-{10 + i % 20}, seat {i % 30}C, cabin "
            f"economy, paid {400 + 7 * i + h} USD with credit_card_{4000 + h}; one checked bag; status "
            f"confirmed. ") * 3
    return [
        {"role": "user", "content": f"[{h}] Turn {i}: check reservation {ref}, its seat and what I paid."},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function", "function": {
            "name": "get_reservation_details", "arguments": json.dumps({"reservation_id": ref})}}]},
        {"role": "tool", "tool_call_id": call_id, "content": tool},
        {"role": "assistant", "content": f"{ref}: seat {i % 30}C, paid {400 + 7 * i + h} USD."},
    ]


def history(h: int, step: int) -> list[dict[str, Any]]:
    turns = 6 + 2 * step  # 8 .. 36 turns: over the summary threshold from about step 4
    messages: list[dict[str, Any]] = [{"role": "system", "content": f"You are airline agent #{h}."}]
    for i in range(turns - 1):
        messages += turn(h, i)
    messages.append({"role": "user", "content": f"[{h}] Turn {turns - 1}: anything else I should know?"})
    return messages


def replica_config(provider: Provider, redis_url: str, n: int) -> dict[str, Any]:
    return {
        "server": {"host": "127.0.0.1", "drain_timeout": 5},
        # the key tells the fake provider which replica called; everything else is identical
        "upstreams": {"provider": {"base_url": provider.url, "api_key": f"sk-replica-{n}"}},
        "models": [{"name": MODEL, "context_window": 4000, "max_output_tokens": 500}],
        "allow_unknown_models": False,
        "context_manager": {"type": "summarising", "params": {"keep_turns": 3}},
        "summarizer_model": MODEL,
        "summarizer": {"timeout_seconds": 10, "retry_backoff_seconds": 0, "lock_wait_seconds": 30},
        "cache": {"backend": "redis", "url": redis_url},
        "logging": {"level": "INFO"},
    }


# --------------------------------------------------------------------------- nginx


def nginx_config(prefix: Path, listen: int, ports: list[int]) -> Path:
    """The shipped file with this test's addresses, included from a minimal nginx.conf in ``prefix``."""
    shipped = NGINX_CONF.read_text(encoding="utf-8")
    servers = re.findall(r"^\s*server ctxproxy-\d+:8080[^;]*;\s*$", shipped, re.M)
    assert len(servers) == len(ports), servers
    for line, port in zip(servers, ports):
        shipped = shipped.replace(line, re.sub(r"ctxproxy-\d+:8080", f"127.0.0.1:{port}", line), 1)
    shipped, n = re.subn(r"^(\s*)listen 8080;", rf"\1listen 127.0.0.1:{listen};", shipped, flags=re.M)
    assert n == 1
    (prefix / "ctxproxy.conf").write_text(shipped, encoding="utf-8")
    for d in ("body", "proxy", "fastcgi", "uwsgi", "scgi", "logs"):
        (prefix / d).mkdir(exist_ok=True)
    main = f"""
daemon off;
worker_processes 1;
pid {prefix}/nginx.pid;
error_log stderr warn;
events {{ worker_connections 512; }}
http {{
    log_format check '$http_x_request_id $upstream_addr $status "$upstream_status" $request_time';
    access_log {prefix}/logs/access.log check;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    include {prefix}/ctxproxy.conf;
}}
"""
    path = prefix / "nginx.conf"
    path.write_text(main, encoding="utf-8")
    return path


# --------------------------------------------------------------------------- the client


@dataclass
class Attempt:
    agent: int
    step: int
    request_id: str
    started: float
    ok: bool = False
    error: str = ""
    summary: str = ""


async def send(session: aiohttp.ClientSession, url: str, agent: int, step: int, attempts: list[Attempt]) -> bool:
    stream = (agent + step) % 2 == 0
    body = {"model": MODEL, "messages": history(agent // 2, step), "stream": stream}
    attempt = Attempt(agent, step, str(uuid.uuid4()), time.monotonic())
    attempts.append(attempt)
    try:
        async with session.post(url + "/v1/chat/completions", json=body,
                                headers={"x-request-id": attempt.request_id}) as r:
            raw = await r.read()
            attempt.summary = r.headers.get("x-ctxproxy-summary", "")
            if r.status != 200:
                attempt.error = f"status {r.status}: {raw[:200]!r}"
            elif stream and not (raw.endswith(b"data: [DONE]\n\n") and b'"finish_reason": "stop"' in raw):
                attempt.error = f"stream cut: {raw[-120:]!r}"
            elif not stream and json.loads(raw)["choices"][0]["finish_reason"] != "stop":
                attempt.error = "no finish_reason"
            else:
                attempt.ok = True
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        attempt.error = f"{type(exc).__name__}: {exc}"
    return attempt.ok


async def agent_loop(session: aiohttp.ClientSession, url: str, agent: int, attempts: list[Attempt],
                     done: list[int]) -> None:
    for step in range(1, STEPS + 1):
        for _ in range(3):  # the first try, and retries of a failed request only
            if await send(session, url, agent, step, attempts):
                break
        else:
            raise AssertionError(f"agent {agent} step {step} failed three times")
        done.append(1)


async def scrape(session: aiohttp.ClientSession, port: int) -> dict[str, float]:
    async with session.get(f"http://127.0.0.1:{port}/metrics") as r:
        text = await r.text()
    out: dict[str, float] = defaultdict(float)
    for name, labels, value in re.findall(r"^(ctxproxy_\w+_total)(\{[^}]*\})? (\S+)$", text, re.M):
        out[name] += float(value)
        if name in ("ctxproxy_summaries_total", "ctxproxy_background_summaries_total"):
            prefix = "summaries_" if name == "ctxproxy_summaries_total" else "background_"
            out[prefix + re.search(r'result="(\w+)"', labels).group(1)] += float(value)  # type: ignore[union-attr]
    return dict(out)


# --------------------------------------------------------------------------- the test


async def test_three_replicas_behind_nginx_survive_a_kill_with_one_summary_each(tmp_path: Path) -> None:
    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").is_file() else None)
    if nginx is None:
        pytest.skip("nginx not installed (apt-get install nginx)")
    with RedisServer.started() as redis:  # skips when redis-server is missing
        provider = await Provider().start()
        prefix = Path(tempfile.mkdtemp(prefix="ctxproxy-nginx-"))
        prefix.chmod(0o755)  # nginx's worker (nobody) reads its temp dirs
        try:
            async with processes() as procs:
                ports = [free_port() for _ in range(REPLICAS)]
                replicas = []
                for n, port in enumerate(ports):
                    cfg = tmp_path / f"replica{n}.yaml"
                    cfg.write_text(yaml.safe_dump(replica_config(provider, redis.url, n)), encoding="utf-8")
                    proc = await start_process([*ctxproxy_command(), "serve", "--config", str(cfg), "--port",
                                                str(port)], f"replica{n}", ready=READY, env=env())
                    procs.append(proc)
                    replicas.append(proc)
                for proc in replicas:
                    await proc.wait_ready(60)
                listen = free_port()
                conf = nginx_config(prefix, listen, ports)
                check = subprocess.run([nginx, "-t", "-e", "stderr", "-p", str(prefix), "-c", str(conf)],
                                       capture_output=True, text=True, check=False)
                assert check.returncode == 0, check.stderr
                lb = await start_process([nginx, "-e", "stderr", "-p", str(prefix), "-c", str(conf)], "nginx",
                                         env=env())
                procs.append(lb)
                url = f"http://127.0.0.1:{listen}"
                deadline = time.monotonic() + 20
                async with aiohttp.ClientSession() as s:
                    while True:
                        try:
                            async with s.get(url + "/nginx-healthz") as r:
                                if r.status == 200:
                                    break
                        except aiohttp.ClientError:
                            pass
                        assert time.monotonic() < deadline, "nginx never answered:\n" + lb.log
                        await asyncio.sleep(0.1)

                attempts: list[Attempt] = []
                done: list[int] = []
                victim = 1
                killed_at = 0.0
                in_flight_at_kill: list[str] = []
                timeout = aiohttp.ClientTimeout(total=60)
                started = time.monotonic()
                async with aiohttp.ClientSession(timeout=timeout) as session:
                    agents = [asyncio.ensure_future(agent_loop(session, url, a, attempts, done))
                              for a in range(AGENTS)]
                    # kill the victim once the run is well under way, at a moment when chat requests are in
                    # flight on it and none of its summariser calls is (a summary lost with its process
                    # would be made again by another replica: a second call, legitimately)
                    deadline = time.monotonic() + 120
                    while len(done) < KILL_AFTER or not (provider.active(victim, "chat") >= 1
                                                         and provider.active(victim, "summarize") == 0):
                        assert time.monotonic() < deadline, "never found a moment to kill the replica"
                        assert not all(a.done() for a in agents), "the run ended before the kill"
                        await asyncio.sleep(0.005)
                    in_flight_at_kill = [c.request_id for c in provider.calls
                                         if c.replica == victim and c.state == "active" and c.purpose == "chat"]
                    replicas[victim].send_signal(signal.SIGKILL)
                    killed_at = time.monotonic()
                    await asyncio.gather(*agents)
                    elapsed = time.monotonic() - started
                    metrics = {f"replica{n}": await scrape(session, p) for n, p in enumerate(ports) if n != victim}
                assert await replicas[victim].wait(10) == -signal.SIGKILL
                await lb.stop(signal.SIGQUIT)
                access = (prefix / "logs" / "access.log").read_text(encoding="utf-8").splitlines()
        finally:
            await provider.stop()
            shutil.rmtree(prefix, ignore_errors=True)

    # ---- the client's view: only requests in flight on the killed replica failed, each retried once
    failed = [a for a in attempts if not a.ok]
    routed: dict[str, str] = {}  # request id -> the replica address(es) nginx tried, in order
    for line in access:
        m = re.match(r'^(\S+) (.+?) (\d{3}) "', line)
        if m:
            routed[m.group(1)] = m.group(2)
    victim_addr = f"127.0.0.1:{ports[victim]}"
    for a in failed:
        assert victim_addr in routed.get(a.request_id, ""), (a, routed.get(a.request_id))
        assert a.started < killed_at + 1.0, f"a request sent {a.started - killed_at:.2f}s after the kill failed: {a}"
        retry = [b for b in attempts if (b.agent, b.step) == (a.agent, a.step) and b.started > a.started]
        # a retry sent while the victim's socket is still being torn down can reach it too (nginx does not
        # resend a POST it already sent): the step must succeed within the client's three tries
        assert any(b.ok for b in retry), f"no retry of {a} succeeded"
    assert len(failed) <= len(in_flight_at_kill) + 3, (failed, in_flight_at_kill)
    steps = Counter((a.agent, a.step) for a in attempts if a.ok)
    assert set(steps) == {(a, s) for a in range(AGENTS) for s in range(1, STEPS + 1)}
    assert max(steps.values()) == 1

    # ---- single flight: one completed summariser call per distinct summarised content, across replicas
    summaries = [c for c in provider.calls if c.purpose == "summarize"]
    completed = Counter(c.content for c in summaries if c.state == "done")
    assert completed, "no summary was ever made: the conversations never crossed the threshold"
    assert max(completed.values()) == 1, {k[:12]: v for k, v in completed.items() if v > 1}
    by_replica = Counter(c.replica for c in summaries if c.state == "done")
    created = sum(1 for a in attempts if a.ok and a.summary in ("created", "waited"))
    reused = sum(1 for a in attempts if a.ok and a.summary == "reused")
    # most summaries are made in the background (no request says it created one): requests reuse them
    assert reused > created and reused > 0

    # ---- metrics from every live replica
    for name, scraped in metrics.items():
        assert scraped.get("ctxproxy_requests_total", 0) > 0, (name, scraped)
    served = Counter(c.replica for c in provider.calls if c.purpose == "chat")
    assert all(served[n] > 0 for n in range(REPLICAS)), served

    record("replicas", {
        "replicas": REPLICAS, "agents": AGENTS, "steps_per_agent": STEPS, "seconds": round(elapsed, 1),
        "requests_sent": len(attempts), "errors_before_retry": len(failed), "retries": len(failed),
        "failed_request_errors": sorted({a.error.split(":")[0] for a in failed}),
        "in_flight_on_victim_at_kill": len(in_flight_at_kill),
        "killed_after_completed_requests": KILL_AFTER,
        "summariser_calls": len(summaries), "summariser_calls_completed": sum(completed.values()),
        "summariser_calls_lost_with_the_victim": sum(1 for c in summaries if c.state != "done"),
        # a summary of more aged turns than the summariser's window takes several calls (chunks), each
        # with its own content: one completed call per distinct content is what single flight promises
        "distinct_summariser_contents": len(completed),
        "summariser_calls_by_replica": dict(sorted(by_replica.items())),
        "summaries_created_or_waited_for": created, "summaries_reused": reused,
        "background_summaries_made_by_live_replica": {k: v.get("background_made", 0) for k, v in metrics.items()},
        "chat_calls_by_replica": dict(sorted(served.items())),
        "nginx_retried_to_another_replica": sum(1 for v in routed.values() if "," in v),
        "metrics_requests_by_live_replica": {k: v.get("ctxproxy_requests_total", 0) for k, v in metrics.items()},
        "metrics_summaries_created_by_live_replica": {k: v.get("summaries_created", 0) for k, v in metrics.items()},
    })
