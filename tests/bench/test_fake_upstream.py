"""bench/fake_upstream.py: the benchmark's upstream answers each wire in its own shape, and ctxproxy relays them."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.server_instructions import WIRE_PATHS, bodies, free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fake() -> Iterator[int]:
    port = free_port()
    env = {**os.environ, "FAKE_USAGE": "counted"}
    process = subprocess.Popen([sys.executable, str(ROOT / "bench" / "fake_upstream.py"), "--port", str(port)],
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield port
    finally:
        process.terminate()
        process.wait(10)


def post(port: int, path: str, raw: bytes) -> tuple[int, Any]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request("POST", path, raw, {"Content-Type": "application/json"})
    answer = connection.getresponse()
    data = answer.read()
    connection.close()
    return answer.status, json.loads(data) if answer.status == 200 else data


def test_each_wire_is_answered_in_its_own_shape_with_the_prompt_counted(fake: int) -> None:
    raws = {wire: next(bodies("small.json", False, 1, wire)) for wire in WIRE_PATHS}
    status, chat = post(fake, WIRE_PATHS["chat"], raws["chat"])
    assert status == 200 and chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["usage"]["prompt_tokens"] == len(raws["chat"]) // 4
    status, responses = post(fake, "/v1/responses", raws["responses"])
    assert status == 200 and responses["object"] == "response" and responses["status"] == "completed"
    assert responses["output"][0]["content"][0]["type"] == "output_text"
    assert responses["usage"]["input_tokens"] == len(raws["responses"]) // 4
    status, messages = post(fake, "/v1/messages", raws["messages"])
    assert status == 200 and messages["type"] == "message" and messages["content"][0]["type"] == "text"
    assert messages["usage"]["input_tokens"] == len(raws["messages"]) // 4
    streamed = json.loads(raws["messages"])
    status, _ = post(fake, "/v1/messages", json.dumps({**streamed, "stream": True}).encode())
    assert status == 400  # it streams Chat Completions only


def test_the_bodies_of_each_wire_hold_one_conversation() -> None:
    chat, responses, messages = (json.loads(next(bodies("small.json", False, 1, wire))) for wire in WIRE_PATHS)
    assert "input" in responses and "messages" not in responses
    assert messages["messages"][0]["role"] == "user" and "max_tokens" in messages
    grown = [json.loads(raw) for raw in bodies("small.json", True, 3, "messages")]
    assert len(grown[0]["messages"]) < len(grown[1]["messages"]) < len(grown[2]["messages"])
    assert len(chat["messages"]) >= len(messages["messages"])
