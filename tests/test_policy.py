"""Org-wide policy on the wire: tenants and proxy keys, enforced context caps, overrides that only
tighten, model routes, output limits, and what a caller may see of its policy.

Several tenants share ONE running proxy; each is driven with the official ``openai`` client and
its own api_key (raw aiohttp where headers matter). Forwarded payloads are recounted here,
independently of the proxy's counter: tiktoken o200k_base with OpenAI's per-message formula.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import tiktoken

from proxy.settings import load_config
from tests.conftest import ROOT, RunningProxy
from tests.fake_upstream import REPLY, FakeUpstream

Message = dict[str, Any]

BIG, MINI = "big", "mini"  # client names; upstream names below
BIG_UPSTREAM, MINI_UPSTREAM = "acme-big-2024-06", "acme-mini-0718"
UPSTREAM_KEY = "sk-upstream-secret-5b1e"
KEYS = {"research": "rk-research-4f1c8a", "support": "sk-support-77aa31", "platform": "pk-platform-hashed-9e2d"}
ADMIN_KEY = "adm-policy-0c4417"
CAPS = {"research": 6000, "support": 3000, "platform": 6000}
SECRETS = [*KEYS.values(), ADMIN_KEY, UPSTREAM_KEY, *(hashlib.sha256(k.encode()).hexdigest() for k in KEYS.values())]


def sha(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def tenants() -> list[dict[str, Any]]:
    return [
        {   # summarising through the llm summariser (the fake upstream writes summaries), all models
            "name": "research",
            "keys": [KEYS["research"]],
            "context_manager": {"type": "summarising", "params": {"keep_turns": 6, "working_memory_messages": 20}},
            "max_context_tokens": CAPS["research"],
            "summarizer_model": MINI,
        },
        {   # sliding window, a small cap, one model, output above 512 refused
            "name": "support",
            "keys": [KEYS["support"]],
            "context_manager": {"type": "sliding-window", "params": {"keep_turns": 6}},
            "max_context_tokens": CAPS["support"],
            "max_output_tokens": 512,
            "max_output_policy": "refuse",
            "models": [BIG],
        },
        {   # a hashed key; summarising that drops (no summariser); output clamped to 1000
            "name": "platform",
            "keys": [sha(KEYS["platform"])],
            "context_manager": {"type": "summarising", "params": {"keep_turns": 6, "summarizer": "drop"}},
            "max_context_tokens": CAPS["platform"],
            "max_output_tokens": 1000,
            "models": [BIG, MINI],
        },
    ]


def policy_config(default_url: str, second_url: str, **extra: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "upstreams": {
            "main": {"base_url": default_url, "api_key": UPSTREAM_KEY},
            "second": {"base_url": second_url, "api_key": UPSTREAM_KEY},
        },
        "default_upstream": "main",
        "models": [
            {"name": BIG, "model": BIG_UPSTREAM, "context_window": 32000, "max_output_tokens": 4096,
             "tokenizer": "o200k_base"},
            {"name": MINI, "upstream": "second", "model": MINI_UPSTREAM, "context_window": 32000,
             "max_output_tokens": 4096, "tokenizer": "o200k_base"},
        ],
        "cache": {"backend": "memory"},
        "summarizer": {"retry_backoff_seconds": 0},
        "tenants": tenants(),
        "admin": {"keys": [ADMIN_KEY]},
    }
    config.update(extra)
    return config


# --------------------------------------------------------------------------- independent counting


@functools.lru_cache(maxsize=1)
def _o200k() -> tiktoken.Encoding:
    return tiktoken.get_encoding("o200k_base")


@functools.lru_cache(maxsize=50_000)
def _n(text: str) -> int:
    return len(_o200k().encode(text, disallowed_special=()))


def count_tokens(messages: list[Message]) -> int:
    """OpenAI's formula: 3 per message + every string value (+1 per name) + 3 + name + arguments per
    tool call, + 3 to prime the reply."""
    total = 3
    for m in messages:
        total += 3
        for key, value in m.items():
            if isinstance(value, str):
                total += _n(value) + (1 if key == "name" else 0)
            elif key == "tool_calls" and isinstance(value, list):
                for c in value:
                    fn = c.get("function") or {}
                    total += 3 + _n(fn.get("name") or "") + _n(fn.get("arguments") or "")
    return total


def within_cap(forwarded: list[Message], cap: int) -> bool:
    """The proxy's estimate may differ slightly from this count: allow 1%."""
    return count_tokens(forwarded) <= cap * 1.01


# --------------------------------------------------------------------------- conversations

WORDS = ["order", "invoice", "refund", "shipment", "Denver", "Boston", "ticket", "ZFA04Y", "account", "balance",
         "customer", "warehouse", "parcel", "delayed", "carrier", "tracking", "8842", "/srv/app/config.yaml",
         "status", "pending", "approved"]


def words(n: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 5 + i * 7) % len(WORDS)] for i in range(n))


def result_text(seed: int, tokens: int = 300) -> str:
    """A tool result of exactly ``tokens`` o200k tokens."""
    text = f"result {seed}: " + words(tokens * 2, seed)
    ids = _o200k().encode(text)
    return _o200k().decode(ids[:tokens])


def conversation(turns: int, *, wm_rounds: int = 0, seed: int = 0) -> list[Message]:
    """An agent conversation: every turn a question, one tool round with a ~300-token result, an
    answer; then the current question, followed by ``wm_rounds`` live tool rounds."""
    out: list[Message] = [{"role": "system", "content": "You are ACME's operations agent. Use the tools."}]
    for t in range(turns):
        tid = f"call_{seed}_{t}"
        out += [
            {"role": "user", "content": f"question {t}: " + words(20, t + seed)},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": tid, "type": "function", "function": {"name": "lookup", "arguments": json.dumps({"t": t})}}]},
            {"role": "tool", "tool_call_id": tid, "content": result_text(t + seed)},
            {"role": "assistant", "content": f"answer {t}: " + words(25, t + seed + 1)},
        ]
    out.append({"role": "user", "content": "current question: " + words(15, seed + 99)})
    for r in range(wm_rounds):
        tid = f"wm_{seed}_{r}"
        out += [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": tid, "type": "function", "function": {"name": "fetch", "arguments": json.dumps({"r": r})}}]},
            {"role": "tool", "tool_call_id": tid, "content": result_text(1000 + r)},
        ]
    return out


def user_turns(messages: list[Message]) -> int:
    return sum(1 for m in messages if m.get("role") == "user")


def pairing_ok(messages: list[Message]) -> bool:
    """Every tool result right after the call that asked for it; every call answered once."""
    i = 0
    while i < len(messages):
        m = messages[i]
        if m.get("role") == "tool":
            return False
        if m.get("tool_calls"):
            wanted = sorted(c["id"] for c in m["tool_calls"])
            j = i + 1
            while j < len(messages) and messages[j].get("role") == "tool":
                j += 1
            if sorted(x["tool_call_id"] for x in messages[i + 1 : j]) != wanted:
                return False
            i = j
            continue
        i += 1
    return True


# --------------------------------------------------------------------------- fixtures and clients


@dataclass
class Env:
    proxy: RunningProxy
    upstream: FakeUpstream
    second: FakeUpstream

    def client(self, tenant_or_key: str) -> openai.AsyncOpenAI:
        key = KEYS.get(tenant_or_key, tenant_or_key)
        return openai.AsyncOpenAI(base_url=self.proxy.base_url, api_key=key, max_retries=0)

    @property
    def forwarded(self) -> list[Message]:
        return self.upstream.chat[-1].body["messages"]


@pytest.fixture
async def second() -> Any:
    fake = await FakeUpstream().start()
    yield fake
    await fake.stop()


@pytest.fixture
async def env(upstream: FakeUpstream, second: FakeUpstream, start_proxy: Any) -> Env:
    proxy = await start_proxy(policy_config(upstream.base_url, second.base_url))
    return Env(proxy, upstream, second)


async def chat(env: Env, tenant: str, messages: list[Message], *, model: str = BIG,
               headers: dict[str, str] | None = None, **kw: Any) -> Any:
    """One request with the openai client; returns the raw response (headers + parse())."""
    async with env.client(tenant) as c:
        return await c.chat.completions.with_raw_response.create(
            model=model, messages=messages, extra_headers=headers or {}, **kw)  # type: ignore[arg-type]


async def get_json(url: str, key: str | None, headers: dict[str, str] | None = None) -> tuple[int, Any, bytes]:
    hdrs = dict(headers or {})
    if key is not None:
        hdrs["Authorization"] = f"Bearer {key}"
    async with aiohttp.ClientSession() as s, s.get(url, headers=hdrs) as r:
        raw = await r.read()
        return r.status, r.headers, raw


async def post_json(url: str, body: Any, key: str | None, headers: dict[str, str] | None = None,
                    ) -> tuple[int, Any, Any]:
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    if key is not None:
        hdrs["Authorization"] = f"Bearer {key}"
    async with aiohttp.ClientSession() as s, s.post(url, data=json.dumps(body), headers=hdrs) as r:
        return r.status, r.headers, await r.json(content_type=None)


def override(**params: Any) -> dict[str, str]:
    return {"x-ctxproxy-context-manager": json.dumps(params)}


# --------------------------------------------------------------------------- the caps hold


@pytest.mark.parametrize("tenant", ["research", "support", "platform"])
async def test_cap_holds_on_every_forwarded_payload(env: Env, tenant: str) -> None:
    """A growing agent conversation, per tenant: every payload the upstream receives fits the tenant's
    cap (recounted here), keeps the system message and the current question, and stays paired."""
    cap = CAPS[tenant]
    seen_over = False
    for turns in (1, 4, 8, 12, 16, 20, 26, 34, 45):
        messages = conversation(turns)
        seen_over |= count_tokens(messages) > cap
        raw = await chat(env, tenant, messages)
        assert raw.status_code == 200
        forwarded = env.forwarded
        assert within_cap(forwarded, cap), (turns, count_tokens(forwarded), cap)
        assert int(raw.headers["x-ctxproxy-tokens-out"]) <= cap
        assert abs(count_tokens(forwarded) - int(raw.headers["x-ctxproxy-tokens-out"])) <= cap * 0.01
        assert forwarded[0] == messages[0] and forwarded[-1] == messages[-1]
        assert pairing_ok(forwarded)
        if count_tokens(messages) <= cap / 1.1 * 0.99:  # under the summary threshold: untouched
            assert forwarded == messages
    assert seen_over
    assert env.upstream.chat[-1].headers["Authorization"] == f"Bearer {UPSTREAM_KEY}"
    if tenant == "research":  # the summariser model is routed too: "mini" -> the second upstream
        assert env.second.summaries and not env.upstream.summaries
        assert {r.body["model"] for r in env.second.summaries} == {MINI_UPSTREAM}
    else:
        assert not env.upstream.summaries and not env.second.summaries


@pytest.mark.parametrize("tenant", ["research", "support", "platform"])
async def test_cap_holds_with_a_heavy_live_tool_round_and_streaming(env: Env, tenant: str) -> None:
    """Most of the payload in the current turn's working memory (tool rounds after the last user
    message): the oldest rounds go, the last stays, and the cap still holds; streamed too."""
    cap = CAPS[tenant]
    for wm_rounds in (2, 6, 12, 25):
        messages = conversation(10, wm_rounds=wm_rounds, seed=wm_rounds)
        async with env.client(tenant) as c:
            stream = await c.chat.completions.create(model=BIG, messages=messages, stream=True)  # type: ignore[arg-type]
            text = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
        assert text == REPLY
        forwarded = env.forwarded
        assert within_cap(forwarded, cap), (wm_rounds, count_tokens(forwarded), cap)
        assert forwarded[-2:] == messages[-2:]  # the last tool round is pinned
        assert pairing_ok(forwarded)


async def test_tenants_get_different_budgets_for_the_same_conversation(env: Env) -> None:
    messages = conversation(4, wm_rounds=14)  # most of it in the live tool round: the caps bind
    sizes = {}
    for tenant in ("support", "platform"):
        raw = await chat(env, tenant, messages)
        sizes[tenant] = count_tokens(env.forwarded)
        assert int(raw.headers["x-ctxproxy-tokens-in"]) > CAPS["platform"]
    assert sizes["support"] <= CAPS["support"] * 1.01 < sizes["platform"] <= CAPS["platform"] * 1.01


async def test_pinned_parts_over_the_cap_are_refused_before_the_upstream(env: Env) -> None:
    """The current question plus the last tool round cannot be dropped: over the cap -> 400."""
    messages = conversation(2)
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "big", "type": "function", "function": {"name": "dump", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "big", "content": result_text(7, tokens=3500)},
    ]
    async with env.client("support") as c:
        with pytest.raises(openai.BadRequestError) as exc:
            await c.chat.completions.create(model=BIG, messages=messages)  # type: ignore[arg-type]
    assert exc.value.status_code == 400
    assert exc.value.body["code"] == "context_length_exceeded"  # type: ignore[index]
    raw = await chat(env, "platform", messages)  # the bigger cap takes it
    assert raw.status_code == 200 and within_cap(env.forwarded, CAPS["platform"])
    assert len(env.upstream.chat) == 1


# --------------------------------------------------------------------------- allowed models


@pytest.mark.parametrize("model", [MINI, "gpt-4o", "no-such-model"])
@pytest.mark.parametrize("stream", [False, True])
async def test_model_outside_the_tenants_list_is_404_model_not_found(env: Env, model: str, stream: bool) -> None:
    async with env.client("support") as c:
        with pytest.raises(openai.NotFoundError) as exc:
            await c.chat.completions.create(model=model, messages=conversation(1), stream=stream)  # type: ignore[arg-type]
    assert exc.value.status_code == 404
    body: Any = exc.value.body
    assert body["code"] == "model_not_found" and body["type"] == "invalid_request_error"
    assert body["param"] == "model" and model in body["message"]
    assert not env.upstream.chat and not env.second.chat


async def test_404_body_has_openais_shape(env: Env) -> None:
    status, _, body = await post_json(env.proxy.base_url + "/chat/completions",
                                      {"model": MINI, "messages": conversation(1)}, KEYS["support"])
    assert status == 404
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == "model_not_found"


async def test_tenant_without_a_model_list_may_use_any_model(env: Env) -> None:
    raw = await chat(env, "research", conversation(1), model="gpt-4o")
    assert raw.status_code == 200
    assert env.upstream.chat[-1].body["model"] == "gpt-4o"  # unknown names go to the default upstream as-is


# --------------------------------------------------------------------------- keys


async def test_hashed_key_works_and_the_hash_itself_is_not_a_key(env: Env) -> None:
    raw = await chat(env, "platform", conversation(1))
    assert raw.status_code == 200
    status, _, body = await get_json(env.proxy.base_url + "/ctxproxy/policy", KEYS["platform"])
    assert status == 200 and json.loads(body)["tenant"] == "platform"
    async with env.client(sha(KEYS["platform"])) as c:
        with pytest.raises(openai.AuthenticationError):
            await c.chat.completions.create(model=BIG, messages=conversation(1))  # type: ignore[arg-type]
    assert len(env.upstream.chat) == 1


@pytest.mark.parametrize("key", ["sk-not-a-tenant", KEYS["support"].upper(), KEYS["support"] + "x", ADMIN_KEY])
async def test_unknown_key_is_401_invalid_api_key(env: Env, key: str) -> None:
    async with env.client(key) as c:
        with pytest.raises(openai.AuthenticationError) as exc:
            await c.chat.completions.create(model=BIG, messages=conversation(1))  # type: ignore[arg-type]
    assert exc.value.status_code == 401
    body: Any = exc.value.body
    assert body["code"] == "invalid_api_key" and body["type"] == "authentication_error"
    assert key not in json.dumps(body)
    assert not env.upstream.chat


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer "}, {"Authorization": "Basic abc"}])
async def test_missing_key_is_401(env: Env, headers: dict[str, str]) -> None:
    for path in ("/chat/completions", "/ctxproxy/policy", "/models"):
        async with aiohttp.ClientSession() as s:
            method = s.post if path == "/chat/completions" else s.get
            async with method(env.proxy.base_url + path, json={"model": BIG, "messages": conversation(1)},
                              headers=headers) as r:
                assert r.status == 401, path
                body = await r.json()
        assert body["error"]["code"] == "invalid_api_key"
    assert not env.upstream.chat


async def test_other_header_spellings_of_the_key(env: Env) -> None:
    for header in ("api-key", "x-api-key"):
        status, _, _ = await get_json(env.proxy.base_url + "/ctxproxy/policy", None, {header: KEYS["support"]})
        assert status == 200


# --------------------------------------------------------------------------- overrides only tighten


def most(keep: int) -> int:
    """Turns a window of ``keep`` may forward: it moves ceil(keep/2) turns at a time (prefix stability)."""
    return keep + math.ceil(keep / 2) - 1


async def baseline(env: Env, tenant: str, messages: list[Message]) -> list[Message]:
    raw = await chat(env, tenant, messages)
    assert "x-ctxproxy-warning" not in raw.headers
    return env.forwarded


@pytest.mark.parametrize("tenant,manager", [("support", "sliding-window"), ("platform", "summarising")])
async def test_override_keep_turns_tightens_but_never_loosens(env: Env, tenant: str, manager: str) -> None:
    """Tenant keep_turns 6: an override of 3 is applied; 20 is ignored with a warning."""
    messages = conversation(16)
    base = await baseline(env, tenant, messages)
    assert 1 < user_turns(base) <= most(6) + 1

    raw = await chat(env, tenant, messages, headers=override(type=manager, params={"keep_turns": 3}))
    assert "x-ctxproxy-warning" not in raw.headers
    assert 3 + 1 <= user_turns(env.forwarded) <= most(3) + 1
    assert user_turns(env.forwarded) < user_turns(base)
    assert env.forwarded[-1] == messages[-1] and pairing_ok(env.forwarded)

    raw = await chat(env, tenant, messages, headers=override(type=manager, params={"keep_turns": 20}))
    warning = raw.headers["x-ctxproxy-warning"]
    assert "x-ctxproxy-context-manager ignored" in warning and "keep_turns 20 > 6" in warning
    assert env.forwarded == base
    assert within_cap(env.forwarded, CAPS[tenant])


@pytest.mark.parametrize("tenant,manager", [("support", "sliding-window"), ("platform", "summarising"),
                                            ("research", "summarising")])
async def test_override_trimmer_max_tokens_lower_applies_higher_has_no_effect(
    env: Env, tenant: str, manager: str
) -> None:
    cap = CAPS[tenant]
    messages = conversation(30)
    base = await baseline(env, tenant, messages)

    for higher in (cap + 1, 50_000, 10**9):
        raw = await chat(env, tenant, messages,
                         headers=override(type=manager, params={"trimmer": {"max_tokens": higher}}))
        assert "x-ctxproxy-warning" not in raw.headers
        assert int(raw.headers["x-ctxproxy-tokens-out"]) <= cap
        assert within_cap(env.forwarded, cap)
        assert env.forwarded == base

    # (after the higher ones: research's smaller summary budget leaves a longer cached summary that
    # later requests may legitimately reuse)
    raw = await chat(env, tenant, messages, headers=override(type=manager, params={"trimmer": {"max_tokens": 1500}}))
    assert "x-ctxproxy-warning" not in raw.headers
    assert int(raw.headers["x-ctxproxy-tokens-out"]) <= 1500
    assert within_cap(env.forwarded, 1500) and pairing_ok(env.forwarded)
    # only the budget changed: the tenant's other params (keep_turns 6) still apply
    assert user_turns(env.forwarded) <= 6 + 1


async def test_override_that_sets_one_param_keeps_the_tenants_others(env: Env) -> None:
    """An override is read over the tenant's binding: setting only trimmer.max_tokens must not reset
    keep_turns to the plugin default (10 > the tenant's 6), nor the drop summariser to llm."""
    messages = conversation(16)
    for tenant, manager in (("support", "sliding-window"), ("platform", "summarising")):
        raw = await chat(env, tenant, messages, headers=override(type=manager, params={"trimmer": {"max_tokens": 5900}}))
        assert "x-ctxproxy-warning" not in raw.headers
        assert user_turns(env.forwarded) <= most(6) + 1, tenant
    status, _, body = await get_json(env.proxy.base_url + "/ctxproxy/policy", KEYS["platform"],
                                     override(type="summarising", params={"keep_turns": 2}))
    policy = json.loads(body)
    assert status == 200 and "warnings" not in policy
    assert policy["context_manager"]["params"]["keep_turns"] == 2
    assert policy["context_manager"]["summarizer"] == "drop"
    assert not env.upstream.summaries and not env.second.summaries


@pytest.mark.parametrize("header,why", [
    ('{"type": "stack"}', "summarising cannot become stack"),
    ('{"type": "summarising", "params": {"keep_turns": 7}}', "keep_turns 7 > 6"),
    ('{"type": "summarising", "params": {"hysteresis_ratio": 0.5}}', "hysteresis_ratio cannot be changed"),
    ('{"type": "summarising", "params": {"working_memory_messages": 500}}', "working_memory_messages 500 > 20"),
    ('{"type": "summarising", "params": {"trimmer": {"reserve_tokens": 0}}}', "only trimmer.max_tokens"),
    ('{"type": "summarising", "params": {"summarizer": {"type": "llm", "params": {"model": "o1-pro"}}}}',
     "the summariser cannot be changed"),
    ('{"type": "sliding-window", "params": {"keep_turns": 9}}', "keep_turns 9 > 6"),
    ('{"type": "summarising", "ref": "plugins.context.stack:Stack"}', "ref plugins cannot be chosen"),
    ("{not json", "not valid JSON"),
    ('{"type": "summarising", "params": {"keep_turns": -1}}', "keep_turns"),
    ("no-such-manager", "unknown context_manager"),
    ('{"type": "summarising", "params": {"keep_recent": 11}}', "keep_recent 11 > 10"),
    ('{"type": "summarising", "params": {"mask_observations": false}}', "mask_observations cannot be turned off"),
    ('{"type": "summarising", "params": {"mask_step": 3}}', "mask_step cannot be changed"),
    ('{"type": "observation-masking", "params": {"keep_recent": 12}}', "keep_recent 12 > 10"),
    ('{"type": "observation-masking", "params": {"working_memory_messages": 21}}', "working_memory_messages 21 > 20"),
])
async def test_loosening_or_malformed_override_is_ignored_with_a_warning(env: Env, header: str, why: str) -> None:
    messages = conversation(24)
    base = await baseline(env, "research", messages)
    raw = await chat(env, "research", messages, headers={"x-ctxproxy-context-manager": header})
    assert raw.status_code == 200
    warning = raw.headers["x-ctxproxy-warning"]
    assert warning.startswith("x-ctxproxy-context-manager ignored") and why in warning, warning
    assert env.forwarded == base
    assert within_cap(env.forwarded, CAPS["research"])


async def test_summarising_tenant_may_switch_to_a_sliding_window_with_its_keep_turns(env: Env) -> None:
    messages = conversation(24)
    before = len(env.second.summaries)
    raw = await chat(env, "research", messages, headers={"x-ctxproxy-context-manager": "sliding-window"})
    assert "x-ctxproxy-warning" not in raw.headers
    assert user_turns(env.forwarded) <= 6 + 1 and within_cap(env.forwarded, CAPS["research"])
    assert len(env.second.summaries) == before  # no summariser call


async def test_summarising_tenant_may_switch_to_observation_masking_and_its_budget_never_rises(env: Env) -> None:
    """Masking forgets only tool outputs, so a tenant on summarising may ask for it per request, but its
    hard budget B and summary threshold T stay the policy's: an override's own ratio or threshold cannot
    raise them."""
    messages = conversation(24)
    url = env.proxy.base_url + "/ctxproxy/explain"
    _, _, base = await post_json(url, {"model": BIG, "messages": messages}, KEYS["research"])
    for header in ("observation-masking", "mask-observations",
                   json.dumps({"type": "observation-masking", "params": {"hysteresis_ratio": 0.0}}),
                   json.dumps({"type": "observation-masking", "params": {"summary_threshold": 30_000,
                                                                         "keep_recent": 4}})):
        status, headers, out = await post_json(url, {"model": BIG, "messages": messages}, KEYS["research"],
                                               {"x-ctxproxy-context-manager": header})
        assert status == 200 and "x-ctxproxy-warning" not in headers, header
        report = out["report"]
        assert report["context_manager"] == "observation-masking"
        assert report["hard_budget"] == base["report"]["hard_budget"] == CAPS["research"]
        assert report["threshold"] <= base["report"]["threshold"]
        assert report["masked"] and report["tokens_after"] <= CAPS["research"]
    before = len(env.second.summaries)
    raw = await chat(env, "research", messages, headers={"x-ctxproxy-context-manager": "observation-masking"})
    assert "x-ctxproxy-warning" not in raw.headers and raw.headers["x-ctxproxy-summary"] == "none"
    assert within_cap(env.forwarded, CAPS["research"]) and pairing_ok(env.forwarded)
    assert any("ctxproxy removed this lookup output" in str(m.get("content")) for m in env.forwarded)
    assert len(env.second.summaries) == before  # no summariser call


async def test_a_sliding_window_tenant_may_not_switch_to_observation_masking(env: Env) -> None:
    """A window keeps fewer turns than masking does: the switch would keep more than the policy allows."""
    messages = conversation(16)
    base = await baseline(env, "support", messages)
    raw = await chat(env, "support", messages, headers={"x-ctxproxy-context-manager": "observation-masking"})
    assert "sliding-window cannot become observation-masking" in raw.headers["x-ctxproxy-warning"]
    assert env.forwarded == base


# --------------------------------------------------------------------------- output limits


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
async def test_max_output_refused_above_the_tenants_limit(env: Env, field: str) -> None:
    async with env.client("support") as c:
        with pytest.raises(openai.BadRequestError) as exc:
            await c.chat.completions.create(model=BIG, messages=conversation(1), **{field: 513})  # type: ignore[call-overload]
    body: Any = exc.value.body
    assert exc.value.status_code == 400 and body["code"] == "max_tokens_exceeded" and body["param"] == field
    assert not env.upstream.chat
    raw = await chat(env, "support", conversation(1), **{field: 512})  # type: ignore[arg-type]
    assert raw.status_code == 200 and env.upstream.chat[-1].body[field] == 512


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
async def test_max_output_clamped_to_the_tenants_limit(env: Env, field: str) -> None:
    raw = await chat(env, "platform", conversation(1), **{field: 5000})  # type: ignore[arg-type]
    assert raw.status_code == 200
    sent = env.upstream.chat[-1].body
    assert sent[field] == 1000
    other = "max_tokens" if field == "max_completion_tokens" else "max_completion_tokens"
    assert other not in sent
    raw = await chat(env, "platform", conversation(1), **{field: 999})  # type: ignore[arg-type]
    assert env.upstream.chat[-1].body[field] == 999
    raw = await chat(env, "research", conversation(1), **{field: 5000})  # type: ignore[arg-type]  # no limit for research
    assert env.upstream.chat[-1].body[field] == 5000


async def test_clamped_request_is_streamed_with_the_clamp(env: Env) -> None:
    async with env.client("platform") as c:
        stream = await c.chat.completions.create(model=MINI, messages=conversation(1), stream=True,  # type: ignore[arg-type]
                                                 max_completion_tokens=4096)
        text = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
    assert text == REPLY
    assert env.second.chat[-1].body["max_completion_tokens"] == 1000
    assert env.second.chat[-1].body["model"] == MINI_UPSTREAM


# --------------------------------------------------------------------------- model routes


async def test_model_routes_map_names_to_upstream_and_upstream_model(env: Env) -> None:
    messages = conversation(1)
    raw = await chat(env, "platform", messages, model=BIG)
    assert raw.parse().choices[0].message.content == REPLY
    assert [r.body["model"] for r in env.upstream.chat] == [BIG_UPSTREAM]
    await chat(env, "platform", messages, model=MINI)
    assert [r.body["model"] for r in env.second.chat] == [MINI_UPSTREAM]
    assert len(env.upstream.chat) == 1
    # only the model name was changed
    assert env.second.chat[-1].body["messages"] == messages


async def test_unknown_model_gets_limits_from_litellms_model_map(env: Env) -> None:
    status, _, out = await post_json(env.proxy.base_url + "/ctxproxy/explain",
                                     {"model": "gpt-4o", "messages": conversation(1)}, KEYS["research"])
    assert status == 200
    assert out["report"]["window"] == 128000
    assert out["report"]["hard_budget"] == CAPS["research"]  # the tenant cap is below the model's budget


async def test_allow_unknown_models_false_answers_404(upstream: FakeUpstream, second: FakeUpstream,
                                                       start_proxy: Any) -> None:
    proxy = await start_proxy(policy_config(upstream.base_url, second.base_url, allow_unknown_models=False))
    env = Env(proxy, upstream, second)
    for model in ("gpt-4o", "acme-big-2024-06"):  # an unrouted name, and an upstream name is not a client name
        async with env.client("research") as c:
            with pytest.raises(openai.NotFoundError) as exc:
                await c.chat.completions.create(model=model, messages=conversation(1))  # type: ignore[arg-type]
        assert exc.value.body["code"] == "model_not_found"  # type: ignore[index]
    assert not upstream.chat
    raw = await chat(env, "research", conversation(1), model=BIG)
    assert raw.status_code == 200
    async with env.client("research") as c:
        listed = sorted([m.id async for m in c.models.list()])
    assert listed == [BIG, MINI]  # configured routes only, not the upstream's list


async def test_tenant_listing_an_unrouted_model_is_a_config_error(upstream: FakeUpstream) -> None:
    from proxy.core.errors import ConfigError

    cfg = policy_config(upstream.base_url, upstream.base_url, allow_unknown_models=False)
    cfg["tenants"][1]["models"] = [BIG, "gpt-4o"]
    with pytest.raises(ConfigError) as exc:
        load_config(cfg, env={})
    assert any(p.startswith("tenants[1].models") for p in exc.value.problems)


# --------------------------------------------------------------------------- visibility


@pytest.mark.parametrize("tenant", ["research", "support", "platform"])
async def test_policy_endpoint_shows_only_the_callers_policy(env: Env, tenant: str) -> None:
    status, _, raw = await get_json(env.proxy.base_url + "/ctxproxy/policy", KEYS[tenant])
    assert status == 200
    policy = json.loads(raw)
    expected = {t["name"]: t for t in tenants()}[tenant]
    assert policy["tenant"] == tenant
    assert policy["max_context_tokens"] == CAPS[tenant]
    assert policy["models"] == expected.get("models")
    assert policy["context_manager"]["type"] == expected["context_manager"]["type"]
    assert policy["context_manager"]["params"]["keep_turns"] == 6
    assert policy["max_output_tokens"] == expected.get("max_output_tokens")
    text = raw.decode()
    for secret in SECRETS:
        assert secret not in text
    assert "sha256" not in text and "keys" not in policy
    for other in KEYS:
        if other != tenant:
            assert other not in text


async def test_policy_endpoint_shows_an_applied_override_and_why_one_was_ignored(env: Env) -> None:
    url = env.proxy.base_url + "/ctxproxy/policy"
    _, _, raw = await get_json(url, KEYS["support"], override(type="sliding-window", params={"keep_turns": 2}))
    assert json.loads(raw)["context_manager"]["params"]["keep_turns"] == 2
    _, _, raw = await get_json(url, KEYS["support"], override(type="sliding-window", params={"keep_turns": 60}))
    policy = json.loads(raw)
    assert policy["context_manager"]["params"]["keep_turns"] == 6
    assert "keep_turns 60 > 6" in policy["warnings"][0]


@pytest.mark.parametrize("tenant,expected", [
    ("support", [BIG]),
    ("platform", [BIG, MINI]),
    ("research", [BIG, MINI, "upstream-model"]),  # no list: configured routes + the upstream's models
])
async def test_models_endpoint_lists_only_the_tenants_models(env: Env, tenant: str, expected: list[str]) -> None:
    async with env.client(tenant) as c:
        listed = [m.id async for m in c.models.list()]
    assert sorted(listed) == sorted(expected)


async def test_without_tenants_the_proxy_runs_open_with_the_top_level_policy(
    upstream: FakeUpstream, second: FakeUpstream, start_proxy: Any
) -> None:
    cfg = policy_config(upstream.base_url, second.base_url, tenants=[],
                        context_manager={"type": "sliding-window", "params": {"keep_turns": 4}})
    proxy = await start_proxy(cfg)
    status, _, raw = await get_json(proxy.base_url + "/ctxproxy/policy", None)
    policy = json.loads(raw)
    assert status == 200 and policy["tenant"] == "default" and policy["max_context_tokens"] is None
    assert policy["context_manager"] == {"type": "sliding-window", "params": {"keep_turns": 4}}
    env = Env(proxy, upstream, second)
    raw_resp = await chat(env, "any-key-at-all", conversation(10), model=MINI)
    assert raw_resp.status_code == 200  # any key: no authentication without tenants
    assert second.chat[-1].body["messages"] == conversation(10)  # under the threshold: untouched
    raw_resp = await chat(env, "any-key-at-all", conversation(70), model=MINI)  # 32000-token window
    assert user_turns(second.chat[-1].body["messages"]) <= 4 + 1


# --------------------------------------------------------------------------- the example config


EXAMPLE = ROOT / "config" / "two-tenants.yaml"


def test_example_config_validates_with_an_empty_environment() -> None:
    config = load_config(EXAMPLE, env={})
    assert [t.name for t in config.tenants] == ["research", "support"]
    assert config.admin_keys
    bare = {k: v for k, v in os.environ.items() if k in ("PATH", "SYSTEMROOT")}
    out = subprocess.run([sys.executable, "-m", "proxy.cli", "validate", str(EXAMPLE)], cwd=ROOT, env=bare,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


async def test_example_config_behaves_as_documented(upstream: FakeUpstream, start_proxy: Any,
                                                    tmp_path: Path) -> None:
    config = load_config(EXAMPLE, env={"OPENAI_BASE_URL": upstream.base_url, "OPENAI_API_KEY": "sk-up",
                                       "CTXPROXY_CACHE_DIR": str(tmp_path / "cache")})
    proxy = await start_proxy(config)
    env = Env(proxy, upstream, upstream)
    research, support, bot = "dev-research-key-change-me", "dev-support-key-change-me", "dev-support-bot-key-change-me"
    raw = await chat(env, research, conversation(2), model="gpt-4o", max_tokens=20000)
    assert upstream.chat[-1].body["model"] == "gpt-4o-2024-08-06"
    assert upstream.chat[-1].body["max_tokens"] == 8192
    for key in (support, bot):
        raw = await chat(env, key, conversation(40), model="gpt-4o-mini")
        assert raw.status_code == 200 and within_cap(env.forwarded, 8000)
        assert upstream.chat[-1].body["model"] == "gpt-4o-mini-2024-07-18"
    async with env.client(support) as c:
        with pytest.raises(openai.NotFoundError):
            await c.chat.completions.create(model="gpt-4o", messages=conversation(1))  # type: ignore[arg-type]
        with pytest.raises(openai.BadRequestError):
            await c.chat.completions.create(model="gpt-4o-mini", messages=conversation(1), max_tokens=2048)
    async with env.client(research) as c:
        with pytest.raises(openai.NotFoundError):
            await c.chat.completions.create(model="gpt-3.5-turbo", messages=conversation(1))  # type: ignore[arg-type]


async def test_output_cap_applies_to_every_field_and_when_none_is_sent(upstream, start_proxy):
    """Both output fields are clamped; with neither, the tenant's cap is added (max_completion_tokens for o-series)."""
    import aiohttp

    cfg = {
        "upstreams": {"fake": {"base_url": upstream.base_url, "api_key": "sk-up"}},
        "models": [{"name": "gpt-4o-mini", "context_window": 32000}, {"name": "o3-mini", "context_window": 32000}],
        "cache": {"backend": "memory"},
        "tenants": [{"name": "t", "keys": ["k-out"], "max_output_tokens": 100}],
    }
    proxy = await start_proxy(cfg)
    msgs = [{"role": "user", "content": "hi"}]
    async with aiohttp.ClientSession(headers={"Authorization": "Bearer k-out"}) as s:
        for extra, model, want in (
            ({"max_tokens": 5000, "max_completion_tokens": 50}, "gpt-4o-mini", {"max_tokens": 100, "max_completion_tokens": 50}),
            ({}, "gpt-4o-mini", {"max_tokens": 100}),
            ({}, "o3-mini", {"max_completion_tokens": 100}),
        ):
            async with s.post(proxy.url + "/v1/chat/completions", json={"model": model, "messages": msgs, **extra}) as r:
                assert r.status == 200
            sent = upstream.chat[-1].body
            assert {k: sent[k] for k in ("max_tokens", "max_completion_tokens") if k in sent} == want


# --------------------------------------------------------------------------- one proxy for every agent

DEFAULT_CONFIG = ROOT / "config" / "ctxproxy.yaml"


def default_config(openai_up: FakeUpstream, anthropic_up: FakeUpstream, tmp_path: Path, **keys: str) -> Any:
    """The shipped config/ctxproxy.yaml, its two upstreams pointed at the fakes, with only the given keys set."""
    return load_config(DEFAULT_CONFIG, env={"OPENAI_BASE_URL": openai_up.base_url,
                                            "ANTHROPIC_UPSTREAM_URL": anthropic_up.url,
                                            "CTXPROXY_CACHE_DIR": str(tmp_path / "cache"), **keys})


def test_the_default_config_validates_with_neither_key_set() -> None:
    """``make run`` on a fresh machine: the config loads with an empty environment, both upstreams open."""
    config = load_config(DEFAULT_CONFIG, env={})
    assert config.default_upstream == "openai" and not config.tenants
    assert all(config.forwards_client_auth(u) for u in config.settings.upstreams.values())
    bare = {k: v for k, v in os.environ.items() if k in ("PATH", "SYSTEMROOT")}
    out = subprocess.run([sys.executable, "-m", "proxy.cli", "validate", str(DEFAULT_CONFIG)], cwd=ROOT, env=bare,
                         capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout.strip()) == (0, "ok"), out.stderr


async def test_claude_models_go_to_anthropic_and_every_other_model_to_openai(
        upstream: FakeUpstream, second: FakeUpstream, start_proxy: Any, tmp_path: Path) -> None:
    """One proxy serves Codex (Responses), Claude Code (Messages) and Chat Completions clients at once: the
    model picks the upstream (claude-* by pattern, everything else the default), and with no key configured
    each client's own key goes to its own provider, in that provider's header."""
    proxy = await start_proxy(default_config(upstream, second, tmp_path))
    user = [{"role": "user", "content": "Hello"}]
    openai_key, anthropic_key = {"Authorization": "Bearer sk-openai-client"}, {"x-api-key": "sk-ant-client"}
    async with aiohttp.ClientSession() as s:
        async def post(path: str, body: dict[str, Any], headers: dict[str, str]) -> int:
            async with s.post(proxy.url + path, json=body, headers=headers) as r:
                await r.read()
                return r.status

        assert await post("/v1/chat/completions", {"model": "gpt-4o-mini", "messages": user}, openai_key) == 200
        assert await post("/v1/responses", {"model": "gpt-5-codex", "input": "Hello", "stream": True},
                          openai_key) == 200
        for stream in (False, True):
            assert await post("/v1/messages", {"model": "claude-sonnet-4-5", "max_tokens": 64, "messages": user,
                                               "stream": stream}, anthropic_key) == 200
        assert await post("/v1/messages/count_tokens", {"model": "claude-haiku-4-5", "messages": user},
                          anthropic_key) == 200
        assert await post("/v1/chat/completions", {"model": "claude-haiku-4-5", "messages": user},
                          {"Authorization": "Bearer sk-ant-client"}) == 200

    assert [r.body["model"] for r in upstream.chat] == ["gpt-4o-mini"]
    assert [r.body["model"] for r in upstream.responses] == ["gpt-5-codex"]
    assert not upstream.messages and not upstream.counts
    assert all(r.headers["Authorization"] == "Bearer sk-openai-client" for r in [*upstream.chat, *upstream.responses])
    assert [r.body["model"] for r in second.messages] == ["claude-sonnet-4-5", "claude-sonnet-4-5"]
    assert all(r.headers["x-api-key"] == "sk-ant-client" and "Authorization" not in r.headers for r in second.messages)
    assert [r.body["model"] for r in second.counts] == ["claude-haiku-4-5"]
    # a Chat Completions client asking for Claude reaches Anthropic's OpenAI-compatible endpoint, with a bearer key
    assert [(r.path, r.body["model"]) for r in second.chat] == [("/v1/chat/completions", "claude-haiku-4-5")]
    assert second.chat[0].headers["Authorization"] == "Bearer sk-ant-client"


async def test_with_both_keys_set_each_provider_gets_its_own_and_never_the_clients(
        upstream: FakeUpstream, second: FakeUpstream, start_proxy: Any, tmp_path: Path) -> None:
    proxy = await start_proxy(default_config(upstream, second, tmp_path, OPENAI_API_KEY="sk-op-configured",
                                             ANTHROPIC_API_KEY="sk-an-configured"))
    user = [{"role": "user", "content": "Hello"}]
    async with aiohttp.ClientSession() as s:
        async with s.post(proxy.base_url + "/chat/completions", json={"model": "o3", "messages": user},
                          headers={"Authorization": "Bearer sk-client"}) as r:
            assert r.status == 200
        async with s.post(proxy.base_url + "/messages", json={"model": "claude-opus-4-1", "max_tokens": 8,
                                                              "messages": user}, headers={"x-api-key": "sk-client"}) as r:
            assert r.status == 200
    assert upstream.chat[-1].headers["Authorization"] == "Bearer sk-op-configured"
    assert second.messages[-1].headers["x-api-key"] == "sk-an-configured"
    assert not second.chat and not upstream.messages


async def test_a_route_names_its_upstream_and_a_pattern_matches_the_model_sent_upstream(
        upstream: FakeUpstream, second: FakeUpstream, start_proxy: Any) -> None:
    """An explicit ``models[].upstream`` wins over any pattern; an alias without one goes where its upstream
    model name matches; a name that only looks like a pattern's (case differs) goes to the default."""
    proxy = await start_proxy({
        "upstreams": {"main": {"base_url": upstream.base_url},
                      "side": {"base_url": second.base_url, "models": ["acme-*", "exact-model"]}},
        "models": [{"name": "acme-pinned", "upstream": "main"}, {"name": "fast", "model": "acme-fast-2"}],
        "cache": {"backend": "memory"},
    })
    async with aiohttp.ClientSession() as s:
        for model in ("acme-pinned", "fast", "acme-x", "exact-model", "ACME-x", "exact-model-2", "gpt-4o"):
            async with s.post(proxy.base_url + "/chat/completions", headers={"Authorization": "Bearer sk-c"},
                              json={"model": model, "messages": [{"role": "user", "content": "hi"}]}) as r:
                assert r.status == 200, await r.text()
    assert [r.body["model"] for r in upstream.chat] == ["acme-pinned", "ACME-x", "exact-model-2", "gpt-4o"]
    assert [r.body["model"] for r in second.chat] == ["acme-fast-2", "acme-x", "exact-model"]


@pytest.mark.parametrize("top", ["observe", "enforce", None])
async def test_the_mode_is_the_tenants_else_the_routes_else_the_top_levels(
        upstream: FakeUpstream, start_proxy: Any, top: str | None) -> None:
    """A tenant's own mode wins on every model; a route's applies to the tenants that set none; the top level's
    to the rest (enforce when it sets none). The policy endpoint and each answer's header say the same."""
    modes = {"observe": "observe", "enforce": "enforce", "unset": None}
    cfg: dict[str, Any] = {
        "upstreams": {"u": {"base_url": upstream.base_url, "api_key": UPSTREAM_KEY}},
        "cache": {"backend": "memory"},
        "models": [{"name": f"route-{r}", **({"mode": m} if m else {})} for r, m in modes.items()],
        "tenants": [{"name": f"team-{t}", "keys": [f"sk-team-{t}"], **({"mode": m} if m else {})}
                    for t, m in modes.items()],
    }
    if top is not None:
        cfg["mode"] = top
    proxy = await start_proxy(cfg)
    async with aiohttp.ClientSession() as s:
        for tenant, tenant_mode in modes.items():
            for route, route_mode in modes.items():
                want = tenant_mode or route_mode or top or "enforce"
                key = {"Authorization": f"Bearer sk-team-{tenant}"}
                async with s.get(proxy.url + f"/v1/ctxproxy/policy?model=route-{route}", headers=key) as r:
                    assert (await r.json())["mode"] == want, (tenant, route)
                async with s.post(proxy.url + "/v1/chat/completions", headers=key, json={
                        "model": f"route-{route}", "messages": [{"role": "user", "content": "hi"}]}) as r:
                    assert r.status == 200 and r.headers["x-ctxproxy-mode"] == want, (tenant, route)
