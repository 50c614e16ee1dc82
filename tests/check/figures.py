"""Print the figures the ``make check`` tests recorded (``python -m tests.check.figures``)."""

from __future__ import annotations

import json
import sys

from tests.check._support import RESULTS


def main() -> int:
    files = sorted(RESULTS.glob("*.json")) if RESULTS.is_dir() else []
    for path in files:
        figures = json.loads(path.read_text(encoding="utf-8"))
        for bulky in ("turns", "proxy_log", "compared"):  # see the file itself
            figures.pop(bulky, None)
        print(f"{path.stem}: {json.dumps(figures, sort_keys=True)}")
    if not files:
        print("no check figures recorded")
    return 0


if __name__ == "__main__":
    sys.exit(main())
