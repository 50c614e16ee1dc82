"""Wire adapters: one module per wire protocol, each a pure function of request bodies.

``WIRES`` maps the bounded ``wire`` label to its (stateless) adapter.
"""

from __future__ import annotations

from types import MappingProxyType

from proxy.wire.chat import WIRE as CHAT
from proxy.wire.chat import ChatWire
from proxy.wire.messages import WIRE as MESSAGES
from proxy.wire.messages import MessagesWire

WIRES: MappingProxyType[str, ChatWire | MessagesWire] = MappingProxyType({CHAT.name: CHAT, MESSAGES.name: MESSAGES})
