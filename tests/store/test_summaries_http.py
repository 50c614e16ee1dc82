"""Summarisation through the proxy: reuse, hysteresis, single flight, tenants, failure, persistence."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.conftest import StartProxy, base_config
from tests.fake_upstream import FakeUpstream
from tests.outside import Message, chat_body, metric_total, scrape
from tests.outside import post as send
from tests.redis_server import RedisServer

MODEL = "small-model"
WINDOW = 8000


def config(upstream_url: str, **extra: Any) -> dict[str, Any]:
    cfg = base_config(
        upstream_url,
        models=[{"name": MODEL, "context_window": WINDOW, "max_output_tokens": 1000},
                {"name": "gpt-4o-mini", "context_window": 128000, "max_output_tokens": 16384}],
        summarizer_model="gpt-4o-mini",
        context_manager={"type": "summarising", "params": {"keep_turns": 4}},
        summarizer={"retry_backoff_seconds": 0, "timeout_seconds": 2, "max_summary_tokens": 300},
    )
    cfg.update(extra)
    return cfg


TOOL_TEXT = (
    "Flight UA{n} from SFO to JFK departs 08:{m:02d}, seat 14C, booking ref ZX{n}Q, fare class Y, "
    "price 412.{m:02d} USD; baggage allowance one checked bag 23 kg; status confirmed. "
)


def turn(i: int) -> list[dict[str, Any]]:
    call_id = f"call_{i}"
    return [
        {"role": "user", "content": f"Turn {i}: please check booking ZX{i}Q and tell me the seat and the price."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "get_booking",
                                                             "arguments": f'{{"ref": "ZX{i}Q"}}'}}]},
        {"role": "tool", "tool_call_id": call_id, "content": TOOL_TEXT.format(n=i, m=i % 60) * 4},
        {"role": "assistant", "content": f"Booking ZX{i}Q: seat 14C, price 412.{i % 60:02d} USD."},
    ]


def conversation(turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a travel agent assistant."}]
    for i in range(turns - 1):
        messages += turn(i)
    messages.append({"role": "user", "content": f"Turn {turns - 1}: anything else I should know?"})
    return messages


async def post(session: aiohttp.ClientSession, url: str, messages: list[dict[str, Any]],
               key: str = "sk-client") -> tuple[int, dict[str, str], Any]:
    async with session.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": messages},
                            headers={"Authorization": f"Bearer {key}"}) as r:
        return r.status, dict(r.headers), await r.json()


async def test_growing_conversation_summaries_grow_with_conversation_not_requests(upstream, start_proxy):
    proxy = await start_proxy(config(upstream.base_url))
    statuses = []
    async with aiohttp.ClientSession() as s:
        for n in range(1, 61):
            status, headers, _ = await post(s, proxy.url, conversation(n))
            assert status == 200
            statuses.append(headers["x-ctxproxy-summary"])
    report = proxy.state.runtime.config  # noqa: F841 - keeps the proxy referenced
    budget = int(headers["x-ctxproxy-tokens-out"])
    calls = len(upstream.summaries)
    hard = WINDOW - 1000 - math.ceil(0.1 * WINDOW)
    # growth: tokens of the conversation from the first summary to the end
    from proxy.core.tokens import TokenCounter
    from tests.wire.chat_helpers import counts as chat_counts

    counter = TokenCounter("o200k_base")
    first = next(i for i, s in enumerate(statuses) if s != "none")  # the first summary asked for
    size = lambda n: sum(chat_counts(counter, conversation(n)))  # noqa: E731
    growth = size(60) - size(first + 1)
    bound = math.ceil(growth / (0.1 * hard)) + 1
    print(f"\n60-turn run: {len(statuses)} requests, {calls} summariser calls (bound {bound}), "
          f"statuses {dict((k, statuses.count(k)) for k in set(statuses))}")
    assert 1 <= calls <= bound
    assert budget <= hard
    for rec in upstream.chat:
        from tests.wire.chat_helpers import check_messages as check

        check(rec.body["messages"])


async def test_concurrent_identical_requests_make_one_summary(upstream, start_proxy):
    proxy = await start_proxy(config(upstream.base_url))
    async with aiohttp.ClientSession() as s:
        results = await asyncio.gather(*(post(s, proxy.url, conversation(40)) for _ in range(20)))
    assert [r[0] for r in results] == [200] * 20
    assert len(upstream.summaries) == 1
    # nothing fits under B without the summary: every request waited for the one summariser call
    assert [r[1]["x-ctxproxy-summary"] for r in results] == ["waited"] * 20
    text = await scrape(proxy)
    assert metric_total(text, "ctxproxy_summaries_total", result="created") == 1
    assert metric_total(text, "ctxproxy_summaries_total", result="reused") == 19


async def test_two_tenants_never_share_a_summary(upstream, start_proxy):
    tenants = [{"name": "a", "keys": ["key-a"]}, {"name": "b", "keys": ["key-b"]}]
    proxy = await start_proxy(config(upstream.base_url, tenants=tenants))
    async with aiohttp.ClientSession() as s:
        for key in ("key-a", "key-b", "key-a", "key-b"):
            status, _, _ = await post(s, proxy.url, conversation(40), key)
            assert status == 200
    assert len(upstream.summaries) == 2


async def test_restart_on_the_same_cache_directory_reuses_the_summary(upstream, start_proxy, tmp_path):
    cfg = config(upstream.base_url, cache={"backend": "disk", "path": str(tmp_path / "cache")})
    first = await start_proxy(cfg)
    async with aiohttp.ClientSession() as s:
        status, headers, _ = await post(s, first.url, conversation(40))
        assert (status, headers["x-ctxproxy-summary"]) == (200, "waited")
        await first.runner.cleanup()
        second = await start_proxy(cfg)
        status, headers, _ = await post(s, second.url, conversation(40))
    assert (status, headers["x-ctxproxy-summary"]) == (200, "reused")
    assert len(upstream.summaries) == 1


@pytest.mark.parametrize("mode", ["status", "hang", "empty"])
async def test_failing_summariser_still_serves_within_budget(upstream, start_proxy, mode):
    proxy = await start_proxy(config(upstream.base_url))
    upstream.summary_mode = mode
    hard = WINDOW - 1000 - math.ceil(0.1 * WINDOW)
    async with aiohttp.ClientSession() as s:
        status, headers, _ = await post(s, proxy.url, conversation(40))
        assert status == 200
        assert headers["x-ctxproxy-summary"] == "failed"
        assert int(headers["x-ctxproxy-tokens-out"]) <= hard
        forwarded = upstream.chat[-1].body["messages"]
        # the trimmer alone fitted it: it dropped only what the budget required
        assert len(forwarded) > 4 * 4
        # the summariser is back, but this conversation's last summary failed: the next request does not
        # wait for it again; the summary is retried in the background and the request after uses it
        upstream.summary_mode = "ok"
        status, headers, _ = await post(s, proxy.url, conversation(40))
        assert (status, headers["x-ctxproxy-summary"]) == (200, "failed")
        await proxy.state.shared.background.idle()
        status, headers, _ = await post(s, proxy.url, conversation(40))
        assert (status, headers["x-ctxproxy-summary"]) == (200, "reused")


async def test_on_summarizer_error_fail_answers_502(upstream, start_proxy):
    proxy = await start_proxy(config(upstream.base_url, on_summarizer_error="fail"))
    upstream.summary_mode = "status"
    async with aiohttp.ClientSession() as s:
        status, _, body = await post(s, proxy.url, conversation(40))
    assert status == 502
    assert body["error"]["code"] == "summarizer_failed"
    assert upstream.chat == []


async def test_summary_message_and_summariser_call(upstream, start_proxy):
    proxy = await start_proxy(config(upstream.base_url))
    async with aiohttp.ClientSession() as s:
        status, _, _ = await post(s, proxy.url, conversation(40))
    assert status == 200
    call = upstream.summaries[0]
    assert call.headers["x-ctxproxy-purpose"] == "summarize"
    assert call.headers["Authorization"] == "Bearer sk-upstream-secret"
    assert call.body["model"] == "gpt-4o-mini"
    prompt = call.body["messages"][0]["content"]
    assert "ids" in prompt and "paths" in prompt
    forwarded = upstream.chat[-1].body["messages"]
    assert forwarded[0]["role"] == "system" and forwarded[0]["content"] == "You are a travel agent assistant."
    assert forwarded[1]["role"] == "system"
    assert forwarded[1]["content"].startswith("[Conversation summary — ")
    assert upstream.summary_text in forwarded[1]["content"]


async def test_aged_part_larger_than_the_summarisers_window_is_folded_in_chunks(upstream, start_proxy):
    proxy = await start_proxy(config(upstream.base_url, summarizer_model=MODEL))  # an 8k summariser window
    async with aiohttp.ClientSession() as s:
        status, headers, _ = await post(s, proxy.url, conversation(40))
    assert (status, headers["x-ctxproxy-summary"]) == (200, "waited")
    assert len(upstream.summaries) >= 2
    first, *rest = [c.body["messages"][1]["content"] for c in upstream.summaries]
    assert not first.startswith("Previous summary")
    assert all(r.startswith("Previous summary:\n" + upstream.summary_text) for r in rest)
    # every chunk fits the summariser's own window
    from proxy.core.tokens import TokenCounter
    from tests.wire.chat_helpers import counts as chat_counts

    counter = TokenCounter("o200k_base")
    assert all(sum(chat_counts(counter, c.body["messages"])) + 300 <= WINDOW for c in upstream.summaries)


async def test_incremental_summary_uses_the_previous_one(upstream, start_proxy):
    proxy = await start_proxy(config(upstream.base_url))
    async with aiohttp.ClientSession() as s:
        for n in range(20, 61):
            status, _, _ = await post(s, proxy.url, conversation(n))
            assert status == 200
    assert len(upstream.summaries) >= 2
    later = upstream.summaries[-1].body["messages"][1]["content"]
    assert later.startswith("Previous summary:\n" + upstream.summary_text)
    # the newly aged turns only, not the whole history again
    assert "Turn 0:" not in later


async def test_summariser_work_per_request_is_bounded_and_oversized_summaries_are_cut(upstream, start_proxy):
    cfg = config(upstream.base_url, summarizer_model=MODEL)  # 8k summariser window: many chunks
    cfg["summarizer"]["max_calls_per_summary"] = 2
    proxy = await start_proxy(cfg)
    upstream.summary_text = "word " * 3000  # ignores max_tokens (300)
    async with aiohttp.ClientSession() as s:
        status, headers, _ = await post(s, proxy.url, conversation(60))
    assert (status, headers["x-ctxproxy-summary"]) == (200, "waited")
    assert len(upstream.summaries) == 2
    summary = upstream.chat[-1].body["messages"][1]["content"]
    from proxy.core.tokens import TokenCounter

    # the summariser's text is cut to max_summary_tokens; the values section after it has its own cap
    text, _, values = summary.partition("\n\nValues these turns acted on")
    counter = TokenCounter("o200k_base")
    assert counter.text(text) <= 300 + 40 and 0 < counter.text(values) <= 1024


def fleet_conversation(agent: int, turns: int) -> list[Message]:
    """An agent of a fleet: the same system prompt and first turn as every other agent, then its own turns."""
    messages: list[Message] = [{"role": "system", "content": "You are a travel agent assistant."}]
    messages += turn(0)
    for i in range(1, turns - 1):
        for m in turn(i):
            m = dict(m)
            if m["role"] == "user":
                m["content"] = f"[agent {agent}] " + m["content"]
            messages.append(m)
    messages.append({"role": "user", "content": f"[agent {agent}] Turn {turns - 1}: anything else?"})
    return messages


@pytest.mark.usefixtures("shared_model_map")
async def test_a_fleet_sharing_the_first_turn_keeps_every_summary(upstream: FakeUpstream, start_proxy: StartProxy
                                                                  ) -> None:
    """Ten agents sharing system prompt and first turn: agent 0's summary is still reused afterwards."""
    proxy = await start_proxy(config(upstream.base_url))
    for agent in range(10):
        status, headers, _ = await send(proxy, chat_body(fleet_conversation(agent, 40)))
        assert (status, headers["x-ctxproxy-summary"]) == (200, "waited"), agent
    calls = len(upstream.summaries)
    status, headers, _ = await send(proxy, chat_body(fleet_conversation(0, 41)))  # agent 0's next request
    assert status == 200
    assert headers["x-ctxproxy-summary"] == "reused"
    assert len(upstream.summaries) == calls


@pytest.mark.usefixtures("shared_model_map")
async def test_a_single_growing_conversation_reuses_its_summary(upstream: FakeUpstream, start_proxy: StartProxy
                                                                ) -> None:
    """The same growth step reuses the summary when no other agent interferes."""
    proxy = await start_proxy(config(upstream.base_url))
    status, headers, _ = await send(proxy, chat_body(fleet_conversation(0, 40)))
    assert (status, headers["x-ctxproxy-summary"]) == (200, "waited")
    status, headers, _ = await send(proxy, chat_body(fleet_conversation(0, 41)))
    assert (status, headers["x-ctxproxy-summary"]) == (200, "reused")
    assert len(upstream.summaries) == 1


@pytest.mark.usefixtures("shared_model_map")
@pytest.mark.parametrize("backend", ["disk", "redis"])  # (the memory cache's yields are too short to show it)
async def test_concurrent_summaries_with_the_same_first_turn_both_stay_indexed(
    upstream: FakeUpstream, start_proxy: StartProxy, tmp_path: Path, backend: str
) -> None:
    """Two conversations sharing the first turn, summarised at the same moment: both are reused later."""
    with contextlib.ExitStack() as stack:
        cache: dict[str, Any] = {"backend": backend}
        if backend == "disk":
            cache["path"] = str(tmp_path / "cache")
        if backend == "redis":
            cache["url"] = stack.enter_context(RedisServer.started()).url
        proxy = await start_proxy(config(upstream.base_url, cache=cache))
        upstream.summary_barrier = 2  # both summariser calls are answered together
        results = await asyncio.gather(*(send(proxy, chat_body(fleet_conversation(a, 40))) for a in (1, 2)))
        assert [(s, h["x-ctxproxy-summary"]) for s, h, _ in results] == [(200, "waited")] * 2
        upstream.summary_barrier = 0
        calls = len(upstream.summaries)
        statuses = []
        for agent in (1, 2):
            status, headers, _ = await send(proxy, chat_body(fleet_conversation(agent, 41)))
            statuses.append((status, headers["x-ctxproxy-summary"]))
    assert statuses == [(200, "reused")] * 2
    assert len(upstream.summaries) == calls


@pytest.mark.usefixtures("shared_model_map")
async def test_summary_counted_created_when_the_leaders_client_disconnects(
    upstream: FakeUpstream, start_proxy: StartProxy
) -> None:
    """The leader's client leaves mid-summary; the one summary made is still counted as created."""
    proxy = await start_proxy(config(upstream.base_url))
    upstream.summary_delay = 1.0
    leader = asyncio.ensure_future(send(proxy, chat_body(conversation(40))))
    while not upstream.summaries:
        await asyncio.sleep(0.01)
    waiters = [asyncio.ensure_future(send(proxy, chat_body(conversation(40)))) for _ in range(2)]
    await asyncio.sleep(0.3)  # the waiters joined the flight
    leader.cancel()  # the leader's client disconnects
    with contextlib.suppress(asyncio.CancelledError):
        await leader
    results = await asyncio.gather(*waiters)
    assert [s for s, _, _ in results] == [200, 200]
    assert len(upstream.summaries) == 1
    text = await scrape(proxy)
    assert metric_total(text, "ctxproxy_summaries_total", result="created") == 1, \
        [h["x-ctxproxy-summary"] for _, h, _ in results]


def spoken(transcript: str, audio_id: str) -> Message:
    return {"role": "assistant", "content": None, "audio": {"id": audio_id, "transcript": transcript}}


async def test_conversations_differing_only_in_a_spoken_answer_do_not_share_a_summary(
    upstream: FakeUpstream, start_proxy: StartProxy
) -> None:
    """Two conversations that differ only in an assistant's audio transcript have different summaries: the
    summary key covers what was said, so one conversation is never served the other's summary."""
    proxy = await start_proxy(config(upstream.base_url))

    def with_spoken(transcript: str, audio_id: str) -> list[Message]:
        messages = conversation(40)
        messages[4] = spoken(transcript, audio_id)  # turn 0's answer, long summarised by turn 39
        return messages

    a = with_spoken("Your flight UA0 to JFK is cancelled; rebook before Friday.", "audio_a1")
    b = with_spoken("Your flight UA0 to JFK is confirmed; seat 14C, boarding 07:40.", "audio_b2")
    status, headers, _ = await send(proxy, chat_body(a))
    assert (status, headers["x-ctxproxy-summary"]) == (200, "waited")
    assert "is cancelled" in json.dumps(upstream.summaries[-1].body)
    status, headers, _ = await send(proxy, chat_body(b))
    assert status == 200
    assert headers["x-ctxproxy-summary"] == "waited", "B was served A's summary (its flight is 'cancelled')"
    assert "is confirmed" in json.dumps(upstream.summaries[-1].body)


@pytest.mark.parametrize("next_turns", [58, 60])
async def test_a_replica_reuses_the_longer_summary_another_made_a_moment_ago(
    upstream: FakeUpstream, start_proxy: StartProxy, tmp_path: Path, next_turns: int
) -> None:
    """Replica A holds an older summary and has just found no longer one in the shared cache; replica B then makes
    the longer one. A's next request that needs a newer summary reuses B's instead of paying for another (its
    lookup took the longer prefixes as missing for a second: it asks again before it makes one)."""
    cfg = config(upstream.base_url, cache={"backend": "disk", "path": str(tmp_path / "cache")})
    cfg["context_manager"]["params"]["summary_prefetch_ratio"] = 0.0  # made on the request path, not ahead
    a, b = await start_proxy(cfg), await start_proxy(cfg)
    _, headers, _ = await send(a, chat_body(conversation(29)))
    assert headers["x-ctxproxy-summary"] == "waited" and len(upstream.summaries) == 1
    for _ in range(2):
        _, headers, _ = await send(a, chat_body(conversation(57)))  # A reuses its own; nothing longer is cached
        assert headers["x-ctxproxy-summary"] == "reused"
    _, headers, _ = await send(b, chat_body(conversation(58)))  # B makes the longer one
    assert headers["x-ctxproxy-summary"] == "waited" and len(upstream.summaries) == 2
    _, headers, _ = await send(a, chat_body(conversation(next_turns)))
    assert headers["x-ctxproxy-summary"] == "reused"
    assert len(upstream.summaries) == 2


async def test_a_replica_schedules_nothing_past_the_longer_summary_another_made_a_moment_ago(
    upstream: FakeUpstream, start_proxy: StartProxy, tmp_path: Path
) -> None:
    """In the background (the default): A's own summary still fits, and it decides whether to make the next one
    ahead; it decides from B's longer summary, made a moment ago, not from its own (which would make one a turn past
    B's, a summariser call a lookup of every prefix would not have made)."""
    cfg = config(upstream.base_url, cache={"backend": "disk", "path": str(tmp_path / "cache")})
    a, b = await start_proxy(cfg), await start_proxy(cfg)
    await send(a, chat_body(conversation(20)))
    await a.state.shared.background.idle()  # A makes its summary in the background
    await send(a, chat_body(conversation(36)))  # A uses its own; the longer prefixes are missing
    await send(b, chat_body(conversation(38)))
    await b.state.shared.background.idle()  # B makes the longer one
    assert len(upstream.summaries) == 2
    await send(a, chat_body(conversation(39)))
    await a.state.shared.background.idle()
    assert len(upstream.summaries) == 2


async def test_a_summary_that_does_not_fit_is_read_once_when_nothing_was_taken_as_missing(
    upstream: FakeUpstream, start_proxy: StartProxy, tmp_path: Path
) -> None:
    """The recheck before making a summary reads again only what a mark left unasked: a replica without its own
    copy of the summary reads the shared cache once, as before the marks."""
    cfg = config(upstream.base_url, cache={"backend": "disk", "path": str(tmp_path / "cache")})
    cfg["context_manager"]["params"]["summary_prefetch_ratio"] = 0.0
    a, b = await start_proxy(cfg), await start_proxy(cfg)
    _, headers, _ = await send(a, chat_body(conversation(29)))
    assert headers["x-ctxproxy-summary"] == "waited"
    reads: list[int] = []
    store = b.state.shared.summaries
    shared = store.cache.get_many

    async def counted(keys: list[str], first_hit: bool = False) -> list[Any]:
        reads.append(len(keys))
        return await shared(keys, first_hit)

    store.cache.get_many = counted  # type: ignore[method-assign]
    _, headers, _ = await send(b, chat_body(conversation(58)))
    assert headers["x-ctxproxy-summary"] == "waited" and len(upstream.summaries) == 2
    assert len(reads) == 1  # the lookup's; none again before making (it had nothing of its own to narrow with)
