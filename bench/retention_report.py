"""The retention benchmark's output: one table per data set, the scoreboard, and the doc's block.

The scoreboard applies the rule docs/quality.md states for choosing the default strategy, so a
rerun on a checkout with more strategies (observation-masking, the hybrid) updates the choice too:

- cells: every data set but ``tau`` as recorded (most of its requests fit every budget) at every
  budget and wire that was run;
- retention: the mean over the cells of (dependencies answerable + values kept) / 2; a cell where
  nothing was touched counts as nothing forgotten;
- candidates: the strategies that forget least, within ``SLACK`` points of the best retention;
- the pick: the candidate that keeps the forwarded prefix best (the provider's prompt cache), and
  within ``TIE`` points of that, the one that forwards fewer tokens, then makes fewer summariser calls.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SLACK = 3.0
TIE = 1.0
UNSCORED = ("tau",)

COLUMNS = [
    ("strategy", "strategy"), ("budget", "B"), ("managed_pct", "managed %"),
    ("tokens_forwarded_pct", "tokens forwarded %"), ("dependencies_answerable_pct", "deps answerable %"),
    ("forgotten_answerable_pct", "… source forgotten %"), ("values_kept_pct", "values kept %"),
    ("argument_values_kept_pct", "… call arguments %"), ("prefix_kept_pct", "prefix kept %"),
    ("prefix_token_share_pct", "prefix tokens %"), ("summariser_calls", "summariser calls"),
]
BEGIN, END = "<!-- retention:begin -->", "<!-- retention:end -->"


def cell(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)


def markdown(results: dict[str, Any]) -> str:
    """One table per data set, plus the skipped strategies."""
    out: list[str] = []
    for dataset, block in results["datasets"].items():
        out.append(f"#### {dataset}: {block['conversations']} conversations, {block['requests']:,} requests, "
                   f"{block['dependencies']:,} dependencies, {block['tokens_mean']:,} tokens on average "
                   f"(at most {block['tokens_max']:,}) at the last request")
        out.append("")
        columns = list(COLUMNS)
        if len({row["wire"] for row in block["rows"]}) > 1:
            columns.insert(1, ("wire", "wire"))
        out.append("| " + " | ".join(title for _, title in columns) + " |")
        out.append("|" + "|".join("---" for _ in columns) + "|")
        for row in block["rows"]:
            out.append("| " + " | ".join(cell(row.get(key)) for key, _ in columns) + " |")
        out.append("")
        refused = [f"{row['strategy']} at {row['budget']} ({row['wire']}): {row['refused']}"
                   for row in block["rows"] if row["refused"]]
        if refused:
            out.append("Requests refused (context_length_exceeded): " + "; ".join(refused) + ".")
            out.append("")
    out += scoreboard_markdown(scoreboard(results))
    for name, why in results["skipped"].items():
        out.append(f"- `{name}`: not measured in this checkout ({why}); its rows appear when the command is "
                   "rerun on a checkout that has it.")
    if results["skipped"]:
        out.append("")
    return "\n".join(out)


def update_doc(path: Path, tables: str) -> None:
    """Put ``tables`` between the markers of ``path``, leaving the rest of the document as it is."""
    doc = path.read_text(encoding="utf-8")
    head, _, rest = doc.partition(BEGIN)
    _, _, tail = rest.partition(END)
    path.write_text(f"{head}{BEGIN}\n{tables}\n{END}{tail}", encoding="utf-8")




def scoreboard(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per strategy, the means over the scored cells, best first by the rule (the first row is the pick)."""
    cells: dict[str, list[dict[str, Any]]] = {}
    for dataset, block in results["datasets"].items():
        if dataset in UNSCORED:
            continue
        for row in block["rows"]:
            cells.setdefault(row["strategy"], []).append(row)
    if not cells:
        return []
    most = max(len(rows) for rows in cells.values())
    board = []
    for strategy, rows in cells.items():
        if len(rows) < most:  # measured on fewer cells than the others: not comparable
            continue
        deps = _mean([r["dependencies_answerable_pct"] for r in rows], None)
        values = _mean([r["values_kept_pct"] for r in rows], 100.0)
        board.append({
            "strategy": strategy, "cells": len(rows), "dependencies_answerable_pct": deps, "values_kept_pct": values,
            "retention": _mean([deps, values], None) or 0.0,
            "prefix_kept_pct": _mean([r["prefix_kept_pct"] for r in rows], None) or 0.0,
            "tokens_forwarded_pct": _mean([r["tokens_forwarded_pct"] for r in rows], None) or 0.0,
            "refused": sum(r["refused"] for r in rows),
            "summariser_calls": sum(r["summariser_calls"] for r in rows),
        })
    floor = max(b["retention"] for b in board) - SLACK
    for b in board:
        b["candidate"] = b["retention"] >= floor
    top = max(b["prefix_kept_pct"] for b in board if b["candidate"])

    def rank(b: dict[str, Any]) -> tuple[int, float, float, float]:
        if b["candidate"] and b["prefix_kept_pct"] >= top - TIE:
            return (0, b["tokens_forwarded_pct"], b["summariser_calls"], -b["prefix_kept_pct"])
        return (1 if b["candidate"] else 2, -b["prefix_kept_pct"], -b["retention"], 0.0)

    return sorted(board, key=rank)


def _mean(values: list[float | None], missing: float | None) -> float | None:
    """The mean of the figures; a missing one (``None``) counts as ``missing``, or is left out when that is None.

    Values kept is missing where no turn was touched: nothing was forgotten (100). Dependencies,
    prefix and tokens are missing where there was nothing to measure: they are left out.
    """
    known = [missing if v is None else v for v in values]
    present = [v for v in known if v is not None]
    return round(sum(present) / len(present), 1) if present else None


def scoreboard_markdown(board: list[dict[str, Any]]) -> list[str]:
    if not board:
        return []
    cells = board[0]["cells"]
    out = [f"#### Scoreboard: means over {cells} cells (every data set but tau as recorded, every budget); "
           f"candidates are within {SLACK:g} points of the best retention", "",
           "| strategy | retention | deps answerable % | values kept % | prefix kept % | tokens forwarded % "
           "| summariser calls | refused | candidate |",
           "|---|---|---|---|---|---|---|---|---|"]
    for b in board:
        out.append(f"| {b['strategy']} | {cell(b['retention'])} | {cell(b['dependencies_answerable_pct'])} | "
                   f"{cell(b['values_kept_pct'])} | {cell(b['prefix_kept_pct'])} | {cell(b['tokens_forwarded_pct'])} | "
                   f"{b['summariser_calls']} | {b['refused']} | {'yes' if b['candidate'] else 'no'} |")
    out += ["", f"By the rule above, the default is **{board[0]['strategy']}**.", ""]
    return out
