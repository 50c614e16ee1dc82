"""The Responses API's input items as neutral items: their kinds, pairing ids, token formula, text and atoms.

One neutral ``ResponsesItem`` is one input item, or a run of ``reasoning`` items together
with the item that follows them (``raw`` is then the list ``[reasoning…, follower]``): the
provider refuses a reasoning item without its following item, so the two are dropped, kept
or summarised together and rendered back as consecutive items, never separated.

Call and result items pair by id (``CALLS`` / ``RESULTS``). Every ``call_id`` shares one
namespace, as OpenAI and its clients treat it: Codex answers a ``local_shell_call`` with a
``function_call_output``. MCP approvals pair in a namespace of their own (their ids are
item ids, not call ids).

Token formula (documented estimate; exact for text with the model's tiktoken encoding):

- every item: ``ITEM_TOKENS`` (3, like a Chat Completions message) plus what it carries;
- a message: its role and its content: text parts by their text (``input_text``,
  ``output_text``, ``refusal``), images, files and audio by ``proxy.core.media``,
  any other part by its compact JSON;
- ``function_call`` / ``custom_tool_call`` / ``mcp_call`` / ``mcp_approval_request``: name
  and arguments (input; an mcp call's output too);
- an output item: its output, a string or content parts as in a message;
- other calls (computer, shell, patch, tool search, program): the JSON of their action;
- ``reasoning``: its summary and reasoning texts, plus ``encrypted_content`` estimated as
  ⌈decoded bytes / 4⌉ (its base64 text is never counted as text), without item overhead;
- ``compaction``: 3 + the same estimate of its ``encrypted_content``;
- anything else: 3 + its compact JSON (an image a call produced counts as one image).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator
from typing import Any

from proxy.core import describe, media
from proxy.core.fields import check_keys
from proxy.core.items import ASSISTANT, OTHER, SYSTEM, TOOL, USER, Item, canonical_arguments, media_digest
from proxy.core.tokens import TokenCounter

ITEM_TOKENS = 3
ENCRYPTED_BYTES_PER_TOKEN = 4

# call item type -> the field holding the id its result answers
CALLS: dict[str, str] = {
    "function_call": "call_id",
    "custom_tool_call": "call_id",
    "computer_call": "call_id",
    "local_shell_call": "call_id",
    "shell_call": "call_id",
    "apply_patch_call": "call_id",
    "tool_search_call": "call_id",
    "program": "call_id",
    "mcp_approval_request": "id",
}
# result item type -> (its call's type, the fields that may hold the call's id, first found wins).
# local_shell_call_output names the call's id ``id`` in OpenAI's reference.
RESULTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "function_call_output": ("function_call", ("call_id",)),
    "custom_tool_call_output": ("custom_tool_call", ("call_id",)),
    "computer_call_output": ("computer_call", ("call_id",)),
    "local_shell_call_output": ("local_shell_call", ("call_id", "id")),
    "shell_call_output": ("shell_call", ("call_id",)),
    "apply_patch_call_output": ("apply_patch_call", ("call_id",)),
    "tool_search_output": ("tool_search_call", ("call_id",)),
    "program_output": ("program", ("call_id",)),
    "mcp_approval_response": ("mcp_approval_request", ("approval_request_id",)),
}
# calls whose id is optional: without one they ran on the provider's side and carry no pairing
OPTIONAL_IDS = frozenset({"tool_search_call", "tool_search_output"})
# items that change what later items mean (tools made available, configuration): never dropped
PINNED_TYPES = frozenset({"additional_tools", "configuration_update"})
# provider-side items that carry their own output: plain assistant-side items, not calls
PROVIDER_SIDE = frozenset({"mcp_call", "mcp_list_tools", "web_search_call", "file_search_call",
                           "image_generation_call", "code_interpreter_call"})
MESSAGE_ROLES = {"user": USER, "system": SYSTEM, "developer": SYSTEM, "assistant": ASSISTANT}
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
CALL_ARGUMENTS = ("arguments", "input", "action", "operation", "code")

# the text that marks ctxproxy's own compaction summary (POST /v1/responses/compact emulated)
COMPACT_PREFIX = "[ctxproxy compaction summary]"


# A call id is its own pairing id, so the pairing check's errors name it as the client sent it. MCP approval
# ids live in a namespace no client id can reach in practice (a NUL prefix, as Chat Completions' legacy calls):
# a pairing id starting with NUL is refused while parsing.
RESERVED = "\x00"
APPROVAL_NS = RESERVED + "approval:"


def key(kind: str, ident: str) -> str:
    """The neutral pairing id of a call of ``kind`` (a result uses its call's kind)."""
    return APPROVAL_NS + ident if kind == "mcp_approval_request" else ident


def unkey(neutral: str) -> tuple[str, str]:
    """(``approval`` or ``call``, the client's id) of a neutral pairing id."""
    if neutral.startswith(APPROVAL_NS):
        return "approval", neutral[len(APPROVAL_NS):]
    return "call", neutral


def pairing_id(element: dict[str, Any], fields: tuple[str, ...]) -> str | None:
    """The id an item pairs by: the first of ``fields`` holding a non-empty string."""
    for field in fields:
        ident = element.get(field)
        if isinstance(ident, str) and ident:
            return ident
    return None


def kind_of(element: Any) -> str:
    """An input item's type: ``message`` for role-only items (EasyInputMessage), ``item_reference`` for id-only."""
    if not isinstance(element, dict):
        return ""
    kind = element.get("type")
    if isinstance(kind, str):
        return kind
    if "role" in element:
        return "message"
    return "item_reference" if "id" in element else ""


# -- text and media ---------------------------------------------------------------------------------


def text_of(content: Any) -> tuple[str, list[str]]:
    """The text of a content field (string or parts), and placeholders for its media parts."""
    if isinstance(content, str):
        return content, []
    texts: list[str] = []
    placeholders: list[str] = []
    if isinstance(content, list):
        for part in content:
            if not isinstance(part, dict):
                continue
            kind = part.get("type")
            if kind in TEXT_PARTS and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif kind == "refusal":
                continue  # its own atom and line
            elif kind == "input_image":
                placeholders.append("[image]")
            elif kind == "input_audio":
                placeholders.append("[audio]")
            elif kind == "input_file":
                name = part.get("filename")
                placeholders.append(f"[file {name}]" if isinstance(name, str) else "[file]")
            else:
                placeholders.append(f"[{kind if isinstance(kind, str) else 'part'}]")
    return "\n".join(texts), placeholders


def _refusals(content: Any) -> list[str]:
    if not isinstance(content, list):
        return []
    return [p["refusal"] for p in content if isinstance(p, dict) and p.get("type") == "refusal"
            and isinstance(p.get("refusal"), str) and p["refusal"]]


def _media_ref(part: dict[str, Any]) -> str | None:
    """The reference a media part is identified by (as Chat Completions identifies the same media)."""
    for field in ("image_url", "file_data", "file_id", "file_url", "data"):
        value = part.get(field)
        if isinstance(value, str) and value:
            return value
        if isinstance(value, dict):  # input_audio: {"data", "format"}
            data = value.get("data") or value.get("url")
            if isinstance(data, str) and data:
                return data
    audio = part.get("input_audio")
    if isinstance(audio, dict) and isinstance(audio.get("data"), str):
        return str(audio["data"])
    return None


def _media_atoms(role: str, content: Any) -> Iterator[tuple[str, ...]]:
    if not isinstance(content, list):
        return
    for part in content:
        if not isinstance(part, dict) or part.get("type") in TEXT_PARTS or part.get("type") == "refusal":
            continue
        ref = _media_ref(part)
        yield ("media", role, media_digest(ref if ref is not None else describe.as_text(part)))


# -- the token formula --------------------------------------------------------------------------------


def encrypted_tokens(value: Any) -> int:
    """Opaque ``encrypted_content``: ⌈decoded bytes / 4⌉, never its base64 text counted as text."""
    if not isinstance(value, str) or not value:
        return 0
    return math.ceil(media.decoded_size(value) / ENCRYPTED_BYTES_PER_TOKEN)


def count_parts(counter: TokenCounter, content: Any) -> int:
    if isinstance(content, str):
        return counter.text(content)
    if not isinstance(content, list):
        return 0 if content is None else counter.json(content)
    n = 0
    for part in content:
        if not isinstance(part, dict):
            n += counter.json(part)
            continue
        check_keys(part)
        kind = part.get("type")
        if kind in TEXT_PARTS and isinstance(part.get("text"), str):
            n += counter.text(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            n += counter.text(part["refusal"])
        elif kind == "input_image":
            url = part.get("image_url")
            n += media.image_tokens(url if isinstance(url, str) else None, part.get("detail"))
        elif kind == "input_file":
            data = part.get("file_data")
            n += media.file_tokens(counter, data if isinstance(data, str) else None, media.OPENAI, part.get("detail"))
        elif kind == "input_audio":
            audio = part.get("input_audio")
            data = audio.get("data") if isinstance(audio, dict) else part.get("data")
            fmt = audio.get("format") if isinstance(audio, dict) else part.get("format")
            n += media.audio_tokens(data, fmt) if isinstance(data, str) else counter.json(part)
        else:
            n += counter.json(part)
    return n


def _value(counter: TokenCounter, value: Any) -> int:
    if isinstance(value, str):
        return counter.text(value)
    return 0 if value is None else counter.json(value)


def count_element(counter: TokenCounter, element: Any) -> int:
    """One input item's tokens (the module docstring's formula)."""
    if isinstance(element, str):  # ``input`` as a plain string: one user message
        return ITEM_TOKENS + counter.text("user") + counter.text(element)
    if not isinstance(element, dict):
        return ITEM_TOKENS + counter.json(element)
    check_keys(element)
    kind = kind_of(element)
    if kind == "message":
        role = element.get("role")
        return ITEM_TOKENS + (counter.text(role) if isinstance(role, str) else 0) \
            + count_parts(counter, element.get("content"))
    if kind == "reasoning":
        n = encrypted_tokens(element.get("encrypted_content"))
        for field in ("summary", "content"):
            parts = element.get(field)
            if isinstance(parts, list):
                n += sum(
                    counter.text(p["text"]) for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)
                )
        return n
    if kind == "compaction":
        return ITEM_TOKENS + encrypted_tokens(element.get("encrypted_content"))
    if kind in ("function_call", "custom_tool_call", "mcp_call", "mcp_approval_request"):
        n = ITEM_TOKENS + _value(counter, element.get("name"))
        n += _value(counter, element.get("arguments", element.get("input")))
        if kind == "mcp_call":
            n += _value(counter, element.get("output")) + _value(counter, element.get("error"))
        return n
    if kind in RESULTS:
        body = element.get("output", element.get("result"))
        if kind == "computer_call_output" and isinstance(body, dict):
            url = body.get("image_url")
            return ITEM_TOKENS + media.image_tokens(url if isinstance(url, str) else None, body.get("detail"))
        if kind == "mcp_approval_response":
            return ITEM_TOKENS + 1 + _value(counter, element.get("reason"))
        if kind == "tool_search_output":
            return ITEM_TOKENS + counter.json(element.get("tools"))
        return ITEM_TOKENS + count_parts(counter, body)
    if kind in CALLS:
        for field in CALL_ARGUMENTS:
            if field in element:
                return ITEM_TOKENS + _value(counter, element[field])
        return ITEM_TOKENS + counter.json(element)
    if kind == "image_generation_call":
        result = element.get("result")
        return ITEM_TOKENS + (media.image_tokens(result) if isinstance(result, str) and result else 0) \
            + _value(counter, element.get("revised_prompt"))
    return ITEM_TOKENS + counter.json(element)


def count_raw(counter: TokenCounter, raw: Any) -> int:
    """A neutral item's tokens: its one element, or its reasoning items plus their follower."""
    if isinstance(raw, list):
        return sum(count_element(counter, element) for element in raw)
    return count_element(counter, raw)


# -- the neutral item ----------------------------------------------------------------------------------


class ResponsesItem(Item):
    """One input item (``raw`` a dict, or the string ``input``), or ``[reasoning…, follower]``."""

    __slots__ = ()

    @property
    def main(self) -> dict[str, Any]:
        """The item itself: the follower of any reasoning attached to it."""
        raw = self.raw
        if isinstance(raw, list):
            raw = raw[-1]
        if isinstance(raw, str):
            return {"type": "message", "role": "user", "content": raw}
        return raw if isinstance(raw, dict) else {}

    def describe(self, keep: Collection[str] = ()) -> str:
        item = self.main
        kind = kind_of(item)
        if kind == "message":
            content = item.get("content")
            text, placeholders = text_of(content)
            lines = [describe.said(str(item.get("role", "")), " ".join([text, *placeholders]).strip())]
            lines += [f"REFUSAL: {r}" for r in _refusals(content)]
            return describe.lines(*lines)
        if self.result_id is not None:
            _, ident = unkey(self.result_id)
            return describe.result(ident, _result_text(item), keep)
        if self.call_ids:
            _, ident = unkey(self.call_ids[0])
            name, arguments = _call_parts(item, kind)
            return describe.call(ident, name, arguments)
        if kind in ("reasoning", "compaction", "item_reference"):
            return ""
        if kind == "mcp_call":
            return describe.lines(describe.call(str(item.get("id", "")), item.get("name"), item.get("arguments")),
                                  describe.result(str(item.get("id", "")), describe.as_text(item.get("output")), keep))
        return f"[{kind or 'item'}: {describe.shorten(describe.as_text(item), describe.ARGUMENT_CHARS)}]"

    def atoms(self) -> Iterator[tuple[str, ...]]:
        item = self.main
        kind = kind_of(item)
        if kind == "message":
            content = item.get("content")
            text, _ = text_of(content)
            if text:
                yield ("text", self.role, text)
            yield from _media_atoms(self.role, content)
            for refusal in _refusals(content):
                yield ("text", "refusal", refusal)
            return
        if self.result_id is not None:
            # the same atoms as a Chat Completions tool message answering the same call
            _, ident = unkey(self.result_id)
            body = item.get("output", item.get("result"))
            if isinstance(body, (str, list)):
                text = text_of(body)[0]
            else:
                text = "" if body is None else describe.as_text(body)
            yield ("result", ident, text)
            yield from _media_atoms(TOOL, body)
            if kind == "mcp_approval_response":
                yield ("text", "approval", "approve" if item.get("approve") is True else "deny")
            return
        if self.call_ids:
            _, ident = unkey(self.call_ids[0])
            name, arguments = _call_parts(item, kind)
            yield ("call", ident, str(name), canonical_arguments(arguments))
            return
        if kind == "reasoning" or not kind:
            return
        # provider-side items (web search, mcp calls, compaction …): identified by their content
        yield ("item", kind, media_digest(describe.as_text(item)))


def _call_parts(item: dict[str, Any], kind: str) -> tuple[Any, Any]:
    """(name, arguments) of a call item; calls without a name are named by their type."""
    name = item.get("name") if isinstance(item.get("name"), str) else kind
    for field in CALL_ARGUMENTS:
        if field in item:
            return name, item[field]
    return name, None


def _result_text(item: dict[str, Any]) -> str:
    body = item.get("output", item.get("result"))
    if item.get("type") == "mcp_approval_response":
        verdict = "approved" if item.get("approve") is True else "denied"
        reason = item.get("reason")
        return f"{verdict}: {reason}" if isinstance(reason, str) and reason else verdict
    if isinstance(body, (str, list)):
        text, placeholders = text_of(body)
        return " ".join([text, *placeholders]).strip()
    return describe.as_text(body)


def neutral(element: dict[str, Any], kind: str) -> tuple[str, tuple[str, ...], str | None]:
    """(role, call ids, result id) of a well-formed input item."""
    if kind == "message":
        return MESSAGE_ROLES.get(element.get("role"), OTHER), (), None  # type: ignore[arg-type]
    call_field = CALLS.get(kind)
    if call_field is not None:
        ident = pairing_id(element, (call_field,))
        if ident is not None:
            return ASSISTANT, (key(kind, ident),), None
        return ASSISTANT, (), None  # (tool search run by the provider)
    result = RESULTS.get(kind)
    if result is not None:
        call_kind, fields = result
        ident = pairing_id(element, fields)
        if ident is not None:
            return TOOL, (), key(call_kind, ident)
        return ASSISTANT, (), None
    if kind in PROVIDER_SIDE:
        return ASSISTANT, (), None
    return OTHER, (), None  # reasoning, compaction, configuration, unknown types: kept in place
