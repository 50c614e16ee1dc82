"""bench/retention_wires.py: the same conversations in each wire's shape, valid as that wire reads them."""

from __future__ import annotations

import pytest

from bench.coding_agent import session
from bench.retention_data import Conversation, tau_conversations
from bench.retention_wires import FORMS, adapter
from proxy.core.tokens import Tokenizers, use_bundled_encodings
from proxy.pipeline import prepare


def sample() -> list[Conversation]:
    return [*tau_conversations()[:25], session(3, turns=6)]


@pytest.mark.parametrize("wire", sorted(FORMS))
def test_every_form_is_read_by_its_wire_without_repair_and_names_every_message(wire: str) -> None:
    """The Responses form splits an assistant message into its text and its calls (two elements, one origin); the
    Messages form merges a run of results into one user message (one element, several origins)."""
    use_bundled_encodings()
    counter = Tokenizers().get("o200k_base")
    form = FORMS[wire]
    for conversation in sample():
        messages = conversation.messages
        body, elements, origins = form.request("gpt-4o", messages)
        prepared = prepare(body, adapter(form), counter)
        assert not prepared.repairs and prepared.unmanaged is None
        assert len(elements) == len(origins)
        assert {i for chat in origins for i in chat} == set(range(len(messages)))
        assert form.forwarded(body) == elements
