"""Seeded coding-agent conversations with planted dependencies, for ``bench/retention.py``.

A session is what an interactive coding agent sends: a system prompt, then user turns (a task, a
follow-up), each answered by a few tool rounds (``read_file``, ``grep``, ``run_tests``, ``shell``,
``http_get``, ``edit_file``) and a closing assistant message. Tool outputs look like the real thing:
numbered source lines, grep hits, pytest logs with tracebacks, ``git log``, ``docker ps``, long JSON.

Planted dependencies: a tool output (or a user message) holds a value (a file path and a line
number, a commit hash, a port, an error code, a deployment id, a ticket id, a config value) that a
call or an assistant message of a later turn (1 to 8 turns later) uses. Every dependency is checked
after generation: the value appears, as a whole token, in no message before its source and in no
message between its source and its use; one that does (a filler number that happens to match) is
left out. The same seed gives the same conversations, byte for byte.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.retention_data import Conversation, Dependency, Message, bounded, message_text

SYSTEM = """You are a coding agent working in the user's repository through tools.
Tools: read_file(path, line?, context?) returns numbered lines; grep(pattern, path?) returns path:line: text
hits; run_tests(target) runs pytest and returns its log; shell(command) runs a shell command and returns
its output; http_get(url) fetches a URL from the development network; edit_file(path, old, new) replaces
text in a file. Read before you edit. Keep changes minimal and explain what you changed and why.
Never push to the main branch; never print secrets. When a test fails, read the failing code and the
traceback before changing anything. Quote file paths, line numbers, commit hashes and error codes exactly."""

WORDS = ("ledger", "account", "invoice", "payment", "retry", "backoff", "queue", "worker", "scheduler",
         "session", "token", "cache", "store", "client", "server", "router", "handler", "parser", "render",
         "config", "loader", "export", "import", "report", "audit", "billing", "customer", "order",
         "refund", "shipment", "inventory", "price", "tax", "currency", "webhook", "event", "stream",
         "batch", "job", "metric", "alert", "probe", "health", "gateway", "proxy", "auth", "user",
         "profile", "search", "index", "shard", "replica", "sync", "snapshot", "migrate", "schema",
         "record", "field", "column", "table", "cursor", "buffer", "codec", "frame", "packet", "socket")
PACKAGES = ("billing", "ledger", "api", "core", "workers", "sync", "reports", "gateway", "storage", "auth")
SERVICES = ("ledger-api", "billing-worker", "report-builder", "auth-gateway", "sync-daemon", "search-indexer")
PROJECTS = ("LEDG", "BILL", "OPS", "PLAT", "CORE")

TASKS = (
    "The nightly build is red again: {test} fails on main. Can you find out why and fix it?",
    "Customers report timeouts from {service}. Please investigate and tell me what is going on.",
    "Please add a retry with exponential backoff to {module}; the upstream is flaky.",
    "Can you review the recent changes to {package} and check nothing broke the invoice export?",
    "We need {module} to log the request id on every error. Can you add that?",
    "The staging deploy of {service} looks wrong. Check what is running and roll back if needed.",
    "Why does {test} pass locally but fail in CI? Dig into it.",
    "Clean up the dead code in {package} and make sure the tests still pass.",
)
FOLLOW_UPS = (
    "Thanks. While you are at it, can you also check {module}?",
    "Good. Now run the whole {package} test suite once more.",
    "OK. Before we merge, look at the error handling in {module} again.",
    "Great. One more thing: is {service} healthy now?",
)
TICKET_TASK = "This is ticket {ticket}; please reference it in the commit message when you commit."


def _name(rng: random.Random, parts: int = 2) -> str:
    return "_".join(rng.choice(WORDS) for _ in range(parts))


def _hex(rng: random.Random, n: int) -> str:
    while True:
        value = "".join(rng.choice("0123456789abcdef") for _ in range(n))
        if any(c.isdigit() for c in value) and any(c.isalpha() for c in value):
            return value


@dataclass(frozen=True)
class Use:
    """How a later turn uses a planted value: a call, with the assistant's text beside it or not."""

    tool: str
    arguments: dict[str, Any]
    text: str | None = None


@dataclass
class Planted:
    """A value held by message ``source``, to be used in turn ``due`` by ``use`` (which makes the call)."""

    kind: str
    values: tuple[str, ...]
    source: int
    due: int
    use: Callable[[], Use]


@dataclass
class Session:
    rng: random.Random
    name: str
    messages: list[Message] = field(default_factory=list)
    planted: list[Planted] = field(default_factory=list)
    dependencies: list[Dependency] = field(default_factory=list)
    used: set[str] = field(default_factory=set)
    calls: int = 0
    files: list[str] = field(default_factory=list)

    def fresh(self, make: Callable[[], str]) -> str:
        """A value never generated before in this session."""
        while True:
            value = make()
            if value not in self.used:
                self.used.add(value)
                return value

    def path(self) -> str:
        return self.fresh(lambda: f"src/{self.rng.choice(PACKAGES)}/{_name(self.rng)}.py")

    def known_file(self) -> str:
        if len(self.files) < 12 or self.rng.random() < 0.3:
            self.files.append(self.path())
        return self.rng.choice(self.files)

    def call(self, tool: str, arguments: dict[str, Any], output: str, text: str | None = None) -> int:
        """An assistant message with one call and its result; returns the result's index."""
        self.calls += 1
        cid = f"call_{self.calls:04d}{_hex(self.rng, 10)}"
        self.messages.append({"role": "assistant", "content": text, "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": tool, "arguments": json.dumps(arguments)}}]})
        self.messages.append({"role": "tool", "tool_call_id": cid, "content": output})
        return len(self.messages) - 1


# --------------------------------------------------------------------------- realistic outputs

def code_lines(rng: random.Random, start: int, count: int, planted: dict[int, str] | None = None) -> str:
    """``count`` numbered lines of plausible Python from line ``start`` (``cat -n`` style)."""
    out: list[str] = []
    indent = 0
    for n in range(start, start + count):
        if planted and n in planted:
            line = planted[n]
        else:
            r = rng.random()
            a, b = rng.choice(WORDS), rng.choice(WORDS)
            if r < 0.08:
                indent = 0
                line = f"def {a}_{b}(self, {rng.choice(WORDS)}: str, timeout: float = {rng.randint(1, 60)}.0) -> dict:"
            elif r < 0.14:
                line = "    " * max(1, indent) + f'"""{a.capitalize()} the {b} and return the {rng.choice(WORDS)}."""'
            elif r < 0.30:
                line = "    " * max(1, indent) + f"{a} = self.{b}.get({rng.choice(WORDS)}_id)"
            elif r < 0.40:
                line = "    " * max(1, indent) + f"if {a} is None or not {a}.{b}:"
                indent = max(1, indent) + 1
            elif r < 0.50:
                line = "    " * max(1, indent) + f'log.warning("{a} {b} failed for %s", {rng.choice(WORDS)}_id)'
            elif r < 0.58:
                line = "    " * max(1, indent) + f"return {{'{a}': {a}, '{b}': {b}}}"
                indent = max(1, indent - 1)
            elif r < 0.66:
                line = "    " * max(1, indent) + f"for {a} in self.{b}s:"
                indent = max(1, indent) + 1
            elif r < 0.72:
                line = ""
            elif r < 0.80:
                line = "    " * max(1, indent) + f"raise {a.capitalize()}Error(f\"{b} {{{a}!r}} not found\")"
            else:
                line = "    " * max(1, indent) + f"self.{a}_{b} = {rng.choice(WORDS)}.{rng.choice(WORDS)}()"
        out.append(f"{n:6d}\t{line}")
    return "\n".join(out)


def grep_output(rng: random.Random, session: Session, pattern: str, hit: str | None = None) -> str:
    lines = []
    for _ in range(rng.randint(14, 36)):
        lines.append(f"{session.known_file()}:{rng.randint(1, 220)}:    {pattern}_{rng.choice(WORDS)}("
                     f"{rng.choice(WORDS)}, {rng.choice(WORDS)}={rng.choice(WORDS)})")
    if hit is not None:
        lines.insert(rng.randint(0, len(lines)), hit)
    return "\n".join(lines)


def test_log(rng: random.Random, session: Session, target: str, error: str | None) -> str:
    passed = rng.randint(40, 160)
    lines = ["============================= test session starts ==============================",
             "platform linux -- Python 3.11.7, pytest-8.3.2, pluggy-1.5.0",
             f"rootdir: /home/dev/{session.name}", "plugins: asyncio-0.23.8, timeout-2.3.1",
             f"collected {passed + (1 if error else 0)} items", ""]
    for i in range(rng.randint(12, 30)):
        pct = min(99, (i + 1) * 100 // 31)
        lines.append(f"tests/{rng.choice(PACKAGES)}/test_{_name(rng)}.py::test_{_name(rng)} PASSED [{pct:3d}%]")
    if error is not None:
        path = session.known_file()
        lines += ["", "=================================== FAILURES ===================================",
                  f"_______________________ {target} _______________________", "",
                  f"    def {target.rsplit('::', 1)[-1]}(client):",
                  f"        resp = client.post('/v1/{rng.choice(WORDS)}', json=payload)",
                  ">       assert resp.status_code == 200",
                  "E       assert 503 == 200", "",
                  f"{path}:{rng.randint(20, 220)}: in {rng.choice(WORDS)}_{rng.choice(WORDS)}",
                  f"    raise {rng.choice(WORDS).capitalize()}Error(code)",
                  f"E   {rng.choice(WORDS).capitalize()}LockTimeout: {error} lock held by worker-{rng.randint(2, 9)} "
                  f"for {rng.randint(20, 90)}.{rng.randint(0, 9)}s", "",
                  "=========================== short test summary info ============================",
                  f"FAILED {target} - assert 503 == 200",
                  f"==================== 1 failed, {passed} passed in {rng.randint(3, 40)}.{rng.randint(10, 99)}s "
                  "===================="]
    else:
        lines.append(f"============================== {passed} passed in {rng.randint(3, 40)}.{rng.randint(10, 99)}s "
                     "===============================")
    return "\n".join(lines)


def git_log(rng: random.Random, hashes: list[str]) -> str:
    out = []
    for h in hashes:
        out.append(f"{h} {rng.choice(['Fix', 'Add', 'Refactor', 'Revert', 'Bump', 'Tidy'])} "
                   f"{rng.choice(WORDS)} {rng.choice(WORDS)} in {rng.choice(PACKAGES)}")
    return "\n".join(out)


def docker_ps(rng: random.Random, rows: list[tuple[str, str]]) -> str:
    out = ["CONTAINER ID   IMAGE                                   STATUS          PORTS                     NAMES"]
    for service, port in rows:
        out.append(f"{_hex(rng, 12)}   registry.local/{service}:1.{rng.randint(0, 30)}.{rng.randint(0, 9)}      "
                   f"Up {rng.randint(2, 59)} minutes   0.0.0.0:{port}->8080/tcp   {service}-{rng.randint(1, 3)}")
    return "\n".join(out)


def deployments_json(rng: random.Random, ids: list[str]) -> str:
    items = []
    for dep in ids:
        items.append({
            "id": dep, "service": rng.choice(SERVICES),
            "image": f"registry.local/{rng.choice(SERVICES)}:1.{rng.randint(0, 30)}.{rng.randint(0, 9)}",
            "created_at": f"2026-11-{rng.randint(10, 28)}T{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:00Z",
            "replicas": rng.randint(1, 6), "status": rng.choice(["running", "running", "degraded", "stopped"]),
            "env": {"LOG_LEVEL": rng.choice(["info", "debug"]), "REGION": rng.choice(["eu-west-1", "us-east-2"])},
            "checks": [{"name": f"{rng.choice(WORDS)}-probe", "ok": rng.random() < 0.8,
                        "latency_ms": round(rng.uniform(1, 90), 1)} for _ in range(rng.randint(1, 3))],
        })
    return json.dumps({"deployments": items, "total": len(items), "page": 1}, indent=2)


# --------------------------------------------------------------------------- one session

def _filler(session: Session) -> None:
    """A tool round that plants nothing (reading, searching, listing)."""
    rng = session.rng
    r = rng.random()
    if r < 0.45:
        path = session.known_file()
        session.call("read_file", {"path": path}, code_lines(rng, 1, rng.randint(60, 200)))
    elif r < 0.75:
        pattern = rng.choice(WORDS)
        session.call("grep", {"pattern": pattern}, grep_output(rng, session, pattern))
    elif r < 0.9:
        session.call("shell", {"command": "ls -la " + session.known_file().rsplit("/", 1)[0]},
                     "\n".join(f"-rw-r--r--  1 dev dev {rng.randint(200, 9000):5d} Nov {rng.randint(1, 28):2d} "
                               f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d} {_name(rng)}.py"
                               for _ in range(rng.randint(8, 24))))
    else:
        target = f"tests/{rng.choice(PACKAGES)}/test_{_name(rng)}.py"
        session.call("run_tests", {"target": target}, test_log(rng, session, target, None))


def _plant(session: Session, due: int) -> None:
    """A tool round whose output holds a value that the turn (or round) ``due`` will use."""
    rng = session.rng
    kind = rng.choice(["grep_line", "commit", "port", "error_code", "deployment", "config"])
    if kind == "grep_line":
        path = session.path()
        line = str(rng.randint(300, 2400))
        pattern = rng.choice(WORDS)
        hit = f"{path}:{line}:    {pattern}_{rng.choice(WORDS)}(self.{rng.choice(WORDS)}, retries=None)"
        source = session.call("grep", {"pattern": pattern}, grep_output(rng, session, pattern, hit))
        session.planted.append(Planted(kind, (path, line), source, due,
                                       lambda: Use("read_file", {"path": path, "line": int(line), "context": 30})))
    elif kind == "commit":
        hashes = [session.fresh(lambda: _hex(rng, 7)) for _ in range(rng.randint(15, 30))]
        chosen = rng.choice(hashes)
        source = session.call("shell", {"command": f"git log --oneline -n {len(hashes)}"}, git_log(rng, hashes))
        session.planted.append(Planted(kind, (chosen,), source, due,
                                       lambda: Use("shell", {"command": f"git show --stat {chosen}"})))
    elif kind == "port":
        rows = [(rng.choice(SERVICES), session.fresh(lambda: str(rng.randint(20000, 60999))))
                for _ in range(rng.randint(4, 9))]
        _, port = rng.choice(rows)
        source = session.call("shell", {"command": "docker ps"}, docker_ps(rng, rows))
        session.planted.append(Planted(kind, (port,), source, due,
                                       lambda: Use("http_get", {"url": f"http://localhost:{port}/health"})))
    elif kind == "error_code":
        code = session.fresh(lambda: f"E{rng.randint(1000, 9999)}")
        target = f"tests/{rng.choice(PACKAGES)}/test_{_name(rng)}.py::test_{_name(rng)}"
        source = session.call("run_tests", {"target": target.split("::")[0]}, test_log(rng, session, target, code))
        if rng.random() < 0.5:
            session.planted.append(Planted(kind, (code,), source, due, lambda: Use("grep", {"pattern": code})))
        else:
            session.planted.append(Planted(kind, (code,), source, due, lambda: Use(
                "grep", {"pattern": "release_lock"},
                f"The earlier failure was lock timeout {code}; that is the same lock the worker holds here, "
                "so the fix has to release it before the retry. Let me find where it is released.")))
    elif kind == "deployment":
        ids = [session.fresh(lambda: "dep-" + _hex(rng, 8)) for _ in range(rng.randint(8, 18))]
        chosen = rng.choice(ids)
        source = session.call("http_get", {"url": "http://deploy.internal/api/v2/deployments?env=staging"},
                              deployments_json(rng, ids))
        session.planted.append(Planted(kind, (chosen,), source, due, lambda: Use(
            "http_get", {"url": f"http://deploy.internal/api/v2/deployments/{chosen}/rollback"})))
    else:
        path = session.path()
        name = session.fresh(lambda: f"{rng.choice(WORDS).upper()}_{rng.choice(WORDS).upper()}_MS")
        value = session.fresh(lambda: str(rng.randint(1000, 9999) * 10 + 5))
        start = rng.randint(1, 40)
        count = rng.randint(80, 200)
        at = rng.randint(start, start + count - 1)
        source = session.call("read_file", {"path": path},
                              code_lines(rng, start, count, {at: f"{name} = {value}  # tuned for staging"}))
        session.planted.append(Planted(kind, (value,), source, due, lambda: Use(
            "edit_file", {"path": path, "old": f"{name} = {value}", "new": f"{name} = {int(value) * 2}"})))


def _ticket(session: Session, due: int) -> str:
    """A user message's ticket id, to be quoted in the commit of turn (or round) ``due``."""
    rng = session.rng
    ticket = session.fresh(lambda: f"{rng.choice(PROJECTS)}-{rng.randint(1000, 9999)}")
    source = len(session.messages)
    session.planted.append(Planted("ticket", (ticket,), source, due, lambda: Use(
        "shell", {"command": f"git commit -am '{ticket}: {rng.choice(WORDS)} {rng.choice(WORDS)} fix'"})))
    return TICKET_TASK.format(ticket=ticket)


def session(seed: int, turns: int = 16) -> Conversation:
    """One coding-agent conversation (about 3.5k tokens a turn)."""
    rng = random.Random(seed)
    s = Session(rng, f"repo-{seed:02d}")
    s.messages.append({"role": "system", "content": SYSTEM})
    for turn in range(turns):
        fill = {"test": f"tests/{rng.choice(PACKAGES)}/test_{_name(rng)}.py", "service": rng.choice(SERVICES),
                "module": s.known_file(), "package": rng.choice(PACKAGES)}
        text = rng.choice(TASKS if turn == 0 or rng.random() < 0.6 else FOLLOW_UPS).format(**fill)
        if rng.random() < 0.3:
            text += " " + _ticket(s, turn + rng.randint(2, 8))
        s.messages.append({"role": "user", "content": text})
        due = [p for p in s.planted if p.due == turn]
        rounds = rng.randint(2, 4)
        for i in range(max(rounds, len(due) + 1)):
            if due:
                p = due.pop(0)
                use = p.use()
                s.call(use.tool, use.arguments, _result_of(rng, s, use), use.text)
                s.dependencies.extend(Dependency(v, p.source, len(s.messages) - 2, p.kind) for v in p.values)
            elif i < 2 and rng.random() < 0.7:
                _plant(s, turn + rng.randint(1, 8))
            else:
                _filler(s)
        s.messages.append({"role": "assistant", "content": _closing(rng)})
        s.planted = [p for p in s.planted if p.due > turn]
    return Conversation(s.name, s.messages, _checked(s.messages, s.dependencies))


def _result_of(rng: random.Random, s: Session, use: Use) -> str:
    tool, args = use.tool, use.arguments
    if tool == "read_file":
        line = int(args["line"])
        return code_lines(rng, line - 30, 61)
    if tool == "http_get":
        return json.dumps({"status": "ok", "uptime_s": rng.randint(100, 90000), "checks": {"db": "ok", "queue": "ok"}})
    if tool == "edit_file":
        return "Replaced 1 occurrence."
    if tool == "grep":
        return grep_output(rng, s, rng.choice(WORDS))
    return "\n".join(f" {s.known_file()} | {rng.randint(1, 40)} {'+' * rng.randint(1, 12)}{'-' * rng.randint(0, 6)}"
                     for _ in range(rng.randint(2, 6)))


def _closing(rng: random.Random) -> str:
    return rng.choice([
        "Done. I read the failing code, made the smallest change that fixes it and re-ran the tests; they pass.",
        "Here is what I found: the retry loop holds the lock while it sleeps, so other workers time out. "
        "I changed it to release the lock first.",
        "I checked the recent changes; nothing else touches that code path. No further changes needed.",
        "The service is healthy again after the change. I left the configuration as it was otherwise.",
    ])


def _checked(messages: list[Message], dependencies: list[Dependency]) -> list[Dependency]:
    """The dependencies whose value no message before the source, or between source and use, contains."""
    texts = [message_text(m) for m in messages]
    out = []
    for dep in dependencies:
        pattern = bounded(dep.value)
        if pattern.search(texts[dep.source]) is None:
            continue
        others = [i for i in range(dep.use) if i != dep.source]
        if any(dep.value in texts[i] and pattern.search(texts[i]) for i in others):
            continue
        out.append(dep)
    return out


def loop(seed: int, rounds: int = 45) -> Conversation:
    """One task and a long tool loop, as SWE-agent runs: one user message, then ``rounds`` tool rounds.

    Planted values are used 3 to 25 rounds later; everything after the user message is the current
    turn's working memory, which ctxproxy's context managers never touch (only the working-memory cap
    and the trimmer do).
    """
    rng = random.Random(seed)
    s = Session(rng, f"loop-{seed:02d}")
    s.messages.append({"role": "system", "content": SYSTEM})
    fill = {"test": f"tests/{rng.choice(PACKAGES)}/test_{_name(rng)}.py", "service": rng.choice(SERVICES),
            "module": s.known_file(), "package": rng.choice(PACKAGES)}
    text = rng.choice(TASKS).format(**fill) + " " + _ticket(s, rng.randint(rounds // 2, rounds - 1))
    s.messages.append({"role": "user", "content": text})
    for r in range(rounds):
        due = [p for p in s.planted if p.due <= r]
        if due:
            p = due[0]
            s.planted.remove(p)
            use = p.use()
            s.call(use.tool, use.arguments, _result_of(rng, s, use), use.text)
            s.dependencies.extend(Dependency(v, p.source, len(s.messages) - 2, p.kind) for v in p.values)
        elif rng.random() < 0.35:
            _plant(s, r + rng.randint(3, 25))
        else:
            _filler(s)
    s.messages.append({"role": "assistant", "content": _closing(rng)})
    return Conversation(s.name, s.messages, _checked(s.messages, s.dependencies))


def loops(count: int = 10, seed: int = 7, rounds: int = 45) -> list[Conversation]:
    """``count`` tool loops, each seeded from ``seed``."""
    return [loop(seed * 1000 + 500 + i, rounds) for i in range(count)]


def conversations(count: int = 10, seed: int = 7, turns: int = 16) -> list[Conversation]:
    """``count`` sessions, each seeded from ``seed``: the same arguments give the same conversations."""
    return [session(seed * 1000 + i, turns) for i in range(count)]

