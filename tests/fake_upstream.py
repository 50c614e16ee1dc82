"""A real aiohttp fake OpenAI upstream on 127.0.0.1 (port 0) that records what it receives.

Behaviour is switched per test through attributes (``mode``, ``summary_mode``,
``status``, delays). Summariser calls are told apart by the
``x-ctxproxy-purpose: summarize`` header and counted separately.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

REPLY = "OK. This is a fixed reply from the fake upstream."
PIECES = ["OK.", " This is a fixed", " reply from", " the fake upstream."]
USAGE = {"prompt_tokens": 10, "completion_tokens": 12, "total_tokens": 22,
         "prompt_tokens_details": {"cached_tokens": 4}}


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    raw: bytes
    body: Any


@dataclass
class FakeUpstream:
    mode: str = "ok"  # ok | status | hang | slow_first_byte | stall | break | no_done | error_in_stream | malformed | script
    status: int = 500
    status_body: Any = None
    status_headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0
    summary_mode: str = "ok"  # ok | status | hang | empty
    summary_text: str = "Summary: user Ada (id U-42) asked about /srv/app.py; decision: use v2."
    chat: list[Received] = field(default_factory=list)
    summaries: list[Received] = field(default_factory=list)
    other: list[Received] = field(default_factory=list)
    # mode "script": canned assistant messages (e.g. with tool_calls), one per chat request, in order;
    # once exhausted, the fixed REPLY
    script: list[dict[str, Any]] = field(default_factory=list)
    cancelled: int = 0
    active: int = 0
    url: str = ""
    _runner: web.AppRunner | None = None

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    async def start(self) -> FakeUpstream:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_route("*", "/v1/{tail:.*}", self._other)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": "upstream-model", "object": "model", "created": 0, "owned_by": "fake"}]})

    async def _other(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.other.append(Received(request.path_qs, dict(request.headers), raw, None))
        if request.path.endswith("/stream-test"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(3):
                await resp.write(f"data: {i}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            return resp
        return web.json_response({"object": "list", "path": request.path_qs, "echo": raw.decode("utf-8", "replace")})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw)
        rec = Received(request.path, dict(request.headers), raw, body)
        if request.headers.get("x-ctxproxy-purpose") == "summarize":
            self.summaries.append(rec)
            return await self._summary(request, body)
        self.chat.append(rec)
        self.active += 1
        try:
            return await self._answer(request, body)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.active -= 1

    async def _summary(self, request: web.Request, body: Any) -> web.StreamResponse:
        if self.summary_mode == "status":
            return web.json_response({"error": {"message": "summariser down", "type": "server_error"}}, status=500)
        if self.summary_mode == "hang":
            await asyncio.sleep(3600)
        text = "" if self.summary_mode == "empty" else self.summary_text
        return web.json_response(_completion(body.get("model", "m"), text, {
            "prompt_tokens": 1000, "completion_tokens": 100, "total_tokens": 1100}))

    async def _answer(self, request: web.Request, body: Any) -> web.StreamResponse:
        model = body.get("model", "m")
        if self.mode == "status":
            payload = self.status_body if self.status_body is not None else {
                "error": {"message": "upstream failure", "type": "server_error", "param": None, "code": None}}
            return web.json_response(payload, status=self.status, headers=self.status_headers)
        if self.mode == "hang" or self.mode == "slow_first_byte":
            await asyncio.sleep(self.delay or 3600)
        if self.mode == "script":
            return await self._scripted(request, body)
        if not body.get("stream"):
            return web.json_response(_completion(model, REPLY, USAGE))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        chunks = [_chunk(model, {"role": "assistant", "content": ""})]
        chunks += [_chunk(model, {"content": p}) for p in PIECES]
        chunks.append(_chunk(model, {}, "stop", USAGE if include_usage else None))
        for i, chunk in enumerate(chunks):
            if self.mode == "stall" and i == 2:
                await asyncio.sleep(self.delay or 3600)
            if self.mode == "break" and i == 2:
                request.transport.close()  # type: ignore[union-attr]
                return resp
            if self.mode == "error_in_stream" and i == 2:
                await resp.write(b'data: {"error": {"message": "overloaded", "type": "server_error"}}\n\n')
                return resp
            if self.mode == "malformed" and i == 2:
                await resp.write(b"data: {not json\n\n")
            await resp.write(chunk)
            if i == 0:
                await resp.write(b": keep-alive\n\n")
        if self.mode != "no_done":
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _scripted(self, request: web.Request, body: Any) -> web.StreamResponse:
        model = body.get("model", "m")
        message = dict(self.script.pop(0)) if self.script else {"role": "assistant", "content": REPLY}
        message.setdefault("role", "assistant")
        message.setdefault("content", None)
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        if not body.get("stream"):
            out = _completion(model, "", USAGE)
            out["choices"][0].update(message=message, finish_reason=finish)
            return web.json_response(out)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        delta = dict(message)
        if delta.get("tool_calls"):
            delta["tool_calls"] = [dict(call, index=i) for i, call in enumerate(delta["tool_calls"])]
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        await resp.write(_chunk(model, delta))
        await resp.write(_chunk(model, {}, finish, USAGE if include_usage else None))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _completion(model: str, text: str, usage: dict[str, Any]) -> dict[str, Any]:
    return {"id": "chatcmpl-fake", "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}],
            "usage": usage}


def _chunk(model: str, delta: dict[str, Any], finish: str | None = None, usage: Any = None) -> bytes:
    d: dict[str, Any] = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": model,
                         "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage is not None:
        d["usage"] = usage
    return b"data: " + json.dumps(d).encode() + b"\n\n"
