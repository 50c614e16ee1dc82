"""``llm``: summarises older turns with a model, through the proxy's own upstream routes.

Model: ``params.model``, else the summariser slot (``summarizer_model``), else the
turn's model. ``params.instructions`` replaces the built-in prompt. Turns are
rendered compactly (long tool results shortened, images as placeholders); an
aged part larger than the summariser's own window is summarised in chunks,
each folded into the running summary. With no engine it degrades to ``drop``.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from typing import Any

import orjson
from pydantic import Field

from plugins.base import Completion, Params, Services, SummarizeFn, Summarizer, SummaryUnavailable
from proxy.messages import Message, role_of

PROMPT_VERSION = "1"
TOOL_RESULT_CHARS = 1500
LABEL_TOKENS = 12  # "TOOL RESULT <id>: ", "TOOL CALL <id> name(" ... per rendered line
ARGUMENT_CHARS = 600

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

    def settings_id(self, services: Services) -> str:
        params: Any = self.params
        instructions = hashlib.sha256((params.instructions or "").encode()).hexdigest()[:16]
        return f"llm/v{PROMPT_VERSION}/{self._model(services)}/{instructions}"

    def bind(self, services: Services) -> SummarizeFn | None:
        engine = services.engine
        if engine is None:
            return None
        params: Any = self.params
        model = self._model(services)
        prompt = params.instructions or PROMPT
        counter = services.counter
        # room for one chunk: the window minus the prompt, the answer and a margin
        room = max(2_000, int(services.summarizer_window * 0.8) - services.summary_tokens - 1_000)

        async def summarize(previous: str | None, turns: Sequence[Sequence[Message]]) -> Completion:
            # rendering and counting ~100k tokens of aged turns takes a while: keep it off the event loop
            count = counter.text if counter else _approx
            chunks = await asyncio.to_thread(_render_chunks, turns, room, count, counter)
            if len(chunks) > services.summarizer_max_calls:
                # bound the summariser work one request can cause: the oldest aged turns are dropped
                chunks = chunks[-services.summarizer_max_calls:]
                chunks[0].insert(0, "[Older turns were dropped without being summarised.]")
            running = previous
            prompt_tokens = completion_tokens = 0
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
                )
                if not out.text.strip():
                    raise SummaryUnavailable("the summariser returned an empty answer")
                running = _cap(out.text.strip(), services.summary_tokens, count)
                prompt_tokens += out.prompt_tokens
                completion_tokens += out.completion_tokens
            return Completion(running or "", model, prompt_tokens, completion_tokens)

        return summarize


def _render_chunks(turns: Sequence[Sequence[Message]], room: int, count: Any, counter: Any) -> list[list[str]]:
    rendered = [render_turn(t) for t in turns]
    if counter is None:
        return _chunks(rendered, [count(r) for r in rendered], room, count)
    # A rendered turn never has more tokens than the turn itself (rendering only shortens) plus its
    # line labels, and the turns' counts are already cached: no second pass of the tokenizer.
    bounds = [sum(counter.messages(list(t))) + LABEL_TOKENS * len(t) for t in turns]
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


def _shorten(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]} […{len(text) - limit} chars…] {text[-half:]}"


def _content(message: Message) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict):
                continue
            if part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif part.get("type") == "image_url":
                parts.append("[image]")
            else:
                parts.append(f"[{part.get('type', 'part')}]")
        return " ".join(parts)
    return ""


def render_turn(turn: Sequence[Message]) -> str:
    """One turn as compact text for the summariser."""
    lines = []
    for message in turn:
        role = role_of(message)
        text = _content(message)
        if role in ("tool", "function"):
            ident = message.get("name") or message.get("tool_call_id") or ""
            lines.append(f"TOOL RESULT {ident}: {_shorten(text, TOOL_RESULT_CHARS)}")
            continue
        if text:
            lines.append(f"{role.upper()}: {text}")
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            for call in calls:
                fn = call.get("function") if isinstance(call, dict) else None
                if isinstance(fn, dict):
                    args = fn.get("arguments")
                    args = args if isinstance(args, str) else orjson.dumps(args).decode()
                    lines.append(f"TOOL CALL {call.get('id', '')} {fn.get('name')}({_shorten(args, ARGUMENT_CHARS)})")
    return "\n".join(lines)
