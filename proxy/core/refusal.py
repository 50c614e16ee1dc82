"""A provider's refusal of a payload too long for its window, read from its error body: calibration evidence.

A refusal for length says the provider counted more input than its window holds, so it is evidence
about the provider's count even without a ``usage`` object. Providers word it differently; what is
recognised (the error's ``code``/``type``, or its message):

- OpenAI: ``code: context_length_exceeded``, "This model's maximum context length is 8192 tokens.
  However, your messages resulted in 11059 tokens ..." (Responses: "Your input exceeds the context
  window of this model" / "Input tokens exceed the configured limit of N tokens. Your messages resulted
  in M tokens").
- Anthropic: "prompt is too long: 211234 tokens > 200000 maximum"; "input length and `max_tokens`
  exceed context limit: 198000 + 8192 > 200000".
- vLLM: "... maximum context length is 8192 tokens. However, you requested 9000 tokens (8000 in the
  messages, 1000 in the completion)".
- llama.cpp's server: ``type: exceed_context_size_error`` with ``n_prompt_tokens`` and ``n_ctx``.

``input_tokens`` is the provider's own count of the input when the message states it (then the
refusal is an exact sample); otherwise only a bound is known: the input was larger than ``limit`` (the
window the message states, or None: the route's configured window).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_MESSAGE = 2000  # only the start of a message is read
MAX_COUNT = 10**9

_LENGTH = re.compile(r"context[ _-]?(?:length|window|size)|prompt is too long|too many (?:input )?tokens"
                     r"|exceed(?:s|ed)? (?:the )?(?:context|configured limit|maximum)", re.I)
_INPUT = (
    re.compile(r"prompt is too long: (\d+) tokens", re.I),
    re.compile(r"input length and `?max_tokens`? exceed context limit: (\d+) \+", re.I),
    re.compile(r"resulted in (\d+) tokens", re.I),
    re.compile(r"\((\d+) in the messages", re.I),
)
_LIMIT = (
    re.compile(r"(\d+) maximum", re.I),
    re.compile(r"maximum context length is (\d+)", re.I),
    re.compile(r"context limit: \d+ \+ \d+ > (\d+)", re.I),
    re.compile(r"limit of (\d+) tokens", re.I),
)


@dataclass(frozen=True)
class Refusal:
    """A refusal for length: the provider's input count if stated, and the window it was refused against."""

    input_tokens: int | None
    limit: int | None


def length_refusal(status: int, body: Any) -> Refusal | None:
    """The refusal for length in a provider's error answer (status 400 or 413; its parsed body), or None."""
    if status not in (400, 413):
        return None
    error = body.get("error") if isinstance(body, Mapping) else None
    if not isinstance(error, Mapping):
        return None
    found = error.get("message")
    message = found if isinstance(found, str) else ""
    kind = " ".join(str(error.get(k)) for k in ("code", "type") if isinstance(error.get(k), str))
    if not (_LENGTH.search(kind) or _LENGTH.search(message[:MAX_MESSAGE])):
        return None
    return Refusal(_count(error.get("n_prompt_tokens"), message, _INPUT), _count(error.get("n_ctx"), message, _LIMIT))


def _count(field: Any, message: str, patterns: tuple[re.Pattern[str], ...]) -> int | None:
    if isinstance(field, int) and not isinstance(field, bool) and 0 < field < MAX_COUNT:
        return field
    for pattern in patterns:
        found = pattern.search(message[:MAX_MESSAGE])
        if found is not None and 0 < int(found.group(1)) < MAX_COUNT:
            return int(found.group(1))
    return None
