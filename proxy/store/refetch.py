"""Re-fetches: the model repeating a call whose output ctxproxy masked, summarised or dropped.

The online measure of what compaction forgot (docs/quality.md#re-fetches-the-online-signal): when a
later request of a conversation holds a new call with the same tool name and the same arguments
(canonical JSON, as ``Item.atoms`` gives them) as a call whose output an earlier request did not
forward verbatim, the model most likely needed that output again. Each such call is counted once, by
how its output was removed on the conversation's previous request: ``masked`` (a placeholder took
its place), ``summarised`` (its turn went into a summary) or ``dropped`` (the window, the trimmer or
the working-memory cap removed it). A re-fetched output is not counted again; the new call's own
output, if it is removed in turn, may be.

What is remembered per conversation, in a bounded LRU of this process for each tenant (never shared
across tenants, and one tenant's traffic never evicts another's conversations; nor across replicas: each replica
counts the re-fetches of the requests it serves after one it
served): the length and hash of the last request's received items (a later request whose items
extend them holds the model's new calls after them; one that does not, an edited history or another
run with the same start, counts nothing and starts again), and the signatures of the calls whose
outputs that request removed (the newest ``per_conversation``). A request that removed nothing starts no
entry, so small requests cannot flush the ones that can count. Each tenant holds at most
``conversations`` conversations and ``signatures`` remembered signatures in all (about 150 bytes each),
its least recently seen conversations going first. A conversation is recognised by tenant, system band
and first item, as ``proxy.store.prefix.PrefixTracker`` does.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import cast

from proxy.core.items import TOOL, Item, ItemKeys
from proxy.store.prefix import conversation_head

HOW = ("masked", "summarised", "dropped")
CONVERSATIONS = 4096  # per tenant
PER_CONVERSATION = 256
SIGNATURES = 65_536  # per tenant: removed and re-fetched ids remembered in all (~10 MB)


def signature(name: str, arguments: str) -> int:
    """A call's identity for a re-fetch: its tool name and canonical arguments, hashed (8 bytes)."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(name.encode("utf-8", "surrogatepass"))
    digest.update(b"\x1f")
    digest.update(arguments.encode("utf-8", "surrogatepass"))
    return int.from_bytes(digest.digest(), "big")


def calls_of(item: Item) -> Iterator[tuple[str, int]]:
    """(call id, signature) of every call ``item`` makes, from its wire-neutral atoms."""
    for atom in item.atoms():
        if atom[0] == "call" and len(atom) > 3:
            yield atom[1], signature(atom[2], atom[3])


def removed_outputs(received: list[Item], forwarded: list[Item], summarised: Collection[Item],
                    last: int | None = None) -> list[tuple[Item, str]]:
    """The tool results of ``received`` not forwarded verbatim, each with how it was removed (``last``: the last
    ones of them only, found from the end).

    A result whose id a new item of ``forwarded`` answers was masked; one in ``summarised`` (the turns a
    summary covers) was summarised; any other was dropped. One that a received result with the same id
    still answers (a duplicate the pairing repair dropped) was not removed.
    """
    if forwarded is received:
        return []
    # sets of the items themselves: an item hashes by identity (3× faster to hash than the integers id() makes)
    sent = set(forwarded)
    results = [item for item in received if item.result_id is not None and item.role == TOOL]
    verbatim = [item for item in results if item in sent]
    if len(verbatim) == len(results):
        return []
    answered = {item.result_id for item in verbatim}  # (every result forwarded verbatim: none of these is removed)
    gone = [item for item in results if item.result_id not in answered]
    if last is not None:
        gone = gone[-last:] if last > 0 else []
    # the ids results forwarded answer (the received ones' are answered: only copies masking made count below)
    copies = {item.result_id for item in forwarded if item.result_id is not None and item.role == TOOL}
    masked = [item.result_id in copies for item in gone]
    inside = set(summarised) if not all(masked) else set()  # (made when a result neither forwarded nor masked is met)
    return [(item, "masked" if was_masked else "summarised" if item in inside else "dropped")
            for item, was_masked in zip(gone, masked)]


@dataclass
class _Conversation:
    """What one conversation's last request removed; result ids are kept as their hashes (a client's id may be
    long: what is kept per conversation is bounded in bytes, not only in entries)."""

    length: int  # received items of the last request
    digest: int  # the hash of their content keys
    removed: dict[int, tuple[int, str]] = field(default_factory=dict)  # result id's hash -> (signature, how)
    refetched: OrderedDict[int, None] = field(default_factory=OrderedDict)  # result ids already counted


class RefetchTracker:
    """``observe`` every forwarded request; it returns the re-fetches the request shows, by how."""

    def __init__(self, conversations: int = CONVERSATIONS, per_conversation: int = PER_CONVERSATION,
                 signatures: int = SIGNATURES) -> None:
        self._tenants: dict[str, OrderedDict[int, _Conversation]] = {}
        self._held: dict[str, int] = {}  # per tenant: signatures remembered (removed + re-fetched ids)
        self._size = conversations
        self._per = per_conversation
        self._signatures = signatures
        self._lock = threading.Lock()  # a large request is observed from a worker thread

    def observe(self, tenant: str, received: list[Item], forwarded: list[Item],
                summarised: Collection[Item] = (), keys: ItemKeys | None = None) -> dict[str, int]:
        """Count the new calls of this request that repeat a call whose output the previous request removed,
        then remember what this request removed. Linear in the items; the lock is held only for the bookkeeping
        (and for reading the call of a result whose re-fetch the bound on counted ids forgot: rare).

        A removed result the previous request removed too keeps the signature found then; one it had counted as
        re-fetched is not looked up again (it is forgotten below, unless the bound forgets it was counted); only
        the others' calls are read, and the request's calls are gathered only when one is. ``keys``: the keys of
        ``received``, when the request has them already (``Assembly.item_keys``)."""
        if not received:
            return {}
        conversation = hash(tuple(conversation_head(received)))
        with self._lock:
            mine = self._tenants.get(tenant)
            previous = mine.get(conversation) if mine is not None else None
        removed = removed_outputs(received, forwarded, summarised, self._per)  # (only the last ones are kept)
        if previous is None and not removed:
            return {}  # nothing to count, and nothing to remember (a request that removed nothing starts no entry)
        if keys is None:
            keys = ItemKeys(received)
        new: list[tuple[str, int]] = []
        if previous is not None and previous.removed and keys.extends(previous.length, previous.digest):
            new = [call for item in received[previous.length:] if item.call_ids for call in calls_of(item)]
        known = previous.removed if previous is not None else {}
        counted = previous.refetched if previous is not None else {}
        calls = _Calls(received)
        remembered: dict[int, tuple[int, str] | None] = {}
        later: list[tuple[int, Item, str]] = []  # results counted already: forgotten below (their place kept)
        for result, how in removed:
            ident = hash(result.result_id)
            entry = known.get(ident)
            if entry is not None:
                remembered[ident] = (entry[0], how)
            elif ident in counted:
                remembered[ident] = None
                later.append((ident, result, how))
            else:
                sig = calls.answered(result)
                if sig is not None:
                    remembered[ident] = (sig, how)
        by_signature: dict[int, list[int]] = {}  # (read only when the request makes new calls)
        if new:
            wanted = {sig for _, sig in new}
            for ident, made in [(ident, entry[0]) for ident, entry in known.items() if entry[0] in wanted]:
                by_signature.setdefault(made, []).append(ident)
        counts: dict[str, int] = {}
        with self._lock:
            # a copy: an entry is never changed once kept (what it holds is counted against the tenant's bound)
            refetched = OrderedDict(previous.refetched) if previous is not None else OrderedDict()
            for _, sig in new:
                hits = [ident for ident in by_signature.get(sig, ()) if ident not in refetched]
                if not hits:
                    continue
                how = known[hits[-1]][1]
                counts[how] = counts.get(how, 0) + 1
                for ident in hits:
                    refetched[ident] = None
            while len(refetched) > self._per:
                refetched.popitem(last=False)
            for ident in refetched:
                remembered.pop(ident, None)
            for ident, result, how in later:  # (one the bound above made forget it was counted: remembered again)
                if ident in remembered:
                    sig = calls.answered(result)
                    if sig is None:
                        del remembered[ident]
                    else:
                        remembered[ident] = (sig, how)
            kept = cast("dict[int, tuple[int, str]]", remembered)
            self._remember(tenant, conversation, _Conversation(len(keys), keys.digest(), kept, refetched))
        return counts


    def _remember(self, tenant: str, conversation: int, entry: _Conversation) -> None:
        """Keep ``entry`` as the tenant's newest conversation (or forget the conversation when it holds nothing
        to count), then evict the tenant's oldest ones beyond its bounds. Under the lock."""
        mine = self._tenants.get(tenant)
        held = self._held.get(tenant, 0)
        if mine is not None and conversation in mine:
            old = mine.pop(conversation)
            held -= len(old.removed) + len(old.refetched)
        if entry.removed or entry.refetched:
            if mine is None:
                mine = self._tenants[tenant] = OrderedDict()
            mine[conversation] = entry
            held += len(entry.removed) + len(entry.refetched)
        if mine is not None:
            while mine and (len(mine) > self._size or held > self._signatures):
                _, oldest = mine.popitem(last=False)
                held -= len(oldest.removed) + len(oldest.refetched)
            if not mine:
                del self._tenants[tenant]
        if held:
            self._held[tenant] = held
        else:
            self._held.pop(tenant, None)

    def conversations(self, tenant: str) -> list[_Conversation]:
        """The tenant's remembered conversations, oldest first (for tests and debugging)."""
        with self._lock:
            return list(self._tenants.get(tenant, {}).values())


class _Calls:
    """The calls of a request's items by id, made when first asked (most requests never ask)."""

    def __init__(self, received: list[Item]) -> None:
        self._received = received
        self._by_id: dict[str, Item] | None = None

    def answered(self, result: Item) -> int | None:
        """The signature of the call ``result`` answers (``_answered``)."""
        if self._by_id is None:
            self._by_id = {call_id: item for item in self._received if item.call_ids for call_id in item.call_ids}
        return _answered(result, self._by_id.get(result.result_id or ""))


def _answered(result: Item, call: Item | None) -> int | None:
    """The signature of the call ``result`` answers (None: no call of the request makes it)."""
    if call is None:
        return None
    made = list(calls_of(call))
    for ident, sig in made:
        if ident == result.result_id:
            return sig
    return made[0][1] if len(made) == 1 else None
