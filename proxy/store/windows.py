"""The provider's real window for a route, learned from its refusals for length.

A configured or mapped window can be larger than the provider's real one (a stale model map, a
self-hosted server started with a smaller context, a provider that changed a limit). A refusal for length
(``proxy.core.refusal``) states the real one, or lets the proxy estimate it (``proxy.serve.overflow``);
it is remembered per (upstream, upstream model), beside the pooled calibration record of that model
(``proxy.store.calibration``), so it is shared by replicas and survives a restart.

A learned window only ever narrows the configured one. It is kept with the configured window it was
learned against: when the configuration changes that window, the learned one is dropped (the operator
has spoken), and it is trusted for ``TRUST_SECONDS``: after that the configured window is tried again, and
a refusal, recovered like the first, teaches it again (a provider may have raised its limit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

TRUST_SECONDS = 7 * 24 * 3600.0
MIN_WINDOW = 256  # no chat model's window is smaller: a refusal that says so is not believed
SOURCES = frozenset({"stated", "estimated", "stepped"})  # the provider said it; from its count; a blind step
MAX_WINDOW = 10**9


@dataclass(frozen=True)
class LearnedWindow:
    """The provider's window (``limit``, in its own tokens), the configured window it narrows, how it was
    found (``stated``, ``estimated`` or ``stepped``) and when (unix time)."""

    limit: int
    configured: int
    source: str
    at: float

    def as_record(self) -> dict[str, Any]:
        return {"limit": self.limit, "configured": self.configured, "source": self.source, "at": self.at}

    def serves(self, configured: int, now: float) -> bool:
        """Whether it narrows a route whose configured window is ``configured``, at ``now``."""
        return self.configured == configured and self.limit < configured and now - self.at < TRUST_SECONDS


def merged(ours: LearnedWindow | None, theirs: LearnedWindow | None) -> LearnedWindow | None:
    """Two replicas' learned windows as one: against the same configured window the narrower (the provider
    refused above it); against different ones the later (it was learned under the configuration in force)."""
    if ours is None or theirs is None:
        return ours or theirs
    if ours.configured == theirs.configured:
        return ours if (ours.limit, -ours.at) <= (theirs.limit, -theirs.at) else theirs
    return ours if ours.at >= theirs.at else theirs


def from_record(raw: Any) -> LearnedWindow | None:
    """A stored window, checked: a shared record is data from another process, maybe another version."""
    if not isinstance(raw, dict):
        return None
    limit, configured, source, at = _count(raw.get("limit")), _count(raw.get("configured")), raw.get("source"), \
        raw.get("at")
    if limit is None or configured is None or limit < MIN_WINDOW or not isinstance(source, str) \
            or source not in SOURCES:
        return None
    if isinstance(at, bool) or not isinstance(at, (int, float)) or not math.isfinite(at):
        return None
    return LearnedWindow(limit, configured, source, float(at))


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 < value < MAX_WINDOW else None
