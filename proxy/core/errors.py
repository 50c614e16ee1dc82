"""Errors ctxproxy raises, and their one mapping to OpenAI's error shape.

::

    CtxProxyError                      every error a client may see
    ├── BadRequest (400)               invalid_request_error
    │   ├── InvalidJSON                code=invalid_json
    │   ├── PayloadError               the ProviderPayloadError: code names the check
    │   ├── ContextLengthExceeded      code=context_length_exceeded
    │   └── OutputLimitExceeded        code=max_tokens_exceeded (tenant policy: refuse)
    ├── BodyTooLarge (413)             code=request_too_large
    ├── RequestTimeout (408)           code=request_timeout (a client too slow to send its body)
    ├── UnsupportedEncoding (415)      code=unsupported_content_encoding (a body in br, zstd …)
    ├── AuthenticationError (401)      code=invalid_api_key
    ├── PermissionDenied (403)         code=not_allowed (a relayed path a tenant may not use)
    ├── ModelNotFound (404)            code=model_not_found
    ├── NotFound (404)                 code=not_found
    ├── RouteError (its status)        an HTTP-level refusal (405 method_not_allowed …)
    ├── ReportUnavailable (503)        code=ledger_unavailable (the cost ledger cannot be read or written)
    └── UpstreamError                  the provider side
        ├── UpstreamUnreachable (502)  code=upstream_unreachable
        ├── UpstreamTimeout (504)      code=upstream_timeout
        ├── SummarizerFailed (502)     code=summarizer_failed (on_summarizer_error: fail)
        └── UpstreamStatus (relayed)   the provider's status and normalised body

    InternalError                      never sent to a client as such
    ├── ConfigError                    startup / validate / reload: one line per problem
    ├── BindingError                   a plugin binding that cannot be resolved
    ├── OverrideRejected               a per-request override ignored (a warning header says why)
    ├── SummaryUnavailable             the summariser failed or is backing off (the trimmer serves)
    ├── CacheBackendError              a cache backend failed (SafeCache turns it into "no cache")
    └── LedgerUnavailable              the cost ledger's store cannot be read or written (the report fails)

``to_openai`` gives an error's OpenAI-shaped body; a wire adapter renders it in its
own shape (``proxy.wire``), so every body a client sees comes from this tree.
"""

from __future__ import annotations

from typing import Any


class CtxProxyError(Exception):
    """Base of every client-visible error."""

    status = 500
    type = "server_error"
    code: str | None = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def to_openai(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


class BadRequest(CtxProxyError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class InvalidJSON(BadRequest):
    code = "invalid_json"


class PayloadError(BadRequest):
    """A payload that would be rejected by the provider (docs/design.md#8-pairing-and-the-payload-check)."""

    code = "invalid_payload"


class ContextLengthExceeded(BadRequest):
    code = "context_length_exceeded"


class OutputLimitExceeded(BadRequest):
    code = "max_tokens_exceeded"


class BodyTooLarge(CtxProxyError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class RequestTimeout(CtxProxyError):
    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class UnsupportedEncoding(CtxProxyError):
    """A request body in a content coding the proxy does not decode; the answer says which it does."""

    status = 415
    type = "invalid_request_error"
    code = "unsupported_content_encoding"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 accepted: str = "identity") -> None:
        super().__init__(message, param=param, code=code)
        self.headers = {"Accept-Encoding": accepted}  # RFC 9110 15.5.16: the codings it does accept


class AuthenticationError(CtxProxyError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class PermissionDenied(CtxProxyError):
    status = 403
    type = "permission_error"
    code = "not_allowed"


class ModelNotFound(CtxProxyError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class NotFound(CtxProxyError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class RouteError(CtxProxyError):
    """An HTTP-level refusal from the server itself (a method a route does not allow, …)."""

    type = "invalid_request_error"

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message, code={404: "not_found", 405: "method_not_allowed"}.get(status, "http_error"))
        self.status = status


class ReportUnavailable(CtxProxyError):
    """The cost report cannot be made: its ledger cannot be read (or this process's figures written)."""

    status = 503
    type = "server_error"
    code = "ledger_unavailable"


class UpstreamError(CtxProxyError):
    status = 502
    type = "upstream_error"
    code = "upstream_error"


class UpstreamUnreachable(UpstreamError):
    code = "upstream_unreachable"


class UpstreamTimeout(UpstreamError):
    status = 504
    code = "upstream_timeout"


class SummarizerFailed(UpstreamError):
    code = "summarizer_failed"


class UpstreamStatus(UpstreamError):
    """An upstream 4xx/5xx, relayed with its status and an OpenAI-shaped body."""

    def __init__(self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None,
                 raw: Any = None) -> None:
        err = body.get("error")
        message = err.get("message") if isinstance(err, dict) else None
        super().__init__(str(message or f"upstream answered {status}"))
        self.status = status
        self.body = body
        self.headers = headers or {}
        self.raw = raw  # the upstream's own parsed body (a wire relays it as is when it is in its shape)

    def to_openai(self) -> dict[str, Any]:
        return self.body


class InternalError(Exception):
    """Base of the errors that are handled inside the proxy and never reach a client as such."""


class ConfigError(InternalError):
    """An invalid configuration: one line per problem, each naming its key path."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


class BindingError(InternalError):
    """A binding that cannot be resolved; ``problems`` are (key path, message) pairs."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        super().__init__("; ".join(f"{p}: {m}" if p else m for p, m in problems))
        self.problems = problems


class OverrideRejected(InternalError):
    """A per-request ``x-ctxproxy-context-manager`` override that is ignored (and why)."""


class SummaryUnavailable(InternalError):
    """The summariser failed (error, timeout, empty answer) or is backing off; ``reason`` is a metric label."""

    def __init__(self, message: str, reason: str = "error") -> None:
        super().__init__(message)
        self.reason = reason


class CacheBackendError(InternalError):
    """A cache backend could not complete an operation (I/O error, corrupt data, backend down)."""


class LedgerUnavailable(InternalError):
    """The cost ledger's store cannot be read or written; the message says why and where (never a secret)."""


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def normalise_error_body(status: int, payload: Any) -> dict[str, Any]:
    """Turn any provider error payload into OpenAI's shape (e.g. Gemini's ``[{"error": ...}]``)."""
    if isinstance(payload, list) and payload:
        payload = payload[0]
    if isinstance(payload, dict):
        err = payload.get("error")
        if isinstance(err, dict):
            message = err.get("message") or err.get("status") or f"upstream answered {status}"
            code = err.get("code")
            return error_body(
                str(message),
                str(err.get("type") or err.get("status") or _type_for(status)),
                err.get("param") if isinstance(err.get("param"), str) else None,
                str(code) if code is not None else None,
            )
        if isinstance(err, str):
            return error_body(err, _type_for(status), None, None)
        for key in ("message", "detail", "msg"):
            if isinstance(payload.get(key), str):
                return error_body(payload[key], _type_for(status), None, None)
    if isinstance(payload, str) and payload.strip():
        return error_body(payload.strip()[:2000], _type_for(status), None, None)
    return error_body(f"upstream answered {status}", _type_for(status), None, None)


def _type_for(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 429:
        return "rate_limit_error"
    if 400 <= status < 500:
        return "invalid_request_error"
    return "upstream_error"
