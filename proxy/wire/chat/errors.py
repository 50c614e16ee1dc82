"""Chat Completions errors: OpenAI's ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any

from proxy.core.errors import CtxProxyError


def error_body(error: CtxProxyError) -> dict[str, Any]:
    return error.to_openai()
