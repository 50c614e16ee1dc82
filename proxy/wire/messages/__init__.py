"""Anthropic's Messages API (``POST /v1/messages``): the third wire adapter.

``adapter``: items, bands, render; ``blocks``: counts, describe, atoms; ``shape``: the
payload check; ``context``: ``context_management`` emulated for upstreams without it;
``answers``: the response edits that emulation needs (the ``context_management``
report, a compaction block) and answers made without an upstream.
"""

from __future__ import annotations

from proxy.wire.messages.adapter import WIRE, MessagesWire

__all__ = ["WIRE", "MessagesWire"]
