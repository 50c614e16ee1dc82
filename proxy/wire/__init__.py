"""Wire adapters: one module per wire protocol, each a pure function of request bodies.

``WIRES`` maps the bounded ``wire`` label to its (stateless) adapter.
"""

from __future__ import annotations

from types import MappingProxyType

from proxy.wire.chat import WIRE as CHAT
from proxy.wire.chat import ChatWire
from proxy.wire.messages import WIRE as MESSAGES
from proxy.wire.messages import MessagesWire
from proxy.wire.responses import WIRE as RESPONSES
from proxy.wire.responses import ResponsesWire

WIRES: MappingProxyType[str, ChatWire | ResponsesWire | MessagesWire] = MappingProxyType(
    {CHAT.name: CHAT, RESPONSES.name: RESPONSES, MESSAGES.name: MESSAGES})
