"""proxy.core.warm: the conversations a wire may resume, found by tenant and verified by every content key."""

from __future__ import annotations

import copy
import json
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.core.items import USER, Item
from proxy.core.warm import BRANCHES, Conversations
from tests.conftest import StartProxy
from tests.fake_upstream import FakeUpstream
from tests.plugins.test_masking_http import WIRES, request_points, support_session
from tests.plugins.test_masking_http import config as masking_config


def _items(n: int) -> list[Item]:
    return [Item({"i": i}, USER, source=i) for i in range(n)]


def test_a_request_that_extends_a_known_one_finds_it() -> None:
    memory = Conversations()
    items = _items(3)
    memory.keep("t", "chat", [1, 2, 3], items, 100)
    known = memory.find("t", "chat", [1, 2, 3, 4, 5])
    assert known is not None and known.keys == [1, 2, 3] and known.items is items
    assert memory.find("t", "chat", [1, 2, 3]) is known  # the same request again


def test_an_edit_a_truncation_or_a_reorder_finds_nothing() -> None:
    """Only a prefix made of the very same elements may be reused: anything else takes the full path."""
    memory = Conversations()
    memory.keep("t", "chat", [1, 2, 3, 4], _items(4), 100)
    assert memory.find("t", "chat", [1, 2, 9, 4, 5]) is None  # the middle edited
    assert memory.find("t", "chat", [1, 2, 3]) is None  # truncated
    assert memory.find("t", "chat", [1, 2, 4, 3, 5]) is None  # reordered
    assert memory.find("t", "chat", [2, 1, 3, 4]) is None


def test_nothing_is_shared_across_tenants_or_wires() -> None:
    """Another tenant's identical conversation is not found: each tenant parses its own."""
    memory = Conversations()
    memory.keep("a", "chat", [1, 2, 3], _items(3), 100)
    assert memory.find("b", "chat", [1, 2, 3, 4]) is None
    assert memory.find("a", "responses", [1, 2, 3, 4]) is None
    assert memory.find("a", "chat", [1, 2, 3, 4]) is not None


def test_a_grown_request_replaces_the_one_it_extends_and_branches_are_bounded() -> None:
    memory = Conversations()
    memory.keep("t", "chat", [1, 2, 3], _items(3), 100)
    memory.keep("t", "chat", [1, 2, 3, 4], _items(4), 100)
    assert memory.items == 4  # the shorter one is superseded
    for tail in range(10, 10 + BRANCHES + 2):  # retries with other endings
        memory.keep("t", "chat", [1, 2, 3, 4, tail], _items(5), 100)
    assert memory.items == 5 * BRANCHES
    assert memory.find("t", "chat", [1, 2, 3, 4, 10 + BRANCHES + 1, 7]) is not None
    assert memory.find("t", "chat", [1, 2, 3, 4, 10, 7]) is None  # the oldest branch went


def test_memory_is_bounded_in_items_least_recently_used_first() -> None:
    memory = Conversations(max_items=10)
    memory.keep("t", "chat", [1, 1, 1, 1], _items(4), 100)
    memory.keep("t", "chat", [2, 2, 2, 2], _items(4), 100)
    assert memory.find("t", "chat", [1, 1, 1, 1]) is not None  # used: now the most recent
    memory.keep("t", "chat", [3, 3, 3, 3], _items(4), 100)
    assert memory.items <= 10
    assert memory.find("t", "chat", [2, 2, 2, 2]) is None
    assert memory.find("t", "chat", [1, 1, 1, 1]) is not None
    memory.keep("t", "chat", list(range(11)), _items(11), 100)  # larger than the whole budget: not kept
    assert memory.find("t", "chat", list(range(11))) is None and memory.items <= 10


def test_memory_is_bounded_in_bytes_least_recently_used_first() -> None:
    """A remembered request holds its client's objects: a few large bodies must not hold what many items would.
    Forty conversations of ~480 kB each used to stay whole under an item bound of 50,000."""
    memory = Conversations(max_bytes=1000)
    memory.keep("t", "chat", [1, 1], _items(2), 400)
    memory.keep("t", "chat", [2, 2], _items(2), 400)
    memory.keep("t", "chat", [3, 3], _items(2), 200)
    assert memory.size <= 1000 and memory.find("t", "chat", [3, 3]) is not None
    memory.keep("t", "chat", [4, 4], _items(2), 200)
    assert memory.size <= 1000 and memory.find("t", "chat", [1, 1]) is None  # the least recently used went
    memory.keep("t", "chat", [5, 5], _items(2), 251)  # over a quarter of the budget: not kept
    assert memory.find("t", "chat", [5, 5]) is None


def test_a_one_element_conversation_is_not_remembered() -> None:
    memory = Conversations()
    memory.keep("t", "chat", [1], _items(1), 100)
    assert len(memory) == 0 and memory.find("t", "chat", [1]) is None


# --------------------------------------------------------------------------- from the outside


async def _send(proxy: Any, wire: Any, body: dict[str, Any], key: str) -> None:
    headers = {"Authorization": f"Bearer {key}", "x-api-key": key, "anthropic-version": "2023-06-01"}
    async with aiohttp.ClientSession() as s, s.post(proxy.url + wire.path, json=body, headers=headers) as r:
        text = await r.text()
        assert r.status == 200, text[:500]


@pytest.mark.parametrize("wire", ["chat", "responses", "messages"])
async def test_a_conversation_forwards_the_same_whatever_was_sent_before(
        upstream: FakeUpstream, start_proxy: StartProxy, wire: str) -> None:
    """Two tenants drive one growing agent session through one proxy (streaming and not), over the masking
    threshold; one of them then edits an early message and resends. Each request's forwarded body is the one a
    proxy that never saw the conversation forwards for it: what earlier requests left behind changes nothing."""
    tenants = [{"name": "a", "keys": ["sk-a"]}, {"name": "b", "keys": ["sk-b"]}]
    config = {**masking_config(upstream, {"type": "observation-masking", "params": {"keep_recent": 3}}),
              "tenants": tenants}
    warm = await start_proxy(config)
    w = WIRES[wire]
    session = support_session(tasks=10, records=2)
    points = request_points(session)
    edited = copy.deepcopy(session)
    first_user = next(i for i, m in enumerate(edited) if m["role"] == "user")
    edited[first_user] = {**edited[first_user], "content": "An edited question."}
    requests = [(session[:n], "sk-a" if k % 2 else "sk-b", k % 3 == 0) for k, n in enumerate(points)]
    requests.append((edited, "sk-a", False))
    sent = []
    for messages, key, stream in requests:
        body = w.body(messages, w.model(32_000), stream)
        await _send(warm, w, body, key)
        sent.append((body, key, w.forwarded(upstream)))
    assert all("[ctxproxy removed this " in json.dumps(forwarded) for _, _, forwarded in sent[-4:])
    # the bodies were read from where they differ from the tenant's previous one (``proxy.serve.bodies``)
    assert warm.state.bodies.reused >= len(requests) // 2 - 4
    for body, key, forwarded in sent[-4:]:
        cold = await start_proxy(config)
        await _send(cold, w, body, key)
        assert w.forwarded(upstream) == forwarded


def _element(i: int) -> dict[str, Any]:
    return {"role": "user", "content": f"message {i}", "n": i}


def test_the_keys_of_elements_a_request_shares_as_objects_are_read_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A body read from where it differs (``proxy.serve.bodies``) holds the previous request's element objects for
    what it repeats: their keys come from the remembered request; only the new ones are keyed. Same keys and size
    as keying every element."""
    from proxy.core import tokens

    memory = Conversations()
    first = [_element(i) for i in range(6)]
    keys, size = tokens.sized_content_keys(first, 7) or ([], 0)
    memory.keep("t", "chat", keys, _items(6), size, elements=tuple(first))
    resent = {**first[5], "cache_control": {"type": "ephemeral"}}  # the last one sent anew, and two appended
    second = [*first[:5], resent, _element(6), _element(7)]
    dumped: list[Any] = []
    real = orjson.dumps

    def dumps(value: Any, *args: Any) -> bytes:
        dumped.append(value)
        return real(value, *args)

    monkeypatch.setattr(orjson, "dumps", dumps)
    got = tokens.resumed_content_keys(memory, "t", "chat", second, 7)
    monkeypatch.undo()
    assert got is not None and got[:2] == tokens.sized_content_keys(second, 7)
    assert got[2] is None  # it does not begin with all of the remembered request's elements (one was sent anew)
    # the first two (which name the conversation), the three new ones and the one they replace
    assert [e for e in dumped if e not in first[:2]] == [resent, second[6], second[7], first[5]]
    # equal elements that are not the same objects are keyed (a fresh parse), and another tenant finds nothing
    fresh = copy.deepcopy(second)
    cold = tokens.sized_content_keys(fresh, 7)
    assert cold is not None and tokens.resumed_content_keys(memory, "t", "chat", fresh, 7) == (*cold, None)
    # a body that begins with every element of the remembered request, as the very objects, is told which request
    longer = [*first, _element(6)]
    got = tokens.resumed_content_keys(memory, "t", "chat", longer, 7)
    assert got is not None and got[:2] == tokens.sized_content_keys(longer, 7)
    assert got[2] is not None and got[2].elements == tuple(first)
    assert memory.shared("other", "chat", second, keys[:2]) is None
    assert memory.shared("t", "chat", fresh, keys[:2]) is None
