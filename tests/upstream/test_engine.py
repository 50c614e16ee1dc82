"""proxy.upstream.engine: the summariser's engine over a fake Provider.

Every failure becomes ``SummaryUnavailable`` with a bounded ``reason`` and a message
that names the upstream status, the upstream's own message, the route and the
summariser call's own request id.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from plugins.base import Completion
from proxy.core.errors import (
    BadRequest,
    ModelNotFound,
    SummaryUnavailable,
    UpstreamError,
    UpstreamStatus,
    UpstreamTimeout,
    UpstreamUnreachable,
    normalise_error_body,
)
from proxy.policy import ModelRoute
from proxy.upstream.engine import FAILURE_REASONS, UpstreamEngine
from tests.conftest import Handler, RunningProxy, StartProxy, base_config
from tests.fake_upstream import FakeUpstream, is_uuid
from tests.faults import (
    CHAT_MODEL,
    eventually,
    openai_error,
    send_chat,
    settle,
    warm,
)
from tests.outside import chat_body, metric_samples, post, scrape
from tests.store.test_summaries_http import config, conversation
from tests.store.test_summaries_http import config as summarising_config

ROUTE = ModelRoute("summarizer", "openai-eu", "gpt-4o-mini-2024-07-18", "openai", 128_000, 16_384, "o200k_base")
MESSAGES = [{"role": "system", "content": "Summarise."}, {"role": "user", "content": "New turns: ..."}]


class FakeProvider:
    """A Provider whose ``complete`` answers, raises or hangs as told."""

    def __init__(self, outcome: Any = None, delay: float = 0.0) -> None:
        self.outcome = outcome
        self.delay = delay
        self.calls: list[dict[str, Any]] = []

    async def send(self, route: ModelRoute, call: Any) -> Any:  # pragma: no cover - not used by the engine
        raise AssertionError("the engine never sends")

    async def complete(self, route: ModelRoute, messages: list[dict[str, Any]], *, max_tokens: int, timeout: float,
                       request_id: str) -> Completion:
        self.calls.append({"route": route, "messages": messages, "max_tokens": max_tokens, "timeout": timeout,
                           "request_id": request_id})
        if self.delay:
            await asyncio.sleep(self.delay)
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome or Completion("- summary", route.name, 900, 40, route.upstream_model)


def engine(provider: FakeProvider, routes: dict[str, ModelRoute] | None = None) -> UpstreamEngine:
    table = routes if routes is not None else {"summarizer": ROUTE}

    def route(model: str) -> ModelRoute:
        if model not in table:
            raise ModelNotFound(f"The model {model!r} does not exist")
        return table[model]

    return UpstreamEngine(route, lambda r: provider)


async def complete(e: UpstreamEngine, model: str = "summarizer", timeout: float = 2.0) -> Completion:
    return await e.complete(model, MESSAGES, max_tokens=300, timeout=timeout, purpose="summarize",
                            request_id="client-req-42")


UUID = re.compile(r"summariser request ([0-9a-f-]{36})\)")


def call_id_of(message: str) -> str:
    match = UUID.search(message)
    assert match, message
    return match.group(1)


async def test_a_call_goes_through_the_routes_provider_with_its_own_uuid() -> None:
    provider = FakeProvider()
    out = await complete(engine(provider))
    assert out.text == "- summary" and out.upstream_model == "gpt-4o-mini-2024-07-18"
    (call,) = provider.calls
    assert call["route"] is ROUTE and call["messages"] is MESSAGES
    assert (call["max_tokens"], call["timeout"]) == (300, 2.0)
    assert call["request_id"] != "client-req-42"
    assert uuid.UUID(call["request_id"]).version == 4


async def test_each_call_gets_a_new_request_id() -> None:
    provider = FakeProvider()
    e = engine(provider)
    await complete(e)
    await complete(e)
    assert provider.calls[0]["request_id"] != provider.calls[1]["request_id"]


def where(message: str) -> None:
    assert "route 'summarizer' -> openai-eu/gpt-4o-mini-2024-07-18" in message
    call_id_of(message)


@pytest.mark.parametrize(("outcome", "reason", "says"), [
    (UpstreamStatus(429, normalise_error_body(429, {"error": {"message": "Rate limit reached for gpt-4o-mini in "
                                                              "organization org-x on tokens per min (TPM)"}})),
     "status", "upstream answered 429: Rate limit reached for gpt-4o-mini"),
    (UpstreamStatus(500, normalise_error_body(500, "<html>\n  <body>Internal\n error</body>\n</html>")),
     "status", "upstream answered 500: <html> <body>Internal error</body> </html>"),
    (UpstreamStatus(503, normalise_error_body(503, None)), "status", "upstream answered 503: upstream answered 503"),
    (UpstreamStatus(400, normalise_error_body(400, {"error": {"message": "Incorrect API key provided: [redacted]"}})),
     "status", "upstream answered 400: Incorrect API key provided: [redacted]"),
    (UpstreamTimeout("The upstream did not answer in time."), "timeout", "timed out after 2s"),
    (UpstreamUnreachable("The upstream is unreachable (ClientConnectorError)."), "unreachable",
     "The upstream is unreachable (ClientConnectorError)."),
    (UpstreamError("The upstream rejected the proxy's credentials; the proxy's operator must fix its configuration.",
                   code="upstream_auth_failed"), "error", "rejected the proxy's credentials"),
    (BadRequest("served through litellm on the chat wire only", code="unsupported_wire"), "error",
     "served through litellm"),
])
async def test_failures_become_summary_unavailable(outcome: BaseException, reason: str, says: str) -> None:
    with pytest.raises(SummaryUnavailable) as err:
        await complete(engine(FakeProvider(outcome)))
    assert err.value.reason == reason
    assert reason in FAILURE_REASONS
    message = str(err.value)
    assert says in message
    where(message)
    assert "New turns" not in message  # never prompt text


async def test_the_upstream_message_is_shortened_to_one_line() -> None:
    body = normalise_error_body(400, {"error": {"message": "bad\n\n  request " + "x" * 1000}})
    with pytest.raises(SummaryUnavailable) as err:
        await complete(engine(FakeProvider(UpstreamStatus(400, body))))
    upstream_part = str(err.value).split("upstream answered 400: ", 1)[1].split(" (route", 1)[0]
    assert upstream_part.startswith("bad request xxx")
    assert len(upstream_part) == 300
    assert "\n" not in str(err.value)


async def test_a_provider_slower_than_the_timeout_is_cut_off() -> None:
    provider = FakeProvider(delay=5)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(SummaryUnavailable) as err:
        await complete(engine(provider), timeout=0.05)
    assert loop.time() - started < 1
    assert err.value.reason == "timeout"
    assert "timed out after 0.05s" in str(err.value)
    where(str(err.value))


async def test_an_unrouted_summariser_model() -> None:
    provider = FakeProvider()
    with pytest.raises(SummaryUnavailable) as err:
        await complete(engine(provider, routes={}), model="nope-" + "x" * 500)
    assert err.value.reason == "no_route"
    assert "has no route" in str(err.value)
    assert len(str(err.value)) < 200
    assert provider.calls == []


async def test_the_call_id_in_the_message_is_the_one_sent_upstream() -> None:
    provider = FakeProvider(UpstreamTimeout("slow"))
    with pytest.raises(SummaryUnavailable) as err:
        await complete(engine(provider))
    assert call_id_of(str(err.value)) == provider.calls[0]["request_id"]


async def test_cancellation_is_not_swallowed() -> None:
    provider = FakeProvider(delay=5)
    task = asyncio.create_task(complete(engine(provider)))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


MODEL = "small-model"  # 8k window: conversation(40) is summarised


SUMMARISER = "gpt-4o-mini"  # the summariser's model route (config(): summarizer_model)


UPSTREAM_KEY = "sk-upstream-secret"  # base_config's upstream key


PROMPT_TEXT = "please check booking"  # appears in every turn of conversation(); never in a log


async def chat(proxy: RunningProxy, messages: list[dict[str, Any]], request_id: str | None = None
               ) -> tuple[int, dict[str, str]]:
    headers = {"Authorization": "Bearer sk-client"}
    if request_id is not None:
        headers["x-request-id"] = request_id
    async with aiohttp.ClientSession() as s, s.post(proxy.base_url + "/chat/completions", headers=headers,
                                                    json={"model": MODEL, "messages": messages}) as r:
        await r.read()
        return r.status, {k.lower(): v for k, v in r.headers.items()}


def ids(upstream: FakeUpstream, purpose: str) -> list[str | None]:
    """X-Request-ID of every request the upstream received for ``purpose`` (summarize, or a path)."""
    return [rid for p, rid in upstream.request_ids if p == purpose]


@pytest.mark.usefixtures("shared_model_map")
async def test_summariser_calls_carry_their_own_uuid_request_id(upstream: FakeUpstream, start_proxy: StartProxy
                                                                ) -> None:
    """Each summariser call is sent with a UUID of its own, not the parent's id and not a fixed name: a server
    that validates X-Request-ID as a UUID (as several ASGI middlewares do) refused every summariser call."""
    proxy = await start_proxy(config(upstream.base_url))
    parent = str(uuid.uuid4())
    status, headers = await chat(proxy, conversation(40), request_id=parent)
    assert (status, headers["x-ctxproxy-summary"]) == (200, "waited")
    sent = ids(upstream, "summarize")
    assert sent and all(is_uuid(rid) for rid in sent), sent
    assert parent not in sent
    assert ids(upstream, "/v1/chat/completions") == [parent]  # the client's id is still kept on its own call


@pytest.mark.usefixtures("shared_model_map")
async def test_summaries_created_and_reused_against_an_upstream_enforcing_uuid_request_ids(
    upstream: FakeUpstream, start_proxy: StartProxy
) -> None:
    """With an upstream that validates X-Request-ID as a UUID, summaries are created, then reused."""
    upstream.require_uuid_request_id = True
    proxy = await start_proxy(config(upstream.base_url))
    status, headers = await chat(proxy, conversation(40))
    assert status == 200
    refused = [{k.lower(): v for k, v in r.headers.items()}.get("x-request-id") for r in upstream.rejected]
    assert refused == [], f"the upstream refused calls with X-Request-ID {refused}"
    assert headers["x-ctxproxy-summary"] == "waited"
    status, headers = await chat(proxy, conversation(40))
    assert (status, headers["x-ctxproxy-summary"]) == (200, "reused")


@pytest.mark.usefixtures("shared_model_map")
async def test_summariser_failure_log_line_says_status_message_route_and_request_id(
    upstream: FakeUpstream, start_proxy: StartProxy, caplog: pytest.LogCaptureFixture
) -> None:
    """One log line per summariser failure: upstream status, its message (key redacted), route, request id."""
    caplog.set_level(logging.DEBUG)
    upstream.summary_mode = "status"
    upstream.summary_status = 400
    upstream.summary_error = f"Summary refused by gateway rule QX-9 (key {UPSTREAM_KEY})"
    proxy = await start_proxy(config(upstream.base_url))
    parent = str(uuid.uuid4())
    status, headers = await chat(proxy, conversation(40), request_id=parent)
    assert (status, headers["x-ctxproxy-summary"]) == (200, "failed")
    text = [r.getMessage() for r in caplog.records]
    lines = [t for t in text if "QX-9" in t]
    assert lines, "no log line carries the upstream's error message:\n" + "\n".join(text)
    line = lines[0]
    assert re.search(r"\b400\b", line), line
    assert SUMMARISER in line or "fake" in line, line  # the summariser's model route (or its upstream's name)
    assert parent in line, line  # the parent request's id, so the failure can be tied to the client's request
    for t in text:  # redacted of keys, never prompt text
        assert UPSTREAM_KEY not in t and PROMPT_TEXT not in t, t


@pytest.mark.usefixtures("shared_model_map")
async def test_summariser_failures_are_counted_by_reason(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """ctxproxy_summarizer_failures_total{reason=...} counts failures, a refusal apart from an empty answer."""
    # two requests that each need a summary: without masking first (which may bring one of them under T)
    proxy = await start_proxy(config(upstream.base_url, context_manager={
        "type": "summarising", "params": {"keep_turns": 4, "mask_observations": False}}))
    upstream.summary_mode = "status"
    status, headers = await chat(proxy, conversation(40))
    assert (status, headers["x-ctxproxy-summary"]) == (200, "failed")
    upstream.summary_mode = "empty"
    status, headers = await chat(proxy, conversation(41))
    # the conversation's summary failed: this request does not wait for the retry, made in the background
    assert (status, headers["x-ctxproxy-summary"]) == (200, "failed")
    await proxy.state.shared.background.idle()
    samples = metric_samples(await scrape(proxy), "ctxproxy_summarizer_failures_total")
    reasons = {labels.get("reason"): value for labels, value in samples if value > 0}
    assert sum(reasons.values()) == 2, samples
    assert None not in reasons and len(reasons) == 2, samples  # an upstream refusal and an empty answer differ


async def test_an_empty_summariser_answer_is_counted_as_empty(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """A summariser that answers with empty text serves the request by the trimmer (``failed``) and counts one
    failure with reason ``empty``, apart from upstream errors."""
    proxy = await start_proxy(summarising_config(upstream.base_url))
    upstream.summary_mode = "empty"
    status, headers, _ = await post(proxy, chat_body(conversation(40)))
    assert (status, headers["x-ctxproxy-summary"]) == (200, "failed")
    samples = metric_samples(await scrape(proxy), "ctxproxy_summarizer_failures_total")
    reasons = {labels["reason"]: value for labels, value in samples if value > 0}
    assert reasons == {"empty": 1.0}


@pytest.mark.parametrize("answer", [b"<html>upstream gateway page</html>", b'{"choices": [{"message": {"con'])
async def test_a_garbage_summariser_answer_is_reported_like_every_other_failure(
    upstream: FakeUpstream, serve_routes: Callable[[dict[str, Handler]], Awaitable[str]], start_proxy: StartProxy,
    caplog: pytest.LogCaptureFixture, answer: bytes
) -> None:
    """A summariser answer that is not JSON (a gateway's HTML page, a cut body) is a failure like any other:
    the request is still served, and the log line names the route and the summariser request."""
    async def garbage(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=answer, content_type="application/json")

    summariser = await serve_routes({"/v1/chat/completions": garbage})
    cfg = summarising_config(upstream.base_url)
    cfg["upstreams"]["summariser-gw"] = {"base_url": summariser}
    cfg["models"] = [m if m["name"] != SUMMARISER else {**m, "upstream": "summariser-gw"} for m in cfg["models"]]
    proxy = await start_proxy(cfg)
    caplog.set_level(logging.WARNING, logger="ctxproxy.summaries")
    status, headers, _ = await post(proxy, chat_body(conversation(40)))
    assert (status, headers["x-ctxproxy-summary"]) == (200, "failed")
    lines = [r.getMessage() for r in caplog.records if "summariser failed" in r.getMessage()]
    assert lines, caplog.text
    assert f"route '{SUMMARISER}'" in lines[0] and "summariser request" in lines[0], lines[0]


SMALL = "small-model"


def hanging_config(upstream: FakeUpstream, **extra: Any) -> dict[str, Any]:
    cfg = base_config(
        upstream.base_url,
        models=[{"name": SMALL, "context_window": 8000, "max_output_tokens": 1000},
                {"name": CHAT_MODEL, "context_window": 128000, "max_output_tokens": 16384}],
        summarizer_model=CHAT_MODEL,
        context_manager={"type": "summarising", "params": {"keep_turns": 4}},
        summarizer={"retry_backoff_seconds": 0, "timeout_seconds": 2, "max_summary_tokens": 300},
    )
    cfg.update(extra)
    return cfg


def tagged_conversation(turns: int, tag: str = "") -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a travel agent assistant."}]
    for i in range(turns - 1):
        messages += [
            {"role": "user", "content": f"{tag}Turn {i}: please check booking ZX{i}Q and its seat."},
            {"role": "assistant", "content": f"Booking ZX{i}Q: seat 14C, price 412.{i % 60:02d} USD. " * 12},
        ]
    messages.append({"role": "user", "content": f"Turn {turns - 1}: anything else?"})
    return messages


async def test_client_gone_while_the_summariser_runs(upstream: FakeUpstream, start_proxy: Any) -> None:
    """The summary is shielded (others may wait for it); it still ends at its deadline, leaving nothing."""
    proxy = await start_proxy(hanging_config(upstream, summarizer={"timeout_seconds": 1,
                                                                       "retry_backoff_seconds": 0}))
    before = await warm(proxy, upstream)
    upstream.summary_mode = "hang"
    async with aiohttp.ClientSession() as s:
        task = asyncio.ensure_future(send_chat(s, proxy.url, {"model": SMALL, "messages": tagged_conversation(30)}))
        assert await eventually(lambda: len(upstream.summaries) == 1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    started = time.monotonic()
    await settle(proxy, upstream, before, timeout=4)
    assert time.monotonic() - started < 10  # the summariser's deadline (1 s), not the upstream's hour


@pytest.mark.parametrize("timeout", [0.5, 1.0])
async def test_hanging_summariser_meets_its_deadline(upstream: FakeUpstream, start_proxy: Any,
                                                     timeout: float) -> None:
    """summarizer.timeout_seconds bounds the wait; then the failure path: served by the trimmer, 'failed'."""
    proxy = await start_proxy(hanging_config(upstream, summarizer={"timeout_seconds": timeout,
                                                                       "retry_backoff_seconds": 0}))
    async with aiohttp.ClientSession() as s:
        await send_chat(s, proxy.url)  # loads the tokenizer: the timing below is the summariser's alone
        upstream.summary_mode = "hang"
        started = time.monotonic()
        status, headers, raw = await send_chat(s, proxy.url, {"model": SMALL, "messages": tagged_conversation(40)})
        elapsed = time.monotonic() - started
    assert status == 200, raw[:300]
    assert headers["x-ctxproxy-summary"] == "failed"
    assert int(headers["x-ctxproxy-tokens-out"]) <= 8000 - 1000 - 800
    assert timeout <= elapsed < timeout + 5, elapsed  # at the deadline, not the upstream's hour
    assert len(upstream.chat) == 2  # the warm-up, then this request


async def test_hanging_summariser_concurrent_requests_share_one_deadline(upstream: FakeUpstream,
                                                                         start_proxy: Any) -> None:
    proxy = await start_proxy(hanging_config(upstream, summarizer={"timeout_seconds": 1,
                                                                       "retry_backoff_seconds": 0}))
    async with aiohttp.ClientSession() as s:
        await send_chat(s, proxy.url)  # loads the tokenizer: the timing below is the summariser's alone
        upstream.summary_mode = "hang"
        started = time.monotonic()
        results = await asyncio.gather(*(send_chat(s, proxy.url, {"model": SMALL, "messages": tagged_conversation(40)})
                                         for _ in range(10)))
        elapsed = time.monotonic() - started
    assert [r[0] for r in results] == [200] * 10
    assert {r[1]["x-ctxproxy-summary"] for r in results} == {"failed"}
    assert len(upstream.summaries) == 1  # single flight: one call, one deadline
    assert elapsed < 10  # one shared 1 s deadline, not ten in a row nor the upstream's hour


async def test_hanging_summariser_with_on_error_fail_is_502_at_the_deadline(upstream: FakeUpstream,
                                                                            start_proxy: Any) -> None:
    proxy = await start_proxy(hanging_config(upstream, on_summarizer_error="fail",
                                                 summarizer={"timeout_seconds": 0.5, "retry_backoff_seconds": 0}))
    async with aiohttp.ClientSession() as s:
        await send_chat(s, proxy.url)  # loads the tokenizer: the timing below is the summariser's alone
        upstream.summary_mode = "hang"
        started = time.monotonic()
        status, _, raw = await send_chat(s, proxy.url, {"model": SMALL, "messages": tagged_conversation(40)})
    assert time.monotonic() - started < 10  # at the deadline, not the upstream's hour
    assert status == 502
    assert openai_error(raw)["code"] == "summarizer_failed"
    assert len(upstream.chat) == 1  # the warm-up only: the refused request was never forwarded
