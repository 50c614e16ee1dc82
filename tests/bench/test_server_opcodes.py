"""bench/server_opcodes.py: the server's Python opcodes per request, by function, line and exception."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "server_opcodes.py"


def run(*args: str) -> str:
    done = subprocess.run([sys.executable, str(SCRIPT), "--payload", "small.json", "--warm", "3", "--requests", "5",
                           "--top", "5", *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def total(report: str) -> int:
    found = re.match(r"([\d,]+) opcodes a request \(5 requests\)", report)
    assert found, report
    return int(found.group(1).replace(",", ""))


def test_a_request_is_counted_by_function_line_and_exception() -> None:
    report = run()
    assert 2_000 < total(report) < 200_000  # a small request: about 11,000
    for heading in ("by file:", "functions (opcodes, calls a request):", "lines:", "exceptions raised"):
        assert heading in report
    assert "proxy/serve/managed.py" in report  # paths within the tree, short
    assert re.search(r"^\s+[\d,]+\s+[\d.]+\s+\S+:\d+:\S+", report, re.MULTILINE)  # opcodes, calls, file:line:function


def test_the_floor_runs_fewer() -> None:
    assert total(run("--floor")) < total(run())
