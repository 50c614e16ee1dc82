"""``POST /v1/responses/compact``: relayed to the route's upstream, or answered by ctxproxy's own summariser.

Codex calls the endpoint on its own and has no fallback when a gateway answers 404,
so every upstream gets one: ``upstreams.<name>.responses_compact`` is ``relay`` (send it
on), ``emulate`` (answer it here) or ``auto`` (the default: relay, and emulate when the
upstream answers 404/405/501). Routes served through litellm are always emulated.

An emulated answer has the shape ``client.responses.compact(...)`` parses
(``CompactedResponse``: ``object: "response.compaction"``, ``output``, ``usage``): the
input's user messages, then one ``message`` item (role ``user``, text starting with
``COMPACT_PREFIX``) holding the summary. A message is the one item every Responses
upstream accepts back as input, and a user message is what Codex keeps of a compacted
history (it drops developer and system messages) and what its own local compaction
writes; the Responses wire recognises it on later requests and pins it, as it pins the
provider's own ``compaction`` item. The summary comes from the same content-addressed
cache and single flight as the pipeline's, so compacting a conversation twice, or
compacting one whose prefix the pipeline already summarised, costs no second call.

Either way the input is read and counted first (in a worker thread for a large body), and
the tenant's ``max_context_tokens`` holds: a compaction sends the whole input to a model,
so one whose visible input exceeds the cap is refused (what the provider holds is not
counted: ctxproxy cannot see it).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from plugins.base import CachedSummary, Summarizer, SummaryScope
from plugins.context.summarising import summary_text
from plugins.summarizers.llm import LLMParams, LLMSummarizer
from proxy.core.bands import split_bands, split_turns
from proxy.core.conversation import Conversation
from proxy.core.errors import BadRequest, CtxProxyError, SummarizerFailed, SummaryUnavailable, UpstreamStatus
from proxy.core.items import USER, Item
from proxy.core.offload import run_step
from proxy.core.pairing import repair
from proxy.pipeline import chain_hashes, check_visible
from proxy.policy import ModelRoute, Policy
from proxy.runtime import Runtime
from proxy.serve.http import (
    ERROR_SHAPE,
    OVERRIDE_HEADER,
    RESPONSE_HEADERS,
    client_keys,
    dumps_body,
    header_safe,
    json_response,
    parse_body,
    read_body,
    request_id,
    state,
)
from proxy.serve.requestlog import RequestRecord
from proxy.serve.streaming import relay_answer
from proxy.upstream.base import Outgoing
from proxy.wire.responses import WIRE, is_compact_summary, provider_state
from proxy.wire.responses_items import COMPACT_PREFIX, ResponsesItem, kind_of
from proxy.wire.sse import RESPONSES, StreamWatcher

COMPACT_PATH = "/responses/compact"
NOT_SERVED = frozenset({404, 405, 501})  # what an upstream without the endpoint answers


async def compact_handler(request: web.Request) -> web.StreamResponse:
    st = state(request)
    served = st.served  # in-flight requests keep the runtime they started with
    runtime = served.runtime
    rid = request_id(request)
    headers: CIMultiDict[str] = CIMultiDict({"x-request-id": rid})
    request[RESPONSE_HEADERS] = headers
    request[ERROR_SHAPE] = "openai"
    record = RequestRecord(request_id=rid, started=time.perf_counter(), wire=WIRE.name, event="compact")
    status = 500
    try:
        tenant = runtime.authenticate(client_keys(request))
        record.tenant = tenant.name if tenant else "default"
        raw = await read_body(request)
        offload = len(raw) > runtime.config.settings.server.offload_bytes
        body = await run_step(offload, parse_body, raw)
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise BadRequest("'model' is required and must be a string", param="model", code="missing_model")
        route = runtime.route(model)
        policy = runtime.policy(tenant, model, request.headers.get(OVERRIDE_HEADER))  # the tenant's allow-list
        record.model = route.name
        counter = runtime.tokenizers.get(route.encoding)
        conversation = await run_step(offload, WIRE.parse, body, counter)
        # the tenant's cap holds for a compaction too, relayed or emulated, on what ctxproxy can see
        check_visible(conversation.fixed_tokens + sum(item.tokens for item in conversation.items), policy,
                      await runtime.calibration_factor(route, policy.tenant), WIRE.field, conversation.unmanaged)
        mode = compact_mode(runtime, route)
        if mode != "emulate":
            try:
                response = await _relay(request, body, raw, route, headers)
                status = response.status
                return response
            except UpstreamStatus as exc:
                if mode == "relay" or exc.status not in NOT_SERVED:
                    raise
                headers["x-ctxproxy-warning"] = header_safe(
                    f"the upstream answered {exc.status} to /responses/compact: compacted by ctxproxy's summariser")
        out = await emulate(runtime, body, route, policy, rid, conversation, offload)
        headers["x-ctxproxy-compact"] = "emulated"
        status = 200
        return json_response(out, headers=headers)
    except CtxProxyError as exc:
        status, record.error = exc.status, exc.code
        raise
    finally:
        record.status = status
        record.overhead = time.perf_counter() - record.started
        st.metrics.finished(record.tenant, record.model or "other", status, overhead=None, upstream=None, ttft=None,
                            usage=None, wire=WIRE.name)
        if st.config.settings.logging.requests:
            record.log()


def compact_mode(runtime: Runtime, route: ModelRoute) -> str:
    """relay | emulate | auto for this route (litellm has no compact endpoint to relay to)."""
    if route.provider == "litellm":
        return "emulate"
    upstream = runtime.config.settings.upstreams.get(route.upstream)
    return upstream.responses_compact if upstream is not None else "auto"


async def _relay(request: web.Request, body: dict[str, Any], raw: bytes, route: ModelRoute,
                 headers: CIMultiDict[str]) -> web.StreamResponse:
    """The client's bytes (with the route's upstream model name) to the upstream's compact endpoint."""
    st = state(request)
    if route.upstream_model != body.get("model"):
        body = {**body, "model": route.upstream_model}
        raw = dumps_body(body)
    call = Outgoing(WIRE.name, COMPACT_PATH, body, raw, False, request.headers, headers["x-request-id"])
    answer = await st.served.providers.for_route(route).send(route, call)
    return await relay_answer(request, answer, headers, idle_timeout=st.config.settings.server.idle_timeout,
                              watcher=StreamWatcher(time.perf_counter(), RESPONSES))


def summarizer_for(policy: Policy) -> Summarizer:
    """The policy's summariser when it makes summaries; else the default ``llm`` one (compact must answer)."""
    bound = policy.manager.summarizer
    if bound is not None and bound.name != "drop":
        return bound
    return LLMSummarizer(LLMParams())


async def emulate(runtime: Runtime, body: dict[str, Any], route: ModelRoute, policy: Policy,
                  rid: str, conversation: Conversation, offload: bool = False) -> dict[str, Any]:
    """A ``response.compaction`` object from ctxproxy's summariser (nothing is forwarded).

    ``conversation`` is ``body`` parsed; with ``offload`` (a large body) the work on its items runs in a
    worker thread.
    """
    held = provider_state(body)
    if held is not None:
        raise BadRequest(f"This conversation continues from {held}: its history is held by the provider, and "
                         "the upstream does not serve /responses/compact, so it cannot be compacted here.",
                         param=held, code="unsupported_compaction")
    if conversation.unmanaged is not None:
        raise BadRequest("The input refers to items held by the provider (item_reference), and the upstream does "
                         "not serve /responses/compact, so it cannot be compacted here.", param="input",
                         code="unsupported_compaction")
    counter = runtime.tokenizers.get(route.encoding)
    items, turns, output = await run_step(offload, _compaction_input, conversation)
    summary = await _summary(runtime, route, policy, rid, turns, counter, offload) if turns else None
    received = conversation.fixed_tokens + sum(item.tokens for item in items)
    produced = 0
    if summary is not None:
        text = f"{COMPACT_PREFIX}\n{summary_text(summary.covered_turns, summary.text)}"
        output.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})
        produced = counter.text(text)
    return {
        "id": f"resp_ctxproxy_{uuid.uuid4().hex}",
        "object": "response.compaction",
        "created_at": int(time.time()),
        "output": output,
        "usage": {"input_tokens": received, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                  "output_tokens": produced, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": received + produced},
    }


def _compaction_input(conversation: Conversation) -> tuple[list[Item], list[list[Item]], list[Any]]:
    """The input's items (repaired), its turns after the system band, and its user messages as output items."""
    items = conversation.items
    if not conversation.paired:
        items, _ = repair(items, WIRE, WIRE.merge_call_runs)
    bands = split_bands(items)
    turns = split_turns(items[len(bands.system):])
    output: list[Any] = [user_message(item) for item in items
                         if item.role == USER and not is_compact_summary(_main(item))]
    return items, turns, output


async def _summary(runtime: Runtime, route: ModelRoute, policy: Policy, rid: str, turns: list[list[Item]],
                   counter: Any, offload: bool) -> CachedSummary:
    """The summary of every turn: from the cache when it holds one, else made once (single flight)."""
    store = runtime.summaries
    services = runtime.services(route, policy, request_id=rid)
    summarizer = summarizer_for(policy)
    summarize = summarizer.bind(services)
    if store is None or summarize is None:
        raise SummarizerFailed("ctxproxy has no summariser to compact this conversation with.")
    scope = SummaryScope(policy.tenant, summarizer.settings_id(services))
    chain = await run_step(offload, chain_hashes, turns, counter)
    found = await store.lookup(scope, chain)
    if found is not None and found.covered_turns == len(turns):
        return found
    try:
        made, _fresh = await store.obtain(scope, chain, len(turns), turns, found, summarize, request_id=rid,
                                          model=services.model)
    except SummaryUnavailable as exc:
        raise SummarizerFailed(f"The summariser could not compact this conversation ({exc.reason}).") from None
    return made


def _main(item: Item) -> dict[str, Any]:
    return item.main if isinstance(item, ResponsesItem) else {}


def user_message(item: Item) -> dict[str, Any]:
    """A user message of the input as an output ``message`` item (content as parts, the client's fields kept)."""
    message = dict(_main(item))
    if kind_of(message) == "message":
        message["type"] = "message"
    content = message.get("content")
    if isinstance(content, str):
        message["content"] = [{"type": "input_text", "text": content}]
    return message
