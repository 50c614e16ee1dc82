"""A toy wire protocol, defined in the tests alone: proof that a wire is one translator.

Nothing outside this module knows it. Its model sits in the URL path (``POST /toy/{model}/chat``),
its key in a header of its own (``x-toy-key``), its output cap one level down
(``options.max_tokens``); a conversation is ``turns`` of ``{"who": "user" | "bot" | "rule", "text"}``;
its errors are ``{"toy_error": {"code", "message"}}``; its stream ends with an ``event: done``;
its usage is ``{"in", "cached", "out"}``. A server speaks it once it is registered:
``create_app(config, wires=WIRES.with_wire(TOY))``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from typing import Any
from urllib.parse import quote

import orjson

from proxy.core import describe
from proxy.core.conversation import Conversation
from proxy.core.errors import CtxProxyError, PayloadError
from proxy.core.items import ASSISTANT, SYSTEM, USER, Item
from proxy.core.tokens import REPLY_PRIMING, TokenCounter, content_key
from proxy.core.usage import UsageForm
from proxy.wire.sse import StreamEnd

ROLES = {"user": USER, "bot": ASSISTANT, "rule": SYSTEM}
SALT = 0x7  # content keys of toy turns, apart from every other wire's
PER_TURN = 3


class ToyItem(Item):
    __slots__ = ()

    def describe(self, keep: Collection[str] = ()) -> str:
        return describe.said(str(self.raw.get("who")), str(self.raw.get("text")))

    def atoms(self) -> Iterator[tuple[str, ...]]:
        yield ("text", self.role, str(self.raw.get("text")))


def count_turn(counter: TokenCounter, turn: dict[str, Any]) -> int:
    return PER_TURN + counter.text(str(turn.get("text", "")))


class ToyStreamEnd(StreamEnd):
    name = "toy"
    needs_terminal = True

    def terminal(self, event: bytes, data: bytes) -> bool:
        return event == b"done"

    def error_event(self, error: CtxProxyError) -> bytes:
        return b"event: toy_error\ndata: " + orjson.dumps(error_body(error)) + b"\n\n"


def error_body(error: CtxProxyError) -> dict[str, Any]:
    return {"toy_error": {"code": error.code, "message": error.message}}


class ToyWire:
    name = "toy"
    field = "turns"
    merge_call_runs = False
    output_fields: tuple[str, ...] = ("options.max_tokens",)
    choices_field: str | None = None
    model_param = "path.model"
    paths: tuple[str, ...] = ("/toy/{model}/chat",)
    endpoints: Mapping[str, str] = {}
    key_headers: tuple[str, ...] = ("x-toy-key",)
    interpreted_fields = frozenset({"turns", "options", "stream"})
    litellm_fields: frozenset[str] | None = None
    usage_form = UsageForm("in", ("cached",), (), "out", marker="in")
    stream_end: StreamEnd = ToyStreamEnd()

    def parse(self, body: dict[str, Any], counter: TokenCounter) -> Conversation:
        turns = body.get("turns")
        if not isinstance(turns, list) or not turns:
            raise PayloadError("'turns' must be a non-empty array", param="turns", code="invalid_turns")
        items: list[Item] = []
        for i, turn in enumerate(turns):
            if not isinstance(turn, dict) or turn.get("who") not in ROLES or not isinstance(turn.get("text"), str):
                raise PayloadError(f"turns[{i}] must be {{who: user|bot|rule, text}}", param=f"turns[{i}]",
                                   code="invalid_turn")
            item = ToyItem(turn, ROLES[turn["who"]], source=i)
            self.count(item, counter)
            items.append(item)
        return Conversation(items, REPLY_PRIMING, True)

    def render(self, body: dict[str, Any], items: list[Item], changes: dict[str, Any]) -> dict[str, Any]:
        out = dict(body)
        out["turns"] = [item.raw for item in items]
        if "options.max_tokens" in changes:
            out["options"] = {**(body.get("options") or {}), "max_tokens": changes["options.max_tokens"]}
        return out

    def count(self, item: Item, counter: TokenCounter) -> None:
        item.key = content_key(item.raw) ^ SALT
        item.tokens = counter.cached(item.key, item.raw, count_turn)

    def summary(self, text: str, covered_turns: int, counter: TokenCounter) -> Item:
        item = ToyItem({"who": "rule", "text": text}, SYSTEM)
        self.count(item, counter)
        return item

    def without_calls(self, item: Item) -> Item | None:
        return None  # the toy has no tools

    def placeholder(self, call: Item, call_id: str) -> Item | None:
        return None

    def mask(self, item: Item, text: str, counter: TokenCounter) -> Item | None:
        return None  # the toy has no tool results to mask

    def output_field(self, upstream_model: str) -> str:
        return "options.max_tokens"

    def output_limits(self, body: dict[str, Any]) -> dict[str, Any]:
        options = body.get("options")
        value = options.get("max_tokens") if isinstance(options, dict) else None
        return {} if value is None else {"options.max_tokens": value}

    def model_of(self, body: dict[str, Any], params: Mapping[str, str]) -> Any:
        return params.get("model")

    def model_changes(self, body: dict[str, Any], upstream_model: str) -> dict[str, Any]:
        return {}  # the upstream's model goes in the upstream path

    def upstream_path(self, upstream_model: str) -> str:
        return f"/toy/{quote(upstream_model, safe='')}/chat"  # a model name is one path segment, whatever it holds

    def error_body(self, error: CtxProxyError) -> dict[str, Any]:
        return error_body(error)

    def sniff(self, body: dict[str, Any]) -> int:
        return 2 if "turns" in body else 0


TOY = ToyWire()
