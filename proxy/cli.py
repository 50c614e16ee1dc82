"""``ctxproxy serve | validate | assemble``."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

import orjson

from proxy.errors import ConfigError, CtxProxyError
from proxy.settings import Config, load_config

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

    p_assemble = sub.add_parser("assemble", help="run the pipeline on a request body; never forwards it")
    p_assemble.add_argument("--config", default="config/ctxproxy.yaml")
    p_assemble.add_argument("request", help="chat-completions body (JSON file, or - for stdin)")
    p_assemble.add_argument("--key", help="proxy key, to apply that tenant's policy")
    p_assemble.add_argument("--context-manager", dest="override", help="per-request override, as the header")
    p_assemble.add_argument("--offline", action="store_true", help="no summariser calls (llm degrades to drop)")

    args = parser.parse_args(argv)
    if args.command == "validate":
        return _validate(args.file)
    if args.command == "assemble":
        return _assemble(args)
    return _serve(args)


def _load(path: str) -> Config | None:
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


def _assemble(args: argparse.Namespace) -> int:
    config = _load(args.config)
    if config is None:
        return EXIT_INVALID
    try:
        raw = sys.stdin.buffer.read() if args.request == "-" else Path(args.request).read_bytes()
    except OSError as exc:
        print(f"{args.request}: cannot read: {exc.strerror}", file=sys.stderr)
        return EXIT_INVALID
    result, code = asyncio.run(_run_assemble(config, raw, args.key, args.override, args.offline))
    sys.stdout.buffer.write(orjson.dumps(result, option=orjson.OPT_INDENT_2) + b"\n")
    return code


async def _run_assemble(
    config: Config, raw: bytes, key: str | None, override: str | None, offline: bool
) -> tuple[dict[str, Any], int]:
    from proxy.explain import explain
    from proxy.runtime import Runtime, open_shared
    from proxy.upstream import UpstreamEngine, UpstreamPool

    shared = open_shared(config)
    pool = None if offline else UpstreamPool(config.settings.server)
    runtime = Runtime(config, shared)
    if pool is not None:
        runtime.engine = UpstreamEngine(runtime, pool)
    try:
        tenant = runtime.authenticate(key) if key else None
        if config.tenants and key and tenant is None:
            from proxy.errors import AuthenticationError

            err = AuthenticationError("Incorrect API key provided.")
            return err.to_openai(), EXIT_REFUSED
        return await explain(runtime, raw, tenant, override), EXIT_OK
    except CtxProxyError as exc:
        return exc.to_openai(), EXIT_REFUSED
    finally:
        if pool is not None:
            await pool.close()
        await shared.summaries.close()
        await shared.cache.close()


def _serve(args: argparse.Namespace) -> int:
    config = _load(args.config)
    if config is None:
        return EXIT_INVALID
    from proxy.server import serve

    return serve(config, host=args.host, port=args.port, workers=args.workers)


if __name__ == "__main__":
    sys.exit(main())
