"""Observability end to end: /metrics after real runs, explain vs ``ctxproxy assemble``, request logs, no leaks.

Everything goes through the proxy on the wire against the fake upstream; the
canaries below are sent as a tenant key, as the upstream key and as prompt
text, and must never come back in /metrics, in any log record, in an error
body or in an explain report.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from multidict import CIMultiDict
from prometheus_client.parser import text_string_to_metric_families

from proxy.core.modelinfo import ModelMap
from tests.conftest import base_config
from tests.fake_upstream import FakeUpstream
from tests.test_summarisation import conversation

MODEL = "gpt-4o-mini"  # configured with a small window so it summarises, and priced in litellm's map
WINDOW = 8000
TENANT_KEY = "sk-SECRET-canary-123"
UPSTREAM_KEY = "sk-UPSTREAM-canary-456"
ADMIN_KEY = "sk-admin-observability"
PROMPT = "PROMPT-canary-789"
CANARIES = (TENANT_KEY, UPSTREAM_KEY, PROMPT)
VENV_BIN = Path(sys.executable).parent

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def model_map() -> ModelMap:
    mm = ModelMap()
    if not mm.input_price(MODEL):
        pytest.skip("litellm's model map is not installed")
    return mm


def priced_config(upstream_url: str, **extra: Any) -> dict[str, Any]:
    cfg = base_config(
        upstream_url,
        upstreams={"fake": {"base_url": upstream_url, "api_key": UPSTREAM_KEY}},
        models=[{"name": MODEL, "context_window": WINDOW, "max_output_tokens": 1000}],
        summarizer_model=MODEL,
        context_manager={"type": "summarising", "params": {"keep_turns": 4}},
        summarizer={"retry_backoff_seconds": 0, "timeout_seconds": 5, "max_summary_tokens": 300},
        admin={"keys": [ADMIN_KEY]},  # /metrics needs it when tenants are configured
    )
    cfg.update(extra)
    return cfg


def with_prompt_canary(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with the prompt canary in an early (summarised) turn and in the current turn."""
    out = [dict(m) for m in messages]
    out[1]["content"] = f"{out[1]['content']} {PROMPT}"
    out[-1]["content"] = f"{out[-1]['content']} {PROMPT}"
    return out


def orphan_messages() -> list[dict[str, Any]]:
    """A short payload with one tool result whose call does not exist (repaired: orphan_result)."""
    return [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": f"What did the tool say? {PROMPT}"},
        {"role": "tool", "tool_call_id": "call_nowhere", "content": f"orphan output {PROMPT}"},
        {"role": "user", "content": "Answer now."},
    ]


def invalid_messages() -> list[dict[str, Any]]:
    return [{"role": "wizard", "content": f"cast a spell {PROMPT}"}]


async def call(
    session: aiohttp.ClientSession, url: str, body: Any, *, key: str | None = TENANT_KEY,
    rid: str | None = None, path: str = "/v1/chat/completions",
) -> tuple[int, CIMultiDict[str], bytes]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    if rid is not None:
        headers["x-request-id"] = rid
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with session.post(url + path, data=data, headers=headers) as r:
        return r.status, CIMultiDict(r.headers), await r.read()


async def scrape(session: aiohttp.ClientSession, url: str) -> tuple[str, Samples]:
    async with session.get(url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = await r.text()
    samples = {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    return text, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum over every series of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def assert_no_canary(text: str, where: str) -> None:
    for canary in CANARIES:
        assert canary not in text, f"{canary!r} leaked into {where}"


# --- 1. /metrics after a summarising run -------------------------------------------------------------


async def test_metrics_after_a_summarising_run(upstream: FakeUpstream, start_proxy: Any, model_map: ModelMap) -> None:
    tenants = [{"name": "acme", "keys": [TENANT_KEY]}]
    proxy = await start_proxy(priced_config(upstream.base_url, tenants=tenants))
    summaries: list[str] = []
    async with aiohttp.ClientSession() as s:
        for _ in range(2):
            status, headers, _ = await call(s, proxy.url, {"model": MODEL, "messages": conversation(40)})
            assert status == 200
            summaries.append(headers["x-ctxproxy-summary"])
        calls = len(upstream.summaries)
        status, headers, _ = await call(s, proxy.url, {"model": MODEL, "messages": orphan_messages()})
        assert (status, headers["x-ctxproxy-repairs"]) == (200, "1")
        status, _, _ = await call(s, proxy.url, {"model": "zz-unknown-model-7", "messages": orphan_messages()[:2]})
        assert status == 200
        status, _, raw = await call(s, proxy.url, {"model": MODEL, "messages": orphan_messages()[:2], "stream": True,
                                                   "stream_options": {"include_usage": True}})
        assert status == 200 and raw.rstrip().endswith(b"data: [DONE]")
        status, _, body = await call(s, proxy.url, {"model": MODEL, "messages": invalid_messages()})
        assert status == 400 and json.loads(body)["error"]["code"] == "invalid_role"
        status, _, _ = await call(s, proxy.url, {"model": MODEL, "messages": orphan_messages()},
                                  key=TENANT_KEY + "-wrong")
        assert status == 401
        text, m = await scrape(s, proxy.url)

    assert summaries == ["waited", "reused"]
    assert calls >= 1 and len(upstream.summaries) == calls  # the 8k summariser window may fold in chunks
    t = {"tenant": "acme", "model": MODEL}

    # cost of the summariser calls (fake usage 1000/100 per call) and savings from what was removed
    cost = value(m, "ctxproxy_summarizer_cost_usd_total", **t)
    assert cost > 0
    assert cost == pytest.approx(model_map.cost(MODEL, 1000 * calls, 100 * calls))
    assert value(m, "ctxproxy_summarizer_tokens_total", **t, kind="prompt") == 1000 * calls
    assert value(m, "ctxproxy_summarizer_tokens_total", **t, kind="completion") == 100 * calls
    removed = total(m, "ctxproxy_tokens_removed_total", **t)
    summarised = value(m, "ctxproxy_tokens_removed_total", **t, mode="enforce", how="summarised")
    assert summarised > 0
    savings = value(m, "ctxproxy_estimated_savings_usd_total", **t, mode="enforce")
    assert savings > 0
    assert savings == pytest.approx(removed * (model_map.input_price(MODEL) or 0))

    # requests, tokens, summaries
    assert value(m, "ctxproxy_requests_total", **t, wire="chat", status="200") == 4
    assert value(m, "ctxproxy_requests_total", **t, wire="chat", status="400") == 1
    assert value(m, "ctxproxy_requests_total", tenant="other", model="other", wire="chat", status="401") == 1
    received = value(m, "ctxproxy_tokens_received_total", **t, mode="enforce")
    forwarded = value(m, "ctxproxy_tokens_forwarded_total", **t, mode="enforce")
    assert received > forwarded > 0
    assert received - forwarded == pytest.approx(removed, abs=removed * 0.2)  # the summary message adds a little
    assert value(m, "ctxproxy_summaries_total", tenant="acme", result="created") == 1
    assert value(m, "ctxproxy_summaries_total", tenant="acme", result="reused") == 1
    assert value(m, "ctxproxy_summaries_total", tenant="acme", result="failed") == 0

    # provider cache, repairs, payload errors
    assert value(m, "ctxproxy_provider_cached_tokens_total", **t) == 4 * 4  # the stream's usage chunk too
    assert value(m, "ctxproxy_provider_cached_tokens_total", tenant="acme", model="other") == 4
    assert value(m, "ctxproxy_repairs_total", kind="orphan_result") == 1
    assert value(m, "ctxproxy_payload_errors_total", code="invalid_role") == 1
    assert total(m, "ctxproxy_payload_errors_total") == 1

    # histograms: overhead for every assembled request; upstream and TTFT for every forwarded one
    assert value(m, "ctxproxy_overhead_seconds_count") == 5
    assert value(m, "ctxproxy_overhead_seconds_sum") > 0
    assert value(m, "ctxproxy_upstream_seconds_count", **t) == 4
    assert value(m, "ctxproxy_upstream_ttft_seconds_count", **t) == 4
    assert value(m, "ctxproxy_upstream_seconds_count", tenant="acme", model="other") == 1

    # labels: the unknown model is "other", and no key or prompt text is anywhere in the exposition
    assert value(m, "ctxproxy_requests_total", tenant="acme", model="other", wire="chat", status="200") == 1
    assert "zz-unknown-model-7" not in text
    models = {dict(ls).get("model") for (_, ls) in m} - {None}
    assert models == {MODEL, "other"}
    assert {dict(ls).get("tenant") for (_, ls) in m} - {None} == {"acme", "other"}
    assert_no_canary(text, "/metrics")


# --- 2. explain == ctxproxy assemble -----------------------------------------------------------------


async def run_cli(*args: str, timeout: float = 60) -> tuple[int, bytes, bytes]:
    """``ctxproxy ...`` as a subprocess without blocking the loop the fake upstream runs on."""
    exe = VENV_BIN / "ctxproxy"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "proxy.cli"]
    proc = await asyncio.create_subprocess_exec(
        *cmd, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=dict(os.environ))
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return proc.returncode, out, err


@pytest.mark.parametrize("summarizer", ["llm", "drop"])
async def test_explain_matches_assemble_cli_and_forwards_nothing(
    upstream: FakeUpstream, start_proxy: Any, tmp_path: Path, summarizer: str,
) -> None:
    from proxy.settings import load_config

    cfg = priced_config(upstream.base_url, context_manager={
        "type": "summarising", "params": {"keep_turns": 4, "summarizer": summarizer}})
    assert cfg["cache"] == {"backend": "memory"}  # both sides start empty
    config_file = tmp_path / "ctxproxy.yaml"
    config_file.write_text(yaml.safe_dump(cfg))
    body = {"model": MODEL, "messages": with_prompt_canary(conversation(40)), "max_tokens": 500}
    body_file = tmp_path / "body.json"
    body_file.write_bytes(json.dumps(body).encode())

    proxy = await start_proxy(load_config(str(config_file)))
    async with aiohttp.ClientSession() as s:
        status, _, raw = await call(s, proxy.url, body_file.read_bytes(), path="/v1/ctxproxy/explain")
        assert status == 200, raw
        explained = json.loads(raw)
        via_proxy = len(upstream.summaries)
        _, m = await scrape(s, proxy.url)

    code, out, err = await run_cli("assemble", "--config", str(config_file), str(body_file))
    assert code == 0, err.decode()
    assembled = json.loads(out)
    via_cli = len(upstream.summaries) - via_proxy

    assert set(explained) == {"messages", "report"}
    assert explained["messages"] == assembled["messages"]
    assert explained["report"] == assembled["report"]
    report = explained["report"]
    assert report["tokens_before"] > report["tokens_after"]
    # explain and assemble never bill anyone: what a summary would replace is reported, not made
    assert report["summary"] == ("would_create" if summarizer == "llm" else "none")
    assert report["max_tokens_clamped"] is False and report["reserve"] == 500  # the body's max_tokens was used
    # older tool outputs are masked first; masking is not enough for 40 turns, so turns go too
    assert report["masked"] and report["removed"]["masked"] == sum(m["tokens_removed"] for m in report["masked"])
    if summarizer == "llm":
        assert set(report["removed"]) == {"masked", "summarised"} and report["turns_summarised"] > 0
    else:
        assert set(report["removed"]) == {"masked", "windowed"} and report["turns_dropped"] > 0

    if summarizer == "llm":
        detail = report["summary_detail"]
        assert detail["turns"] == report["turns_summarised"] and detail["cached"] is False
        assert detail["tokens_replaced"] > 0
    # never forwarded and nobody billed: the upstream saw nothing at all
    assert upstream.chat == [] and upstream.summaries == [] and via_proxy == via_cli == 0
    assert total(m, "ctxproxy_summarizer_tokens_total") == 0
    # explain is not a chat completion: it neither counts as one nor as a forwarded request
    assert total(m, "ctxproxy_requests_total") == 0
    assert total(m, "ctxproxy_upstream_seconds_count") == 0
    # the prompt is legitimately in the messages, never in the report
    assert PROMPT in json.dumps(explained["messages"])
    assert_no_canary(json.dumps(report), "the explain report")


# --- 3. request logs and no leaks anywhere -----------------------------------------------------------


def record_text(record: logging.LogRecord) -> str:
    parts = [record.getMessage(), repr(record.args), str(record.msg)]
    if record.exc_info:
        parts.append("".join(traceback.format_exception(*record.exc_info)))
    if record.exc_text:
        parts.append(record.exc_text)
    if record.stack_info:
        parts.append(record.stack_info)
    parts.append(repr({k: v for k, v in vars(record).items() if k not in ("args", "msg", "exc_info")}))
    return "\n".join(parts)


async def test_request_logs_and_no_canary_anywhere(
    upstream: FakeUpstream, start_proxy: Any, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)  # every logger, every level
    tenants = [{"name": "acme", "keys": [TENANT_KEY], "models": [MODEL]}]
    proxy = await start_proxy(priced_config(upstream.base_url, tenants=tenants))
    long = with_prompt_canary(conversation(40))
    bodies: dict[str, bytes] = {}
    statuses: dict[str, int] = {}

    async def chat(rid: str, body: Any, **kw: Any) -> tuple[int, CIMultiDict[str], bytes]:
        status, headers, raw = await call(s, proxy.url, body, rid=rid, **kw)
        statuses[rid], bodies[rid] = status, raw
        assert headers.get("x-request-id") == rid
        return status, headers, raw

    async with aiohttp.ClientSession() as s:
        assert (await chat("obs-summarised", {"model": MODEL, "messages": long}))[0] == 200
        assert (await chat("obs-stream", {"model": MODEL, "messages": long, "stream": True,
                                          "stream_options": {"include_usage": True}}))[0] == 200
        assert (await chat("obs-repaired", {"model": MODEL, "messages": orphan_messages()}))[0] == 200
        assert (await chat("obs-wrong-key", {"model": MODEL, "messages": long}, key=TENANT_KEY + "x"))[0] == 401
        assert (await chat("obs-no-key", {"model": MODEL, "messages": long}, key=None))[0] == 401
        assert (await chat("obs-invalid", {"model": MODEL, "messages": invalid_messages()}))[0] == 400
        bad_json = b'{"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "' + PROMPT.encode() + b'"'
        assert (await chat("obs-bad-json", bad_json))[0] == 400
        assert (await chat("obs-not-allowed", {"model": "gpt-4o", "messages": long}))[0] == 404
        upstream.mode = "status"
        assert (await chat("obs-upstream-500", {"model": MODEL, "messages": long}))[0] == 500
        upstream.mode = "ok"
        status, _, raw = await call(s, proxy.url, {"model": MODEL, "messages": long}, rid="obs-explain",
                                    path="/v1/ctxproxy/explain")
        assert status == 200
        explained = json.loads(raw)
        status, _, raw_401 = await call(s, proxy.url, {"model": MODEL, "messages": long}, key=TENANT_KEY + "x",
                                        path="/v1/ctxproxy/explain")
        assert status == 401
        bodies["explain-401"] = raw_401
        async with s.get(proxy.url + "/no/such/path", headers={"Authorization": f"Bearer {TENANT_KEY}"}) as r:
            assert r.status == 404
            bodies["path-404"] = await r.read()
        metrics_text, _ = await scrape(s, proxy.url)

    # the canaries really were sent: the prompt reached the upstream, and the upstream key was used
    assert any(PROMPT in rec.raw.decode() for rec in upstream.chat)
    assert any(rec.headers.get("Authorization") == f"Bearer {UPSTREAM_KEY}" for rec in upstream.chat)
    assert PROMPT in json.dumps(explained["messages"])

    # one JSON line per chat-completions request on ctxproxy.requests
    lines: dict[str, list[dict[str, Any]]] = {}
    for record in caplog.records:
        if record.name == "ctxproxy.requests":
            assert record.levelno == logging.INFO
            message = record.getMessage()
            assert "\n" not in message
            fields = json.loads(message)
            lines.setdefault(fields["request_id"], []).append(fields)
    assert set(statuses) <= set(lines), f"no log line for {set(statuses) - set(lines)}"
    for rid, status in statuses.items():
        assert len(lines[rid]) == 1, rid
        assert lines[rid][0]["status"] == status, rid
        assert lines[rid][0]["event"] == "request"

    ok = lines["obs-summarised"][0]
    assert ok["tenant"] == "acme" and ok["model"] == MODEL
    assert ok["tokens_in"] > ok["tokens_out"] > 0
    assert ok["removed"].get("summarised", 0) > 0
    assert ok["summary"] == "created"
    assert ok["repairs"] == {}
    assert ok["overhead_ms"] >= 0 and ok["upstream_ms"] > 0
    assert ok["usage"]["prompt_tokens"] == 10
    stream = lines["obs-stream"][0]
    assert stream["summary"] == "reused" and stream["ttft_ms"] > 0 and stream["upstream_ms"] >= stream["ttft_ms"]
    assert stream["usage"]["prompt_tokens"] == 10
    assert lines["obs-repaired"][0]["repairs"] == {"orphan_result": 1}
    for rid in ("obs-wrong-key", "obs-no-key"):
        assert lines[rid][0]["error"] == "invalid_api_key"
        assert "tokens_in" not in lines[rid][0] and "upstream_ms" not in lines[rid][0]
    assert lines["obs-invalid"][0]["error"] == "invalid_role"
    assert lines["obs-bad-json"][0]["error"] == "invalid_json"
    assert lines["obs-not-allowed"][0]["error"] == "model_not_found"
    failed = lines["obs-upstream-500"][0]
    assert failed["tenant"] == "acme" and failed["summary"] == "reused"
    assert failed["upstream_ms"] > 0 and "overhead_ms" in failed

    # no canary in any log record of any logger, in /metrics, in error bodies, in the explain report
    assert caplog.records
    for record in caplog.records:
        assert_no_canary(record_text(record), f"log record {record.name}: {record.getMessage()[:200]}")
    assert_no_canary(caplog.text, "the formatted log output")
    assert_no_canary(metrics_text, "/metrics")
    for rid, raw in bodies.items():
        if statuses.get(rid, 400) >= 400:
            assert_no_canary(raw.decode(), f"the error body of {rid}")
    assert_no_canary(json.dumps(explained["report"]), "the explain report")
