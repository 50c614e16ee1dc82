"""bench/server_instructions.py: the server's instructions per request under callgrind (skipped without valgrind)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.server_instructions import bodies

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "server_instructions.py"
needs_valgrind = pytest.mark.skipif(shutil.which("valgrind") is None or shutil.which("callgrind_control") is None,
                                    reason="valgrind is not installed")


def count(*args: str) -> int:
    done = subprocess.run([sys.executable, str(SCRIPT), "--payload", "small.json", "--warm", "3", *args],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    found = re.search(r": ([\d,]+) instructions a request", done.stdout)
    assert found, done.stdout
    return int(found.group(1).replace(",", ""))


def test_a_growing_conversation_gains_one_turn_a_request_after_the_first_body() -> None:
    raws = list(bodies("small.json", True, 3))
    sizes = [len(raw) for raw in raws]
    assert sizes[0] < sizes[1] < sizes[2]
    assert list(bodies("small.json", False, 2)) == [raws[0], raws[0]]


@needs_valgrind
def test_switching_a_part_off_takes_its_instructions_off_the_count(tmp_path: Path) -> None:
    patch = tmp_path / "off.py"
    # the feedback after each answer (calibration, prompt-cache tracker, prices, the request log): nothing waits on it
    patch.write_text("import proxy.serve.scope as s\ns._after_answer = lambda *a, **k: None\n")
    whole = count("--requests", "5")
    without = count("--requests", "5", "--patch", str(patch))
    assert 200_000 < whole < 20_000_000  # a small request: about 1.6 M
    assert without < whole * 0.97  # the feedback after each answer is about a tenth of a small request


@needs_valgrind
def test_the_floor_relay_is_counted_too() -> None:
    floor = count("--floor", "--requests", "5")
    assert 100_000 < floor < count("--requests", "5")
