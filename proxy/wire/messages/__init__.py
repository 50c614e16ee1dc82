"""Anthropic's Messages API (``POST /v1/messages``): its translator, ``WIRE``."""

from proxy.wire.messages.translator import WIRE, MessagesWire

__all__ = ["WIRE", "MessagesWire"]
