"""The pairing pass and the pairing check over neutral items (docs/design.md#8-pairing-and-the-payload-check).

``repair`` makes every call have exactly one result, right after its call item
(or, on wires that merge them, right after its run of call items), counting
each repair by kind. ``check`` is the proxy's ProviderPayloadError for pairing:
whatever is still unpaired is refused, never forwarded. Pairing works group by
group, so the same id may appear in two different groups.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from proxy.core.errors import PayloadError
from proxy.core.items import UNKEPT, Item, ItemFactory, same_prefix

PLACEHOLDER = "[ctxproxy: no result was recorded for this tool call]"

# Repair kinds, as counted in reports, headers and metrics (the one list of them).
ORPHAN = "orphan_result"
DUPLICATE = "duplicate_result"
MOVED = "moved_result"
PLACEHOLDER_FILLED = "missing_result"
CALLS_DROPPED = "unanswered_calls"
EMPTY_DROPPED = "empty_assistant"
REASONING_DROPPED = "orphan_reasoning"  # a reasoning item with no item after it (Responses; dropped while parsing)
REPAIR_KINDS = frozenset({ORPHAN, DUPLICATE, MOVED, PLACEHOLDER_FILLED, CALLS_DROPPED, EMPTY_DROPPED,
                          REASONING_DROPPED})


@dataclass
class _Group:
    calls: list[Item]
    ids: list[str]
    results: dict[str, Item] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    taking_calls: bool = True  # no result yet: a merged run may still grow


def repair(items: list[Item], factory: ItemFactory, merge_call_runs: bool = False,
           where: str = "messages") -> tuple[list[Item], Counter[str]]:
    """Return the repaired list (the same list object when nothing changed) and repairs by kind."""
    repairs: Counter[str] = Counter()
    out_items: list[Item | _Group] = []
    open_by_id: dict[str, _Group] = {}
    answered: set[str] = set()
    last: _Group | None = None  # the group the previous kept item belongs to
    for item in items:
        if item.call_ids:
            if merge_call_runs and last is not None and last.taking_calls:
                group = last
                group.calls.append(item)
                group.ids.extend(item.call_ids)
            else:
                group = _Group([item], list(item.call_ids))
                out_items.append(group)
            for cid in item.call_ids:
                open_by_id[cid] = group
                answered.discard(cid)
            last = group
            continue
        if item.result_id is not None:
            owner = open_by_id.get(item.result_id)
            if owner is None:
                repairs[DUPLICATE if item.result_id in answered else ORPHAN] += 1
                continue
            if owner is not last:
                repairs[MOVED] += 1
            owner.results[item.result_id] = item
            owner.order.append(item.result_id)
            owner.taking_calls = False
            del open_by_id[item.result_id]
            answered.add(item.result_id)
            continue
        out_items.append(item)
        last = None

    changed = bool(repairs)
    out: list[Item] = []
    for entry in out_items:
        if not isinstance(entry, _Group):
            out.append(entry)
            continue
        if not entry.results:
            for call in entry.calls:
                repairs[CALLS_DROPPED] += 1
                changed = True
                stripped = factory.without_calls(call)
                if stripped is not None:
                    out.append(stripped)
                else:
                    repairs[EMPTY_DROPPED] += 1
            continue
        seen = set(entry.order)
        leftovers: list[Item] = []  # what is left of a call that lost its calls: after the group's results
        for call in entry.calls:
            absent = [cid for cid in dict.fromkeys(call.call_ids) if cid not in seen]
            if not absent:
                out.append(call)
                continue
            placeholders = [factory.placeholder(call, cid) for cid in absent]
            if any(p is None for p in placeholders):
                if len(absent) < len(call.call_ids):
                    raise PayloadError(f"tool call(s) {absent[:5]} got no result, and this kind of call cannot be "
                                       "given a placeholder", param=where, code="unpaired_tool_call")
                # none of this item's calls was answered and it cannot get placeholders: drop its calls
                repairs[CALLS_DROPPED] += 1
                changed = True
                stripped = factory.without_calls(call)
                if stripped is not None:
                    leftovers.append(stripped)
                else:
                    repairs[EMPTY_DROPPED] += 1
                continue
            out.append(call)
            for cid, placeholder in zip(absent, placeholders):
                assert placeholder is not None
                seen.add(cid)
                repairs[PLACEHOLDER_FILLED] += 1
                changed = True
                entry.results[cid] = placeholder
                entry.order.append(cid)
        out.extend(entry.results[cid] for cid in entry.order)
        out.extend(leftovers)
    return (out if changed else items), repairs


def is_paired(items: list[Item], merge_call_runs: bool = False) -> bool:
    """Whether every call has exactly one result right after its call item (or run) and no result is stray."""
    try:
        check(items, merge_call_runs)
    except PayloadError:
        return False
    return True


def check(items: list[Item], merge_call_runs: bool = False, where: str = "messages") -> None:
    """Raise PayloadError (HTTP 400) unless pairing is valid; ``where`` names the body field in messages."""
    pending: set[str] = set()
    taking_calls = False
    group_open = False
    for item in items:
        result_id = item.result_id
        if result_id is not None:
            if not group_open or result_id not in pending:
                param = _param(where, item)
                raise PayloadError(f"{param} answers tool call {_short(result_id)}, which is not pending "
                                   "right before it", param=param, code="unpaired_tool_result")
            pending.discard(result_id)
            taking_calls = False
            continue
        call_ids = item.call_ids
        if not call_ids and not pending:  # (the usual item: neither a call nor a result)
            group_open = taking_calls = False
            continue
        if call_ids and merge_call_runs and taking_calls:
            for cid in call_ids:
                if cid in pending:
                    param = _param(where, item)
                    raise PayloadError(f"{param} repeats the call id {_short(cid)}", param=param,
                                       code="duplicate_tool_call_id")
                pending.add(cid)
            continue
        if pending:
            param = _param(where, item)
            raise PayloadError(f"tool call(s) {sorted(pending)[:5]} got no result before {param}",
                               param=param, code="unpaired_tool_call")
        if call_ids:
            pending = set(call_ids)
            if len(pending) != len(call_ids):
                param = _param(where, item)
                raise PayloadError(f"{param} makes two calls with the same id", param=param,
                                   code="duplicate_tool_call_id")
            group_open = taking_calls = True
        else:
            group_open = taking_calls = False
    if pending:
        raise PayloadError(f"tool call(s) {sorted(pending)[:5]} got no result", param=where,
                           code="unpaired_tool_call")




def check_known(items: list[Item], merge_call_runs: bool = False, where: str = "messages") -> None:
    """``check``, reading back what an earlier check of the same conversation verified (the same outcome).

    The list its first item began when last checked (``Item.verified``: consecutive requests of a conversation
    forward much the same list) is valid, so its part that ``items`` repeats, as the very items, is valid up to
    its last item that neither calls nor answers: after such an item nothing is pending, the state ``check``
    starts from. Only what follows is checked. A list with a new item the warm memory did not keep
    (``Item.unkept``) is not remembered: its first item would hold it, uncounted. One wire's items only, so
    ``merge_call_runs`` is the same every time.
    """
    holder = items[0] if items else None
    known = holder.verified if holder is not None else None
    start = 0
    if known is not None:
        start = same_prefix(items, known)
        while start > 0 and (items[start - 1].call_ids or items[start - 1].result_id is not None):
            start -= 1
    check(items[start:] if start else items, merge_call_runs, where)
    if holder is not None and not any(map(UNKEPT, items[start:])):
        holder.verified = items[:]


def _param(where: str, item: Item) -> str:
    """Where an item is in the body, as an error's ``param`` names it."""
    return f"{where}[{item.source}]" if item.source >= 0 else where


def _short(value: Any) -> str:
    """An id as the client sent it: wires keep internal namespaces behind a NUL (``"\x00fn:name"``)."""
    if isinstance(value, str) and value.startswith("\x00") and ":" in value:
        value = value.split(":", 1)[1]
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
