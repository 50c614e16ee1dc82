"""A parsed request, wire-neutral, and the contract a wire adapter fulfils (docs/design.md#10-wires).

A wire's translator (``proxy.wire.chat``, ``.responses``, ``.messages``) turns a request
body into a ``Conversation`` (``parse``) and the managed items back into a body of
the same wire (``render``). Everything the pipeline needs from a wire beyond that
is here too: the two pairing edits, the summary item, a result's masked copy (observation
masking), where the model and the output limits are. The server asks more of a wire
(``proxy.wire.protocol.Wire``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from proxy.core.items import Item
from proxy.core.tokens import TokenCounter


@dataclass
class Conversation:
    """A request body as neutral items, plus what counts toward the budget outside them.

    ``fixed_tokens``: reply priming, tool schemas and pinned body fields that are not items
    (Responses ``instructions``, Anthropic ``system``). ``paired``: the wire already knows
    pairing is valid (its fast scan), so the repair pass can be skipped. ``notes``: warnings
    the wire raised while parsing (e.g. provider-held state the proxy cannot see).
    ``unmanaged``: why this history must not be managed (the provider holds part of it:
    ``UNMANAGED_REASONS``); the body is then forwarded as sent, output caps and model rules
    aside. ``repairs``: repairs the wire already made while parsing, by kind (they count
    like the pairing pass's). ``grouped``: how many leading items a wire resumed from an earlier
    request of the conversation (``proxy.core.warm``): numbered into tool groups already.
    """

    items: list[Item]
    fixed_tokens: int
    paired: bool | None = None
    notes: list[str] = field(default_factory=list)
    unmanaged: str | None = None
    repairs: Counter[str] = field(default_factory=Counter)
    grouped: int = 0  # the first items were resumed from an earlier request: they carry their group numbers
    tokens: int | None = None  # the items' tokens in all, when the wire knows them (a resumed conversation)


# why a history is left unmanaged (a bounded metric label)
UNMANAGED_REASONS = frozenset({"previous_response_id", "conversation", "item_reference"})


class WireAdapter(Protocol):
    """One wire protocol: parse a body into items, render items back into a body of the same wire."""

    name: str  # the bounded ``wire`` label: chat | responses | messages
    field: str  # the body field that holds the conversation (for error params and explain)
    merge_call_runs: bool  # consecutive call items form one tool group (their results follow the run)
    output_fields: tuple[str, ...]  # the body's output-limit fields, in order of precedence
    choices_field: str | None  # the field asking for several answers at once (Chat ``n``), if the wire has one
    model_param: str  # where the model is, as an error's ``param`` names it

    def parse(self, body: dict[str, Any], counter: TokenCounter) -> Conversation:
        """Validate ``body`` (raise PayloadError/BadRequest) and return its items, counted."""

    def render(self, body: dict[str, Any], items: list[Item], changes: dict[str, Any]) -> dict[str, Any]:
        """The body to forward: ``body`` with its conversation replaced by ``items`` and ``changes`` applied."""

    def count(self, item: Item, counter: TokenCounter) -> None:
        """Set ``item.key`` and ``item.tokens`` (items the wire made itself: placeholders, edited calls)."""

    def summary(self, text: str, covered_turns: int, counter: TokenCounter) -> Item:
        """The summary of older turns as this wire's own item, counted."""

    def without_calls(self, item: Item) -> Item | None:
        """``item`` with its calls removed (None: nothing worth keeping is left)."""

    def placeholder(self, call: Item, call_id: str) -> Item | None:
        """An explicit "no result was recorded" result for ``call_id`` (None: this kind of call has none)."""

    def mask(self, item: Item, text: str, counter: TokenCounter) -> Item | None:
        """The result ``item`` with its output replaced by ``text``, counted; everything else about it kept
        (its pairing id, its error flag, unknown keys). None when this kind of result cannot carry text
        (a screenshot, an approval): it is then never masked."""

    def output_field(self, upstream_model: str) -> str:
        """The field to add when a tenant's output cap applies and the request sets none."""

    def output_limits(self, body: dict[str, Any]) -> dict[str, Any]:
        """The body's output limits that are set, by the name ``changes`` gives them (not checked)."""

    def model_of(self, body: dict[str, Any], params: Mapping[str, str]) -> Any:
        """The model the client asked for (``params``: the request path's parameters); not checked."""

    def model_changes(self, body: dict[str, Any], upstream_model: str) -> dict[str, Any]:
        """The changes that send ``upstream_model`` in the body (none when the model is in the path)."""



# A wire that can parse a request of a known conversation from where its previous request ended
# (``proxy.core.warm``) has ``resume(body, counter, tenant)``: ``parse``, with the items of the longest prefix
# ``tenant`` sent before reused, and the same result.
Resume = Callable[[dict[str, Any], TokenCounter, str], Conversation]
