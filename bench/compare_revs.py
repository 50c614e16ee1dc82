"""Two commits of ctxproxy side by side: the per-request overhead of each, measured in one run.

For a change that must not cost anything (a restructuring, a refactor), the figure that counts is the
ratio between the code before and after on the same machine at the same time. This script extracts
both revisions (``git archive``, nothing is checked out in the working tree), then runs the harness
(``compare.py``: fake upstream, wrk, direct vs proxy) once per revision and repetition, alternating
the order (A B B A …) so slow drift of the machine hits both alike, and prints the medians of the
proxy's CPU time per request and of what it adds to p50 over the direct path, per payload and
number of connections. Both revisions run on this checkout's ``.venv`` (same dependencies).

usage: .venv/bin/python bench/compare_revs.py REV_A REV_B [--config under_budget.yaml] [--reps 3]
       [--duration 10s] [--conns 1,32] [--out FILE] [--proxy-port 14000] [--upstream-port 18001]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def extract(rev: str, into: Path) -> str:
    """Unpack ``rev`` into ``into``; returns its short hash."""
    into.mkdir(parents=True)
    short = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev], check=True,
                           capture_output=True, text=True).stdout.strip()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return short


def measure(src: Path, label: str, config: str, args: argparse.Namespace, work: Path) -> list[dict]:
    cache = work / f"cache-{label}"
    cache.mkdir(exist_ok=True)
    # The revision's own package first on the path: the checkout's editable install comes after it.
    serve = (f"env PYTHONPATH={src} CTXPROXY_CACHE_DIR={cache} {sys.executable} -c "
             f"'import sys; from proxy.cli import main; sys.exit(main())' serve "
             f"--config {src}/bench/configs/{config} --port {{port}}")
    out = work / f"{label}.json"
    subprocess.run([sys.executable, str(HERE / "compare.py"), "--label", label, "--proxy-cmd", serve,
                    "--rounds", "1", "--duration", args.duration, "--warmup", args.warmup,
                    "--conns", args.conns, "--log-dir", str(work / "logs"), "--json-out", str(out),
                    "--proxy-port", str(args.proxy_port), "--upstream-port", str(args.upstream_port)],
                   check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rev_a")
    ap.add_argument("rev_b")
    ap.add_argument("--config", default="under_budget.yaml", help="a file in bench/configs of both revisions")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--duration", default="10s")
    ap.add_argument("--warmup", default="2s")
    ap.add_argument("--conns", default="1,32")
    ap.add_argument("--out", help="write the raw measurements here (JSON)")
    ap.add_argument("--proxy-port", type=int, default=14000)
    ap.add_argument("--upstream-port", type=int, default=18001)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="ctxproxy-revs-") as tmp:
        work = Path(tmp)
        revs = {name: extract(rev, work / name) for name, rev in (("a", args.rev_a), ("b", args.rev_b))}
        rows: list[dict] = []
        for rep in range(args.reps):
            for name in (("a", "b") if rep % 2 == 0 else ("b", "a")):
                print(f"# rep {rep + 1}/{args.reps}: {revs[name]}", file=sys.stderr)
                for row in measure(work / name, f"{name}{rep}", args.config, args, work):
                    rows.append(dict(row, rev=revs[name], rep=rep))

    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    print(f"\n{revs['a']} vs {revs['b']}, {args.config}: medians of {args.reps} runs per revision "
          f"(alternating), wrk -t1 x {args.duration}\n")
    print(f"| payload | conns | CPU/req {revs['a']} | CPU/req {revs['b']} | ratio | +p50 {revs['a']} "
          f"| +p50 {revs['b']} |")
    print("|---|---|---|---|---|---|---|")
    cells = sorted({(r["payload"], r["conns"]) for r in rows}, key=lambda pc: (pc[0] != "small.json", pc))
    for payload, conns in cells:
        figures = {}
        for rev in revs.values():
            mine = [r for r in rows if (r["payload"], r["conns"], r["rev"]) == (payload, conns, rev)]
            cpu = statistics.median(r["cpu_ms_per_req"] for r in mine if r["target"] == "proxy")
            added = statistics.median(
                p["p50_ms"] - d["p50_ms"]
                for p in mine if p["target"] == "proxy"
                for d in mine if d["target"] == "direct" and d["rep"] == p["rep"])
            figures[rev] = (cpu, added)
        (ca, pa), (cb, pb) = figures[revs["a"]], figures[revs["b"]]
        print(f"| {payload} | {conns} | {ca:.2f} ms | {cb:.2f} ms | {cb / ca:.2f} | {pa:+.2f} ms | {pb:+.2f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
