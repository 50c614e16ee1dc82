"""Anthropic's Messages API (``POST /v1/messages``; ``/v1/messages/count_tokens`` beside it): the translator.

Errors have Anthropic's shape (``errors``); a stream ends with ``message_stop`` (``stream``).
Usage: ``input_tokens`` is only the uncached part, ``cache_read_input_tokens`` and
``cache_creation_input_tokens`` come on top of it.

Items. An assistant message is one item, and so is a (mid-conversation) ``system`` message (its ``tool_use`` ids are
its calls; its
``thinking``/``redacted_thinking`` blocks stay inside it, byte for byte). A user
message is split: one result item per ``tool_result`` block, then one user item
for its other blocks, if any (a user message whose text comes before its results
is split the other way round, so the neutral repair sees the results displaced
and moves them back: Anthropic requires results first). The top-level ``system``
and ``tools`` are pinned: counted in ``fixed_tokens``, never changed.

Bands. A turn starts at a user item, so the current turn is the last user message
with content other than ``tool_result`` blocks, and the assistant/result exchanges
after it are working memory. With ``thinking`` enabled the first assistant item of
the working memory carries the turn's thinking, which Anthropic requires back while
the tool loop runs: it is pinned.

Render. A message whose items are all kept, unchanged and in order is the client's
own dict; any other is ``{**original, "content": [kept blocks]}`` (results first).
All results that answer one assistant message go into the one user message after it.
"""

from __future__ import annotations

import bisect
import copy
from collections.abc import Mapping
from operator import is_
from typing import Any, NamedTuple

from proxy.core.bands import assign_groups
from proxy.core.conversation import Conversation
from proxy.core.errors import CtxProxyError, OutputLimitExceeded, PayloadError
from proxy.core.items import ASSISTANT, OTHER, SYSTEM, TOOL, UNKEPT, USER, Item, same_prefix
from proxy.core.pairing import PLACEHOLDER, is_paired
from proxy.core.tokens import (
    REPLY_PRIMING,
    TokenCounter,
    content_key,
    output_schema,
    resumed_content_keys,
)
from proxy.core.usage import UsageForm
from proxy.wire.messages.errors import error_body
from proxy.wire.messages.items import SALT, THINKING, AnthropicItem, Block, count_raw
from proxy.wire.messages.shape import check_body
from proxy.wire.messages.stream import STREAM
from proxy.wire.protocol import STANDARD_KEY_HEADERS, model_field_changes, top_level_limits
from proxy.wire.sse import StreamEnd

# what a client may pass to litellm (its Anthropic-messages interface): the API's own request fields (see the
# Chat wire's for why)
LITELLM_FIELDS = frozenset({
    "max_tokens", "messages", "metadata", "stop_sequences", "system", "temperature", "thinking", "tool_choice",
    "tools", "top_k", "top_p", "container", "service_tier", "output_config", "output_format", "mcp_servers",
    "cache_control", "inference_geo", "speed",
})
Message = dict[str, Any]
MIN_THINKING_BUDGET = 1_024  # Anthropic: 1024 <= thinking.budget_tokens < max_tokens


def split_message(message: Message, source: int, *, after_assistant: bool = True) -> list[AnthropicItem]:
    """One message (already shape-checked) as its items.

    ``after_assistant``: the previous message is an assistant message. Results in a user message that
    is not (e.g. split over two user messages) are not where Anthropic wants them, in the message
    right after their call; an empty boundary item before them lets the neutral repair see that
    and move them back (``moved_result``).
    """
    role = message["role"]
    content = message["content"]
    if role == "system":  # a mid-conversation system message (Claude Code's mid-conversation-system beta)
        blocks = None if isinstance(content, str) else content
        return [AnthropicItem(message, SYSTEM, message=message, blocks=blocks, source=source)]
    if role == "assistant":
        if isinstance(content, str):
            return [AnthropicItem(message, ASSISTANT, message=message, blocks=None, source=source)]
        ids = tuple(b["id"] for b in content if b.get("type") == "tool_use")
        return [AnthropicItem(message, ASSISTANT, message=message, blocks=content, call_ids=ids, source=source)]
    if isinstance(content, str) or not any(b.get("type") == "tool_result" for b in content):
        blocks = None if isinstance(content, str) else content
        return [AnthropicItem(message, USER, message=message, blocks=blocks, source=source)]
    results: list[AnthropicItem] = []
    others: list[Block] = []
    text_first = False
    for block in content:
        if block.get("type") == "tool_result":
            results.append(AnthropicItem(block, TOOL, message=message, blocks=[block], result_id=block["tool_use_id"],
                                         source=source))
        else:
            text_first = text_first or not results
            others.append(block)
    items = results
    if not after_assistant:
        # a boundary item: 0 tokens (``count_raw``), no atoms, never rendered
        boundary = AnthropicItem({"role": "user", "content": []}, OTHER, message=message, blocks=[], source=source)
        items = [boundary, *results]
    if others:
        user = AnthropicItem({"role": "user", "content": others}, USER, message=message, blocks=others, source=source)
        # text before the results: the repair will see the results displaced and put them first
        items = [user, *items] if text_first else [*items, user]
    for item in items:
        item.siblings = items
    return items


def render_messages(items: list[Item], sent: list[Any] | None = None) -> list[Message]:
    """The ``messages`` array for ``items``: the client's own dicts wherever a message is kept whole.

    ``sent``: the request's own ``messages``; the items resumed from an earlier request are re-pointed to them first
    (``repoint``). One pass: whether the open run of user-side items holds only results, and which client messages
    it came from, are kept up to date, so a user message with thousands of results renders in linear time.

    A conversation rendered again (a later request that resumed it, ``proxy.core.warm``) renders only from where
    its items differ: its last render is remembered, from its anchor (the first remembered item, one of the first
    ``ANCHORS``: a summary may come before it) on, by the conversation's first item (``AnthropicItem.root``: one
    render per conversation, replaced by the next, so what it holds beyond the items is a few tuples however
    often the anchor moves), and reused up to the last message that begins before the first item that is not the
    very same object, provided the client's messages those reused came from are the very same objects too (then
    re-pointing would change none of their items, and a fresh render gives the same).
    """
    render = _Render(items)
    if type(sent) is not list:
        sent = None
    anchor = -1 if sent is None else next((i for i in range(min(ANCHORS, len(items))) if isinstance(
        item := items[i], AnthropicItem) and item.remembered and item.role != OTHER), -1)
    if sent is None or anchor < 0:
        render.feed(0, len(items), sent)
        return render.finish()
    render.feed(0, anchor, sent)
    first = items[anchor]
    assert isinstance(first, AnthropicItem)
    holder = first.root
    if holder is None or not render.opens(first):  # (an anchor that joins the message before it begins none)
        render.feed(anchor, len(items), sent)
        return render.finish()
    render.close()
    head = len(render.out)
    memo = holder.memo
    restart = anchor
    if memo is not None:
        reused = _reusable(memo, items, anchor, sent)
        if reused:
            render.reuse(memo, reused, anchor)
            restart = anchor + memo.starts[reused] - memo.anchor
    render.feed(restart, len(items), sent)
    out = render.finish()
    if any(map(UNKEPT, items[restart:])):  # a request the warm memory did not keep: not held here either
        return out
    holder.memo = _Memo(items[anchor:], tuple(sent), tuple(out[head:]), anchor, tuple(render.starts[head:]),
                        tuple(render.reach[head:]))
    return out


ANCHORS = 2  # where the first remembered item, from which a render is remembered, may be: first, or after a summary


class _Memo(NamedTuple):
    """A conversation's last render, from its anchor item on (``render_messages``)."""

    items: list[Item]  # the items rendered, from the anchor on (never changed)
    sent: tuple[Any, ...]  # the client's messages they were re-pointed to
    out: tuple[Message, ...]  # the messages rendered from them
    anchor: int  # where the anchor was in that render's items
    starts: tuple[int, ...]  # where each message's items began in that render's items (``anchor`` included)
    reach: tuple[int, ...]  # with each message, 1 + the highest client message index it and those before came from


def _reusable(memo: _Memo, items: list[Item], anchor: int, sent: list[Any]) -> int:
    """How many of ``memo``'s messages this render reuses (``render_messages``)."""
    common = same_prefix(items[anchor:], memo.items)
    # the messages that begin before the first different item, but the last (items after it may join it)
    reused = max(0, bisect.bisect_left(memo.starts, memo.anchor + common) - 1)
    if reused == 0:
        return 0
    reach = memo.reach[reused - 1]
    if len(sent) < reach or not all(map(is_, memo.sent[:reach], sent[:reach])):
        return 0
    return reused


class _Render:
    """The messages of a list of items, rendered in one pass (``render_messages``)."""

    def __init__(self, items: list[Item]) -> None:
        self.items = items
        self.out: list[Message] = []
        self.starts: list[int] = []  # where each message's items begin
        self.reach: list[int] = []  # with each message, 1 + the highest client message index up to it
        self.high = 0
        self.run: list[AnthropicItem] = []  # user-side items gathered into one user message
        self.run_start = 0
        self.only_results = True  # every item of the run is a result
        self.sources: set[int] = set()  # the client messages the run's items came from

    def feed(self, start: int, stop: int, sent: list[Any] | None = None) -> None:
        """Render ``items[start:stop]`` (re-pointed to ``sent`` first, when given)."""
        items = self.items
        if sent is not None and start < stop:
            repoint(items[start:stop], sent)
        out = self.out
        for i in range(start, stop):
            item = items[i]
            role = item.role
            if role == OTHER:
                continue  # a boundary: nothing to send
            if role != USER and role != TOOL:
                # an assistant or system message: always a message of its own
                if self.run:
                    self._flush()
                self.high = max(self.high, item.source + 1)
                out.append(item.raw)
                self.starts.append(i)
                self.reach.append(self.high)
                continue
            if self.run and not self._joins(item):
                self._flush()
            if not self.run:
                self.run_start = i
            self.run.append(item)  # type: ignore[arg-type]
            self.only_results = self.only_results and role == TOOL
            self.sources.add(item.source)
            self.high = max(self.high, item.source + 1)

    def _joins(self, item: Item) -> bool:
        return self.only_results if item.role == TOOL else item.source >= 0 and item.source in self.sources

    def opens(self, item: Item) -> bool:
        """Whether ``item`` begins a message of its own after what was fed (it does not join the open run)."""
        return not self.run or item.role not in (USER, TOOL) or not self._joins(item)

    def reuse(self, memo: _Memo, count: int, anchor: int) -> None:
        """Append the first ``count`` messages of an earlier render (``memo``) of the items from ``anchor`` on."""
        self.out.extend(memo.out[:count])
        shift = anchor - memo.anchor  # (none when the anchor is where it was: the starts are taken as they are)
        self.starts.extend([shift + start for start in memo.starts[:count]] if shift else memo.starts[:count])
        self.reach.extend(memo.reach[:count])
        self.high = max(self.high, memo.reach[count - 1])

    def close(self) -> None:
        """End the open run's message."""
        if self.run:
            self._flush()

    def _flush(self) -> None:
        self.out.append(_user_message(self.run))
        self.starts.append(self.run_start)
        self.reach.append(self.high)
        self.run, self.only_results, self.sources = [], True, set()

    def finish(self) -> list[Message]:
        self.close()
        return self.out


def _user_message(run: list[AnthropicItem]) -> Message:
    """The user message of a run of user-side items: the client's own when the run is its message's items, else
    one made of their contents (remembered with the run's first item: a later request that resumed the
    conversation renders the same run of the same objects, masked copies included, without making it again; the
    message it made is never changed)."""
    first = run[0]
    siblings = first.siblings
    if first.message is not None and len(siblings) == len(run) and all(map(is_, siblings, run)):
        return first.message
    base = next((r.message for r in run if r.message is not None), None)
    contents = [item.content() for item in run]
    made = first.rendered
    if made is not None and made[1] is base and len(made[0]) == len(run) and all(map(is_, made[0], run)) \
            and all(map(is_, made[2], contents)):
        return made[3]
    blocks: list[Any] = []
    for content in contents:
        if isinstance(content, str):
            blocks.append({"type": "text", "text": content})
        elif isinstance(content, list):
            blocks.extend(content)
    message = {**(base or {"role": "user"}), "content": blocks}
    first.rendered = (tuple(run), base, contents, message)
    return message


def system_tokens(counter: TokenCounter, system: Any) -> int:
    if not system:
        return 0
    return counter.cached(content_key(system) ^ SALT, {"role": "system", "content": system}, count_raw)


def thinking_enabled(body: dict[str, Any]) -> bool:
    thinking = body.get("thinking")
    return isinstance(thinking, dict) and thinking.get("type") in ("enabled", "adaptive")


def _split(messages: list[Message], start: int, counter: TokenCounter, stop: int | None = None,
           message_keys: list[int] | None = None) -> list[AnthropicItem]:
    """The items of ``messages[start:stop]`` (shape-checked), keyed and counted; an item that is its whole message
    takes that message's content key from ``message_keys`` when given (the same key: made once)."""
    items: list[AnthropicItem] = []
    previous = messages[start - 1]["role"] if start > 0 else None
    for i in range(start, len(messages) if stop is None else stop):
        message = messages[i]
        items.extend(split_message(message, i, after_assistant=previous == "assistant"))
        previous = message["role"]
    raws = [item.raw for item in items]
    if message_keys is None:
        keys = [content_key(raw) ^ SALT for raw in raws]
    else:
        keys = [message_keys[item.source] if item.raw is item.message else content_key(item.raw) ^ SALT
                for item in items]
    for item, key, n in zip(items, keys, counter.many(keys, raws, count_raw)):
        item.key, item.tokens = key, n
    return items


def repoint(items: list[Item], messages: list[Any]) -> None:
    """Give the items a request resumed from an earlier one (``MessagesWire.resume``) this request's JSON for their
    messages (equal byte for byte: their keys are equal), so that what is rendered is the client's own objects, as
    on the full path. Done when rendering, for the items kept: a request forwarded as sent never pays for it."""
    n = len(messages)
    for item in items:
        if not isinstance(item, AnthropicItem) or not item.remembered or not 0 <= item.source < n:
            continue
        message = messages[item.source]
        if item.message is message or type(message) is not dict:
            continue
        content = message["content"]
        if item.raw is item.message:  # a whole message (or the pinned copy of one)
            item.raw = item.message = message
            item.blocks = None if type(content) is str else content
            continue
        item.message = message  # a block item (or a masked copy of one): its message's other items too
        results = iter([b for b in content if b.get("type") == "tool_result"])
        others = [b for b in content if b.get("type") != "tool_result"]
        for sibling in item.siblings:
            sibling.message = message
            if sibling.role == TOOL:
                sibling.raw = next(results)
                sibling.blocks = [sibling.raw]
            elif sibling.role == USER:
                sibling.raw = {"role": "user", "content": others}
                sibling.blocks = others


def _fixed(body: dict[str, Any], counter: TokenCounter) -> int:
    """What a request counts outside its messages: reply priming, the system prompt and the schemas."""
    config = body.get("output_config")
    return (REPLY_PRIMING + system_tokens(counter, body.get("system")) + counter.tools(body.get("tools"))
            + counter.tools(output_schema(body.get("output_format")), "output_format")
            + counter.tools(output_schema(config.get("format") if isinstance(config, dict) else None),
                            "output_config.format"))


def _pinned(items: list[Item]) -> list[Item]:
    """``items`` with the turn's thinking pinned (``pin_turn_thinking``) on a copy of the item it pins."""
    for i in range(len(items) - 1, -1, -1):
        if items[i].role == USER:
            break
    else:
        i = -1
    for j in range(i + 1, len(items)):
        if items[j].role == ASSISTANT:
            pinned = copy.copy(items[j])
            pinned.pinned = True
            return [*items[:j], pinned, *items[j + 1:]]
    return items


def pin_turn_thinking(items: list[AnthropicItem]) -> None:
    """Pin the working memory's first assistant item: it carries the thinking of the turn in progress."""
    start = 0
    for i in range(len(items) - 1, -1, -1):
        if items[i].role == USER:
            start = i + 1
            break
    for item in items[start:]:
        if item.role == ASSISTANT:
            item.pinned = True
            return


def fit_thinking(out: dict[str, Any], changes: dict[str, Any]) -> None:
    """Keep ``thinking.budget_tokens`` below a ``max_tokens`` the proxy lowered (a tenant's output cap).

    Anthropic refuses a budget that is not below max_tokens: the budget shrinks with the cap (thinking
    is output, so the cap limits it too), and a cap that leaves no room for the smallest budget is refused
    here rather than forwarded to fail. A client's own max_tokens is never second-guessed.
    """
    cap = changes.get("max_tokens")
    thinking = out.get("thinking")
    if not isinstance(cap, int) or not isinstance(thinking, dict) or thinking.get("type") != "enabled":
        return
    budget = thinking.get("budget_tokens")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < cap:
        return
    if cap <= MIN_THINKING_BUDGET:
        raise OutputLimitExceeded(
            f"max_tokens is capped at {cap} for this key, which leaves no room for thinking: "
            f"thinking.budget_tokens must be at least {MIN_THINKING_BUDGET} and less than max_tokens",
            param="thinking.budget_tokens")
    out["thinking"] = {**thinking, "budget_tokens": cap - 1}


class MessagesWire:
    """The Messages adapter (stateless; one shared instance)."""

    name = "messages"
    field = "messages"
    merge_call_runs = False
    output_fields: tuple[str, ...] = ("max_tokens",)
    choices_field: str | None = None
    paths: tuple[str, ...] = ("/messages",)
    endpoints: Mapping[str, str] = {"/messages/count_tokens": "count_tokens"}
    key_headers: tuple[str, ...] = STANDARD_KEY_HEADERS
    model_param = "model"
    interpreted_fields = frozenset({"model", "messages", "system", "tools", "tool_choice", "stream", "max_tokens",
                                    "thinking", "context_management"})
    litellm_fields: frozenset[str] | None = LITELLM_FIELDS
    # ``input_tokens`` counts only the uncached part: cache reads and writes come on top of it
    usage_form = UsageForm("input_tokens", ("cache_read_input_tokens",), ("cache_creation_input_tokens",),
                           "output_tokens", additive=True, marker="input_tokens")
    stream_end: StreamEnd = STREAM

    def parse(self, body: dict[str, Any], counter: TokenCounter) -> Conversation:
        check_body(body)
        items = _split(body["messages"], 0, counter)
        if thinking_enabled(body):
            pin_turn_thinking(items)
        neutral: list[Item] = list(items)
        return Conversation(neutral, _fixed(body, counter), is_paired(neutral))

    def resume(self, body: dict[str, Any], counter: TokenCounter, tenant: str) -> Conversation:
        """``parse``, reusing the items of the longest prefix of ``messages`` that ``tenant`` sent before in this
        conversation (``proxy.core.warm``): only the messages after it are checked, split, keyed, counted and
        grouped. The remembered items are never changed: the turn's thinking is pinned on a copy."""
        messages = body.get("messages")
        if type(messages) is not list or len(messages) < 2:
            return self.parse(body, counter)
        sized = resumed_content_keys(counter.conversations, tenant, self.name, messages, SALT)
        if sized is None:  # an element nested too deeply: the full parse refuses it as a cold request is refused
            return self.parse(body, counter)
        keys, size, _ = sized  # (the known items are re-pointed when rendered)
        memory = counter.conversations
        known = memory.find(tenant, self.name, keys)
        start = len(known.keys) if known is not None else 0
        marks = check_body(body, start, known.extra if known is not None else 0)
        split = _split(messages, start, counter, message_keys=keys)
        tail: list[Item] = list(split)
        # a known prefix is paired with no call waiting at its end: the pairing of the whole is the tail's
        if not is_paired(tail):  # a repair to make: items of this request's own (checked already), none kept
            own: list[Item] = [*_split(messages, 0, counter, stop=start, message_keys=keys), *tail]
            if thinking_enabled(body):
                pin_turn_thinking(own)  # type: ignore[arg-type]
            return Conversation(own, _fixed(body, counter), False)
        items = [*known.items, *tail] if known is not None else tail  # the known ones re-pointed when rendered
        tokens = known.tokens_with(tail) if known is not None else sum([item.tokens for item in tail])
        assign_groups(items, self.merge_call_runs, len(known.items) if known is not None else 0)
        memory.keep(tenant, self.name, keys, items[:], size, marks, tuple(messages), new=tail,
                    tokens=tokens)  # (a copy: the request may change its own list)
        root = items[0] if isinstance(items[0], AnthropicItem) else None
        for new in split:
            new.remembered = True
            new.root = root
        if thinking_enabled(body):
            items = _pinned(items)  # (a copy of one item, pinned: the same tokens)
        return Conversation(items, _fixed(body, counter), True, grouped=len(items), tokens=tokens)

    def render(self, body: dict[str, Any], items: list[Item], changes: dict[str, Any]) -> dict[str, Any]:
        messages = render_messages(items, body.get("messages"))
        if not messages:
            # only boundary items were left (stray results in user messages that follow no assistant message):
            # the pipeline's own emptiness check counts them as items, and ``messages: []`` is no request
            raise PayloadError("nothing is left of 'messages' after the pairing repair (every block was a "
                               "tool_result without its tool_use)", param="messages", code="empty_after_repair")
        out = dict(body)
        out["messages"] = messages
        out.update(changes)
        fit_thinking(out, changes)
        return out

    def count(self, item: Item, counter: TokenCounter) -> None:
        item.key = content_key(item.raw) ^ SALT
        item.tokens = counter.cached(item.key, item.raw, count_raw)

    def summary(self, text: str, covered_turns: int, counter: TokenCounter) -> Item:
        # a user message with one text block at the start of ``messages``: nothing before ``messages``
        # (tools, system) changes, so their prompt cache survives a compaction (docs/wires.md#the-messages-wire)
        raw: Message = {"role": "user", "content": [{"type": "text", "text": text}]}
        item = AnthropicItem(raw, USER, message=raw, blocks=raw["content"])
        self.count(item, counter)
        return item

    def without_calls(self, item: Item) -> Item | None:
        assert isinstance(item, AnthropicItem)
        content = item.content()
        if not isinstance(content, list):
            return item
        kept = [b for b in content if b.get("type") != "tool_use"]
        if not any(b.get("type") not in THINKING for b in kept):
            return None  # only thinking (or nothing) is left: the message goes
        raw = {**item.raw, "content": kept}
        return AnthropicItem(raw, ASSISTANT, message=raw, blocks=kept, source=item.source)

    def placeholder(self, call: Item, call_id: str) -> Item | None:
        block: Block = {"type": "tool_result", "tool_use_id": call_id, "content": PLACEHOLDER, "is_error": True}
        return AnthropicItem(block, TOOL, message=None, blocks=[block], result_id=call_id)

    def mask(self, item: Item, text: str, counter: TokenCounter) -> Item | None:
        masked = mask_result(item, text)
        if masked is not None:
            self.count(masked, counter)
        return masked

    def output_field(self, upstream_model: str) -> str:
        return "max_tokens"

    def model_of(self, body: dict[str, Any], params: Mapping[str, str]) -> Any:
        return body.get("model")

    def model_changes(self, body: dict[str, Any], upstream_model: str) -> dict[str, Any]:
        return model_field_changes(body, upstream_model)

    def upstream_path(self, upstream_model: str) -> str:
        return "/messages"

    def output_limits(self, body: dict[str, Any]) -> dict[str, Any]:
        return top_level_limits(body, self.output_fields)

    def error_body(self, error: CtxProxyError) -> dict[str, Any]:
        return error_body(error)

    def sniff(self, body: dict[str, Any]) -> int:
        return 0  # a Messages body looks like a Chat one: it is named (``/messages``, ``?wire=messages``)


WIRE = MessagesWire()


def mask_result(item: Item, text: str) -> Item | None:
    """A ``tool_result`` block with ``text`` as its content (observation masking).

    ``tool_use_id``, ``is_error``, ``cache_control`` and any other key stay; the text, images and
    documents inside go. The masked block keeps its place in the client's user message, which
    ``render`` then writes anew (the message is no longer the client's own).
    """
    if not isinstance(item, AnthropicItem) or item.role != TOOL or not isinstance(item.raw, dict):
        return None
    block: Block = {**item.raw, "content": text}
    masked = AnthropicItem(block, TOOL, message=item.message, blocks=[block], result_id=item.result_id,
                           source=item.source)
    masked.siblings = item.siblings  # not among them: the client's message is not rendered as it was sent
    return masked
