"""The contract every registered wire fulfils, checked for each one, and for a toy wire the tests define alone.

A wire is one translator (``proxy.wire.protocol.Wire``): what the server, the metrics, the CLI and
explain need of it comes from it and the registry, so a new wire is its module and one registry line.
The toy (``tests/wire/toy_wire.py``: the model in its URL path, its key in a header of its own, its
output cap nested) proves it: registered into the registry the app is built with, it is served,
managed, capped and explained over HTTP with no edit to the proxy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.core.errors import BadRequest
from proxy.core.items import SYSTEM, USER
from proxy.core.modelinfo import ModelMap
from proxy.core.tokens import TokenCounter
from proxy.core.usage import normalise_usage
from proxy.serve.metrics import Metrics
from proxy.wire import WIRES
from proxy.wire.protocol import Wire
from proxy.wire.sse import StreamWatcher
from tests.conftest import base_config
from tests.fake_upstream import FakeUpstream
from tests.wire.toy_wire import TOY

ALL = WIRES.with_wire(TOY)  # the one line that registers the toy
ROOT = Path(__file__).resolve().parents[2]
COUNTER = TokenCounter("o200k_base")


# a request, a usage object and a stream's end, as each wire writes them
SAMPLES: dict[str, dict[str, Any]] = {
    "chat": {
        "body": {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                            {"role": "user", "content": "hello there"}], "max_tokens": 9},
        "params": {},
        "usage": {"prompt_tokens": 50, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 20}},
        "end": b'data: {"choices": []}\n\ndata: [DONE]\n\n',
    },
    "responses": {
        "body": {"model": "m", "input": [{"role": "user", "content": "hello there"}], "max_output_tokens": 9},
        "params": {},
        "usage": {"input_tokens": 50, "output_tokens": 5, "input_tokens_details": {"cached_tokens": 20}},
        "end": b'event: response.completed\ndata: {"type": "response.completed", "response": {}}\n\n',
    },
    "messages": {
        "body": {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "hello there"}]},
        "params": {},
        "usage": {"input_tokens": 30, "cache_read_input_tokens": 20, "output_tokens": 5},
        "end": b'event: message_stop\ndata: {"type": "message_stop"}\n\n',
    },
    "toy": {
        "body": {"turns": [{"who": "rule", "text": "be brief"}, {"who": "user", "text": "hello there"}],
                 "options": {"max_tokens": 9}},
        "params": {"model": "m"},
        "usage": {"in": 50, "cached": 20, "out": 5},
        "end": b"event: done\ndata: {}\n\n",
    },
}


def wires() -> list[Wire]:
    return list(ALL.values())


def test_every_registered_wire_has_a_sample_here() -> None:
    assert set(ALL) == set(SAMPLES)


def test_the_wire_packages_are_laid_out_alike() -> None:
    """One package per wire, every one with the same modules: a reader finds a thing where it is in the others."""
    folders = [p for p in (ROOT / "proxy" / "wire").iterdir() if p.is_dir() and p.name != "__pycache__"]
    layouts = {p.name: sorted(f.name for f in p.glob("*.py")) for p in folders}
    assert set(layouts) == set(WIRES)
    assert len({tuple(files) for files in layouts.values()}) == 1, layouts


@pytest.mark.parametrize("wire", wires(), ids=lambda w: w.name)
def test_parse_then_render_gives_the_body_back(wire: Wire) -> None:
    body = SAMPLES[wire.name]["body"]
    conversation = wire.parse(body, COUNTER)
    assert conversation.items and all(item.tokens > 0 for item in conversation.items)
    assert wire.render(body, conversation.items, {}) == body


@pytest.mark.parametrize("wire", wires(), ids=lambda w: w.name)
def test_where_the_model_and_the_output_cap_are(wire: Wire) -> None:
    sample = SAMPLES[wire.name]
    assert wire.model_of(sample["body"], sample["params"]) == "m"
    assert list(wire.output_limits(sample["body"]).values()) == [9]
    field = wire.output_field("m")
    capped = wire.render(sample["body"], wire.parse(sample["body"], COUNTER).items, {field: 7})
    assert wire.output_limits(capped)[field] == 7
    renamed = {**sample["body"], **wire.model_changes(sample["body"], "upstream-m")}
    assert wire.model_of(renamed, sample["params"]) in ("upstream-m", "m")  # in the body, or in the path
    assert wire.upstream_path("upstream-m").startswith("/")
    assert wire.key_headers


@pytest.mark.parametrize("wire", wires(), ids=lambda w: w.name)
def test_usage_is_normalised_in_the_wires_form(wire: Wire) -> None:
    usage = normalise_usage(SAMPLES[wire.name]["usage"], wire.usage_form)
    assert usage is not None and (usage.input_tokens, usage.cached_tokens, usage.output_tokens) == (50, 20, 5)
    assert ALL.guess_usage(SAMPLES[wire.name]["usage"]) == usage  # and told apart by its keys


@pytest.mark.parametrize("wire", wires(), ids=lambda w: w.name)
def test_the_stream_end_is_detected_and_an_error_event_is_the_wires(wire: Wire) -> None:
    watcher = StreamWatcher(0.0, wire.stream_end)
    assert not watcher.complete
    watcher.feed(SAMPLES[wire.name]["end"])
    assert watcher.done and watcher.complete and not watcher.failed
    error = BadRequest("no such thing", code="invalid_thing")
    event = wire.stream_end.error_event(error)
    assert event.endswith(b"\n\n") and b"no such thing" in event
    body = wire.error_body(error)
    assert "no such thing" in json.dumps(body)


@pytest.mark.parametrize("wire", wires(), ids=lambda w: w.name)
def test_a_summary_item_of_the_wire(wire: Wire) -> None:
    item = wire.summary("the summary", 3, COUNTER)
    assert item.role in (SYSTEM, USER) and item.tokens > 0 and "the summary" in item.describe()
    body = SAMPLES[wire.name]["body"]
    rendered = wire.render(body, [item, *wire.parse(body, COUNTER).items], {})
    assert "the summary" in json.dumps(rendered)


@pytest.mark.parametrize("wire", wires(), ids=lambda w: w.name)
def test_explain_recognises_the_body_or_the_wire_is_named(wire: Wire) -> None:
    body = SAMPLES[wire.name]["body"]
    assert ALL.sniff(body) is wire or wire.sniff(body) == 0  # 0: its bodies look like another's (Messages)


@pytest.mark.parametrize("wire", wires(), ids=lambda w: w.name)
def test_the_metric_label_is_the_wires_own(wire: Wire) -> None:
    metrics = Metrics(["default"], ["m"], ModelMap(), wires=ALL)
    metrics.finished("default", "m", 200, overhead=None, upstream=None, ttft=None, usage=SAMPLES[wire.name]["usage"],
                     wire=wire.name)
    requests = metrics.registry.get_sample_value("ctxproxy_requests_total",
                                                 {"tenant": "default", "model": "m", "wire": wire.name, "status": "200"})
    cached = metrics.registry.get_sample_value("ctxproxy_provider_cached_tokens_total",
                                               {"tenant": "default", "model": "m"})
    assert (requests, cached) == (1.0, 20.0)


@pytest.mark.parametrize("wire", list(WIRES.values()), ids=lambda w: w.name)
def test_the_cli_offers_every_wire_the_server_speaks(wire: Wire, capsys: pytest.CaptureFixture[str]) -> None:
    from proxy.cli import main

    with pytest.raises(SystemExit):
        main(["assemble", "--help"])
    assert wire.name in capsys.readouterr().out


@pytest.mark.parametrize("wire", wires(), ids=lambda w: w.name)
async def test_the_wires_paths_are_routes(wire: Wire, upstream: FakeUpstream) -> None:
    from proxy.serve.app import create_app
    from proxy.settings import load_config

    app = create_app(load_config(base_config(upstream.base_url)), wires=ALL)
    routes = {(r.method, r.resource.canonical) for r in app.router.routes() if r.resource is not None}
    for path in (*wire.paths, *wire.endpoints):
        assert ("POST", "/v1" + path) in routes and ("POST", path) in routes


# --------------------------------------------------------------------------- the toy over HTTP

TENANTS = [{"name": "toys", "keys": ["sk-toy"], "max_output_tokens": 50, "models": ["toy-model", "tiny"]}]


def toy_config(upstream: FakeUpstream, **extra: Any) -> dict[str, Any]:
    return base_config(upstream.base_url, tenants=TENANTS, models=[
        {"name": "toy-model", "model": "gpt-4o-mini", "context_window": 128000, "max_output_tokens": 4096},
        {"name": "tiny", "model": "gpt-4o-mini", "context_window": 3000, "max_output_tokens": 256}], **extra)


async def post(url: str, body: Any, **headers: str) -> tuple[int, dict[str, str], Any]:
    async with aiohttp.ClientSession() as s, s.post(url, data=orjson.dumps(body), headers=headers) as r:
        return r.status, dict(r.headers), await r.json(content_type=None)


def turns(n: int, words: int = 60) -> list[dict[str, str]]:
    out = [{"who": "rule", "text": "You are a toy."}]
    for i in range(n):
        out += [{"who": "user", "text": f"question {i} " + "word " * words},
                {"who": "bot", "text": f"answer {i} " + "word " * words}]
    return [*out, {"who": "user", "text": "and now?"}]


async def test_the_toy_wire_is_served_with_its_key_header_and_the_model_in_its_path(
        upstream: FakeUpstream, start_proxy: Any) -> None:
    proxy = await start_proxy(toy_config(upstream), wires=ALL)
    body = {"turns": turns(2), "options": {"max_tokens": 20}}
    status, headers, answer = await post(proxy.url + "/v1/toy/toy-model/chat", body, **{"x-toy-key": "sk-toy"})
    assert status == 200 and headers["x-ctxproxy-tokens-in"] == headers["x-ctxproxy-tokens-out"]
    sent = upstream.other[-1]
    assert sent.path == "/v1/toy/gpt-4o-mini/chat"  # the upstream's model, in the upstream's path
    assert json.loads(sent.raw) == body and answer["path"] == "/v1/toy/gpt-4o-mini/chat"
    # the key is read where the toy says, and nowhere else; errors come in the toy's shape
    status, _, error = await post(proxy.url + "/v1/toy/toy-model/chat", body, Authorization="Bearer sk-toy")
    assert status == 401 and set(error) == {"toy_error"}
    status, _, error = await post(proxy.url + "/toy/toy-model/chat", {"turns": [{"who": "cat"}]},
                                  **{"x-toy-key": "sk-toy"})
    assert status == 400 and error["toy_error"]["code"] == "invalid_turn"
    status, _, error = await post(proxy.url + "/v1/toy/no-such-model/chat", body, **{"x-toy-key": "sk-toy"})
    assert status == 404 and set(error) == {"toy_error"}
    # another spelling of the path (no route takes it) is refused, never relayed around the pipeline
    for spelling in ("/v1/toy/toy-model/chat/", "/v1//toy/toy-model/chat", "/v1/toy/toy-model//chat"):
        status, _, error = await post(proxy.url + spelling, body, **{"x-toy-key": "sk-toy"})
        assert status == 404 and set(error) == {"toy_error"}, spelling
    assert len(upstream.other) == 1
    labels = {"tenant": "toys", "model": "toy-model", "wire": "toy", "status": "200"}
    assert proxy.state.metrics.registry.get_sample_value("ctxproxy_requests_total", labels) == 1.0


async def test_the_toy_wire_is_managed_and_its_nested_cap_applies(upstream: FakeUpstream, start_proxy: Any) -> None:
    proxy = await start_proxy(toy_config(upstream, context_manager={
        "type": "summarising", "params": {"keep_turns": 2}}), wires=ALL)
    body: dict[str, Any] = {"turns": turns(12, 150), "options": {"max_tokens": 200}}
    status, headers, _ = await post(proxy.url + "/v1/toy/tiny/chat", body, **{"x-toy-key": "sk-toy"})
    assert status == 200 and headers["x-ctxproxy-summary"] == "waited"
    assert int(headers["x-ctxproxy-tokens-out"]) < int(headers["x-ctxproxy-tokens-in"])
    sent = json.loads(upstream.other[-1].raw)
    assert len(sent["turns"]) < len(body["turns"]) and sent["turns"][-1] == body["turns"][-1]
    assert any(t["who"] == "rule" and t["text"].startswith("[Conversation summary") for t in sent["turns"])
    assert sent["options"] == {"max_tokens": 50}  # the tenant's cap, one level down
    made = len(upstream.summaries)
    assert made >= 1  # (the summariser's window is the tiny model's: it reads the turns in parts)
    status, headers, _ = await post(proxy.url + "/toy/tiny/chat", body, **{"x-toy-key": "sk-toy"})
    assert status == 200 and headers["x-ctxproxy-summary"] == "reused" and len(upstream.summaries) == made


async def test_the_toy_wire_is_explained(upstream: FakeUpstream, start_proxy: Any) -> None:
    proxy = await start_proxy(toy_config(upstream), wires=ALL)
    body = {"turns": turns(1), "options": {"max_tokens": 20}}
    status, _, out = await post(proxy.url + "/v1/ctxproxy/explain/toy?model=toy-model", body,
                                **{"x-toy-key": "sk-toy"})
    assert status == 200 and out["report"]["wire"] == "toy" and out["turns"] == body["turns"]
    status, _, out = await post(proxy.url + "/v1/ctxproxy/explain?model=toy-model", body, **{"x-toy-key": "sk-toy"})
    assert status == 200 and out["report"]["wire"] == "toy"  # picked from the body
    status, _, error = await post(proxy.url + "/v1/ctxproxy/explain/toy", body, **{"x-toy-key": "sk-toy"})
    assert status == 400 and error["toy_error"]["code"] == "missing_model"
    assert upstream.other == []  # explain forwards nothing
