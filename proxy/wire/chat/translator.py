"""Chat Completions (``POST /v1/chat/completions``): the translator.

Every message is one item (``items``), checked by one fast scan (``shape``); kept
messages are rendered from the client's own JSON. The model is the body's ``model``,
the output caps ``max_completion_tokens`` / ``max_tokens``, the key a Bearer token
(or ``x-api-key`` / ``api-key``). Errors and stream events have OpenAI's shape; a
stream ends with ``data: [DONE]`` (``stream``). Usage: ``prompt_tokens`` includes the
cached ``prompt_tokens_details.cached_tokens`` (litellm adds Anthropic's
``cache_creation_input_tokens``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from proxy.core.bands import assign_groups
from proxy.core.conversation import Conversation
from proxy.core.errors import CtxProxyError
from proxy.core.items import ASSISTANT, SYSTEM, TOOL, Item
from proxy.core.pairing import PLACEHOLDER, is_paired
from proxy.core.tokens import (
    REPLY_PRIMING,
    TokenCounter,
    content_key,
    content_keys,
    output_schema,
    resumed_content_keys,
)
from proxy.core.usage import UsageForm
from proxy.wire.chat.errors import error_body
from proxy.wire.chat.items import LEGACY, SALT, ChatItem, Message, build_items, count_message
from proxy.wire.chat.shape import fast_scan
from proxy.wire.chat.stream import STREAM
from proxy.wire.protocol import STANDARD_KEY_HEADERS, model_field_changes, top_level_limits
from proxy.wire.sse import StreamEnd

COMPLETION_ONLY = ("o1", "o3", "o4", "gpt-5")  # models that accept only max_completion_tokens
# What a client may pass to litellm: the provider API's own request fields. Everything else is dropped, because
# litellm reads many more keyword arguments as its own (api_base, base_url, api_key, extra_headers,
# mock_response, fallbacks, callbacks, timeout …): from a client's body they would send the operator's key to a
# host of the client's choosing, lift the tenant's caps or bypass the model routes.
LITELLM_FIELDS = frozenset({
    "messages", "functions", "function_call", "temperature", "top_p", "n", "stream_options", "stop",
    "max_tokens", "max_completion_tokens", "modalities", "prediction", "audio", "presence_penalty",
    "frequency_penalty", "logit_bias", "user", "response_format", "seed", "tools", "tool_choice",
    "parallel_tool_calls", "logprobs", "top_logprobs", "reasoning_effort", "verbosity", "safety_identifier",
    "service_tier", "store", "prompt_cache_key", "prompt_cache_retention", "thinking", "web_search_options",
})


class ChatWire:
    """The Chat Completions translator (stateless; one shared instance)."""

    name = "chat"
    field = "messages"
    merge_call_runs = False
    output_fields: tuple[str, ...] = ("max_completion_tokens", "max_tokens")
    choices_field: str | None = "n"
    paths: tuple[str, ...] = ("/chat/completions",)
    endpoints: Mapping[str, str] = {}
    key_headers: tuple[str, ...] = STANDARD_KEY_HEADERS
    model_param = "model"
    interpreted_fields = frozenset({"model", "messages", "tools", "functions", "tool_choice", "stream", "n",
                                    "max_tokens", "max_completion_tokens", "response_format"})
    litellm_fields: frozenset[str] | None = LITELLM_FIELDS
    usage_form = UsageForm("prompt_tokens", ("prompt_tokens_details", "cached_tokens"),
                           ("cache_creation_input_tokens",), "completion_tokens", marker="prompt_tokens")
    stream_end: StreamEnd = STREAM

    def parse(self, body: dict[str, Any], counter: TokenCounter) -> Conversation:
        messages = body.get("messages")
        scanned = fast_scan(messages)
        assert isinstance(messages, list)
        keys = content_keys(messages, SALT)
        items = build_items(messages, keys, counter.many(keys, messages, count_message))
        return Conversation(items, _fixed(body, counter), is_paired(items) if scanned is None else scanned)

    def resume(self, body: dict[str, Any], counter: TokenCounter, tenant: str) -> Conversation:
        """``parse``, reusing the items of the longest prefix of ``messages`` that ``tenant`` sent before in this
        conversation (``proxy.core.warm``): only the messages after it are scanned, keyed, counted and grouped."""
        messages = body.get("messages")
        if type(messages) is not list or len(messages) < 2:
            return self.parse(body, counter)
        sized = resumed_content_keys(counter.conversations, tenant, self.name, messages, SALT)
        if sized is None:  # an element nested too deeply: the full parse refuses it as a cold request is refused
            return self.parse(body, counter)
        keys, size, same = sized
        memory = counter.conversations
        known = memory.find(tenant, self.name, keys)
        start = len(known.keys) if known is not None else 0
        scanned = fast_scan(messages, start)  # a known prefix was well formed and paired, no call waiting
        if not scanned:
            # legacy function calls (the check on items decides) or a pairing to repair: items of this request's
            # own, so that the repair never touches a remembered item; nothing is remembered
            items = build_items(messages, keys, counter.many(keys, messages, count_message))
            return Conversation(items, _fixed(body, counter), is_paired(items) if scanned is None else False)
        tail = build_items(messages, keys[start:], counter.many(keys[start:], messages[start:], count_message), start)
        if known is not None:
            if known is not same:  # (else its items hold this request's elements already)
                for item, message in zip(known.items, messages):  # each its own element's JSON (the same bytes)
                    item.raw = message
            items = known.items + tail
            tokens = known.tokens_with(tail)
        else:
            items = tail
            tokens = sum([item.tokens for item in tail])
        assign_groups(items, self.merge_call_runs, start)  # numbered before anyone else may resume from them
        memory.keep(tenant, self.name, keys, items[:], size, elements=tuple(messages), new=tail,
                    tokens=tokens)  # (a copy: the request may change its own list)
        return Conversation(items, _fixed(body, counter), True, grouped=len(items), tokens=tokens)

    def render(self, body: dict[str, Any], items: list[Item], changes: dict[str, Any]) -> dict[str, Any]:
        out = dict(body)
        out["messages"] = [item.raw for item in items]
        out.update(changes)
        return out

    def count(self, item: Item, counter: TokenCounter) -> None:
        item.key = content_key(item.raw) ^ SALT
        item.tokens = counter.cached(item.key, item.raw, count_message)

    def summary(self, text: str, covered_turns: int, counter: TokenCounter) -> Item:
        item = ChatItem({"role": "system", "content": text}, SYSTEM)
        self.count(item, counter)
        return item

    def without_calls(self, item: Item) -> Item | None:
        stripped = {k: v for k, v in item.raw.items() if k not in ("tool_calls", "function_call")}
        if not _has_content(stripped):
            return None
        return ChatItem(stripped, ASSISTANT, source=item.source)

    def placeholder(self, call: Item, call_id: str) -> Item | None:
        if call_id.startswith(LEGACY):
            raw: Message = {"role": "function", "name": call_id[len(LEGACY):], "content": PLACEHOLDER}
        else:
            raw = {"role": "tool", "tool_call_id": call_id, "content": PLACEHOLDER}
        return ChatItem(raw, TOOL, result_id=call_id, source=call.source)

    def mask(self, item: Item, text: str, counter: TokenCounter) -> Item | None:
        masked = mask_result(item, text)
        if masked is not None:
            self.count(masked, counter)
        return masked

    def output_field(self, upstream_model: str) -> str:
        name = upstream_model.rsplit("/", 1)[-1]
        return "max_completion_tokens" if name.startswith(COMPLETION_ONLY) else "max_tokens"

    def model_of(self, body: dict[str, Any], params: Mapping[str, str]) -> Any:
        return body.get("model")

    def model_changes(self, body: dict[str, Any], upstream_model: str) -> dict[str, Any]:
        return model_field_changes(body, upstream_model)

    def upstream_path(self, upstream_model: str) -> str:
        return "/chat/completions"

    def output_limits(self, body: dict[str, Any]) -> dict[str, Any]:
        return top_level_limits(body, self.output_fields)

    def error_body(self, error: CtxProxyError) -> dict[str, Any]:
        return error_body(error)

    def sniff(self, body: dict[str, Any]) -> int:
        # a body with ``messages`` is surely Chat (a Messages body is named by its path); any other, perhaps
        return 2 if "messages" in body else 1


WIRE = ChatWire()


def _fixed(body: dict[str, Any], counter: TokenCounter) -> int:
    """What a request counts outside its messages: reply priming and the schemas the provider puts in the prompt."""
    return (REPLY_PRIMING + counter.tools(body.get("tools"))
            + counter.tools(body.get("functions"), "functions")
            + counter.tools(output_schema(body.get("response_format")), "response_format"))


def mask_result(item: Item, text: str) -> Item | None:
    """A ``tool`` (or legacy ``function``) message with ``text`` as its content (observation masking).

    ``tool_call_id``, ``name`` and every other key stay as the client sent them; text parts, images,
    audio and files in the content all give way to ``text``.
    """
    raw = item.raw
    if item.role != TOOL or item.result_id is None or not isinstance(raw, dict):
        return None
    return ChatItem({**raw, "content": text}, TOOL, result_id=item.result_id, source=item.source)


def _has_content(message: Message) -> bool:
    content = message.get("content")
    if isinstance(content, str) and content.strip():
        return True
    if isinstance(content, list) and content:
        return True
    return bool(message.get("refusal")) or bool(message.get("audio"))
