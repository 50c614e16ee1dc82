"""On a provider: litellm route the request's element objects (shared with KnownBodies' remembered parse and
Conversations' remembered elements) are handed to litellm. Does anything change them in place?"""

from __future__ import annotations

import copy
from typing import Any

import aiohttp
import httpx
import pytest

from tests.conftest import StartProxy
from tests.helpers import words
from tests.serve.test_bodies_shared import check_remembered
from tests.serve.test_bodies_wires import chat_bodies, check_keyed
from tests.wire.messages_helpers import assistant, text_block, tool_result, tool_use, user
from tests.wire.test_messages_litellm import ANTHROPIC, CHAT, MESSAGE, VLLM, config, mock

respx = pytest.importorskip("respx")
pytestmark = pytest.mark.filterwarnings("ignore:.*ReadOnly.*:UserWarning")


@pytest.fixture
def litellm_httpx(monkeypatch: pytest.MonkeyPatch) -> None:
    import litellm

    monkeypatch.setattr(litellm, "disable_aiohttp_transport", True)


def messages_bodies() -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [user("Read every file.")]
    for i in range(10):
        msgs.append(assistant([text_block(f"step {i}"), tool_use(f"toolu_{i:03d}", "Read", path=f"/{i}")]))
        msgs.append(user([tool_result(f"toolu_{i:03d}", words(600, i))]))
    system = [{"type": "text", "text": "Be brief. " + words(2000, 3), "cache_control": {"type": "ephemeral"}}]
    return [{"model": model, "max_tokens": 256, "system": system, "messages": msgs[:n],
             "tools": [{"name": "Read", "input_schema": {"type": "object"}}]}
            for n in range(3, len(msgs) + 1, 2) for model in ("claude", "llama")]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
async def test_litellm_routes_leave_remembered_objects_alone(start_proxy: StartProxy, litellm_httpx: None,
                                                             path: str) -> None:
    proxy = await start_proxy(config())
    bodies = messages_bodies() if path == "/v1/messages" else [
        {**b, "model": model} for b in chat_bodies() for model in ("claude", "llama")]
    statuses = []
    with mock() as m:
        m.post(ANTHROPIC).mock(return_value=httpx.Response(200, json=MESSAGE))
        m.post(VLLM).mock(return_value=httpx.Response(200, json=CHAT))
        for b in bodies:
            async with aiohttp.ClientSession() as s, s.post(proxy.url + path, json=copy.deepcopy(b), headers={
                    "Authorization": "Bearer sk-client", "x-api-key": "sk-client"}) as r:
                statuses.append((r.status, (await r.read())[:200]))
            check_remembered(proxy)
            check_keyed(proxy)
    assert sum(s == 200 for s, _ in statuses) > 3, statuses[:3]
    assert proxy.state.bodies.reused > 2
