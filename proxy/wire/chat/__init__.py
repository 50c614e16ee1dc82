"""Chat Completions (``POST /v1/chat/completions``): its translator, ``WIRE``."""

from proxy.wire.chat.translator import WIRE, ChatWire

__all__ = ["WIRE", "ChatWire"]
