"""A real aiohttp fake OpenAI upstream on 127.0.0.1 (port 0) that records what it receives.

Behaviour is switched per test through attributes (``mode``, ``summary_mode``,
``status``, delays). Summariser calls are told apart by the
``x-ctxproxy-purpose: summarize`` header and counted separately.

Besides Chat Completions it streams the two other wires exactly as the
providers end them, for requests with ``"stream": true``:
``POST /v1/responses`` (named ``response.*`` events ending with
``response.completed`` / ``.incomplete`` / ``.failed``, never ``data: [DONE]``)
and ``POST /v1/messages`` (Anthropic events ending with ``message_stop``), plus
``/v1/sse-clean-close`` (an unknown SSE path that simply ends); ``sent`` holds
the exact bytes written and ``wire_mode = "break"`` cuts those streams mid-way.
Every ``/v1/responses`` request (managed, streaming or not) is recorded in
``responses`` and in ``other`` (as every relayed request always was) and, in modes ``hang`` and
``slow_first_byte``, answered after ``delay`` as chat requests are; a non-streaming one
is answered with a Response object as OpenAI sends it, its ``output`` taken from
``responses_script`` (one list of output items per request, e.g. function calls) or the
fixed reply. ``POST /v1/responses/compact`` answers a ``response.compaction`` object as
OpenAI does (the input's user messages and one opaque ``compaction`` item), or 404 with
``compact_mode = "404"``; compact requests are recorded in ``compactions``.
``/v1/messages`` speaks Anthropic's API whole, for Claude Code and the SDK: every request is recorded in
``messages`` (and ``other``); a non-streaming one gets a message; ``anthropic_script``
gives canned content blocks (e.g. ``tool_use``) one request at a time; ``mode = "status"``
answers ``status`` with ``status_body`` (Anthropic's error shape by default); summariser
calls (``x-ctxproxy-purpose: summarize``) go to ``summaries``; and
``POST /v1/messages/count_tokens`` answers ``{"input_tokens": count_tokens_answer}``
(404 when ``count_tokens_served`` is false), recorded in ``counts``. ``anthropic_input`` (a function of
the body) makes it report its own input count, and ``anthropic_window`` refuse a payload above it for length.
Other relayed requests land in ``other`` and, when not streaming, are
answered with the usual echo. ``require_uuid_request_id`` makes it refuse (400, empty body) every
request whose ``X-Request-ID`` is not a UUID, as several ASGI request-id
middlewares do; ``request_ids`` records every id received. ``set_cookie`` makes every answer set a session
cookie of its own, as a CDN in front of a provider does.

Usage that tells the truth, as a provider whose tokenizer is not o200k does,
off by default (``fixed_usage``, the fixed ``USAGE`` unless a test
sets another, odd one): ``prompt_scale`` reports
``prompt_tokens`` = scale × the request's true o200k count (OpenAI's per-message formula, counted here
with tiktoken, not with the proxy's code), as a provider with another tokenizer would;
``report_cached`` reports ``cached_tokens`` as a provider's prompt cache would: the longest common
prefix, in whole messages, with the previous request of the same conversation (header
``x-fake-conversation``, else the first message), in the same units, floored to ``cache_block`` tokens
and 0 below ``cache_min`` (OpenAI: 128 and 1024). Summariser calls then report their true counts too.
``usages`` and ``summary_usages`` record every usage reported for a chat request and a summary.

A provider's real window (``window``, a ``ProviderWindow``): every request of the three wires (summaries
aside) is counted as that provider counts it (text and tool schemas each at its own scale of o200k) and
reported so in its usage; one whose input plus its output limit is over the window is refused with status
400 in that provider's own words, numbers included (``dialect``: OpenAI, the Responses API, Anthropic,
vLLM, SGLang, llama.cpp, Ollama, Mistral). ``window_counts`` holds every count, ``window_refused`` the
refused ones.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from collections.abc import Awaitable, Callable
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


# keys whose values are structure, not text a provider's tokenizer reads
STRUCTURAL = frozenset({"type", "role", "id", "call_id", "tool_call_id", "tool_use_id", "status", "signature",
                        "cache_control", "media_type", "detail"})


@dataclass
class ProviderWindow:
    """A provider's real context window and tokenizer, and the words it refuses an overflow with.

    ``limit``: its window (input plus the request's output limit); ``text_scale`` / ``tool_scale``: its count of
    the conversation's text / of the tool schemas, as multiples of o200k; ``dialect``: whose refusal text
    (``openai`` Chat Completions, ``responses`` / ``responses-plain`` the Responses API with and without numbers,
    ``anthropic``, ``vllm``, ``sglang``, ``llamacpp``, ``ollama``, ``ollama-plain``, ``mistral``)."""

    limit: int
    text_scale: float = 1.0
    tool_scale: float = 1.0
    dialect: str = "openai"

    def count(self, body: dict[str, Any]) -> int:
        """The provider's own count of a request's input."""
        tools = body.get("tools")
        tool_tokens = o200k_tokens(json.dumps(tools, separators=(",", ":"))) if tools else 0
        text = 3
        for key in ("system", "instructions"):
            text += text_tokens(body.get(key))
        for key in ("messages", "input"):
            value = body.get(key)
            if isinstance(value, str):
                text += o200k_tokens(value) + 3
            elif isinstance(value, list):
                text += sum(3 + text_tokens(item) for item in value)
        return round(self.text_scale * text + self.tool_scale * tool_tokens)

    def refusal(self, body: dict[str, Any], n: int) -> dict[str, Any] | None:
        """The provider's error body for a request it counts ``n`` input tokens for, or None when it fits."""
        out = next((v for k in ("max_tokens", "max_completion_tokens", "max_output_tokens")
                    if isinstance(v := body.get(k), int)), 0)
        w = self.limit
        if n + out <= w:
            return None
        openai = {"type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}
        if self.dialect == "openai":
            said = (f"However, you requested {n + out} tokens ({n} in the messages, {out} in the completion). "
                    "Please reduce the length of the messages or completion.") if out else (
                f"However, your messages resulted in {n} tokens. Please reduce the length of the messages.")
            return {"error": {"message": f"This model's maximum context length is {w} tokens. {said}", **openai}}
        if self.dialect == "responses":
            return {"error": {**openai, "param": "input", "message": f"Input tokens exceed the configured limit of "
                              f"{w} tokens. Your messages resulted in {n} tokens. Please reduce the length of the "
                              "messages."}}
        if self.dialect == "responses-plain":
            return {"error": {**openai, "param": "input", "message": "Your input exceeds the context window of this "
                              "model. Please adjust your input and try again."}}
        if self.dialect == "anthropic":
            message = (f"prompt is too long: {n} tokens > {w} maximum" if n > w else
                       f"input length and `max_tokens` exceed context limit: {n} + {out} > {w}, decrease input "
                       "length or `max_tokens` and try again")
            return {"type": "error", "error": {"type": "invalid_request_error", "message": message}}
        if self.dialect == "vllm":
            return {"error": {"message": f"This model's maximum context length is {w} tokens. However, your request "
                              f"has {n} input tokens. Please reduce the length of the input messages.",
                              "type": "BadRequestError", "param": None, "code": 400}}
        if self.dialect == "sglang":
            return {"error": {"message": f"The input ({n} tokens) is longer than the model's context length "
                              f"({w} tokens).", "type": "BadRequestError", "param": None, "code": 400}}
        if self.dialect == "llamacpp":
            return {"error": {"code": 400, "message": "the request exceeds the available context size, try "
                              "increasing it", "type": "exceed_context_size_error", "n_prompt_tokens": n,
                              "n_ctx": w}}
        if self.dialect == "ollama":
            return {"error": {"message": f"prompt too long; exceeded max context length by {n + out - w} tokens",
                              "type": "invalid_request_error", "param": None, "code": None}}
        if self.dialect == "ollama-plain":
            return {"error": {"message": "the input length exceeds the context length",
                              "type": "invalid_request_error", "param": None, "code": None}}
        if self.dialect == "mistral":
            return {"object": "error", "message": f"Prompt contains {n} tokens, too large for model with {w} maximum "
                    "context length", "type": "invalid_request_error", "param": None, "code": None}
        raise ValueError(f"unknown dialect {self.dialect!r}")


@dataclass
class FakeUpstream:
    # ok | status | hang | slow_first_byte | stall | break | no_done | error_in_stream | malformed | script
    # | echo_key (streams the Authorization header it received back as content)
    # | bad_chunk (a chunk-framing error after the first chunk, then the connection stays open)
    mode: str = "ok"
    status: int = 500
    status_body: Any = None
    status_headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0
    summary_mode: str = "ok"  # ok | status | hang | empty
    summary_status: int = 500  # summary_mode "status": this status, with summary_error as the error message
    summary_error: str = "summariser down"
    summary_text: str = "Summary: user Ada (id U-42) asked about /srv/app.py; decision: use v2."
    chat: list[Received] = field(default_factory=list)
    summaries: list[Received] = field(default_factory=list)
    other: list[Received] = field(default_factory=list)
    # mode "script": canned assistant messages (e.g. with tool_calls), one per chat request, in order;
    # once exhausted, the fixed REPLY
    script: list[dict[str, Any]] = field(default_factory=list)
    cancelled: int = 0
    active: int = 0
    # summariser calls: wait this long before answering; or hold every call until this many are pending
    summary_delay: float = 0.0
    summary_gate: asyncio.Event | None = None  # when set: every summariser call waits until the event is set
    summary_barrier: int = 0
    # relayed wires (/v1/responses, /v1/messages, /v1/sse-clean-close)
    responses_end: str = "response.completed"  # | response.incomplete | response.failed
    wire_mode: str = "ok"  # ok | break (the connection is cut mid-stream)
    responses: list[Received] = field(default_factory=list)  # every /v1/responses request (also in ``other``)
    responses_script: list[list[dict[str, Any]]] = field(default_factory=list)  # output items, one list per request
    compact_mode: str = "ok"  # ok | 404 (an upstream without /v1/responses/compact)
    compactions: list[Received] = field(default_factory=list)
    messages: list[Received] = field(default_factory=list)  # every /v1/messages request (also in ``other``)
    anthropic_script: list[list[dict[str, Any]]] = field(default_factory=list)  # canned content, one per request
    count_tokens_served: bool = True
    count_tokens_answer: int = 42
    counts: list[Received] = field(default_factory=list)  # /v1/messages/count_tokens requests
    # Anthropic's own input count (a test's model of the provider's tokenizer and image pricing), reported as
    # ``usage.input_tokens``; with ``anthropic_window``, a payload counted above it is refused (400) as
    # Anthropic refuses one ("prompt is too long: N tokens > W maximum"). Every count lands in ``anthropic_inputs``.
    anthropic_input: Callable[[Any], int] | None = None
    anthropic_window: int | None = None
    anthropic_inputs: list[int] = field(default_factory=list)
    sent: bytes = b""  # the exact bytes of the last relayed-wire stream this upstream wrote
    # rewrite every stream (chat, responses, messages) before it is written: e.g. other line ends, or cut short
    stream_edit: Callable[[bytes], bytes] | None = None
    stream_close: str = "eof"  # eof (a clean end) | drop (the connection is cut after the last byte written)
    # X-Request-ID enforcement, as some ASGI request-id middlewares do: a non-UUID id is refused
    require_uuid_request_id: bool = False
    request_ids: list[tuple[str, str | None]] = field(default_factory=list)  # (purpose or path, X-Request-ID)
    rejected: list[Received] = field(default_factory=list)
    # usage: ``fixed_usage`` is reported as is unless the truthful switches below are on
    fixed_usage: Any = field(default_factory=lambda: USAGE)
    prompt_scale: float | None = None
    report_cached: bool = False
    cache_min: int = 0
    cache_block: int = 1
    usages: list[dict[str, Any]] = field(default_factory=list)
    summary_usages: list[dict[str, Any]] = field(default_factory=list)
    window: ProviderWindow | None = None
    # mode "error_in_stream": the error event written after the stream began
    stream_error: dict[str, Any] = field(default_factory=lambda: {"message": "overloaded", "type": "server_error"})
    window_counts: list[int] = field(default_factory=list)
    window_refused: list[int] = field(default_factory=list)
    # every answer sets a session cookie of its own (``session=answer-N``), as a CDN in front of a provider does
    set_cookie: bool = False
    _answers: int = 0
    _conversations: dict[str, list[str]] = field(default_factory=dict)
    url: str = ""
    _runner: web.AppRunner | None = None
    _pending_summaries: int = 0
    _barrier: asyncio.Event | None = None

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    async def start(self) -> FakeUpstream:
        app = web.Application(client_max_size=256 * 1024 * 1024, middlewares=[self._request_id_check])
        app.on_response_prepare.append(self._cookie)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/responses", self._responses)
        app.router.add_post("/v1/responses/compact", self._compact)
        app.router.add_post("/v1/messages", self._messages)
        app.router.add_post("/v1/messages/count_tokens", self._count_tokens)
        app.router.add_route("*", "/v1/sse-clean-close", self._sse_clean_close)
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

    async def _cookie(self, request: web.Request, response: web.StreamResponse) -> None:
        if self.set_cookie:
            self._answers += 1
            response.headers.add("Set-Cookie", f"session=answer-{self._answers}; Path=/")  # (the headers are made)
            response.headers.add("Set-Cookie2", f'session="answer-{self._answers}"; Version=1')  # (RFC 2965's)

    @web.middleware
    async def _request_id_check(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        rid = request.headers.get("X-Request-ID")
        self.request_ids.append((request.headers.get("x-ctxproxy-purpose") or request.path, rid))
        if self.require_uuid_request_id and not is_uuid(rid):
            raw = await request.read()
            self.rejected.append(Received(request.path, dict(request.headers), raw, None))
            return web.Response(status=400, body=b"")  # what a request-id middleware answers: nothing to read
        return await handler(request)

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
        refused = self._over_window(body)
        if refused is not None:
            return refused
        self.active += 1
        try:
            return await self._answer(request, body)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.active -= 1

    async def _summary(self, request: web.Request, body: Any) -> web.StreamResponse:
        if self.summary_barrier:
            if self._barrier is None:
                self._barrier = asyncio.Event()
            self._pending_summaries += 1
            if self._pending_summaries >= self.summary_barrier:
                self._barrier.set()
            await self._barrier.wait()
        if self.summary_gate is not None:
            await self.summary_gate.wait()
        if self.summary_delay:
            await asyncio.sleep(self.summary_delay)
        if self.summary_mode == "status":
            return web.json_response({"error": {"message": self.summary_error, "type": "server_error"}},
                                     status=self.summary_status)
        if self.summary_mode == "hang":
            await asyncio.sleep(3600)
        text = "" if self.summary_mode == "empty" else self.summary_text
        usage = {"prompt_tokens": 1000, "completion_tokens": 100, "total_tokens": 1100}
        if self.truthful:
            prompt = round(self._scale * request_tokens(body))
            completion = round(self._scale * o200k_tokens(text))
            usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        self.summary_usages.append(usage)
        return web.json_response(_completion(body.get("model", "m"), text, usage))

    @property
    def truthful(self) -> bool:
        return self.prompt_scale is not None or self.report_cached

    @property
    def _scale(self) -> float:
        return self.prompt_scale if self.prompt_scale is not None else 1.0

    def usage_for(self, request: web.Request, body: Any) -> Any:
        """The usage of one chat request: the fixed USAGE, or counted (``prompt_scale``, ``report_cached``,
        ``window``)."""
        if self.window is not None:
            n = self.window.count(body)
            counted: dict[str, Any] = {"prompt_tokens": n, "completion_tokens": 12, "total_tokens": n + 12}
            self.usages.append(counted)
            return counted
        if not self.truthful:
            return self.fixed_usage  # type: ignore[no-any-return]
        messages = body.get("messages") if isinstance(body.get("messages"), list) else []
        prompt = round(self._scale * request_tokens(body))
        cached = 0
        if self.report_cached:
            key = request.headers.get("x-fake-conversation") or json.dumps(messages[:1], sort_keys=True)
            seen = [json.dumps(m, sort_keys=True) for m in messages]
            previous = self._conversations.get(key, [])
            common = 0
            while common < min(len(seen), len(previous)) and seen[common] == previous[common]:
                common += 1
            self._conversations[key] = seen
            prefix = round(self._scale * sum(message_tokens(m) for m in messages[:common]))
            prefix = prefix // self.cache_block * self.cache_block
            cached = min(prompt, prefix) if prefix >= self.cache_min else 0
        usage = {"prompt_tokens": prompt, "completion_tokens": 12, "total_tokens": prompt + 12,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        self.usages.append(usage)
        return usage

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
        if self.mode == "echo_key" and body.get("stream"):
            return await self._echo_key(request, model)
        if self.mode == "bad_chunk" and body.get("stream"):
            return await self._bad_chunk(request, model)
        usage = self.usage_for(request, body)
        if not body.get("stream"):
            return web.json_response(_completion(model, REPLY, usage))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        chunks = [_chunk(model, {"role": "assistant", "content": ""})]
        chunks += [_chunk(model, {"content": p}) for p in PIECES]
        chunks.append(_chunk(model, {}, "stop", usage if include_usage else None))
        if self.stream_edit is not None:
            return await self._wire_stream(request, [*chunks, b"data: [DONE]\n\n"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for i, chunk in enumerate(chunks):
            if self.mode == "stall" and i == 2:
                await asyncio.sleep(self.delay or 3600)
            if self.mode == "break" and i == 2:
                request.transport.close()  # type: ignore[union-attr]
                return resp
            if self.mode == "error_in_stream" and i == 2:
                await resp.write(b"data: " + json.dumps({"error": self.stream_error}).encode() + b"\n\n")
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
        message: dict[str, Any] = dict(self.script.pop(0)) if self.script else {"role": "assistant", "content": REPLY}
        message.setdefault("role", "assistant")
        message.setdefault("content", None)
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        if not body.get("stream"):
            out = _completion(model, "", self.usage_for(request, body))
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


    async def _echo_key(self, request: web.Request, model: str) -> web.StreamResponse:
        """A 200 stream whose content repeats the credentials it was sent (as some providers' debug echoes do)."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        auth = request.headers.get("Authorization", "")
        await resp.write(_chunk(model, {"role": "assistant", "content": ""}))
        await resp.write(_chunk(model, {"content": f"You called me with {auth}."}))
        await resp.write(_chunk(model, {}, "stop"))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _bad_chunk(self, request: web.Request, model: str) -> web.StreamResponse:
        """One good chunk, then bytes that break HTTP chunked framing; the connection then stays open."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        await resp.write(_chunk(model, {"role": "assistant", "content": "OK."}))
        await asyncio.sleep(0.2)  # the headers and the first chunk are relayed before the framing breaks
        assert request.transport is not None
        request.transport.write(b"zz-not-a-chunk-size\r\n\r\n")
        await asyncio.sleep(self.delay or 30)
        return resp

    def _over_window(self, body: Any) -> web.Response | None:
        """With a ``window``: count the request as that provider does; its refusal when it does not fit."""
        if self.window is None or not isinstance(body, dict):
            return None
        n = self.window.count(body)
        self.window_counts.append(n)
        error = self.window.refusal(body, n)
        if error is None:
            return None
        self.window_refused.append(n)
        return web.json_response(error, status=400)

    # ------------------------------------------------------------------ relayed wires

    async def _wire_stream(self, request: web.Request, events: list[bytes]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        self.sent = b""
        if self.stream_edit is not None:
            events = [self.stream_edit(b"".join(events))]
        for i, event in enumerate(events):
            if self.wire_mode == "break" and i == len(events) // 2:
                assert request.transport is not None
                request.transport.close()
                return resp
            self.sent += event
            await resp.write(event)
        if self.stream_close == "drop":
            await asyncio.sleep(0.05)  # the bytes reach the proxy before the connection is cut
            assert request.transport is not None
            request.transport.close()
            return resp
        await resp.write_eof()  # a clean end: the last chunk, nothing after the terminal event
        return resp

    async def _record(self, request: web.Request, bucket: list[Received] | None = None) -> Any:
        """Record a relayed request in ``other`` (as every relayed path always was) and in ``bucket``."""
        raw = await request.read()
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = None
        rec = Received(request.path_qs, dict(request.headers), raw, body)
        self.other.append(rec)
        if bucket is not None:
            bucket.append(rec)
        return body if isinstance(body, dict) else {}

    async def _is_stream(self, request: web.Request) -> bool:
        try:
            body = json.loads(await request.read())
        except ValueError:
            return False
        return isinstance(body, dict) and bool(body.get("stream"))

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        body = await self._record(request, self.responses)
        model = str(body.get("model", "m"))
        if self.mode == "status":
            payload = self.status_body if self.status_body is not None else {
                "error": {"message": "upstream failure", "type": "server_error", "param": None, "code": None}}
            return web.json_response(payload, status=self.status, headers=self.status_headers)
        if self.mode == "hang" or self.mode == "slow_first_byte":
            await asyncio.sleep(self.delay or 3600)
        refused = self._over_window(body)
        if refused is not None:
            return refused
        usage = None
        if self.window is not None:
            n = self.window_counts[-1]
            usage = {**RESPONSE_USAGE, "input_tokens": n, "total_tokens": n + 12}
        output = self.responses_script.pop(0) if self.responses_script else None
        if not body.get("stream"):
            return web.json_response(response_object(model, "completed", output, usage))
        return await self._wire_stream(request, responses_events(model, self.responses_end, output, usage))

    async def _compact(self, request: web.Request) -> web.StreamResponse:
        body = await self._record(request, self.compactions)
        if self.compact_mode == "404":
            return web.json_response({"error": {"message": "Invalid URL (POST /v1/responses/compact)",
                                                "type": "invalid_request_error", "param": None, "code": None}},
                                     status=404)
        items = body.get("input") if isinstance(body.get("input"), list) else [
            {"role": "user", "content": body.get("input") or ""}]
        users = [{"type": "message", "role": "user", "id": f"msg_u{i}", "status": "completed",
                  "content": m["content"] if isinstance(m.get("content"), list)
                  else [{"type": "input_text", "text": m.get("content")}]}
                 for i, m in enumerate(items) if isinstance(m, dict) and m.get("role") == "user"]
        compaction = {"type": "compaction", "id": "cmp_fake", "encrypted_content": "Z0FBQUFBQm9fZmFrZV9jb21wYWN0"}
        return web.json_response({"id": "resp_compact_fake", "object": "response.compaction", "created_at": 0,
                                  "output": [*users, compaction], "usage": RESPONSE_USAGE})

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get("x-ctxproxy-purpose") == "summarize":
            raw = await request.read()
            body = json.loads(raw)
            self.summaries.append(Received(request.path, dict(request.headers), raw, body))
            return await self._anthropic_summary(request, body)
        body = await self._record(request, self.messages)
        model = str(body.get("model", "m"))
        if self.mode == "status":
            payload = self.status_body if self.status_body is not None else {
                "type": "error", "error": {"type": "api_error", "message": "upstream failure"}}
            return web.json_response(payload, status=self.status, headers=self.status_headers)
        refused = self._over_window(body)
        if refused is not None:
            return refused
        counted = self.anthropic_input(body) if self.anthropic_input is not None else 10
        if self.window is not None:
            counted = self.window_counts[-1]
        if self.anthropic_input is not None:
            self.anthropic_inputs.append(counted)
            if self.anthropic_window is not None and counted > self.anthropic_window:
                return web.json_response({"type": "error", "error": {
                    "type": "invalid_request_error",
                    "message": f"prompt is too long: {counted} tokens > {self.anthropic_window} maximum"}}, status=400)
        content = self.anthropic_script.pop(0) if self.anthropic_script else None
        if not body.get("stream"):
            message = _anthropic_message(model)
            message["usage"] = {"input_tokens": counted, "output_tokens": 12}
            if content is not None:
                message.update(content=content, stop_reason="tool_use" if any(
                    b.get("type") == "tool_use" for b in content) else "end_turn")
            return web.json_response(message)
        return await self._wire_stream(request, anthropic_events(model, content, counted))

    async def _anthropic_summary(self, request: web.Request, body: Any) -> web.StreamResponse:
        if self.summary_gate is not None:
            await self.summary_gate.wait()
        if self.summary_delay:
            await asyncio.sleep(self.summary_delay)
        if self.summary_mode == "status":
            return web.json_response({"type": "error", "error": {"type": "api_error", "message": self.summary_error}},
                                     status=self.summary_status)
        if self.summary_mode == "hang":
            await asyncio.sleep(3600)
        text = "" if self.summary_mode == "empty" else self.summary_text
        message = _anthropic_message(str(body.get("model", "m")))
        message.update(content=[{"type": "text", "text": text}], usage={"input_tokens": 1000, "output_tokens": 100})
        return web.json_response(message)

    async def _count_tokens(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.counts.append(Received(request.path, dict(request.headers), raw, json.loads(raw) if raw else None))
        if not self.count_tokens_served:
            return web.json_response({"type": "error", "error": {"type": "not_found_error", "message": "Not found"}},
                                     status=404)
        return web.json_response({"input_tokens": self.count_tokens_answer})

    async def _sse_clean_close(self, request: web.Request) -> web.StreamResponse:
        await self._record(request)
        events = [f"event: progress\ndata: {json.dumps({'step': i})}\n\n".encode() for i in range(4)]
        return await self._wire_stream(request, events)


@functools.lru_cache(maxsize=1)
def _o200k() -> Any:
    import tiktoken

    return tiktoken.get_encoding("o200k_base")


@functools.lru_cache(maxsize=100_000)
def o200k_tokens(text: str) -> int:
    return len(_o200k().encode(text, disallowed_special=()))


def message_tokens(message: Any) -> int:
    """OpenAI's per-message formula, written out here: 3 + every string value (+1 for name), text parts,
    each tool call 3 + name + arguments."""
    if not isinstance(message, dict):
        return 0
    n = 3
    for key, value in message.items():
        if isinstance(value, str):
            n += o200k_tokens(value) + (1 if key == "name" else 0)
        elif key == "content" and isinstance(value, list):
            for part in value:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    n += o200k_tokens(part["text"])
        elif key == "tool_calls" and isinstance(value, list):
            for call in value:
                fn = call.get("function") if isinstance(call, dict) else None
                if isinstance(fn, dict):
                    n += 3 + o200k_tokens(str(fn.get("name") or "")) + o200k_tokens(str(fn.get("arguments") or ""))
    return n


def text_tokens(value: Any) -> int:
    """o200k tokens of every text in a JSON value (structural keys aside): what a provider reads of it."""
    if isinstance(value, str):
        return o200k_tokens(value)
    if isinstance(value, list):
        return sum(text_tokens(v) for v in value)
    if isinstance(value, dict):
        return sum(text_tokens(v) for k, v in value.items() if k not in STRUCTURAL)
    return 0


def request_tokens(body: Any) -> int:
    """A chat request's true o200k count: its messages, 3 priming tokens, and its tool schemas as JSON."""
    messages = body.get("messages") if isinstance(body, dict) else None
    n = 3 + sum(message_tokens(m) for m in messages) if isinstance(messages, list) else 0
    tools = body.get("tools") if isinstance(body, dict) else None
    if tools:
        n += o200k_tokens(json.dumps(tools, separators=(",", ":")))
    return n


def is_uuid(value: str | None) -> bool:
    """Whether ``value`` parses as a UUID (what request-id middlewares such as asgi-correlation-id check)."""
    if not value:
        return False
    try:
        uuid.UUID(value)
    except ValueError:
        return False
    return True


def sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


RESPONSE_USAGE = {"input_tokens": 10, "output_tokens": 12, "total_tokens": 22,
                  "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}
REPLY_ITEM = {"id": "msg_fake", "type": "message", "status": "completed", "role": "assistant",
              "content": [{"type": "output_text", "text": REPLY, "annotations": []}]}


def function_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """A function_call output item as OpenAI returns it (for ``responses_script``)."""
    return {"id": f"fc_{call_id}", "type": "function_call", "status": "completed", "call_id": call_id,
            "name": name, "arguments": arguments}


def response_object(model: str, status: str, output: list[dict[str, Any]] | None = None,
                    usage: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": "resp_fake", "object": "response", "created_at": 0, "status": status, "model": model,
        "output": [], "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "error": None,
        "incomplete_details": None, "usage": None,
    }
    if status != "in_progress":
        out["output"] = [REPLY_ITEM] if output is None else output
        out["usage"] = usage or RESPONSE_USAGE
    if status == "incomplete":
        out["incomplete_details"] = {"reason": "max_output_tokens"}
    if status == "failed":
        out["error"] = {"code": "server_error", "message": "The model failed to finish."}
    return out


def responses_events(model: str, end: str = "response.completed",
                     output: list[dict[str, Any]] | None = None, usage: dict[str, Any] | None = None) -> list[bytes]:
    """A Responses API stream as OpenAI sends it: named events, a terminal one, and no [DONE].

    ``output``: function calls to stream instead of the fixed text reply.
    """
    if output is not None:
        return _function_call_events(model, end, output, usage)
    item = {"id": "msg_fake", "type": "message", "status": "in_progress", "role": "assistant", "content": []}
    part = {"type": "output_text", "text": "", "annotations": []}
    events: list[tuple[str, dict[str, Any]]] = [
        ("response.created", {"response": response_object(model, "in_progress")}),
        ("response.in_progress", {"response": response_object(model, "in_progress")}),
        ("response.output_item.added", {"output_index": 0, "item": item}),
        ("response.content_part.added", {"item_id": "msg_fake", "output_index": 0, "content_index": 0, "part": part}),
    ]
    events += [("response.output_text.delta", {"item_id": "msg_fake", "output_index": 0, "content_index": 0,
                                               "delta": piece, "logprobs": []}) for piece in PIECES]
    events += [
        ("response.output_text.done", {"item_id": "msg_fake", "output_index": 0, "content_index": 0, "text": REPLY,
                                       "logprobs": []}),
        ("response.content_part.done", {"item_id": "msg_fake", "output_index": 0, "content_index": 0,
                                        "part": {**part, "text": REPLY}}),
        ("response.output_item.done", {"output_index": 0, "item": {
            **item, "status": "completed", "content": [{**part, "text": REPLY}]}}),
        (end, {"response": response_object(model, end.split(".", 1)[1], None, usage)}),
    ]
    return [sse(name, {"type": name, "sequence_number": i, **data}) for i, (name, data) in enumerate(events)]


def _function_call_events(model: str, end: str, output: list[dict[str, Any]],
                          usage: dict[str, Any] | None = None) -> list[bytes]:
    events: list[tuple[str, dict[str, Any]]] = [
        ("response.created", {"response": response_object(model, "in_progress")}),
    ]
    for i, item in enumerate(output):
        events.append(("response.output_item.added", {"output_index": i, "item": {**item, "status": "in_progress"}}))
        if item.get("type") == "function_call":
            events.append(("response.function_call_arguments.delta", {"item_id": item["id"], "output_index": i,
                                                                       "delta": item["arguments"]}))
            events.append(("response.function_call_arguments.done", {"item_id": item["id"], "output_index": i,
                                                                      "arguments": item["arguments"]}))
        events.append(("response.output_item.done", {"output_index": i, "item": item}))
    events.append((end, {"response": response_object(model, end.split(".", 1)[1], output, usage)}))
    return [sse(name, {"type": name, "sequence_number": i, **data}) for i, (name, data) in enumerate(events)]


def _anthropic_message(model: str) -> dict[str, Any]:
    return {"id": "msg_fake", "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": REPLY}], "stop_reason": "end_turn", "stop_sequence": None,
            "usage": {"input_tokens": 10, "output_tokens": 12}}


def anthropic_events(model: str, content: list[dict[str, Any]] | None = None, input_tokens: int = 10) -> list[bytes]:
    """An Anthropic Messages stream as Anthropic sends it, ending with ``message_stop``.

    ``content``: canned blocks (text and tool_use) instead of the fixed text reply.
    """
    start = {**_anthropic_message(model), "content": [], "stop_reason": None,
             "usage": {"input_tokens": input_tokens, "output_tokens": 1}}
    events: list[tuple[str, dict[str, Any]]] = [("message_start", {"message": start})]
    stop = "end_turn"
    if content is None:
        events += [("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}), ("ping", {})]
        events += [("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": p}}) for p in PIECES]
        events.append(("content_block_stop", {"index": 0}))
    else:
        for i, block in enumerate(content):
            if block.get("type") == "tool_use":
                stop = "tool_use"
                events.append(("content_block_start", {"index": i, "content_block": {**block, "input": {}}}))
                events.append(("content_block_delta", {"index": i, "delta": {
                    "type": "input_json_delta", "partial_json": json.dumps(block.get("input", {}))}}))
            else:
                events.append(("content_block_start", {"index": i, "content_block": {"type": "text", "text": ""}}))
                events.append(("content_block_delta", {"index": i, "delta": {
                    "type": "text_delta", "text": block.get("text", "")}}))
            events.append(("content_block_stop", {"index": i}))
    events += [
        ("message_delta", {"delta": {"stop_reason": stop, "stop_sequence": None},
                           "usage": {"output_tokens": 12}}),
        ("message_stop", {}),
    ]
    return [sse(name, {"type": name, **data}) for name, data in events]


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
