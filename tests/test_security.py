"""Security: keys never leak, tenants never share a summary, clients cannot choose the upstream, hop-by-hop
headers are dropped both ways, cache files are private, and nothing unpickles.

tests/test_observability.py::test_request_logs_and_no_canary_anywhere already looks for a tenant key and
prompt text in logs, metrics and error bodies on the main chat paths; the sweep here adds every other
path (413, 502, policy, models, relay, admin reload with wrong and right key), the admin key, a key the
upstream echoes back in its error, response headers, and what the upstream itself receives.
"""

from __future__ import annotations

import ast
import asyncio
import hashlib
import json
import logging
import os
import re
import socket
import stat
import tokenize
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from proxy.settings import load_config
from tests.conftest import ROOT, base_config
from tests.fake_upstream import FakeUpstream, _completion

MODEL = "gpt-4o-mini"
SMALL = "small-model"
MESSAGES = [{"role": "user", "content": "Hello there."}]

# recognisable secrets: none of these may appear anywhere a client, a log or a scrape can see
TENANT_A_KEY = "sk-tenantA-CANARY-4f1e9d7c2b"
TENANT_B_KEY = "sk-tenantB-CANARY-8a3c6e0f5d"
ADMIN_KEY = "adm-CANARY-ROOT-77d2a1e903"
UPSTREAM_KEY = "sk-upstream-CANARY-91b2c4d6e8"
DEAD_UPSTREAM_KEY = "sk-deadup-CANARY-0c5e7a9b1d"
WRONG_KEY = "sk-wrong-CANARY-3e5d7f9a1b"
SECRETS = [TENANT_A_KEY, TENANT_B_KEY, ADMIN_KEY, UPSTREAM_KEY, DEAD_UPSTREAM_KEY, WRONG_KEY]
# what the upstream may see: only its own key, never a proxy or admin key
CLIENT_SECRETS = [TENANT_A_KEY, TENANT_B_KEY, ADMIN_KEY, WRONG_KEY]


def canaries() -> list[str]:
    """The secrets, the distinctive middle part of each, and their sha256 hex (how the proxy stores them)."""
    out = []
    for key in SECRETS:
        out += [key, key.split("-CANARY-")[1], hashlib.sha256(key.encode()).hexdigest()]
    return out


def assert_clean(text: str, where: str) -> None:
    for canary in canaries():
        assert canary not in text, f"{canary!r} leaked in {where}: ...{text[max(0, text.find(canary) - 120):][:300]}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def record_text(record: logging.LogRecord) -> str:
    parts = [record.getMessage(), repr(record.args)]
    if record.exc_info and record.exc_info[1] is not None:
        parts.append(repr(record.exc_info[1]))
    if record.exc_text:
        parts.append(record.exc_text)
    parts.append(repr({k: v for k, v in vars(record).items() if k not in ("args", "msg", "exc_info")}))
    return "\n".join(parts)


def security_config(upstream_url: str, dead_url: str, **extra: Any) -> dict[str, Any]:
    cfg = base_config(
        upstream_url,
        models=[
            {"name": MODEL, "context_window": 128000, "max_output_tokens": 16384},
            {"name": SMALL, "context_window": 8000, "max_output_tokens": 1000},
            {"name": "dead-model", "upstream": "dead", "context_window": 128000, "max_output_tokens": 1000},
        ],
        summarizer_model=MODEL,
        context_manager={"type": "summarising", "params": {"keep_turns": 4}},
        summarizer={"retry_backoff_seconds": 0, "timeout_seconds": 2, "max_summary_tokens": 300},
        tenants=[{"name": "alpha", "keys": [TENANT_A_KEY], "models": [MODEL, SMALL, "dead-model"]},
                 {"name": "bravo", "keys": [f"sha256:{hashlib.sha256(TENANT_B_KEY.encode()).hexdigest()}"],
                  "models": [MODEL, SMALL]}],
        admin={"keys": [ADMIN_KEY]},
        server={"max_body_mb": 0.25},
        logging={"level": "DEBUG", "requests": True},
        # the default relay list, plus a streamed test path, so the key checks cover a relayed stream
        relay={"allow": ["POST /v1/embeddings", "GET /v1/stream-test"]},
    )
    cfg["upstreams"] = {"fake": {"base_url": upstream_url, "api_key": UPSTREAM_KEY},
                        "dead": {"base_url": dead_url, "api_key": DEAD_UPSTREAM_KEY}}
    cfg["default_upstream"] = "fake"
    cfg.update(extra)
    return cfg


def conversation(turns: int, tag: str = "") -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a travel agent assistant."}]
    for i in range(turns - 1):
        messages += [
            {"role": "user", "content": f"{tag}Turn {i}: please check booking ZX{i}Q and its seat."},
            {"role": "assistant", "content": f"Booking ZX{i}Q: seat 14C, price 412.{i % 60:02d} USD. " * 12},
        ]
    messages.append({"role": "user", "content": f"Turn {turns - 1}: anything else?"})
    return messages


# --------------------------------------------------------------------------- keys never leak


async def test_keys_never_leak_on_any_path(upstream: FakeUpstream, start_proxy: Any, tmp_path: Path,
                                           caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)  # root logger: every logger at every level, aiohttp's included
    path = tmp_path / "ctxproxy.yaml"
    path.write_text(yaml.safe_dump(security_config(upstream.base_url, f"http://127.0.0.1:{free_port()}/v1")))
    proxy = await start_proxy(load_config(path, env={}), config_path=str(path))
    seen: list[tuple[str, int, str]] = []  # (what, status, headers + body)

    async def call(what: str, method: str, url_path: str, key: str | None = TENANT_A_KEY, *, body: Any = None,
                   data: bytes | None = None, header: str = "Authorization") -> tuple[int, bytes]:
        headers = {}
        if key is not None:
            headers[header] = f"Bearer {key}" if header == "Authorization" else key
        async with s.request(method, proxy.url + url_path, json=body, data=data, headers=headers) as r:
            raw = await r.read()
            seen.append((what, r.status, "\n".join(f"{k}: {v}" for k, v in r.headers.items()) + "\n"
                         + raw.decode("utf-8", "replace")))
            return r.status, raw

    chat = "/v1/chat/completions"
    ok = {"model": MODEL, "messages": MESSAGES}
    async with aiohttp.ClientSession() as s:
        assert (await call("chat ok", "POST", chat, body=ok))[0] == 200
        assert (await call("chat stream", "POST", chat, body={**ok, "stream": True,
                                                              "stream_options": {"include_usage": True}}))[0] == 200
        assert (await call("chat summarised", "POST", chat, body={"model": SMALL, "messages": conversation(40)}))[0] \
            == 200
        assert upstream.summaries, "the summariser path was not exercised"
        assert (await call("chat tenant b", "POST", chat, TENANT_B_KEY, body=ok))[0] == 200
        assert (await call("chat x-api-key", "POST", chat, TENANT_A_KEY, body=ok, header="x-api-key"))[0] == 200
        assert (await call("400 bad json", "POST", chat, data=b'{"model": ')) [0] == 400
        assert (await call("400 invalid", "POST", chat, body={"model": MODEL, "messages": [{"role": "x"}]}))[0] == 400
        assert (await call("401 wrong key", "POST", chat, WRONG_KEY, body=ok))[0] == 401
        assert (await call("401 wrong x-api-key", "POST", chat, WRONG_KEY, body=ok, header="x-api-key"))[0] == 401
        assert (await call("401 no key", "POST", chat, None, body=ok))[0] == 401
        assert (await call("401 admin key as tenant key", "POST", chat, ADMIN_KEY, body=ok))[0] == 401
        assert (await call("404 model", "POST", chat, TENANT_B_KEY, body={**ok, "model": "dead-model"}))[0] == 404
        assert (await call("404 route", "GET", "/nope"))[0] == 404
        big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 400_000}]}
        assert (await call("413", "POST", chat, body=big))[0] == 413
        assert (await call("502 dead upstream", "POST", chat, body={**ok, "model": "dead-model"}))[0] == 502
        upstream.mode, upstream.status = "status", 401
        # a provider echoing the key it was sent must not hand the proxy's upstream key to the client
        upstream.status_body = {"error": {"message": f"Incorrect API key provided: {UPSTREAM_KEY}.",
                                          "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
        # the proxy's own key was refused: a gateway error (502), never the provider's text
        assert (await call("upstream 401 echoing its key", "POST", chat, body=ok))[0] == 502
        upstream.status_body = f"bad key {UPSTREAM_KEY}"
        upstream.status = 500
        assert (await call("upstream 500 text echoing its key", "POST", chat, body=ok))[0] == 500
        upstream.mode = "ok"
        assert (await call("explain", "POST", "/v1/ctxproxy/explain", body={"model": SMALL,
                                                                          "messages": conversation(40)}))[0] == 200
        assert (await call("explain 401", "POST", "/v1/ctxproxy/explain", WRONG_KEY, body=ok))[0] == 401
        assert (await call("policy a", "GET", "/v1/ctxproxy/policy"))[0] == 200
        assert (await call("policy b", "GET", "/v1/ctxproxy/policy", TENANT_B_KEY))[0] == 200
        assert (await call("policy 401", "GET", "/v1/ctxproxy/policy", WRONG_KEY))[0] == 401
        assert (await call("models", "GET", "/v1/models"))[0] == 200
        assert (await call("relay embeddings", "POST", "/v1/embeddings", body={"input": "hi", "model": MODEL}))[0] == 200
        assert (await call("relay model not allowed", "POST", "/v1/embeddings", body={"input": "hi", "model": "e"}))[0] == 404
        # stored-object listings are not relayed for tenants with the operator's key (issue 11, item 13)
        assert (await call("relay get", "GET", "/v1/files?purpose=x"))[0] == 403
        assert (await call("relay stream", "GET", "/v1/stream-test"))[0] == 200
        assert (await call("relay 401", "GET", "/v1/files", WRONG_KEY))[0] == 401
        assert (await call("reload wrong key", "POST", "/admin/reload", WRONG_KEY))[0] == 401
        assert (await call("reload tenant key", "POST", "/admin/reload", TENANT_A_KEY))[0] == 401
        assert (await call("reload no key", "POST", "/admin/reload", None))[0] == 401
        assert (await call("reload ok", "POST", "/admin/reload", ADMIN_KEY))[0] == 200
        path.write_text("upstreams: {fake: {base_url: 'not a url', api_key: " + UPSTREAM_KEY + "}}\n")
        assert (await call("reload invalid config", "POST", "/admin/reload", ADMIN_KEY))[0] == 400
        assert (await call("healthz", "GET", "/healthz", None))[0] == 200
        assert (await call("readyz", "GET", "/readyz", None))[0] == 200
        # with tenants, /metrics names each one with its traffic and cost: an admin key only
        assert (await call("metrics no key", "GET", "/metrics", None))[0] == 401
        assert (await call("metrics tenant key", "GET", "/metrics", TENANT_A_KEY))[0] == 401
        assert (await call("metrics wrong key", "GET", "/metrics", WRONG_KEY))[0] == 401
        assert (await call("metrics", "GET", "/metrics", ADMIN_KEY))[0] == 200

    assert len(seen) >= 35
    for what, status, text in seen:
        assert "Traceback" not in text, what
        assert_clean(text, f"the answer to {what} ({status})")
    assert caplog.records
    for record in caplog.records:
        assert_clean(record_text(record), f"log record {record.name} {record.levelname}")
    assert_clean(caplog.text, "the formatted log")

    # upstream side: the proxy's own key only, never a tenant or admin key; ours went out as the bearer
    received = upstream.chat + upstream.summaries + upstream.other
    assert received
    for rec in received:
        blob = json.dumps(rec.headers) + rec.raw.decode("utf-8", "replace")
        for secret in CLIENT_SECRETS:
            assert secret not in blob, f"{secret} reached the upstream on {rec.path}"
        assert rec.headers.get("Authorization") == f"Bearer {UPSTREAM_KEY}", rec.path


# --------------------------------------------------------------------------- tenants never share a summary


async def test_tenants_never_get_each_others_summary(upstream: FakeUpstream, start_proxy: Any) -> None:
    proxy = await start_proxy(security_config(upstream.base_url, f"http://127.0.0.1:{free_port()}/v1"))
    body = {"model": SMALL, "messages": conversation(40)}

    async def ask(key: str) -> tuple[str, str]:
        async with aiohttp.ClientSession() as s, s.post(proxy.url + "/v1/chat/completions", json=body,
                                                        headers={"Authorization": f"Bearer {key}"}) as r:
            assert r.status == 200
            status = r.headers["x-ctxproxy-summary"]
        forwarded = upstream.chat[-1].body["messages"]
        summaries = [m["content"] for m in forwarded if m["role"] == "system" and "[Conversation summary" in m["content"]]
        assert len(summaries) == 1
        return status, summaries[0]

    upstream.summary_text = "ALPHA-ONLY summary: Ada's booking ZX1Q."
    status_a, text_a = await ask(TENANT_A_KEY)
    upstream.summary_text = "BRAVO-ONLY summary: Bob's booking ZX2Q."
    status_b, text_b = await ask(TENANT_B_KEY)
    assert (status_a, status_b) == ("waited", "waited")  # each made its own
    assert "ALPHA-ONLY" in text_a and "BRAVO-ONLY" in text_b and "ALPHA-ONLY" not in text_b
    # each keeps reusing its own
    upstream.summary_text = "SHOULD-NOT-BE-CALLED"
    assert await ask(TENANT_A_KEY) == ("reused", text_a)
    assert await ask(TENANT_B_KEY) == ("reused", text_b)
    assert len(upstream.summaries) == 2
    # explain shows tenant B its own summary, not A's
    async with aiohttp.ClientSession() as s, s.post(proxy.url + "/v1/ctxproxy/explain", json=body,
                                                    headers={"Authorization": f"Bearer {TENANT_B_KEY}"}) as r:
        explained = await r.json()
    assert "ALPHA-ONLY" not in json.dumps(explained) and "BRAVO-ONLY" in json.dumps(explained)
    # different cache keys: two summaries, nothing shared
    keys = list(proxy.state.shared.cache.inner._data)
    assert len([k for k in keys if k.startswith("sum:")]) == 2


async def test_concurrent_tenants_do_not_share_a_single_flight(upstream: FakeUpstream, start_proxy: Any,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Two tenants asking for the same conversation's summary at the same moment get two summariser calls."""
    calls = 0

    async def numbered(self: FakeUpstream, request: web.Request, body: Any) -> web.StreamResponse:
        nonlocal calls
        calls += 1
        text = f"SUMMARY-CALL-{calls}"
        await asyncio.sleep(0.2)  # both requests are in flight together
        return web.json_response(_completion(body.get("model", "m"), text, {"prompt_tokens": 1,
                                                                              "completion_tokens": 1}))

    monkeypatch.setattr(FakeUpstream, "_summary", numbered)
    proxy = await start_proxy(security_config(upstream.base_url, f"http://127.0.0.1:{free_port()}/v1"))
    body = {"model": SMALL, "messages": conversation(40)}
    async with aiohttp.ClientSession() as s:
        async def ask(key: str) -> str:
            # explain makes a summary only when asked to (it bills the summariser)
            async with s.post(proxy.url + "/v1/ctxproxy/explain?summarize=true", json=body,
                              headers={"Authorization": f"Bearer {key}"}) as r:
                assert r.status == 200
                return json.dumps((await r.json())["messages"])

        a, b = await asyncio.gather(ask(TENANT_A_KEY), ask(TENANT_B_KEY))
    assert calls == 2
    got_a = re.findall(r"SUMMARY-CALL-\d", a)
    got_b = re.findall(r"SUMMARY-CALL-\d", b)
    assert len(got_a) == len(got_b) == 1 and got_a != got_b


# --------------------------------------------------------------------------- no SSRF


@pytest.fixture
async def evil() -> Any:
    fake = await FakeUpstream().start()
    yield fake
    await fake.stop()


def _evil_tricks(evil_url: str) -> list[tuple[str, dict[str, str], dict[str, Any]]]:
    host = evil_url.split("//", 1)[1]
    headers: list[dict[str, str]] = [
        {"Host": host}, {"X-Forwarded-Host": host}, {"X-Forwarded-Proto": "http", "X-Forwarded-Host": host},
        {"Forwarded": f"host={host};proto=http"}, {"X-Upstream": evil_url + "/v1"},
        {"X-Upstream-Url": evil_url + "/v1"}, {"X-Base-Url": evil_url + "/v1"}, {"X-Api-Base": evil_url + "/v1"},
        {"X-Original-URL": evil_url + "/v1/chat/completions"}, {"X-Rewrite-URL": evil_url + "/v1/chat/completions"},
        {"X-Target-Url": evil_url}, {"OpenAI-Base-URL": evil_url + "/v1"},
        {"x-ctxproxy-context-manager": json.dumps({"type": "stack", "params": {"base_url": evil_url}})},
    ]
    out: list[tuple[str, dict[str, str], dict[str, Any]]] = [
        (f"header {next(iter(h))}", h, {"model": MODEL, "messages": MESSAGES}) for h in headers]
    for field in ("base_url", "api_base", "api_base_url", "baseURL", "endpoint", "url"):
        out.append((f"body {field}", {}, {"model": MODEL, "messages": MESSAGES, field: evil_url + "/v1"}))
    out.append(("body extra_body", {}, {"model": MODEL, "messages": MESSAGES,
                                        "extra_body": {"base_url": evil_url + "/v1"}}))
    for model in (f"{evil_url}/v1", f"openai/{evil_url}/v1", f"{host}/gpt-4o", f"@{host}/x", f"//{host}/x"):
        out.append((f"model {model}", {}, {"model": model, "messages": MESSAGES}))
    return out


async def test_clients_cannot_choose_the_upstream(upstream: FakeUpstream, evil: FakeUpstream,
                                                  start_proxy: Any) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    async with aiohttp.ClientSession() as s:
        for what, headers, body in _evil_tricks(evil.url):
            before = len(upstream.chat)
            async with s.post(proxy.url + "/v1/chat/completions", json=body, headers=headers) as r:
                status = r.status
                await r.read()
            assert status < 500, what
            if status == 200:
                assert len(upstream.chat) == before + 1, what
                assert upstream.chat[-1].headers.get("Host", "").endswith(upstream.url.rsplit(":", 1)[1]), what
    assert not evil.chat and not evil.other and not evil.summaries


RAW_TARGETS = [
    "/v1/../admin/reload", "/v1/%2e%2e/%2e%2e/admin/reload", "/v1/..%2f..%2fadmin%2freload",
    "/v1/http://{evil}/v1/chat/completions", "/v1/http:%2f%2f{evil}/v1/chat/completions", "/v1//{evil}/v1/models",
    "/v1/@{evil}/v1/models", "/v1/%40{evil}/v1/models", "/v1/\\\\{evil}/v1/models", "/v1/models#@{evil}",
    "/v1/models?url=http://{evil}/", "http://{evil}/v1/chat/completions", "//{evil}/v1/chat/completions",
    "/v1/%0d%0aHost:%20{evil}/x", "/v1/x%00http://{evil}/",
]


async def _raw_request(port: int, method: str, target: str, body: bytes = b"") -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"{method} {target} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()
    status_line = raw.split(b"\r\n", 1)[0]
    parts = status_line.split()
    return (int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0), raw


@pytest.mark.parametrize("target", RAW_TARGETS)
@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_path_tricks_go_only_to_the_configured_upstream(upstream: FakeUpstream, evil: FakeUpstream,
                                                              start_proxy: Any, target: str, method: str) -> None:
    proxy = await start_proxy(base_config(upstream.base_url, admin={"keys": [ADMIN_KEY]}))
    port = int(proxy.url.rsplit(":", 1)[1])
    body = json.dumps({"model": MODEL, "messages": MESSAGES}).encode() if method == "POST" else b""
    status, raw = await _raw_request(port, method, target.format(evil=evil.url.split("//", 1)[1]), body)
    assert b"Traceback" not in raw
    assert status == 0 or status < 500 or status in (502, 504), raw[:300]  # 0: the connection was refused
    assert not evil.chat and not evil.other and not evil.summaries
    assert not (method == "POST" and "admin" in target and status == 200), "reached /admin/reload without a key"
    for rec in upstream.other:  # what reached the real upstream stayed under its base path
        assert rec.path.startswith("/v1/"), rec.path


async def test_connect_and_absolute_form_are_not_proxied(upstream: FakeUpstream, evil: FakeUpstream,
                                                         start_proxy: Any) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    port = int(proxy.url.rsplit(":", 1)[1])
    host = evil.url.split("//", 1)[1]
    for method, target in (("CONNECT", host), ("GET", f"http://{host}/v1/models"),
                           ("POST", f"http://{host}/v1/chat/completions")):
        status, raw = await _raw_request(port, method, target)
        assert b"Traceback" not in raw
        # the absolute form is served by path, on this proxy, with its configured upstream: the host is ignored
        assert status == 0 or status < 500, (method, target, raw[:200])
    assert not evil.chat and not evil.other


# --------------------------------------------------------------------------- hop-by-hop headers


async def test_hop_by_hop_and_proxy_auth_headers_stripped_both_ways(upstream: FakeUpstream,
                                                                    start_proxy: Any) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    upstream.mode, upstream.status = "status", 429
    upstream.status_headers = {
        "Retry-After": "3", "x-ratelimit-remaining-requests": "0", "Set-Cookie": "upstream-session=1",
        "Proxy-Authenticate": "Basic realm=upstream", "Keep-Alive": "timeout=99", "Connection": "X-Up-Hop",
        "X-Up-Hop": "hop", "Server": "upstream/1.0", "Trailer": "X-Checksum",
    }
    request_headers = {
        "Proxy-Authorization": "Basic c2VjcmV0", "Proxy-Connection": "keep-alive", "Keep-Alive": "timeout=5",
        "TE": "trailers", "Trailer": "X-Checksum", "Upgrade": "websocket", "Cookie": "session=client",
        "Forwarded": "for=1.2.3.4", "X-Forwarded-For": "1.2.3.4", "X-Real-IP": "1.2.3.4",
        "Connection": "keep-alive, X-Client-Hop", "X-Client-Hop": "hop", "X-Kept": "kept",
    }
    async with aiohttp.ClientSession() as s, s.post(proxy.url + "/v1/chat/completions", headers=request_headers,
                                                    json={"model": MODEL, "messages": MESSAGES}) as r:
        assert r.status == 429
        got = {k.lower(): v for k, v in r.headers.items()}
    assert got["retry-after"] == "3" and got["x-ratelimit-remaining-requests"] == "0"
    for name in ("set-cookie", "proxy-authenticate", "x-up-hop", "trailer"):
        assert name not in got, name
    assert got.get("keep-alive", "") != "timeout=99" and got.get("server", "") != "upstream/1.0"
    sent = {k.lower(): v for k, v in upstream.chat[-1].headers.items()}
    for name in ("proxy-authorization", "proxy-connection", "keep-alive", "te", "trailer", "upgrade", "cookie",
                 "forwarded", "x-forwarded-for", "x-real-ip", "x-client-hop"):
        assert name not in sent, name
    assert sent["x-kept"] == "kept"


# --------------------------------------------------------------------------- cache files private, no pickle


async def test_cache_files_are_owner_only_whatever_the_umask(upstream: FakeUpstream, start_proxy: Any,
                                                            tmp_path: Path) -> None:
    path = tmp_path / "cache"
    cfg = security_config(upstream.base_url, f"http://127.0.0.1:{free_port()}/v1",
                          cache={"backend": "disk", "path": str(path)})
    old = os.umask(0)
    try:
        proxy = await start_proxy(cfg)
        body = {"model": SMALL, "messages": conversation(40)}
        async with aiohttp.ClientSession() as s, s.post(proxy.url + "/v1/chat/completions", json=body,
                                                        headers={"Authorization": f"Bearer {TENANT_A_KEY}"}) as r:
            assert r.status == 200 and r.headers["x-ctxproxy-summary"] == "waited"
        await proxy.runner.cleanup()
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    files = list(path.rglob("*"))
    assert any(f.name == "cache.db" for f in files)
    for f in files:
        mode = stat.S_IMODE(f.stat().st_mode)
        assert mode & 0o077 == 0, f"{f} is {oct(mode)}"
        assert f.stat().st_uid == os.geteuid()


UNSAFE_NAMES = {"pickle", "cPickle", "marshal", "shelve", "dill", "cloudpickle", "joblib", "jsonpickle", "eval",
                "exec", "__import__", "unsafe_load", "full_load", "UnsafeLoader", "FullLoader"}


def _tokens(file: Path) -> list[tokenize.TokenInfo]:
    with file.open("rb") as f:
        return list(tokenize.tokenize(f.readline))


def _pickle_strings(file: Path) -> list[int]:
    """Lines of string constants mentioning pickle, docstrings excluded."""
    tree = ast.parse(file.read_text())
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
            and "pickle" in node.value.lower()]


def test_nothing_unpickles_or_evaluates() -> None:
    """No code in proxy/ or plugins/ names pickle, marshal, shelve, eval, exec or an unsafe YAML loader; the
    word "pickle" appears outside comments only in proxy/cache.py's refusal code; YAML is read with safe_load."""
    code_hits: list[str] = []
    text_hits: list[str] = []
    for folder in ("proxy", "plugins"):
        for file in sorted((ROOT / folder).rglob("*.py")):
            rel = str(file.relative_to(ROOT))
            toks = _tokens(file)
            for i, tok in enumerate(toks):
                if tok.type == tokenize.NAME and tok.string in UNSAFE_NAMES:
                    code_hits.append(f"{rel}:{tok.start[0]}: {tok.line.strip()}")
                if tok.type == tokenize.NAME and tok.string == "load" and i >= 2 and toks[i - 2].string == "yaml":
                    code_hits.append(f"{rel}:{tok.start[0]}: {tok.line.strip()}")
            text_hits += [f"{rel}:{line}" for line in _pickle_strings(file)]
    assert code_hits == [], "\n".join(code_hits)
    # strings the code uses (docstrings aside) that speak of pickle: only the refusal in proxy/store/disk.py
    assert text_hits and all(h.startswith("proxy/store/disk.py:") for h in text_hits), text_hits
    cache_src = (ROOT / "proxy" / "store" / "disk.py").read_text()
    assert "refusing to unpickle" in cache_src and "disk=_JSONBytesDisk" in cache_src
    # the disk backend's serialiser refuses pickled rows instead of loading them
    import diskcache

    from proxy.core.errors import CacheBackendError
    from proxy.store.disk import _JSONBytesDisk

    disk = _JSONBytesDisk.__new__(_JSONBytesDisk)
    with pytest.raises(CacheBackendError):
        disk.fetch(diskcache.core.MODE_PICKLE, None, b"\x80\x04K\x01.", False)
    with pytest.raises(CacheBackendError):
        disk.get(b"\x80\x04K\x01.", False)


async def test_relay_holds_the_tenant_model_allow_list_and_never_relays_the_proxy_namespace(upstream, start_proxy):
    import aiohttp

    cfg = {
        "upstreams": {"fake": {"base_url": upstream.base_url, "api_key": "sk-up"}},
        "cache": {"backend": "memory"},
        "tenants": [{"name": "t", "keys": ["k-relay"], "models": ["gpt-4o-mini"]}],
    }
    proxy = await start_proxy(cfg)
    async with aiohttp.ClientSession(headers={"Authorization": "Bearer k-relay"}) as s:
        async with s.post(proxy.url + "/v1/responses", json={"model": "gpt-4o", "input": "hi"}) as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
        async with s.post(proxy.url + "/v1/responses", json={"model": "gpt-4o-mini", "input": "hi"}) as r:
            assert r.status == 200
        async with s.post(proxy.url + "/v1/ctxproxy/policy", json={}) as r:
            assert r.status == 404
        async with s.get(proxy.url + "/v1/files/%2e%2e/%2e%2e/admin") as r:
            assert r.status == 404
    assert [o.path for o in upstream.other] == ["/v1/responses"]


async def test_upstream_rejecting_the_proxys_key_is_a_gateway_error(upstream, start_proxy):
    import aiohttp

    upstream.mode, upstream.status = "status", 401
    upstream.status_body = {"error": {"message": "Incorrect API key provided: sk-up", "type": "invalid_request_error"}}
    cfg = {"upstreams": {"fake": {"base_url": upstream.base_url, "api_key": "sk-up"}}, "cache": {"backend": "memory"}}
    proxy = await start_proxy(cfg)
    async with aiohttp.ClientSession() as s, s.post(proxy.url + "/v1/chat/completions",
                      json={"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}) as r:
        body = await r.text()
        assert r.status == 502
    assert "upstream_auth_failed" in body and "sk-up" not in body
