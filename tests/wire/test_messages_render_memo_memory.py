"""A conversation whose first kept item moves (a sliding window, cut_step 1) and whose bodies are decoded whole
(a field after ``messages`` that changes: the body reader cannot continue the previous body): every request leaves a
render memo on another anchor item of the warm memory, holding that request's decoded messages (an outside review's
reproduction): what the warm memory kept reachable grew with the square of the conversation, far beyond what it
counts (``Conversations.size``, bounded by ``max_bytes``). A conversation now holds one render, by its first item."""

from __future__ import annotations

import gc
import sys
from typing import Any

import pytest

from proxy.wire.messages import translator
from tests.conftest import StartProxy
from tests.fake_upstream import FakeUpstream
from tests.helpers import words
from tests.outside import share_model_map
from tests.wire.messages_render_harness import body, config, encode, send


@pytest.fixture(autouse=True)
def _shared_model_map(monkeypatch: pytest.MonkeyPatch) -> None:
    share_model_map(monkeypatch)


def reachable(root: Any) -> int:
    seen: set[int] = set()
    stack = [root]
    total = 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, type) or (callable(obj) and not hasattr(obj, "__slots__")):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        if hasattr(type(obj), "__slots__") and not isinstance(obj, (tuple, list, dict)):
            for cls in type(obj).__mro__:
                for slot in getattr(cls, "__slots__", ()):
                    if hasattr(obj, slot):
                        stack.append(getattr(obj, slot))
        else:
            stack.extend(gc.get_referents(obj))
    return total


async def held(upstream: FakeUpstream, start_proxy: StartProxy, turns: int, vary: bool = True) -> tuple[int, int]:
    cfg = config(upstream.url, {"type": "sliding-window", "params": {"keep_turns": 2, "cut_step": 1}}, 6000)
    proxy = await start_proxy(cfg)
    messages: list[dict[str, Any]] = []
    for t in range(turns):
        messages.append({"role": "user", "content": f"question {t} " + words(300, t)})
        # a field after messages that changes: decoded whole
        b = body(messages, False, metadata={"user_id": f"request-{t}" if vary else "u"})
        r = await send(proxy.url, upstream, encode(b, 0))
        assert r["status"] == 200, r
        messages.append({"role": "assistant", "content": f"answer {t} " + words(300, t + 1)})
    gc.collect()
    counters = proxy.state.runtime.tokenizers._counters
    memory = [c.conversations for c in counters.values()]
    return reachable([m._known for m in memory]), sum(m.size for m in memory)


@pytest.mark.parametrize("turns", [120])
async def test_the_warm_memory_holds_what_it_counts(upstream: FakeUpstream, start_proxy: StartProxy,
                                                    turns: int) -> None:
    with pytest.MonkeyPatch.context() as m:
        m.setattr(translator, "ANCHORS", 0)
        without, _counted0 = await held(upstream, start_proxy, turns)
    with_memo, counted = await held(upstream, start_proxy, turns)
    print(f"\nturns={turns}: counted {counted / 1e6:.2f} MB; reachable without memo {without / 1e6:.1f} MB, "
          f"with memo {with_memo / 1e6:.1f} MB")
    assert with_memo < 1.5 * without


async def test_continued_bodies_hold_one_render_too(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """The same conversation, its bodies continued by the body reader (the same objects): the memos' tuples alone."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(translator, "ANCHORS", 0)
        without, _counted0 = await held(upstream, start_proxy, 120, vary=False)
    with_memo, counted = await held(upstream, start_proxy, 120, vary=False)
    print(f"\nappending: counted {counted / 1e6:.2f} MB; reachable without memo {without / 1e6:.1f} MB, "
          f"with memo {with_memo / 1e6:.1f} MB")
    assert with_memo < 1.5 * without
