"""Responses-wire test helpers: conversion from Chat Completions, independent checkers, hypothesis strategies.

The checkers (pairing, reasoning adjacency, token recount) are written out here and do not
reuse ``proxy.wire.responses``: they are what the adapter is judged by.
"""

from __future__ import annotations

import base64
import functools
import json
import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import tiktoken
from hypothesis import strategies as st

from tests.helpers import text

Element = dict[str, Any]

# call type -> (output type, the id field of the call, the id field of the output)
PAIRS: dict[str, tuple[str, str, str]] = {
    "function_call": ("function_call_output", "call_id", "call_id"),
    "custom_tool_call": ("custom_tool_call_output", "call_id", "call_id"),
    "computer_call": ("computer_call_output", "call_id", "call_id"),
    "local_shell_call": ("local_shell_call_output", "call_id", "id"),
    "shell_call": ("shell_call_output", "call_id", "call_id"),
    "apply_patch_call": ("apply_patch_call_output", "call_id", "call_id"),
    "mcp_approval_request": ("mcp_approval_response", "id", "approval_request_id"),
}
OUTPUTS = {out: (call, out_field) for call, (out, _f, out_field) in PAIRS.items()}


def kind(e: Any) -> str:
    if isinstance(e, str):
        return "message"
    t = e.get("type")
    return t if isinstance(t, str) else ("message" if "role" in e else "")


# --------------------------------------------------------------------------- Chat Completions -> Responses


def chat_to_responses(messages: Sequence[dict[str, Any]], *, parts: bool = False) -> list[Element]:
    """A Chat Completions conversation as Responses input items (function_call / function_call_output by call_id)."""
    out: list[Element] = []
    for m in messages:
        role = m.get("role")
        content = m.get("content")
        if role in ("system", "developer", "user"):
            if parts and isinstance(content, str):
                out.append({"type": "message", "role": role, "content": [{"type": "input_text", "text": content}]})
            else:
                out.append({"role": role, "content": content if content is not None else ""})
        elif role == "assistant":
            if isinstance(content, str) and content:
                out.append({"type": "message", "role": "assistant", "status": "completed",
                            "content": [{"type": "output_text", "text": content, "annotations": []}]})
            for call in m.get("tool_calls") or []:
                out.append({"type": "function_call", "call_id": call["id"], "name": call["function"]["name"],
                            "arguments": call["function"]["arguments"], "status": "completed"})
        elif role == "tool":
            out.append({"type": "function_call_output", "call_id": m["tool_call_id"], "output": content})
    return out


# --------------------------------------------------------------------------- independent checkers


def _namespace(call_kind: str) -> str:
    # call ids are one namespace (Codex answers a local_shell_call with a function_call_output); MCP
    # approvals pair by approval request id
    return "approval" if call_kind == "mcp_approval_request" else "call"


def pairing_problems(items: Sequence[Any]) -> list[str]:
    """Every call answered exactly once by an output with its id right after its run of calls; no stray output.

    Reasoning items are transparent (they belong to the item after them).
    """
    seq = [e for e in items if kind(e) != "reasoning"]
    problems: list[str] = []
    i = 0
    while i < len(seq):
        k = kind(seq[i])
        if k in OUTPUTS:
            problems.append(f"stray {k} {seq[i].get(OUTPUTS[k][1])!r}")
            i += 1
            continue
        if k in PAIRS:
            wanted: Counter[tuple[str, Any]] = Counter()
            while i < len(seq) and kind(seq[i]) in PAIRS:
                ck = kind(seq[i])
                wanted[(_namespace(ck), seq[i].get(PAIRS[ck][1]))] += 1
                i += 1
            got: Counter[tuple[str, Any]] = Counter()
            while i < len(seq) and kind(seq[i]) in OUTPUTS:
                ok = kind(seq[i])
                got[(_namespace(OUTPUTS[ok][0]), seq[i].get(OUTPUTS[ok][1]))] += 1
                i += 1
            if got != wanted:
                problems.append(f"calls {dict(wanted)} answered by {dict(got)}")
            continue
        i += 1
    return problems


def reasoning_problems(before: Sequence[Any], after: Sequence[Any]) -> list[str]:
    """Every forwarded reasoning item is followed, as in the input, by the very item that followed it there."""
    problems: list[str] = []
    position = {id(e): i for i, e in enumerate(before)}
    for k, e in enumerate(after):
        if kind(e) != "reasoning":
            continue
        j = k + 1
        while j < len(after) and kind(after[j]) == "reasoning":
            j += 1
        if j == len(after):
            problems.append(f"reasoning {e.get('id')} forwarded last")
            continue
        i = position.get(id(e))
        if i is None:
            problems.append(f"reasoning {e.get('id')} is not the client's object")
            continue
        n = i + 1
        while n < len(before) and kind(before[n]) == "reasoning":
            n += 1
        if n == len(before) or before[n] is not after[j]:
            problems.append(f"reasoning {e.get('id')} separated from its following item")
    return problems


@functools.lru_cache(maxsize=1)
def _enc() -> tiktoken.Encoding:
    return tiktoken.get_encoding("o200k_base")


@functools.lru_cache(maxsize=100_000)
def ntok(value: str) -> int:
    return len(_enc().encode(value, disallowed_special=()))


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _content(c: Any) -> int:
    if isinstance(c, str):
        return ntok(c)
    n = 0
    for p in c or []:
        t = p.get("type")
        if t in ("input_text", "output_text", "text") and isinstance(p.get("text"), str):
            n += ntok(p["text"])
        elif t == "input_image":
            n += 85 if p.get("detail") == "low" else 765
        else:
            n += ntok(_json(p))
    return n


def _encrypted(value: Any) -> int:
    return math.ceil(len(value) * 3 // 4 / 4) if isinstance(value, str) and value else 0


def ref_item_tokens(e: Any) -> int:
    """The documented per-item formula (docs/wires.md, proxy/wire/responses/items.py), written out independently."""
    if isinstance(e, str):
        return 3 + ntok("user") + ntok(e)
    k = kind(e)
    if k == "message":
        return 3 + ntok(e["role"]) + _content(e["content"])
    if k == "reasoning":
        return _encrypted(e.get("encrypted_content")) + sum(ntok(s["text"]) for s in e.get("summary") or [])
    if k == "compaction":
        return 3 + _encrypted(e.get("encrypted_content"))
    if k in ("function_call", "custom_tool_call", "mcp_approval_request"):
        return 3 + ntok(e["name"]) + ntok(e.get("arguments", e.get("input")))
    if k == "computer_call_output":
        return 3 + (85 if e["output"].get("detail") == "low" else 765)
    if k == "mcp_approval_response":
        return 3 + 1 + (ntok(e["reason"]) if e.get("reason") else 0)
    if k in OUTPUTS:
        return 3 + _content(e.get("output"))
    if k in PAIRS:
        for f in ("arguments", "input", "action", "operation", "code"):
            if f in e:
                return 3 + (ntok(e[f]) if isinstance(e[f], str) else ntok(_json(e[f])))
    return 3 + ntok(_json(e))


def recount(body: dict[str, Any]) -> int:
    """Tokens of a Responses body: 3 priming + tools' JSON + instructions (3 + text) + every item."""
    n = 3
    if body.get("tools"):
        n += ntok(_json(body["tools"]))
    if body.get("instructions"):
        n += 3 + ntok(body["instructions"])
    value = body.get("input")
    items = [value] if isinstance(value, str) else (value or [])
    return n + sum(ref_item_tokens(e) for e in items)


def system_band(items: Sequence[Any]) -> list[Any]:
    out = []
    for e in items:
        if kind(e) != "message" or isinstance(e, str) or e.get("role") not in ("system", "developer"):
            break
        out.append(e)
    return out


def current_user(items: Sequence[Any]) -> Any:
    for e in reversed(items):
        if isinstance(e, str) or (kind(e) == "message" and e.get("role") == "user"):
            return e
    return None


def last_compaction(items: Sequence[Any]) -> Any:
    found = None
    for e in items:
        if kind(e) == "compaction":
            found = e
    return found


# --------------------------------------------------------------------------- hypothesis strategies

ID_POOL = [f"call_{i}" for i in range(4)]  # small: ids get reused across groups
REASONING_IDS = iter(range(10**9))


def _b64(n: int, seed: int) -> str:
    return base64.b64encode(bytes((seed + i * 31) % 256 for i in range(n))).decode()


@st.composite
def reasoning(draw: Any) -> Element:
    item: Element = {"type": "reasoning", "id": f"rs_{draw(st.integers(0, 10**6))}",
                     "summary": draw(st.sampled_from([[], [{"type": "summary_text", "text": draw(text(1, 20))}]]))}
    if draw(st.booleans()):
        item["encrypted_content"] = _b64(draw(st.integers(0, 1200)), draw(st.integers(0, 99)))
    return item


@st.composite
def user_item(draw: Any) -> Element:
    style = draw(st.integers(0, 4))
    if style == 0:
        item: Element = {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": draw(text(1, 30))},
            {"type": "input_image", "image_url": "https://example.com/cat.png",
             "detail": draw(st.sampled_from(["low", "high", "auto"]))}]}
    elif style == 1:
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": draw(text(1, 60))}]}
    else:
        item = {"role": "user", "content": draw(text(1, 60))}
    if draw(st.integers(0, 8)) == 0:
        item["x_client_meta"] = {"trace": draw(st.integers(0, 99)), "tag": "ünïcødé 東京 🚀"}
    return item


def _assistant(words: str) -> Element:
    return {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
            "content": [{"type": "output_text", "text": words, "annotations": []}]}


def _call(k: str, cid: str, words: str) -> Element:
    if k == "function_call":
        return {"type": k, "call_id": cid, "name": "lookup", "arguments": _json({"q": words}), "id": f"fc_{cid}"}
    if k == "custom_tool_call":
        return {"type": k, "call_id": cid, "name": "apply", "input": words}
    if k == "computer_call":
        return {"type": k, "call_id": cid, "id": f"cu_{cid}", "action": {"type": "click", "x": 1, "y": 2},
                "pending_safety_checks": [], "status": "completed"}
    if k == "local_shell_call":
        return {"type": k, "call_id": cid, "id": f"ls_{cid}", "status": "completed",
                "action": {"type": "exec", "command": ["ls", words[:10]], "env": {}}}
    if k == "shell_call":
        return {"type": k, "call_id": cid, "action": {"commands": ["echo " + words[:20]]}}
    if k == "apply_patch_call":
        return {"type": k, "call_id": cid, "status": "completed",
                "operation": {"type": "update_file", "path": "a.py", "diff": words}}
    return {"type": "mcp_approval_request", "id": cid, "name": "deploy", "arguments": _json({"w": words}),
            "server_label": "ops"}


def _output(k: str, cid: str, words: str) -> Element:
    if k == "function_call":
        return {"type": "function_call_output", "call_id": cid, "output": words}
    if k == "custom_tool_call":
        return {"type": "custom_tool_call_output", "call_id": cid, "output": [{"type": "input_text", "text": words}]}
    if k == "computer_call":
        return {"type": "computer_call_output", "call_id": cid,
                "output": {"type": "computer_screenshot", "image_url": "data:image/png;base64,iVBORw0KGgo="}}
    if k == "local_shell_call":
        return {"type": "local_shell_call_output", "id": cid, "output": words}
    if k == "shell_call":
        return {"type": "shell_call_output", "call_id": cid,
                "output": [{"stdout": words, "stderr": "", "outcome": {"type": "exit", "exit_code": 0}}]}
    if k == "apply_patch_call":
        return {"type": "apply_patch_call_output", "call_id": cid, "status": "completed", "output": words}
    return {"type": "mcp_approval_response", "approval_request_id": cid, "approve": True}


@st.composite
def tool_round(draw: Any, *, valid: bool) -> list[Element]:
    n = draw(st.integers(1, 3))
    ids = draw(st.lists(st.one_of(st.sampled_from(ID_POOL), st.text("abcdef0123", min_size=4, max_size=4)),
                        min_size=n, max_size=n, unique=True))
    kinds = [draw(st.sampled_from([*PAIRS, "function_call", "function_call"])) for _ in ids]
    calls: list[Element] = []
    for cid, k in zip(ids, kinds):
        if draw(st.integers(0, 3)) == 0:
            calls.append(draw(reasoning()))
        calls.append(_call(k, cid, draw(text(1, 10))))
    outputs = [_output(k, cid, draw(text(1, 80))) for cid, k in zip(ids, kinds)]
    outputs = draw(st.permutations(outputs))
    if valid:
        return calls + outputs
    defect = draw(st.sampled_from(["none", "none", "missing", "duplicate", "displaced", "all_missing"]))
    if defect == "missing" and len(outputs) > 1:
        outputs = outputs[: draw(st.integers(1, len(outputs) - 1))]
    elif defect == "all_missing":
        outputs = []
    elif defect == "duplicate":
        outputs = [*outputs, dict(draw(st.sampled_from(outputs)))]
    elif defect == "displaced":
        k = draw(st.integers(0, len(outputs) - 1))
        return calls + outputs[:k] + [draw(user_item())] + outputs[k:]
    return calls + outputs


@st.composite
def event(draw: Any, *, valid: bool) -> list[Element]:
    choices = ["text", "round", "round", "provider", "unknown"] + ([] if valid else ["orphan"])
    k = draw(st.sampled_from(choices))
    if k == "text":
        out = [_assistant(draw(text(1, 60)))]
        return [draw(reasoning()), *out] if draw(st.booleans()) else out
    if k == "round":
        return draw(tool_round(valid=valid))
    if k == "provider":
        return [{"type": "web_search_call", "id": "ws_1", "status": "completed",
                 "action": {"type": "search", "query": draw(text(1, 8))}}]
    if k == "unknown":
        return [{"type": "future_item_kind", "id": "fx_1", "payload": {"nested": [1, "二", None]}}]
    return [_output("function_call", draw(st.sampled_from([*ID_POOL, "call_orphan"])), draw(text(1, 20)))]


@st.composite
def conversations(draw: Any, *, valid: bool = False, max_turns: int = 6) -> list[Element]:
    """A Responses ``input`` list; ``valid=False`` adds pairing defects and a trailing reasoning item."""
    items: list[Element] = []
    for _ in range(draw(st.integers(0, 2))):
        role = draw(st.sampled_from(["system", "developer"]))
        items.append({"role": role, "content": draw(text(1, 50))} if draw(st.booleans()) else
                     {"type": "message", "role": role, "content": [{"type": "input_text", "text": draw(text(1, 50))}]})
    for t in range(draw(st.integers(0, max_turns))):
        items.append(draw(user_item()))
        for _ in range(draw(st.integers(0, 3))):
            items.extend(draw(event(valid=valid)))
        if t and draw(st.integers(0, 9)) == 0:
            items.append(
                {"type": "compaction", "id": f"cmp_{t}", "encrypted_content": _b64(draw(st.integers(8, 400)), t)}
            )
    if draw(st.integers(0, 8)) == 0:
        items.append(_assistant(draw(text(1, 10))))
    if not valid and draw(st.integers(0, 6)) == 0:
        items.append(draw(reasoning()))
    if not any(kind(e) == "message" and e.get("role") == "user" for e in items) and draw(st.booleans()):
        items.append(draw(user_item()))
    if not items:
        items.append(draw(user_item()))
    return items
