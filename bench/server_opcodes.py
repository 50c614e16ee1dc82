"""The Python bytecode the server runs per request, by function and by line: a profile that does not move.

``server_instructions.py`` counts the machine's instructions, which says how much, not where. A sampling profiler
(py-spy) says where, but a small request is a few hundred microseconds spread over two hundred functions, and
cProfile's own cost per call (about a microsecond) swamps functions that cost less. This runs ``ctxproxy serve`` (or
the floor relay, ``--floor``) with a trace function (``sys.settrace`` with opcode events) switched on after
``--warm`` requests, counts every opcode of ``--requests`` more, and prints per request: the opcodes in all, by file,
the functions that run the most (a dataclass's generated ``__init__`` named after its class), the lines, and the
exceptions raised (a coroutine's return, or a generator's end, shows as a ``StopIteration``). Opcodes are
deterministic, and track the instructions closely: about 100 instructions an opcode at the sixteenth stop, ctxproxy
and the floor alike (``docs/benchmarks.md``). What C code does inside one call (orjson, a regular expression, a
syscall) is not in the count: ``server_instructions.py --patch`` measures that.

    .venv/bin/python bench/server_opcodes.py --payload small.json --requests 300
    .venv/bin/python bench/server_opcodes.py --payload small.json --requests 300 --floor --top 20

Run it from the tree to measure: the server imports ``proxy`` from this script's repository.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from bench.server_instructions import (  # noqa: E402
    FLOOR,
    SERVE,
    WIRE_PATHS,
    bodies,
    free_port,
    send,
    server_arguments,
    wait_ready,
)

# Run in the server before it starts: SIGUSR1 switches the trace on, the next one off and writes the counts
# (tab-separated: kind, count, calls, where) to $CTXPROXY_OPCODES_OUT.
TRACER = r'''
import collections, os, signal, sys
_ops = collections.Counter(); _calls = collections.Counter(); _lines = collections.Counter()
_raised = collections.Counter(); _named = {}; _on = [False]

def _where(frame):
    code = frame.f_code
    if code.co_filename == "<string>":  # a dataclass's generated method: named after its class
        self = frame.f_locals.get("self")
        return f"<dataclass> {type(self).__module__}.{type(self).__qualname__}.{code.co_name}"
    return f"{code.co_filename}:{code.co_firstlineno}:{code.co_qualname}"

def _local(frame, event, arg):
    if event == "opcode":
        _ops[_named[frame.f_code]] += 1
        _lines[(frame.f_code.co_filename, frame.f_lineno)] += 1
    elif event == "exception":
        _raised[(arg[0].__name__, frame.f_code.co_filename, frame.f_lineno)] += 1
    return _local

def _global(frame, event, arg):
    if event != "call":
        return None
    frame.f_trace_opcodes = True
    where = _named[frame.f_code] = _where(frame)  # (a dataclass has generated code objects of its own)
    _calls[where] += 1
    return _local

def _toggle(signum, frame):
    if not _on[0]:
        _on[0] = True
        sys.settrace(_global)
        return
    sys.settrace(None)
    _on[0] = False
    with open(os.environ["CTXPROXY_OPCODES_OUT"], "w") as out:
        for where, n in _ops.items():
            out.write(f"f\t{n}\t{_calls[where]}\t{where}\n")
        for (path, line), n in _lines.items():
            out.write(f"l\t{n}\t0\t{path}:{line}\n")
        for (name, path, line), n in _raised.items():
            out.write(f"e\t{n}\t0\t{name} {path}:{line}\n")

signal.signal(signal.SIGUSR1, _toggle)
'''


def measure(args: argparse.Namespace) -> Path:
    """Run the server, count ``args.requests`` requests, and return the file of counts."""
    work = Path(tempfile.mkdtemp(prefix="ctxproxy-opcodes-"))
    tracer = work / "tracer.py"
    tracer.write_text(TRACER)
    out = work / "counts.tsv"
    port, upstream_port = free_port(), free_port()
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "CTXPROXY_CACHE_DIR": str(work / "cache"),
           "PROXY_PORT": str(port), "UPSTREAM_BASE": f"http://127.0.0.1:{upstream_port}/v1", "PYTHONHASHSEED": "0",
           "CTXPROXY_BENCH_PATCH": str(tracer), "CTXPROXY_OPCODES_OUT": str(out)}
    upstream = subprocess.Popen([sys.executable, str(HERE / "fake_upstream.py"), "--port", str(upstream_port)],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    script = ("import os\nexec(open(os.environ['CTXPROXY_BENCH_PATCH']).read())\n" + FLOOR) if args.floor else SERVE
    target = str(HERE / "floor_relay.py") if args.floor else str(HERE / "configs" / args.config)
    server = subprocess.Popen([sys.executable, "-c", script, target, str(port)], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(port, args.floor, server)
        path = WIRE_PATHS[args.wire]
        raws = list(bodies(args.payload, args.grow, args.warm + args.requests, args.wire))
        send(port, path, raws[:args.warm])
        server.send_signal(signal.SIGUSR1)
        time.sleep(0.2)
        send(port, path, raws[args.warm:])
        server.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 60
        while not out.exists() or not out.stat().st_size:
            if time.monotonic() > deadline:
                raise SystemExit("the server wrote no counts")
            time.sleep(0.2)
        time.sleep(0.5)  # (the file is written in one go; let it finish)
    finally:
        for process in (server, upstream):
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
    return out


def report(counts: Path, requests: int, top: int) -> str:
    """The counts as text, per request."""
    functions: list[tuple[int, int, str]] = []
    lines: list[tuple[int, str]] = []
    raised: list[tuple[int, str]] = []
    by_file: collections.Counter[str] = collections.Counter()
    for row in counts.read_text().splitlines():
        kind, n, calls, where = row.split("\t", 3)
        where = _short(where)
        if kind == "f":
            functions.append((int(n), int(calls), where))
            by_file[where.rsplit(":", 2)[0] if not where.startswith("<dataclass>") else "<dataclass>"] += int(n)
        elif kind == "l":
            lines.append((int(n), where))
        else:
            raised.append((int(n), where))
    total = sum(n for n, _, _ in functions)
    out = [f"{total / requests:,.0f} opcodes a request ({requests} requests)", "", "by file:"]
    out += [f"{n / requests:9,.0f}  {name}" for name, n in by_file.most_common(top)]
    out += ["", "functions (opcodes, calls a request):"]
    out += [f"{n / requests:9,.0f} {c / requests:6.2f}  {name}" for n, c, name in sorted(functions, reverse=True)[:top]]
    out += ["", "lines:"]
    out += [f"{n / requests:9,.1f}  {name}" for n, name in sorted(lines, reverse=True)[:top]]
    out += ["", "exceptions raised (a coroutine's return, or a generator's end, is a StopIteration):"]
    out += [f"{n / requests:9,.2f}  {name}" for n, name in sorted(raised, reverse=True)[:top]]
    return "\n".join(out)


def _short(where: str) -> str:
    """A path as the tables show it: within the tree, the installed packages, or the standard library."""
    where = re.sub(r"\S*/site-packages/", "", where)
    for prefix in (str(ROOT) + "/", os.path.dirname(os.__file__) + "/"):
        where = where.replace(prefix, "")
    return where


def main(argv: list[str] | None = None) -> Any:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    server_arguments(ap, "small.json", 300)
    ap.add_argument("--top", type=int, default=40, help="rows of each table")
    args = ap.parse_args(argv)
    if args.requests <= 0 or args.warm < 0:
        raise SystemExit("--requests must be positive and --warm not negative")
    print(report(measure(args), args.requests, args.top))


if __name__ == "__main__":
    main()
