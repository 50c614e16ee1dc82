"""Every other ``/v1/*`` path, relayed untouched to the default upstream (streaming-safe).

Without tenants the client's own credentials are forwarded and every path is
relayed. With tenants the operator's key is used upstream, so only the paths and
methods of ``relay.allow`` are relayed (no stored-object listings by default), and
the tenant's model allow-list holds on every body, JSON or multipart. A path that
spells a managed wire's path differently (``/v1/chat/completions/``) goes through
that wire's pipeline, never around it.
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
import re
import time
from email.message import Message
from email.parser import BytesParser
from typing import Any
from urllib.parse import parse_qs, unquote

import orjson
from aiohttp import web

from proxy.core.deadline import deadline
from proxy.core.errors import BadRequest, ModelNotFound, NotFound, PermissionDenied
from proxy.core.fields import go_fold
from proxy.serve.http import ERROR_WIRE, Handler, client_keys, read_body, request_id, state
from proxy.serve.streaming import relay_answer
from proxy.settings import Tenant
from proxy.upstream.anthropic import anthropic_headers
from proxy.upstream.client import ClientError
from proxy.upstream.http import HTTPAnswer, open_request, read_error, response_headers, upstream_headers
from proxy.wire.sse import StreamWatcher

_SLASHES = re.compile(r"/{2,}")


def canonical_path(raw_path: str) -> str:
    """The path as the upstream would route it: decoded, slashes collapsed, no trailing slash."""
    path = unquote(raw_path.split("?", 1)[0]).replace("\\", "/")
    path = _SLASHES.sub("/", path)
    return path.rstrip("/") or "/"


def make_relay(managed: dict[str, Handler]) -> Handler:
    """The relay handler; ``managed`` maps canonical managed paths to their handlers (for POST)."""

    async def relay(request: web.Request) -> web.StreamResponse:
        path = canonical_path(request.raw_path)
        if path == "/v1/ctxproxy" or path.startswith("/v1/ctxproxy/"):
            # the proxy's own namespace, however spelled (/v1/ctxproxy%2Fpolicy), is never relayed
            raise NotFound(f"No route for {request.method} {path}.")
        wires = state(request).wires
        wire = wires.for_path(path, below=True)
        if wire is not None:  # a wire's clients parse its error shape (Anthropic's on /v1/messages/batches)
            request[ERROR_WIRE] = wire
        handler = managed.get(path) if request.method == "POST" else None
        if handler is not None:
            return await handler(request)
        if request.method == "POST" and wires.for_path(path) is not None:
            # a managed path (one with the model in it) spelled so that no route took it: never around the pipeline
            raise NotFound(f"No route for POST {path[:200]}: send it to the wire's own path, spelled as documented.")
        return await _relay(request, path)

    return relay


async def _relay(request: web.Request, path: str) -> web.StreamResponse:
    st = state(request)
    config = st.config
    tenant = st.runtime.authenticate(client_keys(request))
    if tenant is not None and not _allowed(request.method, path, config.settings.relay.allowed()):
        raise PermissionDenied(f"{request.method} {path} is not relayed for tenants on this proxy "
                               "(relay.allow in its configuration).")
    upstream = config.settings.upstreams[config.default_upstream]
    raw = await read_body(request) if request.can_read_body else None
    if tenant is not None and raw:
        _check_model(raw, request.headers.get("Content-Type", ""), tenant)
    forward = config.forwards_client_auth(upstream)
    if upstream.api == "anthropic":  # base_url is the API root, and the key goes in x-api-key
        headers = anthropic_headers(request.headers, upstream, forward_client_auth=forward,
                                    request_id=request_id(request, st.ids))
        url = relay_url(upstream.base_url + "/v1", request.raw_path)
    else:
        headers = upstream_headers(request.headers, upstream, forward_client_auth=forward,
                                   request_id=request_id(request, st.ids))
        url = relay_url(upstream.base_url, request.raw_path)
    if "Content-Type" in request.headers:
        headers["Content-Type"] = request.headers["Content-Type"]
    server = config.settings.server
    response = await open_request(st.shared.pool.session(upstream), request.method, url,
                                  data=raw, headers=headers, first_byte_timeout=server.first_byte_timeout)
    if response.status >= 400:
        raise await read_error(response, server.idle_timeout, upstream.api_key)
    if response.content_type == "text/event-stream":
        return await relay_answer(request, HTTPAnswer(response, upstream.api_key), response_headers({}),
                                  idle_timeout=server.idle_timeout,
                                  watcher=StreamWatcher(time.perf_counter(), st.wires.stream_end_for_path(path)))
    out = web.StreamResponse(status=response.status, headers=response_headers(response.headers))
    try:
        await out.prepare(request)
        while True:
            try:
                async with deadline(server.idle_timeout):
                    chunk = await response.readany()
            except (asyncio.TimeoutError, ClientError, OSError):
                # the upstream failed after the answer started: cut the client's connection, so the
                # truncated body can never look complete (and the client is not left waiting for the rest)
                if request.transport is not None:
                    request.transport.close()
                return out
            if not chunk:
                break
            await out.write(chunk)
        await out.write_eof()
    finally:
        response.release()  # (its connection kept only when the answer was read to its end)
    return out


def _allowed(method: str, path: str, allow: tuple[str, ...]) -> bool:
    for entry in allow:
        m, _, pattern = entry.partition(" ")
        if (m == "*" or m.upper() == method) and fnmatch.fnmatchcase(path, pattern):
            return True
    return False


def relay_url(base_url: str, raw_path: str) -> str:
    """The upstream URL for a relayed ``/v1/...`` path, kept percent-encoded exactly as the client sent it.

    Dot segments are refused: a relayed path may not climb out of the upstream's base path.
    """
    tail = raw_path[len("/v1"):] if raw_path.startswith("/v1") else raw_path
    decoded = unquote(tail.split("?", 1)[0]).replace("\\", "/")
    if any(segment in (".", "..") for segment in decoded.split("/")):
        raise NotFound("Relayed paths may not contain '.' or '..' segments.")
    return base_url + tail


def _check_model(raw: bytes, content_type: str, tenant: Tenant) -> None:
    """A tenant's model allow-list holds on every endpoint and body kind, not only chat completions.

    Every ``model`` field counts (upstreams differ in which of two they read), and a body whose model
    field parsers could read differently is refused rather than relayed: JSON that only a lenient parser
    reads (a BOM, UTF-16, NaN, 1e400, a lone surrogate), a multipart body with two boundaries, or a part
    with two ``Content-Disposition`` headers or two ``name`` parameters.
    """
    allowed = tenant.settings.models
    if allowed is None:
        return
    for model in _models_of(raw, content_type):
        if model not in allowed:
            raise ModelNotFound(f"The model {model[:100]!r} does not exist or you do not have access to it.",
                                param="model")


def _ambiguous(what: str) -> BadRequest:
    return BadRequest(f"{what}; send one plain name=\"...\" field per part and one boundary.",
                      code="ambiguous_form_field")


def _models_of(raw: bytes, content_type: str) -> list[str]:
    kind = content_type.split(";", 1)[0].strip().lower()
    if kind == "multipart/form-data":
        return _multipart_models(raw, content_type)
    if kind == "application/x-www-form-urlencoded":
        return parse_qs(raw.decode("utf-8", "replace")).get("model", [])
    return _json_models(raw)


def _multipart_models(raw: bytes, content_type: str) -> list[str]:
    message = BytesParser().parsebytes(b"Content-Type: " + content_type.encode("latin-1", "replace")
                                       + b"\r\n\r\n" + raw)
    if sum(1 for key, _ in message.get_params() or [] if key.strip().lower() == "boundary") > 1:
        # parsers disagree on which of two boundaries counts (the first here, the last in python-multipart)
        raise _ambiguous("The multipart Content-Type names more than one boundary")
    models: list[str] = []
    for part in message.walk():
        if part is message:
            continue
        dispositions = part.get_all("content-disposition") or []
        if len(dispositions) > 1:
            raise _ambiguous("A multipart part has more than one Content-Disposition header")
        disposition = str(dispositions[0]) if dispositions else ""
        if "name*" in disposition.lower() or "\\" in disposition:
            # RFC 2231 and quoted-pair spellings decode differently in different form parsers
            raise BadRequest("A multipart field name is encoded ambiguously (name* or a backslash); send "
                             "plain name=\"...\" fields.", code="ambiguous_form_field")
        names = [v for k, v in _disposition_params(part) if k.strip().lower() == "name"]
        if len(names) > 1:
            raise _ambiguous("A multipart part names its field more than once")
        if names and names[0] == "model":
            models.extend(_part_values(part))
    return models


def _disposition_params(part: Message) -> list[tuple[str, str]]:
    params = part.get_params(header="content-disposition") or []
    return [(str(k), str(v)) for k, v in params]


def _part_values(part: Message) -> list[str]:
    """A model part's value as parsers may read it: transfer-decoded, and (with a transfer encoding) as sent."""
    decoded = part.get_payload(decode=True)
    out = [decoded.decode("utf-8", "replace").strip() if isinstance(decoded, bytes) else ""]
    if part.get("content-transfer-encoding") is not None:  # most form parsers ignore it
        sent = part.get_payload(decode=False)
        out.append(sent.strip() if isinstance(sent, str) else "")
    return list(dict.fromkeys(out))


class _Pairs(dict[str, Any]):
    """A JSON object that also remembers every (key, value) pair, duplicates included."""

    pairs: list[tuple[str, Any]]


def _pairs_hook(pairs: list[tuple[str, Any]]) -> _Pairs:
    obj = _Pairs(pairs)
    obj.pairs = pairs
    return obj


def _json_models(raw: bytes) -> list[str]:
    """The ``model`` fields of a JSON body, as any common parser reads them; refused if none can parse it."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        body = None
    else:
        if not isinstance(body, dict):
            return []
        if raw.lower().count(b'"model"') <= 1 and b"\\u" not in raw:
            # Go's encoding/json (Ollama, LocalAI, one-api …) matches keys case-insensitively: "Model" counts
            return [v for k, v in body.items() if go_fold(k) == "model" and isinstance(v, str)]
    # a duplicate (or escaped) key, or JSON that only a lenient parser reads (Python's reads a BOM, UTF-16,
    # NaN, 1e400 and lone surrogates, and an upstream written in Python would): every model field counts
    try:
        lenient: Any = json.loads(raw, object_pairs_hook=_pairs_hook)
    except (ValueError, RecursionError):
        raise BadRequest("The request body is not valid JSON.", code="invalid_json") from None
    if not isinstance(lenient, _Pairs):
        return []
    return [v for k, v in lenient.pairs if go_fold(k) == "model" and isinstance(v, str)]
