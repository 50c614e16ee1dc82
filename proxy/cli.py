"""``ctxproxy serve | validate | where | assemble | report``."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from proxy.core.errors import ConfigError, CtxProxyError

if TYPE_CHECKING:  # the settings (pydantic) load after `serve` has held SIGHUP (_serve)
    from proxy.settings import Config

EXIT_OK, EXIT_REFUSED, EXIT_INVALID = 0, 1, 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ctxproxy", description="Context-managing OpenAI-compatible proxy.")
    sub = parser.add_subparsers(dest="command", required=True)

    p_serve = sub.add_parser("serve", help="run the proxy")
    p_serve.add_argument("--config", default="config/ctxproxy.yaml")
    p_serve.add_argument("--host")
    p_serve.add_argument("--port", type=int)
    p_serve.add_argument("--workers", type=int, help="worker processes sharing the port")

    p_validate = sub.add_parser("validate", help="check a config file; exit 0 (ok) or 2 (one line per problem)")
    p_validate.add_argument("file")

    p_where = sub.add_parser("where", help="say where to point a client at this config, and which upstream gets what")
    p_where.add_argument("--config", default="config/ctxproxy.yaml")

    p_assemble = sub.add_parser("assemble", help="run the pipeline on a request body; never forwards it")
    p_assemble.add_argument("--config", default="config/ctxproxy.yaml")
    p_assemble.add_argument("request", help="request body (JSON file, or - for stdin)")
    # the registered wires; read only for ``assemble`` (``serve`` holds SIGHUP before it imports anything more)
    asked = sys.argv[1:] if argv is None else argv
    p_assemble.add_argument("--wire", choices=_wire_names() if asked[:1] == ["assemble"] else None,
                            help="the body's wire protocol (default: from the body, as explain picks it: "
                                 "responses for 'input' without 'messages', else chat)")
    p_assemble.add_argument("--key", help="proxy key, to apply that tenant's policy")
    p_assemble.add_argument("--context-manager", dest="override", help="per-request override, as the header")
    p_assemble.add_argument("--summarize", action="store_true",
                            help="make summaries that would be created (calls and bills the summariser); "
                                 "default: report them without calling anyone")
    p_assemble.add_argument("--mode", choices=("enforce", "observe"),
                            help="assemble in this mode rather than the policy's (observe: the client's body is "
                                 "forwarded; the report says what enforce would have done)")
    p_assemble.add_argument("--offline", action="store_true",
                            help="as if no summariser were reachable (llm degrades to drop)")

    p_report = sub.add_parser("report", help="the cost report per tenant and model, from the cost ledger")
    p_report.add_argument("--config", default="config/ctxproxy.yaml")
    p_report.add_argument("--since", default="24h", help="how far back: 90m, 24h, 7d (default 24h; at most 31d)")
    p_report.add_argument("--json", action="store_true", help="print JSON instead of a table")

    args = parser.parse_args(argv)
    if args.command == "validate":
        return _validate(args.file)
    if args.command == "where":
        return _where(args.config)
    if args.command == "assemble":
        return _assemble(args)
    if args.command == "report":
        return _report(args)
    return _serve(args)


def _wire_names() -> list[str]:
    """The registered wires (``proxy.wire.WIRES``), in order."""
    from proxy.wire import WIRES

    return list(WIRES)


def _load(path: str) -> Config | None:
    from proxy.settings import load_config

    try:
        return load_config(path)
    except ConfigError as exc:
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        return None


def _validate(path: str) -> int:
    if _load(path) is None:
        return EXIT_INVALID
    print("ok")
    return EXIT_OK


def _where(path: str) -> int:
    config = _load(path)
    if config is None:
        return EXIT_INVALID
    from proxy.where import where

    print("\n".join(where(config)), flush=True)
    return EXIT_OK


def _assemble(args: argparse.Namespace) -> int:
    config = _load(args.config)
    if config is None:
        return EXIT_INVALID
    try:
        raw = sys.stdin.buffer.read() if args.request == "-" else Path(args.request).read_bytes()
    except OSError as exc:
        print(f"{args.request}: cannot read: {exc.strerror}", file=sys.stderr)
        return EXIT_INVALID
    result, code = asyncio.run(_run_assemble(config, raw, args))
    sys.stdout.buffer.write(orjson.dumps(result, option=orjson.OPT_INDENT_2) + b"\n")
    return code


async def _run_assemble(config: Config, raw: bytes, args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    from proxy.serve.explain import explain
    from proxy.serve.state import build_runtime, build_shared
    from proxy.wire import WIRES

    shared = build_shared(config)
    runtime = build_runtime(config, shared, engine=not args.offline).runtime
    named = WIRES.get(args.wire) if args.wire is not None else None  # None: explain picks it from the body
    try:
        tenant = runtime.authenticate(args.key) if args.key else None
        if args.wire is not None and named is None:
            return {"error": {"message": f"the {args.wire} wire is not available", "type": "invalid_request_error",
                              "param": "wire", "code": "unknown_wire"}}, EXIT_INVALID
        return await explain(runtime, named, raw, tenant, args.override, summarize=args.summarize,
                             mode=args.mode), EXIT_OK
    except CtxProxyError as exc:
        return (named.error_body(exc) if named is not None else exc.to_openai()), EXIT_REFUSED
    finally:
        await shared.close()


def _report(args: argparse.Namespace) -> int:
    config = _load(args.config)
    if config is None:
        return EXIT_INVALID
    from proxy.serve.report import parse_since

    try:
        since = parse_since(args.since)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return EXIT_INVALID
    if config.settings.cache.backend == "memory":
        print("the memory cache lives inside the server process: ask it with GET /admin/report (admin key)",
              file=sys.stderr)
        return EXIT_INVALID
    from proxy.core.errors import LedgerUnavailable

    try:
        report = asyncio.run(_run_report(config, since))
    except LedgerUnavailable as exc:
        print(f"ctxproxy report: cannot read the cost ledger: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    if args.json:
        sys.stdout.buffer.write(orjson.dumps(report, option=orjson.OPT_INDENT_2) + b"\n")
    else:
        from proxy.serve.report import render

        sys.stdout.write(render(report))
    return EXIT_OK


async def _run_report(config: Config, since: float) -> dict[str, Any]:
    from proxy.serve.report import cost_report
    from proxy.store.backends import open_ledger_store

    store = open_ledger_store(config.settings.cache, create=False)  # a reader creates nothing
    try:
        return await cost_report(store, since)
    finally:
        await store.close()


def _serve(args: argparse.Namespace) -> int:
    # SIGHUP (reload) is held until the server has its handler: one sent while it loads must not end it
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    config = _load(args.config)
    if config is None:
        return EXIT_INVALID
    from proxy.serve.server import serve

    return serve(config, host=args.host, port=args.port, workers=args.workers)


if __name__ == "__main__":
    sys.exit(main())
