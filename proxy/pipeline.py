"""The context pipeline, wire-neutral: from a parsed conversation to the items to forward.

repair pairing → split into bands → manage_history (context-manager plugin)
→ working-memory cap → token trim (pin tail) → payload check → fit check
(docs/design.md#2-one-requests-path).

Pairing is repaired first, on the client's items, so every later step works on
whole tool groups and the forwarded payload is always paired; the pairing check
then verifies the result. Everything here is synchronous except the one await on
``manage_history`` (the summariser), so the same code runs in the server, in
``ctxproxy assemble`` and in the explain endpoint, for every wire.

``observe`` is observe mode (a policy's ``mode``): the client's body is forwarded as sent, with
only what always applies (output caps, the upstream model name), and the whole pipeline runs
beside it in dry-run to report what enforce would have forwarded, removed or refused.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from dataclasses import asdict, dataclass, field
from itertools import accumulate, chain
from typing import Any

from plugins.base import HistoryResult, HistoryView, Services, stable_cut
from proxy.core.bands import Bands, assign_groups, known_turns, split_bands, split_turns, tool_groups
from proxy.core.budget import Budget, compute_budget, why
from proxy.core.conversation import Resume, WireAdapter
from proxy.core.errors import (
    BadRequest,
    ContextLengthExceeded,
    CtxProxyError,
    OutputLimitExceeded,
    PayloadError,
)
from proxy.core.fields import case_variant
from proxy.core.items import UNKEPT, USER, Item, ItemKeys, atom_digests, keys_of, same_prefix, turn_digest
from proxy.core.offload import run_step
from proxy.core.pairing import check, check_known, repair
from proxy.core.tokens import TokenCounter
from proxy.policy import ModelRoute, Policy

log = logging.getLogger("ctxproxy")

# What a report's ``summary`` may say, and how removed tokens are counted (the one list of each).
SUMMARY_STATUSES = frozenset({"none", "reused", "created", "failed", "pending", "would_create"})
# the working-memory cap drops rows in steps of a quarter of the cap (at least one row)
WM_CAP_STEP_SHARE = 4
REMOVED_HOW = frozenset({"masked", "summarised", "windowed", "trimmed", "wm_capped"})
MODES = ("enforce", "observe")
BUDGETS_KEPT = 64  # budgets a policy remembers (``_budget``; max_tokens comes from clients: bounded)


@dataclass
class Report:
    """What the pipeline did, for headers, logs, metrics, ``assemble`` and explain."""

    model: str
    tenant: str
    context_manager: str
    wire: str = "chat"
    tokens_before: int = 0
    tokens_after: int = 0
    window: int = 0
    reserve: int = 0
    margin: int = 0
    hard_budget: int = 0
    threshold: int = 0
    calibration: float = 1.0
    provider_window: int | None = None  # the provider's real window, where it narrowed the route's
    turns_total: int = 0
    turns_kept: int = 0
    turns_summarised: int = 0
    turns_dropped: int = 0
    wm_rows_dropped: int = 0
    groups_trimmed: int = 0
    repairs: dict[str, int] = field(default_factory=dict)
    removed: dict[str, int] = field(default_factory=dict)
    summary: str = "none"
    summary_detail: dict[str, Any] = field(default_factory=dict)
    masked: list[dict[str, Any]] = field(default_factory=list)  # tool outputs masked: {call_id, tool, tokens_removed}
    max_tokens_clamped: bool = False
    summary_wait: float | None = None  # seconds the request waited for a summariser (None: it did not wait)
    background: str = ""  # a summary asked for in the background: started | skipped | busy | backoff ("": none)
    warnings: list[str] = field(default_factory=list)
    unmanaged: str | None = None  # why the history was forwarded unmanaged (the provider holds part of it)
    # observe: the client's body was forwarded and every figure above is what enforce would have done
    mode: str = "enforce"
    would_refuse: str | None = None  # observe: the code enforce would have refused the request with

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Assembly:
    """The result: the body to forward (the client's when nothing changed), its items, and the report."""

    body: dict[str, Any]
    items: list[Item]
    changed: bool
    report: Report
    received: list[Item] = field(default_factory=list)
    field_name: str = "messages"
    body_changes: dict[str, Any] = field(default_factory=dict)  # output caps and the upstream model name
    summarised: list[Item] = field(default_factory=list)  # the items of the turns a summary covers (re-fetches)
    sent_tokens: int | None = None  # observe: ctxproxy's count of the client's payload, which is what is forwarded
    _keys: tuple[ItemKeys, ItemKeys] | None = field(default=None, init=False, repr=False, compare=False)

    def item_keys(self) -> tuple[ItemKeys, ItemKeys]:
        """The content keys of the received and of the forwarded items, made once for the trackers that compare the
        request with its conversation's previous one (``keys_of``; the items never change once assembled)."""
        if self._keys is None:
            self._keys = keys_of(self.received, self.items)
        return self._keys

    @property
    def forwarded_tokens(self) -> int:
        """ctxproxy's count of what is forwarded (calibration's denominator): the managed payload's, or in
        observe mode the client's (the report's ``tokens_after`` is then what enforce would have forwarded)."""
        return self.report.tokens_after if self.sent_tokens is None else self.sent_tokens

    @property
    def messages(self) -> Any:
        """The forwarded conversation field (``messages`` / ``input``), as JSON."""
        return self.body.get(self.field_name)


def check_field_names(body: dict[str, Any], fields: frozenset[str]) -> None:
    """Refuse a top-level key that differs from a field the proxy reads (``fields``: every wire's, so that no
    wire's field slips through another's path) only by case (``"Model"``, ``proxy.core.fields``): such an
    upstream would run another model, or another output limit, than the one the proxy checked."""
    for key in body:
        field = case_variant(key, fields)
        if field is not None:
            raise BadRequest(f"'{key[:40]}' differs from the field '{field}' only by case; send '{field}' alone",
                             param=key[:40], code="ambiguous_field")


def request_max_tokens(body: dict[str, Any], wire: WireAdapter) -> dict[str, int]:
    """The request's output limits, by field (several may be present; the wire says where they are)."""
    out: dict[str, int] = {}
    for key, value in wire.output_limits(body).items():
        if value is None:
            continue
        # beyond 64 bits (read exactly, ``proxy.serve.bodies.LONG_DIGITS``) no upstream reads it as a count
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < 2**64:
            raise BadRequest(f"'{key}' must be a positive integer", param=key, code="invalid_max_tokens")
        out[key] = value
    return out


def limit_output(
    body: dict[str, Any], wire: WireAdapter, route: ModelRoute, policy: Policy, report: Report
) -> tuple[int | None, dict[str, Any]]:
    """Apply the tenant's max_output_tokens: clamp (or refuse) every output field, add one when none is set."""
    limits = request_max_tokens(body, wire)
    cap = policy.max_output_tokens
    changes: dict[str, Any] = {}
    if cap is not None:
        # the cap is on the request's whole output: with n choices (Chat Completions) each gets its share
        n = body.get(wire.choices_field) if wire.choices_field else None
        if n is not None and (type(n) is not int or n < 1):  # an upstream may read 4.0 or "4" as 4
            raise BadRequest(f"'{wire.choices_field}' must be a positive integer", param=wire.choices_field,
                             code="invalid_n")
        choices = n or 1
        share = cap // choices
        if share < 1:
            raise OutputLimitExceeded(f"'n' is {n}; this key allows at most {cap} output tokens per request",
                                      param="n")
        per = f" for each of {choices} choices" if choices > 1 else ""
        for key, value in limits.items():
            if value > share:
                if policy.max_output_policy == "refuse":
                    raise OutputLimitExceeded(f"'{key}' is {value}{per}; this key allows at most {cap} output "
                                              "tokens per request", param=key)
                changes[key] = limits[key] = share
        if not limits:
            key = wire.output_field(route.upstream_model)
            changes[key] = limits[key] = share
        report.max_tokens_clamped = bool(changes)
    return (min(limits.values()) if limits else None), changes


LINKS = 200_000  # chained-hash links a counter remembers (then it starts again)


def chain_hashes(turns: list[list[Item]], counter: TokenCounter | None = None) -> list[str]:
    """chain[i] identifies turns[0..i] by their wire-neutral meaning, chained (stable across hosts and wires).

    Each item's atom digests are remembered by the counter under its content key, so a growing
    conversation only digests its new items. The chain of the turns the first item last began is read back for
    the leading turns that are the same lists of the very same items (``Item.chained``: a link is a function of
    the items before it alone); the links a counter remembers serve the turns after them.
    """
    links = counter.links if counter is not None else None
    holder = turns[0][0] if turns and turns[0] else None
    remembered = holder.chained if holder is not None else None
    reused: list[bytes] = []
    if remembered is not None:
        old_turns, old_links = remembered
        reused = old_links[:same_prefix(turns, old_turns)]
    out = [link.hex() for link in reused]
    made = list(reused)  # the links, as bytes (what the first item remembers)
    link = reused[-1] if reused else b""
    known = len(reused)  # turns whose links were remembered (a growing conversation: all but the new ones)
    if links is not None:
        for turn in turns[known:]:
            keys = tuple([item.key for item in turn])
            found = links.get((link, keys)) if 0 not in keys else None
            if found is None:
                break
            link = found
            out.append(link.hex())
            made.append(link)
            known += 1
    rest = turns[known:]
    flat = [item for turn in rest for item in turn]
    if counter is None:
        digests = [atom_digests(item) for item in flat]
    else:
        digests = counter.many_digests([item.key for item in flat], lambda i: atom_digests(flat[i]))
    start = 0
    for turn in rest:
        end = start + len(turn)
        before, link = link, turn_digest(link, digests[start:end])
        out.append(link.hex())
        made.append(link)
        start = end
        if links is not None and all(item.key for item in turn):
            if len(links) >= LINKS:
                links.clear()
            links[(before, tuple([item.key for item in turn]))] = link
    if holder is not None and not any(map(UNKEPT, chain.from_iterable(turns[len(reused):]))):
        holder.chained = (turns[:], made)  # (a request the warm memory did not keep is not remembered)
    return out


@dataclass
class Prepared:
    """The policy-independent, CPU-heavy first step: parse, pairing repair, counting.

    It is synchronous and touches nothing shared but the counter's LRU (behind its lock), so
    it runs in a worker thread for large bodies with the rest of the synchronous pipeline.
    """

    received: list[Item]
    repaired: list[Item]
    repairs: Counter[str]
    fixed: int
    notes: list[str]
    unmanaged: str | None = None
    tokens: int | None = None  # the repaired items' tokens in all, when the wire knew them


def prepare(body: dict[str, Any], wire: WireAdapter, counter: TokenCounter, tenant: str | None = None) -> Prepared:
    """Parse, repair and group ``body``; with ``tenant``, a wire that can resume a known conversation parses only
    what it appends (``proxy.core.warm``: the same result, for less)."""
    resume: Resume | None = getattr(wire, "resume", None) if tenant is not None else None  # (not isinstance: slow)
    conversation = resume(body, counter, tenant) if resume is not None and tenant is not None \
        else wire.parse(body, counter)
    items = conversation.items
    repairs: Counter[str]
    if conversation.paired or conversation.unmanaged is not None:
        repaired, repairs = items, Counter()
    else:
        repaired, repairs = repair(items, wire, wire.merge_call_runs, wire.field)
        check(repaired, wire.merge_call_runs, wire.field)  # what no repair can fix is refused here
        for item in repaired:
            if item.key == 0:  # a placeholder or an edited call: count it
                wire.count(item, counter)
    if conversation.repairs:
        repairs.update(conversation.repairs)  # what the wire already repaired while parsing
    if not repaired and repairs:
        # every item was an unpaired call, a stray result or a dangling reasoning item: an empty
        # conversation is not a request any provider answers, so it is refused here, not forwarded
        raise PayloadError(f"nothing is left of '{wire.field}' after the pairing repair ("
                           + ", ".join(f"{k}={v}" for k, v in sorted(repairs.items())) + ")",
                           param=wire.field, code="empty_after_repair")
    # the items a wire resumed from an earlier request carry their group numbers already
    assign_groups(repaired, wire.merge_call_runs, conversation.grouped if repaired is items else 0)
    return Prepared(items, repaired, repairs, conversation.fixed_tokens, conversation.notes, conversation.unmanaged,
                    conversation.tokens if repaired is items else None)


async def assemble(
    body: dict[str, Any],
    *,
    wire: WireAdapter,
    route: ModelRoute,
    policy: Policy,
    counter: TokenCounter,
    services: Services,
    offload: bool = False,
    calibration: float = 1.0,
    provider_window: int | None = None,
    report: Report | None = None,
    prepared: Prepared | None = None,
) -> Assembly:
    """Run the whole pipeline on one body of ``wire`` (raises a CtxProxyError to refuse).

    Everything but the context manager's ``manage_history`` (which may await the summary cache or the
    summariser) is synchronous and linear in the number of items. With ``offload`` (a large body) the
    synchronous steps run in a worker thread, before and after that await, so the event loop keeps
    serving other requests while a long conversation is parsed, counted, trimmed and rendered.
    ``calibration`` and ``provider_window``: what the provider's counts and refusals taught (``compute_budget``).
    ``report`` (filled in as the steps go, so a caller still has it when a step refuses) and ``prepared``
    (the body already parsed): given by ``observe``.
    """
    if report is None:
        report = new_report(wire, route, policy, calibration, provider_window)
    planned = await run_step(offload, _plan, body, wire, route, policy, counter, services, calibration, offload,
                             report, prepared)
    if isinstance(planned, Assembly):
        return planned
    if isinstance(planned, _Ahead):  # under T, but near it: the context manager may prepare what comes next
        planned.done.report.background = await policy.manager.look_ahead(planned.view)
        return planned.done
    result = await policy.manager.manage_history(planned.view)
    return await run_step(offload, _finish, planned, result)


@dataclass
class _Ahead:
    """A request under T whose payload reached the context manager's look-ahead point: its finished assembly
    (forwarded as it is) and the view the manager looks ahead on."""

    done: Assembly
    view: HistoryView


@dataclass
class _Plan:
    """What the steps before ``manage_history`` decided, for the steps after it."""

    body: dict[str, Any]
    wire: WireAdapter
    policy: Policy
    report: Report
    prepared: Prepared
    changes: dict[str, Any]
    budget: Budget
    bands: Bands
    live: WorkingMemory
    view: HistoryView
    ends: list[int]  # where each turn of the history ends (``whole_turns``)
    pinned: list[Item]  # the history's pinned items


def _tokens(items: list[Item]) -> int:
    return sum([item.tokens for item in items])  # (a comprehension: faster than map with an attrgetter)


def new_report(wire: WireAdapter, route: ModelRoute, policy: Policy, calibration: float,
               provider_window: int | None = None) -> Report:
    return Report(model=route.name, tenant=policy.tenant, context_manager=policy.binding.type, wire=wire.name,
                  warnings=list(policy.warnings), calibration=calibration, provider_window=provider_window)


def _plan(
    body: dict[str, Any], wire: WireAdapter, route: ModelRoute, policy: Policy, counter: TokenCounter,
    services: Services, calibration: float, offload: bool, report: Report, prepared: Prepared | None,
) -> Assembly | _Ahead | _Plan:
    """Parse, repair, budget and bands; the finished Assembly when nothing needs managing."""
    provider_window = report.provider_window
    if prepared is None:
        prepared = prepare(body, wire, counter, policy.tenant)
    received, repaired, repairs, fixed = prepared.received, prepared.repaired, prepared.repairs, prepared.fixed
    report.warnings.extend(prepared.notes)

    max_tokens, changes = limit_output(body, wire, route, policy, report)
    changes.update(wire.model_changes(body, route.upstream_model))
    if prepared.unmanaged is not None:
        return _unmanaged(body, prepared, wire, route, policy, report, max_tokens, changes, calibration,
                          provider_window)

    report.repairs = dict(repairs)
    if repairs and policy.pairing == "strict":
        raise PayloadError(
            "tool-call pairing is invalid (" + ", ".join(f"{k}={v}" for k, v in sorted(repairs.items()))
            + ") and this policy is pairing: strict", param=wire.field, code="invalid_tool_pairing")

    total = fixed + (_tokens(repaired) if prepared.tokens is None else prepared.tokens)
    report.tokens_before = total

    budget = _budget(route, policy, max_tokens, calibration, provider_window)
    report.window, report.reserve, report.margin = budget.window, budget.reserve, budget.margin
    report.hard_budget, report.threshold = budget.hard_budget, budget.threshold

    bands = split_bands(repaired)
    if total <= budget.threshold:
        # a turn starts at each user item of the history (items before the first one are a preamble, not a turn)
        report.turns_total = report.turns_kept = [item.role for item in bands.history].count(USER)
        report.tokens_after = total
        _fits(total, budget, wire)
        changed = bool(repairs) or bool(changes)
        out = wire.render(body, repaired, changes) if changed else body
        done = Assembly(out, repaired, changed, report, received, wire.field, changes)
        point = None if services.dry_run or not bands.history else policy.manager.look_ahead_point(budget)
        if point is None or total < point:
            return done
        turns = split_turns(bands.history)  # (only here: a request forwarded as sent needs no turns)
        return _Ahead(done, _view(wire, counter, services, budget, bands, turns, fixed, offload))

    turns, turn_tokens = known_turns(bands.history)
    report.turns_total = report.turns_kept = len(turns) - (turns[0][0].role != USER) if turns else 0
    ends = list(accumulate(map(len, turns)))  # (before a context manager sees the turns, which it may change)
    live = WorkingMemory(bands.working_memory)
    view = _view(wire, counter, services, budget, bands, turns, fixed, offload, turn_tokens)
    # what can never be dropped: refuse now, before a summariser is called (and billed) for nothing
    pinned = _pinned(bands.history)
    _fits(view.pinned_tokens - _tokens(bands.working_memory) + _tokens(live.pinned_items()) + _tokens(pinned),
          budget, wire)
    return _Plan(body, wire, policy, report, prepared, changes, budget, bands, live, view, ends, pinned)


def _view(wire: WireAdapter, counter: TokenCounter, services: Services, budget: Budget, bands: Bands,
          turns: list[list[Item]], fixed: int, offload: bool, turn_tokens: list[int] | None = None) -> HistoryView:
    """The committed history as the context manager sees it (``turn_tokens``: the turns' tokens, when known)."""
    pinned = fixed + _tokens(bands.system) + _tokens(bands.working_memory)
    if bands.current is not None:
        pinned += bands.current.tokens

    holder = turns[0][0] if turns and turns[0] else None

    def summary_item(text: str, covered: int) -> Item:
        # the history's first item remembers the last one made: the next requests that use the same summary forward
        # the very same item, so what is read back by the first items of the forwarded list (the pairing checked,
        # the render) reaches past it
        made = holder.summary if holder is not None else None
        if made is not None and made[1] == covered and made[0] == text:
            return made[2]
        item = wire.summary(text, covered, counter)
        if holder is not None and not holder.unkept:
            holder.summary = (text, covered, item)
        return item

    def mask(item: Item, text: str) -> Item | None:
        return wire.mask(item, text, counter)

    return HistoryView(
        turns=turns,
        turn_tokens=[sum([item.tokens for item in t]) for t in turns] if turn_tokens is None else turn_tokens,
        chain_fn=lambda: chain_hashes(turns, counter),
        pinned_tokens=pinned,
        budget=budget,
        counter=counter,
        services=services,
        summary_item=summary_item,
        offload=offload,
        mask=mask,
        working_memory_results=sum(1 for item in bands.working_memory if item.result_id is not None),
    )


def _finish(plan: _Plan, result: HistoryResult) -> Assembly:
    """From the context manager's history to the body to forward: WM cap, trim, whole turns, checks, render."""
    body, wire, report, budget, bands, live = plan.body, plan.wire, plan.report, plan.budget, plan.bands, plan.live
    received, repairs, fixed, changes = (plan.prepared.received, plan.prepared.repairs, plan.prepared.fixed,
                                         plan.changes)
    report.summary = result.summary_status
    report.summary_detail = dict(result.detail)
    report.summary_wait = result.waited
    report.background = result.background
    report.turns_summarised = result.turns_summarised
    report.turns_dropped = result.turns_dropped
    report.masked = list(result.masked)
    removed: Counter[str] = Counter(result.removed)
    history = list(chain.from_iterable(result.turns))  # (C speed: faster than a comprehension)
    history = _keep_pinned(plan.pinned, history)
    history, cut = whole_turns(bands.history, history, plan.ends)
    removed["windowed"] += _tokens(cut)

    cap = plan.policy.manager.working_memory_messages
    if cap is not None and live.rows() > cap:
        # on a grid counted from the working memory's start, like every other cut: the rows dropped are a
        # multiple of the step, so the next few rounds of a tool loop append to the same forwarded prefix
        goal = stable_cut(live.rows() - cap, max(1, -(-cap // WM_CAP_STEP_SHARE)), live.rows())
        rows = 0
        while rows < goal and (dropped := live.drop_next()) is not None:
            rows += len(dropped)
            report.wm_rows_dropped += len(dropped)
            removed["wm_capped"] += _tokens(dropped)

    summary = result.summary
    head = list(bands.system) + ([summary] if summary is not None else [])
    tail = [bands.current] if bands.current is not None else []
    size = fixed + _tokens(head) + _tokens(history) + _tokens(tail) + _tokens(live.items())
    trimmed, size = _trim(history, live, size, budget, report, removed)
    if trimmed is not history:  # (else it is whole turns already)
        history, cut = whole_turns(bands.history, trimmed, plan.ends)
        size -= _tokens(cut)
        removed["trimmed"] += _tokens(cut)
    wm = live.items()
    if size > budget.hard_budget and summary is not None:
        # the summary is the last thing to go: better the recent turns without it than a refusal
        size -= summary.tokens
        removed["trimmed"] += summary.tokens
        summary = None
    if summary is not None and report.summary == "would_create":
        report.summary_detail["placeholder_tokens"] = summary.tokens  # counted in place of the summary (observe)

    final = Bands(bands.system, history, bands.current, wm).flatten(summary)
    report.removed = {k: v for k, v in removed.items() if v}
    report.tokens_after = size
    report.turns_kept = [item.role for item in history].count(USER)  # (a turn starts at a user item)
    _fits(size, budget, wire)
    check_known(final, wire.merge_call_runs, wire.field)
    # (items compare by identity, having no __eq__ of their own: list equality is one C pass of identity tests)
    changed = final != received or bool(changes) or bool(repairs)
    out = wire.render(body, final, changes) if changed else body
    summarised = list(chain.from_iterable(plan.view.turns[: result.turns_summarised]))
    return Assembly(out, final, changed, report, received, wire.field, changes, summarised=summarised)


def whole_turns(history: list[Item], kept: list[Item], ends: list[int] | None = None) -> tuple[list[Item], list[Item]]:
    """``kept`` without what is left of a turn whose start was cut, and what that removed.

    A cut (by the trimmer or a context manager) may fall inside a turn: the user's question goes and
    the answer, its tool calls or its results stay, and the forwarded history then opens with an
    answer to nothing. A turn of ``history`` (the committed history before the cut; items before
    the first user item form a preamble turn) is kept from its start or not at all: a kept item
    whose turn's first item was cut goes too, by whole tool groups. Pinned items stay wherever they
    are, as do items that are not in ``history`` (a context manager's own). Linear in the items.
    ``ends``: where each turn of ``history`` ends (``split_turns``'s, accumulated; made here when not given): the
    items of a turn whose start was kept are not looked at, and those of one whose start was cut at C speed.
    """
    if not kept:
        return kept, []
    if ends is None:
        ends = list(accumulate(map(len, split_turns(history))))
    # sets of the items themselves: an item hashes and compares by identity (no __eq__ of its own), 3× faster to
    # hash than the large integers id() makes
    present = set(kept)
    contains = present.__contains__
    orphans: set[Item] = set()  # kept items whose turn's first item was cut
    start = 0
    for end in ends:
        if history[start] not in present:
            rest = history[start + 1:end]
            if any(map(contains, rest)):
                orphans.update(filter(contains, rest))
        start = end
    if not orphans:  # the usual case: every cut fell between turns
        return kept, []
    out: list[Item] = []
    cut: list[Item] = []
    for group in tool_groups(kept):
        orphaned = any(item in orphans for item in group)
        if orphaned and not any(item.pinned for item in group):
            cut.extend(group)
        else:
            out.extend(group)
    return (out, cut) if cut else (kept, cut)


def _unmanaged(
    body: dict[str, Any], prepared: Prepared, wire: WireAdapter, route: ModelRoute, policy: Policy, report: Report,
    max_tokens: int | None, changes: dict[str, Any], calibration: float, provider_window: int | None = None,
) -> Assembly:
    """The provider holds part of this history: forward the conversation as sent; only the body's rules apply.

    The proxy cannot see or count what the provider holds, so it neither manages nor repairs the
    history; output caps, the model allow-list, the upstream model name and the tenant's
    ``max_context_tokens`` (on the part it can see) still hold.
    """
    report.unmanaged = prepared.unmanaged
    visible = prepared.fixed + _tokens(prepared.received)
    report.tokens_before = report.tokens_after = visible
    budget = _budget(route, policy, max_tokens, calibration, provider_window)
    report.window, report.reserve, report.margin = budget.window, budget.reserve, budget.margin
    report.hard_budget, report.threshold = budget.hard_budget, budget.threshold
    check_visible(visible, policy, calibration, wire.field, prepared.unmanaged)
    out = {**body, **changes} if changes else body
    return Assembly(out, prepared.received, bool(changes), report, prepared.received, wire.field, changes)


def check_visible(visible: int, policy: Policy, calibration: float, param: str, held: str | None) -> None:
    """Refuse a body whose visible part alone is over the tenant's ``max_context_tokens``.

    The cap is a hard cap on what is forwarded, on every path, including those where the proxy cannot
    manage the history (the provider holds part of it: ``held``) and ``/responses/compact``. What the
    provider holds is not counted: ctxproxy cannot see it. Like B, the cap holds in the provider's
    count, so in the proxy's own count it is the cap / ``calibration``.
    """
    cap = policy.max_context_tokens
    if cap is None:
        return
    limit = int(cap / calibration) if calibration > 0 and calibration != 1.0 else cap
    if visible <= limit:
        return
    unseen = f" What the provider holds ({held}) is not counted: ctxproxy cannot see it." if held else ""
    raise ContextLengthExceeded(
        f"This request's input is {visible} tokens, over this key's context cap (max_context_tokens) of {limit}, "
        f"and it cannot be trimmed here.{unseen} Shorten the input or start a new conversation.",
        param=param,
    )


def _budget(route: ModelRoute, policy: Policy, max_tokens: int | None, calibration: float,
            provider_window: int | None = None) -> Budget:
    """The request's budget: a function of the route, the policy and these figures alone, so remembered with the
    policy (a request of a known conversation has the same ones as the one before it)."""
    key = (route.window, route.max_output, max_tokens, calibration, provider_window)
    known = policy.budgets.get(key)
    if known is None:
        if len(policy.budgets) >= BUDGETS_KEPT:
            policy.budgets.clear()
        known = policy.budgets[key] = _new_budget(route, policy, max_tokens, calibration, provider_window)
    return known


def _new_budget(route: ModelRoute, policy: Policy, max_tokens: int | None, calibration: float,
                provider_window: int | None) -> Budget:
    manager = policy.manager
    cap = policy.max_context_tokens
    if policy.budget_cap is not None:
        cap = policy.budget_cap if cap is None else min(cap, policy.budget_cap)
    budget = compute_budget(
        window=route.window,
        request_max_tokens=max_tokens,
        model_max_output=route.max_output,
        trimmer=policy.trimmer,
        tenant_cap=cap,
        hysteresis_ratio=manager.hysteresis_ratio,
        summary_threshold=manager.summary_threshold,
        calibration=calibration,
        provider_window=provider_window,
    )
    if policy.base_threshold is not None:
        # an override may lower the summary threshold, never raise it above the policy's own
        threshold, ratio = policy.base_threshold
        base = threshold if threshold > 0 else int(budget.hard_budget / (1 + max(0.0, ratio)))
        if base < budget.threshold:
            budget = dataclasses.replace(budget, threshold=base)
    return budget


def _pinned(items: list[Item]) -> list[Item]:
    return [item for item in items if item.pinned]


def _keep_pinned(pinned: list[Item], after: list[Item]) -> list[Item]:
    """Put back the ``pinned`` items (the history's) a context manager dropped: at the head of the kept history
    (they were older)."""
    if not pinned:
        return after
    kept = set(after)  # (by identity, as in ``whole_turns``)
    missing = [item for item in pinned if item not in kept]
    return missing + after if missing else after


def _trim(
    history: list[Item],
    live: WorkingMemory,
    size: int,
    budget: Budget,
    report: Report,
    removed: Counter[str],
) -> tuple[list[Item], int]:
    """Drop the oldest history groups (on the prefix-stable grid), then WM groups, never a pinned one."""
    if size <= budget.hard_budget:
        return history, size
    need = size - budget.hard_budget
    goal = -(-need // budget.step) * budget.step
    groups = tool_groups(history)
    dropped = 0
    drop: set[int] = set()
    for i, group in enumerate(groups):
        if dropped >= goal:
            break
        if any(item.pinned for item in group):
            continue
        dropped += _tokens(group)
        drop.add(i)
    if drop:
        report.groups_trimmed += len(drop)
        removed["trimmed"] += dropped
        history = [item for i, g in enumerate(groups) if i not in drop for item in g]
        size -= dropped
    while size > budget.hard_budget and (wm_group := live.drop_next()) is not None:
        n = _tokens(wm_group)
        size -= n
        removed["trimmed"] += n
        report.wm_rows_dropped += len(wm_group)
    return history, size


class WorkingMemory:
    """Working memory as tool groups, with the ones that are never dropped.

    Kept always: the last group, the live tool round (the last group with calls: an assistant
    prefill may follow the results the model is working on), and any group with a pinned item.
    The others go oldest first (docs/design.md#7-working-memory-cap-and-token-trim). Dropping is
    O(1) amortised: a cursor walks the groups once and the row count is kept up to date, so a
    working memory of thousands of tool groups is capped or trimmed in linear time.
    """

    def __init__(self, wm: list[Item]) -> None:
        self.groups = tool_groups(wm)
        keep: set[int] = set()
        if self.groups:
            keep.add(len(self.groups) - 1)
            last_calls = next((i for i in range(len(self.groups) - 1, -1, -1) if self.groups[i][0].call_ids), None)
            if last_calls is not None:
                keep.add(last_calls)
            keep.update(i for i, g in enumerate(self.groups) if any(item.pinned for item in g))
        self.keep = keep
        self.dropped: set[int] = set()
        self._next = 0  # every group before it is dropped or kept for good
        self._rows = len(wm)

    def pinned_items(self) -> list[Item]:
        return [item for i in sorted(self.keep) for item in self.groups[i]]

    def rows(self) -> int:
        return self._rows

    def drop_next(self) -> list[Item] | None:
        """Drop the oldest droppable group and return it (None when only kept groups are left)."""
        while self._next < len(self.groups):
            i = self._next
            self._next += 1
            if i not in self.keep:
                self.dropped.add(i)
                self._rows -= len(self.groups[i])
                return self.groups[i]
        return None

    def items(self) -> list[Item]:
        if not self.dropped:
            return [item for g in self.groups for item in g]
        return [item for i, g in enumerate(self.groups) if i not in self.dropped for item in g]


def _fits(size: int, budget: Budget, wire: WireAdapter) -> None:
    if size > budget.hard_budget:
        output = "max_tokens" if "max_tokens" in wire.output_fields else wire.output_fields[0]
        raise ContextLengthExceeded(
            f"This request needs {size} input tokens after context management, but the budget is "
            f"{budget.hard_budget} ({why(budget)}). The system messages, the current user turn and the last "
            f"tool round cannot be dropped; shorten them or lower {output}.",
            param=wire.field,
        )


async def observe(
    body: dict[str, Any],
    *,
    wire: WireAdapter,
    route: ModelRoute,
    policy: Policy,
    counter: TokenCounter,
    services: Services,
    offload: bool = False,
    calibration: float = 1.0,
    provider_window: int | None = None,
) -> Assembly:
    """Observe mode: forward the client's body, and report what enforce would have done with it.

    What always applies is applied, and refused as in enforce: the output caps (``limit_output``) and
    the upstream model name (the model allow-list was checked with the policy). The client's bytes are
    forwarded when nothing of that changes them. The whole pipeline runs beside it on ``services`` in
    dry-run (the summariser is never called: a summary it would make is counted at its largest,
    ``summarizer.max_summary_tokens``); the report carries its figures (``tokens_before``: the client's
    payload; ``tokens_after``: what enforce would forward) and, where enforce would refuse the request,
    ``would_refuse`` with the refusal's code (``tokens_after`` 0: nothing would be forwarded).
    """
    report = new_report(wire, route, policy, calibration, provider_window)
    report.mode = "observe"
    _, changes = limit_output(body, wire, route, policy, report)
    changes.update(wire.model_changes(body, route.upstream_model))
    forwarded = {**body, **changes} if changes else body
    received: list[Item] = []
    sent = 0
    try:
        prepared = await run_step(offload, prepare, body, wire, counter, policy.tenant)
        received, sent = prepared.received, prepared.fixed + _tokens(prepared.received)
        would = await assemble(body, wire=wire, route=route, policy=policy, counter=counter, services=services,
                               offload=offload, calibration=calibration, report=report, prepared=prepared)
    except Exception as exc:  # what enforce would refuse; observed, never answered
        if isinstance(exc, CtxProxyError):
            report.would_refuse, why = exc.code or "invalid_request", exc.message
        else:  # a fault of the pipeline's own: enforce would answer 500; observe mode forwards all the same
            log.exception("observe mode: the pipeline failed on request %s", services.request_id)
            report.would_refuse, why = "internal_error", "the pipeline failed (logged)"
        report.tokens_after, report.removed = 0, {}
        report.warnings.append(f"observe mode: enforce would refuse this request ({report.would_refuse}): {why}")
    else:
        report = would.report
        placeholder = report.summary_detail.get("placeholder_tokens")
        if isinstance(placeholder, int):  # the summary enforce would make, at its largest
            report.tokens_after += max(0, services.summary_tokens - placeholder)
    report.tokens_before = sent
    return Assembly(forwarded, received, bool(changes), report, received, wire.field, changes, sent_tokens=sent)
