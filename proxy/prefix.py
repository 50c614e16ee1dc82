"""Prefix stability: does this request forward the previous request's messages as its prefix?

Providers bill a cached prompt prefix at a fraction of the price, so the
share of requests whose forwarded messages start with the previous request's
forwarded messages (same conversation) is what compaction must keep high.
A conversation is recognised by its system band and first message; the
tracker keeps, per conversation, the length and hash of the last forwarded
list in a bounded LRU.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from proxy.messages import SYSTEM_ROLES, Message
from proxy.tokens import content_key


class PrefixTracker:
    def __init__(self, size: int = 10_000) -> None:
        self._last: OrderedDict[bytes, tuple[int, bytes]] = OrderedDict()
        self._size = size

    def observe(self, received: list[Message], forwarded: list[Message], keys: dict[int, int]) -> bool | None:
        """True/False: the forwarded list does/does not extend the previous one; None: first request seen."""
        if not received or not forwarded:
            return None

        def key_of(message: Message) -> bytes:
            key = keys.get(id(message))
            return (key if key is not None else content_key(message)).to_bytes(16, "little")

        head = hashlib.blake2b(digest_size=16)
        for message in received:
            head.update(key_of(message))
            if message.get("role") not in SYSTEM_ROLES:
                break
        conversation = head.digest()
        previous = self._last.get(conversation)
        rolling = hashlib.blake2b(digest_size=16)
        stable: bool | None = None
        for i, message in enumerate(forwarded):
            if previous is not None and i == previous[0]:
                stable = rolling.digest() == previous[1]
            rolling.update(key_of(message))
        if previous is not None and stable is None:
            stable = len(forwarded) == previous[0] and rolling.digest() == previous[1]
        self._last[conversation] = (len(forwarded), rolling.digest())
        self._last.move_to_end(conversation)
        if len(self._last) > self._size:
            self._last.popitem(last=False)
        return stable
