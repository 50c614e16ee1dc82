"""The wire-neutral conversation: items, their roles, and the ids that pair calls with results.

A wire adapter (``proxy.wire``) parses a request body into a list of ``Item`` and
renders the managed list back. Everything between (bands, pairing, budget, the
context managers, the summary cache) works on items and never on a wire's JSON.

An item keeps a reference to the client's own JSON for it (``raw``): a Chat
Completions message, a Responses input item (with the reasoning items that precede
it), an Anthropic message or content block. An item the pipeline keeps unchanged is
rendered from that object, so fields the proxy does not interpret (unknown keys,
encrypted content, cache markers, signatures) are forwarded byte for byte.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable, Iterator, Sequence
from operator import attrgetter, eq
from typing import Any, Protocol, TypeVar

import orjson

from proxy.core import describe

SYSTEM = "system"
USER = "user"
ASSISTANT = "assistant"
TOOL = "tool"  # a result: answers a call by its id
OTHER = "other"  # anything else a wire carries in the conversation (kept in place, never a turn start)

NO_GROUP = -1


class Item:
    """One unit of a conversation.

    ``role``: system, user (a turn starts here), assistant, tool (a result), other.
    ``call_ids``: the ids of the calls this item makes; ``result_id``: the call it answers.
    ``source``: the index of the client's top-level element it came from (a message or an
    input item); items a wire splits out of one element share it. ``pinned``: never dropped
    or summarised away. ``key``/``tokens``: content key and token count, set by the wire.
    ``group``: items with the same group are one atomic tool group (set after pairing repair).
    ``masked``: observation masking's copy of a result, remembered with the item; ``walk``: its walk of a history
    this item begins; ``split``: the last history it begins, in turns; ``chained``: that history's chained hashes;
    ``verified``: the last forwarded list it begins whose pairing was checked; ``summary``: the last summary item made
    for a history it begins.
    """

    __slots__ = ("call_ids", "chained", "group", "key", "masked", "pinned", "raw", "result_id", "role", "source",
                 "split", "summary", "tokens", "unkept", "verified", "walk")

    def __init__(
        self,
        raw: Any,
        role: str,
        call_ids: tuple[str, ...] = (),
        result_id: str | None = None,
        source: int = -1,
        pinned: bool = False,
        key: int = 0,
        tokens: int = 0,
    ) -> None:
        self.raw = raw
        self.role = role
        self.call_ids = call_ids
        self.result_id = result_id
        self.source = source
        self.pinned = pinned
        self.key = key
        self.tokens = tokens
        self.group = NO_GROUP
        # observation masking's copy of this result, kept for the next request that resumes the conversation
        # (``plugins.masking``): (the call's content key, the copy, its record: call id, tool, tokens removed)
        self.masked: tuple[int, Item | None, dict[str, Any]] | None = None
        self.unkept = False  # a new item of a request the warm memory did not keep (``Conversations.keep``)
        # observation masking's last walk of a history this item begins (``plugins.masking``): its turns, the
        # results found in them (turn, position, result, call), the calls by id, and what masking worked out
        self.walk: tuple[Any, ...] | None = None
        # the last history this item begins as ``proxy.core.bands.known_turns`` split it: (its items, its turns,
        # their tokens, where they end)
        self.split: tuple[list[Item], tuple[list[Item], ...], tuple[int, ...], tuple[int, ...]] | None = None
        # the chained hashes of the last history this item begins (``proxy.pipeline.chain_hashes``): its turns, their
        # links
        self.chained: tuple[list[list[Item]], list[bytes]] | None = None
        # the last list this item begins whose pairing ``proxy.core.pairing.check_known`` checked (never changed)
        self.verified: list[Item] | None = None
        # the last summary item made for a history this item begins (``proxy.pipeline``): its text, the turns it
        # covers, the item (never changed: the requests that use the same summary forward the very same item)
        self.summary: tuple[str, int, Item] | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.role}, calls={self.call_ids}, result={self.result_id}, src={self.source})"

    @property
    def starts_turn(self) -> bool:
        return self.role == USER

    def describe(self, keep: Collection[str] = ()) -> str:
        """The item as compact text for the summariser (calls, results, refusals, media placeholders).

        ``keep``: values a later turn used; a long result shortened for the summariser keeps the passages
        that hold them (``proxy.core.describe.shorten``).
        """
        return ""

    def atoms(self) -> Iterator[tuple[str, ...]]:
        """The item's meaning, wire-neutral: ``(kind, field, ...)`` tuples.

        Kinds: ``("text", role, text)``, ``("call", id, name, arguments)``,
        ``("result", id, output)``, ``("media", role, digest)``. The same conversation yields the
        same atoms on every wire, so summary cache keys do not depend on the wire it came on.
        """
        return iter(())

    def calls(self) -> list[tuple[str, str]]:
        """``(id, name)`` of every call the item makes, as its ``("call", …)`` atoms give them.

        A wire overrides it with a direct read of its JSON where the atoms would re-encode every call's
        arguments for nothing (observation masking asks for the tool's name of every result it masks).
        """
        return [(atom[1], atom[2]) for atom in self.atoms() if atom[0] == "call" and len(atom) > 2]


T = TypeVar("T")
# whether an item is a new one of a request the warm memory did not keep (what no memo may hold, uncounted)
UNKEPT = attrgetter("unkept")


def same_prefix(items: Sequence[T], known: list[T]) -> int:
    """How many leading items of ``items`` are the very items ``known`` begins with (or, for lists of items, lists
    of the very same items).

    Items compare by identity (no ``__eq__`` of their own), so when ``known`` is a prefix of ``items`` (a growing
    conversation) one list comparison says so, a C pass that calls no comparison; only otherwise are the two walked
    to the first difference, with the same equality (an item is equal to itself alone, a list of items to a list of
    the very same items).
    """
    n = len(known)
    if len(items) >= n and items[:n] == known:
        return n
    same = list(map(eq, items, known))
    return same.index(False) if False in same else len(same)


class ItemFactory(Protocol):
    """What a wire lends the neutral pairing repair: the two edits it may need."""

    def without_calls(self, item: Item) -> Item | None:
        """``item`` with its calls removed (None: nothing worth keeping is left)."""

    def placeholder(self, call: Item, call_id: str) -> Item | None:
        """An explicit "no result was recorded" result for ``call_id`` (None: this kind of call has none)."""


class ItemKeys:
    """The content keys of a list of items as one tuple, and the hashes of its prefixes, each made once: the trackers
    that compare a request with its conversation's previous one by length and hash (``proxy.store.prefix``,
    ``proxy.store.promptcache``, ``proxy.store.refetch``) share them (``keys_of``)."""

    __slots__ = ("_hashes", "keys")

    def __init__(self, items: Sequence[Item]) -> None:
        self.keys = tuple([item.key for item in items])
        self._hashes: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.keys)

    def digest(self, n: int | None = None) -> int:
        """The hash of the first ``n`` keys (None: of all of them)."""
        n = len(self.keys) if n is None else min(n, len(self.keys))
        found = self._hashes.get(n)
        if found is None:
            found = self._hashes[n] = hash(self.keys[:n])
        return found

    def extends(self, length: int, digest: int) -> bool:
        """Whether these keys begin with the ``length`` keys whose hash is ``digest``."""
        return len(self.keys) >= length and self.digest(length) == digest


def keys_of(received: Sequence[Item], forwarded: Sequence[Item]) -> tuple[ItemKeys, ItemKeys]:
    """The keys of a request's received and forwarded items: one object when they are the same list."""
    mine = ItemKeys(received)
    return mine, mine if forwarded is received else ItemKeys(forwarded)


def atom_digests(item: Item) -> bytes:
    """16 bytes per atom of ``item``: what chained hashes are built from (boundary-free across items)."""
    out = bytearray()
    for atom in item.atoms():
        h = hashlib.blake2b(digest_size=16)
        for part in atom:
            h.update(part.encode("utf-8", "surrogatepass"))
            h.update(b"\x1f")
        out += h.digest()
    return bytes(out)


def turn_digest(link: bytes, digests: Iterable[bytes]) -> bytes:
    """The next link of a chained hash: ``link`` plus the atom digests of a turn's items (stable across hosts)."""
    h = hashlib.blake2b(link, digest_size=16)
    for d in digests:
        h.update(d)
    return h.digest()


def media_digest(data: str) -> str:
    """A short digest of an image/audio/file reference (a data URL's payload, a URL or a file id)."""
    if data.startswith("data:") and "," in data:
        data = data.split(",", 1)[1]
    return hashlib.blake2b(data.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


def canonical_arguments(arguments: Any) -> str:
    """Call arguments as compact sorted JSON when they parse, else as sent (so wires agree)."""
    if isinstance(arguments, str):
        try:
            parsed = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            return arguments
        try:
            return orjson.dumps(parsed, option=orjson.OPT_SORT_KEYS).decode()
        except TypeError:  # it parses (1024 levels) but is nested deeper than orjson writes (254): as sent
            return arguments
    try:
        return orjson.dumps(arguments, option=orjson.OPT_SORT_KEYS).decode()
    except TypeError:
        return describe.as_text(arguments)
