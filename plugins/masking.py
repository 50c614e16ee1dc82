"""Observation masking (docs/design.md#observation-masking): older tool calls' outputs give way to a short placeholder.

Tool outputs are where an agent's tokens go, and the cheapest thing to forget: the model
still sees every call it made (name, id, arguments), its reasoning and every message, and a
placeholder that names the tool, the call id and the size removed tells it it may call the
tool again. Shared by the ``observation-masking`` context manager and the ``summarising`` one,
which masks first and summarises only when the masked conversation is still over T.

What is masked: tool results of the committed history, oldest first, only while the
conversation is over its summary threshold T. Never masked: the calls, reasoning and thinking,
user and assistant text, the system band, the current turn, the working memory, and the last
``keep_recent`` results of the whole conversation (results in the working memory count toward
them). A result is masked only when its masked copy is smaller, and only if the wire can write
its output as text (``WireAdapter.mask``: not a screenshot or an approval).

The grid: the results of the committed history are numbered from the first one of the
conversation, and a grid line falls after every run of at least ``step`` results that holds at
least one hysteresis step of output (``Budget.step``, ⌈hysteresis_ratio × B⌉ tokens, the
trimmer's step). The number masked is always on a line: the first line that brings the
conversation under T, and never past the last line that leaves ``keep_recent`` results
unmasked. As a conversation grows the masked set moves only from one line to the next, each
move masking at least a step of tokens, so consecutive requests forward the same prefix in
between (providers' prompt caches keep hitting). The lines are a function of the content (and
of B, as the trimmer's grid is) alone: replicas and restarts agree on them.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from typing import Any

from plugins.base import HistoryResult, HistoryView
from proxy.core.items import TOOL, UNKEPT, Item

TOOL_CHARS = 32  # a longer tool name is shortened in the placeholder
ID_CHARS = 16  # a longer call id is shown by its first 15 characters (the call itself, kept, has it whole)


def placeholder(tool: str, call_id: str, tokens: int) -> str:
    """The text a masked output becomes: about 40 tokens (names and ids are shortened to keep it so)."""
    name = _short(tool, TOOL_CHARS) or "tool"
    ident = _short(call_id, ID_CHARS)
    where = f"{ident}, " if ident else ""
    return (f"[ctxproxy removed this {name} output ({where}{tokens:,} tokens) to save context; "
            "call the tool again if you need it]")


def _short(text: str, limit: int) -> str:
    """``text`` without unprintable characters, cut to ``limit`` characters (an ellipsis marks the cut)."""
    if not text.isprintable():  # (the common case, every character printable, is one C call)
        text = "".join(ch for ch in text if ch.isprintable())
    return text if len(text) <= limit else text[: limit - 1] + "…"


# Results masked at once, at least, by default: in a steady tool loop the masked set then moves
# about once every ten results, so about nine requests in ten forward the previous request's prefix
# unchanged (measured on tau-bench sessions: docs/design.md#observation-masking).
MASK_STEP = 10


# A tool result of the history: (its turn, its position in the turn, the item, the call item it answers: the last one
# before it with its id). A plain tuple: made for every result of every request (a NamedTuple costs 10× more to make).
_Result = tuple[int, int, Item, Item | None]


@dataclass
class Masking:
    """A history with its older outputs masked: the view to manage further, and what was masked."""

    view: HistoryView  # the masked history (its ``chain`` is still the client's turns')
    masked: list[dict[str, Any]]  # {call_id, tool, tokens_removed}, oldest first
    saved: int  # tokens removed by masking

    def result(self) -> HistoryResult:
        """The masked history as it goes on to the trimmer."""
        return HistoryResult(turns=self.view.turns, removed={"masked": self.saved}, masked=self.masked)

    def note(self, result: HistoryResult) -> HistoryResult:
        """``result`` (managed from the masked view) with what masking removed added to it."""
        result.removed = {**result.removed, "masked": result.removed.get("masked", 0) + self.saved}
        result.masked = [*self.masked, *result.masked]
        return result


def mask_observations(view: HistoryView, keep_recent: int, step: int) -> Masking | None:
    """The history with older outputs masked on the grid; None when nothing is (under T, nothing old enough).

    What an earlier request of the conversation worked out for the results it shares (``_Memo``) is read back:
    a request that only appends turns works out its new results alone, and one whose masked set did not move
    from the last one's takes that one's masked turns whole.
    """
    mask = view.mask
    budget = view.budget
    total = view.payload_tokens()
    if mask is None or total <= budget.threshold:
        return None
    results, memo, walk = _results(view.turns)
    maskable = len(results) - max(0, keep_recent - view.working_memory_results)
    lines, grid_state = _grid(results, maskable, step, budget.step, memo.grid)
    line = lines[-1]  # the last grid line that keeps keep_recent
    need = total - budget.threshold
    outcomes = list(memo.outcomes)
    saved = list(memo.saved)  # saved[j]: the tokens masking results[:j] saves
    names: dict[int, dict[str, str]] = {}  # per call item (by identity): its call ids' tool names, read once
    while len(outcomes) < line and saved[-1] < need:
        _work_out(results, outcomes, saved, mask, names)
    count = min(line, bisect.bisect_left(saved, need))  # the fewest results that bring it under T (or the line)
    end = lines[bisect.bisect_left(lines, count)]  # the first grid line at or past that
    while len(outcomes) < end:
        _work_out(results, outcomes, saved, mask, names)
    kept = memo.applied
    applied = next((entry for entry in kept if entry[0] == end), None) if saved[end] else None
    if saved[end] and applied is None:
        applied = _apply(view, results, outcomes, end)
        kept = (applied, *kept[:APPLIED - 1])
    if walk is not None:  # (its results are those the outcomes are of; ``walk``: the first item's)
        view.turns[0][0].walk = (*walk, _Memo(tuple(outcomes), tuple(saved), grid_state, kept))
    if applied is None:
        return None
    _, masked_turns, masked_tokens, records = applied
    known = len(masked_turns)
    turns = [*masked_turns, *view.turns[known:]]
    turn_tokens = [*masked_tokens, *view.turn_tokens[known:]]
    # (records are shared with the requests that mask them again: never changed)
    return Masking(dataclasses.replace(view, turns=turns, turn_tokens=turn_tokens), list(records), saved[end])


# What masking worked out for one result: its masked copy, the copy's record and the tokens it saves (None: it stays).
_Outcome = tuple[Item, dict[str, Any], int] | None
_Applied = tuple[int, tuple[list[Item], ...], tuple[int, ...], tuple[dict[str, Any], ...]]


@dataclass(frozen=True)
class _Memo:
    """What masking worked out for the first results of a history's walk, remembered with the walk (``Item.walk``)
    and never changed: a request makes a new one. Each figure is a function of those results alone (the same items
    answering the same calls at the same places), so a later request whose walk repeats them reads it back.

    ``applied``: the last masked sets, newest first (the request's own and, a summarising manager's look-ahead
    masking further, that one's: ``APPLIED``), each as (the results masked, the history's turns up to the last
    one with a masked copy, as masked, their tokens, the records). The next request repeats them until the grid moves.
    """

    outcomes: tuple[_Outcome, ...] = ()
    saved: tuple[int, ...] = (0,)  # saved[j]: the tokens masking results[:j] saves
    grid: tuple[int, int, int, int, int, tuple[int, ...]] | None = None  # (step, tokens, results, count, size, lines)
    applied: tuple[_Applied, ...] = ()


APPLIED = 2  # masked sets remembered per conversation


NO_MEMO = _Memo()


def _work_out(results: list[_Result], outcomes: list[_Outcome], saved: list[int],
              mask: Callable[[Item, str], Item | None], names: dict[int, dict[str, str]]) -> None:
    """Work out the outcome of the next result (``results[len(outcomes)]``)."""
    outcome = _mask_one(results[len(outcomes)], mask, names)
    outcomes.append(outcome)
    saved.append(saved[-1] + (outcome[2] if outcome is not None else 0))


def _apply(view: HistoryView, results: list[_Result], outcomes: list[_Outcome], end: int) -> _Applied:
    """The history's turns with its first ``end`` results masked (as ``_Memo.applied`` holds them)."""
    turns = list(view.turns)
    turn_tokens = list(view.turn_tokens)
    records: list[dict[str, Any]] = []
    last = 0
    for (t, at, _item, _call), outcome in zip(results[:end], outcomes):
        if outcome is None:
            continue
        copy, record, gain = outcome
        if turns[t] is view.turns[t]:
            turns[t] = list(turns[t])
        turns[t][at] = copy
        turn_tokens[t] -= gain
        records.append(record)
        last = t + 1
    return end, tuple(turns[:last]), tuple(turn_tokens[:last]), tuple(records)


def grid(results: list[_Result], maskable: int, step: int, tokens: int) -> list[int]:
    """The grid lines: how many of the first results may be masked together, from 0.

    A line falls after every run of at least ``step`` results holding at least ``tokens`` tokens of
    output, counted from the conversation's first result: a function of the content alone, so a
    growing conversation keeps its lines (and a line never moves once placed).
    """
    return _grid(results, maskable, step, tokens, None)[0]


def _grid(results: list[_Result], maskable: int, step: int, tokens: int,
          known: tuple[int, int, int, int, int, tuple[int, ...]] | None,
          ) -> tuple[list[int], tuple[int, int, int, int, int, tuple[int, ...]]]:
    """``grid``, going on from where ``known`` (the same results' grid, as ``_Memo.grid`` holds it) stopped; and
    where this one stops."""
    if known is not None and known[:2] == (step, tokens):
        _, _, done, count, size, placed = known
    else:
        done, count, size, placed = 0, 0, 0, (0,)
    if maskable <= done:  # (lines are placed from the first result on: those up to ``maskable`` are its own)
        return list(placed[:bisect.bisect_right(placed, max(0, maskable))]), (step, tokens, done, count, size, placed)
    lines = list(placed)
    for j in range(done, maskable):
        count += 1
        size += results[j][2].tokens
        if count >= step and size >= tokens:
            lines.append(j + 1)
            count = size = 0
    return lines, (step, tokens, maskable, count, size, tuple(lines))


_Walk = tuple[list[list[Item]], tuple[_Result, ...], dict[str, Item]]


def _results(turns: list[list[Item]]) -> tuple[list[_Result], _Memo, _Walk | None]:
    """Every tool result of the history, in order, with the call it answers; what masking worked out for them (as
    far as an earlier request did); and the walk to remember that with (None: not remembered).

    The walk is remembered with the history's first item (``Item.walk``: one per conversation, replaced by the next
    walk): a later request whose history begins with the same turns (the very same items, in the same order) walks
    only the turns after them. The result list it returns is its own.
    """
    holder = turns[0][0] if turns and turns[0] else None
    remembered = holder.walk if holder is not None else None
    start = 0
    memo = NO_MEMO
    if remembered is not None:
        known, results, calls, memo = remembered
        if turns[:len(known)] == known:  # (lists of items, compared by identity: one C pass)
            start = len(known)
    if start == 0:
        known, results, calls, memo = [], (), {}, NO_MEMO
    if start == len(turns):  # (nothing new: the remembered walk is this one)
        return list(results), memo, (known, results, calls) if holder is not None else None
    out = list(results)
    calls = dict(calls)
    for t in range(start, len(turns)):
        for i, item in enumerate(turns[t]):
            if item.call_ids:
                for call_id in item.call_ids:
                    calls[call_id] = item
            if item.result_id is not None and item.role == TOOL:
                out.append((t, i, item, calls.get(item.result_id)))
    walk: _Walk | None = None
    if holder is not None and not any(map(UNKEPT, chain.from_iterable(turns[start:]))):
        # (a request the warm memory did not keep is not remembered here either: it would hold it uncounted)
        walk = (known + turns[start:], tuple(out), calls)  # (turn lists are never changed: ``HistoryView``)
        holder.walk = (*walk, memo)
    return out, memo, walk


def _mask_one(result: _Result, mask: Callable[[Item, str], Item | None], names: dict[int, dict[str, str]]) -> _Outcome:
    """The outcome of masking one result: its copy, record and the tokens saved, if that saves tokens."""
    _turn, at, item, call = result
    if item.pinned or at == 0:  # a turn is kept from its first item: that one stays the client's
        return None
    call_key = 0 if call is None else call.key
    known = item.masked
    if known is not None and known[0] == call_key and (call is None or call_key != 0):
        # the same result answering the same call: a request that resumed the conversation (proxy.core.warm) masks
        # it as the earlier one did (the placeholder is a function of the result, its count and the call alone)
        _, copy, record = known
    else:
        tool = _tool_name(result, names)
        copy = mask(item, placeholder(tool, item.result_id or "", item.tokens))
        record = {"call_id": _short(item.result_id or "", 200), "tool": _short(tool, 200),
                  "tokens_removed": item.tokens - copy.tokens if copy is not None else 0}
        item.masked = (call_key, copy, record)
    if copy is None or copy.tokens >= item.tokens:
        return None
    copy.group = item.group
    return copy, record, item.tokens - copy.tokens


def _tool_name(result: _Result, names: dict[int, dict[str, str]]) -> str:
    """The name of the tool whose output this is, from the call it answers (``Item.calls``: its call atoms).

    A message may hold thousands of parallel calls: its atoms are read once (``names``), not once per result.
    """
    _turn, _at, item, call = result
    if call is None:
        return ""
    known = names.get(id(call))
    if known is None:
        pairs = call.calls()
        known = {call_id: name for call_id, name in reversed(pairs)}  # the first of a repeated id wins
        if len(pairs) == 1:
            known[""] = pairs[0][1]  # a single call names any result that answers it
        names[id(call)] = known
    wanted = item.result_id
    if wanted is not None and wanted in known:
        return known[wanted]
    return known.get("", "")
