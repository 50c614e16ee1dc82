"""The shape check of a Responses body's ``input``: each item well formed, its ids out of ctxproxy's namespace.

Pairing aside (the repair fixes that), a malformed item is refused with a ``PayloadError``
that names it (``input[3].call_id``).
"""

from __future__ import annotations

from typing import Any

from proxy.core.errors import PayloadError
from proxy.wire.responses.items import (
    CALLS,
    MESSAGE_ROLES,
    OPTIONAL_IDS,
    RESERVED,
    RESULTS,
    kind_of,
    pairing_id,
)

STRING_OUTPUTS = frozenset({"function_call_output", "custom_tool_call_output", "local_shell_call_output"})


def input_elements(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return value
    raise PayloadError("'input' must be a string or an array of input items", param="input", code="invalid_input")


def check_element(element: Any, i: int) -> str:
    """Raise PayloadError unless ``input[i]`` is a well-formed item; return its type."""
    param = f"input[{i}]"
    if not isinstance(element, dict):
        raise PayloadError(f"{param} must be an object (an input item)", param=param, code="invalid_input_item")
    if "type" in element and not isinstance(element["type"], str):
        raise PayloadError(f"{param}.type must be a string", param=f"{param}.type", code="invalid_input_item")
    kind = kind_of(element)
    if not kind:
        raise PayloadError(f"{param} has no type", param=f"{param}.type", code="invalid_input_item")
    if kind == "message":
        _check_message(element, param)
    elif kind in CALLS:
        _check_id(element, param, kind, (CALLS[kind],))
        if kind in ("function_call", "custom_tool_call", "mcp_approval_request"):
            name = element.get("name")
            if not isinstance(name, str) or not name:
                raise PayloadError(f"{param} ({kind}) has no name", param=f"{param}.name", code="invalid_tool_call")
        if kind == "function_call" and not isinstance(element.get("arguments"), str):
            raise PayloadError(f"{param}.arguments must be a string (JSON)", param=f"{param}.arguments",
                               code="invalid_tool_call")
    elif kind in RESULTS:
        _check_id(element, param, kind, RESULTS[kind][1])
        if kind in STRING_OUTPUTS and not isinstance(element.get("output"), (str, list)):
            raise PayloadError(f"{param}.output must be a string or an array of content parts",
                               param=f"{param}.output", code="invalid_tool_output")
    return kind


def _check_id(element: dict[str, Any], param: str, kind: str, fields: tuple[str, ...]) -> None:
    if kind in OPTIONAL_IDS and all(element.get(f) is None for f in fields):
        return
    ident = pairing_id(element, fields)
    if ident is None:
        raise PayloadError(f"{param} ({kind}) has no {fields[0]}", param=f"{param}.{fields[0]}",
                           code="missing_tool_call_id")
    if ident.startswith(RESERVED):
        # that namespace is the MCP approvals' (items.APPROVAL_NS): a client id may not reach into it
        field = next(f for f in fields if element.get(f) == ident)
        raise PayloadError(f"{param}.{field} may not start with a NUL character", param=f"{param}.{field}",
                           code="invalid_tool_call")


def _check_message(element: dict[str, Any], param: str) -> None:
    role = element.get("role")
    if not isinstance(role, str) or role not in MESSAGE_ROLES:
        shown = repr(role) if len(repr(role)) <= 80 else repr(role)[:77] + "..."
        raise PayloadError(f"{param}.role must be one of {sorted(MESSAGE_ROLES)}, got {shown}",
                           param=f"{param}.role", code="invalid_role")
    if "content" not in element:
        raise PayloadError(f"{param} ({role}) has no content", param=f"{param}.content", code="missing_content")
    content = element["content"]
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise PayloadError(f"{param}.content must be a string or an array of content parts",
                           param=f"{param}.content", code="invalid_content")
    for j, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise PayloadError(f"{param}.content[{j}] must be an object with a 'type'",
                               param=f"{param}.content[{j}]", code="invalid_content")
