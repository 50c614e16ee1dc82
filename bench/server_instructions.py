"""The instructions the server executes per request, counted by callgrind: a deterministic A/B measure.

Wall and CPU times through the harness move by 10-20 % between runs of one revision on a 2-core machine (and by 2x
when the machine changes speed); a count of instructions does not. This runs ``ctxproxy serve`` (or the floor relay,
``--floor``) under ``valgrind --tool=callgrind`` with the cyclic collector off, sends ``--warm`` requests with the
count off, then counts ``--requests`` more (``callgrind_control -i on``) and prints the server's user-space
instructions per request, every thread included. Kernel time (socket writes, page faults, thread switches) is
not in the count, and callgrind counts a ``rep movsb`` copy byte by byte, so copies weigh more here than in time.
Two runs of one tree agree within 0.02 % under budget and within about 1.3 % over budget (a worker thread reads the
disk cache).

``--grow``: a conversation that grows by one turn a request (``pipeline_bench.grown``), as a real client sends,
instead of the same body again. ``--wire responses|messages``: the same conversation on that wire
(``responses_bench.CONVERT``), sent to its path (the fake upstream answers each wire in its own shape).
``--pad-to BYTES``: each body ends in spaces up to that size, so two wires' bodies arrive in the same socket reads
(a body that arrives in several is joined: one more copy, which callgrind counts byte by byte).
``--patch FILE``: Python run in the server before it starts, to switch a part off and see what it costs
(e.g. ``import proxy.store.prefix as p; p.PrefixTracker.observe = lambda *a, **k: None``).

    .venv/bin/python bench/server_instructions.py --config under_budget.yaml --payload agent_long.json --requests 20
    .venv/bin/python bench/server_instructions.py --floor --payload small.json --requests 200

Needs valgrind (``apt-get install valgrind``). Run it from the tree to measure: the server imports ``proxy`` from
this script's repository.
"""

from __future__ import annotations

import argparse
import http.client
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from bench.pipeline_bench import grown, read_payload  # noqa: E402

SERVE = ("import gc, os, runpy, sys\n"
         "patch = os.environ.get('CTXPROXY_BENCH_PATCH')\n"
         "if patch: exec(open(patch).read())\n"
         "gc.disable()\n"
         "sys.argv = ['ctxproxy', 'serve', '--config', sys.argv[1], '--port', sys.argv[2]]\n"
         "runpy.run_module('proxy.cli', run_name='__main__')\n")
FLOOR = ("import gc, runpy, sys\n"
         "gc.disable()\n"
         "path = sys.argv[1]\n"
         "sys.argv = ['floor', '--port', sys.argv[2]]\n"
         "runpy.run_path(path, run_name='__main__')\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


WIRE_PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}


def bodies(payload: str, grow: bool, count: int, wire: str = "chat") -> Iterator[bytes]:
    """``count`` request bodies: the payload again and again, or a conversation growing by one turn each (on
    ``wire``: the same conversation in its shape)."""
    from bench.responses_bench import CONVERT

    convert = CONVERT[wire]
    body = read_payload(payload)
    raw = orjson.dumps(convert(body))
    for i in range(count):
        if grow and i:
            body = grown(body, i - 1)
            raw = orjson.dumps(convert(body))
        yield raw


def send(port: int, path: str, raws: list[bytes]) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    for raw in raws:
        connection.request("POST", path, raw, {"Content-Type": "application/json", "Authorization": "Bearer sk-x"})
        answer = connection.getresponse()
        data = answer.read()
        if answer.status != 200:
            raise SystemExit(f"the server answered {answer.status}: {data[:300]!r}")
    connection.close()


def wait_ready(port: int, floor: bool, process: subprocess.Popen[Any], timeout: float = 300) -> None:
    """Until the server answers (under valgrind, start-up takes a minute or more)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited ({process.returncode}) before it was ready")
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            if floor:
                connection.request("POST", "/v1/chat/completions", b"{}", {"Content-Type": "application/json"})
            else:
                connection.request("GET", "/healthz")
            connection.getresponse().read()
            return
        except OSError:
            time.sleep(0.5)
    raise SystemExit("the server was not ready in time")


def instructions(out: Path) -> int:
    """The instructions of the dumps callgrind wrote when asked (``callgrind_control -d``), all threads."""
    total = 0
    for dump in out.glob("cg.*.1*"):
        for line in dump.read_text(errors="replace").splitlines():
            if line.startswith("summary:"):
                total += int(line.split()[1])
    return total


def measure(args: argparse.Namespace) -> float:
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} not found (apt-get install valgrind)")
    work = Path(tempfile.mkdtemp(prefix="ctxproxy-instr-"))
    port, upstream_port = free_port(), free_port()
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "CTXPROXY_CACHE_DIR": str(work / "cache"),
           "PROXY_PORT": str(port), "UPSTREAM_BASE": f"http://127.0.0.1:{upstream_port}/v1", "PYTHONHASHSEED": "0"}
    if args.patch:
        env["CTXPROXY_BENCH_PATCH"] = str(Path(args.patch).resolve())
    if args.counted_usage:
        env["FAKE_USAGE"] = "counted"
    upstream = subprocess.Popen([sys.executable, str(HERE / "fake_upstream.py"), "--port", str(upstream_port)],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    target = [FLOOR, str(HERE / "floor_relay.py")] if args.floor else [SERVE, str(HERE / "configs" / args.config)]
    server = subprocess.Popen(
        ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={work}/cg.%p",
         sys.executable, "-c", target[0], target[1], str(port)],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(port, args.floor, server)
        raws = [raw.ljust(args.pad_to) for raw in bodies(args.payload, args.grow, args.warm + args.requests, args.wire)]
        send(port, args.path, raws[:args.warm])
        subprocess.run(["callgrind_control", "-i", "on", str(server.pid)], check=True, capture_output=True)
        send(port, args.path, raws[args.warm:])
        subprocess.run(["callgrind_control", "-d", str(server.pid)], check=True, capture_output=True)
        subprocess.run(["callgrind_control", "-i", "off", str(server.pid)], check=True, capture_output=True)
        total = instructions(work)
        if args.keep:
            for dump in work.glob("cg.*.1*"):
                shutil.copy(dump, args.keep)
    finally:
        for process in (server, upstream):
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
        shutil.rmtree(work, ignore_errors=True)
    if total <= 0:
        raise SystemExit("callgrind wrote no count")
    return total / args.requests


def server_arguments(ap: argparse.ArgumentParser, payload: str, requests: int) -> None:
    """The arguments that say which server runs and what it is sent (this script's and ``server_opcodes.py``'s)."""
    ap.add_argument("--config", default="under_budget.yaml", help="a file in bench/configs")
    ap.add_argument("--payload", default=payload, help="a file in bench/payloads")
    ap.add_argument("--requests", type=int, default=requests, help="requests counted")
    ap.add_argument("--warm", type=int, default=30, help="requests sent before counting")
    ap.add_argument("--grow", action="store_true", help="a growing conversation instead of the same body again")
    ap.add_argument("--floor", action="store_true", help="the floor relay (bench/floor_relay.py) instead of ctxproxy")
    ap.add_argument("--wire", choices=tuple(WIRE_PATHS), default="chat",
                    help="the conversation on this wire, sent to its path")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    server_arguments(ap, "agent_long.json", 20)
    ap.add_argument("--patch", help="Python run in the server before it starts (switch a part off)")
    ap.add_argument("--counted-usage", action="store_true",
                    help="the fake upstream counts the prompt as a provider would (calibration samples every answer)")
    ap.add_argument("--path", help="where to send it (default: the wire's path)")
    ap.add_argument("--keep", help="copy callgrind's dump here (callgrind_annotate reads it)")
    ap.add_argument("--pad-to", type=int, default=0, metavar="BYTES",
                    help="end each body with spaces up to this size (wires compared at one body size)")
    args = ap.parse_args()
    if args.requests <= 0 or args.warm < 0:
        raise SystemExit("--requests must be positive and --warm not negative")
    args.path = args.path or WIRE_PATHS[args.wire]
    per = measure(args)
    what = "floor relay" if args.floor else f"ctxproxy {args.config}"
    print(f"{what}, {args.payload}{' growing' if args.grow else ''}, {args.wire}: {per:,.0f} instructions a request "
          f"({args.requests} counted after {args.warm})")


if __name__ == "__main__":
    main()
