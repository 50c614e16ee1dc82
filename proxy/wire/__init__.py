"""The wires: one translator per wire protocol (``proxy.wire.<name>``), registered here, one line each.

``WIRES`` is the registry the server runs with; a server for more wires is built with
``WIRES.with_wire(...)`` (``proxy.wire.registry``).
"""

from proxy.wire.chat import WIRE as CHAT
from proxy.wire.messages import WIRE as MESSAGES
from proxy.wire.registry import Wires
from proxy.wire.responses import WIRE as RESPONSES

WIRES = Wires(
    CHAT,
    RESPONSES,
    MESSAGES,
)

__all__ = ["CHAT", "MESSAGES", "RESPONSES", "WIRES", "Wires"]
