"""A provider's refusal of a payload too long for its window, read from its error body.

A refusal for length says the provider counted more input than its window holds: it is evidence about
the provider's count (calibration) and about its real window, and the proxy recovers from it
(``proxy.serve.overflow``). Providers word it differently; what is recognised (the error's
``code``/``type``, or its message; ``message`` at the top level or ``error`` as a plain string too):

- OpenAI: ``code: context_length_exceeded``, "This model's maximum context length is 8192 tokens.
  However, your messages resulted in 11059 tokens ..." or "... However, you requested 9000 tokens (8000
  in the messages, 1000 in the completion)"; the Responses API: "Input tokens exceed the configured limit
  of N tokens. Your messages resulted in M tokens" and, with no number, "Your input exceeds the context
  window of this model".
- Anthropic: "prompt is too long: 211234 tokens > 200000 maximum"; "input length and `max_tokens`
  exceed context limit: 198000 + 8192 > 200000".
- vLLM: "This model's maximum context length is 8192 tokens. However, your request has 9000 input
  tokens" (older: "you requested 9000 tokens (8000 in the messages, 1000 in the completion)").
- SGLang, Together: "The input (49146 tokens) is longer than the model's context length (40960 tokens)".
- llama.cpp's server: ``type: exceed_context_size_error`` with ``n_prompt_tokens`` and ``n_ctx``.
- Ollama: "prompt too long; exceeded max context length by 4021 tokens" (the excess only), and with no
  number "the input length exceeds the context length".
- Mistral: "Prompt contains 240000 tokens, too large for model with 128000 maximum context length".
- litellm: ``ContextWindowExceededError`` (its message quotes the provider's).

Not a refusal for length, whatever else it says: a status other than 400/413, a message about a rate
("too many tokens per minute", "throttling", "please wait"): a limit on tokens per minute is not a window;
and a limit on the request's size in bytes (Anthropic's 413 ``request_too_large``, "Request exceeds the
maximum size", a gateway's "Payload Too Large"): fewer tokens may not make it smaller.

``input_tokens`` is the provider's own count of the input when the message states it; ``limit`` the
window it states; ``excess`` how far over it the request was, where that is all it states (Ollama).
Numbers may carry thousands separators ("5,958,968").
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_MESSAGE = 2000  # only the start of a message is read
MAX_COUNT = 10**9

_N = r"(\d{1,3}(?:,\d{3})+|\d+)"  # a count, with or without thousands separators
_LENGTH = re.compile(
    r"context[ _-]?(?:length|window|size|limit)|prompt is too long|prompt too long|too many (?:input )?tokens"
    r"|exceed(?:s|ed)? (?:the )?(?:context|configured limit|maximum context)|maximum (?:model|input) length"
    r"|too large for model|model token limit|prompt token count", re.I)
_RATE = re.compile(r"per (?:minute|second|hour|day)|rate[ _-]?limit|throttl|please wait|quota|monthly|daily", re.I)
# a limit on the request's size in bytes (Anthropic's 413 request_too_large, a gateway's body limit) is not a window
_SIZE = re.compile(r"request_too_large|maximum size|entity too large|payload too large|\d+ ?(?:[kmg]i?b|bytes)\b",
                   re.I)
_INPUT = (
    re.compile(rf"prompt is too long: {_N} tokens", re.I),
    re.compile(rf"input length and `?max_tokens`? exceed context limit: {_N} \+", re.I),
    re.compile(rf"resulted in {_N} tokens", re.I),
    re.compile(rf"your request has {_N} input tokens", re.I),
    re.compile(rf"the input \({_N} tokens\)", re.I),
    re.compile(rf"prompt (?:contains|has) {_N} tokens", re.I),
    re.compile(rf"input length \(?{_N}\)? exceeds", re.I),
    re.compile(rf"decoder prompt \(length {_N}\)", re.I),
    re.compile(rf"prompt token count of {_N}", re.I),
    re.compile(rf"\(requested: {_N}\)", re.I),
)
_LIMIT = (
    re.compile(rf"{_N} maximum", re.I),
    re.compile(rf"maximum context length is {_N}", re.I),
    re.compile(rf"maximum context length (?:of )?\(?{_N}", re.I),
    re.compile(rf"context limit: {_N} \+ {_N} > {_N}", re.I),
    re.compile(rf"limit of {_N} tokens", re.I),
    re.compile(rf"model's context length \({_N} tokens\)", re.I),
    re.compile(rf"configured context size is {_N}", re.I),
    re.compile(rf"maximum (?:model|allowed input) length of {_N}", re.I),
    re.compile(rf"exceeds the limit of {_N}", re.I),
    re.compile(rf"token limit: {_N}", re.I),
)
# OpenAI's "you requested N tokens (A in the messages, [F in the functions, and] C in the completion)": the
# input is what is not the completion
_REQUESTED = re.compile(rf"\({_N} in the messages(?:, {_N} in the functions)?", re.I)
_EXCESS = re.compile(rf"exceeded (?:max )?context length by {_N}", re.I)
_LITELLM = "ContextWindowExceededError"


@dataclass(frozen=True)
class Refusal:
    """A refusal for length: the provider's input count and its window if stated, and the excess when that is
    all it states."""

    input_tokens: int | None
    limit: int | None
    excess: int | None = None


def length_refusal(status: int, body: Any) -> Refusal | None:
    """The refusal for length in a provider's error answer (status 400 or 413; its parsed body), or None."""
    if status not in (400, 413) or not isinstance(body, Mapping):
        return None
    error = body.get("error")
    if isinstance(error, str):
        error = {"message": error}
    elif not isinstance(error, Mapping):
        error = body if isinstance(body.get("message"), str) else None  # Mistral's and older vLLM's shape
    if error is None:
        return None
    found = error.get("message")
    message = (found if isinstance(found, str) else "")[:MAX_MESSAGE]
    kind = " ".join(str(error.get(k)) for k in ("code", "type") if isinstance(error.get(k), str))
    if _RATE.search(message) or _SIZE.search(f"{kind} {message}") \
            or not (_LENGTH.search(kind) or _LENGTH.search(message) or _LITELLM in message):
        return None
    limit = _field(error.get("n_ctx")) or _first(message, _LIMIT)
    return Refusal(_field(error.get("n_prompt_tokens")) or _input(message), limit, _first(message, (_EXCESS,)))


def _input(message: str) -> int | None:
    requested = _REQUESTED.search(message)
    if requested is not None:
        counts = [_number(g) for g in requested.groups() if g is not None]
        total = sum(c for c in counts if c is not None)
        return total if 0 < total < MAX_COUNT else None
    return _first(message, _INPUT)


def _first(message: str, patterns: tuple[re.Pattern[str], ...]) -> int | None:
    for pattern in patterns:
        found = pattern.search(message)
        if found is not None:
            return _number(found.groups()[-1])
    return None


def _number(text: str) -> int | None:
    value = int(text.replace(",", ""))
    return value if 0 < value < MAX_COUNT else None


def _field(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value < MAX_COUNT:
        return value
    return None
