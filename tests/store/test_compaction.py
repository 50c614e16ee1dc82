"""proxy.store.compaction: one compaction service for the summarising manager, /responses/compact and the Messages
compaction edit, with one placeholder, one rule for a ``drop`` policy and one cache.

The three were written three times with different rules: under a ``drop`` policy ``/responses/compact``
billed the default LLM while the Messages compaction declined, and a dry run forwarded one of two
placeholder texts depending on who asked.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from plugins.base import Services
from plugins.summarizers.drop import DropParams, DropSummarizer
from plugins.summarizers.llm import LLMParams, LLMSummarizer
from proxy.core.tokens import TokenCounter
from proxy.store.compaction import DROPS_OLDER_TURNS, NO_SUMMARISER, WOULD_CREATE, Compaction, summarizer_for
from proxy.store.memory import MemoryCache
from proxy.store.summaries import SummaryService
from tests.conftest import base_config
from tests.fake_upstream import FakeUpstream
from tests.helpers import FakeEngine
from tests.wire.chat_helpers import items_of

COUNTER = TokenCounter("o200k_base")


def turns(n: int) -> list[list[Any]]:
    out = []
    for i in range(n):
        out.append(items_of([{"role": "user", "content": f"question {i}"},
                             {"role": "assistant", "content": f"answer {i}"}], COUNTER))
    return out


def service() -> tuple[Compaction, FakeEngine]:
    store = SummaryService(MemoryCache(), ttl=None, lock_wait=5, backoff_first=0, backoff_max=0)
    return Compaction(store), FakeEngine("the summary")


async def test_made_once_then_reused_and_never_made_in_a_dry_run() -> None:
    compaction, engine = service()
    llm = LLMSummarizer(LLMParams())
    history = turns(4)
    chain = [str(i) for i in range(4)]
    dry = await compaction.compact(llm, Services(engine=engine, dry_run=True, counter=COUNTER), history, chain)
    assert (dry.status, dry.text, dry.summary) == ("would_create", WOULD_CREATE, None) and engine.calls == []
    made = await compaction.compact(llm, Services(engine=engine, counter=COUNTER), history, chain)
    assert made.status == "created" and made.summary is not None and len(engine.calls) == 1
    again = await compaction.compact(llm, Services(engine=engine, dry_run=True, counter=COUNTER), history, chain)
    assert (again.status, again.text) == ("reused", made.text) and len(engine.calls) == 1


async def test_a_drop_policy_compacts_nothing_and_bills_nobody() -> None:
    compaction, engine = service()
    drop = DropSummarizer(DropParams())
    out = await compaction.compact(drop, Services(engine=engine, counter=COUNTER), turns(3), ["a", "b", "c"])
    assert (out.status, out.text, out.reason) == ("unavailable", DROPS_OLDER_TURNS, "drop") and engine.calls == []
    assert summarizer_for(drop) is drop  # whoever asks: the policy's own drop, never a stand-in LLM
    out = await compaction.compact(LLMSummarizer(LLMParams()), Services(engine=None), turns(3), ["a", "b", "c"])
    assert (out.status, out.text) == ("unavailable", NO_SUMMARISER)


def drop_config(upstream: FakeUpstream, **upstream_extra: Any) -> dict[str, Any]:
    return base_config(upstream.base_url, upstreams={"fake": {
        "base_url": upstream.base_url, "api_key": "sk-upstream-secret", **upstream_extra}},
        context_manager={"type": "summarising", "params": {"summarizer": "drop"}})


async def test_responses_compact_under_a_drop_policy_is_refused_not_billed(
        upstream: FakeUpstream, start_proxy: Any) -> None:
    proxy = await start_proxy(drop_config(upstream, responses_compact="emulate"))
    body = {"model": "gpt-4o-mini", "input": [
        {"role": "user", "content": "first"}, {"role": "assistant", "content": "one"},
        {"role": "user", "content": "second"}]}
    async with aiohttp.ClientSession() as s, s.post(proxy.base_url + "/responses/compact", json=body) as r:
        assert r.status == 400
        error = await r.json()
    assert error["error"]["code"] == "compaction_unavailable"
    assert error["error"]["message"].startswith(DROPS_OLDER_TURNS)
    assert upstream.summaries == []  # no summariser was called (and billed) for it


def long_messages(words: int = 1500) -> list[dict[str, Any]]:
    """A Messages conversation past the compaction trigger's minimum (50,000 input tokens)."""
    messages: list[dict[str, Any]] = []
    for i in range(40):
        messages += [{"role": "user", "content": f"question {i} " + "word " * words},
                     {"role": "assistant", "content": f"answer {i}"}]
    return [*messages, {"role": "user", "content": "now?"}]


COMPACT = {"edits": [{"type": "compact_20260112", "trigger": {"type": "input_tokens", "value": 50_000}}]}


async def test_messages_compaction_under_a_drop_policy_says_why_it_was_not_applied(
        upstream: FakeUpstream, start_proxy: Any) -> None:
    config = drop_config(upstream, context_management="emulate")
    proxy = await start_proxy(config)
    body = {"model": "gpt-4o-mini", "max_tokens": 64, "messages": long_messages(), "context_management": COMPACT}
    url = proxy.url + "/v1/ctxproxy/explain/messages?summarize=true"  # it would make one, were it allowed
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        assert r.status == 200
        report = (await r.json())["report"]
    assert report["context_management"]["compaction"] is None
    assert any(DROPS_OLDER_TURNS in w for w in report["warnings"])
    assert upstream.summaries == []


@pytest.mark.parametrize("path", ["/v1/ctxproxy/explain/chat", "/v1/ctxproxy/explain/messages"])
async def test_a_dry_run_forwards_one_placeholder_whoever_compacts(
        upstream: FakeUpstream, start_proxy: Any, path: str) -> None:
    config = base_config(upstream.base_url, upstreams={"fake": {
        "base_url": upstream.base_url, "api_key": "sk-upstream-secret", "context_management": "emulate"}},
        models=[{"name": "gpt-4o-mini", "context_window": 60_000, "max_output_tokens": 1024}],
        context_manager={"type": "summarising", "params": {"keep_turns": 1}})
    proxy = await start_proxy(config)
    body: dict[str, Any] = {"model": "gpt-4o-mini", "max_tokens": 64, "messages": long_messages()}
    if path.endswith("messages"):
        body["context_management"] = COMPACT
    async with aiohttp.ClientSession() as s, s.post(proxy.url + path, json=body) as r:
        assert r.status == 200
        out = await r.json()
    assert WOULD_CREATE in str(out["messages"]) and upstream.summaries == []
