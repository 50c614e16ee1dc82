"""Issue 17: request ids sent upstream are UUIDs, and a summariser failure says why.

Against a server that validates ``X-Request-ID`` as a UUID (as several ASGI
request-id middlewares do) every summariser call failed, because ctxproxy sent
``X-Request-ID: ctxproxy-summarize``; and the log said only
``summariser failed (UpstreamStatus)``. Driven over HTTP through the proxy, with
the fake upstream in its UUID-enforcing mode (``require_uuid_request_id``).

Names the fix is expected to follow: the metric ``ctxproxy_summarizer_failures_total``
with a ``reason`` label.
"""

from __future__ import annotations

import logging
import re
import uuid
from typing import Any

import aiohttp
import pytest

from tests.conftest import RunningProxy, StartProxy
from tests.fake_upstream import FakeUpstream, is_uuid
from tests.outside import metric_samples, scrape, share_model_map
from tests.test_summarisation import config, conversation

MODEL = "small-model"  # 8k window: conversation(40) is summarised
SUMMARISER = "gpt-4o-mini"  # the summariser's model route (config(): summarizer_model)
UPSTREAM_KEY = "sk-upstream-secret"  # base_config's upstream key
PROMPT_TEXT = "please check booking"  # appears in every turn of conversation(); never in a log


@pytest.fixture(autouse=True)
def _shared_model_map(monkeypatch: pytest.MonkeyPatch) -> None:
    share_model_map(monkeypatch)  # speed only


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


# --------------------------------------------------------------------------- chat requests (pass today)


async def test_chat_request_id_sent_upstream_is_a_uuid(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """Issue 17 (passes today): a chat request without x-request-id is sent upstream with a generated UUID."""
    proxy = await start_proxy(config(upstream.base_url))
    status, headers = await chat(proxy, [{"role": "user", "content": "hi"}])
    assert status == 200
    sent = ids(upstream, "/v1/chat/completions")
    assert len(sent) == 1 and is_uuid(sent[0]), sent
    assert headers["x-request-id"] == sent[0]


async def test_clients_own_request_id_is_kept_upstream(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """Issue 17 (passes today): the client's own x-request-id is sent upstream and echoed back unchanged."""
    proxy = await start_proxy(config(upstream.base_url))
    mine = str(uuid.uuid4())
    status, headers = await chat(proxy, [{"role": "user", "content": "hi"}], request_id=mine)
    assert status == 200
    assert ids(upstream, "/v1/chat/completions") == [mine]
    assert headers["x-request-id"] == mine


# --------------------------------------------------------------------------- the summariser's calls


async def test_summariser_calls_carry_their_own_uuid_request_id(upstream: FakeUpstream, start_proxy: StartProxy
                                                                ) -> None:
    """Issue 17: each summariser call is sent with a UUID of its own, not the parent's id and not a fixed name."""
    proxy = await start_proxy(config(upstream.base_url))
    parent = str(uuid.uuid4())
    status, headers = await chat(proxy, conversation(40), request_id=parent)
    assert (status, headers["x-ctxproxy-summary"]) == (200, "waited")
    sent = ids(upstream, "summarize")
    assert sent and all(is_uuid(rid) for rid in sent), sent
    assert parent not in sent
    assert ids(upstream, "/v1/chat/completions") == [parent]  # the client's id is still kept on its own call


async def test_summaries_created_and_reused_against_an_upstream_enforcing_uuid_request_ids(
    upstream: FakeUpstream, start_proxy: StartProxy
) -> None:
    """Issue 17: with an upstream that validates X-Request-ID as a UUID, summaries are created, then reused."""
    upstream.require_uuid_request_id = True
    proxy = await start_proxy(config(upstream.base_url))
    status, headers = await chat(proxy, conversation(40))
    assert status == 200
    refused = [{k.lower(): v for k, v in r.headers.items()}.get("x-request-id") for r in upstream.rejected]
    assert refused == [], f"the upstream refused calls with X-Request-ID {refused}"
    assert headers["x-ctxproxy-summary"] == "waited"
    status, headers = await chat(proxy, conversation(40))
    assert (status, headers["x-ctxproxy-summary"]) == (200, "reused")


# --------------------------------------------------------------------------- failures say why


async def test_summariser_failure_log_line_says_status_message_route_and_request_id(
    upstream: FakeUpstream, start_proxy: StartProxy, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 17: one log line per summariser failure: upstream status, its message (key redacted), route, request id."""
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


async def test_summariser_failures_are_counted_by_reason(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """Issue 17: ctxproxy_summarizer_failures_total{reason=...} counts failures, a refusal apart from an empty answer."""
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
