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
provider's own ``compaction`` item. The summary comes from the one compaction service
(``proxy.store.compaction``), the pipeline's too, so compacting a conversation twice, or
compacting one whose prefix the pipeline already summarised, costs no second call; under a
policy whose summariser is ``drop`` it is refused (400 ``compaction_unavailable``): that
policy never calls a model to summarise. Errors have the wire's shape (the scope's).

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

from plugins.context.summarising import summary_text
from proxy.core.bands import split_bands, split_turns
from proxy.core.conversation import Conversation
from proxy.core.errors import BadRequest, SummarizerFailed, UpstreamStatus
from proxy.core.items import USER, Item
from proxy.core.offload import run_step
from proxy.core.pairing import repair
from proxy.pipeline import chain_hashes, check_visible
from proxy.policy import ModelRoute, Policy
from proxy.runtime import Runtime
from proxy.serve.http import OVERRIDE_HEADER, dumps_body, header_safe, json_response, state
from proxy.serve.scope import request_scope
from proxy.serve.streaming import relay_answer
from proxy.store.compaction import summarizer_for
from proxy.upstream.base import Outgoing
from proxy.wire.protocol import Wire
from proxy.wire.responses.items import COMPACT_PREFIX, ResponsesItem, kind_of
from proxy.wire.responses.translator import is_compact_summary, provider_state
from proxy.wire.sse import StreamWatcher

NOT_SERVED = frozenset({404, 405, 501})  # what an upstream without the endpoint answers


async def compact_handler(request: web.Request, wire: Wire) -> web.StreamResponse:
    with request_scope(request, wire, event="compact") as scope:
        runtime, headers = scope.runtime, scope.headers
        body = await scope.body()
        model = scope.model(body)
        route = runtime.route(model)
        policy = runtime.policy(scope.tenant, model, request.headers.get(OVERRIDE_HEADER))  # the tenant's allow-list
        scope.record.model = route.name
        counter = await runtime.tokenizers.counter(route.encoding)
        conversation = await run_step(scope.offload, wire.parse, body, counter)
        # the tenant's cap holds for a compaction too, relayed or emulated, on what ctxproxy can see
        check_visible(conversation.fixed_tokens + sum(item.tokens for item in conversation.items), policy,
                      await runtime.calibration_factor(route, policy.tenant), wire.field, conversation.unmanaged)
        mode = compact_mode(runtime, route)
        if mode != "emulate":
            try:
                return scope.answered(await _relay(request, wire, body, scope.raw, route, headers))
            except UpstreamStatus as exc:
                if mode == "relay" or exc.status not in NOT_SERVED:
                    raise
                headers["x-ctxproxy-warning"] = header_safe(
                    f"the upstream answered {exc.status} to /responses/compact: compacted by ctxproxy's summariser")
        out = await emulate(runtime, wire, body, route, policy, scope.request_id, conversation, scope.offload)
        headers["x-ctxproxy-compact"] = "emulated"
        return scope.answered(json_response(out, headers=headers))


def compact_mode(runtime: Runtime, route: ModelRoute) -> str:
    """relay | emulate | auto for this route (litellm has no compact endpoint to relay to)."""
    if route.provider == "litellm":
        return "emulate"
    upstream = runtime.config.settings.upstreams.get(route.upstream)
    return upstream.responses_compact if upstream is not None else "auto"


async def _relay(request: web.Request, wire: Wire, body: dict[str, Any], raw: bytes, route: ModelRoute,
                 headers: CIMultiDict[str]) -> web.StreamResponse:
    """The client's bytes (with the route's upstream model name) to the upstream's compact endpoint."""
    st = state(request)
    changes = wire.model_changes(body, route.upstream_model)
    if changes:
        body = {**body, **changes}
        raw = dumps_body(body)
    path = next(own for own, name in wire.endpoints.items() if name == "compact")
    call = Outgoing(wire.name, path, body, raw, False, request.headers, headers["x-request-id"])
    answer = await st.served.providers.for_route(route).send(route, call)
    return await relay_answer(request, answer, headers, idle_timeout=st.config.settings.server.idle_timeout,
                              watcher=StreamWatcher(time.perf_counter(), wire.stream_end))


async def emulate(runtime: Runtime, wire: Wire, body: dict[str, Any], route: ModelRoute, policy: Policy,
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
    counter = await runtime.tokenizers.counter(route.encoding)
    items, turns, output = await run_step(offload, _compaction_input, wire, conversation)
    summary = await _summary(runtime, route, policy, rid, turns, counter, offload) if turns else None
    received = conversation.fixed_tokens + sum(item.tokens for item in items)
    produced = 0
    if summary is not None:
        text = f"{COMPACT_PREFIX}\n{summary_text(len(turns), summary)}"
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


def _compaction_input(wire: Wire, conversation: Conversation) -> tuple[list[Item], list[list[Item]], list[Any]]:
    """The input's items (repaired), its turns after the system band, and its user messages as output items."""
    items = conversation.items
    if not conversation.paired:
        items, _ = repair(items, wire, wire.merge_call_runs)
    bands = split_bands(items)
    turns = split_turns(items[len(bands.system):])
    output: list[Any] = [user_message(item) for item in items
                         if item.role == USER and not is_compact_summary(_main(item))]
    return items, turns, output


async def _summary(runtime: Runtime, route: ModelRoute, policy: Policy, rid: str, turns: list[list[Item]],
                   counter: Any, offload: bool) -> str:
    """The summary of every turn, from the one compaction service: cached, else made once (single flight)."""
    services = runtime.services(route, policy, request_id=rid)
    compaction = services.compaction
    if compaction is None:
        raise SummarizerFailed("ctxproxy has no summariser to compact this conversation with.")
    chain = await run_step(offload, chain_hashes, turns, counter)
    made = await compaction.compact(summarizer_for(policy.manager.summarizer), services, turns, chain)
    if made.status == "unavailable":
        if made.reason == "drop":
            raise BadRequest(f"{made.text}: this key's policy never calls a model to summarise, so ctxproxy does "
                             "not compact its conversations.", code="compaction_unavailable")
        raise SummarizerFailed("ctxproxy has no summariser to compact this conversation with.")
    if made.summary is None:
        raise SummarizerFailed(f"The summariser could not compact this conversation ({made.reason}).")
    return made.text


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
