"""Shared test helpers: configs, conversation builders, hypothesis strategies, and
independent checkers (tool-call pairing, token recount) that do not reuse the
code under test.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import gzip
import itertools
import json
import math
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from proxy.core.modelinfo import offline_environment

offline_environment()  # tiktoken must never reach the network in tests

import tiktoken  # noqa: E402  (after use_bundled_encodings)

from plugins.base import Completion, Services  # noqa: E402
from proxy.runtime import Runtime  # noqa: E402
from proxy.settings import Config, load_config  # noqa: E402
from proxy.store.memory import MemoryCache  # noqa: E402
from proxy.store.summaries import SummaryService  # noqa: E402

Message = dict[str, Any]

REPO = Path(__file__).resolve().parents[1]
TAU_BENCH = REPO / "tests" / "data" / "tau-bench-airline.json.gz"  # provenance: tests/data/README.md
UPSTREAM = {"u": {"base_url": "http://127.0.0.1:9"}}
MODEL = "gpt-4o"

# The four context managers of the issue, as config bindings.
MANAGERS: dict[str, Any] = {
    "summarising-drop": {"type": "summarising", "params": {"summarizer": "drop", "keep_turns": 3}},
    "summarising-llm-no-engine": {"type": "summarising", "params": {"summarizer": "llm", "keep_turns": 3}},
    "sliding-window": {"type": "sliding-window", "params": {"keep_turns": 3}},
    "stack": {"type": "stack", "params": {"max_messages": 12}},
}


# --------------------------------------------------------------------------- configs


def config_dict(
    *,
    window: int = 128_000,
    context_manager: Any = None,
    reserve: int | None = 256,
    max_tokens: int | None = None,
    model: str = MODEL,
    **extra: Any,
) -> dict[str, Any]:
    trimmer: dict[str, Any] = {}
    if reserve is not None:
        trimmer["reserve_tokens"] = reserve
    if max_tokens is not None:
        trimmer["max_tokens"] = max_tokens
    raw: dict[str, Any] = {
        "upstreams": UPSTREAM,
        "models": [{"name": model, "context_window": window, "max_output_tokens": 4096}],
        "cache": {"backend": "memory"},
        "trimmer": trimmer,
    }
    if context_manager is not None:
        raw["context_manager"] = context_manager
    raw.update(extra)
    return raw


def make_config(**kwargs: Any) -> Config:
    return load_config(config_dict(**kwargs), env={})


def hard_budget(window: int, reserve: int = 256, ratio: float = 0.1) -> int:
    """B = window - reserve - ceil(ratio * window), computed here independently."""
    return window - reserve - math.ceil(ratio * window)


# --------------------------------------------------------------------------- cost per item

LINEAR = 2.5  # how much the time per item may grow over a size ladder (linear: about 1; quadratic: the factor)


def per_item_growth(setup: Callable[[int], Callable[[], object]], small: int, factor: int = 8,
                    repeat: int = 3) -> float:
    """How much the CPU time per item grows from ``small`` items to ``factor`` times as many.

    ``setup(n)`` builds the input for n items and returns the step to time. About 1 when the step is
    linear (or n log n), about ``factor`` when it is quadratic. Robust on a loaded machine: the
    process's own CPU time (other processes do not count), the best of ``repeat`` runs, with the
    cyclic GC paused while timing (its pauses grow with the heap, not with the code under test).
    """
    def best(n: int) -> float:
        step = setup(n)
        times = []
        for _ in range(repeat):
            gc.collect()
            gc.disable()
            try:
                t0 = time.process_time()
                step()
                times.append(time.process_time() - t0)
            finally:
                gc.enable()
        return max(min(times), 1e-4)

    return (best(small * factor) / (small * factor)) / (best(small) / small)


# --------------------------------------------------------------------------- data


@functools.lru_cache(maxsize=1)
def _tau_raw() -> bytes:
    return gzip.decompress(TAU_BENCH.read_bytes())


def tau_trajectories() -> list[dict[str, Any]]:
    """Fresh (unshared) dicts on every call, so a test can never see another test's mutation."""
    return json.loads(_tau_raw())


# --------------------------------------------------------------------------- builders


def system(text: str = "You are a helpful assistant.", **extra: Any) -> Message:
    return {"role": "system", "content": text, **extra}


def developer(text: str = "Answer briefly.", **extra: Any) -> Message:
    return {"role": "developer", "content": text, **extra}


def user(text: str, **extra: Any) -> Message:
    return {"role": "user", "content": text, **extra}


def assistant(text: str | None, **extra: Any) -> Message:
    return {"role": "assistant", "content": text, **extra}


def call(*calls: tuple[str, str] | tuple[str, str, str], content: str | list[Any] | None = None,
         **extra: Any) -> Message:
    """An assistant tool-call message; each call is (id, function name[, arguments JSON])."""
    tool_calls = []
    for c in calls:
        tid, name = c[0], c[1]
        args = c[2] if len(c) > 2 else json.dumps({"q": tid})  # type: ignore[misc]
        tool_calls.append({"id": tid, "type": "function", "function": {"name": name, "arguments": args}})
    return {"role": "assistant", "content": content, "tool_calls": tool_calls, **extra}


def tool(tid: str, content: str = "ok", **extra: Any) -> Message:
    return {"role": "tool", "tool_call_id": tid, "content": content, **extra}


def legacy_call(name: str, arguments: str = "{}") -> Message:
    return {"role": "assistant", "content": None, "function_call": {"name": name, "arguments": arguments}}


def legacy_result(name: str, content: str = "ok") -> Message:
    return {"role": "function", "name": name, "content": content}


def image_user(text: str, detail: str | None = None) -> Message:
    image: dict[str, Any] = {"url": "data:image/png;base64,iVBORw0KGgo="}
    if detail is not None:
        image["detail"] = detail
    return {"role": "user", "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": image}]}


LOREM = ["the", "passenger", "asked", "to", "move", "the", "flight", "from", "Boston", "to", "Denver", "and", "keep",
         "the", "same", "cabin", "class", "while", "the", "reservation", "ZFA04Y", "holds", "two", "checked", "bags",
         "and", "travel", "insurance", "purchased", "with", "a", "gift", "card"]


def words(n: int, seed: int = 0) -> str:
    """n deterministic words (about 1.1 tokens each)."""
    return " ".join(LOREM[(seed + i * 7) % len(LOREM)] for i in range(n))


@dataclass
class AgentSim:
    """A growing agent conversation: each user turn is followed by 2-4 tool rounds, then an answer.

    ``requests()`` yields the message list of every request the agent would send: after each user
    message and after each round of tool results; each request is the previous one plus new messages.
    """

    system_words: int = 400
    user_words: int = 30
    result_words: int = 180
    answer_words: int = 60
    parallel_every: int = 3
    seed: int = 7
    messages: list[Message] = field(default_factory=list)

    def requests(self, count: int) -> list[list[Message]]:
        out: list[list[Message]] = []
        msgs: list[Message] = [system(words(self.system_words, 1))]
        ids = itertools.count()
        turn = 0
        while len(out) < count:
            turn += 1
            msgs.append(user(f"turn {turn}: " + words(self.user_words, turn)))
            out.append(list(msgs))
            rounds = 2 + (turn * 5 + self.seed) % 3
            for r in range(rounds):
                if len(out) >= count:
                    break
                n_calls = 2 if (turn + r) % self.parallel_every == 0 else 1
                tids = [f"call_{next(ids)}" for _ in range(n_calls)]
                msgs.append(call(*[(t, "lookup", json.dumps({"turn": turn, "round": r})) for t in tids]))
                for k, t in enumerate(tids):
                    msgs.append(tool(t, f"{t} result: " + words(self.result_words // n_calls, turn * 13 + r + k)))
                out.append(list(msgs))
            msgs.append(assistant(f"answer {turn}: " + words(self.answer_words, turn + 3)))
        return out[:count]


# --------------------------------------------------------------------------- independent checkers


def pairing_problems(messages: Sequence[Message]) -> list[str]:
    """Independent of proxy.pairing: every tool/function message sits in the block right after the
    assistant message that called its id, and every call gets exactly one result before the next
    non-result message."""
    problems: list[str] = []
    i, n = 0, len(messages)
    while i < n:
        m = messages[i]
        role = m.get("role")
        if role in ("tool", "function"):
            problems.append(f"[{i}] {role} result not directly after its call")
            i += 1
            continue
        calls = m.get("tool_calls") if role == "assistant" else None
        if isinstance(calls, list) and calls:
            wanted = Counter(c.get("id") for c in calls)
            got: Counter[Any] = Counter()
            j = i + 1
            while j < n and messages[j].get("role") == "tool":
                got[messages[j].get("tool_call_id")] += 1
                j += 1
            if got != wanted:
                problems.append(f"[{i}] calls {dict(wanted)} answered by {dict(got)}")
            if j < n and messages[j].get("role") == "function":
                problems.append(f"[{j}] function result after a tool_calls message")
            i = j
            continue
        fc = m.get("function_call") if role == "assistant" else None
        if isinstance(fc, dict):
            j = i + 1
            got_names = []
            while j < n and messages[j].get("role") == "function":
                got_names.append(messages[j].get("name"))
                j += 1
            if got_names != [fc.get("name")]:
                problems.append(f"[{i}] function_call {fc.get('name')!r} answered by {got_names}")
            i = j
            continue
        i += 1
    return problems


@functools.lru_cache(maxsize=4)
def _encoding(name: str) -> tiktoken.Encoding:
    return tiktoken.get_encoding(name)


@functools.lru_cache(maxsize=200_000)
def _ref_text(encoding: str, text: str) -> int:
    return len(_encoding(encoding).encode(text, disallowed_special=()))


def ref_message_tokens(message: Message, encoding: str = "o200k_base") -> int:
    """OpenAI's per-message formula, written out here: 3 + every string value (+1 for name);
    text parts by their text, image parts 765 (85 with detail: low); each tool call 3 + name +
    arguments; a legacy function_call its name + arguments."""
    n = 3
    for key, value in message.items():
        if isinstance(value, str):
            n += _ref_text(encoding, value) + (1 if key == "name" else 0)
        elif key == "content" and isinstance(value, list):
            for part in value:
                if part.get("type") == "text":
                    n += _ref_text(encoding, part["text"])
                elif part.get("type") == "image_url":
                    low = isinstance(part.get("image_url"), dict) and part["image_url"].get("detail") == "low"
                    n += 85 if low else 765
                else:
                    n += _ref_text(encoding, json.dumps(part, separators=(",", ":"), ensure_ascii=False))
        elif key == "tool_calls" and isinstance(value, list):
            for c in value:
                fn = c.get("function") or {}
                n += 3 + _ref_text(encoding, fn.get("name") or "") + _ref_text(encoding, fn.get("arguments") or "")
        elif key == "function_call" and isinstance(value, dict):
            n += _ref_text(encoding, value.get("name") or "") + _ref_text(encoding, value.get("arguments") or "")
    return n


def recount(messages: Sequence[Message], encoding: str = "o200k_base") -> int:
    """Tokens of a request made of ``messages`` (no tools): the messages plus 3 priming tokens."""
    return 3 + sum(ref_message_tokens(m, encoding) for m in messages)


def contains_run(haystack: Sequence[Message], needle: Sequence[Message]) -> bool:
    """``needle`` appears in ``haystack`` as a contiguous run of equal messages."""
    if not needle:
        return True
    k = len(needle)
    return any(list(haystack[i : i + k]) == list(needle) for i in range(len(haystack) - k + 1))


def leading_system(messages: Sequence[Message]) -> list[Message]:
    out = []
    for m in messages:
        if m.get("role") not in ("system", "developer"):
            break
        out.append(m)
    return out


def last_user(messages: Sequence[Message]) -> Message | None:
    for m in reversed(messages):
        if m.get("role") == "user":
            return m
    return None


# --------------------------------------------------------------------------- fakes


class FakeEngine:
    """An Engine that answers every summary call with a short deterministic text."""

    def __init__(self, text: str = "- the user booked flight HAT001 (reservation ZFA04Y)") -> None:
        self.text = text
        self.calls: list[list[Message]] = []

    async def complete(
        self, model: str, messages: list[Message], *, max_tokens: int, timeout: float, purpose: str,
        request_id: str = "",
    ) -> Completion:
        self.calls.append(messages)
        await asyncio.sleep(0)
        return Completion(f"{self.text} (call {len(self.calls)})", model, 100, 20)


def summary_service(cache: MemoryCache | None = None) -> SummaryService:
    return SummaryService(
        cache or MemoryCache(),
        ttl=None,
        lock_wait=5,
        backoff_first=0,
        backoff_max=0,
    )


@contextlib.asynccontextmanager
async def running(config: Config, engine: Any = None) -> AsyncIterator[Runtime]:
    """A runtime built as the server builds it (memory cache per config), closed afterwards."""
    from proxy.serve.state import build_runtime, build_shared

    shared = build_shared(config)
    runtime = build_runtime(config, shared, engine=False).runtime
    runtime.engine = engine
    try:
        yield runtime
    finally:
        await shared.close()


def services(counter: Any, engine: Any = None, summaries: Any = None, **extra: Any) -> Services:
    from proxy.store.compaction import Compaction

    if summaries is not None:
        extra.setdefault("compaction", Compaction(summaries))  # as the runtime lends it, over the same store
    return Services(engine=engine, summaries=summaries, model=MODEL, counter=counter, **extra)


# --------------------------------------------------------------------------- hypothesis strategies

VOCAB = [*sorted(set(LOREM)), "Zürich", "東京", "🚀", "id_8842", "/var/log/app.log", "3.14", "naïve", "{\"k\": 1}"]
FN_NAMES = ["get_user_details", "search_flights", "book_reservation", "cancel_reservation", "calculate"]
SHARED_IDS = [f"call_{i}" for i in range(5)]  # small pool: ids get reused across groups


def _vocab_text(n: int, seed: int) -> str:
    out, x = [], seed
    for _ in range(n):
        x = (x * 1103515245 + 12345) % 2**31
        out.append(VOCAB[(x >> 8) % len(VOCAB)])
    return " ".join(out)


def text(min_words: int = 1, max_words: int = 40) -> st.SearchStrategy[str]:
    """Words from VOCAB (unicode, emoji, paths, JSON included); cheap to draw and to shrink."""
    return st.builds(_vocab_text, st.integers(min_words, max_words), st.integers(0, 2**16))


@st.composite
def _extras(draw: Any, *, name: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if name and draw(st.integers(0, 5)) == 0:
        out["name"] = draw(st.sampled_from(["alice", "bob_2", "agent-x"]))
    if draw(st.integers(0, 6)) == 0:
        out["cache_control"] = {"type": "ephemeral"}
    if draw(st.integers(0, 9)) == 0:
        out["x_client_meta"] = {"trace": draw(st.integers(0, 99))}
    return out


@st.composite
def _user(draw: Any) -> Message:
    if draw(st.integers(0, 4)) == 0:
        parts: list[dict[str, Any]] = [{"type": "text", "text": draw(text(1, 30))}]
        image: dict[str, Any] = {"url": "https://example.com/cat.png"}
        detail = draw(st.sampled_from([None, "low", "high", "auto"]))
        if detail is not None:
            image["detail"] = detail
        parts.append({"type": "image_url", "image_url": image})
        msg: Message = {"role": "user", "content": parts}
    else:
        msg = {"role": "user", "content": draw(text(1, 60))}
    msg.update(draw(_extras()))
    return msg


@st.composite
def _tool_group(draw: Any, *, valid: bool) -> list[Message]:
    """An assistant tool-call message and its results; when not ``valid``, with defects."""
    n = draw(st.integers(1, 3))
    fresh = st.text("abcdef0123456789", min_size=6, max_size=6).map("call_".__add__)
    pool = st.one_of(st.sampled_from(SHARED_IDS), fresh)
    ids = draw(st.lists(pool, min_size=n, max_size=n, unique=True))
    names = [draw(st.sampled_from(FN_NAMES)) for _ in ids]
    content = draw(st.one_of(st.none(), text(1, 20)))
    msg = call(*[(i, nm, json.dumps({"arg": draw(text(1, 8))})) for i, nm in zip(ids, names)], content=content)
    if draw(st.booleans()):
        msg["refusal"] = None
    msg.update(draw(_extras(name=False)))
    results = []
    for tid, nm in zip(ids, names):
        body: Any = draw(text(1, 120))
        if draw(st.integers(0, 7)) == 0:
            body = [{"type": "text", "text": body}]
        r: Message = {"role": "tool", "tool_call_id": tid, "content": body}
        if draw(st.booleans()):
            r["name"] = nm
        results.append(r)
    results = draw(st.permutations(results))  # parallel results may come in any order
    out: list[Message] = [msg]
    if valid:
        return out + results
    defect = draw(st.sampled_from(["none", "none", "missing", "duplicate", "displaced", "all_missing"]))
    if defect == "missing" and len(results) > 1:
        results = results[: draw(st.integers(1, len(results) - 1))]
    elif defect == "all_missing":
        results = []
    elif defect == "duplicate":
        dup = dict(draw(st.sampled_from(results)))
        dup["content"] = "duplicate " + str(dup["content"])
        results = [*results, dup]
    elif defect == "displaced":
        k = draw(st.integers(0, len(results) - 1))
        return out + results[:k] + [draw(_user())] + results[k:]
    return out + results


@st.composite
def _event(draw: Any, *, valid: bool) -> list[Message]:
    kinds = ["text", "group", "group", "legacy"] + ([] if valid else ["orphan"])
    kind = draw(st.sampled_from(kinds))
    if kind == "text":
        msg = assistant(draw(text(1, 60)))
        msg.update(draw(_extras(name=True)))
        return [msg]
    if kind == "group":
        return draw(_tool_group(valid=valid))
    if kind == "legacy":
        name = draw(st.sampled_from(FN_NAMES))
        out = [legacy_call(name, json.dumps({"x": 1})), legacy_result(name, draw(text(1, 40)))]
        if not valid and draw(st.integers(0, 3)) == 0:
            out = out[:1]
        return out
    tid = draw(st.sampled_from([*SHARED_IDS, "call_orphan"]))
    return [tool(tid, draw(text(1, 30)))]


@st.composite
def conversations(draw: Any, *, valid: bool = False, max_turns: int = 6) -> list[Message]:
    """A chat-completions ``messages`` list; ``valid=False`` adds pairing defects."""
    msgs: list[Message] = []
    for _ in range(draw(st.integers(0, 2))):
        role = draw(st.sampled_from(["system", "developer"]))
        m: Message = {"role": role, "content": draw(text(1, 50))}
        m.update(draw(_extras()))
        msgs.append(m)
    if draw(st.integers(0, 9)) == 0:  # a preamble: an assistant greeting before any user message
        msgs.append(assistant(draw(text(1, 10))))
    for _ in range(draw(st.integers(0, max_turns))):
        msgs.append(draw(_user()))
        for _ in range(draw(st.integers(0, 3))):
            msgs.extend(draw(_event(valid=valid)))
    if draw(st.integers(0, 8)) == 0:  # an assistant prefill at the very end
        msgs.append(assistant(draw(text(1, 10))))
    if not msgs:
        msgs.append(draw(_user()))
    return msgs


# --------------------------------------------------------------------------- assembly invariants


def last_tool_group(messages: Sequence[Message]) -> list[Message]:
    """The last assistant tool-call message (tool_calls or legacy function_call) and the results after it."""
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if m.get("role") == "assistant" and (m.get("tool_calls") or isinstance(m.get("function_call"), dict)):
            j = i + 1
            while j < len(messages) and messages[j].get("role") in ("tool", "function"):
                j += 1
            return list(messages[i:j])
    return []


def working_memory(messages: Sequence[Message]) -> list[Message]:
    """Everything after the last user message (after the system band when there is none)."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "user":
            return list(messages[i + 1 :])
    return list(messages[len(leading_system(messages)) :])


def minimal_payload(messages: Sequence[Message]) -> list[Message]:
    """What can never be dropped (docs/design.md#7-working-memory-cap-and-token-trim): system band, current user turn,
    the last WM tool group
    (the live round) and the last WM group (an assistant prefill after the live round included)."""
    wm = working_memory(messages)
    keep = last_tool_group(wm)
    if wm and not any(m is wm[-1] for m in keep):
        keep = keep + wm[-1:]
    current = last_user(messages)
    return leading_system(messages) + ([current] if current is not None else []) + keep


def assembly_problems(
    before: Sequence[Message], after: Sequence[Message], assembly: Any, *, encoding: str = "o200k_base",
    fixed: int = 0,
) -> list[str]:
    """Every invariant a forwarded payload must satisfy, checked independently where possible.

    ``before`` is the client's list as sent, ``after`` the same list after the call (mutation check),
    ``fixed`` the tokens of the request's tool schemas.
    """
    from proxy.core.errors import PayloadError
    from tests.wire.chat_helpers import check_messages as check

    problems: list[str] = []
    out = assembly.messages
    if list(after) != list(before):
        problems.append("the client's messages were mutated")
    try:
        check(out)
    except PayloadError as exc:
        problems.append(f"payload check: {exc.code}: {exc}")
    problems += [f"pairing: {p}" for p in pairing_problems(out)]
    n = recount(out, encoding) + fixed
    if n != assembly.report.tokens_after:
        problems.append(f"tokens_after {assembly.report.tokens_after} != independent recount {n}")
    if n > assembly.report.hard_budget:
        problems.append(f"{n} tokens > hard budget {assembly.report.hard_budget}")
    band = leading_system(after)
    if len(out) < len(band) or any(a is not b for a, b in zip(out, band)):
        problems.append("system band not forwarded verbatim at the start")
    current = last_user(after)
    if current is not None and not any(m is current for m in out):
        problems.append("current user turn missing")
    if not assembly.changed and (list(out) != list(after) or any(a is not b for a, b in zip(out, after))):
        problems.append("changed is False but the messages differ from the input")
    return problems
