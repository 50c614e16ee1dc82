"""The values a conversation's turns acted on, and the values section a summary carries.

A summary replaces turns with text, and whatever the summariser writes, the values those turns acted
on must still reach the model (docs/design.md#values-kept-through-a-summary). They are read from the
items' wire-neutral atoms (``Item.atoms``), so one conversation has the same values on every wire:

- every leaf of every tool call's arguments (read as JSON; a string longer than ``MAX_VALUE``
  characters, or on several lines, is free text: its values are found as in text), keyed by its
  argument's name (the call's tool name for arguments that are not an object);
- in user and assistant text: ids (letters and digits mixed), numbers of three digits or more,
  ISO dates, times, paths, URLs and emails, keyed ``user`` or ``assistant``.

A tool output holds no values of its own here: the values of an output that a later call or
message used are that call's or message's values already. What they change is how a long output
is rendered for the summariser: the passages that hold them are kept (``used_later``).

The values section lists, in the order the turns first used them and grouped by key, the values the
summary's text does not show (``missing``), e.g. ``reservation_id=8JXA2P, ZFA04Y; flight_number=HAT170;
user=2024-05-16``. It is bounded in tokens: past the bound the oldest values are left out, and the
section says how many. It is a pure function of the turns (and the summary's text), so the same
turns always give the same section: it is cached with the summary and keeps the provider's prompt
cache warm.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.core.items import ASSISTANT, TOOL, USER, Item

MIN_VALUE = 3  # a shorter string or number appears everywhere by chance: it is listed, never searched for
MAX_VALUE = 80  # a longer argument string is free text: its values are found as in text
KEY_CHARS = 40
SEPARATOR = "\n\n"  # between a summary's text and its values section
ROLES = (USER, ASSISTANT)  # the keys of text values
LEAD = "Values these turns acted on"
SUMMARY_LEAD = f"{LEAD} (ctxproxy lists those the summary leaves out)"

# a whitespace-delimited token, quotes and brackets excluded
_TOKEN = re.compile(r"[^\s\"'`()\[\]{}<>;|*]+")
_EMAIL = re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+")
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2})?)?")
_TIME = re.compile(r"\d{1,2}:\d{2}(?::\d{2})?")
_NUMBER = re.compile(r"\$?\d[\d,]*(?:\.\d+)?%?")
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:#-]*")
_PLAIN = re.compile(r"[^\s,;=\"\\]+(?: [^\s,;=\"\\]+)*")  # a value or key written as is in the section


@dataclass(frozen=True)
class Value:
    """One value and what it is: an argument's name, a tool's name, or the role whose text held it."""

    key: str
    text: str

    @property
    def searchable(self) -> bool:
        """Long enough that finding it in a text means something (shorter ones are always listed)."""
        return len(self.text) >= MIN_VALUE


def text_values(text: str) -> Iterator[str]:
    """The ids, numbers, dates, times, paths, URLs and emails in free text, in order (repeats included)."""
    for match in _TOKEN.finditer(text):
        value = _token_value(match.group())
        if value is not None:
            yield value


def _token_value(token: str) -> str | None:
    token = token.rstrip(".,:!?").lstrip("#")
    if not MIN_VALUE <= len(token) <= MAX_VALUE:
        return None
    if token.startswith(("http://", "https://")) or _EMAIL.fullmatch(token) or _DATE.fullmatch(token) \
            or _TIME.fullmatch(token):
        return token
    if "/" in token:
        return token if any(c.isalnum() for c in token) and not token.startswith("//") else None
    if _NUMBER.fullmatch(token):
        number = token.strip("$%")
        return number if sum(c.isdigit() for c in number) >= 3 else None
    if len(token) >= 4 and _ID.fullmatch(token) and any(c.isdigit() for c in token) \
            and any(c.isalpha() for c in token):
        return token
    return None


def argument_values(tool: str, arguments: str) -> Iterator[Value]:
    """The leaves of a call's arguments (canonical JSON, as ``Item.atoms`` gives them), keyed by argument name."""
    try:
        parsed = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        parsed = arguments  # not JSON (a custom tool's free-form input): free text
    yield from _leaves(parsed, tool)


def _leaves(root: Any, tool: str) -> Iterator[Value]:
    """The leaves of parsed arguments in document order (a stack, not recursion: arguments may nest 1,000 deep)."""
    stack: list[tuple[Any, str]] = [(root, tool)]
    while stack:
        node, key = stack.pop()
        if isinstance(node, dict):
            stack.extend((value, str(name)) for name, value in reversed(node.items()))
        elif isinstance(node, list):
            stack.extend((value, key) for value in reversed(node))
        elif isinstance(node, bool) or node is None:
            continue
        elif isinstance(node, (int, float)):
            yield Value(key, str(int(node)) if isinstance(node, float) and node.is_integer() else str(node))
        elif isinstance(node, str):
            text = node.strip()
            if "\n" not in text and 0 < len(text) <= MAX_VALUE:
                yield Value(key, text)
            elif text:
                yield from (Value(key, v) for v in text_values(text))


def item_values(item: Item) -> Iterator[Value]:
    """What one item acted on: its calls' arguments, its user or assistant text (results and the rest: none)."""
    if item.role not in ROLES or item.pinned:
        return
    for atom in item.atoms():
        if atom[0] == "call" and len(atom) > 3:
            yield from argument_values(atom[2], atom[3])
        elif atom[0] == "text" and len(atom) > 2 and atom[1] in ROLES:
            yield from (Value(atom[1], v) for v in text_values(atom[2]))


def acted_on(turns: Iterable[Sequence[Item]]) -> list[Value]:
    """Every value the turns acted on, once each, in the order they were first used.

    A value of three characters or more is listed once, under the first argument name that used it
    (a flight number the assistant wrote, then booked, is a ``flight_number``), else under the role
    whose text held it first; a shorter one once per key (``passengers=2`` and ``bags=2`` say
    different things).
    """
    first: dict[tuple[str, str], Value] = {}  # in order of first use
    for turn in turns:
        for item in turn:
            for value in item_values(item):
                ident = ("", value.text) if value.searchable else (value.key, value.text)
                known = first.get(ident)
                if known is None:
                    first[ident] = value
                elif known.key in ROLES and value.key not in ROLES:
                    first[ident] = value  # the same place in the order, under its argument's name
    return list(first.values())


def bounded(value: str) -> re.Pattern[str]:
    """``value`` as a whole token: not inside a longer run of letters, digits or underscores."""
    return re.compile(r"(?<![A-Za-z0-9_])" + re.escape(value) + r"(?![A-Za-z0-9_])")


def shows(text: str, value: str) -> bool:
    """Whether ``text`` holds ``value`` as a whole token."""
    return value in text and bounded(value).search(text) is not None


def missing(values: Sequence[Value], text: str) -> list[Value]:
    """The values ``text`` (a summary) does not show; values too short to search for are always missing."""
    return [v for v in values if not v.searchable or not shows(text, v.text)]


def _written(text: str) -> str:
    """A key or value as the section writes it: as is, or quoted (JSON) when it holds a separator or a character
    that is not printable; those (controls, bidirectional overrides, line separators) are escaped, never written
    raw into the model's context."""
    if _PLAIN.fullmatch(text) and text.isprintable():
        return text
    quoted = orjson.dumps(text).decode()
    if quoted.isprintable():
        return quoted
    return "".join(ch if ch.isprintable() else _escaped(ch) for ch in quoted)


def _escaped(ch: str) -> str:
    """A character as a JSON escape (a pair of surrogates beyond the basic plane)."""
    code = ord(ch)
    if code < 0x10000:
        return f"\\u{code:04x}"
    code -= 0x10000
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def listing(values: Sequence[Value]) -> str:
    """``key=v1, v2; key2=v3``: grouped by key, keys in the order of their first value, values in order."""
    groups: dict[str, list[str]] = {}
    for value in values:
        groups.setdefault(value.key, []).append(_written(value.text))
    return "; ".join(f"{_written(key[:KEY_CHARS]) if key else 'value'}={', '.join(texts)}"
                     for key, texts in groups.items())


@dataclass(frozen=True)
class Section:
    """A values section: its text ('' when there is none), the values it lists and those it leaves out."""

    text: str = ""
    listed: int = 0
    left_out: int = 0


def section(values: Sequence[Value], limit: int, count: Callable[[str], int], lead: str = LEAD) -> Section:
    """The values section: ``lead``, then the listing, within ``limit`` tokens.

    Past the limit the oldest values are left out (the newest are the likeliest to be needed next), and
    the section says how many; the cut is found by bisection, so the section is counted O(log n) times.
    """
    if not values or limit <= 0:
        return Section(left_out=len(values))
    # every value takes a token at least: more than ``limit`` of them never fit (so a pasted log's thousands of
    # numbers cost no more to bound than ``limit`` values do)
    older = max(0, len(values) - limit)
    values = values[older:]

    def written(kept: int) -> str:
        omitted = older + len(values) - kept
        note = f" ({omitted} older values left out)" if omitted else ""
        return f"{lead}{note}: {listing(values[len(values) - kept:])}"

    text = written(len(values))
    if count(text) <= limit:
        return Section(text, len(values), older)
    low, high = 0, len(values) - 1  # the most values that fit: at least low, fewer than high + 1
    while low < high:
        mid = (low + high + 1) // 2
        if count(written(mid)) <= limit:
            low = mid
        else:
            high = mid - 1
    return Section(written(low), low, older + len(values) - low) if low else Section(left_out=older + len(values))


def section_of(turns: Iterable[Sequence[Item]], limit: int, count: Callable[[str], int], lead: str = LEAD) -> Section:
    """The section of every value ``turns`` acted on (``acted_on``), within ``limit`` tokens."""
    return section(acted_on(turns), limit, count, lead)


def keep_values(summary: str, turns: Iterable[Sequence[Item]], limit: int, count: Callable[[str], int]) -> str:
    """``summary`` with a values section for what it leaves out of the values ``turns`` acted on."""
    extra = section(missing(acted_on(turns), summary), limit, count, SUMMARY_LEAD)
    return f"{summary}{SEPARATOR}{extra.text}" if extra.text else summary



# --------------------------------------------------------------------------- rendering for the summariser


def last_uses(items: Sequence[Item]) -> dict[str, int]:
    """Each value's last position in ``items`` where a call or a message used it."""
    out: dict[str, int] = {}
    for position, item in enumerate(items):
        for value in item_values(item):
            if value.searchable:
                out[value.text] = position
    return out


def used_later(item: Item, position: int, uses: dict[str, int], spaced: Collection[str] = ()) -> frozenset[str]:
    """The values of a tool result at ``position`` that a later call or message used (``uses``: ``last_uses``).

    The output is read token by token (linear in its length, whatever the number of values); ``spaced``:
    the values that are not one token (a name with a space), looked for as substrings.
    """
    if item.role != TOOL:
        return frozenset()
    found: set[str] = set()
    for atom in item.atoms():
        if atom[0] != "result" or len(atom) < 3:
            continue
        output = atom[2]
        for match in _TOKEN.finditer(output):
            token = match.group()
            for candidate in (token, token.rstrip(".,:!?").lstrip("#")):
                if uses.get(candidate, -1) > position:
                    found.add(candidate)
        found.update(v for v in spaced if uses[v] > position and shows(output, v))
    return frozenset(found)


def spaced_values(uses: dict[str, int]) -> list[str]:
    """The values of ``uses`` that the token reader cannot see whole (they hold a separator)."""
    return [v for v in uses if _TOKEN.fullmatch(v) is None]
