"""The context pipeline (DESIGN §1-5), from a parsed request body to the messages to forward.

repair pairing → split into bands → manage_history (context-manager plugin)
→ working-memory cap → token trim (pin tail) → payload check → fit check.

Pairing is repaired first, on the client's messages, so every later step works
on whole tool groups and the forwarded payload is always paired; the payload
check then verifies the result. Everything here is synchronous except the one
await on ``manage_history`` (the summariser), so the same code runs in the
server, in ``ctxproxy assemble`` and in the explain endpoint.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from plugins.base import HistoryView, Services
from proxy.budget import Budget, compute_budget
from proxy.errors import BadRequest, ContextLengthExceeded, OutputLimitExceeded, PayloadError
from proxy.messages import Bands, Message, is_call, split_bands, split_turns, tool_groups
from proxy.pairing import check, repair, scan
from proxy.policy import ModelRoute, Policy
from proxy.tokens import REPLY_PRIMING, TokenCounter, content_key


@dataclass
class Report:
    """What the pipeline did, for headers, logs, metrics, ``assemble`` and explain."""

    model: str
    tenant: str
    context_manager: str
    tokens_before: int = 0
    tokens_after: int = 0
    window: int = 0
    reserve: int = 0
    margin: int = 0
    hard_budget: int = 0
    threshold: int = 0
    turns_total: int = 0
    turns_kept: int = 0
    turns_summarised: int = 0
    turns_dropped: int = 0
    wm_rows_dropped: int = 0
    groups_trimmed: int = 0
    repairs: dict[str, int] = field(default_factory=dict)
    removed: dict[str, int] = field(default_factory=dict)
    summary: str = "none"
    max_tokens_clamped: bool = False
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Assembly:
    """The result: messages to forward, whether anything changed, and the report."""

    messages: list[Message]
    changed: bool
    report: Report
    body_changes: dict[str, Any] = field(default_factory=dict)
    keys: dict[int, int] = field(default_factory=dict)  # id(message) -> in-process content key
    received: list[Message] = field(default_factory=list)


OUTPUT_FIELDS = ("max_completion_tokens", "max_tokens")
# models that accept only max_completion_tokens
_COMPLETION_ONLY = ("o1", "o3", "o4", "gpt-5")


def request_max_tokens(body: dict[str, Any]) -> dict[str, int]:
    """The request's output limits, by field (both may be present)."""
    out: dict[str, int] = {}
    for key in OUTPUT_FIELDS:
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BadRequest(f"'{key}' must be a positive integer", param=key, code="invalid_max_tokens")
        out[key] = value
    return out


def limit_output(body: dict[str, Any], route: ModelRoute, policy: Policy, report: Report) -> tuple[int | None, dict[str, Any]]:
    """Apply the tenant's max_output_tokens: clamp (or refuse) every output field, add one when none is set."""
    limits = request_max_tokens(body)
    cap = policy.max_output_tokens
    changes: dict[str, Any] = {}
    if cap is not None:
        for key, value in limits.items():
            if value > cap:
                if policy.max_output_policy == "refuse":
                    raise OutputLimitExceeded(f"'{key}' is {value}; this key allows at most {cap}", param=key)
                changes[key] = limits[key] = cap
        if not limits:
            completion_only = route.upstream_model.rsplit("/", 1)[-1].startswith(_COMPLETION_ONLY)
            key = "max_completion_tokens" if completion_only else "max_tokens"
            changes[key] = limits[key] = cap
        report.max_tokens_clamped = bool(changes)
    return (min(limits.values()) if limits else None), changes


def chain_hashes(turns: list[list[Message]], keys: dict[int, int]) -> list[str]:
    """chain[i] identifies turns[0..i]: each turn's messages hashed onto the previous link (stable across hosts)."""
    out: list[str] = []
    link = b""
    for turn in turns:
        h = hashlib.blake2b(link, digest_size=16)
        for message in turn:
            key = keys.get(id(message))
            h.update((key if key is not None else content_key(message)).to_bytes(16, "little"))
        link = h.digest()
        out.append(link.hex())
    return out


@dataclass
class Prepared:
    """The policy-independent, CPU-heavy first step: shape check, pairing repair, hashing, counting.

    It is synchronous and touches nothing shared but the counter's LRU, so the
    server runs it in a worker thread for large bodies (tiktoken releases the GIL).
    """

    messages: list[Message]
    repaired: list[Message]
    repairs: Counter[str]
    keys: dict[int, int]  # id(message) -> in-process content key (token LRU, prefix tracking)
    tokens: dict[int, int]
    fixed: int


def prepare(body: dict[str, Any], counter: TokenCounter) -> Prepared:
    messages: list[Message] = body.get("messages")  # type: ignore[assignment]  # scan() checks it
    if scan(messages):
        repaired, repairs = messages, Counter[str]()
    else:
        repaired, repairs = repair(messages)
    key_list = [content_key(m) for m in repaired]
    counts = counter.messages(repaired, key_list)
    ids = [id(m) for m in repaired]
    fixed = REPLY_PRIMING + counter.tools(body.get("tools")) + counter.tools(body.get("functions"))
    return Prepared(messages, repaired, repairs, dict(zip(ids, key_list)),
                    dict(zip(ids, counts)), fixed)


async def assemble(
    body: dict[str, Any],
    *,
    route: ModelRoute,
    policy: Policy,
    counter: TokenCounter,
    services: Services,
    prepared: Prepared | None = None,
) -> Assembly:
    """Run the whole pipeline on one chat-completions body (raises a CtxProxyError to refuse)."""
    report = Report(model=route.name, tenant=policy.tenant, context_manager=policy.binding.type,
                    warnings=list(policy.warnings))
    if prepared is None:
        prepared = prepare(body, counter)
    messages, repaired, repairs = prepared.messages, prepared.repaired, prepared.repairs
    keys, tokens, fixed = prepared.keys, prepared.tokens, prepared.fixed

    max_tokens, body_changes = limit_output(body, route, policy, report)

    report.repairs = dict(repairs)
    if repairs and policy.pairing == "strict":
        raise PayloadError(
            "tool-call pairing is invalid (" + ", ".join(f"{k}={v}" for k, v in sorted(repairs.items()))
            + ") and this policy is pairing: strict", param="messages", code="invalid_tool_pairing")

    total = fixed + sum(tokens.values())
    report.tokens_before = total

    budget = _budget(route, policy, max_tokens)
    report.window, report.reserve, report.margin = budget.window, budget.reserve, budget.margin
    report.hard_budget, report.threshold = budget.hard_budget, budget.threshold

    bands = split_bands(repaired)
    turns = split_turns(bands.history)
    report.turns_total = report.turns_kept = sum(1 for t in turns if t and t[0].get("role") == "user")
    if total <= budget.threshold:
        report.tokens_after = total
        _fits(total, budget)
        if repairs:
            check(repaired)
        return Assembly(repaired, bool(repairs) or bool(body_changes), report, body_changes, keys, messages)

    def toks(ms: list[Message]) -> int:
        return sum(tokens[id(m)] for m in ms)

    pinned = fixed + toks(bands.system) + toks(bands.working_memory)
    if bands.current is not None:
        pinned += tokens[id(bands.current)]
    # what can never be dropped: refuse now, before a summariser is called (and billed) for nothing
    live = WorkingMemory(bands.working_memory)
    _fits(pinned - toks(bands.working_memory) + toks(live.pinned_group()), budget)
    message_tokens = [[tokens[id(m)] for m in t] for t in turns]
    view = HistoryView(
        turns=turns,
        message_tokens=message_tokens,
        turn_tokens=[sum(t) for t in message_tokens],
        chain_fn=lambda: chain_hashes(turns, keys),
        pinned_tokens=pinned,
        budget=budget,
        counter=counter,
        services=services,
    )
    result = await policy.manager.manage_history(view)
    report.summary = result.summary_status
    report.turns_summarised = result.turns_summarised
    report.turns_dropped = result.turns_dropped
    removed: Counter[str] = Counter(result.removed)
    if result.summary is not None:
        tokens[id(result.summary)] = counter.message(result.summary)
    history = [m for t in result.turns for m in t]
    for m in history:
        if id(m) not in tokens:  # a plugin may return messages of its own
            tokens[id(m)] = counter.message(m)

    cap = policy.manager.working_memory_messages
    if cap is not None and live.rows() > cap:
        while live.rows() > cap and (dropped := live.drop_next()) is not None:
            report.wm_rows_dropped += len(dropped)
            removed["wm_capped"] += toks(dropped)
    wm = live.messages()

    head = list(bands.system) + ([result.summary] if result.summary is not None else [])
    tail = ([bands.current] if bands.current is not None else [])
    size = fixed + toks(head) + toks(history) + toks(tail) + toks(wm)
    history, size = _trim(history, live, size, budget, toks, report, removed)
    wm = live.messages()
    summary = result.summary
    if size > budget.hard_budget and summary is not None:
        # the summary is the last thing to go: better the recent turns without it than a refusal
        size -= toks([summary])
        removed["trimmed"] += toks([summary])
        summary = None

    final = Bands(bands.system, history, bands.current, wm).flatten(summary)
    report.removed = {k: v for k, v in removed.items() if v}
    report.tokens_after = size
    report.turns_kept = sum(1 for m in history if m.get("role") == "user")
    _fits(size, budget)
    check(final)
    changed = len(final) != len(messages) or any(a is not b for a, b in zip(final, messages))
    return Assembly(final, changed or bool(body_changes), report, body_changes, keys, messages)


def _budget(route: ModelRoute, policy: Policy, max_tokens: int | None) -> Budget:
    manager = policy.manager
    budget = compute_budget(
        window=route.window,
        request_max_tokens=max_tokens,
        model_max_output=route.max_output,
        trimmer=policy.trimmer,
        tenant_cap=policy.max_context_tokens,
        hysteresis_ratio=manager.hysteresis_ratio,
        summary_threshold=manager.summary_threshold,
    )
    if policy.budget_cap is not None and policy.budget_cap < budget.hard_budget:
        budget = compute_budget(
            window=route.window, request_max_tokens=max_tokens, model_max_output=route.max_output,
            trimmer=policy.trimmer, tenant_cap=policy.budget_cap,
            hysteresis_ratio=manager.hysteresis_ratio, summary_threshold=manager.summary_threshold,
        )
    return budget


def _trim(
    history: list[Message],
    live: WorkingMemory,
    size: int,
    budget: Budget,
    toks: Any,
    report: Report,
    removed: Counter[str],
) -> tuple[list[Message], int]:
    """Drop the oldest history groups (on the prefix-stable grid), then WM groups but never the last."""
    if size <= budget.hard_budget:
        return history, size
    need = size - budget.hard_budget
    goal = -(-need // budget.step) * budget.step
    groups = tool_groups(history)
    dropped = 0
    cut = 0
    while cut < len(groups) and dropped < goal:
        dropped += toks(groups[cut])
        cut += 1
    if cut:
        report.groups_trimmed += cut
        removed["trimmed"] += dropped
        history = [m for g in groups[cut:] for m in g]
        size -= dropped
    while size > budget.hard_budget and (group := live.drop_next()) is not None:
        n = toks(group)
        size -= n
        removed["trimmed"] += n
        report.wm_rows_dropped += len(group)
    return history, size


class WorkingMemory:
    """Working memory as tool groups, with the one that is never dropped: the live tool round.

    That is the last group with tool calls (else the last group): an assistant
    prefill after it may be dropped, but never the results the model is working on.
    Droppable groups go oldest first, then any group after the live round.
    """

    def __init__(self, wm: list[Message]) -> None:
        self.groups = tool_groups(wm)
        calls = [i for i, g in enumerate(self.groups) if is_call(g[0])]
        self.pinned = calls[-1] if calls else len(self.groups) - 1
        self.kept = set(range(len(self.groups)))

    def pinned_group(self) -> list[Message]:
        return self.groups[self.pinned] if self.groups else []

    def rows(self) -> int:
        return sum(len(self.groups[i]) for i in self.kept)

    def drop_next(self) -> list[Message] | None:
        """Drop the next droppable group and return it (None when only the live round is left)."""
        for i in [*range(self.pinned), *range(self.pinned + 1, len(self.groups))]:
            if i in self.kept:
                self.kept.discard(i)
                return self.groups[i]
        return None

    def messages(self) -> list[Message]:
        return [m for i, g in enumerate(self.groups) if i in self.kept for m in g]


def _fits(size: int, budget: Budget) -> None:
    if size > budget.hard_budget:
        derived = budget.window - budget.reserve - budget.margin
        why = (f"window {budget.window} - completion reserve {budget.reserve} - safety margin {budget.margin}"
               if budget.hard_budget == derived else "the configured token budget or this key's cap")
        raise ContextLengthExceeded(
            f"This request needs {size} input tokens after context management, but the budget is "
            f"{budget.hard_budget} ({why}). The system messages, the current user turn and the last "
            "tool round cannot be dropped; shorten them or lower max_tokens.",
            param="messages",
        )
