"""``{<conversation field>, "report"}`` for a body of any wire: ``ctxproxy assemble`` and POST /v1/ctxproxy/explain.

Explain never bills anyone: summaries are looked up in the cache, and what a new
summary would replace is reported (``summary: would_create``) instead of made,
unless the caller asks for it (``summarize``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from proxy.core.conversation import WireAdapter
from proxy.runtime import Runtime
from proxy.serve.http import parse_body
from proxy.settings import Tenant


async def explain(
    runtime: Runtime, wire: WireAdapter, raw: bytes, tenant: Tenant | None, override: str | None,
    *, summarize: bool = False, request_id: str = "",
) -> dict[str, Any]:
    # large bodies are parsed and assembled off the event loop, as on the managed path
    offload = len(raw) > runtime.config.settings.server.offload_bytes
    body = (await asyncio.get_running_loop().run_in_executor(None, parse_body, raw)) if offload else parse_body(raw)
    assembly, _route, _policy = await runtime.assemble(wire, body, tenant=tenant, override=override, offload=offload,
                                                       request_id=request_id, dry_run=not summarize)
    return {wire.field: assembly.messages, "report": assembly.report.as_dict()}
