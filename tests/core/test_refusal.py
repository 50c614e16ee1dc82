"""proxy.core.refusal: a provider's refusal for length, in each provider's words, and everything else not one."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.core.refusal import MAX_MESSAGE, Refusal, length_refusal


def body(error: Any) -> dict[str, Any]:
    return {"error": error}


@pytest.mark.parametrize(("raw", "refusal"), [
    (body({"message": "This model's maximum context length is 8192 tokens. However, your messages resulted in "
                      "11059 tokens. Please reduce the length of the messages.", "type": "invalid_request_error",
           "param": "messages", "code": "context_length_exceeded"}), Refusal(11059, 8192)),
    ({"type": "error", "error": {"type": "invalid_request_error",
                                 "message": "prompt is too long: 211234 tokens > 200000 maximum"}},
     Refusal(211234, 200000)),
    (body({"type": "invalid_request_error", "message": "input length and `max_tokens` exceed context limit: "
                                                        "198000 + 8192 > 200000, decrease input length"}),
     Refusal(198000, 200000)),
    (body({"message": "This model's maximum context length is 8192 tokens. However, you requested 9000 tokens "
                      "(8000 in the messages, 1000 in the completion).", "type": "BadRequestError", "code": 400}),
     Refusal(8000, 8192)),
    (body({"code": 400, "message": "the request exceeds the available context size, try increasing it",
           "type": "exceed_context_size_error", "n_prompt_tokens": 9000, "n_ctx": 8192}), Refusal(9000, 8192)),
    (body({"message": "Your input exceeds the context window of this model.", "code": "context_length_exceeded"}),
     Refusal(None, None)),
])
def test_each_providers_words(raw: dict[str, Any], refusal: Refusal) -> None:
    assert length_refusal(400, raw) == refusal


@pytest.mark.parametrize(("status", "raw"), [
    (400, body({"message": "messages: field required", "type": "invalid_request_error"})),
    (500, body({"message": "prompt is too long: 9000 tokens > 8000 maximum"})),  # not a refusal status
    (429, body({"message": "context length exceeded", "code": "context_length_exceeded"})),
    (400, "not json"), (400, None), (400, [1, 2]), (400, {"error": "context length"}),
    (400, body({"message": "x" * MAX_MESSAGE + " context length exceeded"})),  # only the start is read
])
def test_other_answers_are_not_refusals(status: int, raw: Any) -> None:
    assert length_refusal(status, raw) is None


def test_counts_that_are_not_counts_are_dropped() -> None:
    got = length_refusal(400, body({"type": "exceed_context_size_error", "message": "too long",
                                    "n_prompt_tokens": True, "n_ctx": -5}))
    assert got == Refusal(None, None)
    huge = length_refusal(413, body({"message": "prompt is too long: " + "9" * 30 + " tokens > 10 maximum"}))
    assert huge == Refusal(None, 10)
