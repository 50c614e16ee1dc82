"""What ``bench/retention.py`` measures on each forwarded request, and how the figures add up.

Everything is read from the outside: the conversation the client sent (Chat Completions messages)
and the body the pipeline would forward. A forwarded message is "kept" when the same JSON object
(canonical: sorted keys) is forwarded, in order; anything else the pipeline forwards (a summary, a
masked tool result) is new. Definitions (docs/quality.md says the same in words):

- tokens forwarded: the pipeline's own count after management over its count before, summed over
  requests;
- dependency answerable: its value appears, as a whole token, in the text of the context forwarded
  for the request that precedes its use (checked once per dependency); "source forgotten" counts
  those whose source message was not forwarded verbatim for that request (dropped, masked or
  summarised) and the share of them still answerable (a refused request forgets everything);
- values kept: for each request, the values (ids, numbers, dates, paths, URLs, emails; a call's
  arguments) of the user and assistant messages of every turn with a message not forwarded verbatim,
  less those the system prompt holds; the share of them that appears in the forwarded text, summed
  over requests; "argument values kept" is the same for the values of the calls' arguments alone;
  a refused request (context_length_exceeded) forgets every value and dependency it had, and breaks
  the prefix on both sides;
- prefix kept: the share of consecutive requests of a conversation whose forwarded messages start
  with the previous request's forwarded messages; and the mean share of the later request's
  forwarded tokens (tokens of the messages' JSON) inside the common prefix.
"""

from __future__ import annotations

import difflib
import json
import re
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from bench.retention_data import Conversation, Dependency, acted_values, bounded, call_values


def canonical(message: Any) -> bytes:
    return orjson.dumps(message, option=orjson.OPT_SORT_KEYS)


def strings(node: Any) -> Iterator[str]:
    """Every string and number in a message, wire-neutral; a string holding JSON (call arguments) is read too."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key not in ("role", "type"):
                yield from strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from strings(value)
    elif isinstance(node, str):
        yield node
        if node[:1] in ("{", "["):
            try:
                parsed = json.loads(node)
            except ValueError:
                return
            yield from strings(parsed)
    elif isinstance(node, bool) or node is None:
        return
    elif isinstance(node, float) and node.is_integer():
        yield str(int(node))
    elif isinstance(node, (int, float)):
        yield str(node)


def kept_positions(received: list[bytes], forwarded: list[bytes]) -> list[bool]:
    """For each received element, whether it is forwarded verbatim: the two lists aligned in order
    (``difflib``'s longest matching blocks), so a repeated message ("Go on.") is not matched out of place."""
    out = [False] * len(received)
    matcher = difflib.SequenceMatcher(None, received, forwarded, autojunk=False)
    for block in matcher.get_matching_blocks():
        for i in range(block.a, block.a + block.size):
            out[i] = True
    return out


def common_prefix(a: list[bytes], b: list[bytes]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class Subject:
    """One conversation, prepared for measuring: per-message keys, turns, values, and the value index."""

    conversation: Conversation
    turn_of: list[int] = field(init=False)
    acted: list[frozenset[str]] = field(init=False)
    arguments: list[frozenset[str]] = field(init=False)
    due: dict[int, list[Dependency]] = field(init=False)
    patterns: dict[str, re.Pattern[str]] = field(init=False)
    _present: dict[bytes, frozenset[str]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        messages = self.conversation.messages
        turn = -1
        self.turn_of = []
        for m in messages:
            if m.get("role") == "user":
                turn += 1
            self.turn_of.append(turn)
        system = "\n".join(s for m in messages if m.get("role") in ("system", "developer") for s in strings(m))
        acted = [frozenset(acted_values(m)) for m in messages]
        universe = {v for values in acted for v in values} | {d.value for d in self.conversation.dependencies}
        self.patterns = {v: bounded(v) for v in sorted(universe)}
        in_system = {v for v, p in self.patterns.items() if v in system and p.search(system)}
        self.acted = [values - in_system for values in acted]
        self.arguments = [frozenset(call_values(m)) - in_system for m in messages]
        self.due = defaultdict(list)
        for dep in self.conversation.dependencies:
            self.due[dep.use].append(dep)

    def present(self, key: bytes, message: Any) -> frozenset[str]:
        """The values (of this conversation's universe) a message's text holds, memoised by its JSON."""
        found = self._present.get(key)
        if found is None:
            text = "\n".join(strings(message))
            found = frozenset(v for v, p in self.patterns.items() if v in text and p.search(text))
            self._present[key] = found
        return found


@dataclass
class Totals:
    """The figures of one strategy × budget × data set, summed over requests."""

    requests: int = 0
    managed: int = 0
    refused: int = 0
    tokens_before: int = 0
    tokens_after: int = 0
    dependencies: int = 0
    answerable: int = 0
    forgotten: int = 0  # dependencies whose source message was not forwarded verbatim
    forgotten_answerable: int = 0
    values: int = 0
    values_kept: int = 0
    argument_values: int = 0
    argument_values_kept: int = 0
    pairs: int = 0
    prefix_kept: int = 0
    prefix_token_share: float = 0.0
    summariser_calls: int = 0
    summariser_prompt_tokens: int = 0
    removed: dict[str, int] = field(default_factory=dict)

    def add(self, other: Totals) -> None:
        for name in self.__dataclass_fields__:
            if name == "removed":
                for k, v in other.removed.items():
                    self.removed[k] = self.removed.get(k, 0) + v
            else:
                setattr(self, name, getattr(self, name) + getattr(other, name))

    def figures(self) -> dict[str, Any]:
        """The table's figures (percentages; None where nothing was there to measure)."""
        def pct(part: float, whole: float) -> float | None:
            return round(100.0 * part / whole, 1) if whole else None

        return {
            "requests": self.requests,
            "managed_pct": pct(self.managed, self.requests),
            "refused": self.refused,
            "tokens_forwarded_pct": pct(self.tokens_after, self.tokens_before),
            "dependencies": self.dependencies,
            "dependencies_answerable_pct": pct(self.answerable, self.dependencies),
            "forgotten_sources": self.forgotten,
            "forgotten_answerable_pct": pct(self.forgotten_answerable, self.forgotten),
            "values": self.values,
            "values_kept_pct": pct(self.values_kept, self.values),
            "argument_values": self.argument_values,
            "argument_values_kept_pct": pct(self.argument_values_kept, self.argument_values),
            "pairs": self.pairs,
            "prefix_kept_pct": pct(self.prefix_kept, self.pairs),
            "prefix_token_share_pct": pct(self.prefix_token_share, self.pairs),
            "summariser_calls": self.summariser_calls,
            "summariser_prompt_tokens": self.summariser_prompt_tokens,
            "removed": dict(sorted(self.removed.items())),
        }


class Meter:
    """Measures the requests of one conversation, in order, into ``totals``.

    A request's elements are its body's conversation entries (``bench/retention_wires.py``); each
    names the chat messages it came from, on which turns, values and dependencies are counted.
    """

    def __init__(self, subject: Subject, totals: Totals, tokens: Callable[[bytes], int]) -> None:
        self.subject = subject
        self.totals = totals
        self.tokens = tokens
        self._previous: list[bytes] | None = None  # the previous request's forwarded keys (None: refused)
        self._first = True

    def refused(self, n: int) -> None:
        """The request ``messages[:n]`` was refused: the model sees nothing, so it is counted as forgetting
        everything (its dependencies, every value so far) and as breaking the prefix."""
        s, t = self.subject, self.totals
        t.requests += 1
        t.refused += 1
        for _ in s.due.get(n, []):
            t.dependencies += 1
            t.forgotten += 1
        t.values += len(frozenset().union(*s.acted[:n]))
        t.argument_values += len(frozenset().union(*s.arguments[:n]))
        if not self._first:
            t.pairs += 1
        self._first = False
        self._previous = None

    def observe(self, n: int, received: list[Any], origins: list[tuple[int, ...]], forwarded: list[Any],
                before: int, after: int, changed: bool, removed: dict[str, int]) -> None:
        """One request ``messages[:n]``: its elements as received and as forwarded, and the pipeline's counts."""
        s, t = self.subject, self.totals
        t.requests += 1
        t.managed += changed
        t.tokens_before += before
        t.tokens_after += after
        for how, tokens in removed.items():
            t.removed[how] = t.removed.get(how, 0) + tokens
        received_keys = [canonical(e) for e in received]
        keys = [canonical(e) for e in forwarded] if changed else received_keys
        present: set[str] = set()
        for key, element in zip(keys, forwarded):
            present |= s.present(key, element)

        kept = kept_positions(received_keys, keys) if changed else None
        element_of = {i: k for k, chat in enumerate(origins) for i in chat}
        for dep in s.due.get(n, []):
            ok = dep.value in present
            t.dependencies += 1
            t.answerable += ok
            if kept is not None and not kept[element_of[dep.source]]:
                t.forgotten += 1
                t.forgotten_answerable += ok

        if kept is not None:
            touched = {s.turn_of[i] for k, chat in enumerate(origins) if not kept[k] for i in chat
                       if s.turn_of[i] >= 0}
            if touched:
                values: set[str] = set()
                arguments: set[str] = set()
                for i in range(n):
                    if s.turn_of[i] in touched:
                        values |= s.acted[i]
                        arguments |= s.arguments[i]
                t.values += len(values)
                t.values_kept += len(values & present)
                t.argument_values += len(arguments)
                t.argument_values_kept += len(arguments & present)

        if not self._first:
            t.pairs += 1
        if self._previous is not None:
            common = common_prefix(self._previous, keys)
            t.prefix_kept += common == len(self._previous)
            total = sum(self.tokens(k) for k in keys)
            t.prefix_token_share += sum(self.tokens(k) for k in keys[:common]) / total if total else 1.0
        self._first = False
        self._previous = keys
