"""proxy.serve.relay: canonical paths, the relay allow-list matcher, relay URLs and the model of any body kind."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from yarl import URL

from proxy.core.errors import BadRequest, ModelNotFound, NotFound
from proxy.serve.relay import _allowed, _check_model, _models_of, canonical_path, relay_url
from proxy.settings import DEFAULT_RELAY_ALLOW, load_config
from tests.conftest import Handler, RunningProxy, StartProxy, base_config
from tests.fake_upstream import FakeUpstream
from tests.faults import RawUpstream, Resources, SlowStreamUpstream, eventually, openai_error, settle
from tests.outside import request
from tests.wire.messages_helpers import CLAUDE

# --------------------------------------------------------------------------- canonical paths


@pytest.mark.parametrize(("raw", "path"), [
    ("/v1/chat/completions", "/v1/chat/completions"),
    ("/v1/chat/completions/", "/v1/chat/completions"),
    ("/v1/chat/completions///", "/v1/chat/completions"),
    ("//v1//chat/completions", "/v1/chat/completions"),
    ("/v1//chat//completions", "/v1/chat/completions"),
    ("/v1/chat%2Fcompletions", "/v1/chat/completions"),
    ("/v1/chat%2fcompletions", "/v1/chat/completions"),
    ("/v1%2Fchat%2Fcompletions", "/v1/chat/completions"),
    ("/v1/chat/completions?stream=true", "/v1/chat/completions"),
    ("/v1/chat/completions/?x=/y", "/v1/chat/completions"),
    ("/v1\\chat\\completions", "/v1/chat/completions"),
    ("/v1/chat%5Ccompletions", "/v1/chat/completions"),
    ("/v1/%63hat/completions", "/v1/chat/completions"),  # any percent-encoding decodes
    ("/", "/"),
    ("", "/"),
    ("///", "/"),
    ("/v1/Chat/Completions", "/v1/Chat/Completions"),  # case is kept (upstreams route case-sensitively)
    ("/v1/embeddings", "/v1/embeddings"),
])
def test_canonical_path(raw: str, path: str) -> None:
    assert canonical_path(raw) == path


def test_canonical_path_is_idempotent() -> None:
    for raw in ("//v1//chat%2Fcompletions/", "/v1\\x//y/", "/a%2F%2Fb"):
        once = canonical_path(raw)
        assert canonical_path(once) == once


# --------------------------------------------------------------------------- the allow-list matcher


@pytest.mark.parametrize(("method", "path", "allowed"), [
    ("POST", "/v1/embeddings", True),
    # managed by their own handlers now, never through the relay
    ("POST", "/v1/responses", False),
    ("POST", "/v1/responses/compact", False),
    ("POST", "/v1/messages/count_tokens", True),
    ("POST", "/v1/audio/transcriptions", True),
    ("GET", "/v1/embeddings", False),  # the method counts
    ("POST", "/v1/embeddings/x", False),  # no implicit prefix match
    ("GET", "/v1/files", False),  # stored-object listings are not in the default list
    ("GET", "/v1/chat/completions", False),
    ("GET", "/v1/responses/resp_123", False),
    ("POST", "/v1/batches", False),
    ("DELETE", "/v1/files/file-abc", False),
    ("POST", "/v1/Embeddings", False),
])
def test_default_allow_list(method: str, path: str, allowed: bool) -> None:
    assert _allowed(method, path, DEFAULT_RELAY_ALLOW) is allowed


@pytest.mark.parametrize(("allow", "method", "path", "allowed"), [
    (("GET /v1/files/*",), "GET", "/v1/files/file-abc", True),
    (("GET /v1/files/*",), "GET", "/v1/files/file-abc/content", True),  # shell patterns: * spans slashes
    (("GET /v1/files/*",), "GET", "/v1/files", False),
    (("* /v1/models",), "DELETE", "/v1/models", True),
    (("post /v1/embeddings",), "POST", "/v1/embeddings", True),  # entry methods in any case
    (("POST /v1/embeddings",), "post", "/v1/embeddings", False),  # aiohttp gives methods upper case
    (("POST /v1/images/[ge]*",), "POST", "/v1/images/generations", True),
    (("POST /v1/images/[ge]*",), "POST", "/v1/images/variations", False),
    (("GET /v1/models?",), "GET", "/v1/models", False),  # ? is one character
    ((), "POST", "/v1/embeddings", False),
    (("POST",), "POST", "/v1/embeddings", False),
])
def test_allow_entries(allow: tuple[str, ...], method: str, path: str, allowed: bool) -> None:
    assert _allowed(method, path, allow) is allowed


# --------------------------------------------------------------------------- relay URLs


@pytest.mark.parametrize(("base", "raw", "url"), [
    ("https://api.openai.com/v1", "/v1/embeddings", "https://api.openai.com/v1/embeddings"),
    ("https://api.openai.com/v1", "/v1/files?purpose=batch&limit=2",
     "https://api.openai.com/v1/files?purpose=batch&limit=2"),
    ("https://gw.example.com/openai/v1", "/v1/files/file-abc%2Fx/content",
     "https://gw.example.com/openai/v1/files/file-abc%2Fx/content"),
    ("https://api.openai.com/v1", "/v1/a..b/c.d", "https://api.openai.com/v1/a..b/c.d"),  # dots inside a segment
    ("https://api.openai.com/v1", "/v1/files?q=../..", "https://api.openai.com/v1/files?q=../.."),  # not the path
    ("https://api.openai.com/v1", "/v1/files/%252e%252e", "https://api.openai.com/v1/files/%252e%252e"),
])
def test_relay_url_keeps_the_path_as_sent(base: str, raw: str, url: str) -> None:
    assert relay_url(base, raw) == url


@pytest.mark.parametrize("raw", [
    "/v1/../admin", "/v1/files/../../secrets", "/v1/./files", "/v1/files/.", "/v1/%2e%2e/admin", "/v1/%2E%2e/x",
    "/v1/files/%2e", "/v1/files/..%2f..%2fadmin", "/v1/files\\..\\admin", "/v1/files%5c..%5cadmin", "/v1/..",
    "/v1/files/..?x=1",
])
def test_relay_url_refuses_dot_segments_however_spelled(raw: str) -> None:
    with pytest.raises(NotFound):
        relay_url("https://api.openai.com/v1", raw)


# --------------------------------------------------------------------------- the model of a body


def multipart(fields: list[tuple[str, str]], boundary: str = "----WebKitFormBoundary7MA4YWxkTrZu0gW",
              file: bool = True) -> tuple[bytes, str]:
    parts = []
    for name, value in fields:
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n')
    if file:
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="speech.mp3"\r\n'
                     "Content-Type: audio/mpeg\r\n\r\nID3\x03\x00binary\r\n")
    body = "".join(parts) + f"--{boundary}--\r\n"
    return body.encode(), f"multipart/form-data; boundary={boundary}"


@pytest.mark.parametrize(("raw", "content_type", "model"), [
    (b'{"model": "text-embedding-3-small", "input": "hi"}', "application/json", "text-embedding-3-small"),
    (b'{"model": "text-embedding-3-small"}', "application/json; charset=utf-8", "text-embedding-3-small"),
    (b'{"model": "gpt-4o"}', "", "gpt-4o"),  # no content type: tried as JSON
    (b'{"model": "gpt-4o"}', "text/plain", "gpt-4o"),
    (b'{"model": 42}', "application/json", None),
    (b'{"input": "no model"}', "application/json", None),
    (b'["model"]', "application/json", None),
    (b"model=whisper-1&language=en", "application/x-www-form-urlencoded", "whisper-1"),
    (b"model=gpt%2D4o&x=1", "application/x-www-form-urlencoded; charset=utf-8", "gpt-4o"),
    (b"language=en", "application/x-www-form-urlencoded", None),
    (*multipart([("model", "whisper-1"), ("language", "en")]), "whisper-1"),
    (*multipart([("language", "en"), ("model", "  gpt-4o-transcribe \r\n")]), "gpt-4o-transcribe"),
    (*multipart([("language", "en")]), None),
    (*multipart([("model", "dall-e-2")], boundary="x"), "dall-e-2"),
    (*multipart([("model", "dall-e-2")], boundary="'()+_,-./:=? "[:-1]), "dall-e-2"),  # every legal boundary char
    (*multipart([("model", "Zürich-model")], file=False), "Zürich-model"),
])
def test_model_of_every_body_kind(raw: bytes, content_type: str, model: str | None) -> None:
    assert _models_of(raw, content_type) == ([model] if model is not None else [])


def test_model_of_a_body_no_json_parser_reads_is_refused() -> None:
    with pytest.raises(BadRequest):
        _models_of(b"not json", "application/json")


@pytest.mark.parametrize("raw", [b'\xef\xbb\xbf{"model": "whisper-1"}', b'{"model": "whisper-1", "t": NaN}',
                                 '{"model": "whisper-1"}'.encode("utf-16"), b'{"model": "a", "model": "whisper-1"}',
                                 b'{"model": "whisper-1", "mod\\u0065l": "a"}'])
def test_model_of_json_only_a_lenient_parser_reads(raw: bytes) -> None:
    """What orjson cannot read a lenient upstream parser may (a BOM, UTF-16, NaN …); every model field counts."""
    assert "whisper-1" in _models_of(raw, "application/json")


def test_model_of_a_quoted_boundary() -> None:
    raw, _ = multipart([("model", "whisper-1")], boundary="abc def")
    assert _models_of(raw, 'multipart/form-data; boundary="abc def"') == ["whisper-1"]


def test_model_of_a_multipart_body_with_the_wrong_boundary_is_unknown() -> None:
    raw, _ = multipart([("model", "whisper-1")], boundary="right")
    assert _models_of(raw, "multipart/form-data; boundary=wrong") == []


def tenant(models: list[str] | None):  # type: ignore[no-untyped-def]
    cfg = load_config({"upstreams": {"u": {"base_url": "http://127.0.0.1:9"}}, "cache": {"backend": "memory"},
                       "tenants": [{"name": "acme", "keys": ["sk-acme"], "models": models}]}, env={})
    return cfg.tenants[0]


def test_check_model_refuses_a_model_outside_the_tenants_list() -> None:
    acme = tenant(["whisper-1", "text-embedding-3-small"])
    _check_model(json.dumps({"model": "text-embedding-3-small"}).encode(), "application/json", acme)
    _check_model(b'{"input": "no model field: the upstream refuses it"}', "application/json", acme)
    with pytest.raises(ModelNotFound) as err:
        _check_model(json.dumps({"model": "gpt-4o" + "x" * 300}).encode(), "application/json", acme)
    assert err.value.param == "model" and err.value.status == 404
    assert len(err.value.message) < 200
    raw, ct = multipart([("model", "gpt-4o-transcribe")])
    with pytest.raises(ModelNotFound):
        _check_model(raw, ct, acme)


def test_check_model_without_a_list_allows_everything() -> None:
    _check_model(b'{"model": "anything"}', "application/json", tenant(None))


MODEL = "gpt-4o-mini"


TENANT_KEY = "sk-tenant-acme-7f3a"


def tenant_config(upstream_url: str, **tenant: Any) -> dict[str, Any]:
    return base_config(upstream_url, tenants=[{"name": "acme", "keys": [TENANT_KEY], **tenant}],
                       summarizer={"retry_backoff_seconds": 0, "timeout_seconds": 2, "max_summary_tokens": 300})


def error_of(payload: Any) -> dict[str, Any]:
    assert isinstance(payload, dict) and set(payload) == {"error"}, payload
    error = payload["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    return dict(error)


def raw_multipart(parts: list[tuple[bytes, bytes]], boundary: bytes = b"BB") -> bytes:
    """A multipart body written byte for byte: each part's raw header lines, then its value."""
    out = b""
    for headers, value in parts:
        out += b"--" + boundary + b"\r\n" + headers + b"\r\n\r\n" + value + b"\r\n"
    return out + b"--" + boundary + b"--\r\n"


MP = "multipart/form-data; boundary=BB"


HOSTILE_BODIES = {
    # JSON orjson refuses and Python's json (FastAPI, vLLM, a LiteLLM proxy) reads, model and all
    "json-bom": (b'\xef\xbb\xbf{"model": "whisper-1", "input": "x"}', "application/json"),
    "json-utf16": ('{"model": "whisper-1", "input": "x"}'.encode("utf-16"), "application/json"),
    "json-nan": (b'{"model": "whisper-1", "input": "x", "temperature": NaN}', "application/json"),
    "json-1e400": (b'{"model": "whisper-1", "input": "x", "t": 1e400}', "application/json"),
    "json-lone-surrogate": (b'{"model": "whisper-1", "input": "\\ud800"}', "application/json"),
    # a first-wins parser reads the first of two model keys
    "json-duplicate-model": (b'{"model": "whisper-1", "model": "gpt-4o-mini"}', "application/json"),
    "json-octet-stream-bom": (b'\xef\xbb\xbf{"model": "whisper-1"}', "application/octet-stream"),
    # python-multipart reads the last name / header / boundary, the stdlib's parser the first
    "multipart-two-names": (raw_multipart([(b'Content-Disposition: form-data; name="x"; name="model"', b"whisper-1")]),
                            MP),
    "multipart-two-dispositions": (raw_multipart([(b'Content-Disposition: form-data; name="x"\r\n'
                                               b'Content-Disposition: form-data; name="model"', b"whisper-1")]), MP),
    "multipart-two-boundaries": (raw_multipart([(b'Content-Disposition: form-data; name="model"', b"whisper-1")],
                                           b"B2"), "multipart/form-data; boundary=B1; boundary=B2"),
}


@pytest.mark.usefixtures("shared_model_map")
@pytest.mark.parametrize("name", list(HOSTILE_BODIES))
async def test_relayed_bodies_parsers_read_differently_never_escape_the_model_list(
    upstream: FakeUpstream, start_proxy: StartProxy, name: str
) -> None:
    """A tenant limited to gpt-4o-mini: a body a lenient or another form parser reads as whisper-1 is refused."""
    raw, content_type = HOSTILE_BODIES[name]
    proxy = await start_proxy(tenant_config(upstream.base_url, models=[MODEL]))
    status, _headers, answer = await request(proxy, "POST", "/v1/audio/transcriptions", key=TENANT_KEY, data=raw,
                                             headers={"Content-Type": content_type})
    assert status in (400, 404), answer[:300]
    assert error_of(json.loads(answer))["code"] in ("model_not_found", "ambiguous_form_field", "invalid_json")
    assert upstream.other == []


@pytest.mark.usefixtures("shared_model_map")
async def test_plain_relayed_bodies_still_pass(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """Control: an allowed model in plain JSON, in escaped JSON and in a plain multipart field is relayed."""
    proxy = await start_proxy(tenant_config(upstream.base_url, models=[MODEL]))
    bodies = [(json.dumps({"model": MODEL, "input": "héllo"}).encode(), "application/json"),  # \u00e9: the slow path
              (raw_multipart([(b'Content-Disposition: form-data; name="model"', MODEL.encode()),
                          (b'Content-Disposition: form-data; name="file"; filename="a.wav"\r\n'
                           b"Content-Type: audio/wav", b"RIFF")]), MP)]
    for raw, content_type in bodies:
        status, _headers, answer = await request(proxy, "POST", "/v1/audio/transcriptions", key=TENANT_KEY, data=raw,
                                                 headers={"Content-Type": content_type})
        assert status == 200, answer[:300]
    assert len(upstream.other) == 2


@pytest.mark.usefixtures("shared_model_map")
@pytest.mark.parametrize("path", ["/v1/ctxproxy%2Fpolicy", "/v1/ctxproxy%2fexplain", "/v1//ctxproxy/policy"])
async def test_the_proxys_namespace_is_never_relayed_however_spelled(upstream: FakeUpstream, start_proxy: StartProxy,
                                                                    path: str) -> None:
    """The proxy's own namespace is never relayed upstream, however its path is spelled: ``/v1/ctxproxy%2Fpolicy``
    (an encoded slash) used to be relayed with the operator's key."""
    proxy = await start_proxy(base_config(upstream.base_url))  # no tenants: every other path is relayed
    for method in ("GET", "POST"):
        status, _headers, answer = await request(proxy, method, path, data=b"{}" if method == "POST" else None)
        assert status == 404, answer[:300]
        error_of(json.loads(answer))
    assert upstream.other == []


def error_shape(raw: bytes) -> dict[str, Any]:
    body = json.loads(raw)
    assert set(body) == {"error"} and set(body["error"]) >= {"message", "type", "param", "code"}, body
    return dict(body["error"])


@pytest.mark.usefixtures("shared_model_map")
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/chat/completions/chatcmpl-abc123/messages",
                                  "/v1/files"])
async def test_stored_object_listings_are_not_relayed_for_tenants(upstream: FakeUpstream, start_proxy: StartProxy,
                                                                  path: str) -> None:
    """With tenants, GET listings of stored objects answer 403/404 (OpenAI's shape) and reach nobody."""
    proxy = await start_proxy(tenant_config(upstream.base_url, models=[MODEL]))
    status, _headers, raw = await request(proxy, "GET", path, key=TENANT_KEY)
    assert status in (403, 404), raw[:300]
    error_shape(raw)
    assert upstream.other == [] and upstream.chat == []


@pytest.mark.usefixtures("shared_model_map")
async def test_model_allow_list_holds_on_multipart_bodies(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """A multipart /v1/audio/transcriptions with a model outside the tenant's allow-list is refused."""
    proxy = await start_proxy(tenant_config(upstream.base_url, models=[MODEL]))
    form = aiohttp.FormData()
    form.add_field("model", "whisper-1")
    form.add_field("file", b"RIFF\x00\x00\x00\x00WAVEfmt ", filename="a.wav", content_type="audio/wav")
    status, _headers, raw = await request(proxy, "POST", "/v1/audio/transcriptions", key=TENANT_KEY, data=form)
    assert status in (403, 404), raw[:300]
    assert error_shape(raw)["code"] in ("model_not_found", "forbidden", "not_found", "permission_denied")
    assert upstream.other == []


async def test_the_stored_chat_completions_list_is_relayed_without_tenants(
    upstream: FakeUpstream, start_proxy: StartProxy
) -> None:
    """Without tenants, ``GET /v1/chat/completions`` (OpenAI's list of stored completions) is relayed with its
    query, not taken for a managed chat request."""
    proxy = await start_proxy(base_config(upstream.base_url))
    status, _, raw = await request(proxy, "GET", "/v1/chat/completions?limit=2&model=gpt-4o-mini")
    assert status == 200, raw[:300]
    assert [r.path for r in upstream.other] == ["/v1/chat/completions?limit=2&model=gpt-4o-mini"]


@pytest.mark.parametrize("kind", ["multipart", "urlencoded"])
async def test_a_body_with_two_model_fields_is_held_to_the_tenants_allow_list(
    upstream: FakeUpstream, start_proxy: StartProxy, kind: str
) -> None:
    """A multipart or urlencoded body with two ``model`` fields is refused for a tenant with an allow-list: the
    proxy and the upstream might read different ones."""
    proxy = await start_proxy(base_config(upstream.base_url, tenants=[
        {"name": "acme", "keys": [TENANT_KEY], "models": ["whisper-1"]}]))
    data: Any
    if kind == "multipart":
        data = aiohttp.FormData()
        data.add_field("model", "whisper-1")
        data.add_field("model", "gpt-4o-transcribe")
        data.add_field("file", b"RIFF\x00\x00\x00\x00WAVEfmt ", filename="a.wav", content_type="audio/wav")
    else:
        data = aiohttp.FormData([("model", "whisper-1"), ("model", "gpt-4o-transcribe")])
    status, _, raw = await request(proxy, "POST", "/v1/audio/transcriptions", key=TENANT_KEY, data=data)
    assert status in (400, 403, 404), raw[:300]
    assert upstream.other == []


@pytest.mark.parametrize("disposition", ["name*=UTF-8''model", "name*=utf-8''%6Dodel", 'name="mod\\el"'])
async def test_every_spelling_of_a_multipart_model_field_is_held_to_the_allow_list(
    serve_routes: Callable[[dict[str, Handler]], Awaitable[str]], start_proxy: StartProxy, disposition: str
) -> None:
    """RFC 2231 and escaped spellings of a multipart ``model`` field name (``name*=UTF-8''model``,
    ``name="mod\\el"``) are held to the tenant's allow-list: never relayed past it."""
    used: list[Any] = []

    async def transcriptions(request: web.Request) -> web.Response:
        form = await request.post()
        used.append(form.get("model"))
        return web.json_response({"text": "hello"})

    base = await serve_routes({"/v1/audio/transcriptions": transcriptions})
    proxy = await start_proxy(base_config(base, tenants=[
        {"name": "acme", "keys": [TENANT_KEY], "models": ["whisper-1"]}]))
    boundary = "----ctxproxyBoundary7MA4YWxk"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; {disposition}\r\n\r\ngpt-4o-transcribe\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n"
            f"Content-Type: audio/wav\r\n\r\nRIFF\x00\x00\x00\x00WAVEfmt \r\n--{boundary}--\r\n").encode()
    status, _, raw = await request(proxy, "POST", "/v1/audio/transcriptions", key=TENANT_KEY, data=body,
                                   headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    assert status in (400, 403, 404), (raw[:300], "the upstream used model", used)
    assert used == []


def client(proxy: Any, key: str = "sk-client-key", **kw: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=proxy.base_url, api_key=key, **kw)


async def post_raw(url: str, data: bytes, headers: dict[str, str] | None = None) -> tuple[int, Any, bytes]:
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    async with aiohttp.ClientSession() as s, s.post(url, data=data, headers=hdrs) as r:
        return r.status, r.headers, await r.read()


async def test_relay_post_embeddings_untouched(upstream: FakeUpstream, start_proxy: Any) -> None:
    cfg = base_config(upstream.base_url)
    cfg["upstreams"]["fake"].pop("api_key")
    proxy = await start_proxy(cfg)
    raw = b'{"model": "text-embedding-3-small",  "input": ["a", "b"], "x": 1.50}'
    status, headers, out = await post_raw(proxy.url + "/v1/embeddings", raw,
                                          {"Authorization": "Bearer sk-client", "X-Custom": "yes"})
    assert status == 200
    got = upstream.other[-1]
    assert got.path == "/v1/embeddings"
    assert got.raw == raw
    assert got.headers["X-Custom"] == "yes"
    assert got.headers["Authorization"] == "Bearer sk-client"
    assert json.loads(out) == {"object": "list", "path": "/v1/embeddings", "echo": raw.decode()}
    assert headers["Content-Type"].startswith("application/json")


async def test_relay_openai_client_embeddings(upstream: FakeUpstream, start_proxy: Any) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    async with client(proxy) as c:
        raw = await c.embeddings.with_raw_response.create(model="text-embedding-3-small", input="hi")
    assert raw.status_code == 200
    assert json.loads(upstream.other[-1].raw)["input"] == "hi"
    assert upstream.other[-1].headers["Authorization"] == "Bearer sk-upstream-secret"


async def test_relay_get_with_query_untouched(upstream: FakeUpstream, start_proxy: Any) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    async with aiohttp.ClientSession() as s, s.get(proxy.url + "/v1/files?x=1&purpose=fine-tune") as r:
        assert r.status == 200
        out = await r.json()
    assert upstream.other[-1].path == "/v1/files?x=1&purpose=fine-tune"
    assert out["path"] == "/v1/files?x=1&purpose=fine-tune"
    assert upstream.other[-1].raw == b""


async def test_relay_encoded_query_delimiters_untouched(upstream: FakeUpstream, start_proxy: Any) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    path_qs = "/v1/files?q=a%26b&n=1%2B1&after=file-1"
    async with aiohttp.ClientSession() as s, s.get(URL(proxy.url + path_qs, encoded=True)) as r:
        assert r.status == 200
    assert upstream.other[-1].path == path_qs


async def test_relay_encoded_slash_in_path_untouched(upstream: FakeUpstream, start_proxy: Any) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    path = "/v1/files/file-a%2Fb/content"
    async with aiohttp.ClientSession() as s, s.get(URL(proxy.url + path, encoded=True)) as r:
        assert r.status == 200
    assert upstream.other[-1].path == path


async def test_relay_streaming_path(upstream: FakeUpstream, start_proxy: Any) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    async with aiohttp.ClientSession() as s, s.post(proxy.url + "/v1/stream-test", data=b"{}") as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = [line async for line in r.content]
    assert b"".join(events) == b"data: 0\n\ndata: 1\n\ndata: 2\n\ndata: [DONE]\n\n"


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


async def test_client_gone_from_a_relayed_stream_nothing_leaks(start_proxy: Any) -> None:
    """The generic /v1/* relay: a client leaving a stream closes the upstream request too."""
    slow = await SlowStreamUpstream(chunks=3, interval=0.01).start()
    try:
        proxy = await start_proxy(base_config(slow.base_url))
        async with aiohttp.ClientSession() as s, s.get(proxy.url + "/v1/anything/stream") as r:
            assert r.status == 200  # warm: one full relayed stream
            await r.read()
        before = Resources.take(proxy)
        slow.chunks, slow.interval = 50, 3600
        async with aiohttp.ClientSession() as s:
            r = await s.get(proxy.url + "/v1/anything/stream")
            assert r.status == 200
            await asyncio.wait_for(r.content.readuntil(b"\n\n"), 3)
            assert slow.active == 1
            r.close()
        assert await eventually(lambda: slow.active == 0 and slow.cancelled == 1)
        await settle(proxy, None, before)
    finally:
        await slow.stop()


@pytest.mark.parametrize("mode", ["close_at_once", "garbage", "silent", "short_body", "stall_body"])
async def test_raw_upstream_faults_on_the_relay(start_proxy: Any, mode: str) -> None:
    """Any other /v1/* path: failures before the answer are 502/504; after it started, the client's answer is
    cut short (never a clean end) and the proxy stays up."""
    raw_up = await RawUpstream(mode).start()
    try:
        cfg = base_config(raw_up.url)
        cfg["server"] = {"first_byte_timeout": 0.5, "idle_timeout": 0.5}
        proxy = await start_proxy(cfg)
        async with aiohttp.ClientSession() as s:
            started = time.monotonic()
            async with s.get(proxy.url + "/v1/files/file-1/content") as r:
                status = r.status
                try:
                    raw = await r.read()
                    complete = True
                except aiohttp.ClientPayloadError:
                    raw, complete = b"", False
            assert time.monotonic() - started < 3
        if mode in ("short_body", "stall_body"):
            assert status == 200 and not complete  # headers were relayed, then the body was cut
        else:
            assert status == (504 if mode == "silent" else 502)
            openai_error(raw)
        assert await eventually(lambda: Resources.take(proxy).acquired == 0)
    finally:
        await raw_up.stop()


UPSTREAM_KEY = "sk-ant-upstream-secret"


def anthropic_config(upstream: FakeUpstream, *, key: str | None = UPSTREAM_KEY, api: str = "anthropic", **extra: Any
           ) -> dict[str, Any]:
    up: dict[str, Any] = {"base_url": upstream.url if api == "anthropic" else upstream.base_url, "api": api}
    if key:
        up["api_key"] = key
    out: dict[str, Any] = {
        "upstreams": {"a": up},
        "models": [{"name": CLAUDE, "context_window": 200_000, "max_output_tokens": 64_000}],
        "cache": {"backend": "memory"},
        "summarizer": {"retry_backoff_seconds": 0},
        "server": {"idle_timeout": 5},
    }
    out.update(extra)
    return out


async def post_messages(proxy: RunningProxy, payload: Any, headers: dict[str, str] | None = None,
               path: str = "/v1/messages") -> tuple[int, Any]:
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    async with aiohttp.ClientSession() as s, s.post(proxy.url + path, data=data, headers={
            "x-api-key": "sk-ant-client", "content-type": "application/json", **(headers or {})}) as r:
        return r.status, await r.json(content_type=None)


def tenants(*models: str) -> list[dict[str, Any]]:
    return [{"name": "team", "keys": ["proxy-key-1"], **({"models": list(models)} if models else {})}]


@pytest.mark.usefixtures("shared_model_map")
async def test_unmanaged_messages_paths_are_relayed_the_anthropic_way(
        upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """/v1/messages/batches (not managed) goes to {root}/v1/messages/batches with x-api-key, for tenants too."""
    cfg = anthropic_config(upstream, tenants=tenants(), relay={"allow": ["POST /v1/messages/batches"]})
    proxy = await start_proxy(cfg)
    status, _ = await post_messages(proxy, {"requests": []}, {"x-api-key": "proxy-key-1"}, path="/v1/messages/batches")
    assert status == 200
    sent = upstream.other[-1]
    headers = {k.lower(): v for k, v in sent.headers.items()}
    assert sent.path == "/v1/messages/batches"
    assert headers["x-api-key"] == UPSTREAM_KEY and "authorization" not in headers


Event = tuple[str | None, Any]


async def proxy_for(upstream: FakeUpstream, start_proxy: StartProxy, **server: Any) -> RunningProxy:
    return await start_proxy(base_config(upstream.base_url, server={"idle_timeout": 5, **server}))


def parse_sse(raw: bytes) -> list[Event]:
    """(event name or None, parsed data or the raw data string) for every SSE event in ``raw``."""
    out: list[Event] = []
    for block in raw.replace(b"\r\n", b"\n").split(b"\n\n"):
        name: str | None = None
        data: list[str] = []
        for line in block.decode("utf-8", "replace").split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
        if name is None and not data:
            continue
        text = "\n".join(data)
        try:
            out.append((name, json.loads(text)))
        except ValueError:
            out.append((name, text))
    return out


async def post_stream(url: str, body: dict[str, Any], headers: dict[str, str] | None = None
                      ) -> tuple[int, bytes, BaseException | None]:
    """POST and read the whole streamed body; a cut connection is returned, not raised."""
    hdrs = {"Authorization": "Bearer sk-client", **(headers or {})}
    async with aiohttp.ClientSession() as s, s.post(url, json=body, headers=hdrs) as r:
        chunks: list[bytes] = []
        try:
            async for chunk in r.content.iter_any():
                chunks.append(chunk)
        except aiohttp.ClientError as exc:
            return r.status, b"".join(chunks), exc
        return r.status, b"".join(chunks), None


@pytest.mark.usefixtures("shared_model_map")
async def test_unknown_relayed_sse_stream_ends_on_clean_close(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """an unknown relayed SSE path ends when the upstream closes cleanly: bytes unchanged, nothing added."""
    proxy = await proxy_for(upstream, start_proxy)
    status, raw, cut = await post_stream(proxy.base_url + "/sse-clean-close", {"job": 1})
    assert (status, cut) == (200, None)
    assert upstream.sent and raw == upstream.sent


@pytest.mark.usefixtures("shared_model_map")
async def test_truncated_unknown_relayed_sse_stream_still_surfaces_an_error(
    upstream: FakeUpstream, start_proxy: StartProxy
) -> None:
    """an unknown relayed SSE stream cut mid-way is never presented as complete."""
    upstream.wire_mode = "break"
    proxy = await proxy_for(upstream, start_proxy)
    status, raw, cut = await post_stream(proxy.base_url + "/sse-clean-close", {"job": 1})
    assert status == 200
    assert raw.startswith(upstream.sent)
    added = parse_sse(raw[len(upstream.sent):])
    # either an error event after the upstream's bytes, or the client's connection is cut too
    assert cut is not None or any(isinstance(d, dict) and ("error" in d or d.get("type") == "error")
                                  for _, d in added), added
