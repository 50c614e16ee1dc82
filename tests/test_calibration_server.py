"""Calibration end to end: a provider whose tokenizer counts 1.3x o200k, through the real server; tenants
that must not move each other's budgets; a refusal for length as evidence.

The fake upstream reports ``prompt_tokens`` = 1.3 x the true o200k count of what it received. With
calibration, after a handful of answers the factor is 1.3 and no forwarded payload exceeds the window
as the upstream counts it; with calibration off, the same conversation overflows it.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from tests import media_files as mf
from tests.conftest import RunningProxy, StartProxy, base_config
from tests.fake_upstream import FakeUpstream, ProviderWindow, request_tokens
from tests.helpers import words
from tests.outside import metric_total, n_tokens, scrape, text_of
from tests.test_summarisation import conversation

MODEL = "gpt-4o-mini"
WINDOW, OUTPUT = 8000, 1000
RESERVE = min(OUTPUT, WINDOW // 4)  # the completion reserve: the model's max output, at most a quarter of the window
SCALE = 1.3
HANDFUL = 3  # answers before the factor is learned (MIN_SAMPLES)


def config(url: str, calibration: Any = "auto", **extra: Any) -> dict[str, Any]:
    cfg = base_config(
        url,
        models=[{"name": MODEL, "context_window": WINDOW, "max_output_tokens": OUTPUT, "calibration": calibration}],
        summarizer_model=MODEL,
        context_manager={"type": "summarising", "params": {"keep_turns": 4}},
        summarizer={"retry_backoff_seconds": 0, "timeout_seconds": 5, "max_summary_tokens": 300},
    )
    cfg.update(extra)
    return cfg


async def post(s: aiohttp.ClientSession, proxy: RunningProxy, messages: list[dict[str, Any]],
               **extra: Any) -> tuple[int, dict[str, str], bytes]:
    async with s.post(proxy.url + "/v1/chat/completions", json={"model": MODEL, "messages": messages, **extra},
                      headers={"Authorization": "Bearer sk-client"}) as r:
        return r.status, dict(r.headers), await r.read()


async def policy(s: aiohttp.ClientSession, proxy: RunningProxy, model: str = MODEL) -> dict[str, Any]:
    async with s.get(proxy.url + f"/v1/ctxproxy/policy?model={model}",
                     headers={"Authorization": "Bearer sk-client"}) as r:
        assert r.status == 200
        body: dict[str, Any] = await r.json()
        return body["calibration"][model]


async def run(upstream: FakeUpstream, proxy: RunningProxy, turns: range) -> list[int]:
    """The provider's prompt_tokens of every request of a growing conversation."""
    async with aiohttp.ClientSession() as s:
        for n in turns:
            status, _, _ = await post(s, proxy, conversation(n))
            assert status == 200
    return [u["prompt_tokens"] for u in upstream.usages]


async def test_the_factor_converges_and_no_payload_overflows(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    upstream.prompt_scale = SCALE
    proxy = await start_proxy(config(upstream.base_url))
    counts = await run(upstream, proxy, range(3, 61))
    # what the upstream counted is what it received, times 1.3 (the fake counts independently of the proxy)
    assert counts == [round(SCALE * request_tokens(r.body)) for r in upstream.chat]
    async with aiohttp.ClientSession() as s:
        learned = await policy(s, proxy)
    assert learned["source"] == "learned" and learned["factor"] == pytest.approx(SCALE, abs=0.02)
    assert learned["upstream"] == "fake" and learned["upstream_model"] == MODEL
    assert max(counts) > (WINDOW - RESERVE) * 0.8  # the conversation did press against the window
    assert [c for c in counts[HANDFUL:] if c > WINDOW - RESERVE] == []  # fits with room for the answer
    text = await scrape(proxy)
    assert metric_total(text, "ctxproxy_token_calibration_factor", upstream="fake", model=MODEL) == learned["factor"]
    assert metric_total(text, "ctxproxy_calibration_samples_total", model=MODEL, result="used") == len(counts)
    # the accuracy histogram: raw counts are ~23 % low ((1 - 1.3) / 1.3), calibrated ones within a per cent
    assert metric_total(text, "ctxproxy_token_count_error_ratio_count", model=MODEL, count="raw") == len(counts)
    assert metric_total(text, "ctxproxy_token_count_error_ratio_bucket", model=MODEL, count="raw", le="-0.2") \
        == len(counts)
    late = metric_total(text, "ctxproxy_token_count_error_ratio_bucket", model=MODEL, count="calibrated", le="0.02") \
        - metric_total(text, "ctxproxy_token_count_error_ratio_bucket", model=MODEL, count="calibrated", le="-0.02")
    assert late >= len(counts) - HANDFUL


async def test_with_calibration_off_the_same_run_overflows(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    upstream.prompt_scale = SCALE
    # summaries alone, made when the conversation needs them, fill the budget up to B (masking first keeps
    # these requests lower, under T, and summaries made ahead in the background leave a lead under B: both
    # hide part of the overflow this test shows)
    proxy = await start_proxy(config(upstream.base_url, calibration="off", context_manager={
        "type": "summarising", "params": {"keep_turns": 4, "mask_observations": False,
                                          "summary_prefetch_ratio": 0}}))
    counts = await run(upstream, proxy, range(3, 61))
    over = [c for c in counts if c > WINDOW - RESERVE]
    assert over, "without calibration the upstream would have seen no overflow: the test proves nothing"
    # over what leaves room for the answer: a provider refuses these, or cuts the answer short
    async with aiohttp.ClientSession() as s:
        shown = await policy(s, proxy)
    assert (shown["factor"], shown["source"]) == (1.0, "off")
    assert shown["learned"] == pytest.approx(SCALE, abs=0.02)  # still learned, for the operator to see


async def test_a_pinned_factor_and_explain(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(config(upstream.base_url, calibration=1.5))
    async with aiohttp.ClientSession() as s, s.post(
            proxy.url + "/v1/ctxproxy/explain", json={"model": MODEL, "messages": conversation(40)},
            headers={"Authorization": "Bearer sk-client"}) as r:
        assert r.status == 200
        report = (await r.json())["report"]
    assert report["calibration"] == 1.5
    assert report["calibration_detail"]["source"] == "pinned"
    b = WINDOW - RESERVE - WINDOW // 10
    assert report["hard_budget"] == int(b / 1.5)
    assert report["tokens_after"] <= report["hard_budget"]


async def test_streamed_answers_teach_it_too(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    upstream.prompt_scale = SCALE
    proxy = await start_proxy(config(upstream.base_url))
    async with aiohttp.ClientSession() as s:
        for n in range(3, 3 + HANDFUL):
            status, _, raw = await post(s, proxy, conversation(n), stream=True,
                                        stream_options={"include_usage": True})
            assert status == 200 and raw.endswith(b"data: [DONE]\n\n")
        status, _, _ = await post(s, proxy, conversation(9), stream=True)  # no usage asked for: no sample
        assert (await policy(s, proxy))["factor"] == pytest.approx(SCALE, abs=0.02)
    text = await scrape(proxy)
    assert metric_total(text, "ctxproxy_calibration_samples_total", model=MODEL, result="used") == HANDFUL
    assert metric_total(text, "ctxproxy_calibration_samples_total", model=MODEL, result="no_usage") == 1


@pytest.mark.parametrize("usage", [
    {"prompt_tokens": 0},
    {"prompt_tokens": -40},
    {"prompt_tokens": "4000"},
    {"prompt_tokens": 10},  # the fake's fixed usage: not a count of this payload
    {"prompt_tokens": 10**9},
    None,
])
async def test_odd_usage_teaches_nothing(upstream: FakeUpstream, start_proxy: StartProxy, usage: Any) -> None:
    proxy = await start_proxy(config(upstream.base_url, models=[
        {"name": MODEL, "model": "SmolLM2-135M-Instruct", "context_window": WINDOW, "max_output_tokens": OUTPUT}]))
    upstream.fixed_usage = usage
    async with aiohttp.ClientSession() as s:
        for n in range(3, 9):
            status, _, _ = await post(s, proxy, conversation(n))
            assert status == 200
        shown = await policy(s, proxy)
    assert (shown["factor"], shown["source"], shown["samples"]) == (1.2, "default", 0)  # SmolLM's default, unmoved


# -- tenants on an Anthropic route: one tenant's traffic never widens another's budget --------------------

CLAUDE = "claude-sonnet-4-5"
CLAUDE_WINDOW, CLAUDE_OUTPUT = 8000, 1000
CAP_B = 3000


def claude_count(body: dict[str, Any]) -> int:
    """The fake provider's own count: o200k text (3 per message) and 1 token per image (a 1×1 image costs next to
    nothing), written here independently of the proxy's formulas."""
    n = n_tokens(body["system"]) if isinstance(body.get("system"), str) else 0
    for message in body.get("messages", []):
        n += 3
        content = message["content"]
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        for block in blocks:
            n += n_tokens(block["text"]) if block.get("type") == "text" else 1
    return n


def tenants_config(upstream: FakeUpstream, **model: Any) -> dict[str, Any]:
    return {
        "upstreams": {"a": {"base_url": upstream.url, "api": "anthropic", "api_key": "sk-ant-upstream"}},
        "models": [{"name": CLAUDE, "context_window": CLAUDE_WINDOW, "max_output_tokens": CLAUDE_OUTPUT,
                    "calibration": "auto", **model}],
        "context_manager": {"type": "sliding-window", "params": {"keep_turns": 1000}},  # the budget decides
        "tenants": [{"name": "a", "keys": ["sk-a"]}, {"name": "b", "keys": ["sk-b"], "max_context_tokens": CAP_B},
                    {"name": "c", "keys": ["sk-c"]}],
        "cache": {"backend": "memory"},
        "admin": {"keys": ["sk-admin"]},
    }


def talk(turns: int, words_each: int = 150) -> list[dict[str, Any]]:
    """A plain-text conversation of ``turns`` user/assistant pairs, ending with a user turn."""
    out: list[dict[str, Any]] = []
    for i in range(turns):
        out.append({"role": "user", "content": f"Question {i}: " + words(words_each, seed=i)})
        out.append({"role": "assistant", "content": f"Answer {i}: " + words(words_each, seed=i + 1000)})
    out.append({"role": "user", "content": "And now?"})
    return out


async def send(s: aiohttp.ClientSession, proxy: RunningProxy, key: str, messages: list[dict[str, Any]],
               **extra: Any) -> int:
    async with s.post(proxy.url + "/v1/messages", json={"model": CLAUDE, "max_tokens": CLAUDE_OUTPUT,
                                                        "messages": messages, **extra},
                      headers={"x-api-key": key, "anthropic-version": "2023-06-01"}) as r:
        await r.read()
        return r.status


async def claude_policy(s: aiohttp.ClientSession, proxy: RunningProxy, key: str) -> dict[str, Any]:
    async with s.get(proxy.url + f"/v1/ctxproxy/policy?model={CLAUDE}", headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status == 200
        body: dict[str, Any] = await r.json()
        return body["calibration"][CLAUDE]


@pytest.mark.parametrize("stream", [False, True])
async def test_one_tenants_images_do_not_widen_other_tenants_budgets(
        upstream: FakeUpstream, start_proxy: StartProxy, stream: bool) -> None:
    """Tenant A sends text with a 1×1 PNG that the provider bills at ~1 token. The proxy counts the image by its
    size (1 token, not 1,600), and A's samples are A's alone: B (capped at 3,000) and C (no cap, window 8,000)
    are forwarded within their budgets as the provider counts them."""
    upstream.anthropic_input = claude_count
    proxy = await start_proxy(tenants_config(upstream))
    pixel = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": mf.b64(mf.png(1, 1))}}
    async with aiohttp.ClientSession() as s:
        for i in range(3):
            content = [{"type": "text", "text": words(750, seed=i)}, pixel]
            assert await send(s, proxy, "sk-a", [{"role": "user", "content": content}], stream=stream) == 200
        long = talk(50)
        assert claude_count({"messages": long}) > 2 * CLAUDE_WINDOW  # far more than fits: trimming decides
        assert await send(s, proxy, "sk-b", long, stream=stream) == 200
        assert await send(s, proxy, "sk-c", long, stream=stream) == 200
        forwarded_b, forwarded_c = upstream.anthropic_inputs[3:5]
        assert forwarded_b <= CAP_B
        assert forwarded_c <= CLAUDE_WINDOW - CLAUDE_OUTPUT
        assert forwarded_c > CAP_B  # C's conversation did fill its budget
        a = await claude_policy(s, proxy, "sk-a")
        b, c = await claude_policy(s, proxy, "sk-b"), await claude_policy(s, proxy, "sk-c")
    assert a["source"] == "learned" and a["tenant"] == "a"
    assert a["factor"] >= 0.9  # text and the image counted as billed: a ratio near 1, not the 0.5 clamp
    assert b["source"] in ("default", "shared") and b["factor"] >= b["family_default"]
    assert c["factor"] >= c["family_default"]


async def test_a_tenant_with_a_low_factor_of_its_own_never_moves_another(
        upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """A tenant whose traffic the provider bills at half the proxy's count learns 0.5 for itself only, and only
    as fast as its samples agree: the budget is not widened on the strength of a few requests."""
    upstream.anthropic_input = lambda body: claude_count(body) // 2
    proxy = await start_proxy(tenants_config(upstream))
    async with aiohttp.ClientSession() as s:
        for i in range(30):
            assert await send(s, proxy, "sk-a", [{"role": "user", "content": words(800, seed=i)}]) == 200
            if i == 3:
                early = await claude_policy(s, proxy, "sk-a")
        a, c = await claude_policy(s, proxy, "sk-a"), await claude_policy(s, proxy, "sk-c")
    assert early["factor"] >= 0.9 * early["family_default"]
    assert (a["factor"], a["source"]) == (0.5, "learned")
    assert (c["factor"], c["source"], c["shared"]) == (c["family_default"], "default", 0.5)


async def test_a_refusal_for_length_teaches_the_factor(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """A provider that counts 1.8× the proxy refuses the first payload (the default 1.2 is too low); the refusal,
    which states its count, is a sample: the request is assembled again with 1.8 and answered, and the next one
    fits the first time."""
    upstream.anthropic_input = lambda body: round(1.8 * claude_count(body))
    upstream.anthropic_window = CLAUDE_WINDOW
    proxy = await start_proxy(tenants_config(upstream))
    long = talk(50)
    async with aiohttp.ClientSession() as s:
        assert await send(s, proxy, "sk-c", long) == 200
        first, retried = upstream.anthropic_inputs
        assert first > CLAUDE_WINDOW >= retried
        assert await send(s, proxy, "sk-c", long) == 200
        assert len(upstream.anthropic_inputs) == 3 and upstream.anthropic_inputs[-1] <= CLAUDE_WINDOW
        c = await claude_policy(s, proxy, "sk-c")
    assert c["source"] == "learned" and c["factor"] == pytest.approx(1.8, abs=0.03)
    text = await scrape(proxy, "sk-admin")
    assert metric_total(text, "ctxproxy_calibration_samples_total", model=CLAUDE, result="refused") == 1
    assert metric_total(text, "ctxproxy_overflow_recovered_total", tenant="c", model=CLAUDE) == 1


# -- a conversation that starts tool-heavy and turns text-heavy: Claude Code's shape --------------------------
#
# A provider that counts tool schemas far lower than text (0.5x / 1.3x o200k; in the extreme run 0.2x / 1.4x)
# and enforces its real window: the first requests, a 15k-token tool list and little else, teach a low ratio;
# the conversation then reads files, and the same ratio would put the payload far over the window.

RUN_WINDOW, RUN_OUTPUT = 48000, 4000
RUN_REQUESTS = 36
TOOL_HEAVY = 3  # requests before the conversation turns text-heavy


def claude_code_tools(total: int = 15000, n: int = 40) -> list[dict[str, Any]]:
    """A tool list of about ``total`` o200k tokens, in Anthropic's shape."""
    each = total // n - 40
    return [{"name": f"tool_{i}", "description": text_of(each, seed=i),
             "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}
            for i in range(n)]


def claude_code_run(requests: int = RUN_REQUESTS) -> list[dict[str, Any]]:
    """The bodies of one conversation: each request is every finished turn plus a new user message."""
    tools = claude_code_tools()
    done: list[dict[str, Any]] = []
    bodies: list[dict[str, Any]] = []
    for k in range(requests):
        heavy = k >= TOOL_HEAVY
        ask = {"role": "user", "content": f"Step {k}: " + (text_of(300, seed=k) if heavy else words(20, seed=k))}
        bodies.append({"model": CLAUDE, "max_tokens": RUN_OUTPUT, "system": text_of(800, seed=99), "tools": tools,
                       "messages": [*done, ask]})
        tid = f"toolu_{k:03d}"
        result = text_of(8000, seed=k + 500) if heavy else words(60, seed=k + 500)
        done += [ask,
                 {"role": "assistant", "content": [{"type": "text", "text": words(20, seed=k)},
                                                   {"type": "tool_use", "id": tid, "name": f"tool_{k % 40}",
                                                    "input": {"path": f"/srv/app/module_{k}.py"}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tid, "content": result}]},
                 {"role": "assistant", "content": words(40, seed=k + 900)}]
    return bodies


def run_config(upstream: FakeUpstream) -> dict[str, Any]:
    return {
        "upstreams": {"a": {"base_url": upstream.url, "api": "anthropic", "api_key": "sk-ant-upstream"}},
        "models": [{"name": CLAUDE, "context_window": RUN_WINDOW, "max_output_tokens": RUN_OUTPUT}],
        "context_manager": {"type": "sliding-window", "params": {"keep_turns": 1000}},  # the budget decides
        "cache": {"backend": "memory"},
    }


async def tool_heavy_then_text_heavy(upstream: FakeUpstream, proxy: RunningProxy) -> list[int]:
    """The statuses the client got for every request of the run."""
    statuses = []
    async with aiohttp.ClientSession() as s:
        for body in claude_code_run():
            async with s.post(proxy.url + "/v1/messages", json=body,
                              headers={"x-api-key": "sk-client", "anthropic-version": "2023-06-01"}) as r:
                await r.read()
                statuses.append(r.status)
    return statuses


@pytest.mark.parametrize(("tool_scale", "text_scale"), [(0.5, 1.3), (0.2, 1.4)])
async def test_a_ratio_learned_on_tools_does_not_overflow_text(
        upstream: FakeUpstream, start_proxy: StartProxy, tool_scale: float, text_scale: float) -> None:
    """The first requests teach a low ratio (0.55; in the extreme run 0.28, too low to be taken, and the next ones
    are still low); the rule before, a median, put a text-heavy payload 35 % (33 %) over B by the provider's
    count, and its client got the provider's 400. Every request must be answered, with at most two refused
    attempts in the 36."""
    upstream.window = ProviderWindow(RUN_WINDOW, text_scale=text_scale, tool_scale=tool_scale, dialect="anthropic")
    proxy = await start_proxy(run_config(upstream))
    statuses = await tool_heavy_then_text_heavy(upstream, proxy)
    assert statuses == [200] * RUN_REQUESTS
    assert len(upstream.window_refused) <= 2  # measured: 0 (before: 1, and its client got the provider's 400)
    assert max(upstream.window_counts) > RUN_WINDOW // 2  # the conversation did press against the window
