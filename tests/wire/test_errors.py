"""proxy.wire.errors: the error tree re-shaped per wire (OpenAI's for chat/responses, Anthropic's for messages)."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.core.errors import (
    AuthenticationError,
    BadRequest,
    BodyTooLarge,
    ContextLengthExceeded,
    CtxProxyError,
    ModelNotFound,
    PayloadError,
    PermissionDenied,
    RequestTimeout,
    SummarizerFailed,
    UpstreamStatus,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from proxy.wire.errors import ANTHROPIC_TYPES, anthropic_error_body, openai_error_body


@pytest.mark.parametrize("error", [
    PayloadError("messages[2] answers tool call 'c1', which is not pending", param="messages[2]",
                 code="unpaired_tool_result"),
    ContextLengthExceeded("too long", param="messages"),
    AuthenticationError("Incorrect API key provided."),
    UpstreamTimeout("The upstream did not answer in time."),
])
def test_openai_body_is_the_trees_own(error: CtxProxyError) -> None:
    assert openai_error_body(error) == error.to_openai()


@pytest.mark.parametrize(("error", "type_"), [
    (BadRequest("bad"), "invalid_request_error"),
    (PayloadError("unpaired", code="unpaired_tool_call"), "invalid_request_error"),
    (ContextLengthExceeded("prompt is too long"), "invalid_request_error"),
    (AuthenticationError("invalid x-api-key"), "authentication_error"),
    (PermissionDenied("not relayed"), "permission_error"),
    (ModelNotFound("model: claude-9"), "not_found_error"),
    (BodyTooLarge("too big"), "request_too_large"),
    (RequestTimeout("slow body"), "invalid_request_error"),  # 408: not in Anthropic's table, a 4xx
    (UpstreamUnreachable("unreachable"), "api_error"),  # 502
    (SummarizerFailed("summariser failed"), "api_error"),
    (UpstreamStatus(429, {"error": {"message": "Rate limited"}}), "rate_limit_error"),
    (UpstreamStatus(529, {"error": {"message": "Overloaded"}}), "overloaded_error"),
    (UpstreamStatus(418, {"error": {"message": "teapot"}}), "invalid_request_error"),
    (UpstreamStatus(503, {"error": {"message": "unavailable"}}), "api_error"),
])
def test_anthropic_body_by_status(error: CtxProxyError, type_: str) -> None:
    body = anthropic_error_body(error)
    assert body == {"type": "error", "error": {"type": type_, "message": error.message}}


def test_anthropic_table_is_anthropics_documented_one() -> None:
    assert ANTHROPIC_TYPES == {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                               500: "api_error", 529: "overloaded_error"}


def test_an_anthropic_upstreams_own_error_body_is_relayed_as_it_came() -> None:
    raw: dict[str, Any] = {"type": "error", "error": {"type": "invalid_request_error",
                                      "message": "messages.1: tool_use ids were found without tool_result blocks"},
           "request_id": "req_011"}
    error = UpstreamStatus(400, {"error": {"message": raw["error"]["message"]}}, raw=raw)
    assert anthropic_error_body(error) is raw


@pytest.mark.parametrize("raw", [
    None,
    "upstream text",
    {"error": {"message": "OpenAI shaped", "type": "invalid_request_error"}},  # not Anthropic's: re-shaped
    {"type": "message", "content": []},
    [{"type": "error"}],
])
def test_other_upstream_bodies_are_reshaped(raw: Any) -> None:
    error = UpstreamStatus(400, {"error": {"message": "Bad thing"}}, raw=raw)
    assert anthropic_error_body(error) == {"type": "error", "error": {"type": "invalid_request_error",
                                                                      "message": "Bad thing"}}
