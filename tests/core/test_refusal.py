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
    # OpenAI, with tools: the input is the messages and the functions, not the completion
    (body({"message": "This model's maximum context length is 12000 tokens. However, you requested 24488 tokens "
                      "(20488 in the messages, 3000 in the functions, and 1000 in the completion). Please reduce the "
                      "length of the messages, functions, or completion.", "code": "context_length_exceeded"}),
     Refusal(23488, 12000)),
    # the Responses API, with numbers
    (body({"message": "Input tokens exceed the configured limit of 272000 tokens. Your messages resulted in 509178 "
                      "tokens. Please reduce the length of the messages.", "type": "invalid_request_error",
           "param": "input", "code": "context_length_exceeded"}), Refusal(509178, 272000)),
    # vLLM today
    (body({"message": "This model's maximum context length is 4096 tokens. However, your request has 5000 input "
                      "tokens. Please reduce the length of the input messages.", "type": "BadRequestError",
           "param": None, "code": 400}), Refusal(5000, 4096)),
    # SGLang, Together
    (body({"message": "The input (49146 tokens) is longer than the model's context length (40960 tokens).",
           "type": "BadRequestError", "code": 400}), Refusal(49146, 40960)),
    # Ollama: only the excess (its native API puts the message in "error" itself)
    ({"StatusCode": 400, "Status": "400 Bad Request",
      "error": "prompt too long; exceeded max context length by 4021 tokens"}, Refusal(None, None, 4021)),
    (body({"message": "the input length exceeds the context length", "type": "invalid_request_error"}),
     Refusal(None, None)),
    # Mistral: the message at the top level
    ({"object": "error", "message": "Prompt contains 240000 tokens, too large for model with 128000 maximum context "
                                    "length", "type": "invalid_request_error", "param": None, "code": None},
     Refusal(240000, 128000)),
    # thousands separators
    (body({"message": "Prompt has 5,958,968 tokens, but the configured context size is 256,000 tokens"}),
     Refusal(5958968, 256000)),
    # litellm's exception, whatever provider it wraps
    (body({"message": "litellm.ContextWindowExceededError: litellm.BadRequestError: ContextWindowExceededError: "
                      "OpenAIException - This model's maximum context length is 8192 tokens. However, your messages "
                      "resulted in 9100 tokens.", "type": None, "code": "context_length_exceeded"}),
     Refusal(9100, 8192)),
])
def test_each_providers_words(raw: dict[str, Any], refusal: Refusal) -> None:
    assert length_refusal(400, raw) == refusal


@pytest.mark.parametrize(("status", "raw"), [
    (400, body({"message": "messages: field required", "type": "invalid_request_error"})),
    (500, body({"message": "prompt is too long: 9000 tokens > 8000 maximum"})),  # not a refusal status
    (429, body({"message": "context length exceeded", "code": "context_length_exceeded"})),
    (400, "not json"), (400, None), (400, [1, 2]), (400, {"error": "model 'llama3' not found"}),
    # a limit on the body's size in bytes is not a window
    (413, {"type": "error", "error": {"type": "request_too_large", "message": "Request exceeds the maximum size"}}),
    (413, body({"message": "Payload Too Large: the body may not exceed 32 MB", "code": "context_length_exceeded"})),
    # not an error object
    (400, body({"message": 123, "code": None})), (400, body(["context length exceeded"])), (400, {"error": None}),
    # a limit on tokens per minute is not a window
    (400, body({"message": "ThrottlingException: Too many tokens, please wait before trying again."})),
    (413, body({"message": "Request too large: too many tokens per minute (limit 30000, requested 42000)",
                "code": "rate_limit_exceeded"})),
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
