"""The server's log: every event one JSON line on stderr, written by one thread from a bounded queue.

A log reader that falls behind (a pipe nobody reads, a stalled collector) must never stall the
proxy. A logging call only formats its record (on the caller's thread) and puts the line in a
bounded queue; one writer thread writes the queue to stderr, and it alone waits when stderr is
full. When the queue is full the line is dropped and counted (``LogSink.dropped``, and
``ctxproxy_log_lines_dropped_total`` once the app is attached); as soon as the writer can write
again, one ``{"event": "log_dropped", "dropped": N, "total": M}`` line says how many were lost (at
most one such line every ``NOTICE_EVERY`` seconds while the loss goes on).

Every line is a JSON object: the request log's own (``ctxproxy.requests``, marked ``STRUCTURED``),
``{"event": "log", "level", "logger", "message"[, "exception"]}`` for any other record (litellm's
and aiohttp's included; message and traceback cut at ``FIELD_CHARS``, so the queue holds at most
``capacity`` lines of a few kB), and, once ``capture_stdio`` ran, one such line per line a library
prints to stdout or stderr (``logger`` "stdout" / "stderr").
"""

from __future__ import annotations

import io
import json
import logging
import os
import queue
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, TextIO

import orjson

# ``extra=`` for a record whose message is already a JSON object (read-only: no module-level mutable state)
STRUCTURED: Mapping[str, object] = MappingProxyType({"ctxproxy_json": True})
NOTICE_EVERY = 10.0  # seconds between two "lines dropped" notices while lines keep being dropped
BATCH_BYTES = select.PIPE_BUF  # the writer joins queued lines into writes of at most this many bytes
FIELD_CHARS = 16_384  # a message or a traceback longer than this is cut: a queued line stays small
PARTIAL_LINE = FIELD_CHARS  # printed text without a newline is logged in pieces of this many characters
_STOP = "\x00stop"


def json_line(fields: dict[str, Any]) -> str:
    """``fields`` as one line of JSON, whatever the strings hold (lone surrogates included)."""
    try:
        return orjson.dumps(fields, default=str).decode()
    except TypeError:
        return json.dumps(fields, default=str)


class JsonFormatter(logging.Formatter):
    """A record as one JSON object; a ``STRUCTURED`` record's message is one already."""

    def format(self, record: logging.LogRecord) -> str:
        if getattr(record, "ctxproxy_json", False):
            return record.getMessage()
        fields: dict[str, Any] = {"event": "log", "level": record.levelname, "logger": record.name,
                                  "message": cut(record.getMessage())}
        if record.exc_info:
            record.exc_text = record.exc_text or self.formatException(record.exc_info)
        if record.exc_text:
            fields["exception"] = cut(record.exc_text)
        if record.stack_info:
            fields["stack"] = cut(self.formatStack(record.stack_info))
        return json_line(fields)


def cut(text: str) -> str:
    """``text``, at most ``FIELD_CHARS`` of it (a library at DEBUG may log whole request bodies)."""
    if len(text) <= FIELD_CHARS:
        return text
    return f"{text[:FIELD_CHARS]}... [{len(text) - FIELD_CHARS} characters cut]"


class QueueLineHandler(logging.Handler):
    """Formats a record on the caller's thread and hands the line to the sink; never waits."""

    def __init__(self, sink: LogSink) -> None:
        super().__init__()
        self.sink = sink
        self.setFormatter(JsonFormatter())

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception as exc:  # a record whose arguments do not fit its format
            line = json_line({"event": "log", "level": "ERROR", "logger": "ctxproxy.log",
                              "message": f"a log record from {record.name} could not be formatted "
                                         f"({type(exc).__name__})"})
        self.sink.put(line)


class LogSink:
    """A bounded queue of log lines and the thread that writes them to ``stream``."""

    def __init__(self, stream: TextIO, capacity: int) -> None:
        self.stream = stream
        self.queue: queue.Queue[str] = queue.Queue(maxsize=capacity)
        self.handler = QueueLineHandler(self)
        self.dropped = 0
        self._noticed = 0
        self._last_notice = float("-inf")
        self._on_drop: Callable[[float], None] | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="ctxproxy-log", daemon=True)
        try:
            self._fd: int | None = stream.fileno()
        except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
            self._fd = None

    # -- the callers' side (any thread, never blocks) --------------------------------------------

    def put(self, line: str) -> bool:
        """Queue one line; drop and count it when the queue is full."""
        try:
            self.queue.put_nowait(line)
            return True
        except queue.Full:
            with self._lock:
                self.dropped += 1
                on_drop = self._on_drop
            if on_drop is not None:
                on_drop(1)
            return False

    def event(self, fields: dict[str, Any]) -> None:
        """One line of the server's own (not a log record: written whatever the level)."""
        self.put(json_line(fields))

    def count_drops(self, on_drop: Callable[[float], None] | None) -> None:
        """Report every dropped line to ``on_drop`` (a counter's ``inc``), the ones so far included."""
        with self._lock:
            self._on_drop = on_drop
            so_far = self.dropped
        if on_drop is not None and so_far:
            on_drop(so_far)

    # -- lifecycle ------------------------------------------------------------------------------------

    def start(self) -> LogSink:
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        """Write what is queued, for at most ``timeout`` seconds (a stalled reader cannot hold the exit)."""
        if not self._thread.is_alive():
            return
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.queue.put(_STOP, timeout=0.05)
                break
            except queue.Full:
                if time.monotonic() >= deadline:
                    return
        self._thread.join(max(0.0, deadline - time.monotonic()))

    # -- the writer thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        # signals are the main thread's business: a supervisor waits for them blocked (sigtimedwait), and one
        # delivered here, unblocked, would take its default action (SIGTERM: end the process, workers left)
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        carried: str | None = None  # a line that did not fit in the last write
        while True:
            if carried is not None:
                line, carried = carried, None
            else:
                try:
                    line = self.queue.get(timeout=NOTICE_EVERY)
                except queue.Empty:
                    self._notice()
                    continue
            if line == _STOP:
                self._notice(force=True)
                return
            # whole lines, at most PIPE_BUF bytes a write (unless one line is longer): a pipe writes that much
            # in one piece, so the workers that share stderr never cut into each other's lines
            batch = [_encoded(line)]
            size = len(batch[0])
            while carried is None:
                try:
                    more = self.queue.get_nowait()
                except queue.Empty:
                    break
                data = _encoded(more) if more != _STOP else b""
                if more == _STOP or size + len(data) > BATCH_BYTES:
                    carried = more
                else:
                    batch.append(data)
                    size += len(data)
            self._write(b"".join(batch))
            self._notice()

    def _notice(self, *, force: bool = False) -> None:
        """One line saying how many lines were dropped since the last such line."""
        with self._lock:
            new = self.dropped - self._noticed
            now = time.monotonic()
            if new <= 0 or (not force and now - self._last_notice < NOTICE_EVERY):
                return
            self._noticed, self._last_notice = self.dropped, now
            total = self.dropped
        self._write(_encoded(json_line({"event": "log_dropped", "level": "WARNING", "dropped": new, "total": total,
                                        "message": f"{new} log lines dropped: stderr was not read fast enough"})))

    def _write(self, data: bytes) -> None:
        try:
            if self._fd is None:
                self.stream.write(data.decode("utf-8", "replace"))
                self.stream.flush()
                return
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
        except Exception:  # the reader is gone (EPIPE), stderr closed (None): the writer must live on
            pass


def _encoded(line: str) -> bytes:
    """A line as the bytes written for it, its newline included (never fails: lone surrogates escaped)."""
    return line.encode("utf-8", "backslashreplace") + b"\n"


class PrintedLines(io.TextIOBase):
    """A text stream (``sys.stdout``/``sys.stderr``) whose lines become log lines in the sink."""

    encoding = "utf-8"  # what callers of sys.stdout.encoding expect to find

    def __init__(self, sink: LogSink, name: str, level: str) -> None:
        super().__init__()
        self.sink = sink
        self._name = name
        self._level = level
        self._held = ""
        self._lock = threading.Lock()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def write(self, text: str) -> int:
        with self._lock:
            data = self._held + text
            *lines, self._held = data.split("\n")
            if len(self._held) >= PARTIAL_LINE:
                lines.append(self._held)
                self._held = ""
        for line in lines:
            if line.strip():
                self.sink.put(json_line({"event": "log", "level": self._level, "logger": self._name,
                                         "message": cut(line.rstrip("\r"))}))
        return len(text)


def install_log_sink(level: str, capacity: int, stream: TextIO | None = None) -> LogSink:
    """Route every log record through a new ``LogSink`` on ``stream`` (stderr) at ``level``; start it.

    The root logger's handlers are replaced by the sink's, warnings become log records, and the
    loggers of libraries that bring their own handler keep it (litellm's are removed where it is
    imported, ``proxy.upstream.litellm``).
    """
    sink = LogSink(stream if stream is not None else sys.stderr, capacity).start()
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(sink.handler)
    root.setLevel(getattr(logging, level, logging.INFO))
    logging.captureWarnings(True)
    return sink


def capture_stdio(sink: LogSink) -> None:
    """Make what anything prints a log line too: nothing in the process writes to stdout or stderr itself."""
    sys.stdout = PrintedLines(sink, "stdout", "INFO")
    sys.stderr = PrintedLines(sink, "stderr", "WARNING")
