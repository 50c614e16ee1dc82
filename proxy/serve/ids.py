"""New request ids: version-4 UUIDs, one per request the client sent without a usable ``x-request-id``.

``uuid.uuid4()`` makes each from 16 fresh random bytes through the ``UUID`` class, which costs a small
request some 2 % of the server's instructions. Here a process draws its random part once and counts
its requests in the last 48 bits, from a random start. The ids stay unique: every worker of
``serve --workers`` is a process of its own, with its own random part. And they keep the UUID form
that upstream request-id middlewares check.
They are not secrets, and need not be unguessable.
"""

from __future__ import annotations

import itertools
import uuid

COUNTED_BITS = 48  # the node field: 2**48 requests before the count wraps


class RequestIds:
    """One process's request ids (``State.ids``): a random UUID whose node field counts up."""

    def __init__(self) -> None:
        first = uuid.uuid4()
        self._random = str(first)[:24]  # "xxxxxxxx-xxxx-4xxx-yxxx-": version and variant set
        self._count = itertools.count(first.node)  # the first id is that UUID

    def new(self) -> str:
        return f"{self._random}{next(self._count) & ((1 << COUNTED_BITS) - 1):012x}"
