"""Field names as the most lenient common JSON decoder matches them.

Go's ``encoding/json`` (behind Ollama, LocalAI and many gateways) matches object keys to struct fields
case-insensitively, by Unicode simple folding, the last key winning: ``"Model"``, ``"MAX_TOKENS"`` or
``"max_tokenſ"`` (a long s) name the same field as the exact key. A key that folds onto a field the proxy
reads, without being it, would make such an upstream act on something the proxy never checked or counted;
wires refuse it.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from proxy.core.errors import PayloadError


def go_fold(key: str) -> str:
    """``key`` folded as Go folds it onto an ASCII field name (lower case; the long s and the Kelvin sign)."""
    return key.lower().replace("\u017f", "s")


def case_variant(key: str, fields: Collection[str]) -> str | None:
    """The field of ``fields`` that ``key`` only differs from by case folding, or None."""
    if key.isascii() and key.islower():  # the common case: an exact name, or one that is nobody's variant
        return None
    folded = go_fold(key)
    return folded if folded != key and folded in fields else None


# The keys of conversation items, content parts and blocks that some wire reads (the union of the three)
STRUCTURAL_FIELDS = frozenset({
    "role", "content", "name", "tool_calls", "tool_call_id", "function_call", "function", "custom", "arguments",
    "type", "id", "text", "refusal", "audio", "transcript", "image_url", "input_audio", "file", "file_data",
    "file_id", "data", "format", "detail", "call_id", "output", "result", "input", "status", "summary",
    "encrypted_content", "reasoning_content", "tool_use_id", "is_error", "thinking", "signature", "source",
    "cache_control", "citations", "action", "approval_request_id", "approve", "reason", "error",
})


def check_keys(obj: dict[str, Any]) -> None:
    """Refuse an item, part or block with a key that only folds onto one the wires read (``"Content"``): a Go
    upstream would read content the proxy never counted, past the budget and the tenant's cap."""
    for key in obj:
        if type(key) is str:
            field = case_variant(key, STRUCTURAL_FIELDS)
            if field is not None:
                raise PayloadError(f"A conversation item has the key '{key[:40]}', which differs from '{field}' "
                                   f"only by case; send '{field}' alone.", code="ambiguous_field")
