"""proxy.serve.http.read_body: a chunked body whose framing breaks after good chunks, under both of aiohttp's
parsers, through a real ``ctxproxy serve`` (the parser is chosen when aiohttp is imported: a process of its own).

aiohttp's pure-Python parser reports the broken framing to the handler: a prompt 400 in the wire's shape (or
aiohttp's own plain-text 400, when its parser meets the framing before the handler reads the body), nothing
forwarded, no internal error (aiohttp itself then logs the error once more as it drains the connection, after the
answer was sent). Its compiled parser does not report it (the body just stops): 408 at ``server.body_timeout``.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import http_parser

from tests.conftest import base_config
from tests.fake_upstream import FakeUpstream
from tests.outside import serve

PATHS = ("/v1/chat/completions", "/v1/responses", "/v1/messages")
BODY = {"/v1/chat/completions": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]},
        "/v1/responses": {"model": "gpt-4o-mini", "input": "hi"},
        "/v1/messages": {"model": "gpt-4o-mini", "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]}}
# after one good chunk: a size that is not hex, a chunk longer than its size, a size line ending in a bare LF
BROKEN = (b"zz\r\nab\r\n0\r\n\r\n", b"2\r\nabcdef\r\n0\r\n\r\n", b"2\nab\r\n0\r\n\r\n")


async def send_broken(port: int, path: str, tail: bytes) -> tuple[int, dict[str, Any] | None, float]:
    """One good chunk of the body, then ``tail``: the status, the JSON answer (None: aiohttp's own plain-text 400,
    when its parser meets the broken framing before the handler reads it) and how long it took."""
    raw = json.dumps(BODY[path]).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    started = time.monotonic()
    writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Transfer-Encoding: chunked\r\n\r\n{len(raw[:5]):x}\r\n".encode() + raw[:5] + b"\r\n")
    await writer.drain()
    await asyncio.sleep(0.1)
    writer.write(tail)
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
    status = int(head.split(b" ", 2)[1])
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
    data = await asyncio.wait_for(reader.readexactly(length), 10)
    answer = json.loads(data) if re.search(rb"(?i)content-type: *application/json", head) else None
    elapsed = time.monotonic() - started
    writer.close()
    return status, answer, elapsed


def error_of(path: str, answer: dict[str, Any] | None) -> dict[str, Any]:
    assert answer is not None
    if path == "/v1/messages":  # Anthropic's shape
        assert answer["type"] == "error"
    error: dict[str, Any] = answer["error"]
    assert isinstance(error["message"], str) and "Traceback" not in error["message"]
    return error


def write_config(cfg: dict[str, Any], tmp_path: Path) -> Path:
    path = tmp_path / "ctxproxy.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


async def test_pure_python_parser_answers_400_at_once(upstream: FakeUpstream, tmp_path: Path) -> None:
    async with serve(write_config(base_config(upstream.base_url), tmp_path), {"AIOHTTP_NO_EXTENSIONS": "1"}) as served:
        port = int(served.url.rsplit(":", 1)[1])
        for path in PATHS:
            for tail in BROKEN:
                status, answer, elapsed = await send_broken(port, path, tail)
                assert status == 400, (path, tail, answer)
                if answer is not None:  # the handler met it (else aiohttp did, first: its own 400)
                    error = error_of(path, answer)
                    assert "framing is malformed" in error["message"]
                    if path != "/v1/messages":
                        assert error["code"] == "invalid_body"
                assert elapsed < 5
    log = "\n".join(served.lines)
    assert not upstream.chat and not upstream.other
    assert "internal error" not in log and '"status":500' not in log


@pytest.mark.skipif(http_parser.HttpRequestParser is http_parser.HttpRequestParserPy,
                    reason="aiohttp's compiled parser is not installed")
async def test_compiled_parser_answers_408_at_the_body_timeout(upstream: FakeUpstream, tmp_path: Path) -> None:
    cfg = base_config(upstream.base_url)
    cfg["server"] = {"body_timeout": 1}
    async with serve(write_config(cfg, tmp_path)) as served:
        port = int(served.url.rsplit(":", 1)[1])
        for path in PATHS:
            status, answer, elapsed = await send_broken(port, path, BROKEN[0])
            assert status in (400, 408), answer  # 400 should aiohttp's compiled parser one day report it
            if status == 408 or answer is not None:
                assert error_of(path, answer)
            assert elapsed < 10
    assert not upstream.chat and not upstream.other
    assert "Traceback" not in "\n".join(served.lines)
