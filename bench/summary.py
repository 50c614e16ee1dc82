#!/usr/bin/env python3
"""The proxies of one `bench/compare.sh` run side by side: CPU per request and requests per second.

Reads the raw measurements compare.sh wrote (``<label>.json`` in the folder given) for the HTTP stack's
floor (``floor_relay.py``), ctxproxy under and over budget, context-guardian and LiteLLM (those that ran),
and prints one markdown table: per payload and number of connections, the direct path's rps, then each
one's median CPU time per request of its process tree and median rps (min–max over the rounds), and
ctxproxy's rps as a multiple of LiteLLM's.

    .venv/bin/python bench/summary.py bench/results/latest
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

LABELS = (("floor", "floor (aiohttp relaying bytes)"), ("ctxproxy-under", "ctxproxy (under budget)"),
          ("ctxproxy-over", "ctxproxy (over budget, cached summary)"),
          ("context-guardian", "context-guardian"), ("litellm", "LiteLLM"))


def cells(rows: list[dict]) -> dict[tuple[str, int], dict[str, list[dict]]]:
    out: dict[tuple[str, int], dict[str, list[dict]]] = {}
    for r in rows:
        out.setdefault((r["payload"], r["conns"]), {}).setdefault(r["target"], []).append(r)
    return out


def figure(rows: list[dict], key: str) -> tuple[float, float, float]:
    values = [r[key] for r in rows]
    return statistics.median(values), min(values), max(values)


def main() -> int:
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "bench/results/latest")
    runs = {label: cells(json.loads((folder / f"{label}.json").read_text()))
            for label, _ in LABELS if (folder / f"{label}.json").exists()}
    if not runs:
        print(f"no <label>.json in {folder}")
        return 1
    names = [(label, name) for label, name in LABELS if label in runs]
    print("| payload | conns | direct rps | " + " | ".join(f"{n} CPU/req, rps" for _, n in names)
          + (" | ctxproxy rps / LiteLLM rps |" if "litellm" in runs and "ctxproxy-under" in runs else " |"))
    print("|---|---|---|" + "---|" * len(names) + ("---|" if "litellm" in runs and "ctxproxy-under" in runs else ""))
    every = {cell for run in runs.values() for cell in run}  # (a run that lacks a cell shows a dash there)
    for payload, conns in sorted(every, key=lambda pc: (pc[0] != "small.json", pc)):
        directs = [r["rps"] for run in runs.values() for r in run.get((payload, conns), {}).get("direct", [])]
        line = f"| {payload.split('.')[0]} | {conns} | {statistics.median(directs):,.0f} |" if directs \
            else f"| {payload.split('.')[0]} | {conns} | – |"
        for label, _ in names:
            proxy = runs[label].get((payload, conns), {}).get("proxy")
            if not proxy:
                line += " – |"
                continue
            cpu, rps = figure(proxy, "cpu_ms_per_req"), figure(proxy, "rps")
            line += f" {cpu[0]:.2f} ms ({cpu[1]:.2f}–{cpu[2]:.2f}), {rps[0]:,.0f} ({rps[1]:,.0f}–{rps[2]:,.0f}) |"
        if "litellm" in runs and "ctxproxy-under" in runs:
            mine = runs["ctxproxy-under"].get((payload, conns), {}).get("proxy")
            theirs = runs["litellm"].get((payload, conns), {}).get("proxy")
            line += f" {figure(mine, 'rps')[0] / figure(theirs, 'rps')[0]:.1f}× |" if mine and theirs else " – |"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
