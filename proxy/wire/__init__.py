"""Wire adapters: one module per wire protocol, each a pure function of request bodies.

``WIRES`` maps the bounded ``wire`` label to its (stateless) adapter.
"""

from __future__ import annotations

from types import MappingProxyType

from proxy.wire.chat import WIRE as CHAT

WIRES = MappingProxyType({CHAT.name: CHAT})
