"""A payload that pairing repair empties is refused, never forwarded as an empty conversation.

Found by tests/test_reliability_input.py's fuzzing (once new modules changed the constants Hypothesis
draws from): ``[{"role": "assistant", "function_call": {"name": "lookup"}}]`` lost its unanswered call,
then the empty assistant message, and ``"messages": []`` went upstream (and came back from explain).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import StartProxy, base_config
from tests.fake_upstream import FakeUpstream
from tests.outside import post

EMPTIED: list[list[dict[str, Any]]] = [
    [{"role": "assistant", "function_call": {"name": "lookup"}}],
    [{"role": "assistant", "content": None,
      "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}],
    [{"role": "tool", "tool_call_id": "nowhere", "content": "orphan"}],
]


@pytest.mark.parametrize("messages", EMPTIED)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/ctxproxy/explain"])
async def test_a_payload_emptied_by_repair_is_refused(upstream: FakeUpstream, start_proxy: StartProxy,
                                                      messages: list[dict[str, Any]], path: str) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    status, _, body = await post(proxy, {"model": "gpt-4o-mini", "messages": messages}, path=path)
    assert status == 400
    assert body["error"]["code"] == "empty_after_repair" and body["error"]["param"] == "messages"
    assert upstream.chat == []
