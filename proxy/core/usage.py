"""The provider's ``usage`` object of any wire, normalised: what calibration and cost accounting read.

Each wire reports input tokens its own way:

- Chat Completions: ``prompt_tokens`` (every input token, cached ones included),
  ``prompt_tokens_details.cached_tokens``; litellm adds Anthropic's ``cache_creation_input_tokens``.
- Responses: ``input_tokens`` (cached included), ``input_tokens_details.cached_tokens``.
- Anthropic Messages: ``input_tokens`` counts only the uncached part; ``cache_read_input_tokens`` and
  ``cache_creation_input_tokens`` come on top of it.

``normalise_usage`` turns any of them into one ``Usage`` whose ``input_tokens`` is the whole input the
provider counted. Provider data is untrusted: a count that is missing, negative, fractional, a bool or
a string is not a count; parts that do not add up (cached above the input) are clamped and the usage is
marked inconsistent, so nothing downstream divides by a lie.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_COUNT = 10**12  # beyond any real request: a larger "count" is garbage


@dataclass(frozen=True)
class Usage:
    """One answer's usage: ``input_tokens`` is every input token, of which ``cached_tokens`` were read from
    the provider's prompt cache and ``cache_write_tokens`` written to it (Anthropic)."""

    input_tokens: int
    cached_tokens: int = 0
    cache_write_tokens: int = 0
    output_tokens: int = 0
    consistent: bool = True

    @property
    def uncached_tokens(self) -> int:
        return self.input_tokens - self.cached_tokens


def count(value: Any) -> int | None:
    """A token count, or None when ``value`` is not one (bool, negative, fractional, text, absurd)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and 0 <= value <= MAX_COUNT:
        return value
    return None


def _detail(usage: Mapping[str, Any], field: str, key: str) -> Any:
    details = usage.get(field)
    return details.get(key) if isinstance(details, Mapping) else None


def normalise_usage(usage: Any, wire: str | None = None) -> Usage | None:
    """``usage`` of a ``wire`` answer (chat | responses | messages; None: told apart by its keys) as a
    ``Usage``, or None when it carries no usable input count."""
    if not isinstance(usage, Mapping):
        return None
    if wire is None:
        if "prompt_tokens" in usage:
            wire = "chat"
        elif "input_tokens_details" in usage:
            wire = "responses"
        else:
            wire = "messages" if "input_tokens" in usage else "chat"
    consistent = True

    def part(value: Any) -> int:
        nonlocal consistent
        if value is None:
            return 0
        n = count(value)
        if n is None:
            consistent = False
            return 0
        return n

    if wire == "messages":
        base = count(usage.get("input_tokens"))
        if base is None:
            return None
        cached = part(usage.get("cache_read_input_tokens"))
        writes = part(usage.get("cache_creation_input_tokens"))
        total = base + cached + writes
        output = part(usage.get("output_tokens"))
        return Usage(total, cached, writes, output, consistent)
    if wire == "responses":
        total_raw = count(usage.get("input_tokens"))
        cached = part(_detail(usage, "input_tokens_details", "cached_tokens"))
        writes = 0
        output = part(usage.get("output_tokens"))
    else:
        total_raw = count(usage.get("prompt_tokens"))
        cached = part(_detail(usage, "prompt_tokens_details", "cached_tokens"))
        writes = part(usage.get("cache_creation_input_tokens"))
        output = part(usage.get("completion_tokens"))
    if total_raw is None:
        return None
    total = total_raw
    if cached > total:
        cached, consistent = total, False
    if writes > total - cached:
        writes, consistent = total - cached, False
    return Usage(total, cached, writes, output, consistent)
