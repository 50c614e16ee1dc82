"""Messages API errors in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``.

Every body a client sees comes from the error tree (``proxy.core.errors``); this module only
re-shapes it; an Anthropic upstream's own error body is relayed as it came.
"""

from __future__ import annotations

from typing import Any

from proxy.core.errors import CtxProxyError, UpstreamStatus

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors)
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


def error_body(error: CtxProxyError) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}``; an Anthropic upstream's own error body as it came."""
    if isinstance(error, UpstreamStatus) and _anthropic_shaped(error.raw):
        return error.raw  # type: ignore[no-any-return]
    kind = ANTHROPIC_TYPES.get(error.status)
    if kind is None:
        kind = "invalid_request_error" if 400 <= error.status < 500 else "api_error"
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def _anthropic_shaped(raw: Any) -> bool:
    """A body the Anthropic SDK parses as an error: ``{"type": "error", "error": {"type": str, "message": str}}``."""
    if not isinstance(raw, dict) or raw.get("type") != "error":
        return False
    err = raw.get("error")
    return isinstance(err, dict) and isinstance(err.get("type"), str) and isinstance(err.get("message"), str)
