"""What compaction cost the provider's prompt cache, measured from the provider's own cached-token counts.

Providers bill a prompt prefix they served from their cache at a fraction of the input price. Removing
tokens saves their input price (the gross saving), but it has two prompt-cache costs, both measured
here per conversation from the usage the provider reported for consecutive requests:

- **break**: a request whose forwarded prefix ctxproxy changed (a new summary, a window that moved)
  while the client's own history only grew: the tokens the previous request read from the cache and
  this one did not (``previous cached - cached``) are paid at the full input price now, and any cache
  writes above the previous request's are paid at the write premium (Anthropic).
- **removed**: the tokens removed from the previous request would, in an unmanaged conversation, have
  been read from the cache by this one (they were part of its prefix); the gross saving prices them at
  the full input price, but they would have cost the cache-read price. Measured with this
  conversation's hit share: the part of the previous prompt the provider read back from its cache on
  the last request whose prefix was kept (0 when it caches nothing, about 1 when it caches everything).

A conversation is recognised by tenant, system band and first item (as ``PrefixTracker`` does); what
is remembered per conversation is its last request's item-key hashes, usage and removed tokens, in a
bounded LRU of this process. Its limits: a conversation's first request, a request whose previous one
went to another replica, and a client that edited its history are not measured (effect 0).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from proxy.core.items import SYSTEM, Item, ItemKeys, keys_of
from proxy.core.usage import Usage


@dataclass(frozen=True)
class CacheEffect:
    """The prompt-cache effect of one request, in the provider's tokens."""

    tracked: bool = False  # the conversation's previous request was seen here, with usage
    shifted: bool = False  # ctxproxy changed the forwarded prefix while the client's history only grew
    lost_reads: int = 0  # break: cache reads of the previous request this one did not get
    extra_writes: int = 0  # break: cache writes above the previous request's
    removed_reads: int = 0  # removed tokens the provider would have read from its cache
    hit: float | None = None  # the conversation's measured hit share


NO_EFFECT = CacheEffect()  # nothing measured (frozen: shared by every request that measures nothing)


@dataclass
class _Last:
    received: tuple[int, int]  # (length, hash) of the received item keys
    forwarded: tuple[int, int]
    input: int | None  # the provider's counts for that request (None: no usage)
    cached: int
    writes: int
    removed: int  # provider tokens ctxproxy removed from that request
    hit: float | None


class PromptCacheTracker:
    def __init__(self, size: int = 10_000) -> None:
        self._last: OrderedDict[tuple[str, int], _Last] = OrderedDict()
        self._size = size

    def observe(self, tenant: str, received: list[Item], forwarded: list[Item], usage: Usage | None,
                removed_tokens: int, keys: tuple[ItemKeys, ItemKeys] | None = None) -> CacheEffect:
        """Compare this answered request with the conversation's previous one, then remember it. ``keys``: the keys
        of ``received`` and ``forwarded``, when the request has them already (``Assembly.item_keys``)."""
        if not received or not forwarded:
            return NO_EFFECT
        head: list[int] = []
        for item in received:
            head.append(item.key)
            if item.role != SYSTEM:
                break
        conversation = (tenant, hash(tuple(head)))
        received_keys, forwarded_keys = keys if keys is not None else keys_of(received, forwarded)
        previous = self._last.get(conversation)
        effect = NO_EFFECT
        hit = previous.hit if previous is not None else None
        if previous is not None and usage is not None and previous.input is not None \
                and received_keys.extends(*previous.received):
            stable = forwarded_keys.extends(*previous.forwarded)
            if stable and previous.input > 0:
                hit = min(1.0, usage.cached_tokens / previous.input)
            lost = writes = 0
            if not stable:
                lost = max(0, previous.cached - usage.cached_tokens)
                writes = max(0, usage.cache_write_tokens - previous.writes)
            removed_reads = round(previous.removed * hit) if hit else 0
            effect = CacheEffect(True, not stable, lost, writes, removed_reads, hit)
        self._last[conversation] = _Last(
            (len(received_keys), received_keys.digest()), (len(forwarded_keys), forwarded_keys.digest()),
            usage.input_tokens if usage is not None else None,
            usage.cached_tokens if usage is not None else 0,
            usage.cache_write_tokens if usage is not None else 0,
            max(0, removed_tokens), hit)
        self._last.move_to_end(conversation)
        if len(self._last) > self._size:
            self._last.popitem(last=False)
        return effect
