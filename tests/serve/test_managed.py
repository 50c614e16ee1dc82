"""The managed handler forwards what the request's mode says, on every wire, against the fake upstream.

In observe mode (``mode: observe``, here a tenant's) the upstream receives the client's bytes and no summariser
is called, while the headers, the metrics (``mode="observe"``) and the log line say what enforce would have done;
a tenant in enforce mode next to it on the same proxy gets its context managed as before. The counts the test
expects are recomputed here from the bodies (``tests.wire.*_helpers.recount``), not read from the proxy.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from tests.conftest import RunningProxy, StartProxy
from tests.fake_upstream import FakeUpstream, Received, request_tokens
from tests.outside import metric_total, scrape
from tests.test_summarisation import conversation
from tests.wire.test_masking_http import MAX_TOKENS, WIRES, Wire, budget

WATCHED, ENFORCED, ADMIN = "sk-watched", "sk-enforced", "sk-admin"
PRICE = 2e-6  # USD per input token, on every route (so savings are priced)
Message = dict[str, Any]


def config(upstream: FakeUpstream, manager: Any, *, watched: dict[str, Any] | None = None,
           **extra: Any) -> dict[str, Any]:
    """An 8k route per wire; tenant ``watched`` in observe mode next to tenant ``enforced`` (the default mode)."""
    common = {"context_window": 8_000, "max_output_tokens": 4_096, "tokenizer": "o200k_base", "calibration": "off",
              "input_cost_per_token": PRICE, "output_cost_per_token": PRICE}
    cfg: dict[str, Any] = {
        "upstreams": {"openai": {"base_url": upstream.base_url, "api_key": "sk-upstream"},
                      "anthropic": {"base_url": upstream.url, "api": "anthropic", "api_key": "sk-ant-upstream"}},
        "default_upstream": "openai",
        "models": [{"name": "gpt-8k", **common}, {"name": "claude-8k", "upstream": "anthropic", **common}],
        "cache": {"backend": "memory"},
        "summarizer": {"retry_backoff_seconds": 0, "max_summary_tokens": 300},
        "context_manager": manager,
        "tenants": [{"name": "watched", "keys": [WATCHED], "mode": "observe", **(watched or {})},
                    {"name": "enforced", "keys": [ENFORCED]}],
        "admin": {"keys": [ADMIN]},
    }
    cfg.update(extra)
    return cfg


def encoded(body: dict[str, Any]) -> bytes:
    """A body as a client might write it: indented, keys in its own order, non-ASCII escaped, a trailing newline."""
    return json.dumps(body, indent=2, ensure_ascii=True).encode() + b"\n"


async def send(proxy: RunningProxy, wire: Wire, raw: bytes, key: str) -> tuple[int, dict[str, str], bytes]:
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json",
               "anthropic-version": "2023-06-01"}
    async with aiohttp.ClientSession() as s, s.post(proxy.url + wire.path, data=raw, headers=headers) as r:
        return r.status, {k.lower(): v for k, v in r.headers.items()}, await r.read()


def last(upstream: FakeUpstream, wire: Wire) -> Received:
    return {"chat": upstream.chat, "responses": upstream.responses, "messages": upstream.messages}[wire.name][-1]


def body_for(wire: Wire, messages: list[Message], stream: bool) -> dict[str, Any]:
    body = wire.body(messages, wire.model(8_000), stream)
    body["metadata"] = {"note": "Zürich — café"}  # escaped by ``encoded``: re-serialising would change the bytes
    return body


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("wire", sorted(WIRES))
async def test_observe_forwards_the_clients_bytes_and_reports_what_enforce_would_do(
        upstream: FakeUpstream, start_proxy: StartProxy, wire: str, stream: bool) -> None:
    """An over-budget conversation from a tenant in observe mode reaches the upstream byte for byte, with no
    summariser call; the headers and metrics give its size and what enforce would have forwarded. The same body
    from a tenant in enforce mode on the same proxy is summarised and forwarded within B."""
    manager = {"type": "summarising", "params": {"keep_turns": 4, "mask_observations": False}}
    proxy = await start_proxy(config(upstream, manager))
    w = WIRES[wire]
    hard, _ = budget(8_000)
    body = body_for(w, conversation(30), stream)
    raw = encoded(body)
    received = w.recount(body)
    assert received > hard  # enforce must manage it

    status, headers, answer = await send(proxy, w, raw, WATCHED)
    assert status == 200, answer[:300]
    assert last(upstream, w).raw == raw and upstream.summaries == []
    assert headers["x-ctxproxy-mode"] == "observe"
    assert int(headers["x-ctxproxy-tokens-in"]) == received
    would = int(headers["x-ctxproxy-tokens-out"])
    assert 0 < would <= hard and headers["x-ctxproxy-summary"] == "would_create"

    status, headers, answer = await send(proxy, w, raw, ENFORCED)
    assert status == 200, answer[:300]
    forwarded = last(upstream, w)
    assert forwarded.raw != raw and upstream.summaries  # managed: a summary was made for it
    assert headers["x-ctxproxy-mode"] == "enforce" and headers["x-ctxproxy-summary"] == "waited"
    assert w.recount(forwarded.body) == int(headers["x-ctxproxy-tokens-out"]) <= would  # observe counted it at most

    text = await scrape(proxy, ADMIN)
    seen = {"tenant": "watched", "mode": "observe"}
    assert metric_total(text, "ctxproxy_tokens_received_total", **seen) == received
    assert metric_total(text, "ctxproxy_tokens_forwarded_total", **seen) == would
    assert metric_total(text, "ctxproxy_tokens_removed_total", **seen, how="summarised") > 0
    if not stream:  # savings are counted from an answer's usage (a stream that reports none counts none)
        assert metric_total(text, "ctxproxy_estimated_savings_usd_total", **seen) == pytest.approx(
            metric_total(text, "ctxproxy_tokens_removed_total", **seen) * PRICE)
    assert metric_total(text, "ctxproxy_tokens_received_total", tenant="watched", mode="enforce") == 0
    assert metric_total(text, "ctxproxy_tokens_received_total", tenant="enforced", mode="enforce") == received
    assert metric_total(text, "ctxproxy_tokens_received_total", tenant="enforced", mode="observe") == 0
    # nothing was summarised for the observed tenant: its summary series stays empty
    assert metric_total(text, "ctxproxy_summaries_total", tenant="watched") == 0
    assert metric_total(text, "ctxproxy_summarizer_tokens_total", tenant="watched") == 0


@pytest.mark.parametrize("wire", sorted(WIRES))
@pytest.mark.parametrize("manager", ["sliding-window", {"type": "summarising", "params": {"summarizer": "drop"}},
                                     "observation-masking"], ids=["sliding-window", "drop", "masking"])
async def test_observe_would_forward_exactly_what_enforce_forwards(
        upstream: FakeUpstream, start_proxy: StartProxy, wire: str, manager: Any) -> None:
    """With a context manager that calls no model, what observe mode says enforce would forward is what the
    enforced tenant's request did forward, token for token, request after request of a growing conversation;
    the would-be savings equal the enforced ones."""
    proxy = await start_proxy(config(upstream, manager))
    w = WIRES[wire]
    hard, _ = budget(8_000)
    managed = 0
    for n in range(20, 34, 3):
        raw = encoded(body_for(w, conversation(n), n % 2 == 0))
        status, observed, _ = await send(proxy, w, raw, WATCHED)
        assert status == 200 and last(upstream, w).raw == raw
        status, enforced, _ = await send(proxy, w, raw, ENFORCED)
        assert status == 200
        out = int(enforced["x-ctxproxy-tokens-out"])
        assert w.recount(last(upstream, w).body) == out <= hard
        assert (observed["x-ctxproxy-tokens-in"], observed["x-ctxproxy-tokens-out"]) == (
            enforced["x-ctxproxy-tokens-in"], enforced["x-ctxproxy-tokens-out"])
        managed += out < int(enforced["x-ctxproxy-tokens-in"])
    assert managed >= 3
    text = await scrape(proxy, ADMIN)
    for name in ("ctxproxy_tokens_received_total", "ctxproxy_tokens_forwarded_total", "ctxproxy_tokens_removed_total",
                 "ctxproxy_estimated_savings_usd_total"):
        assert metric_total(text, name, tenant="watched", mode="observe") == pytest.approx(
            metric_total(text, name, tenant="enforced", mode="enforce")), name
    assert metric_total(text, "ctxproxy_estimated_savings_usd_total", tenant="watched") > 0


def unpaired(messages: list[Message]) -> list[Message]:
    """A conversation whose second tool result answers no call (enforce refuses it as unrepairable under
    ``pairing: strict``)."""
    out = [dict(m) for m in messages]
    results = [i for i, m in enumerate(out) if m["role"] == "tool"]
    out[results[1]]["tool_call_id"] = "call_nobody_made"
    return out


@pytest.mark.parametrize("wire", sorted(WIRES))
@pytest.mark.parametrize("case", ["over_budget", "strict_pairing"])
async def test_a_request_enforce_would_refuse_is_forwarded_and_counted(
        upstream: FakeUpstream, start_proxy: StartProxy, wire: str, case: str) -> None:
    """A request enforce refuses (too large even after management; tool pairing broken under ``pairing:
    strict``) is forwarded as sent in observe mode, with a warning naming the refusal and counted as an
    observed refusal; the enforced tenant gets the refusal and the upstream nothing."""
    w = WIRES[wire]
    hard, _ = budget(8_000)
    if case == "over_budget":
        messages = [*conversation(3)[:-1], {"role": "user", "content": "x " * (hard + 200)}]
        code = "context_length_exceeded"
        proxy = await start_proxy(config(upstream, "summarising"))
    else:
        messages = unpaired(conversation(4))
        code = "invalid_tool_pairing"
        proxy = await start_proxy(config(upstream, "summarising", pairing="strict"))
    raw = encoded(body_for(w, messages, False))
    status, headers, _ = await send(proxy, w, raw, WATCHED)
    assert status == 200 and last(upstream, w).raw == raw
    assert headers["x-ctxproxy-tokens-out"] == "0"
    assert f"enforce would refuse this request ({code})" in headers["x-ctxproxy-warning"]
    forwarded = len(upstream.chat) + len(upstream.responses) + len(upstream.messages)
    status, _, answer = await send(proxy, w, raw, ENFORCED)
    assert status == 400 and (code in answer.decode() or wire == "messages")  # Anthropic's errors carry no code
    assert len(upstream.chat) + len(upstream.responses) + len(upstream.messages) == forwarded
    text = await scrape(proxy, ADMIN)
    assert metric_total(text, "ctxproxy_observed_refusals_total", tenant="watched", code=code) == 1
    assert metric_total(text, "ctxproxy_tokens_received_total", tenant="watched") == 0  # counted as a refusal only
    assert metric_total(text, "ctxproxy_payload_errors_total", code=code) == 1  # the enforced tenant's


async def test_observe_keeps_the_output_cap_the_allow_list_and_the_upstream_model(
        upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """What policy always enforces holds in observe mode too: the tenant's output cap clamps (or refuses), a model
    outside its list is refused, and an alias goes upstream under the route's model name; the rest of the body
    is the client's."""
    cfg = config(upstream, "summarising", watched={"max_output_tokens": 300, "models": ["alias"]})
    cfg["models"].append({"name": "alias", "model": "gpt-4o-mini", "context_window": 8_000})
    proxy = await start_proxy(cfg)
    w = WIRES["chat"]
    body = {"model": "alias", "messages": conversation(30), "max_tokens": 2_000, "temperature": 0.25}
    status, headers, _ = await send(proxy, w, encoded(body), WATCHED)
    assert status == 200 and headers["x-ctxproxy-mode"] == "observe"
    sent = upstream.chat[-1].body
    assert sent == {**body, "model": "gpt-4o-mini", "max_tokens": 300}
    status, _, answer = await send(proxy, w, encoded({**body, "model": "gpt-8k"}), WATCHED)
    assert status == 404 and b"model_not_found" in answer
    cfg["tenants"][0]["max_output_policy"] = "refuse"
    proxy = await start_proxy(cfg)
    status, _, answer = await send(proxy, w, encoded(body), WATCHED)
    assert status == 400 and b"max_tokens" in answer
    assert len(upstream.chat) == 1


async def test_observe_calibrates_on_the_payload_it_forwarded(upstream: FakeUpstream,
                                                             start_proxy: StartProxy) -> None:
    """The provider counted the client's payload: the calibration sample is its count over ctxproxy's count of
    that payload, not of the smaller one enforce would have sent, so the factor learned is the provider's."""
    upstream.prompt_scale = 1.3
    cfg = config(upstream, {"type": "summarising", "params": {"keep_turns": 4}})
    cfg["models"][0]["calibration"] = "auto"
    proxy = await start_proxy(cfg)
    for n in range(24, 34, 2):
        status, headers, _ = await send(proxy, WIRES["chat"], encoded({"model": "gpt-8k", "messages": conversation(n),
                                                                         "max_tokens": MAX_TOKENS}), WATCHED)
        assert status == 200 and int(headers["x-ctxproxy-tokens-out"]) < int(headers["x-ctxproxy-tokens-in"])
        assert upstream.usages[-1]["prompt_tokens"] == round(1.3 * request_tokens(upstream.chat[-1].body))
    async with aiohttp.ClientSession() as s, s.get(proxy.url + "/v1/ctxproxy/policy?model=gpt-8k",
                                                   headers={"Authorization": f"Bearer {WATCHED}"}) as r:
        policy = await r.json()
    assert policy["mode"] == "observe"
    learned = policy["calibration"]["gpt-8k"]
    assert learned["source"] == "learned" and learned["factor"] == pytest.approx(1.3, abs=0.02)
