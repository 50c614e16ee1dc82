"""``Wires``: the wires a server speaks, by name; everything that differs by wire is derived from it.

A registry is immutable: the one the server runs with is built once (``proxy.wire.WIRES``, one line
per wire) and handed to the app (``create_app(wires=...)``); ``with_wire`` makes a new one with one
more wire (a test's toy protocol, a third party's). A second wire with a taken name or path is an
error, never a silent replacement.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from proxy.core.errors import CtxProxyError
from proxy.core.usage import Usage, guess_form, normalise_usage
from proxy.wire.protocol import Wire
from proxy.wire.sse import SSE, StreamEnd


class Wires(Mapping[str, Wire]):
    """The registered wires in order (their names are the bounded ``wire`` label)."""

    def __init__(self, *wires: Wire) -> None:
        by_name: dict[str, Wire] = {}
        owner: dict[str, str] = {}
        for wire in wires:
            if wire.name in by_name:
                raise ValueError(f"two wires are named {wire.name!r}")
            for path in (*wire.paths, *wire.endpoints):
                if path in owner:
                    raise ValueError(f"the path {path} is both {owner[path]!r}'s and {wire.name!r}'s")
                owner[path] = wire.name
            by_name[wire.name] = wire
        self._wires = by_name
        self.names: frozenset[str] = frozenset(by_name)
        self.interpreted_fields: frozenset[str] = frozenset(f for w in wires for f in w.interpreted_fields)
        # every wire's key headers, in order: a request whose wire is known only from its body is read with them
        self.key_headers: tuple[str, ...] = tuple(dict.fromkeys(h for w in wires for h in w.key_headers))

    def __getitem__(self, name: str) -> Wire:
        return self._wires[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._wires)

    def __len__(self) -> int:
        return len(self._wires)

    def with_wire(self, wire: Wire) -> Wires:
        """These wires and ``wire``."""
        return Wires(*self._wires.values(), wire)

    def sniff(self, body: dict[str, Any]) -> Wire:
        """The wire of a body whose caller names none: the surest, the first registered among equals."""
        best, score = next(iter(self._wires.values())), -1
        for wire in self._wires.values():
            found = wire.sniff(body)
            if found > score:
                best, score = wire, found
        return best

    def for_path(self, path: str, *, below: bool = False) -> Wire | None:
        """The wire a path (``/v1/chat/completions/``) belongs to: one of its paths or endpoints, or with
        ``below`` a path under one (``/v1/messages/batches``); a ``{model}`` segment matches any one segment."""
        tail = path.split("?", 1)[0].rstrip("/")
        tail = tail[3:] if tail.startswith("/v1/") else tail
        found: Wire | None = None
        longest = -1
        for wire in self._wires.values():
            for own in (*wire.paths, *wire.endpoints):
                if _matches(own, tail, below) and len(own) > longest:
                    found, longest = wire, len(own)
        return found

    def stream_end_for_path(self, path: str) -> StreamEnd:
        """The stream dialect of a relayed path; a path of no wire ends on a clean close."""
        wire = self.for_path(path)
        return wire.stream_end if wire is not None else SSE

    def error_body(self, error: CtxProxyError, path: str) -> dict[str, Any]:
        """``error`` in the shape of the wire ``path`` belongs to; OpenAI's on the proxy's own paths."""
        wire = self.for_path(path, below=True)
        return wire.error_body(error) if wire is not None else error.to_openai()

    def guess_usage(self, usage: Any) -> Usage | None:
        """A ``usage`` object of an unknown wire, read in the form its keys point to."""
        return normalise_usage(usage, guess_form(usage, [w.usage_form for w in self._wires.values()]))


def _matches(own: str, tail: str, below: bool) -> bool:
    """Whether ``tail`` is the path ``own`` (or, ``below``, under it); a ``{…}`` segment matches any one segment."""
    if "{" not in own:
        return tail == own or (below and tail.startswith(own + "/"))
    want, got = own.split("/"), tail.split("/")
    if len(got) < len(want) or (len(got) > len(want) and not below):
        return False
    return all(w == g or (w.startswith("{") and w.endswith("}") and g) for w, g in zip(want, got))
