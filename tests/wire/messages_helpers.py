"""Helpers for Messages-wire tests: builders, a Chat-to-Messages converter, hypothesis strategies,
and independent checkers (pairing, token recount, cache breakpoints, cached prefix) that do not reuse
the adapter's code.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from hypothesis import strategies as st

from tests.helpers import _ref_text, text

Message = dict[str, Any]
Block = dict[str, Any]
PLACEHOLDER_PREFIX = "[ctxproxy:"
CLAUDE = "claude-sonnet-4-5"

# --------------------------------------------------------------------------- builders


def user(content: str | list[Block], **extra: Any) -> Message:
    return {"role": "user", "content": content, **extra}


def assistant(content: str | list[Block], **extra: Any) -> Message:
    return {"role": "assistant", "content": content, **extra}


def text_block(value: str, **extra: Any) -> Block:
    return {"type": "text", "text": value, **extra}


def tool_use(tid: str, name: str = "lookup", **input_: Any) -> Block:
    return {"type": "tool_use", "id": tid, "name": name, "input": input_ or {"q": tid}}


def tool_result(tid: str, content: Any = "ok", **extra: Any) -> Block:
    return {"type": "tool_result", "tool_use_id": tid, "content": content, **extra}


def thinking(value: str = "Let me think.", signature: str = "EqQBCkYIBRgCKkD3sig==") -> Block:
    return {"type": "thinking", "thinking": value, "signature": signature}


def redacted(data: str = "EmwKAhgBEgy3va3pzix/LafPsn4aDFIT2Xlxh0L5L8rLVyIwxtE3rAFBa8cr3qpP") -> Block:
    return {"type": "redacted_thinking", "data": data}


def image(data: str = "iVBORw0KGgo=") -> Block:
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}


def body(messages: list[Message], *, system: Any = "You are helpful.", max_tokens: int = 256, **extra: Any
         ) -> dict[str, Any]:
    out: dict[str, Any] = {"model": CLAUDE, "max_tokens": max_tokens, "messages": messages}
    if system is not None:
        out["system"] = system
    out.update(extra)
    return out


# --------------------------------------------------------------------------- Chat Completions -> Messages


def from_chat(messages: Sequence[Message]) -> tuple[str | None, list[Message]]:
    """A Chat Completions conversation as (system, Messages messages).

    System/developer messages become the top-level system; tool results (and a user message right after
    them) become one user message with the results first; assistant tool calls become tool_use blocks.
    """
    system: list[str] = []
    out: list[Message] = []
    for m in messages:
        role = m.get("role")
        content = m.get("content")
        if role in ("system", "developer"):
            system.append(_chat_text(content))
        elif role == "user":
            blocks = _chat_parts(content)
            if out and out[-1]["role"] == "user" and _only_results(out[-1]):
                out[-1] = {"role": "user", "content": [*out[-1]["content"], *blocks]}
            else:
                out.append({"role": "user", "content": content if isinstance(content, str) else blocks})
        elif role == "assistant":
            blocks = []
            if _chat_text(content):
                blocks.append({"type": "text", "text": _chat_text(content)})
            for call in m.get("tool_calls") or []:
                args = call["function"].get("arguments") or "{}"
                try:
                    parsed = json.loads(args)
                except ValueError:
                    parsed = {"raw": args}
                blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                               "input": parsed if isinstance(parsed, dict) else {"value": parsed}})
            if isinstance(m.get("function_call"), dict):
                fc = m["function_call"]
                blocks.append({"type": "tool_use", "id": "fn_" + fc["name"], "name": fc["name"],
                               "input": {"raw": fc.get("arguments")}})
            if not blocks:
                blocks.append({"type": "text", "text": "(no content)"})
            out.append({"role": "assistant", "content": blocks})
        elif role in ("tool", "function"):
            tid = m.get("tool_call_id") if role == "tool" else "fn_" + str(m.get("name"))
            block = {"type": "tool_result", "tool_use_id": tid, "content": _chat_text(content) or "(empty)"}
            if out and out[-1]["role"] == "user" and _only_results(out[-1]):
                out[-1] = {"role": "user", "content": [*out[-1]["content"], block]}
            else:
                out.append({"role": "user", "content": [block]})
    return ("\n\n".join(system) if system else None), out


def _only_results(message: Message) -> bool:
    content = message.get("content")
    return isinstance(content, list) and bool(content) and all(b.get("type") == "tool_result" for b in content)


def _chat_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def _chat_parts(content: Any) -> list[Block]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    out: list[Block] = []
    for part in content or []:
        if part.get("type") == "text":
            out.append({"type": "text", "text": part["text"]})
        elif part.get("type") == "image_url":
            out.append({"type": "image", "source": {"type": "url", "url": part["image_url"]["url"]}})
    return out or [{"type": "text", "text": "(empty)"}]


# --------------------------------------------------------------------------- independent checkers


def pairing_problems(messages: Sequence[Message]) -> list[str]:
    """Anthropic's rules, checked from scratch: every tool_use is answered by a tool_result in the very next
    (user) message, results come before any other block there, and no result answers anything else."""
    problems: list[str] = []
    for i, m in enumerate(messages):
        content = m.get("content")
        blocks = content if isinstance(content, list) else []
        if m.get("role") == "assistant":
            ids = [b["id"] for b in blocks if b.get("type") == "tool_use"]
            if len(ids) != len(set(ids)):
                problems.append(f"messages[{i}] repeats a tool_use id")
            if not ids:
                continue
            nxt = messages[i + 1] if i + 1 < len(messages) else None
            got = [b.get("tool_use_id") for b in (nxt or {}).get("content", []) if isinstance(b, dict)
                   and b.get("type") == "tool_result"] if nxt and isinstance(nxt.get("content"), list) else []
            if nxt is None or nxt.get("role") != "user" or sorted(got, key=repr) != sorted(ids, key=repr):
                problems.append(f"messages[{i}] tool_use {ids} not answered exactly by the next message ({got})")
        elif m.get("role") == "user":
            kinds = [b.get("type") for b in blocks]
            if "tool_result" in kinds:
                first_other = next((k for k, kind in enumerate(kinds) if kind != "tool_result"), len(kinds))
                if "tool_result" in kinds[first_other:]:
                    problems.append(f"messages[{i}] has a tool_result after another block")
                prev = messages[i - 1] if i > 0 else None
                calls = {b["id"] for b in (prev or {}).get("content", []) if isinstance(b, dict)
                         and b.get("type") == "tool_use"} if prev and prev.get("role") == "assistant" \
                    and isinstance(prev.get("content"), list) else set()
                for b in blocks:
                    if b.get("type") == "tool_result" and b.get("tool_use_id") not in calls:
                        problems.append(f"messages[{i}] answers {b.get('tool_use_id')} which the previous message "
                                        "did not call")
    return problems


def _text(encoding: str, value: str) -> int:
    return _ref_text(encoding, value)


def _json(encoding: str, value: Any) -> int:
    return _text(encoding, json.dumps(value, separators=(",", ":"), ensure_ascii=False))


def _block_tokens(b: Block, enc: str) -> int:
    kind = b.get("type")
    if kind == "text":
        return _text(enc, b["text"])
    if kind == "tool_use":
        return 3 + _text(enc, b["name"]) + _json(enc, b["input"])
    if kind == "tool_result":
        c = b.get("content")
        inner = _text(enc, c) if isinstance(c, str) else sum(_block_tokens(x, enc) for x in (c or []))
        return 3 + inner
    if kind == "thinking":
        return _text(enc, b["thinking"])
    if kind == "redacted_thinking":
        return len(b["data"]) // 4 + 1
    if kind == "image":
        return 1600
    if kind == "document" and isinstance(b.get("source"), dict) and b["source"].get("type") == "text":
        return _text(enc, b["source"]["data"])
    if kind == "document" and isinstance(b.get("source"), dict) and b["source"].get("type") == "base64":
        return max(1, -(-(len(b["source"]["data"]) * 3 // 4) // 30_000)) * 1_500
    return _json(enc, b)


def recount(body: dict[str, Any], encoding: str = "o200k_base") -> int:
    """The documented formula, recomputed from the forwarded body (proxy/wire/messages/blocks.py docstring)."""
    n = 3  # reply priming
    system = body.get("system")
    if isinstance(system, str):
        n += 3 + _text(encoding, system)
    elif isinstance(system, list):
        n += 3 + sum(_block_tokens(b, encoding) for b in system)
    if body.get("tools"):
        n += _json(encoding, body["tools"])
    for m in body["messages"]:
        content = m["content"]
        if isinstance(content, str):
            n += 3 + _text(encoding, content)
            continue
        results = [b for b in content if b.get("type") == "tool_result"]
        others = [b for b in content if b.get("type") != "tool_result"]
        n += sum(3 + _block_tokens(b, encoding) for b in results)
        if others or not results:
            n += 3 + sum(_block_tokens(b, encoding) for b in others)
    return n


def cache_marks(body: dict[str, Any]) -> int:
    """cache_control marks anywhere in tools, system and messages (nested tool_result content included)."""

    def walk(value: Any) -> int:
        if isinstance(value, dict):
            return (1 if value.get("cache_control") is not None else 0) + sum(
                walk(v) for k, v in value.items() if k != "cache_control")
        if isinstance(value, list):
            return sum(walk(v) for v in value)
        return 0

    return walk(body.get("tools")) + walk(body.get("system")) + walk(body.get("messages"))


def _flat_blocks(body: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """The request as Anthropic caches it, in order (tools, system, messages): one entry per block, without
    its cache_control mark, and whether the block carried one."""
    out: list[tuple[str, str, bool]] = []

    def add(where: str, block: Any) -> None:
        marked = isinstance(block, dict) and block.get("cache_control") is not None
        plain = {k: v for k, v in block.items() if k != "cache_control"} if isinstance(block, dict) else block
        out.append((where, json.dumps(plain, sort_keys=True), marked))

    for tool in body.get("tools") or []:
        add("tool", tool)
    system = body.get("system")
    if isinstance(system, str):
        add("system", {"type": "text", "text": system})
    for block in system if isinstance(system, list) else []:
        add("system", block)
    for m in body["messages"]:
        content = m["content"]
        for block in ([{"type": "text", "text": content}] if isinstance(content, str) else content):
            add(m["role"], block)
    return out


def cached_prefix_survives(previous: dict[str, Any], current: dict[str, Any]) -> bool:
    """Whether ``current`` starts with ``previous`` up to and including previous's last cache breakpoint: the
    prompt cache that request wrote is read by this one (Anthropic caches exact prefixes at breakpoints)."""
    before = _flat_blocks(previous)
    marks = [i for i, (_, _, marked) in enumerate(before) if marked]
    if not marks:
        return False
    cut = marks[-1] + 1
    now = _flat_blocks(current)
    return len(now) >= cut and [b[:2] for b in now[:cut]] == [b[:2] for b in before[:cut]]


# --------------------------------------------------------------------------- hypothesis strategies

NAMES = ["get_user_details", "search_flights", "book_reservation", "Bash", "Read"]
IDS = [f"toolu_{i:02d}" for i in range(6)]  # a small pool: ids get reused across groups


@st.composite
def _extras(draw: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if draw(st.integers(0, 7)) == 0:
        out["cache_control"] = {"type": "ephemeral"}
    if draw(st.integers(0, 9)) == 0:
        out["citations"] = [{"type": "char_location", "cited_text": "x", "document_index": 0,
                             "start_char_index": 0, "end_char_index": 1}]
    return out


@st.composite
def _user_blocks(draw: Any) -> list[Block]:
    blocks: list[Block] = [{"type": "text", "text": draw(text(1, 40)), **draw(_extras())}]
    extra = draw(st.integers(0, 6))
    if extra == 0:
        blocks.append(image())
    elif extra == 1:
        blocks.append({"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                                      "data": draw(text(1, 30))}, "title": "notes.txt"})
    elif extra == 2:
        blocks.append({"type": "x_unknown_block", "payload": {"n": draw(st.integers(0, 9))}})
    return blocks


@st.composite
def _user(draw: Any) -> Message:
    if draw(st.booleans()):
        return {"role": "user", "content": draw(text(1, 50))}
    return {"role": "user", "content": draw(_user_blocks())}


@st.composite
def _round(draw: Any, *, valid: bool, with_thinking: bool) -> list[Message]:
    """An assistant message with tool_use blocks and the user message answering it (with defects unless valid)."""
    n = draw(st.integers(1, 3))
    ids = draw(st.lists(st.one_of(st.sampled_from(IDS), st.text("abcdef0123456789", min_size=6, max_size=6)
                                  .map("toolu_".__add__)), min_size=n, max_size=n, unique=True))
    blocks: list[Block] = []
    if with_thinking:
        blocks.append(thinking(draw(text(1, 20))) if draw(st.integers(0, 4)) else redacted())
    if draw(st.booleans()):
        blocks.append({"type": "text", "text": draw(text(1, 20))})
    blocks += [tool_use(i, draw(st.sampled_from(NAMES)), arg=draw(text(1, 6))) for i in ids]
    results: list[Block] = []
    for i in ids:
        content: Any = draw(text(1, 80))
        if draw(st.integers(0, 5)) == 0:
            content = [{"type": "text", "text": content}]
        r = tool_result(i, content)
        if draw(st.integers(0, 8)) == 0:
            r["is_error"] = True
        results.append(r)
    results = draw(st.permutations(results))
    follow: list[Block] = []
    if draw(st.integers(0, 4)) == 0:
        follow = [{"type": "text", "text": draw(text(1, 15))}]
    out = [{"role": "assistant", "content": blocks}]
    if valid:
        return [*out, {"role": "user", "content": results + follow}]
    defect = draw(st.sampled_from(["none", "none", "missing", "duplicate", "displaced", "all_missing",
                                   "text_first", "next_message"]))
    if defect == "missing" and len(results) > 1:
        results = results[: draw(st.integers(1, len(results) - 1))]
    elif defect == "all_missing":
        return [*out, {"role": "user", "content": follow or [{"type": "text", "text": "go on"}]}]
    elif defect == "duplicate":
        results = [*results, {**draw(st.sampled_from(results)), "content": "duplicate"}]
    elif defect == "displaced":
        return [*out, draw(_user()), {"role": "user", "content": results}]
    elif defect == "text_first":
        return [*out, {"role": "user", "content": [{"type": "text", "text": "first"}, *results]}]
    elif defect == "next_message":
        return [*out, {"role": "user", "content": results[:1] + follow or [{"type": "text", "text": "x"}]},
                {"role": "user", "content": results[1:] or [{"type": "text", "text": "y"}]}]
    return [*out, {"role": "user", "content": results + follow}]


@st.composite
def conversations(draw: Any, *, valid: bool = False, max_turns: int = 5) -> dict[str, Any]:
    """A Messages request body; ``valid=False`` adds pairing defects (per block)."""
    with_thinking = draw(st.booleans())
    messages: list[Message] = []
    for _ in range(draw(st.integers(1, max_turns))):
        messages.append(draw(_user()))
        if draw(st.integers(0, 7)) == 0:  # a mid-conversation system message, as Claude Code sends
            messages.append({"role": "system", "content": draw(text(1, 30))})
        for _ in range(draw(st.integers(0, 3))):
            if draw(st.integers(0, 3)) == 0:
                messages.append({"role": "assistant", "content": [{"type": "text", "text": draw(text(1, 40))}]})
            else:
                messages.extend(draw(_round(valid=valid, with_thinking=with_thinking)))
        if not valid and draw(st.integers(0, 9)) == 0:
            messages.append({"role": "user", "content": [tool_result(draw(st.sampled_from(IDS)), "orphan")]})
    system: Any = draw(st.one_of(st.none(), text(1, 60), st.builds(
        lambda t: [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1"},
                   {"type": "text", "text": t, "cache_control": {"type": "ephemeral"}}], text(1, 60))))
    out = body(messages, system=system)
    _at_most_four_marks(out)
    if with_thinking:
        out["thinking"] = {"type": "adaptive"}
    if draw(st.integers(0, 3)) == 0:
        out["tools"] = [{"name": n, "description": "d", "input_schema": {"type": "object"}} for n in NAMES[:2]]
    return out


def _at_most_four_marks(request: dict[str, Any]) -> None:
    """Keep the first four cache_control marks (Anthropic refuses a fifth; that case has its own test)."""
    seen = 1 if isinstance(request.get("system"), list) else 0
    for m in request["messages"]:
        if not isinstance(m["content"], list):
            continue
        for b in m["content"]:
            if b.get("cache_control") is not None:
                seen += 1
                if seen > 4:
                    del b["cache_control"]


def repaired_live_round(messages: Sequence[Message]) -> list[str]:
    """ids of the last tool round of the working memory (the tool_use ids of the last assistant message
    after the last user message with more than results), when it was fully answered in the input."""
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user" and (
        isinstance(m["content"], str) or any(b.get("type") != "tool_result" for b in m["content"]))), default=-1)
    for i in range(len(messages) - 1, last_user, -1):
        m = messages[i]
        if m["role"] == "assistant" and isinstance(m["content"], list):
            ids = [b["id"] for b in m["content"] if b.get("type") == "tool_use"]
            if ids:
                return ids
    return []
