"""The Responses API (``POST /v1/responses``; ``/v1/responses/compact`` beside it): the translator.

``input`` (a string: one user turn; or a list of input items) becomes neutral items
(``items``): leading ``system``/``developer`` messages are the
system band, a ``user`` message starts a turn, call and output items pair by their
ids, and a ``reasoning`` item travels with the item after it. ``instructions`` and
``tools`` are pinned and counted in the fixed tokens. The provider's last
``compaction`` item (and ctxproxy's own compaction summary) is pinned: the items
before it may go, never it. Kept items are rendered from the client's own JSON, in
order; the only items ctxproxy writes are a summary (a ``message``) and
placeholder outputs.

A request that continues state held by the provider (``previous_response_id``,
``conversation``, or ``item_reference`` items) carries history the proxy cannot see:
it is marked unmanaged and forwarded as sent, output caps, model rules and the
tenant's context cap (on the visible part) aside.
Errors have OpenAI's shape; a stream ends with ``response.completed`` /
``response.failed`` / ``response.incomplete`` (``stream``). Usage: ``input_tokens`` includes
the cached ``input_tokens_details.cached_tokens``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from proxy.core.bands import assign_groups
from proxy.core.conversation import Conversation
from proxy.core.errors import CtxProxyError, PayloadError
from proxy.core.items import ASSISTANT, OTHER, SYSTEM, TOOL, USER, Item
from proxy.core.pairing import PLACEHOLDER, REASONING_DROPPED
from proxy.core.tokens import (
    REPLY_PRIMING,
    TokenCounter,
    content_key,
    output_schema,
    resumed_content_keys,
)
from proxy.core.usage import UsageForm
from proxy.wire.protocol import STANDARD_KEY_HEADERS, model_field_changes, top_level_limits
from proxy.wire.responses.errors import error_body
from proxy.wire.responses.items import (
    COMPACT_PREFIX,
    ITEM_TOKENS,
    MESSAGE_ROLES,
    PINNED_TYPES,
    RESERVED,
    ResponsesItem,
    count_raw,
    kind_of,
    neutral,
    unkey,
)
from proxy.wire.responses.shape import STRING_OUTPUTS, check_element, input_elements
from proxy.wire.responses.stream import STREAM
from proxy.wire.sse import StreamEnd

SALT = 0x2  # content keys of Responses items, distinct from other wires' formulas in the shared LRU
PROVIDER_STATE = ("previous_response_id", "conversation")
# what a client may pass to litellm (``aresponses``): the API's own request fields (see the Chat wire's for why)
LITELLM_FIELDS = frozenset({
    "input", "include", "instructions", "max_output_tokens", "prompt", "parallel_tool_calls",
    "previous_response_id", "reasoning", "store", "background", "temperature", "text", "tool_choice", "tools",
    "top_p", "truncation", "user", "service_tier", "safety_identifier", "conversation", "max_tool_calls",
    "prompt_cache_key", "prompt_cache_retention", "stream_options", "top_logprobs", "metadata",
    "context_management", "partial_images",
})
# outputs ctxproxy can write for a call that got none (the others cannot be faked: the call is removed)
PLACEHOLDERS: dict[str, dict[str, Any]] = {
    "function_call": {"type": "function_call_output", "call_id": "", "output": PLACEHOLDER},
    "custom_tool_call": {"type": "custom_tool_call_output", "call_id": "", "output": PLACEHOLDER},
    # a local shell call is answered the way Codex answers it (a function_call_output by call_id)
    "local_shell_call": {"type": "function_call_output", "call_id": "", "output": PLACEHOLDER},
    "apply_patch_call": {"type": "apply_patch_call_output", "call_id": "", "status": "failed",
                         "output": PLACEHOLDER},
}
# outputs observation masking may replace by a text (the others are screenshots, tool lists, approvals …)
TEXT_OUTPUTS = frozenset({*STRING_OUTPUTS, "apply_patch_call_output"})
# the type of an item's ``raw`` when it is one input element as the client sent it (``render``'s fast path)
ONLY_ELEMENTS = frozenset({dict})


class ResponsesWire:
    """The Responses adapter (stateless; one shared instance)."""

    name = "responses"
    field = "input"
    merge_call_runs = True  # parallel calls are consecutive call items; their outputs follow the run
    output_fields: tuple[str, ...] = ("max_output_tokens",)
    choices_field: str | None = None
    paths: tuple[str, ...] = ("/responses",)
    endpoints: Mapping[str, str] = {"/responses/compact": "compact"}
    key_headers: tuple[str, ...] = STANDARD_KEY_HEADERS
    model_param = "model"
    interpreted_fields = frozenset({"model", "input", "instructions", "tools", "tool_choice", "stream",
                                    "max_output_tokens", "text", "previous_response_id", "conversation", "prompt",
                                    "context_management"})
    litellm_fields: frozenset[str] | None = LITELLM_FIELDS
    usage_form = UsageForm("input_tokens", ("input_tokens_details", "cached_tokens"), (), "output_tokens",
                           marker="input_tokens_details")
    stream_end: StreamEnd = STREAM

    def parse(self, body: dict[str, Any], counter: TokenCounter) -> Conversation:
        notes: list[str] = []
        unmanaged = provider_state(body)
        if unmanaged is not None:
            notes.append(f"{unmanaged}: the earlier conversation is held by the provider, which ctxproxy cannot see "
                         "or count; this request is forwarded without context management")
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise PayloadError("'instructions' must be a string", param="instructions", code="invalid_instructions")
        items, dropped, references, paired = build_items(body.get("input"), keep_trailing=unmanaged is not None)
        if references and unmanaged is None:
            unmanaged = "item_reference"
            notes.append("input refers to items held by the provider (item_reference), which ctxproxy cannot see "
                         "or count; this request is forwarded without context management")
        keys = [content_key(item.raw) ^ SALT for item in items]
        counts = counter.many(keys, [item.raw for item in items], count_raw)
        for item, key, n in zip(items, keys, counts):
            item.key, item.tokens = key, n
        fixed = _fixed(body, counter)
        if unmanaged is not None:
            return Conversation(items, fixed, True, notes, unmanaged=unmanaged)
        repairs: Counter[str] = Counter({REASONING_DROPPED: dropped}) if dropped else Counter()
        return Conversation(items, fixed, paired, notes, repairs=repairs)

    def resume(self, body: dict[str, Any], counter: TokenCounter, tenant: str) -> Conversation:
        """``parse``, reusing the items of the longest prefix of ``input`` that ``tenant`` sent before in this
        conversation (``proxy.core.warm``): only the elements after it are checked, keyed, counted and grouped."""
        value = body.get("input")
        instructions = body.get("instructions")
        if type(value) is not list or len(value) < 2 or provider_state(body) is not None \
                or not (instructions is None or isinstance(instructions, str)):
            return self.parse(body, counter)
        # an element's key is its item's when no reasoning is attached to it
        sized = resumed_content_keys(counter.conversations, tenant, self.name, value, SALT)
        if sized is None:  # an element nested too deeply: the full parse refuses it as a cold request is refused
            return self.parse(body, counter)
        keys, size, same = sized
        memory = counter.conversations
        known = memory.find(tenant, self.name, keys)
        start = len(known.keys) if known is not None else 0
        if known is not None and any(type(e) is dict and (e.get("type") == "compaction" or is_compact_summary(e))
                                     for e in value[start:]):
            return self.parse(body, counter)  # a later compaction unpins the earlier one: items of its own
        tail, dropped, references, paired = build_items(value, start=start)
        if not paired or dropped or references:  # a repair, an unmanaged history: items of its own, none kept
            return self.parse(body, counter)
        tail_keys = [keys[item.source] if type(item.raw) is dict else content_key(item.raw) ^ SALT for item in tail]
        for item, key, n in zip(tail, tail_keys, counter.many(tail_keys, [item.raw for item in tail], count_raw)):
            item.key, item.tokens = key, n
        if known is not None and known is not same:  # (else its items hold this request's elements already)
            for item in known.items:  # each its own elements' JSON (the same bytes)
                raw = item.raw
                item.raw = value[item.source] if type(raw) is not list \
                    else value[item.source - len(raw) + 1:item.source + 1]
        items = known.items + tail if known is not None else tail
        tokens = known.tokens_with(tail) if known is not None else sum([item.tokens for item in tail])
        assign_groups(items, self.merge_call_runs, len(known.items) if known is not None else 0)
        memory.keep(tenant, self.name, keys, items[:], size, elements=tuple(value), new=tail,
                    tokens=tokens)  # (a copy: the request may change its own list)
        return Conversation(items, _fixed(body, counter), True, grouped=len(items), tokens=tokens)

    def render(self, body: dict[str, Any], items: list[Item], changes: dict[str, Any]) -> dict[str, Any]:
        out = dict(body)
        source = body.get("input")
        if not (isinstance(source, str) and len(items) == 1 and items[0].raw is source) \
                and not (source is None and not items):
            rendered: list[Any] = [item.raw for item in items]  # the usual case: each one element of the client's
            if not ONLY_ELEMENTS.issuperset(map(type, rendered)):  # (a C pass, stopping at the first other type)
                rendered = []
                for item in items:
                    raw = item.raw
                    if isinstance(raw, list):
                        rendered.extend(raw)
                    elif isinstance(raw, str):
                        rendered.append({"role": "user", "content": raw})
                    else:
                        rendered.append(raw)
            out["input"] = rendered
        out.update(changes)
        return out

    def count(self, item: Item, counter: TokenCounter) -> None:
        item.key = content_key(item.raw) ^ SALT
        item.tokens = counter.cached(item.key, item.raw, count_raw)

    def summary(self, text: str, covered_turns: int, counter: TokenCounter) -> Item:
        item = ResponsesItem({"type": "message", "role": "system", "content": text}, SYSTEM)
        self.count(item, counter)
        return item

    def without_calls(self, item: Item) -> Item | None:
        return None  # a call item is nothing but its call (and the reasoning that led to it goes with it)

    def placeholder(self, call: Item, call_id: str) -> Item | None:
        _, ident = unkey(call_id)
        kind = kind_of(call.main) if isinstance(call, ResponsesItem) else ""
        template = PLACEHOLDERS.get(kind)
        if template is None:
            return None  # a screenshot, shell outcome, approval or program result cannot be made up
        raw = dict(template)
        raw["call_id"] = ident
        return ResponsesItem(raw, TOOL, result_id=call_id, source=call.source)

    def mask(self, item: Item, text: str, counter: TokenCounter) -> Item | None:
        masked = mask_output(item, text)
        if masked is not None:
            self.count(masked, counter)
        return masked

    def output_field(self, upstream_model: str) -> str:
        return "max_output_tokens"

    def model_of(self, body: dict[str, Any], params: Mapping[str, str]) -> Any:
        return body.get("model")

    def model_changes(self, body: dict[str, Any], upstream_model: str) -> dict[str, Any]:
        return model_field_changes(body, upstream_model)

    def upstream_path(self, upstream_model: str) -> str:
        return "/responses"

    def output_limits(self, body: dict[str, Any]) -> dict[str, Any]:
        return top_level_limits(body, self.output_fields)

    def error_body(self, error: CtxProxyError) -> dict[str, Any]:
        return error_body(error)

    def sniff(self, body: dict[str, Any]) -> int:
        return 2 if "input" in body and "messages" not in body else 0


WIRE = ResponsesWire()


def mask_output(item: Item, text: str) -> Item | None:
    """An output item with ``text`` as its output (observation masking); None for outputs that cannot be text.

    ``call_id``, ``status`` and every other key are kept, and so are reasoning items that travel with
    it. A ``shell_call_output`` keeps one chunk: ``text`` as its stdout, with the last chunk's outcome
    (the exit code). Screenshots (``computer_call_output``), tool lists, program outputs and MCP
    approvals are never masked.
    """
    if not isinstance(item, ResponsesItem) or item.result_id is None:
        return None
    element = item.main
    kind = kind_of(element)
    if kind in TEXT_OUTPUTS:
        masked: dict[str, Any] = {**element, "output": text}
    elif kind == "shell_call_output":
        chunks = element.get("output")
        last = chunks[-1] if isinstance(chunks, list) and chunks else None
        outcome = last.get("outcome") if isinstance(last, dict) else None
        if not isinstance(outcome, dict):
            return None
        masked = {**element, "output": [{"stdout": text, "stderr": "", "outcome": outcome}]}
    else:
        return None
    raw = [*item.raw[:-1], masked] if isinstance(item.raw, list) else masked
    return ResponsesItem(raw, TOOL, result_id=item.result_id, source=item.source)


def provider_state(body: dict[str, Any]) -> str | None:
    """The field through which the provider holds part of the conversation, if any."""
    for field in PROVIDER_STATE:
        value = body.get(field)
        if value is not None and value != "":
            return field
    return None


def _fixed(body: dict[str, Any], counter: TokenCounter) -> int:
    """What a request counts outside its input items: reply priming, tool and output schemas, instructions."""
    options = body.get("text")
    fixed = REPLY_PRIMING + counter.tools(body.get("tools")) + counter.tools(
        output_schema(options.get("format") if isinstance(options, dict) else None), "text.format")
    instructions = body.get("instructions")
    if instructions:
        fixed += ITEM_TOKENS + counter.text(instructions)
    return fixed


def build_items(value: Any, *, keep_trailing: bool = False, start: int = 0) -> tuple[list[Item], int, int, bool]:
    """Neutral items of ``input``, checked: (items, trailing reasoning items dropped, item references, paired).

    A string is one user message. Reasoning items join the item after them; the last
    ``compaction`` (or ctxproxy compaction summary) and items that change later items'
    meaning are pinned. ``paired`` is the pairing check's verdict, found in the same pass
    (``proxy.core.pairing.check`` with merged call runs), so a valid request costs one scan.
    ``start``: only the elements from it on, after a prefix that was paired with no call open and no
    reasoning waiting (``proxy.core.warm``); ``paired`` then holds for the whole list.
    """
    if isinstance(value, str):
        return [ResponsesItem(value, USER, source=0)], 0, 0, True
    elements = input_elements(value)
    items: list[Item] = []
    pending: list[Any] = []
    references = 0
    last_compaction = -1
    open_calls: set[str] | None = None  # the ids of the open run of calls still awaiting outputs
    taking_calls = False
    paired = True
    calls: tuple[str, ...]
    result: str | None
    for i in range(start, len(elements)):
        element = elements[i]
        # the common items take a few dict lookups; anything unusual gets the precise checks
        # (``id[:1] > RESERVED``: a non-empty id that does not start with NUL, which check_element refuses)
        kind = element.get("type") if type(element) is dict else None
        if kind is None and type(element) is dict and "role" in element and "type" not in element:
            kind = "message"
        if kind == "message" and type(element.get("role")) is str and element["role"] in MESSAGE_ROLES \
                and type(element.get("content")) is str:
            role, calls, result = MESSAGE_ROLES[element["role"]], (), None
        elif kind == "function_call" and type(element.get("call_id")) is str and element["call_id"][:1] > RESERVED \
                and type(element.get("name")) is str and element["name"] and type(element.get("arguments")) is str:
            role, calls, result = ASSISTANT, (element["call_id"],), None
        elif kind == "function_call_output" and type(element.get("call_id")) is str \
                and element["call_id"][:1] > RESERVED and type(element.get("output")) is str:
            role, calls, result = TOOL, (), element["call_id"]
        else:
            kind = check_element(element, i)
            if kind == "reasoning":
                pending.append(element)
                continue
            role, calls, result = neutral(element, kind)
        item = ResponsesItem([*pending, element] if pending else element, role, call_ids=calls, result_id=result,
                             source=i)
        pending = []
        if result is not None:
            if open_calls is None or result not in open_calls:
                paired = False
            else:
                open_calls.discard(result)
            taking_calls = False
        elif calls:
            if taking_calls and open_calls is not None:
                if calls[0] in open_calls:
                    paired = False  # the same id twice in one run: the pairing check names it
                open_calls.add(calls[0])
            else:
                if open_calls:
                    paired = False
                open_calls, taking_calls = {calls[0]}, True
        else:
            if open_calls:
                paired = False
            open_calls, taking_calls = None, False
            if kind == "compaction" or (kind == "message" and is_compact_summary(element)):
                last_compaction = len(items)
            elif kind in PINNED_TYPES:
                item.pinned = True
            references += kind == "item_reference"
        items.append(item)
    if open_calls:
        paired = False
    if last_compaction >= 0:
        items[last_compaction].pinned = True
    dropped = len(pending)
    if pending and keep_trailing:
        items.append(ResponsesItem(pending, OTHER, source=len(elements) - len(pending)))
        dropped = 0
    return items, dropped, references, paired


def is_compact_summary(element: dict[str, Any]) -> bool:
    """ctxproxy's own compaction summary (``/responses/compact`` answered by ctxproxy), carried back as input."""
    if element.get("role") != "user":
        return False
    content = element.get("content")
    if isinstance(content, list) and content and isinstance(content[0], dict):
        content = content[0].get("text")
    return isinstance(content, str) and content.startswith(COMPACT_PREFIX)


def items_of(value: Any, counter: TokenCounter | None = None) -> list[Item]:
    """Input items as neutral items (counted when a counter is given): for tests and tools."""
    items, _, _, _ = build_items(value)
    if counter is not None:
        for item in items:
            WIRE.count(item, counter)
    return items
