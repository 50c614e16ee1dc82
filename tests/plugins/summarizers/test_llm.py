"""plugins.summarizers.llm: settings ids, the calls it makes, chunking under the summariser's window, caps."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from plugins.base import Completion, Services, SummaryUnavailable
from plugins.summarizers.llm import PROMPT, LLMParams, LLMSummarizer, _cap, _chunks, render_turn
from proxy.core.tokens import TokenCounter
from tests.conftest import Handler, StartProxy
from tests.fake_upstream import FakeUpstream
from tests.helpers import assistant, call, tool, user
from tests.outside import (
    chat_body,
    message_tokens,
    post,
)
from tests.store.test_summaries_http import config as summarising_config
from tests.store.test_summaries_http import conversation
from tests.wire.chat_helpers import items_of

COUNTER = TokenCounter("o200k_base")


class Engine:
    def __init__(self, answers: list[str] | None = None) -> None:
        self.answers = answers
        self.calls: list[dict[str, Any]] = []

    async def complete(self, model: str, messages: list[dict[str, Any]], *, max_tokens: int, timeout: float,
                       purpose: str, request_id: str = "") -> Completion:
        self.calls.append({"model": model, "messages": messages, "max_tokens": max_tokens, "timeout": timeout,
                           "purpose": purpose, "request_id": request_id})
        text = self.answers[len(self.calls) - 1] if self.answers is not None else f"summary {len(self.calls)}"
        return Completion(text, model, 100, 10, "gpt-4o-mini-2024-07-18")


def services(engine: Any = None, **extra: Any) -> Services:
    options: dict[str, Any] = {"engine": engine, "model": "gpt-4o", "counter": COUNTER, "request_id": "rid-7",
                               "summary_tokens": 200, "summarizer_timeout": 9.0}
    options.update(extra)
    return Services(**options)


def turns(n: int, words: int = 20) -> list[list[Any]]:
    out = []
    for i in range(n):
        out.append(items_of([user(f"turn {i}: " + "lorem " * words), call((f"c{i}", "lookup")), tool(f"c{i}", "ok"),
                             assistant(f"answer {i}")], COUNTER))
    return out


def summarizer(**params: Any) -> LLMSummarizer:
    return LLMSummarizer(LLMParams(**params))


@pytest.mark.parametrize(("params", "extra", "model"), [
    ({}, {}, "gpt-4o"),  # the turn's model
    ({}, {"summarizer_model": "gpt-4o-mini"}, "gpt-4o-mini"),  # the summariser slot
    ({"model": "cheap"}, {"summarizer_model": "gpt-4o-mini"}, "cheap"),  # params win
])
def test_settings_id_names_the_model_and_the_prompt(params: dict[str, Any], extra: dict[str, Any], model: str) -> None:
    sid = summarizer(**params).settings_id(services(**extra))
    assert sid.startswith(f"llm/v3/{model}/")
    assert summarizer(**params, instructions="Be terse.").settings_id(services(**extra)) != sid


def test_without_an_engine_it_drops() -> None:
    assert summarizer().bind(services(None)) is None


async def test_one_call_with_the_prompt_and_the_rendered_turns() -> None:
    engine = Engine()
    fn = summarizer().bind(services(engine, summarizer_model="gpt-4o-mini"))
    assert fn is not None
    out = await fn(None, turns(2))
    assert out.text == "summary 1"
    assert (out.model, out.prompt_tokens, out.completion_tokens) == ("gpt-4o-mini", 100, 10)
    (c,) = engine.calls
    assert (c["model"], c["max_tokens"], c["timeout"], c["purpose"], c["request_id"]) == (
        "gpt-4o-mini", 200, 9.0, "summarize", "rid-7")
    system, body = c["messages"]
    assert system == {"role": "system", "content": PROMPT}
    assert body["content"].startswith("New turns:\nUSER: turn 0:")
    assert "TOOL CALL c1 lookup" in body["content"] and "TOOL RESULT c1: ok" in body["content"]


async def test_custom_instructions_replace_the_prompt_and_a_previous_summary_is_folded_in() -> None:
    engine = Engine()
    fn = summarizer(instructions="Summarise in French.").bind(services(engine))
    assert fn is not None
    await fn("- earlier: user Ada", turns(1))
    system, body = engine.calls[0]["messages"]
    assert system["content"] == "Summarise in French."
    assert body["content"].startswith("Previous summary:\n- earlier: user Ada\n\nNew turns:\n")


async def test_turns_larger_than_the_summarisers_window_are_folded_in_chunks() -> None:
    engine = Engine()
    fn = summarizer().bind(services(engine, summarizer_window=1500, summary_tokens=64))
    assert fn is not None
    out = await fn(None, turns(12, words=60))
    assert len(engine.calls) > 1
    assert out.text == f"summary {len(engine.calls)}"
    assert out.prompt_tokens == 100 * len(engine.calls)
    for i, c in enumerate(engine.calls[1:], start=1):
        assert c["messages"][1]["content"].startswith(f"Previous summary:\nsummary {i}\n\n")


async def test_the_work_per_summary_is_bounded_and_says_what_was_dropped() -> None:
    engine = Engine()
    fn = summarizer().bind(services(engine, summarizer_window=1500, summary_tokens=64, summarizer_max_calls=1))
    assert fn is not None
    await fn(None, turns(12, words=60))
    assert len(engine.calls) == 1
    assert "[Older turns were dropped without being summarised.]" in engine.calls[0]["messages"][1]["content"]
    assert "turn 0:" not in engine.calls[0]["messages"][1]["content"]


@pytest.mark.parametrize("answer", ["", "   \n\t"])
async def test_an_empty_answer_is_a_failure(answer: str) -> None:
    fn = summarizer().bind(services(Engine([answer])))
    assert fn is not None
    with pytest.raises(SummaryUnavailable):
        await fn(None, turns(1))


async def test_an_oversized_answer_is_cut_to_the_summary_budget() -> None:
    fn = summarizer().bind(services(Engine(["word " * 2000]), summary_tokens=100))
    assert fn is not None
    out = await fn(None, turns(1))
    assert COUNTER.text(out.text) <= 110
    assert out.text.endswith(" […]")


def test_cap() -> None:
    count = COUNTER.text
    assert _cap("short text", 100, count) == "short text"
    cut = _cap("alpha beta " * 500, 50, count)
    assert cut.endswith(" […]") and count(cut) <= 60


def test_chunks_group_turns_by_size_and_cut_an_enormous_one() -> None:
    def count(text: str) -> int:
        return len(text)

    assert _chunks(["a", "b", "c"], [40, 40, 40], 100, count) == [["a", "b"], ["c"]]
    assert _chunks(["a"], [10], 100, count) == [["a"]]
    huge = "x" * 1000
    (chunk,) = _chunks([huge], [1000], 100, count)
    assert chunk == ["x" * 300]
    assert _chunks([], [], 100, count) == [[]]


def test_render_turn_skips_items_without_text() -> None:
    items = items_of([user("hello"), assistant(None), assistant("hi")])
    assert render_turn(items) == "USER: hello\nASSISTANT: hi"


async def test_a_long_output_keeps_for_the_summariser_the_values_later_turns_used() -> None:
    """A search returns 300 flights; the assistant later books the 140th. The summariser is shown both ends of
    the output and the line with the booked flight, which a plain middle cut would have removed."""
    flights = "\n".join(f"flight HAT{i:03d} JFK-SEA {8 + i % 12:02d}:00 ${100 + i}" for i in range(300))
    conversation = [items_of([user("find me a flight to SEA"), call(("s1", "search", '{"to": "SEA"}')),
                              tool("s1", flights), assistant("Several flights are available.")], COUNTER),
                    items_of([user("book the one at 4pm for $240"),
                              call(("b1", "book", '{"flight": "HAT140"}')), tool("b1", "booked")], COUNTER)]
    engine = Engine()
    fn = summarizer().bind(services(engine))
    assert fn is not None
    await fn(None, conversation)
    body = engine.calls[0]["messages"][1]["content"]
    assert "] flight HAT140 JFK-SEA 16:00 $240 [" in body  # the line, between two gap marks
    assert "flight HAT000" in body and "flight HAT299" in body  # both ends, as before
    assert "HAT150" not in body  # the rest of the middle is still cut


@pytest.mark.usefixtures("shared_model_map")
async def test_summariser_chunks_fit_the_summariser_models_window(upstream: FakeUpstream, start_proxy: StartProxy
                                                                  ) -> None:
    """With params.model: small (8k) summarising for a 60k request model, every call fits 8k."""
    cfg = summarising_config(
        upstream.base_url,
        models=[{"name": "big", "context_window": 60000, "max_output_tokens": 4096},
                {"name": "small", "context_window": 8000, "max_output_tokens": 1000}],
        context_manager={"type": "summarising", "params": {  # the summariser's input is the subject: no masking
            "keep_turns": 4, "mask_observations": False, "summarizer": {"type": "llm", "params": {"model": "small"}}}},
    )
    cfg.pop("summarizer_model")
    proxy = await start_proxy(cfg)
    status, headers, _ = await post(proxy, chat_body(conversation(200), "big"))
    assert (status, headers["x-ctxproxy-summary"]) == (200, "waited")
    assert {c.body["model"] for c in upstream.summaries} == {"small"}
    sizes = [message_tokens(c.body["messages"]) for c in upstream.summaries]
    answer = 300  # config(): summarizer.max_summary_tokens
    assert all(size + answer <= 8000 for size in sizes), sizes


MODEL = "gpt-4o-mini"


SMALL = "small-model"  # tests.store.test_summaries_http: 8k window, keep_turns 4, summariser gpt-4o-mini


TENANT_KEY = "sk-tenant-acme-7f3a"


def chat(messages: list[Any], model: str = MODEL, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": messages, **extra}


async def test_an_echoed_upstream_key_never_reaches_a_tenant_through_a_summary(
    upstream: FakeUpstream, serve_routes: Callable[[dict[str, Handler]], Awaitable[str]], start_proxy: StartProxy
) -> None:
    """A summariser gateway that echoes its own key into the summary text: that key is never forwarded to
    the chat provider, nor shown to the tenant by explain."""
    secret = "sk-summariser-gw-9d8c7b6a"

    async def echo(request: web.Request) -> web.Response:
        body = await request.json()
        text = f"- debug: called with {request.headers.get('Authorization')}; user asked about booking ZX0Q"
        return web.json_response({"id": "chatcmpl-s", "object": "chat.completion", "model": body["model"],
                                  "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                               "finish_reason": "stop"}],
                                  "usage": {"prompt_tokens": 900, "completion_tokens": 40}})

    gateway = await serve_routes({"/v1/chat/completions": echo})
    cfg = summarising_config(upstream.base_url, tenants=[{"name": "acme", "keys": [TENANT_KEY]}])
    cfg["upstreams"]["summariser-gw"] = {"base_url": gateway, "api_key": secret}
    cfg["models"] = [m if m["name"] != MODEL else {**m, "upstream": "summariser-gw"} for m in cfg["models"]]
    proxy = await start_proxy(cfg)
    messages = conversation(40)
    status, headers, _ = await post(proxy, chat(messages, model=SMALL), key=TENANT_KEY)
    assert (status, headers["x-ctxproxy-summary"]) == (200, "waited")
    assert secret not in json.dumps(upstream.chat[-1].body), "the summariser's key was forwarded to another provider"
    status, _, explained = await post(proxy, chat(messages, model=SMALL), path="/v1/ctxproxy/explain", key=TENANT_KEY)
    assert status == 200
    assert explained["report"]["summary"] == "reused"
    assert secret not in json.dumps(explained), "explain showed the tenant the operator's summariser key"
