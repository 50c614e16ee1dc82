"""Deterministic summariser engines for ``bench/retention.py``: nothing is called over the network.

Both stand in for the model behind the ``llm`` summariser (``plugins.base.Engine``), so the real
summariser plugin, its chunking and the summary cache all run as in the server:

- ``generic``: answers every call with the same generic text, the way a summariser that writes
  "the user and the assistant discussed the booking" does. It keeps no value at all: it is the
  floor a summary's values section must lift.
- ``extractive``: keeps the head of every line it is given (the previous summary's lines, then one
  line per call, result and message of the new turns), cut to ``max_tokens``, dropping the oldest
  lines first. It stands for a careful model: it sees what the summariser plugin renders and keeps
  the start of everything, so what the rendering cut away (the middle of a long tool output) it
  cannot keep either.
"""

from __future__ import annotations

from typing import Any

from plugins.base import Completion

GENERIC = ("- The user asked the assistant for help with their request.\n"
           "- The assistant looked up the relevant records with its tools and went through the options "
           "with the user.\n"
           "- The work on the request is under way; nothing is left to confirm from the earlier turns.")
LINE_HEAD = 160  # characters kept of each line by the extractive engine
CHARS_PER_TOKEN = 3  # conservative, so the answer stays within max_tokens


def _prompt_tokens(messages: list[dict[str, Any]]) -> int:
    return sum(len(str(m.get("content") or "")) for m in messages) // 4 + 1


class TestEngine:
    """``plugins.base.Engine`` with no model behind it: counts its calls and the prompt it was given."""

    name = ""

    def __init__(self) -> None:
        self.calls = 0
        self.prompt_tokens = 0

    async def complete(
        self, model: str, messages: list[dict[str, Any]], *, max_tokens: int, timeout: float, purpose: str,
        request_id: str = "",
    ) -> Completion:
        self.calls += 1
        prompt = _prompt_tokens(messages)
        self.prompt_tokens += prompt
        text = self.answer(str(messages[-1].get("content") or ""), max_tokens)
        return Completion(text, model, prompt, len(text) // 4)

    def answer(self, body: str, max_tokens: int) -> str:
        raise NotImplementedError


class GenericEngine(TestEngine):
    """Always the same generic summary."""

    name = "generic"

    def answer(self, body: str, max_tokens: int) -> str:
        return GENERIC


class ExtractiveEngine(TestEngine):
    """The head of every line it was given, newest lines kept when it must cut."""

    name = "extractive"

    def answer(self, body: str, max_tokens: int) -> str:
        return extract(body, max_tokens * CHARS_PER_TOKEN)


def extract(body: str, limit: int) -> str:
    """The summariser's request (previous summary, new turns) as the heads of its lines, within ``limit`` chars."""
    previous, _, new = body.partition("New turns:\n")
    if not new:
        previous, new = "", previous
    previous = previous.removeprefix("Previous summary:\n")
    lines = [line.strip() for line in (*previous.splitlines(), *new.splitlines())]
    heads = [line if len(line) <= LINE_HEAD else line[:LINE_HEAD] + "…" for line in lines if line]
    kept: list[str] = []
    used = 0
    for line in reversed(heads):
        if used + len(line) + 1 > limit:
            if not kept:  # not even the newest line fits: its start
                kept.append(line[: max(1, limit)])
            break
        kept.append(line)
        used += len(line) + 1
    return "\n".join(reversed(kept)) or GENERIC


ENGINES: dict[str, type[TestEngine]] = {"generic": GenericEngine, "extractive": ExtractiveEngine}
