"""Invariants of the caches under review, read from a running proxy: every remembered rendered user message
(``AnthropicItem.rendered``) and masking record (``Item.masked``) still says what making it again would."""

from __future__ import annotations

from typing import Any

import orjson

from proxy.wire.messages.items import AnthropicItem


def _fresh(run: tuple[AnthropicItem, ...]) -> dict[str, Any]:
    base = next((r.message for r in run if r.message is not None), None) or {"role": "user"}
    blocks: list[Any] = []
    for item in run:
        content = item.content()
        if isinstance(content, str):
            blocks.append({"type": "text", "text": content})
        elif isinstance(content, list):
            blocks.extend(content)
    return {**base, "content": blocks}


def check_caches(proxy: Any) -> tuple[int, int]:
    rendered = records = 0
    counters = proxy.state.runtime.tokenizers._counters
    for counter in counters.values():
        for branches in list(counter.conversations._known.values()):
            for known in branches:
                for item in known.items:
                    for it in (item, item.masked[1] if item.masked else None):
                        if isinstance(it, AnthropicItem) and it.rendered is not None:
                            run, _base, _contents, message = it.rendered
                            assert orjson.dumps(message) == orjson.dumps(_fresh(run)), "a cached message changed"
                            rendered += 1
                    if item.masked is not None:
                        _, copy, record = item.masked
                        assert set(record) == {"call_id", "tool", "tokens_removed"}, record
                        if copy is not None:
                            assert record["tokens_removed"] == item.tokens - copy.tokens, record
                        records += 1
    return rendered, records
