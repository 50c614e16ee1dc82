"""Running the app: one process, or several workers sharing one port; signals and drain."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
from typing import TYPE_CHECKING, Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from proxy.serve.logsink import LogSink, capture_stdio, install_log_sink
from proxy.serve.workers import HELD_UNTIL_READY, SUPERVISOR_ENV
from proxy.settings import LOG_QUEUE_LINES, Config

if TYPE_CHECKING:
    from proxy.serve.state import State

log = logging.getLogger("ctxproxy")
GC_THRESHOLDS = (20_000, 50, 50)


class MalformedRequestLine(logging.Filter):
    """aiohttp logs a malformed request (an over-long header, a bad request line) with a traceback that
    quotes the offending bytes, which may be a client's key: keep one line that names the error, never them."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            record.msg = f"{record.getMessage()}: {type(exc).__name__} (answered {exc.code})"
            record.args = None
            record.exc_info = record.exc_text = None
        return True


def setup_logging(level: str, queue_lines: int = LOG_QUEUE_LINES) -> LogSink:
    """Every log record as one JSON line on stderr, through a bounded queue that a thread writes out."""
    sink = install_log_sink(level, queue_lines)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, MalformedRequestLine) for f in server_log.filters):
        server_log.addFilter(MalformedRequestLine())
    return sink


def serve(config: Config, *, host: str | None = None, port: int | None = None, workers: int | None = None) -> int:
    s = config.settings.server
    host = host or s.host
    port = s.port if port is None else port
    workers = workers or s.workers
    sink = setup_logging(config.settings.logging.level, config.settings.logging.queue_lines)
    capture_stdio(sink)  # a library's print() must not write to a stderr nobody reads, on the event loop
    try:
        if workers > 1 and os.environ.get(SUPERVISOR_ENV) is None:
            from proxy.serve.supervisor import supervise

            return supervise(config, host, port, workers)
        main = _run(config, host, port, reuse_port=workers > 1, sink=sink)
        try:
            import uvloop
        except ImportError:  # pragma: no cover - uvloop is optional (not on Windows)
            asyncio.run(main)
        else:
            uvloop.run(main)
        return 0
    except Exception as exc:  # a port in use, ...: said here, as a log line (after sink.stop() nothing is written)
        log.critical("ctxproxy serve failed: %s", exc, exc_info=True)
        return 1
    finally:
        sink.stop()


async def _run(config: Config, host: str, port: int, *, reuse_port: bool, sink: LogSink) -> None:
    from proxy.serve.app import create_app
    from proxy.serve.state import STATE

    app = create_app(config, config_path=None if config.source == "<memory>" else config.source)
    state = app[STATE]
    sink.count_drops(state.metrics.log_lines_dropped.inc)
    drain = config.settings.server.drain_timeout
    runner = make_runner(app, config)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_port=reuse_port or None, backlog=2048)
    await site.start()
    bound = _bound_port(site) or port
    metrics_runner = await _metrics_listener(app, config, reuse_port=reuse_port, sink=sink)
    # load the default tokenizer and litellm's model map in the background: the first request
    # must not pay ~0.5 s for them
    warm = asyncio.get_running_loop().run_in_executor(None, _warm_up, state)
    state.announce()  # before the line below: a worker that says it listens is ready for its supervisor too
    url, pid = f"http://{host}:{bound}", os.getpid()
    sink.event({"event": "listening", "level": "INFO", "message": f"ctxproxy listening on {url} (pid {pid})",
                "url": url, "pid": pid})

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGHUP, state.reload)
    # held until now (by `serve`, or inherited from the supervisor): one that came meanwhile is handled now
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD_UNTIL_READY)
    await stop.wait()
    await warm
    state.draining = True
    log.info("draining: no new connections; in-flight requests get up to %ss", drain)
    if metrics_runner is not None:
        await metrics_runner.cleanup()
    await runner.cleanup()  # stops listening, waits for in-flight handlers up to shutdown_timeout
    log.info("stopped")


async def _metrics_listener(app: web.Application, config: Config, *, reuse_port: bool,
                            sink: LogSink) -> web.AppRunner | None:
    """The ``server.metrics_port`` listener (GET /metrics with no key), started; None when not configured."""
    from proxy.serve.app import create_metrics_app

    s = config.settings.server
    if s.metrics_port is None:
        return None
    runner = web.AppRunner(create_metrics_app(app), access_log=None, keepalive_timeout=s.header_timeout,
                           shutdown_timeout=1)
    await runner.setup()
    site = web.TCPSite(runner, s.metrics_host, s.metrics_port, reuse_port=reuse_port or None)
    await site.start()
    bound = _bound_port(site) or s.metrics_port
    url = f"http://{s.metrics_host}:{bound}/metrics"
    sink.event({"event": "metrics_listening", "level": "INFO", "message": f"ctxproxy metrics on {url} (no key)",
                "url": url})
    return runner


def make_runner(app: web.Application, config: Config, *, shutdown_timeout: float | None = None) -> web.AppRunner:
    """The app's runner: handlers cancelled with their client, idle and half-sent request heads timed out, request
    bodies decoded by ``proxy.serve.http.read_body`` (aiohttp would refuse a coding it cannot decode in plain text)."""
    from proxy.serve.state import STATE

    server = config.settings.server
    drain = server.drain_timeout if shutdown_timeout is None else shutdown_timeout
    if STATE in app:
        app[STATE].drain_timeout = drain  # background work gets what is left of it (proxy.serve.app)
    return web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=drain,
                         keepalive_timeout=server.header_timeout, auto_decompress=False)


def _warm_up(state: State) -> None:
    state.shared.tokenizers.get("o200k_base")
    for model in state.config.settings.models:  # each configured route's encoding (another loads off the loop)
        with contextlib.suppress(Exception):
            state.shared.tokenizers.get(state.runtime.route(model.name).encoding)
    state.shared.model_map.get("gpt-4o")
    if any(m.provider == "litellm" for m in state.config.settings.models):
        from proxy.upstream.litellm import warm_up

        warm_up()  # seconds of imports, here in a thread rather than on the first litellm request
    # Everything loaded so far (modules, config, litellm's model map: ~10^5 objects) lives as long as
    # the process: move it out of the collector's sight, so the collections that every request's
    # parsed JSON triggers do not walk it again and again.
    gc.collect()
    gc.freeze()
    # Each in-flight request holds its parsed body and one item per message (~1,000 tracked objects for a
    # 300-message agent request), so at the default thresholds (700, 10, 10) the collector walks those live
    # objects again and again: 0.43 ms of GC per request at 32 concurrent agent_long requests, 0.04 ms at
    # these (measured with gc.callbacks). Request objects die by reference counting; cycles are rare.
    gc.set_threshold(*GC_THRESHOLDS)


def _bound_port(site: web.TCPSite) -> int | None:
    server: Any = getattr(site, "_server", None)
    sockets = getattr(server, "sockets", None) or []
    for sock in sockets:
        return int(sock.getsockname()[1])
    return None
