"""The contract of one wire protocol: everything the proxy asks of a wire, in one place.

A wire is one translator (``proxy.wire.<name>``, a package laid out like every other:
``translator``, ``items``, ``shape``, ``stream``, ``errors``). Beyond parsing and
rendering (``proxy.core.conversation.WireAdapter``, what the pipeline needs) it says
where its request keeps what the server reads before the pipeline (its paths, the
model, the client's key, the output caps), how its answers report usage, how its
streams end and fail, how its errors look, how a body of it is recognised when no
wire is named, and which fields litellm may receive. The server, the metrics, the
CLI and explain read all of it from the registry (``proxy.wire.registry.Wires``),
never from a list of their own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from proxy.core.conversation import WireAdapter
from proxy.core.errors import CtxProxyError
from proxy.core.usage import UsageForm
from proxy.wire.sse import StreamEnd

# where the three HTTP wires read a client's key, in order (``Authorization: Bearer`` first)
STANDARD_KEY_HEADERS = ("authorization", "x-api-key", "api-key")


class Wire(WireAdapter, Protocol):
    """One wire protocol, whole: ``WireAdapter`` plus where its request keeps things and its answers' dialect."""

    paths: tuple[str, ...]  # the managed paths (each also under /v1); ``{model}`` marks a model in the path
    endpoints: Mapping[str, str]  # the wire's other paths: path -> the server's name for their handler
    key_headers: tuple[str, ...]  # the headers a client's key may come in, in order
    interpreted_fields: frozenset[str]  # top-level body fields the proxy reads on this wire
    litellm_fields: frozenset[str] | None  # the request fields litellm may receive (None: no litellm route)
    usage_form: UsageForm  # where its answers' ``usage`` keeps the counts
    stream_end: StreamEnd  # its stream dialect: terminal event, usage, error event

    def upstream_path(self, upstream_model: str) -> str:
        """The managed path below the upstream's API root (``/chat/completions``)."""

    def error_body(self, error: CtxProxyError) -> dict[str, Any]:
        """``error`` as this wire's clients parse it."""

    def sniff(self, body: dict[str, Any]) -> int:
        """How surely ``body`` is this wire's when the caller names none: 0 not, 1 perhaps, 2 surely."""


def read_keys(headers: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, ...]:
    """Every key the client sent in ``names``, in order; ``authorization`` counts only as ``Bearer <key>``."""
    keys: list[str] = []
    for name in names:
        value = headers.get(name, "")
        if name == "authorization":
            key = value[7:].strip() if value[:7].lower() == "bearer " else ""
        else:
            key = value.strip()
        if key:
            keys.append(key)
    return tuple(keys)


def top_level_limits(body: dict[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
    """The output-limit fields of ``fields`` that ``body`` sets at its top level."""
    return {key: body[key] for key in fields if body.get(key) is not None}


def model_field_changes(body: dict[str, Any], upstream_model: str) -> dict[str, Any]:
    """For a wire whose model is the body's ``model``: send the upstream's name when it differs."""
    return {"model": upstream_model} if body.get("model") != upstream_model else {}
