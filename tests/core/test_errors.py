"""proxy.core.errors: the error tree, its one mapping to OpenAI's shape, and upstream error normalisation."""

from __future__ import annotations

import inspect
import re
from typing import Any

import pytest

from proxy.core import errors
from proxy.core.errors import (
    AuthenticationError,
    BadRequest,
    BindingError,
    BodyTooLarge,
    CacheBackendError,
    ConfigError,
    ContextLengthExceeded,
    CtxProxyError,
    InternalError,
    InvalidJSON,
    LedgerUnavailable,
    ModelNotFound,
    NotFound,
    OutputLimitExceeded,
    OverrideRejected,
    PayloadError,
    PermissionDenied,
    ReportUnavailable,
    RequestTimeout,
    RouteError,
    SummarizerFailed,
    SummaryUnavailable,
    UnsupportedEncoding,
    UpstreamError,
    UpstreamStatus,
    UpstreamTimeout,
    UpstreamUnreachable,
    error_body,
    normalise_error_body,
)

# class, parent, status, type, code: the tree as docs/architecture.md and the module docstring draw it
TREE: list[tuple[type[CtxProxyError], type[Exception], int, str, str]] = [
    (BadRequest, CtxProxyError, 400, "invalid_request_error", "invalid_request"),
    (InvalidJSON, BadRequest, 400, "invalid_request_error", "invalid_json"),
    (PayloadError, BadRequest, 400, "invalid_request_error", "invalid_payload"),
    (ContextLengthExceeded, BadRequest, 400, "invalid_request_error", "context_length_exceeded"),
    (OutputLimitExceeded, BadRequest, 400, "invalid_request_error", "max_tokens_exceeded"),
    (BodyTooLarge, CtxProxyError, 413, "invalid_request_error", "request_too_large"),
    (RequestTimeout, CtxProxyError, 408, "invalid_request_error", "request_timeout"),
    (UnsupportedEncoding, CtxProxyError, 415, "invalid_request_error", "unsupported_content_encoding"),
    (AuthenticationError, CtxProxyError, 401, "authentication_error", "invalid_api_key"),
    (PermissionDenied, CtxProxyError, 403, "permission_error", "not_allowed"),
    (ModelNotFound, CtxProxyError, 404, "invalid_request_error", "model_not_found"),
    (NotFound, CtxProxyError, 404, "invalid_request_error", "not_found"),
    (ReportUnavailable, CtxProxyError, 503, "server_error", "ledger_unavailable"),
    (UpstreamError, CtxProxyError, 502, "upstream_error", "upstream_error"),
    (UpstreamUnreachable, UpstreamError, 502, "upstream_error", "upstream_unreachable"),
    (UpstreamTimeout, UpstreamError, 504, "upstream_error", "upstream_timeout"),
    (SummarizerFailed, UpstreamError, 502, "upstream_error", "summarizer_failed"),
]
INTERNAL = [ConfigError, BindingError, OverrideRejected, SummaryUnavailable, CacheBackendError, LedgerUnavailable]


@pytest.mark.parametrize(("cls", "parent", "status", "type_", "code"), TREE, ids=[t[0].__name__ for t in TREE])
def test_client_visible_errors_map_to_openais_shape(
    cls: type[CtxProxyError], parent: type[Exception], status: int, type_: str, code: str
) -> None:
    assert cls.__bases__ == (parent,)
    exc = cls("Something went wrong.", param="messages[3]")
    assert exc.status == status
    assert str(exc) == exc.message == "Something went wrong."
    assert exc.to_openai() == {"error": {"message": "Something went wrong.", "type": type_,
                                         "param": "messages[3]", "code": code}}


@pytest.mark.parametrize("cls", [t[0] for t in TREE])
def test_a_code_given_overrides_the_class_code(cls: type[CtxProxyError]) -> None:
    exc = cls("x", code="unpaired_tool_call")
    assert exc.code == "unpaired_tool_call"
    assert cls.code != "unpaired_tool_call"  # set on the instance, never on the class
    assert cls("y").to_openai()["error"]["param"] is None


def test_the_tree_table_covers_every_client_visible_class() -> None:
    classes = {c for _, c in inspect.getmembers(errors, inspect.isclass)
               if issubclass(c, CtxProxyError) and c is not CtxProxyError and c.__module__ == errors.__name__}
    assert classes == {t[0] for t in TREE} | {UpstreamStatus, RouteError}


def test_the_docstring_tree_names_every_class() -> None:
    doc = errors.__doc__ or ""
    for cls in [t[0] for t in TREE] + [UpstreamStatus, *INTERNAL]:
        assert re.search(rf"\b{cls.__name__}\b", doc), cls.__name__
    for *_, code in TREE:
        if code not in ("invalid_request", "invalid_payload", "upstream_error"):
            assert f"code={code}" in doc


@pytest.mark.parametrize("cls", INTERNAL)
def test_internal_errors_are_not_client_visible(cls: type[Exception]) -> None:
    assert issubclass(cls, InternalError)
    assert not issubclass(cls, CtxProxyError)
    assert not hasattr(cls, "to_openai")


def test_internal_error_payloads() -> None:
    config = ConfigError(["models[0].name: field required", "cache.url: missing"])
    assert config.problems == ["models[0].name: field required", "cache.url: missing"]
    assert str(config) == "models[0].name: field required\ncache.url: missing"
    binding = BindingError([("context_manager.type", "unknown plugin 'x'"), ("", "bare problem")])
    assert str(binding) == "context_manager.type: unknown plugin 'x'; bare problem"
    assert SummaryUnavailable("down").reason == "error"
    assert SummaryUnavailable("later", reason="backoff").reason == "backoff"


def test_upstream_status_relays_status_body_headers_and_raw() -> None:
    body = {"error": {"message": "Rate limit reached for gpt-4o", "type": "rate_limit_error", "param": None,
                      "code": "rate_limit_exceeded"}}
    raw = {"anything": "the upstream's own"}
    exc = UpstreamStatus(429, body, {"Retry-After": "7"}, raw)
    assert isinstance(exc, UpstreamError)
    assert exc.status == 429
    assert exc.message == "Rate limit reached for gpt-4o"
    assert exc.to_openai() is body
    assert exc.headers == {"Retry-After": "7"}
    assert exc.raw is raw


@pytest.mark.parametrize("body", [{}, {"error": "flat"}, {"error": {"message": ""}}, {"error": {"type": "x"}}])
def test_upstream_status_without_a_message(body: dict[str, Any]) -> None:
    exc = UpstreamStatus(503, body)
    assert exc.message == "upstream answered 503"
    assert exc.headers == {}


def test_error_body() -> None:
    assert error_body("m", "t") == {"error": {"message": "m", "type": "t", "param": None, "code": None}}


@pytest.mark.parametrize(("status", "payload", "expected"), [
    # OpenAI's own shape passes through
    (400, {"error": {"message": "Invalid 'messages[1]'", "type": "invalid_request_error", "param": "messages",
                     "code": "invalid_value"}},
     ("Invalid 'messages[1]'", "invalid_request_error", "messages", "invalid_value")),
    # Gemini's list shape, with status instead of type and a numeric code
    (429, [{"error": {"code": 429, "message": "Resource has been exhausted", "status": "RESOURCE_EXHAUSTED"}}],
     ("Resource has been exhausted", "RESOURCE_EXHAUSTED", None, "429")),
    # a message-less error object uses its status
    (500, {"error": {"status": "INTERNAL"}}, ("INTERNAL", "INTERNAL", None, None)),
    (500, {"error": {}}, ("upstream answered 500", "upstream_error", None, None)),
    # a non-string param is dropped
    (400, {"error": {"message": "bad", "param": ["x"]}}, ("bad", "invalid_request_error", None, None)),
    (401, {"error": "Unauthorized"}, ("Unauthorized", "authentication_error", None, None)),
    (422, {"detail": "Unprocessable entity"}, ("Unprocessable entity", "invalid_request_error", None, None)),
    (404, {"message": "Not Found"}, ("Not Found", "invalid_request_error", None, None)),
    (400, {"msg": "bad field"}, ("bad field", "invalid_request_error", None, None)),
    (400, {"detail": [{"loc": ["body"]}]}, ("upstream answered 400", "invalid_request_error", None, None)),
    (502, "<html>Bad Gateway</html>\n", ("<html>Bad Gateway</html>", "upstream_error", None, None)),
    (503, "   ", ("upstream answered 503", "upstream_error", None, None)),
    (429, None, ("upstream answered 429", "rate_limit_error", None, None)),
    (500, [], ("upstream answered 500", "upstream_error", None, None)),
    (500, 42, ("upstream answered 500", "upstream_error", None, None)),
    (400, {"error": {"message": 7, "code": 0}}, ("7", "invalid_request_error", None, "0")),
])
def test_normalise_error_body(status: int, payload: Any, expected: tuple[Any, ...]) -> None:
    body = normalise_error_body(status, payload)
    assert set(body) == {"error"}
    err = body["error"]
    assert (err["message"], err["type"], err["param"], err["code"]) == expected
    assert isinstance(err["message"], str)


def test_a_long_text_error_body_is_cut() -> None:
    body = normalise_error_body(500, "x" * 10_000)
    assert len(body["error"]["message"]) == 2_000


@pytest.mark.parametrize(("status", "code"), [(404, "not_found"), (405, "method_not_allowed"), (418, "http_error")])
def test_route_errors_keep_their_status(status: int, code: str) -> None:
    exc = RouteError(status, "Method Not Allowed")
    assert exc.status == status and exc.to_openai()["error"]["code"] == code
    assert exc.to_openai()["error"]["type"] == "invalid_request_error"
