"""What the previous request of a conversation computed, so that a request which only appends turns parses those.

Consecutive requests of one conversation (an agent loop, a chat) resend the whole history with a
turn or a tool round appended. A wire that can resume (its ``resume``, ``proxy.core.conversation.Resume``:
Chat Completions, Responses and Messages) remembers,
per conversation, the content keys of the elements it parsed and their items (counted, checked,
paired); the next request reuses those items for the prefix it shares and parses, checks and counts
only the elements after it.

A conversation is found by its tenant, its wire and the content keys of its first two elements, and
a remembered one is used only when its whole sequence of content keys is a prefix of the request's.
Content keys are xxh3-128 of each element's JSON as sent, key order included
(``proxy.core.tokens.content_key``), so this is the check a hash chain over the raw elements makes,
made element by element: a client that edits the middle, truncates, reorders or comes with another
tenant's key finds nothing it may reuse and takes the full path.

A reused item is given this request's JSON for its element (``raw``: the client's own object, as on
the full path; equal byte for byte to the one it had, since their content keys are equal), and
nothing else about it changes: the request builds a list of its own, and ``assign_groups`` gives the
items the numbers they already have (a group number depends on the items before it alone). Two
concurrent requests of one conversation may each forward the other's equal object for an element:
the same bytes. Bounded: at most ``max_items`` items and ``max_bytes`` bytes of the elements' JSON in all
(a remembered request holds its client's objects: a few large bodies must not hold the memory that many
items would), least recently used conversations go first, and per conversation its last ``BRANCHES``
requests (a client that retried or branched); a request larger than a quarter of ``max_bytes`` is not kept.
Thread-safe: a large body's parse runs in a worker thread.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from operator import is_
from typing import Any

from proxy.core.items import Item

BRANCHES = 2  # requests remembered per conversation (its first two elements)
MAX_BYTES = 32 * 1024 * 1024  # of the remembered requests' JSON, in all (their objects take a few times more)


@dataclass(frozen=True)
class Known:
    """One parsed request of a conversation: its elements' content keys and their items (never changed)."""

    keys: list[int]
    items: list[Item]
    size: int  # bytes of its elements' JSON
    extra: int = 0  # what else the wire needs to resume from it (Messages: the cache_control marks of its messages)
    elements: tuple[Any, ...] = ()  # the elements themselves, as objects (``shared``)
    tokens: int = -1  # its items' tokens in all (-1: not known)

    def tokens_with(self, tail: list[Item]) -> int:
        """The tokens of its items and ``tail``'s, in all."""
        known = self.tokens if self.tokens >= 0 else sum([item.tokens for item in self.items])
        return known + sum([item.tokens for item in tail])


class Conversations:
    """Known conversations by tenant, wire and first two content keys: a bounded LRU, counted in items."""

    def __init__(self, max_items: int = 50_000, max_bytes: int = MAX_BYTES) -> None:
        self._known: OrderedDict[tuple[str, str, int, int], list[Known]] = OrderedDict()
        self._items = 0
        self._bytes = 0
        self._max_items = max_items
        self._max_bytes = max_bytes
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._known)

    @property
    def items(self) -> int:
        """Items remembered, in all."""
        return self._items

    @property
    def size(self) -> int:
        """Bytes of the remembered requests' JSON, in all."""
        return self._bytes

    def clear(self) -> None:
        with self._lock:
            self._known.clear()
            self._items = self._bytes = 0

    def find(self, tenant: str, wire: str, keys: list[int]) -> Known | None:
        """The longest remembered request of this conversation whose keys are a prefix of ``keys``."""
        if len(keys) < 2:
            return None
        with self._lock:
            branches = self._known.get((tenant, wire, keys[0], keys[1]))
            if branches is None:
                return None
            self._known.move_to_end((tenant, wire, keys[0], keys[1]))
            best: Known | None = None
            for known in branches:
                n = len(known.keys)
                if n <= len(keys) and (best is None or n > len(best.keys)) and keys[:n] == known.keys:
                    best = known
            return best

    def shared(self, tenant: str, wire: str, elements: list[Any], first: list[int]) -> tuple[Known, int] | None:
        """The remembered request of this conversation (``first``: the content keys of ``elements[:2]``) whose
        elements, as the very objects, begin ``elements`` the longest, and how many: a body read from where it
        differs from the previous one (``proxy.serve.bodies``) holds that request's objects for what it repeats,
        and their keys need not be made again."""
        with self._lock:
            branches = list(self._known.get((tenant, wire, first[0], first[1]), ()))
        best: tuple[Known, int] | None = None
        for known in branches:
            n = _same_objects(elements, known.elements)
            if n and (best is None or n > best[1]):
                best = known, n
        return best

    def keep(self, tenant: str, wire: str, keys: list[int], items: list[Item], size: int, extra: int = 0,
             elements: tuple[Any, ...] = (), new: list[Item] | None = None, tokens: int = -1) -> None:
        """Remember a parsed request (``items`` must not change afterwards; ``size``: its elements' JSON, in
        bytes; ``elements``: the elements); it replaces the ones it extends. A request not kept (too large, or too
        short to be found again) has its ``new`` items marked (``Item.unkept``): what is remembered with the items
        kept before it (a walk of the history, a render) must not hold them, uncounted. ``tokens``: the items' tokens
        in all (-1: not known)."""
        if len(keys) < 2 or len(items) > self._max_items or size > self._max_bytes // 4:
            for item in new or ():
                item.unkept = True
            return
        entry = (tenant, wire, keys[0], keys[1])
        known = Known(keys, items, size, extra, elements, tokens)
        with self._lock:
            branches = self._known.get(entry, [])
            kept = [known]
            for old in branches:
                n = len(old.keys)
                superseded = n <= len(keys) and keys[:n] == old.keys  # an earlier request of this branch
                if not superseded and len(kept) < BRANCHES:
                    kept.append(old)
                else:
                    self._items -= len(old.items)
                    self._bytes -= old.size
            self._known[entry] = kept
            self._known.move_to_end(entry)
            self._items += len(items)
            self._bytes += size
            while (self._items > self._max_items or self._bytes > self._max_bytes) and self._known:
                _, dropped = self._known.popitem(last=False)
                self._items -= sum(len(k.items) for k in dropped)
                self._bytes -= sum(k.size for k in dropped)


def _same_objects(elements: list[Any], known: tuple[Any, ...]) -> int:
    """How many leading elements of ``elements`` are the very objects ``known`` begins with."""
    if not known or not elements or elements[0] is not known[0]:
        return 0
    same = list(map(is_, elements, known))
    return same.index(False) if False in same else len(same)
