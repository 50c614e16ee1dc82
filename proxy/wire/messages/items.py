"""Anthropic content blocks: token counts, the summariser's text and wire-neutral atoms.

Claude's tokenizer is not public. Text is counted with the route's tiktoken
encoding (o200k_base for Claude models, ``proxy.core.tokens.encoding_for``) and the
usage calibration corrects the ratio per model (``proxy.runtime.Calibration``).
The per-item formula, documented so that tests can recount it independently:

- a message (an assistant item, or a user item: a user message's non-result blocks)
  costs ``TOKENS_PER_MESSAGE`` plus its content: a string's text, or its blocks;
- a ``tool_result`` block is an item of its own and costs ``TOKENS_PER_MESSAGE`` +
  ``TOOL_OVERHEAD`` plus its content (a string, or text/image blocks);
- ``text``: its text; ``tool_use``: ``TOOL_OVERHEAD`` + name + the input's compact JSON;
  ``thinking``: its thinking text (the signature is opaque and not billed as text);
  ``redacted_thinking``: a quarter of its data's length (ciphertext: no text to count);
  ``image``: ``proxy.core.media.claude_image_tokens`` (width×height/750 from the image's header, 1,600
  when its size cannot be read); ``document``: its text, or ``proxy.core.media``'s per-page estimate for
  a PDF (extracted text plus a page image per page); any other block: its compact JSON.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from typing import Any

from proxy.core import describe, media
from proxy.core.fields import check_keys
from proxy.core.items import ASSISTANT, SYSTEM, TOOL, Item, canonical_arguments, media_digest
from proxy.core.tokens import TokenCounter

TOKENS_PER_MESSAGE = 3
TOOL_OVERHEAD = 3
THINKING = frozenset({"thinking", "redacted_thinking"})
SALT = 0x3  # content keys of this wire's items, distinct from other wires' formulas in the shared LRU

Block = dict[str, Any]


def count_raw(counter: TokenCounter, raw: Any) -> int:
    """An item's tokens: a message-shaped raw (``role``) or a ``tool_result`` block."""
    if isinstance(raw, dict) and "role" in raw:
        check_keys(raw)
        content = raw.get("content")
        if content == [] and raw.get("role") == "user":
            return 0  # a boundary item (the adapter's; a client's empty user message is refused): no message
        return TOKENS_PER_MESSAGE + count_content(counter, content)
    if isinstance(raw, dict):
        return TOKENS_PER_MESSAGE + count_block(counter, raw)
    return counter.json(raw)


def count_content(counter: TokenCounter, content: Any) -> int:
    if isinstance(content, str):
        return counter.text(content)
    if isinstance(content, list):
        return sum(count_block(counter, b) if isinstance(b, dict) else counter.json(b) for b in content)
    return 0 if content is None else counter.json(content)


def count_block(counter: TokenCounter, block: Block) -> int:
    check_keys(block)
    kind = block.get("type")
    if kind == "text":
        text = block.get("text")
        return counter.text(text) if isinstance(text, str) else counter.json(block)
    if kind == "tool_use":
        name = block.get("name")
        return TOOL_OVERHEAD + (counter.text(name) if isinstance(name, str) else 0) + counter.json(block.get("input"))
    if kind == "tool_result":
        return TOOL_OVERHEAD + count_content(counter, block.get("content"))
    if kind == "thinking":
        thinking = block.get("thinking")
        return counter.text(thinking) if isinstance(thinking, str) else 0
    if kind == "redacted_thinking":
        data = block.get("data")
        return len(data) // 4 + 1 if isinstance(data, str) else 0
    if kind == "image":
        source = block.get("source")
        data = source.get("data") if isinstance(source, dict) and source.get("type") == "base64" else None
        return media.claude_image_tokens(data if isinstance(data, str) else None)
    if kind == "document":
        return _document_tokens(counter, block)
    return counter.json(block)


def _document_tokens(counter: TokenCounter, block: Block) -> int:
    source = block.get("source")
    if not isinstance(source, dict):
        return counter.json(block)
    kind = source.get("type")
    data = source.get("data")
    if kind == "text" and isinstance(data, str):
        return counter.text(data)
    if kind == "content":
        return count_content(counter, source.get("content"))
    if kind == "base64" and isinstance(data, str):
        return media.file_tokens(counter, data, media.ANTHROPIC)
    return media.FILE_UNKNOWN_TOKENS


def text_of(content: Any) -> tuple[str, list[str]]:
    """The text of a content field (text blocks joined by newlines, as on Chat Completions) and media placeholders."""
    if isinstance(content, str):
        return content, []
    texts: list[str] = []
    placeholders: list[str] = []
    if isinstance(content, list):
        for block in content:
            if not isinstance(block, dict):
                continue
            kind = block.get("type")
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "image":
                placeholders.append("[image]")
            elif kind == "document":
                title = block.get("title")
                placeholders.append(f"[document {title}]" if isinstance(title, str) else "[document]")
            elif kind in THINKING or kind in ("tool_use", "tool_result"):
                continue
            else:
                placeholders.append(f"[{kind if isinstance(kind, str) else 'block'}]")
    return "\n".join(texts), placeholders


def media_atoms(role: str, content: Any) -> Iterator[tuple[str, ...]]:
    """Images and documents as ``("media", role, digest)``: the same digest as the same image on Chat Completions."""
    if not isinstance(content, list):
        return
    for block in content:
        if not isinstance(block, dict) or block.get("type") not in ("image", "document"):
            continue
        source = block.get("source")
        ref: Any = None
        if isinstance(source, dict):
            ref = source.get("data") or source.get("url") or source.get("file_id")
        yield ("media", role, media_digest(ref if isinstance(ref, str) else describe.as_text(block)))


def other_atoms(role: str, content: Any) -> Iterator[tuple[str, ...]]:
    """Blocks no other wire has (server tools, search results …): their JSON, so an edit changes the hash."""
    if not isinstance(content, list):
        return
    for block in content:
        if isinstance(block, dict) and block.get("type") not in _NEUTRAL:
            yield ("block", role, describe.as_text(block))


_NEUTRAL = frozenset({"text", "image", "document", "tool_use", "tool_result", *THINKING})


class AnthropicItem(Item):
    """An item of the Messages wire.

    ``message``: the client's message dict this item came from (None for items the proxy made);
    ``blocks``: the item's blocks (None: the message's string content); ``siblings``: every item
    parsed from that message, in order, so ``render`` can put the message back as the client's
    own dict when all of them are kept, unchanged and in order.
    """

    __slots__ = ("blocks", "memo", "message", "remembered", "rendered", "root", "siblings")

    def __init__(self, raw: Any, role: str, *, message: dict[str, Any] | None, blocks: list[Block] | None,
                 call_ids: tuple[str, ...] = (), result_id: str | None = None, source: int = -1) -> None:
        super().__init__(raw, role, call_ids=call_ids, result_id=result_id, source=source)
        self.message = message
        self.blocks = blocks
        self.siblings: list[AnthropicItem] = [self]
        self.remembered = False  # kept for later requests (``proxy.core.warm``): its JSON may be an earlier request's
        # the user message last rendered from a run of items this one opens, with the run, its base message and
        # its contents it was made of (``render_messages``: reused only for the very same objects)
        self.rendered: tuple[tuple[AnthropicItem, ...], dict[str, Any] | None, list[Any], dict[str, Any]] | None = None
        # the first item of the conversation it was remembered in, which holds the conversation's last render
        # (``memo``: one per conversation, replaced by each render; ``proxy.wire.messages.translator.render_messages``)
        self.root: AnthropicItem | None = None
        self.memo: Any = None

    def content(self) -> Any:
        """The item's content as it would be sent: its blocks, or the message's string."""
        if self.blocks is not None:
            return self.blocks
        return self.raw.get("content") if isinstance(self.raw, dict) else None

    def describe(self, keep: Collection[str] = ()) -> str:
        if self.role == TOOL:
            text, placeholders = text_of(self.raw.get("content"))
            error = " (error)" if self.raw.get("is_error") is True else ""
            return describe.result(self.result_id or "", " ".join([text, *placeholders]).strip() + error, keep)
        content = self.content()
        text, placeholders = text_of(content)
        role = {ASSISTANT: "assistant", SYSTEM: "system"}.get(self.role, "user")
        lines = [describe.said(role, " ".join([text, *placeholders]).strip())]
        if isinstance(content, list):
            for block in content:
                if isinstance(block, dict) and block.get("type") == "tool_use":
                    lines.append(describe.call(str(block.get("id", "")), block.get("name"), block.get("input")))
        return describe.lines(*lines)

    def atoms(self) -> Iterator[tuple[str, ...]]:
        # the same atoms as the same conversation on Chat Completions: text (blocks joined by newlines),
        # media, then calls with canonical arguments; thinking blocks contribute none
        if self.role == TOOL:
            content = self.raw.get("content")
            text, _ = text_of(content)
            yield ("result", self.result_id or "", text)
            yield from media_atoms(TOOL, content)
            return
        content = self.content()
        text, _ = text_of(content)
        if text:
            yield ("text", self.role, text)
        yield from media_atoms(self.role, content)
        yield from other_atoms(self.role, content)
        if isinstance(content, list):
            for block in content:
                if isinstance(block, dict) and block.get("type") == "tool_use":
                    yield ("call", str(block.get("id", "")), str(block.get("name")),
                           canonical_arguments(block.get("input")))

    def calls(self) -> list[tuple[str, str]]:
        # the ids and names of ``atoms``' call atoms, without canonicalising their inputs
        if self.role == TOOL:
            return []
        content = self.content()
        if not isinstance(content, list):
            return []
        return [(str(block.get("id", "")), str(block.get("name"))) for block in content
                if isinstance(block, dict) and block.get("type") == "tool_use"]
