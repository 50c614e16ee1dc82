"""bench/retention.py: the harness replays a conversation through the real pipeline and counts what it forgets.

The hand-computed case: a tracking number that only an early tool output holds is used four turns
later. Over a 2,000-token budget sliding-window (one turn kept) drops that output before the use, so
the dependency is lost; a summary that quotes the output keeps it answerable.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.retention import Run, Strategy, main, strategies
from bench.retention_data import Conversation, Dependency, detect_dependencies
from bench.retention_metrics import Subject, Totals
from bench.retention_report import BEGIN, END
from bench.retention_wires import FORMS

ROOT = Path(__file__).resolve().parents[2]


def filler(n: int) -> str:
    return " ".join(["river"] * n)  # one token a word, no value in it


def parcel_conversation() -> Conversation:
    call1 = {"id": "c1", "type": "function", "function": {"name": "lookup_order", "arguments": '{"order_id": "ORD-5531"}'}}
    call2 = {"id": "c2", "type": "function", "function": {"name": "track_parcel", "arguments": '{"tracking": "TRK-99812"}'}}
    output = json.dumps({"order": "ORD-5531", "tracking": "TRK-99812", "history": filler(1200)})
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a support agent."},
        {"role": "user", "content": "Please look up order ORD-5531."},  # turn 0
        {"role": "assistant", "content": None, "tool_calls": [call1]},
        {"role": "tool", "tool_call_id": "c1", "content": output},
        {"role": "assistant", "content": "It has shipped."},
        {"role": "user", "content": "Thanks. " + filler(300)},  # turn 1
        {"role": "assistant", "content": "You are welcome."},
        {"role": "user", "content": "Another thing: " + filler(300)},  # turn 2
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": "Where is my parcel now?"},  # turn 3
        {"role": "assistant", "content": None, "tool_calls": [call2]},
        {"role": "tool", "tool_call_id": "c2", "content": "In Berlin."},
        {"role": "assistant", "content": "It is in Berlin."},
    ]
    return Conversation("parcel", messages, detect_dependencies(messages))


async def measure(strategy: Strategy, wire: str = "chat") -> Totals:
    return await Run().measure(strategy, 2000, [Subject(parcel_conversation())], FORMS[wire])


def test_the_parcel_conversation_has_the_two_dependencies_it_was_written_with() -> None:
    """The order id comes from the user and is used by the next call; the tracking number comes from the first
    tool output and is used four turns later."""
    assert parcel_conversation().dependencies == [Dependency("ORD-5531", 1, 2), Dependency("TRK-99812", 3, 10)]


@pytest.mark.parametrize("wire", ["chat", "responses", "messages"])
async def test_a_value_dropped_by_sliding_window_is_counted_as_lost(wire: str) -> None:
    """Requests 2, 4 and 6 messages long fit; at 8 the first turn is dropped (one turn kept), and at 10 the
    tracking number's only holder is gone when the call that needs it is made. The order id of the dropped turn
    is counted at each of the three managed requests (8, 10, 12) and kept at none. Of the five consecutive pairs,
    the two where the window moved (8, 10) lose the prefix."""
    t = await measure(Strategy("sw", {"type": "sliding-window", "params": {"keep_turns": 1, "cut_step": 1}}), wire)
    assert (t.requests, t.managed, t.refused) == (6, 3, 0)
    assert (t.dependencies, t.answerable) == (2, 1)
    assert (t.forgotten, t.forgotten_answerable) == (1, 0)
    assert (t.values, t.values_kept) == (3, 0)
    assert (t.argument_values, t.argument_values_kept) == (3, 0)
    assert (t.pairs, t.prefix_kept) == (5, 3)
    assert t.summariser_calls == 0
    assert t.tokens_after < t.tokens_before


@pytest.mark.parametrize("wire", ["chat", "responses", "messages"])
async def test_a_value_kept_by_a_summary_that_contains_it_is_counted_as_kept(wire: str) -> None:
    """The summary of the first turn (made once, at request 8, reused at 10 and 12) quotes the head of the tool
    output, tracking number included: the dependency is answerable although its source was not forwarded, and the
    order id of the summarised turn is kept at all three requests. The summary stays in place, so only the pair
    where it appeared loses the prefix."""
    t = await measure(Strategy("sum", {"type": "summarising", "params": {"keep_turns": 1}}, "extractive"), wire)
    assert (t.requests, t.managed, t.refused) == (6, 3, 0)
    assert (t.dependencies, t.answerable) == (2, 2)
    assert (t.forgotten, t.forgotten_answerable) == (1, 1)
    assert (t.values, t.values_kept) == (3, 3)
    assert (t.pairs, t.prefix_kept) == (5, 4)
    assert t.summariser_calls == 1


async def test_a_generic_summary_keeps_the_values_through_its_section() -> None:
    """The same summary point with a summariser that writes a generic text: the values the first turn acted on
    reach the model through the summary's values section, but the tracking number only its tool output held
    does not (a value an output holds is kept only when a later call or message used it)."""
    t = await measure(Strategy("sum", {"type": "summarising", "params": {"keep_turns": 1}}, "generic"))
    assert (t.dependencies, t.answerable, t.forgotten_answerable) == (2, 1, 0)
    assert (t.values, t.values_kept) == (3, 3)
    assert t.summariser_calls == 1


async def test_a_refused_request_forgets_everything_it_had() -> None:
    """Under a 10-token budget even the system prompt and the question do not fit: every request is refused, so
    each dependency is lost, every value so far counts as forgotten and no pair keeps its prefix."""
    t = await Run().measure(Strategy("stack", {"type": "stack"}), 10, [Subject(parcel_conversation())], FORMS["chat"])
    assert (t.requests, t.refused, t.managed) == (6, 6, 0)
    assert (t.dependencies, t.answerable, t.forgotten) == (2, 0, 2)
    assert t.values > 0 and t.values_kept == 0
    assert (t.pairs, t.prefix_kept) == (5, 0)


def test_a_plugin_that_crashes_stops_the_run_with_the_request_it_broke_on(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch,
                                                                               capsys: pytest.CaptureFixture[str]
                                                                               ) -> None:
    (tmp_path / "broken_plugin.py").write_text(
        "from plugins.base import ContextManager, Params\n"
        "class Broken(ContextManager):\n"
        "    name = 'broken'\n"
        "    Params = Params\n"
        "    async def manage_history(self, view):\n"
        "        raise RuntimeError('boom')\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["--datasets", "coding", "--limit", "1", "--coding-turns", "3", "--budgets", "2k", "--quiet",
                 "--strategies", "stack", "--binding", 'broken={"ref": "broken_plugin:Broken"}'])
    assert code == 1
    err = capsys.readouterr().err
    assert "broken at B=2000 on repo-7000 (chat wire), the request of" in err and "RuntimeError: boom" in err


def test_the_strategies_are_the_issues_and_only_missing_plugins_are_skipped() -> None:
    """Every strategy of the table has a row; the masking rows wait for their plugin, nothing else is skipped."""
    from bench.retention import available

    names = [s.name for s in strategies()]
    assert names == ["sliding-window", "stack", "summarising/drop", "summarising/generic", "summarising/extractive",
                     "summarising/generic/no-wm-cap", "observation-masking", "hybrid/generic", "hybrid/extractive",
                     "hybrid/generic/no-wm-cap"]
    for s in strategies():
        if s.needs is None:
            assert available(s) is None


def test_the_command_writes_its_tables_json_and_the_doc_block(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                                ) -> None:
    """One small run end to end: the markdown table, the JSON figures, and the doc's block replaced in place."""
    doc = tmp_path / "quality.md"
    doc.write_text(f"# Quality\n\nbefore\n\n{BEGIN}\nold table\n{END}\n\nafter\n", encoding="utf-8")
    out_json, out_md = tmp_path / "r.json", tmp_path / "r.md"
    code = main(["--datasets", "coding", "--limit", "1", "--coding-turns", "5", "--budgets", "4k",
                 "--strategies", "sliding-window,summarising/generic", "--quiet",
                 "--json-out", str(out_json), "--markdown-out", str(out_md), "--update-doc", str(doc)])
    assert code == 0
    results = json.loads(out_json.read_text())
    rows = results["datasets"]["coding"]["rows"]
    assert [(r["strategy"], r["budget"], r["wire"]) for r in rows] == [
        ("sliding-window", "4k", "chat"), ("summarising/generic", "4k", "chat")]
    assert all(r["requests"] == rows[0]["requests"] > 0 for r in rows)
    table = out_md.read_text()
    assert "| sliding-window | 4k |" in table and "| summarising/generic | 4k |" in table
    text = doc.read_text()
    assert text.startswith("# Quality\n\nbefore\n\n") and text.endswith(f"{END}\n\nafter\n")
    assert "old table" not in text and "| sliding-window | 4k |" in text
    assert "| sliding-window | 4k |" in capsys.readouterr().out


def test_the_script_runs_from_a_clone_without_installing_the_bench() -> None:
    """``bench/retention.py`` is run as a file too (the repository root is not on the path then)."""
    done = subprocess.run([sys.executable, "bench/retention.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert "--update-doc" in done.stdout


@pytest.mark.parametrize("args", [["--strategies", "nope"], ["--budgets", "8x"], ["--wires", "grpc"],
                                  ["--binding", 'x={"type": "nope"}'], ["--binding", "novalue"],
                                  ["--limit", "0"]])
def test_bad_arguments_are_refused_with_a_usage_error(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err
