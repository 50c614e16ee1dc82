"""The same conversation on each wire, for ``bench/retention.py``.

A form turns a prefix of a Chat Completions conversation into a request body of its wire, and lists
the body's elements (what the measurements compare and search): the conversation field's entries,
plus, on a wire with a top-level system field, that field as one element in front. Each element of
a request names the chat messages it came from (its origins), so turns, values and dependencies
are counted on the same messages whatever the wire.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from bench.retention_data import Message
from proxy.wire import WIRES

Element = Any
Origins = list[tuple[int, ...]]


class Form(Protocol):
    @property
    def name(self) -> str: ...

    def request(self, model: str, messages: list[Message]) -> tuple[dict[str, Any], list[Element], Origins]:
        """The body for ``messages``, its elements and each element's chat messages."""

    def forwarded(self, body: dict[str, Any]) -> list[Element]:
        """The elements of a body the pipeline would forward."""


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _arguments(raw: Any) -> Any:
    try:
        return json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        return {"raw": raw}


@dataclass(frozen=True)
class ChatForm:
    name: str = "chat"

    def request(self, model: str, messages: list[Message]) -> tuple[dict[str, Any], list[Element], Origins]:
        return {"model": model, "messages": messages}, messages, [(i,) for i in range(len(messages))]

    def forwarded(self, body: dict[str, Any]) -> list[Element]:
        out: list[Element] = body["messages"]
        return out


@dataclass(frozen=True)
class ResponsesForm:
    """Responses input items: messages by role, ``function_call`` and ``function_call_output`` by call_id."""

    name: str = "responses"

    def request(self, model: str, messages: list[Message]) -> tuple[dict[str, Any], list[Element], Origins]:
        items: list[Element] = []
        origins: Origins = []
        for i, m in enumerate(messages):
            role, content = m.get("role"), m.get("content")
            if role in ("system", "developer", "user"):
                items.append({"role": role, "content": _text(content)})
                origins.append((i,))
            elif role == "assistant":
                if _text(content):
                    items.append({"type": "message", "role": "assistant", "status": "completed",
                                  "content": [{"type": "output_text", "text": _text(content), "annotations": []}]})
                    origins.append((i,))
                for call in m.get("tool_calls") or []:
                    items.append({"type": "function_call", "call_id": call["id"], "name": call["function"]["name"],
                                  "arguments": call["function"]["arguments"], "status": "completed"})
                    origins.append((i,))
            elif role == "tool":
                items.append({"type": "function_call_output", "call_id": m["tool_call_id"],
                              "output": _text(content)})
                origins.append((i,))
        return {"model": model, "input": items}, items, origins

    def forwarded(self, body: dict[str, Any]) -> list[Element]:
        head = [{"instructions": body["instructions"]}] if "instructions" in body else []
        return head + list(body["input"])


@dataclass(frozen=True)
class MessagesForm:
    """Anthropic Messages: a top-level system, ``tool_use`` blocks, and one user message per run of results."""

    name: str = "messages"
    max_tokens: int = 4096

    def request(self, model: str, messages: list[Message]) -> tuple[dict[str, Any], list[Element], Origins]:
        system = [i for i, m in enumerate(messages) if m.get("role") in ("system", "developer")]
        out: list[Message] = []
        origins: Origins = []
        for i, m in enumerate(messages):
            role, content = m.get("role"), m.get("content")
            if role == "user":
                out.append({"role": "user", "content": _text(content)})
                origins.append((i,))
            elif role == "assistant":
                blocks: list[dict[str, Any]] = []
                if _text(content):
                    blocks.append({"type": "text", "text": _text(content)})
                for call in m.get("tool_calls") or []:
                    blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                                   "input": _arguments(call["function"]["arguments"])})
                out.append({"role": "assistant", "content": blocks})
                origins.append((i,))
            elif role == "tool":
                block = {"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": _text(content)}
                last = out[-1] if out else None
                if last is not None and last["role"] == "user" and isinstance(last["content"], list):
                    last["content"].append(block)
                    origins[-1] = (*origins[-1], i)
                else:
                    out.append({"role": "user", "content": [block]})
                    origins.append((i,))
        body: dict[str, Any] = {"model": model, "max_tokens": self.max_tokens, "messages": out}
        elements: list[Element] = list(out)
        if system:
            body["system"] = "\n\n".join(_text(messages[i].get("content")) for i in system)
            elements.insert(0, {"system": body["system"]})
            origins.insert(0, tuple(system))
        return body, elements, origins

    def forwarded(self, body: dict[str, Any]) -> list[Element]:
        head = [{"system": body["system"]}] if "system" in body else []
        return head + list(body["messages"])


FORMS: dict[str, Form] = {"chat": ChatForm(), "responses": ResponsesForm(), "messages": MessagesForm()}


def adapter(form: Form) -> Any:
    """The wire adapter the pipeline runs for ``form`` (``proxy.wire.WIRES``, the stable entry point)."""
    return WIRES[form.name]
