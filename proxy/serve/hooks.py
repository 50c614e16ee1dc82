"""What a wire does around the pipeline, by wire name: the one list (the managed handler, explain,
count_tokens and ``ctxproxy assemble`` all read it). A wire without an entry has no hook."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from proxy.serve.context_management import HOOK as CONTEXT_MANAGEMENT
from proxy.serve.managed import RequestHook

HOOKS: Mapping[str, RequestHook] = MappingProxyType({
    "messages": CONTEXT_MANAGEMENT,  # Anthropic's context_management, emulated for upstreams without it
})
