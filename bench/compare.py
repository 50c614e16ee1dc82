#!/usr/bin/env python3
"""Direct-to-upstream vs through-a-proxy, measured in one run, alternating.

Starts fake_upstream.py and the proxy under test, then for every round, payload and
concurrency runs run_load.sh (wrk) against the upstream and against the proxy, in
alternating order (ABBA across rounds), and prints medians over rounds:
rps, p50/p99, proxy overhead (proxy minus direct), ratios, and CPU ms per request
of the proxy process tree. Every process it starts is stopped by PID at the end.

The proxy command is a shell string; in it {port}, {upstream} (upstream base URL, ending
in /v1) and {here} (this folder) are replaced, and PROXY_PORT, UPSTREAM_BASE and
UPSTREAM_PORT are exported to it. Example (LiteLLM):
  compare.py --proxy-cmd 'litellm --config {here}/litellm_config.yaml --host 127.0.0.1 --port {port}'
"""
import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request

from make_payloads import payload_file

HERE = os.path.dirname(os.path.abspath(__file__))
TICK = os.sysconf("SC_CLK_TCK")
started = []  # Popen objects, stopped in stop_all()


def children_map():
    kids = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open("/proc/%s/stat" % d) as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    return kids


def tree(pid):
    """pid and all its descendants, by parent PID."""
    kids, out, todo = children_map(), [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def cpu_seconds(pid):
    total = 0
    for p in tree(pid):
        try:
            with open("/proc/%d/stat" % p) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime + stime
        except (OSError, IndexError, ValueError):
            pass
    return total / TICK


def stop_all():
    pids = []
    for proc in started:
        if proc.poll() is None:
            pids += tree(proc.pid)
    for p in pids:
        try:
            os.kill(p, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.time() + 10
    for proc in started:
        try:
            proc.wait(max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            pass
    for p in pids:  # anything left (including grandchildren) gets SIGKILL
        try:
            os.kill(p, 0)
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    started.clear()


def start(cmd, log_path, env=None):
    log = open(log_path, "w")
    proc = subprocess.Popen(["bash", "-c", "exec " + cmd], stdout=log, stderr=subprocess.STDOUT,
                            env=env, start_new_session=True, cwd=HERE)
    started.append(proc)
    return proc


def post(url, body, timeout=30):
    req = urllib.request.Request(url, data=body, method="POST", headers={
        "Content-Type": "application/json", "Authorization": "Bearer sk-bench"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read()


def wait_ready(url, body, proc, timeout):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            sys.exit("process exited early (rc=%s); see its log" % proc.returncode)
        try:
            if post(url, body, timeout=5)[0] == 200:
                return time.time() - t0
        except Exception:
            pass
        time.sleep(0.3)
    sys.exit("not ready after %ss: %s" % (timeout, url))


def load(url, payload, duration, conns):
    proc = subprocess.Popen([os.path.join(HERE, "run_load.sh"), url, payload, duration, str(conns)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    started.append(proc)  # so an interrupt stops the load generator too
    out = proc.communicate(timeout=600)[0]
    started.remove(proc)
    m = re.search(r"^BENCH (.*)$", out, re.M)
    if not m:
        sys.exit("no BENCH line from run_load.sh:\n" + out)
    return {k: float(v) for k, v in (kv.split("=") for kv in m.group(1).split())}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--proxy-cmd", required=True)
    ap.add_argument("--label", default="proxy")
    ap.add_argument("--proxy-port", type=int, default=14000)
    ap.add_argument("--upstream-port", type=int, default=18001)
    ap.add_argument("--proxy-path", default="/v1/chat/completions")
    ap.add_argument("--payloads", default="small.json,agent_long.json")
    ap.add_argument("--conns", default="1,32")
    ap.add_argument("--duration", default="10s")
    ap.add_argument("--warmup", default="2s")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ready-timeout", type=float, default=240)
    ap.add_argument("--log-dir", default=os.path.join(HERE, "logs"))
    ap.add_argument("--json-out", help="write every raw measurement here")
    a = ap.parse_args()

    os.makedirs(a.log_dir, exist_ok=True)
    upstream_base = "http://127.0.0.1:%d/v1" % a.upstream_port
    direct_url = upstream_base + "/chat/completions"
    proxy_url = "http://127.0.0.1:%d%s" % (a.proxy_port, a.proxy_path)
    payloads = [payload_file(p, os.path.join(a.log_dir, "payloads")) for p in a.payloads.split(",")]
    conns = [int(c) for c in a.conns.split(",")]
    small = open(payloads[0], "rb").read()

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        up = start("%s %s --host 127.0.0.1 --port %d" % (sys.executable, os.path.join(HERE, "fake_upstream.py"),
                                                          a.upstream_port), os.path.join(a.log_dir, "upstream.log"))
        wait_ready(direct_url, small, up, 30)
        env = dict(os.environ, PROXY_PORT=str(a.proxy_port), UPSTREAM_BASE=upstream_base,
                   UPSTREAM_PORT=str(a.upstream_port))
        cmd = a.proxy_cmd.format(port=a.proxy_port, upstream=upstream_base, here=HERE)
        px = start(cmd, os.path.join(a.log_dir, a.label + ".log"), env)
        secs = wait_ready(proxy_url, small, px, a.ready_timeout)
        print("# %s ready after %.1fs: %s" % (a.label, secs, a.proxy_cmd), file=sys.stderr)

        # forwarding check: the upstream must see every message of each payload
        for p in payloads:
            body = open(p, "rb").read()
            post(proxy_url, body)
            with urllib.request.urlopen("http://127.0.0.1:%d/_last" % a.upstream_port) as r:
                got = json.load(r)["n_messages"]
            want = len(json.loads(body)["messages"])
            print("# forwarding %s: %s/%s messages %s" % (os.path.basename(p), got, want,
                                                          "OK" if got == want else "MISMATCH"), file=sys.stderr)

        targets = {"direct": (direct_url, up), "proxy": (proxy_url, px)}
        for name, (url, _) in targets.items():
            for p in payloads:
                for c in conns:
                    load(url, p, a.warmup, c)

        raw = []
        for r in range(a.rounds):
            for i, p in enumerate(payloads):
                for j, c in enumerate(conns):
                    order = ["direct", "proxy"] if (r + i + j) % 2 == 0 else ["proxy", "direct"]
                    for name in order:
                        url, proc = targets[name]
                        cpu0 = cpu_seconds(proc.pid)
                        res = load(url, p, a.duration, c)
                        res["cpu_ms_per_req"] = (cpu_seconds(proc.pid) - cpu0) * 1000 / max(1, res["requests"])
                        res.update(round=r, payload=os.path.basename(p), conns=c, target=name)
                        raw.append(res)
                        print("# r%d %-15s c=%-3d %-6s rps=%9.1f p50=%8.2fms p99=%8.2fms cpu/req=%.2fms err=%d" % (
                            r, res["payload"], c, name, res["rps"], res["p50_ms"], res["p99_ms"],
                            res["cpu_ms_per_req"], res["non2xx"] + res["timeouts"] + res["read_err"]),
                            file=sys.stderr)
    finally:
        stop_all()

    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(raw, f, indent=1)
    med = lambda rows, k: statistics.median(x[k] for x in rows)
    print("\n%s vs direct: median of %d rounds x %s, wrk -t1, 2 payloads x %s connections\n"
          % (a.label, a.rounds, a.duration, a.conns))
    print("| payload | conns | direct rps | proxy rps (min-max) | rps ratio | direct p50 | proxy p50 | +p50 "
          "| direct p99 | proxy p99 | +p99 | p50 ratio | proxy CPU/req | upstream CPU/req | errors |")
    print("|" + "---|" * 15)
    for p in payloads:
        for c in conns:
            rows = {t: [x for x in raw if x["payload"] == os.path.basename(p) and x["conns"] == c and x["target"] == t]
                    for t in ("direct", "proxy")}
            d, x = rows["direct"], rows["proxy"]
            errs = sum(y["non2xx"] + y["timeouts"] + y["read_err"] + y["connect_err"] for y in d + x)
            print("| %s | %d | %.0f | %.1f (%.1f-%.1f) | %.3f | %.2f ms | %.2f ms | %+.2f ms | %.2f ms | %.2f ms "
                  "| %+.2f ms | %.1fx | %.2f ms | %.2f ms | %d |" % (
                      os.path.basename(p), c, med(d, "rps"), med(x, "rps"), min(y["rps"] for y in x),
                      max(y["rps"] for y in x), med(x, "rps") / med(d, "rps"), med(d, "p50_ms"), med(x, "p50_ms"),
                      med(x, "p50_ms") - med(d, "p50_ms"), med(d, "p99_ms"), med(x, "p99_ms"),
                      med(x, "p99_ms") - med(d, "p99_ms"), med(x, "p50_ms") / med(d, "p50_ms"),
                      med(x, "cpu_ms_per_req"), med(d, "cpu_ms_per_req"), errs))


if __name__ == "__main__":
    main()
