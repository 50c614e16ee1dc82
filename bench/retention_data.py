"""The retention benchmark's conversations: tau-bench as recorded, tau-bench sessions, and their dependencies.

A conversation is a list of Chat Completions messages plus its dependencies: a value that a later
message uses (in a tool call's arguments, or in assistant text) and that first appeared in an earlier
tool output or user message. tau-bench's dependencies are detected here; the coding-agent
conversations of ``bench/coding_agent.py`` carry planted ones.

The tau-bench data is the repository's own copy (``tests/data``, MIT licence, provenance in
``tests/data/README.md``); it is read with the standard library, and nothing is fetched.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TAU_BENCH = ROOT / "tests" / "data" / "tau-bench-airline.json.gz"

Message = dict[str, Any]

# A value is at least this long (0, 1, 30 or "no" appear everywhere by chance) and at most this long
# (a longer argument is free text: its ids, numbers, dates, paths, URLs and emails are the values).
MIN_VALUE = 3
MAX_VALUE = 80


@dataclass(frozen=True)
class Dependency:
    """``value`` first appears in message ``source`` and is used by message ``use`` (an assistant message)."""

    value: str
    source: int
    use: int
    kind: str = "detected"


@dataclass
class Conversation:
    name: str
    messages: list[Message]
    dependencies: list[Dependency] = field(default_factory=list)


def request_points(messages: list[Message]) -> list[int]:
    """Where the agent's model is called: before every assistant message, and at the end unless it is one.

    Each point n is the request ``messages[:n]``, which ends with a user message or tool results.
    """
    points = [n for n in range(1, len(messages)) if messages[n].get("role") == "assistant"]
    if messages and messages[-1].get("role") != "assistant":
        points.append(len(messages))
    return points


# --------------------------------------------------------------------------- values

_TOKEN = re.compile(r"[^\s\"'`()\[\]{}<>;|*]+")
_EMAIL = re.compile(r"^[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+$")
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2})?)?$")
_NUMBER = re.compile(r"^\$?\d[\d,]*(?:\.\d+)?%?$")
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:#-]*$")


def text_values(text: str) -> Iterator[str]:
    """The ids, numbers, dates, paths, URLs and emails in free text.

    A whitespace-delimited token (quotes, brackets and trailing punctuation stripped) is a value when
    it is a URL, an email, an ISO date, a path (has a ``/``), a number with at least three digits, or
    an id (letters and digits mixed, at least four characters, ``_ - . :`` allowed inside).
    """
    for match in _TOKEN.finditer(text):
        token = match.group().rstrip(".,:!?").lstrip("#")
        if len(token) < MIN_VALUE or len(token) > MAX_VALUE:
            continue
        if token.startswith(("http://", "https://")) or _EMAIL.match(token) or _DATE.match(token):
            yield token
        elif "/" in token:
            if any(c.isalnum() for c in token) and not token.startswith("//"):
                yield token
        elif _NUMBER.match(token):
            number = token.strip("$%")
            if sum(c.isdigit() for c in number) >= 3:
                yield number
        elif _ID.match(token) and len(token) >= 4 and any(c.isdigit() for c in token) \
                and any(c.isalpha() for c in token):
            yield token


def argument_values(arguments: Any) -> Iterator[str]:
    """The values of a tool call's arguments: every short string or number leaf; in long text, its values."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            yield from text_values(arguments)
            return
    yield from _leaves(arguments)


def _leaves(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for value in node.values():
            yield from _leaves(value)
    elif isinstance(node, list):
        for value in node:
            yield from _leaves(value)
    elif isinstance(node, bool) or node is None:
        return
    elif isinstance(node, (int, float)):
        text = str(int(node)) if isinstance(node, float) and node.is_integer() else str(node)
        if len(text.lstrip("-")) >= MIN_VALUE:
            yield text
    elif isinstance(node, str):
        stripped = node.strip()
        if MIN_VALUE <= len(stripped) <= MAX_VALUE and "\n" not in stripped:
            yield stripped
        elif len(stripped) > MAX_VALUE or "\n" in stripped:
            yield from text_values(stripped)


def message_text(message: Message) -> str:
    """A Chat Completions message's text: its content (text parts), and its calls' names and arguments."""
    parts: list[str] = []
    content = message.get("content")
    if isinstance(content, str):
        parts.append(content)
    elif isinstance(content, list):
        parts.extend(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            parts.append(f"{function.get('name')}({function.get('arguments')})")
    return "\n".join(parts)


def acted_values(message: Message) -> list[str]:
    """The values a message acted on: its calls' arguments, and the values in user and assistant text.

    Tool outputs and system text have none (what an output holds is counted when a later message uses it).
    """
    role = message.get("role")
    if role not in ("user", "assistant"):
        return []
    out: list[str] = []
    content = message.get("content")
    if isinstance(content, str):
        out.extend(text_values(content))
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                out.extend(text_values(part["text"]))
    out.extend(call_values(message))
    return list(dict.fromkeys(out))


def call_values(message: Message) -> list[str]:
    """The values of a message's tool-call arguments."""
    out: list[str] = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            out.extend(argument_values(function.get("arguments")))
    return list(dict.fromkeys(out))


def bounded(value: str) -> re.Pattern[str]:
    """``value`` as a whole token: not inside a longer run of letters, digits or underscores."""
    return re.compile(r"(?<![A-Za-z0-9_])" + re.escape(value) + r"(?![A-Za-z0-9_])")


def contains(text: str, value: str, pattern: re.Pattern[str] | None = None) -> bool:
    return value in text and (pattern or bounded(value)).search(text) is not None


# --------------------------------------------------------------------------- tau-bench


def tau_trajectories(path: Path = TAU_BENCH) -> list[dict[str, Any]]:
    data: list[dict[str, Any]] = json.loads(gzip.decompress(path.read_bytes()))
    return data


def detect_dependencies(messages: list[Message]) -> list[Dependency]:
    """Every value of a call's arguments that first appeared in an earlier tool output or user message.

    First appearance is looked for in every earlier message's text (system included, as a whole
    token); a value the system prompt or the assistant itself introduced first is not a dependency.
    """
    texts = [message_text(m) for m in messages]
    out: list[Dependency] = []
    for use, message in enumerate(messages):
        if message.get("role") != "assistant" or not message.get("tool_calls"):
            continue
        for value in call_values(message):
            pattern = bounded(value)
            first = next((i for i in range(use) if contains(texts[i], value, pattern)), None)
            if first is not None and messages[first].get("role") in ("tool", "user"):
                out.append(Dependency(value, first, use))
    return out


def tau_conversations(path: Path = TAU_BENCH) -> list[Conversation]:
    """The 200 tau-bench airline trajectories, one conversation each, as recorded."""
    out = []
    for i, record in enumerate(tau_trajectories(path)):
        messages = record["traj"]
        out.append(Conversation(f"tau-{i:03d}-task{record['task_id']}", messages, detect_dependencies(messages)))
    return out


def tau_sessions(path: Path = TAU_BENCH, min_tokens: int = 40_000, count: Any = None) -> list[Conversation]:
    """Consecutive tau-bench trajectories chained into long sessions (one agent, one system prompt).

    A session takes trajectories in file order until its messages hold ``min_tokens`` (``count``
    counts a message's tokens; default: its JSON length / 4); the last, shorter remainder is dropped.
    Dependencies are detected on the whole session, so a value a later customer's call reuses from an
    earlier customer's tool output counts too.
    """
    size = count or (lambda m: len(json.dumps(m)) // 4)
    out: list[Conversation] = []
    current: list[Message] = []
    tokens = 0
    start = 0
    for i, record in enumerate(tau_trajectories(path)):
        traj = record["traj"]
        if not current:
            current = [traj[0]]
            tokens = size(traj[0])
            start = i
        body = [m for m in traj if m.get("role") != "system"]
        current.extend(body)
        tokens += sum(size(m) for m in body)
        if tokens >= min_tokens:
            out.append(Conversation(f"tau-session-{start:03d}-{i:03d}", current, detect_dependencies(current)))
            current = []
    return out
