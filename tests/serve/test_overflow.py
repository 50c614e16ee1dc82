"""Recovering from the provider's refusal for length (proxy/serve/overflow.py), over HTTP on every wire.

The fake upstream enforces a real window (``ProviderWindow``) and refuses an overflow in the provider's own
words, numbers included; the proxy's route says the window is ten times larger. The client must get its
answer, the upstream must see at most one refused attempt, and the next request of that model must fit the
first time, also after a restart (the learned window is kept in the cache backend: disk and a real Redis).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.conftest import RunningProxy, StartProxy
from tests.fake_upstream import FakeUpstream, ProviderWindow
from tests.outside import metric_total, scrape, share_model_map, text_of
from tests.redis_server import RedisServer, redis_server_fixture

GPT, CLAUDE = "gpt-4o-mini", "claude-sonnet-4-5"
REAL, CONFIGURED, OUT = 12_000, 120_000, 1000  # the provider's window, the route's (ten times too large)
ADMIN = "sk-admin"
redis_server = redis_server_fixture(scope="module")


@pytest.fixture(autouse=True)
def _shared_model_map(monkeypatch: pytest.MonkeyPatch) -> None:
    share_model_map(monkeypatch)  # speed only


def config(upstream: FakeUpstream, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "upstreams": {"openai": {"base_url": upstream.base_url, "api_key": "sk-upstream"},
                      "anthropic": {"base_url": upstream.url, "api": "anthropic", "api_key": "sk-ant-upstream"}},
        "models": [{"name": GPT, "upstream": "openai", "context_window": CONFIGURED, "max_output_tokens": 16384},
                   {"name": CLAUDE, "upstream": "anthropic", "context_window": CONFIGURED,
                    "max_output_tokens": 8192}],
        "tenants": [{"name": "acme", "keys": ["sk-acme"]}],
        "admin": {"keys": [ADMIN]},
        "cache": {"backend": "memory"},
        "context_manager": {"type": "sliding-window", "params": {"keep_turns": 1000}},  # the budget decides
    }
    cfg.update(extra)
    return cfg


def talk(turns: int) -> list[dict[str, str]]:
    """A plain conversation of about 600 tokens a turn, ending with a user message."""
    out = []
    for t in range(turns):
        out += [{"role": "user", "content": f"Question {t}: " + text_of(300, seed=t)},
                {"role": "assistant", "content": f"Answer {t}: " + text_of(300, seed=t + 1000)}]
    return [*out, {"role": "user", "content": "And now?"}]


DIALECT = {"chat": "openai", "responses": "responses", "messages": "anthropic"}
PATH = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}


def body_of(wire: str, turns: int, *, stream: bool = False, model: str | None = None) -> dict[str, Any]:
    messages = talk(turns)
    if wire == "chat":
        return {"model": model or GPT, "max_tokens": OUT, "messages": [
            {"role": "system", "content": "You are terse."}, *messages], "stream": stream}
    if wire == "responses":
        return {"model": model or GPT, "max_output_tokens": OUT, "instructions": "You are terse.",
                "input": messages, "stream": stream}
    return {"model": model or CLAUDE, "max_tokens": OUT, "system": "You are terse.", "messages": messages,
            "stream": stream}


async def send(proxy: RunningProxy, wire: str, body: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
    headers = {"Authorization": "Bearer sk-acme", "anthropic-version": "2023-06-01"}
    async with aiohttp.ClientSession() as s, s.post(proxy.url + PATH[wire], json=body, headers=headers) as r:
        return r.status, {k.lower(): v for k, v in r.headers.items()}, await r.read()


def answered(wire: str, raw: bytes, stream: bool) -> bool:
    """The answer is the upstream's whole answer (streams end with the wire's own terminal event)."""
    if stream:
        return {"chat": b"data: [DONE]", "responses": b"response.completed", "messages": b"message_stop"}[wire] in raw
    return bool(json.loads(raw))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("wire", ["chat", "responses", "messages"])
async def test_a_window_ten_times_too_large_is_recovered_once_and_then_fits(
        upstream: FakeUpstream, start_proxy: StartProxy, wire: str, stream: bool) -> None:
    """The first request is refused once, in the provider's words, and re-assembled within the window the
    refusal states: the client gets 200 with a warning. The next request fits the first time."""
    upstream.window = ProviderWindow(REAL, dialect=DIALECT[wire])
    proxy = await start_proxy(config(upstream))
    status, headers, raw = await send(proxy, wire, body_of(wire, 40, stream=stream))
    assert status == 200 and answered(wire, raw, stream)
    assert len(upstream.window_refused) == 1 and upstream.window_refused[0] > 2 * REAL
    assert len(upstream.window_counts) == 2 and upstream.window_counts[1] + OUT <= REAL
    assert "refused the request for its length" in headers["x-ctxproxy-warning"]
    assert int(headers["x-ctxproxy-tokens-out"]) < int(headers["x-ctxproxy-tokens-in"])
    status, _, raw = await send(proxy, wire, body_of(wire, 42, stream=stream))
    assert status == 200 and answered(wire, raw, stream)
    assert len(upstream.window_refused) == 1 and len(upstream.window_counts) == 3  # the first time
    text = await scrape(proxy, ADMIN)
    model = CLAUDE if wire == "messages" else GPT
    assert metric_total(text, "ctxproxy_overflow_recovered_total", tenant="acme", model=model) == 1
    assert metric_total(text, "ctxproxy_overflow_failed_total") == 0
    # the refusal and both answers taught calibration (a stream's usage only where the client asked for it)
    assert metric_total(text, "ctxproxy_calibration_samples_total", result="refused") == 1
    assert metric_total(text, "ctxproxy_calibration_samples_total", result="used") == (0 if stream and wire == "chat"
                                                                                      else 2)


async def explain(proxy: RunningProxy, wire: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.post(
            proxy.url + f"/v1/ctxproxy/explain/{wire}", json=body_of(wire, 5),
            headers={"Authorization": "Bearer sk-acme"}) as r:
        assert r.status == 200
        report: dict[str, Any] = (await r.json())["report"]
        return report


@pytest.mark.parametrize("backend", ["disk", "redis"])
async def test_the_learned_window_survives_a_restart(
        upstream: FakeUpstream, start_proxy: StartProxy, tmp_path: Path, backend: str,
        request: pytest.FixtureRequest) -> None:
    """Learned once, kept in the cache backend: a new process (or a replica) fits the first time."""
    if backend == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        cache: dict[str, Any] = {"backend": "redis", "url": server.url}
    else:
        cache = {"backend": "disk", "path": str(tmp_path / "cache")}
    upstream.window = ProviderWindow(REAL, dialect="openai")
    first = await start_proxy(config(upstream, cache=cache))
    status, _, _ = await send(first, "chat", body_of("chat", 40))
    assert status == 200 and len(upstream.window_refused) == 1
    await first.runner.cleanup()  # the process stops: what it learned is written on the way out
    again = await start_proxy(config(upstream, cache=cache))
    report = await explain(again, "chat")
    assert report["calibration_detail"]["provider_window"] == REAL
    assert report["window"] == REAL and report["hard_budget"] <= REAL - OUT
    status, _, _ = await send(again, "chat", body_of("chat", 41))
    assert status == 200
    assert len(upstream.window_refused) == 1 and len(upstream.window_counts) == 3  # the first time


@pytest.mark.parametrize("dialect", ["vllm", "sglang", "llamacpp", "mistral", "ollama"])
async def test_every_providers_words_are_recovered(upstream: FakeUpstream, start_proxy: StartProxy, dialect: str) -> None:
    """vLLM, SGLang, llama.cpp, Mistral state the window; Ollama only how far over it the request was (the window
    is then the proxy's calibrated count less the excess: an estimate on the safe side)."""
    upstream.window = ProviderWindow(REAL, dialect=dialect)
    proxy = await start_proxy(config(upstream))
    for turns in (40, 42):
        status, _, _ = await send(proxy, "chat", body_of("chat", turns))
        assert status == 200
    assert len(upstream.window_refused) == 1 and len(upstream.window_counts) == 3


@pytest.mark.parametrize("dialect", ["responses-plain", "ollama-plain"])
async def test_a_refusal_without_numbers_steps_the_window_down(
        upstream: FakeUpstream, start_proxy: StartProxy, dialect: str) -> None:
    """"Your input exceeds the context window of this model": no number to learn from. The window is taken as 3/4
    of what the refused request asked for; a window a quarter too large is recovered on the first request."""
    upstream.window = ProviderWindow(REAL, dialect=dialect)
    proxy = await start_proxy(config(upstream, models=[
        {"name": GPT, "upstream": "openai", "context_window": REAL * 5 // 4, "max_output_tokens": 16384}]))
    wire = "responses" if dialect == "responses-plain" else "chat"
    for turns in (40, 42):
        status, _, _ = await send(proxy, wire, body_of(wire, turns))
        assert status == 200
    assert len(upstream.window_refused) == 1 and len(upstream.window_counts) == 3
    assert (await explain(proxy, wire))["window"] < REAL


async def test_ten_times_too_large_and_no_numbers_converges_in_steps(
        upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """With no number and a window ten times too large, one retry cannot find the window: the first request gets
    the provider's error after two refused attempts (never a third), and each refusal narrows the window, so the
    requests after it fit."""
    upstream.window = ProviderWindow(REAL, dialect="responses-plain")
    proxy = await start_proxy(config(upstream))
    status, _, raw = await send(proxy, "responses", body_of("responses", 40))
    assert status == 400 and json.loads(raw)["error"]["code"] == "context_length_exceeded"
    assert len(upstream.window_refused) == 2 == len(upstream.window_counts)
    status, _, _ = await send(proxy, "responses", body_of("responses", 42))
    assert status == 200 and len(upstream.window_refused) == 2
    text = await scrape(proxy, ADMIN)
    assert metric_total(text, "ctxproxy_overflow_failed_total", tenant="acme", model=GPT) == 1


async def test_a_retry_refused_again_is_not_retried_again(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """A provider that refuses whatever it is sent: two attempts, never a third; the client gets its words."""
    refusal = {"type": "error", "error": {"type": "invalid_request_error",
                                          "message": "prompt is too long: 9000 tokens > 5000 maximum"}}
    upstream.mode, upstream.status, upstream.status_body = "status", 400, refusal
    proxy = await start_proxy(config(upstream))
    status, _, raw = await send(proxy, "messages", body_of("messages", 40))
    assert status == 400 and json.loads(raw) == refusal  # Anthropic's own body, as Anthropic sent it
    assert len(upstream.messages) == 2
    text = await scrape(proxy, ADMIN)
    assert metric_total(text, "ctxproxy_overflow_failed_total", tenant="acme", model=CLAUDE) == 1
    assert metric_total(text, "ctxproxy_overflow_recovered_total") == 0


async def test_what_cannot_fit_the_providers_window_is_refused_by_the_proxy(
        upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """The current turn alone is larger than the provider's real window: the retry is not sent; the client gets
    the proxy's own error, which names the provider's window."""
    upstream.window = ProviderWindow(REAL, dialect="openai")
    proxy = await start_proxy(config(upstream))
    body = body_of("chat", 3)
    body["messages"][-1]["content"] = text_of(REAL + 2000)
    status, _, raw = await send(proxy, "chat", body)
    error = json.loads(raw)["error"]
    assert status == 400 and error["code"] == "context_length_exceeded"
    assert f"the provider's window {REAL}" in error["message"]
    assert len(upstream.window_counts) == 1


async def test_a_stream_that_began_is_never_retried(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """An overflow reported inside a stream that already began: the client has part of the answer; it gets the
    rest as the upstream sent it, and nothing is sent twice."""
    upstream.mode = "error_in_stream"
    upstream.stream_error = {"message": "This model's maximum context length is 12000 tokens. However, your "
                                        "messages resulted in 24000 tokens.", "code": "context_length_exceeded"}
    proxy = await start_proxy(config(upstream))
    status, _, raw = await send(proxy, "chat", body_of("chat", 3, stream=True))
    assert status == 200 and b"maximum context length" in raw
    assert len(upstream.chat) == 1


@pytest.mark.parametrize(("status", "message"), [
    (429, "Rate limit reached: too many tokens per minute. Limit 30000, requested 42000."),
    (413, "Request too large for gpt-4o-mini: tokens per min (TPM): Limit 30000, Requested 42000."),
    (400, "ThrottlingException: Too many tokens, please wait before trying again."),
    (400, "Invalid 'messages[3].content': string too long."),
    (413, "Request exceeds the maximum size"),  # Anthropic's limit on the body's bytes, not a window
])
async def test_other_refusals_are_relayed_once(
        upstream: FakeUpstream, start_proxy: StartProxy, status: int, message: str) -> None:
    """A rate limit worded with tokens, or any other 4xx, is not an overflow: relayed as it came, sent once."""
    upstream.mode, upstream.status = "status", status
    upstream.status_body = {"error": {"message": message, "type": "invalid_request_error", "code": None}}
    proxy = await start_proxy(config(upstream))
    got, _, raw = await send(proxy, "chat", body_of("chat", 3))
    assert got == status and json.loads(raw)["error"]["message"] == message
    assert len(upstream.chat) == 1
    assert (await explain(proxy, "chat"))["window"] == CONFIGURED


async def test_a_history_the_provider_holds_is_not_retried_but_its_window_is_learned(
        upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """A Responses request that continues ``previous_response_id`` is forwarded as sent: a retry would send the
    same thing, so none is made; the window the refusal states is learned all the same."""
    upstream.window = ProviderWindow(REAL, dialect="responses")
    proxy = await start_proxy(config(upstream))
    body = body_of("responses", 40)
    body["previous_response_id"] = "resp_earlier"
    status, _, _ = await send(proxy, "responses", body)
    assert status == 400 and len(upstream.window_counts) == 1
    assert (await explain(proxy, "responses"))["window"] == REAL
    status, _, _ = await send(proxy, "responses", body_of("responses", 42))
    assert status == 200 and len(upstream.window_refused) == 1


async def test_a_window_too_small_to_be_true_is_not_learned(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    upstream.mode, upstream.status = "status", 400
    upstream.status_body = {"error": {"message": "This model's maximum context length is 10 tokens. However, your "
                                                 "messages resulted in 20000 tokens.",
                                      "code": "context_length_exceeded"}}
    proxy = await start_proxy(config(upstream))
    status, _, _ = await send(proxy, "chat", body_of("chat", 30))
    assert status == 400 and len(upstream.chat) == 1
    assert (await explain(proxy, "chat"))["window"] == CONFIGURED


async def test_the_request_log_says_what_became_of_the_refusal(
        upstream: FakeUpstream, start_proxy: StartProxy, caplog: pytest.LogCaptureFixture) -> None:
    upstream.window = ProviderWindow(REAL, dialect="openai")
    proxy = await start_proxy(config(upstream))
    with caplog.at_level("INFO"):
        status, headers, _ = await send(proxy, "chat", body_of("chat", 40))
        assert status == 200
        await asyncio.sleep(0.05)  # the log line is written after the answer
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "ctxproxy.requests"]
    assert [line.get("overflow") for line in lines] == ["recovered"]
    assert lines[0]["tokens_out"] == int(headers["x-ctxproxy-tokens-out"]) <= REAL
    warnings = [r.getMessage() for r in caplog.records if r.name == "ctxproxy" and "refused" in r.getMessage()]
    assert len(warnings) == 1 and "sk-acme" not in warnings[0]


@pytest.mark.filterwarnings("ignore:.*ReadOnly.*:UserWarning")
@pytest.mark.parametrize("stream", [False, True])
async def test_a_litellm_route_recovers_from_context_window_exceeded(
        upstream: FakeUpstream, start_proxy: StartProxy, stream: bool) -> None:
    """litellm raises ContextWindowExceededError for the provider's refusal: recovered the same way."""
    pytest.importorskip("litellm")
    upstream.window = ProviderWindow(REAL, dialect="openai")
    proxy = await start_proxy(config(upstream, models=[
        {"name": GPT, "provider": "litellm", "upstream": "openai", "model": "openai/gpt-4o-mini",
         "context_window": CONFIGURED, "max_output_tokens": 16384}]))
    for turns in (40, 42):
        status, _, raw = await send(proxy, "chat", body_of("chat", turns, stream=stream))
        assert status == 200 and answered("chat", raw, stream), raw
    assert len(upstream.window_refused) == 1 and len(upstream.window_counts) == 3


@pytest.mark.parametrize("wire", ["chat", "responses", "messages"])
async def test_observe_mode_relays_the_refusal_and_learns_the_window(
        upstream: FakeUpstream, start_proxy: StartProxy, wire: str) -> None:
    """Observe mode forwards the client's payload as sent: a refusal for length is relayed, never retried with
    a managed payload, but the provider's window is learned, so what enforce would forward next fits it."""
    upstream.window = ProviderWindow(REAL, dialect=DIALECT[wire])
    proxy = await start_proxy(config(upstream, mode="observe"))
    body = body_of(wire, 40)
    status, headers, raw = await send(proxy, wire, body)
    assert status == 400 and headers["x-ctxproxy-mode"] == "observe" and str(REAL).encode() in raw  # its words
    assert len(upstream.window_refused) == 1 == len(upstream.window_counts)  # sent once, as the client sent it
    forwarded = (upstream.messages if wire == "messages" else upstream.responses if wire == "responses"
                 else upstream.chat)[-1].body
    assert forwarded[{"messages": "messages", "responses": "input", "chat": "messages"}[wire]] == \
        body["input" if wire == "responses" else "messages"]
    report = await explain(proxy, wire)
    assert report["window"] == REAL
    status, headers, _ = await send(proxy, wire, body_of(wire, 41))
    assert status == 400 and int(headers["x-ctxproxy-tokens-out"]) + OUT <= REAL  # what enforce would send fits
    text = await scrape(proxy, ADMIN)
    model = CLAUDE if wire == "messages" else GPT
    assert metric_total(text, "ctxproxy_overflow_failed_total", tenant="acme", model=model) == 2
    assert metric_total(text, "ctxproxy_overflow_recovered_total") == 0
