"""Reloading the policy without a restart: POST /admin/reload and SIGHUP on a real ``ctxproxy serve``.

A valid new file swaps the policy for new requests; an invalid one is rejected with its key paths
(in the answer and the log) and the running policy kept; requests in flight finish on the policy
they started with.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import yaml

from proxy.settings import load_config
from tests.conftest import base_config
from tests.fake_upstream import FakeUpstream
from tests.outside import serve
from tests.store import test_summaries_http as travel
from tests.test_policy import (
    ADMIN_KEY,
    BIG,
    CAPS,
    KEYS,
    SECRETS,
    Env,
    chat,
    conversation,
    count_tokens,
    get_json,
    policy_config,
    user_turns,
    within_cap,
)

NEW_SUPPORT_KEY = "sk-support-rotated-51c0"


def write(path: Path, config: dict[str, Any] | str) -> None:
    path.write_text(config if isinstance(config, str) else yaml.safe_dump(config, sort_keys=False))


def tenant(config: dict[str, Any], name: str) -> dict[str, Any]:
    return next(t for t in config["tenants"] if t["name"] == name)


@pytest.fixture
async def second() -> AsyncIterator[FakeUpstream]:
    fake = await FakeUpstream().start()
    yield fake
    await fake.stop()


@pytest.fixture
async def setup(upstream: FakeUpstream, second: FakeUpstream, start_proxy: Any,
                tmp_path: Path) -> tuple[Env, Path, dict[str, Any]]:
    path = tmp_path / "ctxproxy.yaml"
    config = policy_config(upstream.base_url, second.base_url)
    write(path, config)
    proxy = await start_proxy(load_config(path, env={}), config_path=str(path))
    return Env(proxy, upstream, second), path, config


async def admin_reload(env: Env, key: str | None = ADMIN_KEY) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    async with aiohttp.ClientSession() as s, s.post(env.proxy.url + "/admin/reload", headers=headers) as r:
        return r.status, await r.json()


async def policy_of(env: Env, key: str) -> tuple[int, Any]:
    status, _, raw = await get_json(env.proxy.base_url + "/ctxproxy/policy", key)
    return status, json.loads(raw)


# --------------------------------------------------------------------------- POST /admin/reload


@pytest.mark.parametrize("key", [None, KEYS["support"], "adm-wrong", ADMIN_KEY + "x", ADMIN_KEY.upper()])
async def test_admin_reload_needs_the_admin_key(setup: Any, key: str | None) -> None:
    env, path, config = setup
    tenant(config, "support")["max_context_tokens"] = 1000
    write(path, config)
    status, body = await admin_reload(env, key)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert (await policy_of(env, KEYS["support"]))[1]["max_context_tokens"] == CAPS["support"]


async def test_admin_reload_swaps_the_policy_for_new_requests(setup: Any) -> None:
    env, path, config = setup
    messages = conversation(30)
    await chat(env, "support", messages)
    assert count_tokens(env.forwarded) > 2000

    support = tenant(config, "support")
    support["max_context_tokens"] = 1500
    support["keys"] = [NEW_SUPPORT_KEY]
    support["models"] = [BIG, "mini"]
    support["context_manager"]["params"]["keep_turns"] = 2
    config["tenants"] = [t for t in config["tenants"] if t["name"] != "platform"]
    write(path, config)
    status, body = await admin_reload(env)
    assert (status, body) == (200, {"reloaded": True, "restart_required": []})

    # the rotated key works with the new policy; the old one and the removed tenant's are refused
    status, policy = await policy_of(env, NEW_SUPPORT_KEY)
    assert status == 200 and policy["tenant"] == "support" and policy["max_context_tokens"] == 1500
    assert policy["models"] == [BIG, "mini"] and policy["context_manager"]["params"]["keep_turns"] == 2
    for old in (KEYS["support"], KEYS["platform"]):
        assert (await policy_of(env, old))[0] == 401
        async with env.client(old) as c:
            with pytest.raises(openai.AuthenticationError):
                await c.chat.completions.create(model=BIG, messages=messages)  # type: ignore[arg-type]
    raw = await chat(env, NEW_SUPPORT_KEY, messages)
    assert int(raw.headers["x-ctxproxy-tokens-out"]) <= 1500 and within_cap(env.forwarded, 1500)
    assert user_turns(env.forwarded) <= 2 + 1
    await chat(env, NEW_SUPPORT_KEY, conversation(1), model="mini")  # newly allowed
    assert env.second.chat[-1].body["model"] == "acme-mini-0718"
    # an untouched tenant keeps its policy
    assert (await policy_of(env, KEYS["research"]))[1]["max_context_tokens"] == CAPS["research"]


async def test_admin_key_rotation_takes_effect_on_reload(setup: Any) -> None:
    env, path, config = setup
    config["admin"] = {"keys": ["adm-next-7788"]}
    write(path, config)
    assert (await admin_reload(env))[0] == 200
    assert (await admin_reload(env))[0] == 401  # the old admin key is gone
    assert (await admin_reload(env, "adm-next-7788"))[0] == 200


def _negative_cap(c: dict[str, Any]) -> None:
    tenant(c, "support")["max_context_tokens"] = -5


def _unknown_key(c: dict[str, Any]) -> None:
    tenant(c, "research")["max_context"] = 100


def _bad_manager(c: dict[str, Any]) -> None:
    tenant(c, "platform")["context_manager"] = {"type": "no-such-manager"}


def _bad_param(c: dict[str, Any]) -> None:
    tenant(c, "support")["context_manager"]["params"]["keep_turns"] = "many"


def _shared_key(c: dict[str, Any]) -> None:
    tenant(c, "research")["keys"].append(KEYS["support"])


def _bad_policy(c: dict[str, Any]) -> None:
    tenant(c, "support")["max_output_policy"] = "truncate"


def _bad_route(c: dict[str, Any]) -> None:
    c["models"][1]["upstream"] = "nowhere"


@pytest.mark.parametrize("mutate,path_", [
    (_negative_cap, "tenants[1].max_context_tokens"),
    (_unknown_key, "tenants[0].max_context"),
    (_bad_manager, "tenants[2].context_manager.type"),
    (_bad_param, "tenants[1].context_manager.params.keep_turns"),
    (_shared_key, "tenants[1].keys"),
    (_bad_policy, "tenants[1].max_output_policy"),
    (_bad_route, "models[1].upstream"),
])
async def test_invalid_config_is_rejected_and_the_running_one_kept(
    setup: Any, caplog: pytest.LogCaptureFixture, mutate: Any, path_: str
) -> None:
    env, path, config = setup
    tenant(config, "support")["max_context_tokens"] = 1000  # a valid change next to the invalid one
    mutate(config)
    write(path, config)
    with caplog.at_level(logging.ERROR, logger="ctxproxy"):
        status, body = await admin_reload(env)
    assert status == 400 and body["reloaded"] is False
    assert any(p.startswith(path_) for p in body["problems"]), body
    logged = [r.getMessage() for r in caplog.records if "reload rejected" in r.getMessage()]
    assert any(path_ in line for line in logged), logged
    for text in [json.dumps(body), *logged]:
        for secret in SECRETS:
            assert secret not in text
    # still the old policy, in every respect
    assert (await policy_of(env, KEYS["support"]))[1]["max_context_tokens"] == CAPS["support"]
    raw = await chat(env, "support", conversation(30))
    assert raw.status_code == 200 and count_tokens(env.forwarded) > 1000
    assert within_cap(env.forwarded, CAPS["support"])


@pytest.mark.parametrize("text,expected", [
    ("tenants: [\n  - name: x\n", "not valid YAML"),
    ("- just\n- a list\n", "the top level must be a mapping"),
    ("", "upstreams"),
])
async def test_unparsable_config_is_rejected(setup: Any, text: str, expected: str) -> None:
    env, path, _ = setup
    write(path, text)
    status, body = await admin_reload(env)
    assert status == 400 and any(expected in p for p in body["problems"]), body
    assert (await policy_of(env, KEYS["support"]))[0] == 200


async def test_missing_environment_variable_is_named(setup: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    env, path, config = setup
    monkeypatch.delenv("CTXPROXY_TEST_UNSET_KEY", raising=False)
    tenant(config, "support")["keys"] = ["${CTXPROXY_TEST_UNSET_KEY}"]
    write(path, config)
    status, body = await admin_reload(env)
    assert status == 400
    assert any(p.startswith("tenants[1].keys[0]") and "CTXPROXY_TEST_UNSET_KEY" in p for p in body["problems"])
    monkeypatch.setenv("CTXPROXY_TEST_UNSET_KEY", NEW_SUPPORT_KEY)  # the environment is read on reload
    assert (await admin_reload(env))[0] == 200
    assert (await policy_of(env, NEW_SUPPORT_KEY))[1]["tenant"] == "support"


async def test_deleted_config_file_is_rejected(setup: Any) -> None:
    env, path, _ = setup
    path.unlink()
    status, body = await admin_reload(env)
    assert status == 400 and "cannot read" in body["problems"][0]
    assert (await policy_of(env, KEYS["support"]))[0] == 200


# --------------------------------------------------------------------------- in-flight requests


async def test_in_flight_request_finishes_on_the_policy_it_started_with(setup: Any) -> None:
    """The upstream is slow to answer; meanwhile the tenant's key and cap change. The request in
    flight still completes, its payload shaped by the old cap; new requests see the new policy."""
    env, path, config = setup
    env.upstream.mode, env.upstream.delay = "slow_first_byte", 1.5
    messages = conversation(30)
    in_flight = asyncio.create_task(chat(env, "support", messages))
    while not env.upstream.chat:
        await asyncio.sleep(0.01)

    support = tenant(config, "support")
    support["keys"], support["max_context_tokens"] = [NEW_SUPPORT_KEY], 1500
    write(path, config)
    assert (await admin_reload(env))[0] == 200
    assert (await policy_of(env, KEYS["support"]))[0] == 401
    assert not in_flight.done()

    raw = await in_flight
    assert raw.status_code == 200
    old = int(raw.headers["x-ctxproxy-tokens-out"])
    assert 1500 < old <= CAPS["support"]
    assert within_cap(env.upstream.chat[0].body["messages"], CAPS["support"])

    env.upstream.delay = 0.01
    raw = await chat(env, NEW_SUPPORT_KEY, messages)
    assert int(raw.headers["x-ctxproxy-tokens-out"]) <= 1500 and within_cap(env.forwarded, 1500)


async def test_reload_during_a_summariser_call_keeps_the_requests_policy(setup: Any) -> None:
    """Reloaded while the request is still in the pipeline (waiting for its summary): the rest of
    its pipeline (keep_turns, the cap) runs on the policy it started with."""
    env, path, config = setup
    original = env.second._summary
    started = asyncio.Event()

    async def slow_summary(request: Any, body: Any) -> Any:
        started.set()
        await asyncio.sleep(1.0)
        return await original(request, body)

    env.second._summary = slow_summary  # type: ignore[method-assign]
    messages = conversation(30)
    in_flight = asyncio.create_task(chat(env, "research", messages))
    await asyncio.wait_for(started.wait(), 10)

    research = tenant(config, "research")
    research["max_context_tokens"] = 1500
    research["context_manager"]["params"]["keep_turns"] = 1
    write(path, config)
    assert (await admin_reload(env))[0] == 200
    assert not env.upstream.chat

    raw = await in_flight
    assert raw.status_code == 200 and raw.headers["x-ctxproxy-summary"] == "waited"
    forwarded = env.upstream.chat[0].body["messages"]
    assert user_turns(forwarded) == 6 + 1  # the old keep_turns
    assert 1500 < count_tokens(forwarded) <= CAPS["research"] * 1.01

    env.second._summary = original  # type: ignore[method-assign]
    raw = await chat(env, "research", messages)
    assert within_cap(env.forwarded, 1500) and user_turns(env.forwarded) <= 1 + 1


# --------------------------------------------------------------------------- SIGHUP on `ctxproxy serve`


@pytest.mark.timeout(120)
async def test_sighup_reloads_a_running_ctxproxy_serve(upstream: FakeUpstream, second: FakeUpstream,
                                                       tmp_path: Path) -> None:
    path = tmp_path / "ctxproxy.yaml"
    config = policy_config(upstream.base_url, second.base_url, logging={"level": "INFO", "requests": True})
    write(path, config)
    messages = conversation(30)
    async with serve(path) as served:
        base_url = served.url + "/v1"

        async def ask(key: str, **kw: Any) -> Any:
            async with openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0) as c:
                return await c.chat.completions.with_raw_response.create(
                    model=BIG, messages=messages, **kw)  # type: ignore[arg-type]

        async def policy(key: str) -> tuple[int, Any]:
            status, _, raw = await get_json(base_url + "/ctxproxy/policy", key)
            return status, json.loads(raw)

        raw = await ask(KEYS["support"])
        assert 1500 < int(raw.headers["x-ctxproxy-tokens-out"]) <= CAPS["support"]

        # a valid change: SIGHUP swaps the policy
        support = tenant(config, "support")
        support["max_context_tokens"] = 1500
        support["keys"] = [KEYS["support"], NEW_SUPPORT_KEY]
        write(path, config)
        mark = len(served.lines)
        served.proc.send_signal(signal.SIGHUP)
        await served.wait_for(r"config reloaded from", after=mark)
        for key in (KEYS["support"], NEW_SUPPORT_KEY):
            raw = await ask(key)
            assert int(raw.headers["x-ctxproxy-tokens-out"]) <= 1500
            assert within_cap(upstream.chat[-1].body["messages"], 1500)
        assert (await policy(NEW_SUPPORT_KEY))[1]["max_context_tokens"] == 1500

        # an invalid change: rejected, logged with its key path, the running policy kept
        for mutate, pattern in (
            (lambda: support.update(max_context_tokens=0), r"tenants\[1\]\.max_context_tokens"),
            (lambda: support.update(max_context_tokens=900, context_manager={"type": "sliding-window",
                                                                            "params": {"keep_turns": 0}}),
             r"tenants\[1\]\.context_manager\.params\.keep_turns"),
        ):
            mutate()
            write(path, config)
            mark = len(served.lines)
            served.proc.send_signal(signal.SIGHUP)
            await served.wait_for(r"reload rejected, keeping the running config: " + pattern, after=mark)
            assert served.proc.returncode is None
            raw = await ask(KEYS["support"])
            assert raw.status_code == 200 and 900 < int(raw.headers["x-ctxproxy-tokens-out"]) <= 1500
            assert (await policy(KEYS["support"]))[1]["max_context_tokens"] == 1500

        # an unreadable file likewise
        path.unlink()
        mark = len(served.lines)
        served.proc.send_signal(signal.SIGHUP)
        await served.wait_for(r"reload rejected.*cannot read", after=mark)
        assert (await policy(KEYS["platform"]))[0] == 200
    assert served.proc.returncode == 0
    log = "\n".join(served.lines)
    assert '"tenant":"support"' in log.replace(" ", "")  # per-request log lines name the tenant ...
    for secret in [*SECRETS, NEW_SUPPORT_KEY]:
        assert secret not in log  # ... never a key


# --------------------------------------------------------------------------- what a reload applies

RELOAD_ADMIN = "adm-reload-live-31f7"
MB = 1024 * 1024


async def reloadable(start_proxy: Any, tmp_path: Path, config: dict[str, Any]) -> tuple[Any, Path]:
    path = tmp_path / "ctxproxy.yaml"
    write(path, {**config, "admin": {"keys": [RELOAD_ADMIN]}})
    return await start_proxy(load_config(path, env={}), config_path=str(path)), path


async def rewrite_and_reload(proxy: Any, path: Path, config: dict[str, Any]) -> Any:
    write(path, {**config, "admin": {"keys": [RELOAD_ADMIN]}})
    async with aiohttp.ClientSession() as s, s.post(proxy.url + "/admin/reload",
                                                    headers={"Authorization": f"Bearer {RELOAD_ADMIN}"}) as r:
        assert r.status == 200, await r.text()
        return await r.json()


# a body of ~3 MB on each managed wire and on the relay; the padding is forwarded untouched
PADDED: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"model": "gpt-4o-mini", "input": "hi"},
    "/v1/messages": {"model": "gpt-4o-mini", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/embeddings": {"model": "text-embedding-3-small", "input": "hi"},
}


async def post_padded(proxy: Any, path: str) -> tuple[int, Any]:
    body = {**PADDED[path], "metadata": {"pad": "x" * (3 * MB)}}
    async with aiohttp.ClientSession() as s, s.post(proxy.url + path, json=body) as r:
        return r.status, await r.json(content_type=None)


async def test_reload_applies_max_body_mb_up_and_down(upstream: FakeUpstream, start_proxy: Any,
                                                      tmp_path: Path) -> None:
    """max_body_mb was fixed when the app was built: raised from 1 to 8 MB, a 3 MB body was still refused."""
    config = base_config(upstream.base_url, server={"max_body_mb": 1})
    proxy, path = await reloadable(start_proxy, tmp_path, config)
    for url_path in PADDED:
        status, body = await post_padded(proxy, url_path)
        assert status == 413 and "1048576" in json.dumps(body), (url_path, status, body)
    await rewrite_and_reload(proxy, path, {**config, "server": {"max_body_mb": 8}})
    for url_path in PADDED:
        assert (await post_padded(proxy, url_path))[0] == 200, url_path
    await rewrite_and_reload(proxy, path, {**config, "server": {"max_body_mb": 2}})
    status, body = await post_padded(proxy, "/v1/messages")
    assert status == 413 and body["type"] == "error" and "2097152" in body["error"]["message"]  # Anthropic's shape


async def test_reload_applies_the_first_byte_timeout(upstream: FakeUpstream, start_proxy: Any,
                                                    tmp_path: Path) -> None:
    upstream.mode, upstream.delay = "slow_first_byte", 1.0
    config = base_config(upstream.base_url, server={"first_byte_timeout": 0.3})
    proxy, path = await reloadable(start_proxy, tmp_path, config)
    for stream in (False, True):
        status, body = await post_chat(proxy, stream=stream)
        assert status == 504 and body["error"]["code"] == "upstream_timeout"
    await rewrite_and_reload(proxy, path, {**config, "server": {"first_byte_timeout": 10}})
    for stream in (False, True):
        assert (await post_chat(proxy, stream=stream))[0] == 200
    await rewrite_and_reload(proxy, path, config)
    assert (await post_chat(proxy))[0] == 504


async def post_chat(proxy: Any, *, stream: bool = False) -> tuple[int, Any]:
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    async with aiohttp.ClientSession() as s, s.post(proxy.url + "/v1/chat/completions", json=body) as r:
        raw = await r.read()
    return r.status, json.loads(raw) if r.status != 200 else raw


@contextlib.contextmanager
def unanswered_port() -> Any:
    """A port whose accept queue is full: a connection attempt to it waits until the client gives up."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(3):
        filler = socket.socket()
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect(("127.0.0.1", port))
        fillers.append(filler)
    try:
        yield port
    finally:
        for sock in [*fillers, listener]:
            sock.close()


async def test_reload_applies_the_connect_timeout(start_proxy: Any, tmp_path: Path) -> None:
    """The pooled session kept the connect timeout it was built with; a lowered one now applies at once."""
    with unanswered_port() as port:
        config = base_config(f"http://127.0.0.1:{port}/v1", server={"connect_timeout": 30, "first_byte_timeout": 1})
        proxy, path = await reloadable(start_proxy, tmp_path, config)
        status, body = await post_chat(proxy)
        assert status == 504 and "did not answer in time" in body["error"]["message"]  # the first-byte bound
        await rewrite_and_reload(proxy, path, {**config, "server": {"connect_timeout": 0.2, "first_byte_timeout": 1}})
        status, body = await post_chat(proxy)
        assert status == 504 and "Connecting to the upstream timed out" in body["error"]["message"]


async def test_reload_applies_the_summariser_back_off_to_a_back_off_in_progress(
        upstream: FakeUpstream, start_proxy: Any, tmp_path: Path) -> None:
    """A failed summary backs its conversation off; an operator who shortens the back-off sees it retried."""
    config = travel.config(upstream.base_url, summarizer={"retry_backoff_seconds": 300, "timeout_seconds": 2})
    proxy, path = await reloadable(start_proxy, tmp_path, config)
    upstream.summary_mode = "status"
    messages = travel.conversation(40)
    async with aiohttp.ClientSession() as s:
        async def summary() -> str:
            async with s.post(proxy.url + "/v1/chat/completions",
                              json={"model": "small-model", "messages": messages}) as r:
                assert r.status == 200
                return r.headers["x-ctxproxy-summary"]

        assert await summary() == "failed"
        calls = len(upstream.summaries)
        upstream.summary_mode = "ok"
        assert await summary() == "failed" and len(upstream.summaries) == calls  # backing off: not asked
        await rewrite_and_reload(proxy, path, {**config, "summarizer": {"retry_backoff_seconds": 0}})
        # its last summary failed, so this request is not made to wait: the summary is retried in the background
        assert await summary() == "failed"
        await proxy.state.shared.background.idle()
        assert len(upstream.summaries) == calls + 1
        assert await summary() == "reused"


async def test_reload_applies_the_summary_ttl(upstream: FakeUpstream, start_proxy: Any, tmp_path: Path) -> None:
    config = travel.config(upstream.base_url)
    proxy, path = await reloadable(start_proxy, tmp_path, config)
    await rewrite_and_reload(proxy, path, {**config, "cache": {"backend": "memory", "ttl_seconds": 0.5}})
    async with aiohttp.ClientSession() as s:
        async def summary() -> str:
            async with s.post(proxy.url + "/v1/chat/completions",
                              json={"model": "small-model", "messages": travel.conversation(40)}) as r:
                return r.headers["x-ctxproxy-summary"]

        assert await summary() == "waited"
        assert await summary() == "reused"
        await asyncio.sleep(1.0)
        assert await summary() == "waited"  # expired after the reloaded TTL, not the week it started with


async def test_reload_names_the_settings_that_need_a_restart(upstream: FakeUpstream, start_proxy: Any,
                                                            tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A reload must not claim what it cannot apply: the cache and the listening socket stay as started."""
    config = base_config(upstream.base_url)
    proxy, path = await reloadable(start_proxy, tmp_path, config)
    moved = {**config, "cache": {"backend": "disk", "path": str(tmp_path / "cache"), "breaker_timeouts": 5,
                                 "local_summaries": 10, "budget_seconds": 2},
             "server": {"port": 9, "workers": 3, "drain_timeout": 1, "max_body_mb": 2}}
    with caplog.at_level(logging.INFO, logger="ctxproxy"):
        answer = await rewrite_and_reload(proxy, path, moved)
    needs = ["server.port", "server.workers", "server.drain_timeout", "cache.backend", "cache.path",
             "cache.breaker_timeouts"]
    assert answer == {"reloaded": True, "restart_required": needs}
    assert any(r.levelno == logging.WARNING and "until a restart: " + ", ".join(needs) in r.getMessage()
               for r in caplog.records)
    assert proxy.state.shared.cache.name == "memory"  # really still the one it started with
    # compared with what the process started with, not with the previous reload
    tenants = {**moved, "tenants": [{"name": "t", "keys": ["sk-t-1"]}]}
    assert (await rewrite_and_reload(proxy, path, tenants))["restart_required"] == needs
    assert (await rewrite_and_reload(proxy, path, config))["restart_required"] == []


async def test_the_log_queue_keeps_its_size_until_a_restart(upstream: FakeUpstream, start_proxy: Any,
                                                             tmp_path: Path) -> None:
    """The log's queue is made when the server starts: a new logging.queue_lines is said to need a restart."""
    config = base_config(upstream.base_url)
    proxy, path = await reloadable(start_proxy, tmp_path, config)
    answer = await rewrite_and_reload(proxy, path, {**config, "logging": {"level": "INFO", "queue_lines": 7}})
    assert answer == {"reloaded": True, "restart_required": ["logging.queue_lines"]}


@pytest.mark.timeout(120)
async def test_reload_applies_the_log_level(upstream: FakeUpstream, tmp_path: Path) -> None:
    """logging.level was set once at start: a reload to INFO showed no request lines, one to ERROR kept them."""
    path = tmp_path / "ctxproxy.yaml"
    config = {**base_config(upstream.base_url, logging={"level": "WARNING", "requests": True}),
              "admin": {"keys": [RELOAD_ADMIN]}}
    write(path, config)
    async with serve(path) as served, aiohttp.ClientSession() as s:
        async def request(rid: str) -> None:
            body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
            async with s.post(served.url + "/v1/chat/completions", json=body, headers={"x-request-id": rid}) as r:
                assert r.status == 200

        async def reload_to(level: str) -> None:
            write(path, {**config, "logging": {"level": level, "requests": True}})
            async with s.post(served.url + "/admin/reload",
                              headers={"Authorization": f"Bearer {RELOAD_ADMIN}"}) as r:
                assert r.status == 200

        await request("at-warning-1")
        await reload_to("INFO")
        await request("at-info-2")
        await served.wait_for("at-info-2")
        await reload_to("ERROR")
        await request("at-error-3")
        await request("at-error-4")
        await reload_to("INFO")
        await request("at-info-5")
        await served.wait_for("at-info-5")
    log = "\n".join(served.lines)
    assert "at-warning-1" not in log and "at-error-3" not in log and "at-error-4" not in log
