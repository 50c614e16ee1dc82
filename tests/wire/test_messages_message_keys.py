"""A message-level key that only differs from
'content' by case (``"Content"``) was refused on a user message of text, but forwarded on a user message that held
a ``tool_result`` block, whose own keys were never checked (the wire splits it; ``count_raw`` checks the
synthetic ``{"role", "content"}`` dicts and the blocks). A Go upstream would read the uncounted "Content"
(found by an outside review; every message's own keys are now checked with its shape)."""

from __future__ import annotations

import pytest

from tests.conftest import StartProxy
from tests.fake_upstream import FakeUpstream
from tests.outside import share_model_map
from tests.wire.messages_warm_harness import CLAUDE, config, send


@pytest.fixture(autouse=True)
def _shared_model_map(monkeypatch: pytest.MonkeyPatch) -> None:
    share_model_map(monkeypatch)


async def test_a_case_variant_key_is_refused_on_every_user_message(upstream: FakeUpstream,
                                                                   start_proxy: StartProxy) -> None:
    proxy = await start_proxy(config(upstream))
    head = [{"role": "user", "content": "go"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Read", "input": {}}]}]
    plain = {"role": "user", "content": [{"type": "text", "text": "x"}], "Content": "uncounted " * 1000}
    split = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}],
             "Content": "uncounted " * 1000}
    refused = await send(proxy, upstream, {"model": CLAUDE, "max_tokens": 16, "messages": [*head, plain]})
    assert refused["status"] == 400 and refused["forwarded"] is None
    other = await send(proxy, upstream, {"model": CLAUDE, "max_tokens": 16, "messages": [*head, split]})
    assert other["status"] == 400 and other["forwarded"] is None, "forwarded with its 'Content' key"
