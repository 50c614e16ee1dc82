"""ctxproxy in front of a real LLM server, whose tokenizer and request-id rules are not ours:
llama-cpp-python's OpenAI-compatible server
with SmolLM2-135M-Instruct, a 4,096-token route, a 30-turn conversation through the official openai client.

The run itself is ``bench/real_server.py`` (also a script that writes ``bench/results/real-server.*``); it
runs once per module and each test below checks one promise on its figures. Needs the cached venv that
``make llama-venv`` builds (llama-cpp-python from source, once per machine); skips without it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from bench import real_server
from tests.check._support import RESULTS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]



@pytest.fixture(scope="module")
def run() -> dict[str, Any]:
    found = real_server.find_llama()
    if isinstance(found, str):
        pytest.skip(found)
    figures = asyncio.run(real_server.run(*found))
    RESULTS.mkdir(parents=True, exist_ok=True)
    real_server.write_results(figures, RESULTS / "real-server")  # .json and .md, as the script writes them
    return figures


def test_stream_framing_usage_and_finish_reasons_same_as_a_direct_request(run: dict[str, Any]) -> None:
    f = run["framing"]
    assert (f["direct_status"], f["proxied_status"]) == (200, 200)
    assert f["proxied_content_type"] == f["direct_content_type"]
    assert f["same_framing"], f"the proxied stream's events are shaped differently: {f['framing_pattern']}"
    assert f["ends_with_done"] and f["blank_line_separated"]
    assert f["proxied_usage_chunk"] == f["usage_chunk"]
    assert len(f["finish_reasons"]) == 1


def test_answers_relayed_intact(run: dict[str, Any]) -> None:
    """Turns re-sent straight to the server with the messages ctxproxy forwarded (its explain endpoint):
    the same finish reasons and usage, streaming and not, before and after the summary threshold. (The
    text itself may differ: llama.cpp's greedy decoding is not bit-identical between a fresh and a cached
    prompt evaluation; the count of same texts is in the figures.)"""
    assert len(run["compared"]) == len(real_server.COMPARE_TURNS), run["compared"]
    compared = [c for c in run["compared"] if not any(c["errors"])]  # refused turns: the budget test's failure
    assert len(compared) >= 3 and {c["stream"] for c in compared} == {True, False}, run["compared"]
    for c in compared:
        assert c["same_finish"] and c["same_usage"], c
    for row in run["turns"]:
        assert row["summary"] in ("none", "created", "reused", "failed"), row
        assert row["tokens_out"] <= row["tokens_in"]


def test_failures_are_only_the_window(run: dict[str, Any]) -> None:
    """Whatever went wrong was the real window being exceeded (see the budget test), nothing else."""
    for e in run["errors"]:
        assert "maximum context length" in e["error"] or e["error"].startswith("mid-stream"), e
    assert run["proxy_tracebacks"] == 0


def test_the_server_refuses_a_non_uuid_request_id(run: dict[str, Any]) -> None:
    """A server that validates X-Request-ID refuses a non-UUID id with an empty 400: why ctxproxy sends UUIDs
    (if this fails, the server changed)."""
    probe = run["request_id_probe"]
    assert (probe["non_uuid"]["status"], probe["non_uuid"]["body_bytes"]) == (400, 0)
    assert probe["uuid"]["status"] == 200


def test_summariser_calls_accepted_by_the_server(run: dict[str, Any]) -> None:
    assert run["summariser_calls"]["failed"] == 0, run["proxy_warnings"]
    assert not any("summariser failed" in line for line in run["proxy_warnings"])


def test_summaries_created_by_the_real_model_and_reused(run: dict[str, Any]) -> None:
    s = run["summariser_calls"]
    assert s["created"] >= 1 and s["reused"] >= 1, s
    assert s["completion_tokens"] > 0  # written by the model
    headers = run["summary_headers"]
    assert headers.get("reused", 0) >= 1 and "failed" not in headers, headers
    # a summary is made in the background before a request needs it (or waited for, when nothing else fits)
    first = next(r["turn"] for r in run["turns"] if r["summary"] in ("created", "waited", "reused"))
    assert all(r["summary"] in ("created", "waited", "reused", "pending") for r in run["turns"][first:]), \
        run["turns"]


def test_budget_kept_by_the_servers_own_count(run: dict[str, Any]) -> None:
    """usage.prompt_tokens (the server's tokenizer and chat template) <= window - max_tokens: on every turn,
    and for a payload at ctxproxy's hard budget B at the worst server/ctxproxy ratio seen in the run. The server
    counts 7-13 % more than ctxproxy's o200k count; the token calibration (a conservative default for small
    models, then the learned factor) keeps B inside the real window, which the provider counts, not ctxproxy."""
    t = run["tokens"]
    assert run["errors"] == [], run["errors"]
    assert t["max_server_prompt_tokens"] <= t["budget_server_tokens"], t
    assert t["server_tokens_at_budget"] <= t["budget_server_tokens"], t
