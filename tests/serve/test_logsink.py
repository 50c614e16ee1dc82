"""proxy.serve.logsink: the server's log is one JSON line per event, and a log reader that stalls never stalls
the proxy (lines are dropped and counted instead).

The outside tests run ``ctxproxy serve`` as a real process: one whose stderr (and stdout) is a pipe nobody
reads, one with ``provider: litellm`` routes whose own log lines used to be plain text.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from proxy.serve.logsink import FIELD_CHARS, PARTIAL_LINE, STRUCTURED, JsonFormatter, LogSink, PrintedLines
from tests.fake_upstream import FakeUpstream

CTXPROXY = Path(sys.executable).parent / "ctxproxy"
MODEL = "gpt-4o-mini"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello from a test that never reads stderr."}]}


# --------------------------------------------------------------------------- the sink on its own


@contextmanager
def pipe_sink(capacity: int) -> Iterator[tuple[LogSink, int]]:
    """A sink writing into a pipe; yields the sink and the pipe's read end (nobody reads it unless a test does)."""
    read_fd, write_fd = os.pipe()
    stream = os.fdopen(write_fd, "w", encoding="utf-8")
    sink = LogSink(stream, capacity).start()
    try:
        yield sink, read_fd
    finally:
        os.set_blocking(read_fd, False)  # let the writer thread finish whatever it is writing
        try:
            while os.read(read_fd, 1 << 20):
                pass
        except BlockingIOError:
            pass
        sink.stop(timeout=1)
        stream.close()
        os.close(read_fd)


def read_until(fd: int, marker: str, timeout: float = 10) -> list[str]:
    """The pipe's lines until one contains ``marker`` (read on this thread, with a deadline)."""
    data = b""
    deadline = time.monotonic() + timeout
    os.set_blocking(fd, False)
    while time.monotonic() < deadline:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            chunk = b""
        data += chunk
        if marker.encode() in data and data.endswith(b"\n"):
            return data.decode().splitlines()
        if not chunk:
            time.sleep(0.01)
    raise AssertionError(f"no {marker!r} within {timeout}s: {data[-500:]!r}")


def test_a_full_queue_drops_and_counts_lines_instead_of_waiting() -> None:
    """With nobody reading, the writer thread blocks on the pipe; callers must not: their lines are dropped."""
    counted: list[float] = []
    with pipe_sink(capacity=20) as (sink, read_fd):
        sink.count_drops(counted.append)
        line = json.dumps({"event": "request", "padding": "x" * 300})
        done = threading.Event()

        def produce() -> None:
            for _ in range(5000):  # 1.6 MB: 25 times what a pipe holds
                sink.put(line)
            done.set()

        threading.Thread(target=produce, daemon=True).start()
        assert done.wait(20), "putting a line waited for the reader"
        assert sink.dropped > 4000
        assert sum(counted) == sink.dropped
        lines = read_until(read_fd, '"log_dropped"')
    assert all(json.loads(text) for text in lines)
    notice = json.loads(next(text for text in lines if '"log_dropped"' in text))
    assert notice["dropped"] > 0 and notice["total"] >= notice["dropped"]
    assert notice["level"] == "WARNING"


def test_drops_before_the_metrics_exist_are_counted_when_they_attach() -> None:
    with pipe_sink(capacity=1) as (sink, _):
        for _ in range(5000):
            sink.put("{}")
        counted: list[float] = []
        sink.count_drops(counted.append)
        assert counted == [sink.dropped] and sink.dropped > 0


def test_stop_returns_within_its_timeout_when_the_reader_is_gone_quiet() -> None:
    with pipe_sink(capacity=10) as (sink, _):
        for _ in range(1000):
            sink.put("x" * 1000)
        started = time.monotonic()
        sink.stop(timeout=0.5)
        assert time.monotonic() - started < 2


def test_writers_sharing_one_pipe_never_cut_into_each_others_lines() -> None:
    """The workers of ``--workers N`` share one stderr. A pipe keeps a write of up to PIPE_BUF bytes in one
    piece, so each writer writes whole lines in writes no larger than that."""
    read_fd, write_fd = os.pipe()
    streams = [os.fdopen(os.dup(write_fd), "w", encoding="utf-8") for _ in range(3)]
    os.close(write_fd)
    sinks = [LogSink(stream, 100_000).start() for stream in streams]
    received = bytearray()

    def drain() -> None:
        while chunk := os.read(read_fd, 1000):  # a slow reader: the pipe is often full
            received.extend(chunk)
            time.sleep(0.0005)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    for n, sink in enumerate(sinks):
        for i in range(1500):
            sink.put(json.dumps({"event": "request", "writer": n, "i": i, "padding": "é" * (50 + i % 300)}))
    for sink, stream in zip(sinks, streams, strict=True):
        sink.stop(timeout=30)
        stream.close()
    reader.join(30)
    os.close(read_fd)
    lines = [json.loads(line) for line in received.decode().splitlines()]
    assert sorted((line["writer"], line["i"]) for line in lines) == [(n, i) for n in range(3) for i in range(1500)]


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads the thread's signal mask from /proc")
def test_the_writer_thread_takes_no_signal() -> None:
    """A supervisor waits for SIGTERM with it blocked (sigtimedwait): delivered to the writer thread instead,
    unblocked there, it would end the process at once and leave its workers running."""
    with pipe_sink(capacity=10) as (sink, read_fd):
        sink.put('{"event":"written"}')
        read_until(read_fd, "written")  # the thread runs: its mask is set
        status = Path(f"/proc/self/task/{sink._thread.native_id}/status").read_text()
    blocked = int(next(line for line in status.splitlines() if line.startswith("SigBlk:")).split()[1], 16)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
        assert blocked & (1 << (signum - 1)), signum.name


def record(msg: str, *args: Any, level: int = logging.WARNING, exc: bool = False, **extra: Any) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError("inner\nline two")
        except ValueError:
            exc_info = sys.exc_info()
    out = logging.LogRecord("some.lib", level, __file__, 1, msg, args, exc_info)
    out.__dict__.update(extra)
    return out


def test_every_record_is_one_json_object_on_one_line() -> None:
    formatter = JsonFormatter()
    plain = json.loads(formatter.format(record("multi\nline %s", "arg")))
    assert plain == {"event": "log", "level": "WARNING", "logger": "some.lib", "message": "multi\nline arg"}
    with_exc = formatter.format(record("failed", level=logging.ERROR, exc=True))
    assert "\n" not in with_exc
    assert "ValueError: inner\nline two" in json.loads(with_exc)["exception"]
    surrogate = formatter.format(record("lone \udc80 surrogate"))  # orjson refuses it; the line still goes out
    assert "\n" not in surrogate and json.loads(surrogate)["message"].startswith("lone ")
    structured = formatter.format(record('{"event":"request","status":200}', **STRUCTURED))  # type: ignore[arg-type]
    assert structured == '{"event":"request","status":200}'
    huge = json.loads(formatter.format(record("%s", "z" * 1_000_000)))  # a library logging a whole body
    assert len(huge["message"]) < FIELD_CHARS + 100 and huge["message"].endswith("characters cut]")


def test_a_record_that_cannot_be_formatted_becomes_an_error_line() -> None:
    with pipe_sink(capacity=10) as (sink, read_fd):
        sink.handler.handle(record("%d items", "not a number"))
        (line,) = [text for text in read_until(read_fd, "could not be formatted") if text]
    assert json.loads(line)["level"] == "ERROR"


def test_printed_text_becomes_one_log_line_per_line() -> None:
    with pipe_sink(capacity=100) as (sink, read_fd):
        out = PrintedLines(sink, "stdout", "INFO")
        print("first\n\nsecond", file=out)  # blank lines are not events
        out.write("held until its newline ")
        out.write("comes\n")
        out.write("y" * PARTIAL_LINE)  # a line that never ends is still logged, in pieces
        print("last", file=out, flush=True)
        lines = [json.loads(text) for text in read_until(read_fd, '"last"') if text]
    assert [line["message"][:30] for line in lines] == ["first", "second", "held until its newline comes",
                                                        "y" * 30, "last"]
    assert {(line["logger"], line["level"]) for line in lines} == {("stdout", "INFO")}


# --------------------------------------------------------------------------- ctxproxy serve, from the outside


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_config(tmp_path: Path, upstream: FakeUpstream, **extra: Any) -> Path:
    config: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "drain_timeout": 5},
        "upstreams": {"fake": {"base_url": upstream.base_url, "api_key": "sk-upstream-secret"}},
        "models": [{"name": MODEL, "context_window": 128000, "max_output_tokens": 16384}],
        "cache": {"backend": "memory"},
        "logging": {"level": "INFO"},
    }
    config.update(extra)
    path = tmp_path / "ctxproxy.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


async def wait_healthy(s: aiohttp.ClientSession, url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, "ctxproxy exited"
        try:
            async with s.get(url + "/healthz") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise AssertionError("ctxproxy never answered /healthz")


def dropped_metric(text: str) -> float:
    match = re.search(r"^ctxproxy_log_lines_dropped_total (\S+)$", text, re.M)
    assert match, "no ctxproxy_log_lines_dropped_total in /metrics"
    return float(match.group(1))


pytestmark_serve = pytest.mark.skipif(not CTXPROXY.is_file(), reason="the ctxproxy console script is not installed")


@pytestmark_serve
async def test_a_stderr_nobody_reads_does_not_stall_the_proxy(upstream: FakeUpstream, tmp_path: Path) -> None:
    """The request log went to stderr on the event loop: with a pipe nobody reads, the proxy froze after about a
    hundred requests, /healthz included. Now every request and every /healthz is answered, the lines that did
    not fit are dropped and counted, and what reaches the log is still one JSON object per line."""
    requests = 400
    config = write_config(tmp_path, upstream, logging={"level": "INFO", "queue_lines": 50})
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # stderr and stdout are pipes this test does not read until the end (Popen, not asyncio: asyncio would read)
    proc = subprocess.Popen([str(CTXPROXY), "serve", "--config", str(config), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            await wait_healthy(s, url, proc)
            for i in range(requests):
                body = {**CHAT, "stream": i % 4 == 0}
                async with s.post(url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200, f"request {i}"
                    await r.read()
                async with s.get(url + "/healthz") as r:
                    assert r.status == 200, f"/healthz after request {i}"
            async with s.get(url + "/metrics") as r:
                dropped = dropped_metric(await r.text())
        assert dropped > 0
        proc.send_signal(signal.SIGTERM)
        out, err = await asyncio.get_running_loop().run_in_executor(None, proc.communicate, None, 30)
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert out == b""  # nothing in the process writes to stdout
    lines = [json.loads(line) for line in err.decode().splitlines()]
    assert lines[0]["event"] == "listening" and f":{port}" in lines[0]["url"]
    logged = sum(line["event"] == "request" for line in lines)
    notices = [line for line in lines if line["event"] == "log_dropped"]
    assert notices and notices[-1]["total"] >= dropped
    assert logged < requests and logged + notices[-1]["total"] >= requests
    assert "Traceback" not in err.decode() and b"sk-upstream-secret" not in err


@pytestmark_serve
async def test_litellm_routes_log_json_lines_and_print_nothing(upstream: FakeUpstream, tmp_path: Path) -> None:
    """litellm gives its loggers a handler of its own: plain-text lines on stderr, its INFO lines on stdout,
    written on the event loop. Its records now reach the server's log like any other: as JSON lines."""
    routes = [{"name": "ll", "provider": "litellm", "upstream": "fake", "model": "openai/gpt-4o-mini",
               "context_window": 128000, "max_output_tokens": 1000},
              {"name": "ll-down", "provider": "litellm", "upstream": "down", "model": "openai/gpt-4o-mini",
               "context_window": 128000, "max_output_tokens": 1000}]
    config = write_config(tmp_path, upstream, models=routes, logging={"level": "DEBUG"},
                          upstreams={"fake": {"base_url": upstream.base_url, "api_key": "sk-upstream-secret"},
                                     "down": {"base_url": f"http://127.0.0.1:{free_port()}/v1", "api_key": "sk-d"}})
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([str(CTXPROXY), "serve", "--config", str(config), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    loop = asyncio.get_running_loop()
    err_reader = loop.run_in_executor(None, proc.stderr.read)  # type: ignore[union-attr]
    out_reader = loop.run_in_executor(None, proc.stdout.read)  # type: ignore[union-attr]
    statuses = []
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            await wait_healthy(s, url, proc)
            for model, mode in (("ll", "ok"), ("ll", "status"), ("ll-down", "ok")):
                upstream.mode, upstream.status = mode, 429
                for stream in (False, True):
                    async with s.post(url + "/v1/chat/completions",
                                      json={**CHAT, "model": model, "stream": stream}) as r:
                        await r.read()
                        statuses.append(r.status)
        proc.send_signal(signal.SIGTERM)
        err, out = await asyncio.wait_for(asyncio.gather(err_reader, out_reader), 30)
        assert await loop.run_in_executor(None, proc.wait, 10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert statuses == [200, 200, 429, 429, 502, 502]
    assert out == b""
    lines = [json.loads(line) for line in err.decode().splitlines()]
    assert any(line.get("logger") == "LiteLLM" for line in lines)  # litellm's own records, as JSON
    assert b"sk-upstream-secret" not in err and b"Traceback" not in err
