"""``run_step(offload, step, *args)``: a synchronous step in a worker thread for a large request, else inline.

Parsing, counting, repairing, trimming and rendering a conversation are linear in its items, but
a body may hold hundreds of thousands of them: run on the event loop, that would hold up every
other request. A request larger than ``server.offload_bytes`` runs those steps in the default
executor's threads; a small one runs them inline, which costs less than a thread hop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


async def run_step(offload: bool, step: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``step(*args, **kwargs)``: in a worker thread when ``offload``, else right here."""
    if offload:
        return await asyncio.to_thread(step, *args, **kwargs)
    return step(*args, **kwargs)
