"""The warm memory's byte bound (proxy.core.warm) held against a Messages body holding one integer of 20+
digits: ``sized_content_keys`` used to report 0 bytes for it, so the request was remembered whatever its size and
counted for nothing against ``MAX_BYTES`` (found by an outside review)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.outside import share_model_map
from tests.wire.messages_warm_harness import CLAUDE


@pytest.fixture(autouse=True)
def _shared_model_map(monkeypatch: pytest.MonkeyPatch) -> None:
    share_model_map(monkeypatch)


def raw_body(tag: str, text_bytes: int, big_int: bool) -> bytes:
    """Two messages whose JSON is ``text_bytes`` long; with ``big_int`` one block carries a 24-digit integer."""
    extra = ',"n":123456789012345678901234' if big_int else ""
    text = (tag + " lorem ipsum dolor sit amet ") * (text_bytes // (len(tag) + 28))
    return (b'{"model":"' + CLAUDE.encode() + b'","max_tokens":16,"messages":['
            b'{"role":"user","content":[{"type":"text","text":"' + text.encode() + b'"' + extra.encode() + b'}]},'
            b'{"role":"assistant","content":"ok"},{"role":"user","content":"go on"}]}')


def test_the_same_bypass_in_process() -> None:
    """The same, without HTTP: a memory of 4,000 bytes keeps a 3,000-byte Messages request (over its quarter) only
    when one of its blocks holds a long integer, and then accounts it as 0 bytes."""
    import json

    from proxy.core.tokens import TokenCounter
    from proxy.core.warm import Conversations
    from proxy.wire.messages import WIRE

    def request(n: Any) -> dict[str, Any]:
        return json.loads(json.dumps({"model": CLAUDE, "max_tokens": 16, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "lorem ipsum " * 250, "n": n}]},
            {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go on"}]}))

    counter = TokenCounter("o200k_base")
    counter.conversations = Conversations(max_bytes=4_000)
    WIRE.resume(request(1), counter, "t")
    assert len(counter.conversations) == 0  # over a quarter of the bound: not kept, as documented
    WIRE.resume(request(10**30), counter, "t")
    assert len(counter.conversations) == 0, f"kept, accounted as {counter.conversations.size} bytes"
