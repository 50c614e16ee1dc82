"""Responses bodies above 16 KiB with reasoning items, compaction items, ctxproxy's own compaction summaries,
and /responses/compact (emulated) in between: warm equals fresh, remembered parses and keys never change."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.conftest import StartProxy, base_config
from tests.fake_upstream import FakeUpstream
from tests.outside import share_model_map
from tests.serve.test_bodies_shared import check_remembered
from tests.serve.test_bodies_wires import MANAGERS, MODEL, chat_bodies, check_keyed, send
from tests.wire.responses_helpers import chat_to_responses


@pytest.fixture(autouse=True)
def _shared_model_map(monkeypatch: pytest.MonkeyPatch) -> None:
    share_model_map(monkeypatch)


def bodies() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for i, body in enumerate(chat_bodies()):
        items = chat_to_responses(body["messages"])
        with_reasoning: list[Any] = []
        for j, item in enumerate(items):
            if item.get("type") == "function_call":
                with_reasoning.append({"type": "reasoning", "id": f"rs_{j}", "summary": [],
                                       "encrypted_content": "e" * 40})
            with_reasoning.append(item)
        if i % 3 == 1:
            with_reasoning.insert(3, {"type": "compaction", "encrypted_content": "c" * 200})
        if i % 4 == 2:
            with_reasoning.insert(2, {"role": "user", "content": [
                {"type": "input_text", "text": "[ctxproxy compaction summary] earlier work"}]})
        b = {"model": MODEL, "instructions": "Be terse.", "input": with_reasoning, "store": False,
             "max_output_tokens": 100}
        out.append(("/v1/responses", b))
        if i % 5 == 4:
            out.append(("/v1/responses/compact", b))
    return out


@pytest.mark.parametrize("manager", ["summarising", "masking"])
async def test_responses_with_reasoning_and_compaction(upstream: FakeUpstream, start_proxy: StartProxy,
                                                       manager: str) -> None:
    cfg = base_config(upstream.base_url, models=[
        {"name": MODEL, "context_window": 128000, "max_output_tokens": 16384}],
        summarizer_model=MODEL, summarizer={"retry_backoff_seconds": 0, "timeout_seconds": 2})
    cfg["context_manager"] = MANAGERS[manager]
    cfg["trimmer"] = {"max_tokens": 6000}
    cfg["upstreams"]["fake"]["responses_compact"] = "emulate"
    warm = await start_proxy(cfg)
    for i, (path, b) in enumerate(bodies()):
        w = await send(warm, upstream, path, copy.deepcopy(b))
        check_remembered(warm)
        check_keyed(warm)
        c = await send(await start_proxy(cfg), upstream, path, copy.deepcopy(b))
        w.pop("forwarded"), c.pop("forwarded")  # (compact's emulated answer has fresh ids)
        assert w == c, (i, path, w, c)
    assert warm.state.bodies.reused > 3
