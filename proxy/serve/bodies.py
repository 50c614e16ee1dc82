"""Request bodies: decoded whole (``parse_body``), or from where they differ from the conversation's previous one.

An agent resends its whole history with each request: the same bytes, with a turn or a tool round
appended to the conversation's array (Chat ``messages``, Responses ``input``, Messages ``messages``), and
what follows the array (tools, system, settings) as before. ``KnownBodies`` remembers, per tenant and
wire, the last bodies parsed (their bytes, their parse, and where in the bytes the array's last elements
end); a body that begins with a remembered one's bytes up to the end of one of those elements and ends
with the same bytes after its array is parsed from what lies between: only the elements it appends (or
sends anew: a client that moves a cache mark to the last message). Its other fields are the remembered
parse's, its array the remembered elements followed by the new ones: what ``parse_body`` gives for the
whole body, for a fraction of the work (no decode of the known bytes, no scan of them for long numbers
or repeated fields: the top level is the one already checked).

Where an array ends is found once per conversation, from the end of the body backwards (the fields after
the array, then its last ``CUTS`` elements; a quote's escaping is read from the backslashes before it, so
strings are known exactly), and *proven* by the first body that reuses it: that one is decoded whole,
with a number only this process knows inserted at the place, and is used only if the number lands as the
array's element there (not in a string, in another field's array, or in a ``messages`` that a repeated key
replaces). From a proven place onwards the new elements' ends are found by a forward scan of the new
bytes alone. Anything unexpected (a new element that is not valid JSON, a run of 20 digits, another tail)
takes the full parse, which refuses what it refuses.

Bounded: bodies of at least ``MIN_BYTES``, at most ``BRANCHES`` per bucket (tenant, wire, the hash of the
first ``HEAD`` bytes), ``max_bytes`` of remembered bytes in all and ``MAX_BUCKETS`` buckets, least recently
used first; a bucket whose bodies never match is tried less and less often. The remembered parse is shared
with the requests that reuse it and is never changed (as ``proxy.core.warm``'s items are not). Thread-safe.
"""

from __future__ import annotations

import json
import re
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
from xxhash import xxh3_64_intdigest

from proxy.core.errors import BadRequest, CtxProxyError, InvalidJSON
from proxy.pipeline import check_field_names
from proxy.wire import WIRES

CUTS = 4  # the last elements of an array whose ends are remembered (a client may resend the last few anew)
MIN_BYTES = 16 * 1024  # smaller bodies are parsed whole: it costs less than looking them up
HEAD = 1024  # bytes that name a body's bucket
BRANCHES = 8  # bodies remembered per bucket (conversations that begin alike, retries)
MAX_BYTES = 32 * 1024 * 1024  # what the remembered bodies hold in all, their bytes and their parses (``weigh``)
MAX_BUCKETS = 4096  # names remembered, with their misses, whether or not they hold a body
WINDOW = 32 * 1024  # the end of a body read backwards first
WINDOWS = 8  # and then this many times more, at most
MORE: Literal["more"] = "more"  # the places lie before the window read

# JSON read forwards: a structural character, a whole string, or a quote that opens a string never closed
_FORWARD = re.compile(rb'[\[\]{},:]|"(?:[^"\\]++|\\.)*+"|"')
# JSON read backwards (the bytes reversed): a quote followed by an odd run of backslashes is an escaped one; a
# quote alone is a string that began before the bytes read
_BACKWARD = re.compile(rb'[\[\]{},:]|"(?:[^"]++|"(?=(?:\\\\)*+\\(?!\\)))*+"|"')


def parse_body(raw: bytes, fields: frozenset[str] = WIRES.interpreted_fields) -> dict[str, Any]:
    """A request body: a JSON object none of whose keys differs from a field the proxy reads (``fields``) only by
    case."""
    return read_json_body(raw, fields)[0]


def read_json_body(raw: bytes, fields: frozenset[str] = WIRES.interpreted_fields) -> tuple[dict[str, Any], bool]:
    """``parse_body``, and whether the body took the plain way: decoded by orjson alone (no run of 20 digits,
    ``LONG_DIGITS``) and no guarded field named twice in its bytes (``check_repeated_fields``'s byte count)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidJSON(f"The request body is not valid JSON: {exc}") from None
    exact = long_digits(raw)
    if exact:
        body = _exact(raw, body)
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object", code="invalid_body")
    check_field_names(body, fields)
    counted = check_repeated_fields(raw, body)
    return body, not exact and counted


# Top-level fields an upstream must read as the proxy did: the model (the allow-list, the route) and the output
# caps. The JSON decoder keeps a repeated key's last value; an upstream that keeps the first would run another
# model, or another output limit, than the one the proxy checked.
GUARDED_FIELDS = ("model", "max_tokens", "max_completion_tokens", "max_output_tokens", "n")
GUARDED_NAMES = tuple(f'"{key}"'.encode() for key in GUARDED_FIELDS)  # as they are written in a body


def check_repeated_fields(raw: bytes, body: dict[str, Any]) -> bool:
    """Refuse a body whose top level repeats a guarded field. A byte count rules nearly every body out at once
    (True: it did); only a body that names a guarded field more than once anywhere is decoded again, key by key."""
    suspects = [key for key, name in zip(GUARDED_FIELDS, GUARDED_NAMES) if key in body and raw.count(name) > 1]
    if not suspects:
        return True
    outermost: list[list[tuple[str, Any]]] = []

    def keep(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        outermost[:] = [pairs]  # objects close innermost first: the last one is the body itself
        return {}

    try:
        json.loads(raw, object_pairs_hook=keep)
    except (ValueError, RecursionError):
        raise BadRequest("The request body repeats a field or nests too deeply to be checked; send each field "
                         "once.", code="ambiguous_field") from None
    seen: set[str] = set()
    for key, _ in outermost[0] if outermost else ():
        if key in suspects and key in seen:
            raise BadRequest(f"The field '{key}' appears more than once; send it once.", param=key,
                             code="ambiguous_field")
        seen.add(key)
    return False


# orjson reads an integer beyond 64 bits as a float (12345678901234567890123 -> 1.2345678901234568e+22): a
# body with a run of 20 digits is read again by the standard decoder, which keeps such integers exact.
LONG_DIGITS = re.compile(rb"[0-9]{20}")
# the same search without the regular expression, which takes about 8 ns a byte (2 ms for a 254 kB agent body):
# every digit becomes "0" and every other byte ".", then one substring search for twenty zeros
_DIGITS_ONLY = bytes(0x30 if 0x30 <= b <= 0x39 else 0x2E for b in range(256))
_RUN = b"0" * 20


def long_digits(raw: bytes) -> bool:
    """Whether ``raw`` holds a run of 20 ASCII digits (``LONG_DIGITS``), at about a byte copy's cost."""
    return _RUN in raw.translate(_DIGITS_ONLY)


def _exact(raw: bytes, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` read again with its large integers exact (``body`` itself when the standard decoder cannot)."""
    try:
        exact = json.loads(raw)
    except (ValueError, RecursionError):
        return body
    return exact if isinstance(exact, dict) else body



@dataclass
class Known:
    """One parsed body: its bytes, its parse (never changed), where its array's last elements end."""

    raw: bytes
    body: dict[str, Any]
    cuts: list[tuple[int, int]]  # (offset of the ',' or ']' after an element, elements before it), ascending
    tail: int  # where the bytes after the array begin (the ']' closing it)
    proven: bool  # the cuts were found from a place a decode proved (else from the backward read: to prove)
    weight: int = 0  # what keeping it holds, about: its bytes and its parse (``weigh``)


ParseWhole = Callable[[bytes], tuple[dict[str, Any], bool]]  # a body and whether it took the plain way
Parsed = tuple[dict[str, Any], Known | None]  # a body, and what to remember of it (None: what it matched)
Place = tuple[int, int, int]  # a match: the place's offset, the elements before it, where the tail begins


@dataclass
class _Bucket:
    bodies: list[Known] = field(default_factory=list)  # newest first
    misses: int = 0  # bodies that matched none since the last match


class KnownBodies:
    """The last bodies of each conversation, by tenant and wire; ``parse`` reads a body from where it differs."""

    def __init__(self, max_bytes: int = MAX_BYTES, min_bytes: int | None = None) -> None:
        self._min_bytes = MIN_BYTES if min_bytes is None else min_bytes
        self._buckets: OrderedDict[tuple[str, str, int], _Bucket] = OrderedDict()
        self._bytes = 0
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self.reused = 0  # bodies read from a remembered one (for tests and debugging)
        self._probe = secrets.randbits(62) + 2**62  # inserted to prove a place: no client can send it by design

    @property
    def size(self) -> int:
        """What the remembered bodies hold, about, in bytes (``weigh``)."""
        return self._bytes

    def clear(self) -> None:
        with self._lock:
            self._buckets.clear()
            self._bytes = 0

    def parse(self, raw: bytes, tenant: str, wire: str, field_name: str,
              parse_whole: ParseWhole) -> dict[str, Any]:
        """The body ``raw``, as ``parse_whole`` reads it (``read_json_body``: the body, and whether it took the plain
        way), from the remembered body it continues when there is one (``field_name``: where the wire keeps its
        conversation). Only a body that took the plain way is remembered."""
        if len(raw) < self._min_bytes:
            return parse_whole(raw)[0]
        bucket = (tenant, wire, xxh3_64_intdigest(memoryview(raw)[:HEAD]))
        with self._lock:
            known_ones = self._buckets.get(bucket)
            candidates = list(known_ones.bodies) if known_ones is not None else []
        for known in candidates:
            found = _match(raw, known)
            if found is None:
                continue
            parsed = (self._continue(raw, known, found, field_name) if known.proven
                      else self._prove(raw, known, found, field_name, parse_whole))
            if parsed is not None:
                self._keep(bucket, parsed, known)
                return parsed[0]
            if not known.proven:
                self._forget(bucket, known)  # its places were not where the read said: never tried again
        whole, plain = parse_whole(raw)
        if not plain:  # integers read exactly, or a guarded field named twice: decoded whole every time
            return whole
        with self._lock:
            known_ones = self._bucket(bucket)
            known_ones.misses += 1
            # a body seen once is not read back (most never come again); then at the 2nd, 4th, 8th … miss: a client
            # whose bodies never match pays less and less
            tried = known_ones.misses > 1 and known_ones.misses & (known_ones.misses - 1) == 0
        if tried:
            read = _read_back(raw, whole, field_name)
            if read is not None:
                self._keep(bucket, (whole, read), None)
        return whole

    def _continue(self, raw: bytes, known: Known, found: Place, field_name: str) -> Parsed | None:
        """The body ``raw`` is: ``known``'s up to a proven place, new elements, ``known``'s tail."""
        offset, before, end = found
        new = _elements(raw, offset, end)
        if new is None:
            return None
        elements, cuts = new
        body = dict(known.body)
        body[field_name] = [*known.body[field_name][:before], *elements]
        if end == known.tail and not elements and len(raw) == len(known.raw):
            return body, None  # the same body again: ``known`` stays
        return body, _continued(raw, body, known, found, cuts)

    def _prove(self, raw: bytes, known: Known, found: Place, field_name: str,
               parse_whole: ParseWhole) -> Parsed | None:
        """``raw`` decoded whole with the probe inserted at the place found: kept when it lands there as the array's
        element (the body is then what ``parse_whole`` gives for ``raw``, once the probe is removed)."""
        offset, before, end = found
        try:
            body, plain = parse_whole(b"%b,%d%b" % (raw[:offset], self._probe, raw[offset:]))
        except CtxProxyError:  # whatever is wrong with the body, its own parse says it
            return None
        if not plain:
            return None
        array = body.get(field_name)
        if type(array) is not list or len(array) <= before or type(array[before]) is not int \
                or array[before] != self._probe:
            return None
        del array[before]
        cuts = _cuts(raw, offset, end)
        if cuts is None or len(cuts) != len(array) - before:
            return body, None  # the right body, but no place to remember for the next one
        return body, _continued(raw, body, known, found, cuts)

    def _keep(self, bucket: tuple[str, str, int], parsed: Parsed,
              replaces: Known | None) -> None:
        """Remember a parsed body's places (none: ``replaces``, the body it matched, is still the one to keep)."""
        known = parsed[1]
        with self._lock:
            known_ones = self._bucket(bucket)
            if replaces is not None:
                known_ones.misses = 0
                self.reused += 1
            if known is None or known.weight > self._max_bytes // 4:
                return
            kept = [known]
            for old in known_ones.bodies:
                if old is not replaces and len(kept) < BRANCHES:
                    kept.append(old)
                else:
                    self._bytes -= old.weight
            known_ones.bodies = kept
            self._bytes += known.weight
            self._shrink()

    def _forget(self, key: tuple[str, str, int], known: Known) -> None:
        with self._lock:
            bucket = self._buckets.get(key)
            if bucket is not None and any(k is known for k in bucket.bodies):
                bucket.bodies = [k for k in bucket.bodies if k is not known]
                self._bytes -= known.weight

    def _bucket(self, key: tuple[str, str, int]) -> _Bucket:
        """The bucket named ``key``, made when new, as the most recently used (the lock held)."""
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket()
            self._shrink()
        else:
            self._buckets.move_to_end(key)
        return bucket

    def _shrink(self) -> None:
        """While over either bound, the least recently used bucket's oldest body goes, and an empty bucket with it
        (the lock held)."""
        while (self._bytes > self._max_bytes or len(self._buckets) > MAX_BUCKETS) and self._buckets:
            key, bucket = next(iter(self._buckets.items()))
            if bucket.bodies and len(self._buckets) <= MAX_BUCKETS:
                self._bytes -= bucket.bodies.pop().weight
            if not bucket.bodies or len(self._buckets) > MAX_BUCKETS:
                del self._buckets[key]
                self._bytes -= sum(k.weight for k in bucket.bodies)


def _continued(raw: bytes, body: dict[str, Any], known: Known, found: Place, cuts: list[int]) -> Known:
    """``raw``, which continues ``known`` from the place ``found`` (proven, and with it every place of ``known``: one
    read found them all) with elements beginning at ``cuts``."""
    offset, before, end = found
    places = [*(place for place in known.cuts if place[0] < offset), (offset, before),
              *((cut, before + i) for i, cut in enumerate(cuts) if i), (end, before + len(cuts))]
    if end == offset:
        places.pop()
    weight = known.weight - weigh(known.raw[offset:known.tail]) + weigh(raw[offset:end])  # what it sends anew
    return Known(raw, body, places[-CUTS:], end, True, weight)


def _match(raw: bytes, known: Known) -> Place | None:
    """The furthest remembered place of ``known`` up to which ``raw`` has its bytes, when ``raw`` also ends with
    ``known``'s tail: (offset, elements before it, where that tail begins in ``raw``)."""
    old = memoryview(known.raw)
    end = len(raw) - (len(known.raw) - known.tail)
    if not raw.endswith(old[known.tail:]):
        return None
    for offset, before in reversed(known.cuts):
        if offset <= end and raw.startswith(old[:offset]):
            return offset, before, end
    return None


def _elements(raw: bytes, start: int, end: int) -> tuple[list[Any], list[int]] | None:
    """The elements ``raw[start:end]`` appends to an array (it continues one after an element), and where each
    ends (``_cuts``); None when they are not valid JSON, hold a run of 20 digits (``parse_body`` reads those
    its own way), or are not what the forward read finds."""
    new = raw[start:end]
    if long_digits(new) or any(name in new for name in GUARDED_NAMES):
        return None  # read its own way by the whole parse, or a guarded field named again: counted by it
    cuts = _cuts(raw, start, end)  # first: bounded, and what it refuses need not be decoded
    if cuts is None:
        return None
    try:
        decoded = orjson.loads(b'{"":[null%b]}' % new)[""]  # at the depth they have in the body
    except orjson.JSONDecodeError:
        return None
    if type(decoded) is not list or decoded[0] is not None or len(cuts) != len(decoded) - 1:
        return None
    return decoded[1:], cuts


def _cuts(raw: bytes, start: int, end: int) -> list[int] | None:
    """Where the elements of ``raw[start:end]`` (which continues an array after an element) begin: the offset of
    each ',' before one; None when the bytes do not end at the array's own level, outside any string, or hold more
    tokens than reading them is worth (``_limit``)."""
    depth = 0
    found: list[int] = []
    limit = _limit(raw)
    for token in _FORWARD.finditer(raw, start, end):
        limit -= 1
        char = raw[token.start()]
        if char == 0x22:  # a string, or a quote never closed
            if token.end() - token.start() < 2:
                return None
        elif char in (0x5B, 0x7B):  # [ {
            depth += 1
        elif char in (0x5D, 0x7D):  # ] }
            depth -= 1
            if depth < 0:
                return None
        elif char == 0x2C and depth == 0:  # ,
            found.append(token.start())
        if not limit:
            return None
    return found if depth == 0 else None


def _limit(raw: bytes) -> int:
    """Tokens a read of ``raw``'s structure may step through: about what decoding it whole costs (a token read in
    Python costs what orjson spends on 60 to 100 bytes). Past it, the body is decoded whole."""
    return 256 + len(raw) // 64


def _read_back(raw: bytes, body: dict[str, Any], field_name: str) -> Known | None:
    """The places of ``body``'s array in ``raw``, read from the end: the fields after it (which must be the
    body's fields after ``field_name``, in order), its ']', the ','s before its last elements. To be proven.

    Only the end of the body is reversed and read (a reversed copy costs about 0.6 ns a byte): ``WINDOW`` bytes, and
    ``WINDOWS`` times more when the array's end lies before them; fewer than ``CUTS`` places when its last elements
    do. Within ``_limit`` tokens in all."""
    array = body.get(field_name)
    if type(array) is not list or not array:
        return None
    keys = list(body)
    after = keys[keys.index(field_name) + 1:]
    limit = [_limit(raw)]
    for window in (WINDOW, WINDOW * WINDOWS):
        found = _read_window(raw, max(0, len(raw) - window), list(after), len(array), limit)
        if found != MORE:
            return Known(raw, body, found[0], found[1], False, weigh(raw)) if isinstance(found, tuple) else None
        if window >= len(raw):
            break
    return None


def _read_window(raw: bytes, start: int, after: list[str], count: int,
                 limit: list[int]) -> tuple[list[tuple[int, int]], int] | Literal["more"] | None:
    """``_read_back`` on ``raw[start:]``: the places and the tail; None when there are none to find (or ``limit``,
    the tokens left to read, runs out), ``MORE`` when the array's end lies before the window."""
    size = len(raw)
    reverse = raw[start:][::-1]
    depth = 0
    key_next = False  # the string after a ':' at the top level is a key
    tail = -1
    cuts: list[tuple[int, int]] = []
    for token in _BACKWARD.finditer(reverse):
        limit[0] -= 1
        if not limit[0]:
            return None
        char = reverse[token.start()]
        where = size - token.end()  # the token's offset in ``raw``
        if char == 0x22 and token.end() - token.start() < 2:  # a string that began before the window
            break
        if depth == 1 and tail < 0:
            if key_next:
                if char != 0x22 or not after:
                    return None
                try:
                    name = orjson.loads(raw[where:size - token.start()])
                except orjson.JSONDecodeError:
                    return None
                if name != after.pop():
                    return None
                key_next = False
                continue
            if char == 0x3A:  # :
                key_next = True
                continue
            if char == 0x5D and not after:  # the array's ']'
                tail = where
                cuts.append((where, count))
                depth = 2
                continue
        if char in (0x7D, 0x5D):  # } ]
            depth += 1
        elif char in (0x7B, 0x5B):  # { [
            depth -= 1
            if depth < 1:
                return None
            if depth == 1 and tail >= 0:
                break  # the array's first element
        elif char == 0x2C and depth == 2 and tail >= 0:
            count -= 1
            cuts.append((where, count))
            if len(cuts) == CUTS:
                break
    if tail < 0:
        return MORE if start else None  # the window ended (or a string crossed its edge) before the array's end
    return cuts[::-1], tail  # every place found before the window's edge is exact


def weigh(raw: bytes) -> int:
    """What a body's bytes and their parse hold, about (objects, lists and strings each cost far more than their JSON:
    a body of small blocks weighs ten times its bytes, and each number past 256 is an object); it errs high."""
    return len(raw) + 200 * raw.count(b"{") + 60 * raw.count(b"[") + 25 * raw.count(b'"') + 32 * raw.count(b",")
