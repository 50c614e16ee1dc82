"""``ctxproxy serve`` as a real process: ready line, a request, SIGTERM drain, and config errors before binding."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from tests.fake_upstream import REPLY, FakeUpstream

CTXPROXY = Path(sys.executable).parent / "ctxproxy"
MODEL = "gpt-4o-mini"
MESSAGES = [{"role": "user", "content": "Hello from a real process."}]
DRAIN = 5.0
READY = re.compile(r"ctxproxy listening on http://([\d.]+):(\d+)")

pytestmark = pytest.mark.skipif(not CTXPROXY.is_file(), reason="the ctxproxy console script is not installed")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_config(tmp_path: Path, upstream: FakeUpstream, **server: Any) -> Path:
    config = {
        "server": {"host": "127.0.0.1", "drain_timeout": DRAIN, **server},
        "upstreams": {"fake": {"base_url": upstream.base_url, "api_key": "sk-upstream-secret"}},
        "models": [{"name": MODEL, "context_window": 128000, "max_output_tokens": 16384}],
        "cache": {"backend": "memory"},
        "logging": {"level": "INFO"},
    }
    path = tmp_path / "ctxproxy.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


class Served:
    def __init__(self, proc: asyncio.subprocess.Process, port: int) -> None:
        self.proc = proc
        self.port = port
        self.lines: list[str] = []
        self.ready = asyncio.get_running_loop().create_future()
        self.reader = asyncio.ensure_future(self._read())

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def _read(self) -> None:
        assert self.proc.stderr is not None
        async for raw in self.proc.stderr:  # drained to the end, so the pipe never fills up
            line = raw.decode(errors="replace").rstrip("\n")
            self.lines.append(line)
            if not self.ready.done() and READY.search(line):
                self.ready.set_result(line)

    async def wait_exit(self, timeout: float) -> int:
        code = await asyncio.wait_for(self.proc.wait(), timeout)
        await asyncio.wait_for(self.reader, 5)
        return code


@contextlib.asynccontextmanager
async def serve(config: Path, port: int) -> AsyncIterator[Served]:
    proc = await asyncio.create_subprocess_exec(
        str(CTXPROXY), "serve", "--config", str(config), "--port", str(port),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    served = Served(proc, port)
    try:
        await asyncio.wait([served.ready, served.reader], timeout=30,
                           return_when=asyncio.FIRST_COMPLETED)
        assert served.ready.done(), "never ready:\n" + "\n".join(served.lines)
        yield served
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        served.reader.cancel()


async def test_serve_answers_then_exits_0_on_sigterm(upstream: FakeUpstream, tmp_path: Path) -> None:
    port = free_port()
    async with serve(write_config(tmp_path, upstream), port) as served:
        host, bound = READY.search(served.ready.result()).groups()  # type: ignore[union-attr]
        assert (host, int(bound)) == ("127.0.0.1", port)
        async with openai.AsyncOpenAI(base_url=served.base_url, api_key="sk-client", max_retries=0) as c:
            raw = await c.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES)
            stream = await c.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)
            text = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
        assert raw.parse().choices[0].message.content == REPLY
        assert text == REPLY
        assert "x-ctxproxy-tokens-in" in raw.headers
        assert len(upstream.chat) == 2
        assert upstream.chat[0].headers["Authorization"] == "Bearer sk-upstream-secret"
        started = time.monotonic()
        served.proc.send_signal(signal.SIGTERM)
        assert await served.wait_exit(DRAIN + 5) == 0
        assert time.monotonic() - started < DRAIN
    log = "\n".join(served.lines)
    assert "Traceback" not in log
    assert "sk-upstream-secret" not in log and "sk-client" not in log  # keys are never logged


async def test_sigterm_lets_slow_stream_finish(upstream: FakeUpstream, tmp_path: Path) -> None:
    upstream.mode, upstream.delay = "slow_first_byte", 1.0
    port = free_port()
    async with serve(write_config(tmp_path, upstream), port) as served:
        async with openai.AsyncOpenAI(base_url=served.base_url, api_key="sk-client", max_retries=0) as c:

            async def consume() -> tuple[str, list[str]]:
                stream = await c.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                                         stream_options={"include_usage": True})
                text, finishes = "", []
                async for ch in stream:
                    if ch.choices:
                        text += ch.choices[0].delta.content or ""
                        if ch.choices[0].finish_reason:
                            finishes.append(ch.choices[0].finish_reason)
                return text, finishes

            task = asyncio.ensure_future(consume())
            deadline = time.monotonic() + 10
            while upstream.active == 0 and time.monotonic() < deadline:  # the request reached the upstream
                await asyncio.sleep(0.01)
            assert upstream.active == 1
            sent_at = time.monotonic()
            served.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            assert not task.done(), "the in-flight stream was cut at SIGTERM"
            # draining: the listening socket is closed, a new connection is refused
            with pytest.raises(openai.APIConnectionError):
                async with openai.AsyncOpenAI(base_url=served.base_url, api_key="k", max_retries=0) as c2:
                    await c2.chat.completions.create(model=MODEL, messages=MESSAGES)
            text, finishes = await asyncio.wait_for(task, 10)
        assert text == REPLY
        assert finishes == ["stop"]
        assert await served.wait_exit(DRAIN + 5) == 0
        assert time.monotonic() - sent_at < DRAIN
    assert "Traceback" not in "\n".join(served.lines)


async def _run(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(str(CTXPROXY), *args, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


INVALID = """\
server:
  port: 99999
  drain_timeout: -1
  bogus: 1
upstreams:
  fake:
    base_url: ftp://not-http
    api_key: ${CTXPROXY_TEST_UNSET_VARIABLE_FOR_CLI}
models:
  - name: m
    context_window: 0
"""


@pytest.mark.parametrize("text", [INVALID, "context_manager: nope\nupstreams: {u: {base_url: 'http://x'}}\n",
                                  "server: [unclosed\n"], ids=["fields", "binding", "yaml"])
async def test_invalid_config_exits_2_before_binding(tmp_path: Path, text: str) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(text, encoding="utf-8")
    with socket.socket() as holder:  # the port is taken: binding it would fail differently
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        (serve_rc, _, serve_err), (val_rc, val_out, val_err) = await asyncio.gather(
            _run("serve", "--config", str(config), "--port", str(port)), _run("validate", str(config)))
    assert serve_rc == 2 and val_rc == 2
    assert serve_err == val_err
    assert val_out == ""
    assert "listening" not in serve_err and "Traceback" not in serve_err
    lines = serve_err.strip().splitlines()
    assert lines and all(":" in line for line in lines)
    if text is INVALID:
        for key in ("server.port", "server.drain_timeout", "server.bogus", "upstreams.fake.base_url",
                    "upstreams.fake.api_key", "models[0].context_window"):
            assert any(line.startswith(key) for line in lines), (key, lines)


async def test_valid_config_validates(upstream: FakeUpstream, tmp_path: Path) -> None:
    rc, out, err = await _run("validate", str(write_config(tmp_path, upstream)))
    assert (rc, out.strip(), err) == (0, "ok", "")


async def test_workers_share_one_port_and_aggregate_metrics(upstream: FakeUpstream, tmp_path: Path) -> None:
    """`ctxproxy serve --workers 2`: two processes on one port (SO_REUSEPORT); /metrics sums them."""
    import aiohttp

    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        str(CTXPROXY), "serve", "--config", str(write_config(tmp_path, upstream)), "--port", str(port),
        "--workers", "2", stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    pids: set[str] = set()
    try:
        assert proc.stderr is not None
        while len(pids) < 2:
            line = (await asyncio.wait_for(proc.stderr.readline(), 30)).decode()
            assert line, "the workers did not start"
            match = re.search(r"listening on .* \(pid (\d+)\)", line)
            if match:
                pids.add(match.group(1))
        async with aiohttp.ClientSession() as s:
            for _ in range(20):
                async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                                  json={"model": MODEL, "messages": MESSAGES}) as r:
                    assert r.status == 200
            async with s.get(f"http://127.0.0.1:{port}/metrics") as r:
                text = await r.text()
        total = sum(
            float(v) for v in re.findall(r'^ctxproxy_requests_total\{[^}]*status="200"[^}]*\} (\S+)$', text, re.M)
        )
        assert total == 20
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), DRAIN + 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_a_malformed_request_is_logged_in_one_line_without_its_bytes(
        upstream: FakeUpstream, tmp_path: Path) -> None:
    """aiohttp quotes the offending header in its traceback; the log keeps one line naming the error."""
    port = free_port()
    async with serve(write_config(tmp_path, upstream), port) as served:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-LEAKED-"
                     + b"k" * 9000 + b"\r\nContent-Length: 2\r\n\r\n{}")
        await writer.drain()
        head = await asyncio.wait_for(reader.read(200), 10)
        writer.close()
        assert head.startswith(b"HTTP/1.") and b" 400 " in head
        await asyncio.sleep(0.5)
        served.proc.send_signal(signal.SIGTERM)
        assert await served.wait_exit(DRAIN + 5) == 0
    log = "\n".join(served.lines)
    assert "sk-LEAKED" not in log and "Traceback" not in log
    assert "LineTooLong" in log


async def test_the_metrics_port_serves_metrics_without_a_key_on_loopback(
        upstream: FakeUpstream, tmp_path: Path) -> None:
    """`server.metrics_port`: a second listener, on 127.0.0.1 unless told otherwise, that serves GET /metrics with no
    key (summed over the workers, which share it) and nothing else; the main port's /metrics then needs the admin
    key, since tenants are configured."""
    import aiohttp

    port, metrics_port = free_port(), free_port()
    path = write_config(tmp_path, upstream, metrics_port=metrics_port)
    config = yaml.safe_load(path.read_text(encoding="utf-8"))
    config["tenants"] = [{"name": "acme", "keys": ["sk-acme"]}]
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    proc = await asyncio.create_subprocess_exec(
        str(CTXPROXY), "serve", "--config", str(path), "--port", str(port), "--workers", "2",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    announced = 0
    try:
        assert proc.stderr is not None
        while announced < 2:
            line = (await asyncio.wait_for(proc.stderr.readline(), 30)).decode()
            assert line, "the workers did not start"
            announced += f"ctxproxy metrics on http://127.0.0.1:{metrics_port}/metrics" in line
        async with aiohttp.ClientSession() as s:
            for _ in range(6):
                async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions", headers={
                        "Authorization": "Bearer sk-acme"}, json={"model": MODEL, "messages": MESSAGES}) as r:
                    assert r.status == 200
            async with s.get(f"http://127.0.0.1:{port}/metrics") as r:
                assert r.status == 401
            async with s.get(f"http://127.0.0.1:{metrics_port}/metrics") as r:
                assert r.status == 200
                text = await r.text()
            async with s.get(f"http://127.0.0.1:{metrics_port}/v1/models") as r:
                assert r.status == 404 and (await r.json())["error"]["code"] == "not_found"
            async with s.post(f"http://127.0.0.1:{metrics_port}/v1/chat/completions", json={}) as r:
                assert r.status == 404
        total = sum(float(v) for v in re.findall(
            r'^ctxproxy_requests_total\{[^}]*status="200"[^}]*tenant="acme"[^}]*\} (\S+)$', text, re.M))
        assert total == 6
        with pytest.raises(OSError):  # loopback only: not reachable on another address of the host
            socket.create_connection(("127.0.0.2", metrics_port), timeout=2).close()
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), DRAIN + 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_the_metrics_port_must_differ_from_the_port(upstream: FakeUpstream, tmp_path: Path) -> None:
    rc, _out, err = await _run("validate", str(write_config(tmp_path, upstream, port=8123, metrics_port=8123)))
    assert rc != 0 and "server.metrics_port: must differ from server.port" in err


def sighup_held(pid: int) -> bool:
    """Whether ``pid`` blocks SIGHUP (bit 0 of SigBlk in /proc/<pid>/status)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    match = re.search(r"^SigBlk:\s*([0-9a-f]+)$", status, re.M)
    return bool(match and int(match.group(1), 16) & 1)


async def test_a_sighup_before_the_server_listens_is_handled_once_it_does(upstream: FakeUpstream,
                                                                         tmp_path: Path) -> None:
    """SIGHUP's default action ends a process: one sent while `serve` was still loading killed it."""
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        str(CTXPROXY), "serve", "--config", str(write_config(tmp_path, upstream)), "--port", str(port),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    served = Served(proc, port)
    try:
        deadline = time.monotonic() + 10
        while not sighup_held(proc.pid):  # held from the start, long before it listens
            assert time.monotonic() < deadline and proc.returncode is None, "SIGHUP is never held while it starts"
            await asyncio.sleep(0.002)
        assert not served.ready.done()
        proc.send_signal(signal.SIGHUP)
        await asyncio.wait([served.ready, served.reader], timeout=30, return_when=asyncio.FIRST_COMPLETED)
        assert served.ready.done(), f"exited {proc.returncode}:\n" + "\n".join(served.lines)
        for _ in range(100):
            if any("config reloaded from" in line for line in served.lines):
                break
            await asyncio.sleep(0.05)
        assert any("config reloaded from" in line for line in served.lines), served.lines
        async with openai.AsyncOpenAI(base_url=served.base_url, api_key="sk-client", max_retries=0) as c:
            await c.chat.completions.create(model=MODEL, messages=MESSAGES)
        proc.send_signal(signal.SIGTERM)
        assert await served.wait_exit(DRAIN + 5) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_a_port_in_use_is_said_in_one_log_line(upstream: FakeUpstream, tmp_path: Path) -> None:
    """A failure to start is logged through the same queue as everything else, before it is stopped: exit 1 and
    one JSON line naming the cause, not a traceback printed after the log writer is gone (or nothing)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        rc, out, err = await _run("serve", "--config", str(write_config(tmp_path, upstream)), "--port", str(port))
    assert rc == 1 and out == ""
    (line,) = [json.loads(text) for text in err.splitlines()]
    assert line["level"] == "CRITICAL" and "address already in use" in line["message"]
