"""Prefix stability: does this request forward the previous request's items as its prefix?

Providers bill a cached prompt prefix at a fraction of the price, so the share of
requests whose forwarded items start with the previous request's forwarded items
(same conversation) is what compaction must keep high. A conversation is
recognised by its system band and first item; the tracker keeps, per
conversation, the length and hash of the last forwarded list in a bounded LRU.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from proxy.core.items import SYSTEM, Item, ItemKeys


def conversation_head(received: list[Item]) -> list[object]:
    """The content keys that recognise a conversation across its requests: its system band and first item."""
    head: list[object] = []
    for item in received:
        head.append(item.key)
        if item.role != SYSTEM:
            break
    return head


class PrefixTracker:
    def __init__(self, size: int = 10_000) -> None:
        self._last: OrderedDict[int, tuple[int, int]] = OrderedDict()
        self._size = size
        self._lock = threading.Lock()  # a large request is observed from a worker thread

    def observe(self, received: list[Item], forwarded: list[Item], tenant: str = "",
                sent: ItemKeys | None = None) -> bool | None:
        """True/False: the forwarded list does/does not extend the previous one; None: first request seen.

        Conversations are told apart by tenant, system band and first item (identical agent runs of one
        tenant share a record: the share they report is still that of the forwarded prefixes). The
        linear part (the keys and their hashes) runs outside the lock. ``sent``: the keys of ``forwarded``, when the
        request has them already (``Assembly.item_keys``).
        """
        if not received or not forwarded:
            return None
        conversation = hash((tenant, *conversation_head(received)))
        if sent is None:
            sent = ItemKeys(forwarded)
        digest = sent.digest()
        with self._lock:
            previous = self._last.get(conversation)
            self._last[conversation] = (len(sent), digest)
            self._last.move_to_end(conversation)
            if len(self._last) > self._size:
                self._last.popitem(last=False)
        if previous is None:
            return None
        return sent.extends(*previous)
