"""``{"messages", "report"}`` for a chat-completions body: ``ctxproxy assemble`` and POST /v1/ctxproxy/explain."""

from __future__ import annotations

from typing import Any

import orjson

from proxy.errors import BadRequest, InvalidJSON
from proxy.runtime import Runtime
from proxy.settings import Tenant


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidJSON(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object", code="invalid_body")
    return body


async def explain(runtime: Runtime, raw: bytes, tenant: Tenant | None, override: str | None) -> dict[str, Any]:
    body = parse_body(raw)
    assembly, _route, _policy = await runtime.assemble(body, tenant=tenant, override=override)
    return {"messages": assembly.messages, "report": assembly.report.as_dict()}
