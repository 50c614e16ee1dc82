"""``llm``: summarises older turns with a model, through the proxy's own upstream routes.

Model: ``params.model``, else the summariser slot (``summarizer_model``), else the
turn's model. ``params.instructions`` replaces the built-in prompt. Turns are
rendered compactly (long tool results shortened in the middle, keeping the passages
that hold the values a later call or message of these turns used; images as
placeholders); an aged part larger than the summariser's own window is summarised
in chunks, each folded into the running summary. With no engine it degrades to ``drop``.
Whatever the summary says, the values the turns acted on reach the model: the compaction
service appends those it leaves out (``proxy.core.values``).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
from collections.abc import Sequence
from typing import Any

from pydantic import Field

from plugins.base import Completion, Params, Services, SummarizeFn, Summarizer, SummaryUnavailable
from proxy.core import values
from proxy.core.items import Item

PROMPT_VERSION = "3"  # 3: long results keep the passages holding the values a later turn used
LABEL_TOKENS = 12  # "TOOL RESULT <id>: ", "TOOL CALL <id> name(" ... per rendered line
PROMPT_TOKENS = 300  # the built-in prompt and the call's framing, rounded up
MIN_CHUNK = 256

PROMPT = """You compress the earlier part of a conversation between a user and an AI assistant that uses tools.
Write a summary that lets the assistant continue the conversation without the original turns.
Keep, exactly as written: names, ids, numbers, amounts, dates, file paths, URLs, commands and error messages
that a later turn may need. Keep every decision made and why, the user's goals and constraints, open tasks and
promises, and the outcome of each tool call (what was called, what it returned or why it failed).
Drop greetings, repetition and reasoning that led nowhere. Write plain text in short bullet points,
in the conversation's language. If a previous summary is given, merge it with the new turns into one summary."""


class LLMParams(Params):
    model: str | None = Field(None, description="Model for summary calls (a configured model name or litellm string).")
    instructions: str | None = Field(None, description="Replaces the built-in summarisation prompt.")


class LLMSummarizer(Summarizer):
    name = "llm"
    Params = LLMParams

    def _model(self, services: Services) -> str:
        params: Any = self.params
        return str(params.model or services.summarizer_model or services.model)

    @functools.cached_property
    def _instructions(self) -> str:
        """The digest of the instructions (a plugin's params never change: a reload makes a new plugin)."""
        params: Any = self.params
        return hashlib.sha256((params.instructions or "").encode()).hexdigest()[:16]

    def settings_id(self, services: Services) -> str:
        return f"llm/v{PROMPT_VERSION}/{self._model(services)}/{self._instructions}"

    def bind(self, services: Services) -> SummarizeFn | None:
        engine = services.engine
        if engine is None:
            return None
        params: Any = self.params
        model = self._model(services)
        prompt = params.instructions or PROMPT
        counter = services.counter
        # room for one chunk: the summariser model's own window, less a 10 % margin, the prompt, the previous
        # summary folded in and the answer (both at most summary_tokens)
        window = services.window_of(model) if services.window_of is not None else services.summarizer_window
        room = max(MIN_CHUNK, int(window * 0.9) - PROMPT_TOKENS - 2 * services.summary_tokens)

        async def summarize(previous: str | None, turns: Sequence[Sequence[Item]]) -> Completion:
            # rendering and counting ~100k tokens of aged turns takes a while: keep it off the event loop
            count = counter.text if counter else _approx
            chunks = await asyncio.to_thread(_render_chunks, turns, room, count)
            if len(chunks) > services.summarizer_max_calls:
                # bound the summariser work one request can cause: the oldest aged turns are dropped
                chunks = chunks[-services.summarizer_max_calls:]
                chunks[0].insert(0, "[Older turns were dropped without being summarised.]")
            running = previous
            prompt_tokens = completion_tokens = 0
            upstream_model = ""
            for chunk in chunks:
                body = ""
                if running:
                    body += f"Previous summary:\n{running}\n\n"
                body += "New turns:\n" + "\n".join(chunk)
                out = await engine.complete(
                    model,
                    [{"role": "system", "content": prompt}, {"role": "user", "content": body}],
                    max_tokens=services.summary_tokens,
                    timeout=services.summarizer_timeout,
                    purpose="summarize",
                    request_id=services.request_id,
                )
                if not out.text.strip():
                    raise SummaryUnavailable("the summariser returned an empty answer", reason="empty")
                running = _cap(out.text.strip(), services.summary_tokens, count)
                prompt_tokens += out.prompt_tokens
                completion_tokens += out.completion_tokens
                upstream_model = out.upstream_model
            return Completion(running or "", model, prompt_tokens, completion_tokens, upstream_model)

        return summarize


def _render_chunks(turns: Sequence[Sequence[Item]], room: int, count: Any) -> list[list[str]]:
    rendered = render_turns(turns)
    # A rendered turn never has more tokens than the turn itself (rendering only shortens) plus its
    # line labels, and the items' counts are known: no second pass of the tokenizer.
    bounds = [sum(item.tokens for item in t) + LABEL_TOKENS * max(1, len(t)) for t in turns]
    return _chunks(rendered, bounds, room, count)


def _cap(text: str, tokens: int, count: Any) -> str:
    """A summary that ignored max_tokens is cut to it: it must leave room for the turns it precedes."""
    size = count(text)
    if size <= tokens:
        return text
    return text[: max(1, len(text) * tokens // size)].rstrip() + " […]"


def _approx(text: str) -> int:
    return len(text) // 4 + 1


def _chunks(rendered: list[str], sizes: list[int], room: int, count: Any) -> list[list[str]]:
    chunks: list[list[str]] = [[]]
    used = 0
    for text, size in zip(rendered, sizes):
        if size > room:  # one enormous turn: cut it to what fits
            size = count(text)
        if size > room:
            text = text[: room * 3]
            size = count(text)
        if chunks[-1] and used + size > room:
            chunks.append([])
            used = 0
        chunks[-1].append(text)
        used += size
    return chunks


def render_turn(turn: Sequence[Item]) -> str:
    """One turn as compact text for the summariser: every item as its wire describes it."""
    return render_turns([turn])[0]


def render_turns(turns: Sequence[Sequence[Item]]) -> list[str]:
    """Each turn as compact text for the summariser; a long tool result keeps the passages that hold the
    values a later call or message of these turns used (``proxy.core.values.used_later``)."""
    flat = [item for turn in turns for item in turn]
    uses = values.last_uses(flat)
    spaced = values.spaced_values(uses)
    out: list[str] = []
    position = 0
    for turn in turns:
        lines = []
        for item in turn:
            keep = values.used_later(item, position, uses, spaced) if uses else frozenset()
            lines.append(item.describe(keep))
            position += 1
        out.append("\n".join(text for text in lines if text))
    return out
