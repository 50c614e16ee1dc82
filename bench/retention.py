#!/usr/bin/env python3
"""What each context manager forgets: a retention benchmark (docs/quality.md holds its table).

Replays conversations request by request through the real pipeline, exactly as the server would
(``build_runtime`` + ``Runtime.assemble``, as ``ctxproxy assemble`` does), with the summary cache in
memory and a deterministic summariser engine (``bench/retention_engines.py``): nothing is sent
anywhere. For each strategy × budget × data set it reports tokens forwarded (% of received),
dependencies still answerable from the forwarded context, values of the summarised, dropped or
masked turns kept, forwarded prefix kept between consecutive requests, and summariser calls
(definitions: ``bench/retention_metrics.py`` and docs/quality.md).

    .venv/bin/python -m bench.retention --update-doc docs/quality.md --json-out bench/results/retention.json
    .venv/bin/python bench/retention.py --strategies sliding-window,summarising/generic --budgets 8k \
        --datasets coding --wires chat,messages

Strategies that need a plugin this checkout does not have (``observation-masking``, the hybrid's
``mask_observations``) are skipped with a note, and appear once the plugin is registered.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script (bench/retention.py) as well as a module
    sys.path.insert(0, str(ROOT))

from bench import coding_agent  # noqa: E402
from bench.retention_data import Conversation, request_points, tau_conversations, tau_sessions  # noqa: E402
from bench.retention_engines import ENGINES  # noqa: E402
from bench.retention_metrics import Meter, Subject, Totals, canonical  # noqa: E402
from bench.retention_report import BEGIN, END, cell, markdown, update_doc  # noqa: E402
from bench.retention_wires import FORMS, Form, adapter  # noqa: E402
from plugins.registry import default_registry  # noqa: E402
from proxy.core.errors import BindingError, ContextLengthExceeded, CtxProxyError  # noqa: E402
from proxy.core.modelinfo import ModelMap  # noqa: E402
from proxy.core.tokens import Tokenizers, use_bundled_encodings  # noqa: E402
from proxy.serve.state import build_runtime, build_shared  # noqa: E402
from proxy.settings import load_config  # noqa: E402

MODEL = "gpt-4o"
WINDOW = 128_000
ENCODING = "o200k_base"


class Failure(Exception):
    """The pipeline refused a request it should have managed (anything but context_length_exceeded), or a plugin
    raised: a finding about the code, not a figure."""


@dataclass(frozen=True)
class Strategy:
    """A context-manager binding, the test engine its summariser calls, and what it needs to exist."""

    name: str
    binding: dict[str, Any]
    engine: str | None = None
    needs: str | None = None  # "plugin:<name>" or "param:<manager>.<param>"
    custom: bool = False  # given with --binding: measured exactly as written


def where(strategy: Strategy, budget: int, subject: Subject, form: Form, n: int) -> str:
    return (f"{strategy.name} at B={budget} on {subject.conversation.name} ({form.name} wire), "
            f"the request of {n} messages")


WM_CAP = {"working_memory_messages": 20}


def strategies() -> list[Strategy]:
    """Every strategy of the table, in its order. Summarising rows turn masking off where the param exists."""
    return [
        Strategy("sliding-window", {"type": "sliding-window"}),
        Strategy("stack", {"type": "stack"}),
        # the summarising rows keep the working-memory cap of 20 the default had when the table was first
        # measured; the rows named no-wm-cap are today's default (no cap)
        Strategy("summarising/drop", {"type": "summarising", "params": {"summarizer": "drop", **WM_CAP}}),
        Strategy("summarising/generic", {"type": "summarising", "params": WM_CAP}, "generic"),
        Strategy("summarising/extractive", {"type": "summarising", "params": WM_CAP}, "extractive"),
        Strategy("summarising/generic/no-wm-cap", {"type": "summarising", "params": {"working_memory_messages": None}},
                 "generic"),
        Strategy("observation-masking", {"type": "observation-masking"}, None, "plugin:observation-masking"),
        Strategy("hybrid/generic", {"type": "summarising", "params": {"mask_observations": True, **WM_CAP}},
                 "generic", "param:summarising.mask_observations"),
        Strategy("hybrid/extractive", {"type": "summarising", "params": {"mask_observations": True, **WM_CAP}},
                 "extractive", "param:summarising.mask_observations"),
        Strategy("hybrid/generic/no-wm-cap",
                 {"type": "summarising", "params": {"mask_observations": True, "working_memory_messages": None}},
                 "generic", "param:summarising.mask_observations"),
    ]


def available(strategy: Strategy) -> str | None:
    """None when this checkout can run ``strategy``; else why not."""
    if strategy.needs is None:
        return None
    registry = default_registry()
    kind, _, what = strategy.needs.partition(":")
    if kind == "plugin":
        return None if registry.canonical("context_manager", what) else f"no {what!r} context manager registered"
    manager, _, param = what.partition(".")
    fields = registry.resolve("context_manager", manager, "bench").plugin.Params.model_fields
    return None if param in fields else f"{manager!r} has no {param!r} param"


def binding_for(strategy: Strategy) -> dict[str, Any]:
    """The binding as configured: summarising rows that are not the hybrid say ``mask_observations: false``
    once that param exists (it defaults to on), so they keep measuring summaries alone."""
    if strategy.custom:
        return strategy.binding
    binding = {**strategy.binding, "params": dict(strategy.binding.get("params", {}))}
    if binding["type"] == "summarising" and "mask_observations" not in binding["params"] \
            and available(Strategy("", {}, needs="param:summarising.mask_observations")) is None:
        binding["params"]["mask_observations"] = False
    return binding


def parse_budget(text: str) -> int:
    text = text.strip().lower()
    return int(float(text[:-1]) * 1000) if text.endswith("k") else int(text)


def budget_label(budget: int) -> str:
    return f"{budget // 1000}k" if budget % 1000 == 0 else str(budget)


DATASETS: dict[str, Callable[[argparse.Namespace], list[Conversation]]] = {
    "tau": lambda a: tau_conversations(),
    "tau-sessions": lambda a: tau_sessions(min_tokens=a.session_tokens),
    "coding": lambda a: coding_agent.conversations(a.coding_count, a.seed, a.coding_turns),
    "coding-loop": lambda a: coding_agent.loops(a.coding_count, a.seed, a.loop_rounds),
}


@dataclass
class Run:
    """The shared parts of one benchmark run: token counters and the model map, built once."""

    tokenizers: Tokenizers = field(default_factory=Tokenizers)
    model_map: ModelMap = field(default_factory=ModelMap)
    _json_tokens: dict[bytes, int] = field(default_factory=dict)

    def json_tokens(self, key: bytes) -> int:
        n = self._json_tokens.get(key)
        if n is None:
            n = self._json_tokens[key] = self.tokenizers.get(ENCODING).text(key.decode())
        return n

    def config(self, strategy: Strategy, budget: int) -> Any:
        return load_config({
            "upstreams": {"bench": {"base_url": "http://127.0.0.1:9"}},  # never called
            "models": [{"name": MODEL, "context_window": WINDOW, "max_output_tokens": 4096}],
            "context_manager": binding_for(strategy),
            "trimmer": {"max_tokens": budget},
            "cache": {"backend": "memory"},
        }, env={})

    async def measure(self, strategy: Strategy, budget: int, subjects: list[Subject], form: Form) -> Totals:
        """Every request of every conversation, on ``form``'s wire, through a fresh runtime (an empty summary
        cache)."""
        config = self.config(strategy, budget)
        shared = build_shared(config, model_map=self.model_map)
        shared.tokenizers = self.tokenizers  # counts are content-addressed: share them across runs
        runtime = build_runtime(config, shared, engine=False).runtime
        engine = ENGINES[strategy.engine]() if strategy.engine else None
        runtime.engine = engine
        totals = Totals()
        wire = adapter(form)
        try:
            for subject in subjects:
                meter = Meter(subject, totals, self.json_tokens)
                messages = subject.conversation.messages
                for n in request_points(messages):
                    body, received, origins = form.request(MODEL, messages[:n])
                    try:
                        assembly, _, _ = await runtime.assemble(wire, body, tenant=None)
                    except ContextLengthExceeded:
                        meter.refused(n)
                        continue
                    except CtxProxyError as exc:  # a pipeline that refuses valid input: a finding, not a figure
                        raise Failure(f"{where(strategy, budget, subject, form, n)}: {exc.code}: {exc.message}") from None
                    except Exception as exc:  # a third-party plugin's bug: name the request it broke on
                        raise Failure(f"{where(strategy, budget, subject, form, n)}: {type(exc).__name__}: {exc}") \
                            from exc
                    # a summary started in the background is ready for the next request (a user's think time
                    # longer than the summariser), so the figures do not depend on how fast this loop runs
                    await shared.background.idle()
                    report = assembly.report
                    meter.observe(n, received, origins, form.forwarded(assembly.body), report.tokens_before,
                                  report.tokens_after, assembly.changed, report.removed)
        finally:
            await shared.close()
        if engine is not None:
            totals.summariser_calls = engine.calls
            totals.summariser_prompt_tokens = engine.prompt_tokens
        return totals


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    names = [s.name for s in strategies()]
    p = argparse.ArgumentParser(prog="bench/retention.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategies", default=",".join(names), help=f"comma-separated, from: {', '.join(names)}")
    p.add_argument("--budgets", default="8k,16k,32k", help="hard budgets B (trimmer.max_tokens), e.g. 8k,16000")
    p.add_argument("--datasets", default=",".join(DATASETS), help=f"comma-separated, from: {', '.join(DATASETS)}")
    p.add_argument("--wires", default="chat", help=f"comma-separated, from: {', '.join(FORMS)} (default chat): "
                   "the same conversations in each wire's own shape")
    p.add_argument("--limit", type=positive, default=None, help="at most this many conversations per data set")
    p.add_argument("--session-tokens", type=positive, default=40_000,
                   help="tau-sessions: chain trajectories until a session holds this many tokens (default 40000)")
    p.add_argument("--coding-count", type=positive, default=10, help="coding, coding-loop: conversations to generate (default 10 each)")
    p.add_argument("--coding-turns", type=positive, default=16, help="coding: user turns per conversation (default 16)")
    p.add_argument("--loop-rounds", type=positive, default=45,
                   help="coding-loop: tool rounds after the one user message (default 45)")
    p.add_argument("--seed", type=int, default=7, help="coding, coding-loop: the generator's seed (default 7)")
    p.add_argument("--binding", action="append", default=[], metavar="NAME=JSON",
                   help="also measure this context-manager binding, e.g. "
                        "'sw4={\"type\": \"sliding-window\", \"params\": {\"keep_turns\": 4}}' (repeatable)")
    p.add_argument("--binding-engine", choices=sorted(ENGINES), default="generic",
                   help="the test summariser engine of --binding strategies (default generic)")
    p.add_argument("--json-out", help="write every figure as JSON here")
    p.add_argument("--markdown-out", help="write the tables as markdown here")
    p.add_argument("--update-doc", metavar="FILE",
                   help=f"replace the tables between {BEGIN} and {END} in FILE (docs/quality.md)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = p.parse_args(argv)
    args.custom = []
    for spec in args.binding:
        name, sep, raw = spec.partition("=")
        try:
            binding = json.loads(raw) if sep else None
        except ValueError as exc:
            p.error(f"--binding {name}: not JSON: {exc}")
        if not name or name in names or not isinstance(binding, dict):
            p.error(f"--binding: expected NEW_NAME={{...}}, got {spec!r}")
        try:
            default_registry().resolve("context_manager", binding, f"--binding {name}")
        except BindingError as exc:
            p.error("; ".join(f"{where}: {what}" for where, what in exc.problems))
        args.custom.append(Strategy(name, binding, args.binding_engine, custom=True))
    if args.update_doc:
        try:
            doc = Path(args.update_doc).read_text(encoding="utf-8")
        except OSError as exc:
            p.error(f"--update-doc: cannot read {args.update_doc}: {exc.strerror}")
        if BEGIN not in doc or END not in doc.partition(BEGIN)[2]:
            p.error(f"--update-doc: {args.update_doc} has no {BEGIN} ... {END} block")
    unknown = [s for s in args.strategies.split(",") if s not in names]
    unknown += [d for d in args.datasets.split(",") if d not in DATASETS]
    unknown += [w for w in args.wires.split(",") if w not in FORMS]
    if unknown:
        p.error(f"unknown strategy, data set or wire: {', '.join(unknown)}")
    try:
        args.budget_list = [parse_budget(b) for b in args.budgets.split(",")]
    except ValueError:
        p.error(f"--budgets: cannot read {args.budgets!r} (e.g. 8k,16k,32k)")
    if any(b < 1 for b in args.budget_list):
        p.error("--budgets: a budget is a positive number of tokens")
    return args


async def run(args: argparse.Namespace) -> dict[str, Any]:
    use_bundled_encodings()
    bench = Run()
    chosen = [s for s in strategies() if s.name in args.strategies.split(",")] + args.custom
    skipped = {s.name: why for s in chosen if (why := available(s)) is not None}
    results: dict[str, Any] = {"model": MODEL, "encoding": ENCODING, "skipped": skipped, "datasets": {}}
    for dataset in args.datasets.split(","):
        conversations = DATASETS[dataset](args)[: args.limit]
        subjects = [Subject(c) for c in conversations]
        deps = [d for s in subjects for d in s.conversation.dependencies]
        last = [sum(bench.json_tokens(canonical(m)) for m in c.messages) for c in conversations]
        block: dict[str, Any] = {
            "conversations": len(subjects),
            "requests": sum(len(request_points(c.messages)) for c in conversations),
            "dependencies": len(deps),
            "tokens_mean": round(sum(last) / max(1, len(last))),
            "tokens_max": max(last, default=0),
            "rows": [],
        }
        for wire in args.wires.split(","):
            for budget in args.budget_list:
                for strategy in chosen:
                    if strategy.name in skipped:
                        continue
                    started = time.monotonic()
                    totals = await bench.measure(strategy, budget, subjects, FORMS[wire])
                    row = {"strategy": strategy.name, "wire": wire, "budget": budget_label(budget),
                           **totals.figures()}
                    block["rows"].append(row)
                    if not args.quiet:
                        print(f"{dataset} {wire} {row['budget']} {strategy.name}: "
                              f"tokens {cell(row['tokens_forwarded_pct'])}% "
                              f"deps {cell(row['dependencies_answerable_pct'])}% "
                              f"values {cell(row['values_kept_pct'])}% prefix {cell(row['prefix_kept_pct'])}% "
                              f"({time.monotonic() - started:.1f}s)", file=sys.stderr)
        results["datasets"][dataset] = block
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        results = asyncio.run(run(args))
    except Failure as exc:
        print(f"bench/retention.py: {exc}", file=sys.stderr)
        return 1
    text = markdown(results)
    if args.markdown_out:
        Path(args.markdown_out).write_text(text + "\n", encoding="utf-8")
    if args.update_doc:
        update_doc(Path(args.update_doc), text)
    if args.json_out:
        Path(args.json_out).write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2) + b"\n")
    sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
