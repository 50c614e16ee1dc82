"""Hostile and malformed input against the running proxy: never a 5xx, never a traceback, never an invalid
payload forwarded, bounded time and memory.

Everything the fake upstream receives must pass ``proxy.pairing.check`` and carry a non-empty ``messages``
list and a string ``model``: the proxy either repairs a body into something a provider accepts or refuses
it with a 4xx in OpenAI's error shape. The bounds asserted here are the ones stated in docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import gc
import gzip
import json
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import base_config
from tests.fake_upstream import FakeUpstream
from tests.wire.chat_helpers import check_messages as check

MODEL = "gpt-4o-mini"
MODELS = [
    {"name": MODEL, "context_window": 128000, "max_output_tokens": 16384},
    # a tiny window, so that fuzzed bodies also reach summarising, trimming and context_length_exceeded
    {"name": "tiny", "context_window": 400, "max_output_tokens": 50},
]
ENDPOINTS = ["/v1/chat/completions", "/chat/completions", "/v1/ctxproxy/explain"]
MB = 1024 * 1024


# --------------------------------------------------------------------------- helpers


def proxy_config(upstream: FakeUpstream, **extra: Any) -> dict[str, Any]:
    cfg = base_config(upstream.base_url, models=MODELS)
    cfg["context_manager"] = {"type": "summarising", "params": {"keep_turns": 2}}
    cfg["summarizer"] = {"retry_backoff_seconds": 0, "timeout_seconds": 5, "max_summary_tokens": 64}
    cfg["logging"] = {"level": "WARNING", "requests": False}
    cfg.update(extra)
    return cfg


def assert_no_traceback(raw: bytes) -> None:
    for needle in (b"Traceback", b'File "', b"site-packages", b"proxy/", b"Error at 0x"):
        assert needle not in raw, raw[:500]


def assert_openai_error(raw: bytes) -> dict[str, Any]:
    assert_no_traceback(raw)
    body = json.loads(raw)
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    return err


def assert_forwarded_valid(upstream: FakeUpstream, start: int = 0) -> None:
    """Every chat body the upstream received is a payload a provider accepts."""
    for rec in upstream.chat[start:] + upstream.summaries:
        body = rec.body
        assert isinstance(body, dict)
        assert isinstance(body.get("model"), str) and body["model"]
        messages = body.get("messages")
        assert isinstance(messages, list) and messages
        check(messages)  # raises PayloadError on an invalid payload


def assert_wellformed_answer(status: int, raw: bytes) -> None:
    assert status < 500, (status, raw[:500])
    assert_no_traceback(raw)
    if status >= 400:
        assert_openai_error(raw)


async def post(session: aiohttp.ClientSession, url: str, data: Any, headers: dict[str, str] | None = None,
               ) -> tuple[int, bytes, Any]:
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    async with session.post(url, data=data, headers=hdrs) as r:
        return r.status, await r.read(), r.headers


def _status_line(name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024
    return 0


class PeakRSS:
    """Peak resident memory of this process (the proxy runs in it) while the block runs.

    Resets the kernel's high-water mark (``/proc/self/clear_refs`` = 5) first, so the figure is this
    block's peak, not the test session's.
    """

    def __enter__(self) -> PeakRSS:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:  # pragma: no cover - not Linux, or not allowed
            pass
        self.before = _status_line("VmRSS")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.peak_growth = max(0, _status_line("VmHWM") - self.before)
        self.after_growth = _status_line("VmRSS") - self.before


# --------------------------------------------------------------------------- strategies

BODY_KEYS = ["model", "messages", "stream", "max_tokens", "max_completion_tokens", "tools", "functions",
             "stream_options", "n", "temperature", "tool_choice", "user", "base_url", "api_base"]
MESSAGE_KEYS = ["role", "content", "tool_calls", "tool_call_id", "name", "function_call", "refusal", "type", "id"]
ROLES = ["system", "developer", "user", "user", "assistant", "assistant", "tool", "function", "robot", "", "USER"]
IDS = ["c1", "c2", "c3"]  # a small pool, so generated calls and results sometimes pair up

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(),
    st.integers(min_value=2**63 - 2, max_value=2**70),  # beyond int64: orjson reads these as floats
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.sampled_from(BODY_KEYS + MESSAGE_KEYS) | st.text(max_size=6), inner, max_size=4),
    max_leaves=10,
)
tool_call = st.one_of(
    st.fixed_dictionaries(
        {"id": st.sampled_from(IDS) | json_values},
        optional={"type": st.just("function") | json_values,
                  "function": st.fixed_dictionaries({}, optional={
                      "name": st.sampled_from(["lookup", "f", ""]) | json_values,
                      "arguments": st.sampled_from(['{"q": 1}', "", "{not json"]) | json_values})
                  | json_values}),
    json_values,
)
content = st.one_of(
    st.text(max_size=40), st.none(),
    st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "input_audio", ""])},
                                   optional={"text": st.text(max_size=20) | json_values,
                                             "image_url": json_values}) | json_values, max_size=3),
    json_values,
)
message = st.one_of(
    st.fixed_dictionaries({}, optional={
        "role": st.sampled_from(ROLES) | json_values,
        "content": content,
        "tool_calls": st.lists(tool_call, max_size=3) | json_values,
        "tool_call_id": st.sampled_from(IDS) | json_values,
        "name": st.sampled_from(["lookup", "alice"]) | json_values,
        "function_call": st.fixed_dictionaries({"name": st.sampled_from(["lookup"]) | json_values},
                                               optional={"arguments": st.text(max_size=5)}) | json_values,
    }),
    json_values,
)
body = st.one_of(
    st.fixed_dictionaries({"model": st.just(MODEL), "messages": st.lists(message, min_size=1, max_size=8)}),
    st.fixed_dictionaries({}, optional={
        # (valid-looking values are drawn more often, so that most bodies get deep into the pipeline)
        "model": st.sampled_from([MODEL, MODEL, "tiny", "", "unknown-model", "http://127.0.0.1:1/v1"])
        | st.sampled_from([MODEL, "tiny"]) | json_values,
        "messages": st.lists(message, min_size=1, max_size=8) | st.lists(message, min_size=1, max_size=8)
        | json_values,
        "stream": st.booleans() | json_values,
        "stream_options": st.just({"include_usage": True}) | json_values,
        "max_tokens": st.integers(-5, 2**64) | json_values,
        "max_completion_tokens": st.integers(-5, 100) | json_values,
        "tools": st.lists(json_values, max_size=2) | json_values,
        "functions": json_values,
        "n": json_values,
        "base_url": st.just("http://127.0.0.1:1/v1") | json_values,
    }),
    json_values,
)
# ways to spoil the encoding on the wire
encodings = st.sampled_from(["json", "json", "json", "truncated", "invalid_utf8", "bom", "nan", "dup_keys",
                             "trailing_garbage", "empty"])
override_header = st.one_of(
    st.none(), st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=30),
    st.sampled_from(["stack", "sliding-window", '{"type": "stack", "params": {"max_messages": 2}}',
                     '{"type": "summarising", "params": {"keep_turns": -1}}', '{"ref": "os:system"}',
                     '{"type": "x", "ref": "builtins:eval"}', "[]", "{"]),
)


def encode(value: Any, how: str) -> bytes:
    raw = json.dumps(value).encode()  # the stdlib keeps ints beyond 64 bits as written
    if how == "truncated":
        return raw[: max(0, len(raw) // 2)]
    if how == "invalid_utf8":
        return raw.replace(b'"', b'"\xff\xfe', 1) if b'"' in raw else b"\xff" + raw
    if how == "bom":
        return b"\xef\xbb\xbf" + raw
    if how == "nan":
        return raw.replace(b"0", b"NaN", 1) if b"0" in raw else b"[NaN]"
    if how == "dup_keys" and raw.startswith(b"{") and len(raw) > 2:
        return b'{"messages": "first", ' + raw[1:]
    if how == "trailing_garbage":
        return raw + b" }{"
    if how == "empty":
        return b""
    return raw


# --------------------------------------------------------------------------- fuzzing


FUZZ = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])


async def _fuzz_one(upstream: FakeUpstream, url: str, path: str, value: Any, how: str, override: str | None,
                    session: aiohttp.ClientSession) -> float:
    raw = encode(value, how)
    start = len(upstream.chat)
    headers = {"Authorization": "Bearer sk-client"}
    if override is not None:
        headers["x-ctxproxy-context-manager"] = override
    started = time.perf_counter()
    status, out, _ = await post(session, url + path, raw, headers)
    elapsed = time.perf_counter() - started
    assert_wellformed_answer(status, out)
    if path.endswith("/explain") and status == 200:
        explained = json.loads(out)
        assert set(explained) == {"messages", "report"}
        check(explained["messages"])
    assert_forwarded_valid(upstream, start)
    upstream.summaries.clear()
    return elapsed


@given(path=st.sampled_from(ENDPOINTS), value=body, how=encodings, override=override_header)
@FUZZ
async def test_fuzzed_bodies(upstream: FakeUpstream, start_proxy: Any, path: str, value: Any, how: str,
                             override: str | None) -> None:
    proxy = await _shared_proxy(upstream, start_proxy)
    async with aiohttp.ClientSession() as s:
        elapsed = await _fuzz_one(upstream, proxy.url, path, value, how, override, s)
    assert elapsed < 5, f"one small fuzzed request took {elapsed:.2f}s"


@pytest.mark.slow
@given(path=st.sampled_from(ENDPOINTS), value=body, how=encodings, override=override_header)
@settings(FUZZ, max_examples=3000)
async def test_fuzzed_bodies_long(upstream: FakeUpstream, start_proxy: Any, path: str, value: Any, how: str,
                                  override: str | None) -> None:
    proxy = await _shared_proxy(upstream, start_proxy)
    async with aiohttp.ClientSession() as s:
        await _fuzz_one(upstream, proxy.url, path, value, how, override, s)


async def _shared_proxy(upstream: FakeUpstream, start_proxy: Any) -> Any:
    """One proxy per test: hypothesis runs the test body once per example with the same fixtures."""
    proxy = getattr(start_proxy, "fuzz_proxy", None)
    if proxy is None:
        proxy = start_proxy.fuzz_proxy = await start_proxy(proxy_config(upstream))
    return proxy


# --------------------------------------------------------------------------- named hostile inputs


def _nested(depth: int, open_: bytes = b"[", close: bytes = b"]") -> bytes:
    return open_ * depth + close * depth


def _deep_message(depth: int) -> bytes:
    inner = b'{"a":' * (depth - 1) + b"1" + b"}" * (depth - 1)
    return b'{"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "x", "meta": ' + inner + b"}]}"


HOSTILE: list[tuple[str, bytes, int, str | None]] = [
    # (id, raw body, expected status, expected error code)
    ("nested-lists-10000", _nested(10000), 400, "invalid_json"),
    ("nested-objects-10000", b'{"a":' * 10000 + b"1" + b"}" * 10000, 400, "invalid_json"),
    ("nested-in-messages-10000", b'{"model": "gpt-4o-mini", "messages": ' + _nested(10000) + b"}", 400,
     "invalid_json"),
    ("nested-in-content-10000", b'{"model": "gpt-4o-mini", "messages": [{"role": "user", "content": '
     + _nested(10000) + b"}]}", 400, "invalid_json"),
    # orjson reads up to 1024 levels but writes only 254: a message deeper than that is refused (it was a 500)
    ("nested-extra-key-1000", _deep_message(1000), 400, "invalid_message"),
    ("nested-extra-key-300", _deep_message(300), 400, "invalid_message"),
    ("nested-extra-key-200", _deep_message(200), 200, None),
    # a deep field outside messages is forwarded byte for byte when nothing changed ...
    ("nested-tools-600-unchanged", b'{"model": "gpt-4o-mini", "tools": ' + _nested(600) + b', "messages": '
     b'[{"role": "user", "content": "hi"}]}', 200, None),
    # ... and refused when the body must be re-serialised (here: an orphan tool result is dropped)
    ("nested-tools-600-repaired", b'{"model": "gpt-4o-mini", "tools": ' + _nested(600) + b', "messages": '
     b'[{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "x", "content": "orphan"}]}', 400,
     "invalid_json"),  # (explain forwards nothing: 200 there)
    ("nested-content-1000", b'{"model": "gpt-4o-mini", "messages": [{"role": "user", "content": '
     + _nested(990) + b"}]}", 400, "invalid_content"),
    ("invalid-utf8-in-content", b'{"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "a\xff\xfeb"}]}',
     400, "invalid_json"),
    ("overlong-utf8", b'{"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "\xc0\xaf"}]}', 400,
     "invalid_json"),
    ("lone-surrogate-escape", b'{"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "\\ud800"}]}',
     400, "invalid_json"),
    ("utf16-body", '{"model": "gpt-4o-mini", "messages": []}'.encode("utf-16"), 400, "invalid_json"),
    ("nul-in-content", b'{"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "a\\u0000b"}]}', 200,
     None),
    ("max-tokens-2**64-1", b'{"model": "gpt-4o-mini", "max_tokens": 18446744073709551615, "messages": '
     b'[{"role": "user", "content": "hi"}]}', 400, "context_length_exceeded"),
    ("max-tokens-2**70", b'{"model": "gpt-4o-mini", "max_tokens": 1180591620717411303424, "messages": '
     b'[{"role": "user", "content": "hi"}]}', 400, "invalid_max_tokens"),
    ("max-tokens-1e308", b'{"model": "gpt-4o-mini", "max_tokens": 1e308, "messages": '
     b'[{"role": "user", "content": "hi"}]}', 400, "invalid_max_tokens"),
    ("max-tokens-1e999", b'{"model": "gpt-4o-mini", "max_tokens": 1e999, "messages": '
     b'[{"role": "user", "content": "hi"}]}', 400, "invalid_json"),
    ("max-tokens-negative", b'{"model": "gpt-4o-mini", "max_tokens": -9223372036854775808, "messages": '
     b'[{"role": "user", "content": "hi"}]}', 400, "invalid_max_tokens"),
    ("max-tokens-true", b'{"model": "gpt-4o-mini", "max_tokens": true, "messages": '
     b'[{"role": "user", "content": "hi"}]}', 400, "invalid_max_tokens"),
    ("nan-literal", b'{"model": "gpt-4o-mini", "temperature": NaN, "messages": [{"role": "user", "content": "hi"}]}',
     400, "invalid_json"),
    ("model-1mb", b'{"model": "' + b"m" * MB + b'", "messages": [{"role": "user", "content": "hi"}]}', 200, None),
    ("model-object", b'{"model": {"$gt": ""}, "messages": [{"role": "user", "content": "hi"}]}', 400,
     "missing_model"),
    ("messages-null", b'{"model": "gpt-4o-mini", "messages": null}', 400, "invalid_messages"),
    ("tool-calls-10000-unanswered", orjson.dumps({"model": MODEL, "messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in range(10000)]},
        {"role": "user", "content": "and?"}]}), 200, None),
    ("tool-calls-duplicate-ids", orjson.dumps({"model": MODEL, "messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "same", "type": "function", "function": {"name": "f", "arguments": "{}"}}] * 3},
        {"role": "tool", "tool_call_id": "same", "content": "r"},
        # one id three times: no result can say which call it answers, so it is refused
        {"role": "tool", "tool_call_id": "same", "content": "r"}]}), 400, "duplicate_tool_call_id"),
    ("tools-not-a-list", b'{"model": "gpt-4o-mini", "tools": 5, "messages": [{"role": "user", "content": "hi"}]}',
     200, None),
    ("empty-object", b"{}", 400, "missing_model"),
    ("whitespace-only", b" \n\t ", 400, "invalid_json"),
]


@contextlib.contextmanager
def _no_collector() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@pytest.mark.parametrize(("raw", "status", "code"), [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
async def test_hostile_bodies(upstream: FakeUpstream, start_proxy: Any, raw: bytes, status: int,
                              code: str | None) -> None:
    proxy = await start_proxy(proxy_config(upstream))
    async with aiohttp.ClientSession() as s:
        for path in ("/v1/chat/completions", "/v1/ctxproxy/explain"):
            # the bound is the proxy's: the test process's cyclic collector (over the whole suite's objects, late in
            # a run) is kept out of the timed request (a full run once took 6.3 s for one that takes under one alone)
            with _no_collector():
                started = time.perf_counter()
                got, out, _ = await post(s, proxy.url + path, raw)
                elapsed = time.perf_counter() - started
            assert elapsed < 5
            assert_wellformed_answer(got, out)
            if (
                path.endswith("/explain")
                and code == "invalid_json"
                and raw.startswith(b'{"model": "gpt-4o-mini", "tools"')
            ):
                assert got == 200
                continue
            assert got == status, out[:300]
            if code is not None:
                assert assert_openai_error(out)["code"] == code
    assert_forwarded_valid(upstream)
    if status >= 400:
        assert not upstream.chat


async def test_gzip_bomb_is_refused_with_bounded_memory(upstream: FakeUpstream, start_proxy: Any) -> None:
    """1 GiB of zeros in a ~1 MB gzip body: refused as too large, without inflating it all in memory."""
    proxy = await start_proxy(proxy_config(upstream, server={"max_body_mb": 8}))
    zeros = b"0" * (4 * MB)
    buf = gzip.compress(zeros, compresslevel=9)
    # a valid gzip stream may be several members back to back: 256 x 4 MiB = 1 GiB inflated
    bomb = buf * 256
    with PeakRSS() as mem:
        async with aiohttp.ClientSession(auto_decompress=False) as s:
            status, out, _ = await post(s, proxy.url + "/v1/chat/completions", bomb, {"Content-Encoding": "gzip"})
    print(f"\ngzip bomb: {status} {out[:80]!r}, peak RSS +{mem.peak_growth / MB:.0f} MB")
    assert status in (400, 413), out[:300]
    assert_openai_error(out)
    assert mem.peak_growth < 200 * MB, f"peak RSS grew {mem.peak_growth / MB:.0f} MB"
    assert not upstream.chat


def _messages(n: int) -> Iterator[dict[str, Any]]:
    for i in range(n):
        yield {"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i}"}


async def test_200k_messages_bounded_time_and_memory(upstream: FakeUpstream, start_proxy: Any) -> None:
    """200 000 short messages (10 MB): answered (summarised) in < 20 s, peak RSS growth < 500 MB."""
    proxy = await start_proxy(proxy_config(upstream))
    raw = orjson.dumps({"model": MODEL, "messages": list(_messages(200_000))})
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        await post(s, proxy.url + "/v1/chat/completions",
                   orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "warm up"}]}))
        with PeakRSS() as mem:
            started = time.perf_counter()
            status, out, headers = await post(s, proxy.url + "/v1/chat/completions", raw)
            elapsed = time.perf_counter() - started
    print(f"\n200k messages ({len(raw) / MB:.1f} MB): {status} in {elapsed:.1f}s, "
          f"peak RSS +{mem.peak_growth / MB:.0f} MB, after +{mem.after_growth / MB:.0f} MB, "
          f"{len(upstream.summaries)} summariser calls")
    assert status == 200, out[:300]
    assert headers["x-ctxproxy-summary"] == "waited"
    assert int(headers["x-ctxproxy-tokens-out"]) <= 128000 - 16384 - 12800
    assert elapsed < 65  # 5-6.5 s measured: ten times that
    assert mem.peak_growth < 500 * MB
    assert_forwarded_valid(upstream)


async def test_30mb_single_message_refused_in_bounded_time(upstream: FakeUpstream, start_proxy: Any) -> None:
    """One 30 MB user turn can never fit: 400 context_length_exceeded, no provider call."""
    proxy = await start_proxy(proxy_config(upstream))
    text = "lorem ipsum dolor sit amet " * (30 * MB // 27)
    raw = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": text}]})
    del text
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        with PeakRSS() as mem:
            started = time.perf_counter()
            status, out, _ = await post(s, proxy.url + "/v1/chat/completions", raw)
            elapsed = time.perf_counter() - started
    print(f"\n30 MB one message: {status} in {elapsed:.1f}s, peak RSS +{mem.peak_growth / MB:.0f} MB")
    assert status == 400
    assert assert_openai_error(out)["code"] == "context_length_exceeded"
    assert elapsed < 48  # 1.5-4.8 s measured: ten times that
    assert mem.peak_growth < 600 * MB
    assert not upstream.chat and not upstream.summaries


@pytest.mark.parametrize("chunked", [False, True])
async def test_30mb_body_over_the_limit_is_413_early(upstream: FakeUpstream, start_proxy: Any,
                                                     chunked: bool) -> None:
    proxy = await start_proxy(proxy_config(upstream, server={"max_body_mb": 16}))
    raw = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * (30 * MB)}]})

    async def pieces() -> Any:
        for i in range(0, len(raw), MB):
            yield raw[i:i + MB]

    async with aiohttp.ClientSession() as s:
        started = time.perf_counter()
        try:
            status, out, _ = await post(s, proxy.url + "/v1/chat/completions", pieces() if chunked else raw)
        except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
            pytest.fail("the proxy dropped the connection instead of answering 413")
        elapsed = time.perf_counter() - started
    assert status == 413
    assert assert_openai_error(out)["code"] == "request_too_large"
    assert elapsed < 5
    assert not upstream.chat


@pytest.mark.slow
async def test_30mb_conversation_summarised_in_bounded_time(upstream: FakeUpstream, start_proxy: Any) -> None:
    """A 30 MB, 300-turn conversation: served with a summary; the summariser is called once per chunk."""
    proxy = await start_proxy(proxy_config(upstream, context_manager={"type": "summarising",
                                                                      "params": {"keep_turns": 4}}))
    messages = []
    for i in range(600):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": f"word{i} " * 7000})
    raw = orjson.dumps({"model": MODEL, "messages": messages})
    del messages
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        with PeakRSS() as mem:
            started = time.perf_counter()
            status, out, headers = await post(s, proxy.url + "/v1/chat/completions", raw)
            elapsed = time.perf_counter() - started
    print(f"\n30 MB conversation ({len(raw) / MB:.1f} MB, 300 turns): {status} in {elapsed:.1f}s, "
          f"peak RSS +{mem.peak_growth / MB:.0f} MB, {len(upstream.summaries)} summariser calls")
    assert status == 200, out[:300]
    assert headers["x-ctxproxy-summary"] == "waited"
    assert elapsed < 60
    assert mem.peak_growth < 1500 * MB
    assert_forwarded_valid(upstream)


async def test_unique_unknown_model_names_stay_bounded(upstream: FakeUpstream, start_proxy: Any,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """Model names come from clients: 1100 distinct 20 kB names must not grow memory or logs without bound
    (the 'no known context window' warning remembered every name, and logged it whole)."""
    from proxy.policy import WARNED_MODELS

    proxy = await start_proxy(proxy_config(upstream))
    caplog.set_level("WARNING", logger="ctxproxy")
    async with aiohttp.ClientSession() as s:
        for i in range(WARNED_MODELS + 100):
            model = f"unknown-{i:05d}-" + "m" * 20_000
            status, out, _ = await post(s, proxy.url + "/v1/ctxproxy/explain", orjson.dumps(
                {"model": model, "messages": [{"role": "user", "content": "hi"}]}))
            assert status == 200, out[:200]
    warnings = [r for r in caplog.records if "no known context window" in r.getMessage()]
    assert len(warnings) <= WARNED_MODELS
    assert max(len(r.getMessage()) for r in warnings) < 300
    assert len(proxy.state.runtime.routes._warned) <= WARNED_MODELS
