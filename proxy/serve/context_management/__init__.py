"""Anthropic's ``context_management`` emulated for upstreams without it: the Messages wire's request hook.

``hook``: the orchestration (which edits run, the compaction through ``proxy.store.compaction``);
``edits``: the pure body edits (clear_tool_uses, clear_thinking, the compaction's messages);
``answers``: the answer edits (the report, a compaction block) and the answer made without an upstream.
"""

from proxy.serve.context_management.hook import HOOK, ContextManagementHook

__all__ = ["HOOK", "ContextManagementHook"]
