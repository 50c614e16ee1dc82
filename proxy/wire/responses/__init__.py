"""The Responses API (``POST /v1/responses``): its translator, ``WIRE``."""

from proxy.wire.responses.translator import WIRE, ResponsesWire

__all__ = ["WIRE", "ResponsesWire"]
