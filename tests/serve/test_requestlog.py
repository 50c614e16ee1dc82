"""proxy.serve.requestlog: one JSON line per request, bounded, with no keys or prompt text."""

from __future__ import annotations

import json
import logging

import pytest

from proxy.pipeline import Report
from proxy.serve.requestlog import RequestRecord


def report() -> Report:
    return Report(model="gpt-4o-mini", tenant="acme", context_manager="summarising", tokens_before=9000,
                  tokens_after=4000, hard_budget=6000, removed={"summarised": 5000}, summary="created",
                  turns_summarised=7, repairs={"orphan_result": 1}, warnings=["x-ctxproxy-context-manager ignored"])


def test_fields_of_a_full_record() -> None:
    r = RequestRecord(request_id="rid-1", started=0.0, wire="chat", tenant="acme", model="gpt-4o-mini", status=200,
                      report=report(), overhead=0.0012345, upstream=1.5, ttft=0.25,
                      usage={"prompt_tokens": 4001, "completion_tokens": 12, "prompt_tokens_details": {"cached": 1}})
    assert r.fields() == {
        "event": "request", "request_id": "rid-1", "wire": "chat", "tenant": "acme", "model": "gpt-4o-mini",
        "status": 200, "mode": "enforce", "tokens_in": 9000, "tokens_out": 4000, "hard_budget": 6000,
        "removed": {"summarised": 5000},
        "summary": "created", "turns_summarised": 7, "turns_dropped": 0, "repairs": {"orphan_result": 1},
        "context_manager": "summarising", "warnings": 1, "overhead_ms": 1.234, "upstream_ms": 1500.0,
        "ttft_ms": 250.0, "usage": {"prompt_tokens": 4001, "completion_tokens": 12},
    }


def test_masked_outputs_are_counted_never_named() -> None:
    """The line says how many tool outputs were masked; their call ids and tool names (client text) stay in
    explain and ``ctxproxy assemble``."""
    masked = report()
    masked.removed = {"masked": 3000}
    masked.masked = [{"call_id": "call_secret_1", "tool": "lookup", "tokens_removed": 1500},
                     {"call_id": "call_secret_2", "tool": "lookup", "tokens_removed": 1500}]
    fields = RequestRecord(request_id="r", started=0.0, status=200, report=masked).fields()
    assert fields["outputs_masked"] == 2 and fields["removed"] == {"masked": 3000}
    assert "call_secret" not in json.dumps(fields) and "outputs_masked" not in RequestRecord(
        request_id="r", started=0.0, status=200, report=report()).fields()


def test_an_observed_request_says_so_and_what_enforce_would_have_refused() -> None:
    """In observe mode the line carries the mode; its tokens out are what enforce would have forwarded, and a
    request enforce would have refused names the refusal's code."""
    observed = report()
    observed.mode = "observe"
    fields = RequestRecord(request_id="r", started=0.0, status=200, report=observed).fields()
    assert fields["mode"] == "observe" and (fields["tokens_in"], fields["tokens_out"]) == (9000, 4000)
    assert "would_refuse" not in fields
    observed.would_refuse, observed.tokens_after, observed.removed = "context_length_exceeded", 0, {}
    fields = RequestRecord(request_id="r", started=0.0, status=200, report=observed).fields()
    assert fields["would_refuse"] == "context_length_exceeded" and fields["tokens_out"] == 0


def test_a_refused_request_has_its_error_and_no_report() -> None:
    r = RequestRecord(request_id="rid-2", started=0.0, status=400, error="context_length_exceeded")
    assert r.fields() == {"event": "request", "request_id": "rid-2", "wire": "chat", "tenant": "default",
                          "model": None, "status": 400, "error": "context_length_exceeded"}


def test_a_client_chosen_model_name_is_cut_short() -> None:
    assert len(RequestRecord(request_id="r", started=0.0, model="m" * 10_000).fields()["model"]) == 200


def test_log_writes_one_json_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="ctxproxy.requests")
    RequestRecord(request_id="rid-3", started=0.0, event="explain", status=200, report=report()).log()
    (record,) = [r for r in caplog.records if r.name == "ctxproxy.requests"]
    line = record.getMessage()
    assert "\n" not in line
    assert json.loads(line)["event"] == "explain"
    assert "ignored" not in line  # warnings are counted, never copied (they may quote client input)


def test_nothing_is_logged_above_info(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="ctxproxy.requests")
    RequestRecord(request_id="rid-4", started=0.0).log()
    assert [r for r in caplog.records if r.name == "ctxproxy.requests"] == []
