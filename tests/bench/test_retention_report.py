"""bench/retention_report.py: the scoreboard applies docs/quality.md's rule for the default strategy."""

from __future__ import annotations

from typing import Any

from bench.retention_report import markdown, scoreboard


def row(strategy: str, deps: float | None, values: float | None, prefix: float, tokens: float, calls: int = 0,
        budget: str = "8k") -> dict[str, Any]:
    return {"strategy": strategy, "wire": "chat", "budget": budget, "requests": 10, "managed_pct": 50.0,
            "tokens_forwarded_pct": tokens, "dependencies_answerable_pct": deps, "forgotten_answerable_pct": None,
            "values_kept_pct": values, "argument_values_kept_pct": values, "prefix_kept_pct": prefix,
            "prefix_token_share_pct": prefix, "summariser_calls": calls, "refused": 0}


def results(rows: list[dict[str, Any]], tau: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    block = {"conversations": 1, "requests": 10, "dependencies": 5, "tokens_mean": 100, "tokens_max": 100}
    datasets = {"coding": {**block, "rows": rows}}
    if tau is not None:
        datasets = {"tau": {**block, "rows": tau}, **datasets}
    return {"datasets": datasets, "skipped": {}}


def test_the_best_prefix_wins_among_those_that_forget_least() -> None:
    """cache-friendly forgets 2 points more than stack, the best, and keeps the prefix best: it is the pick;
    forgetful keeps the prefix even better but forgets 10 points more: not a candidate."""
    board = scoreboard(results([
        row("stack", 80, 60, 80, 60),
        row("cache-friendly", 78, 58, 90, 50, calls=3),
        row("forgetful", 70, 50, 99, 30),
    ]))
    assert [b["strategy"] for b in board] == ["cache-friendly", "stack", "forgetful"]
    assert [b["candidate"] for b in board] == [True, True, False]
    assert board[0]["retention"] == 68.0


def test_forgetting_less_than_the_others_makes_the_others_no_candidates() -> None:
    """A strategy that keeps 10 points more than everything else is the pick even with a worse prefix."""
    board = scoreboard(results([
        row("stack", 70, 50, 90, 60),
        row("masking", 80, 60, 85, 58),
    ]))
    assert [(b["strategy"], b["candidate"]) for b in board] == [("masking", True), ("stack", False)]


def test_within_a_point_of_the_best_prefix_fewer_tokens_then_fewer_summariser_calls_win() -> None:
    board = scoreboard(results([
        row("stack", 80, 60, 90, 60),
        row("summaries", 80, 60, 90.5, 50, calls=9),
        row("masking", 80, 60, 90.2, 40, calls=0),
    ]))
    assert board[0]["strategy"] == "masking"


def test_tau_as_recorded_is_not_scored_and_nothing_touched_counts_as_nothing_forgotten() -> None:
    """tau-bench as recorded fits the budgets: it would credit every strategy alike. A cell where no turn was
    touched (values kept: None) forgot nothing."""
    board = scoreboard(results([row("stack", 100, None, 100, 100), row("other", 100, 40, 100, 100)],
                               tau=[row("stack", 0, 0, 0, 0), row("other", 100, 100, 100, 100)]))
    by = {b["strategy"]: b for b in board}
    assert by["stack"]["cells"] == 1 and by["stack"]["values_kept_pct"] == 100.0
    assert by["other"]["retention"] == 70.0 and not by["other"]["candidate"]


def test_the_markdown_names_the_pick_and_the_strategies_it_could_not_measure() -> None:
    data = results([row("stack", 80, 60, 80, 60)])
    data["skipped"] = {"observation-masking": "no 'observation-masking' context manager registered"}
    text = markdown(data)
    assert "| stack | 8k |" in text
    assert "the default is **stack**" in text
    assert "`observation-masking`: not measured in this checkout" in text
