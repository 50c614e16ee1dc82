"""proxy.wire.sse and each wire's stream dialect (proxy.wire.<name>.stream): stream end, usage extraction and
error event; StreamWatcher on any chunking."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.errors import ContextLengthExceeded, UpstreamStatus, UpstreamTimeout, UpstreamUnreachable
from proxy.wire import WIRES
from proxy.wire.chat.stream import STREAM as CHAT
from proxy.wire.messages.stream import STREAM as MESSAGES
from proxy.wire.responses.stream import STREAM as RESPONSES
from proxy.wire.sse import SSE, StreamEnd, StreamWatcher

stream_end_for_path = WIRES.stream_end_for_path


def data(payload: Any) -> bytes:
    return b"data: " + (payload if isinstance(payload, bytes) else json.dumps(payload).encode()) + b"\n\n"


def event(name: str, payload: Any) -> bytes:
    return f"event: {name}\n".encode() + data(payload)


CHAT_USAGE = {"prompt_tokens": 19, "completion_tokens": 10, "total_tokens": 29,
              "prompt_tokens_details": {"cached_tokens": 0}}
CHAT_STREAM = b"".join([
    data({"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": ""}}], "usage": None}),
    data({"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {"content": "Hello \"usage\" [DONE]"}}], "usage": None}),
    data({"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": None}),
    data({"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [], "usage": CHAT_USAGE}),
    b"data: [DONE]\n\n",
])

RESPONSES_USAGE = {"input_tokens": 36, "output_tokens": 87, "total_tokens": 123,
                   "input_tokens_details": {"cached_tokens": 0}}
RESPONSES_STREAM = b"".join([
    event("response.created", {"type": "response.created", "sequence_number": 0,
                               "response": {"id": "resp_1", "status": "in_progress", "usage": None}}),
    event("response.output_text.delta", {"type": "response.output_text.delta", "sequence_number": 1,
                                         "delta": "response.completed"}),
    event("response.completed", {"type": "response.completed", "sequence_number": 2,
                                 "response": {"id": "resp_1", "status": "completed", "usage": RESPONSES_USAGE}}),
])

MESSAGES_STREAM = b"".join([
    event("message_start", {"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": "claude-sonnet-4",
        "usage": {"input_tokens": 472, "output_tokens": 2, "cache_creation_input_tokens": 0,
                  "cache_read_input_tokens": 128}}}),
    event("content_block_start", {"type": "content_block_start", "index": 0,
                                  "content_block": {"type": "text", "text": ""}}),
    event("ping", {"type": "ping"}),
    event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                  "delta": {"type": "text_delta", "text": "message_stop usage"}}),
    event("content_block_stop", {"type": "content_block_stop", "index": 0}),
    event("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                            "usage": {"output_tokens": 15, "cache_read_input_tokens": None}}),
    event("message_stop", {"type": "message_stop"}),
])
MESSAGES_USAGE = {"input_tokens": 472, "output_tokens": 15, "cache_creation_input_tokens": 0,
                  "cache_read_input_tokens": 128}

STREAMS = [
    ("chat", CHAT, CHAT_STREAM, CHAT_USAGE),
    ("responses", RESPONSES, RESPONSES_STREAM, RESPONSES_USAGE),
    ("messages", MESSAGES, MESSAGES_STREAM, MESSAGES_USAGE),
]


EOLS = [b"\n", b"\r\n", b"\r"]


def watch(end: StreamEnd, chunks: list[bytes]) -> StreamWatcher:
    watcher = StreamWatcher(0.0, end, clock=lambda: 1.5)
    for chunk in chunks:
        watcher.feed(chunk)
    return watcher


def split(stream: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(stream) + 1) for c in cuts})
    out, last = [], 0
    for p in points:
        out.append(stream[last:p])
        last = p
    out.append(stream[last:])
    return out


# --------------------------------------------------------------------------- whole streams


@pytest.mark.parametrize(("name", "end", "stream", "usage"), STREAMS, ids=[s[0] for s in STREAMS])
def test_a_whole_stream_is_complete_with_its_usage(
    name: str, end: StreamEnd, stream: bytes, usage: dict[str, Any]
) -> None:
    w = watch(end, [stream])
    assert w.done and w.complete
    assert w.usage == usage
    assert w.ttft == 1.5
    assert end.name == name


@pytest.mark.parametrize(("name", "end", "stream", "usage"), STREAMS, ids=[s[0] for s in STREAMS])
def test_every_single_cut_gives_the_same_result(
    name: str, end: StreamEnd, stream: bytes, usage: dict[str, Any]
) -> None:
    for cut in range(len(stream) + 1):
        w = watch(end, [stream[:cut], stream[cut:]])
        assert (w.done, w.usage) == (True, usage), cut


@pytest.mark.parametrize(("name", "end", "stream", "usage"), STREAMS, ids=[s[0] for s in STREAMS])
def test_byte_by_byte(name: str, end: StreamEnd, stream: bytes, usage: dict[str, Any]) -> None:
    w = watch(end, [stream[i:i + 1] for i in range(len(stream))])
    assert (w.done, w.usage) == (True, usage)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(STREAMS), st.lists(st.integers(0, 10_000), max_size=12), st.sampled_from(EOLS))
def test_any_chunking_and_line_ending(case: tuple[str, StreamEnd, bytes, dict[str, Any]], cuts: list[int],
                                      eol: bytes) -> None:
    """Whatever the chunking and the line ends (the SSE format allows CR, LF and CRLF), the same events; and the
    blocks the watcher lets through, joined, are the stream's bytes exactly."""
    _, end, stream, usage = case
    stream = stream.replace(b"\n", eol)
    w = StreamWatcher(0.0, end)
    relayed = b"".join(w.feed(chunk) for chunk in split(stream, cuts))
    assert (w.done, w.usage) == (True, usage)
    assert relayed == stream and w.pending == b""


@pytest.mark.parametrize("eol", EOLS, ids=["lf", "crlf", "cr"])
@pytest.mark.parametrize(("name", "end", "stream", "usage"), STREAMS, ids=[s[0] for s in STREAMS])
def test_every_single_cut_with_each_line_end(name: str, end: StreamEnd, stream: bytes, usage: dict[str, Any],
                                             eol: bytes) -> None:
    """A CR that ends one chunk and the LF that starts the next are one line end, never a blank line."""
    stream = stream.replace(b"\n", eol)
    for cut in range(len(stream) + 1):
        w = StreamWatcher(0.0, end)
        relayed = w.feed(stream[:cut]) + w.feed(stream[cut:])
        assert (w.done, w.usage, relayed) == (True, usage, stream), cut


@pytest.mark.parametrize("eol", EOLS, ids=["lf", "crlf", "cr"])
@pytest.mark.parametrize(("name", "end", "stream", "usage"), STREAMS, ids=[s[0] for s in STREAMS])
def test_a_stream_cut_inside_its_terminal_event_is_not_complete(name: str, end: StreamEnd, stream: bytes,
                                                                usage: Any, eol: bytes) -> None:
    """The end is the whole terminal event: its event line, its data line and the blank line that dispatches it.
    Cut anywhere before that blank line, the stream is not complete, and nothing of the event is let through."""
    stream = stream.replace(b"\n", eol)
    start = stream.rindex(eol * 2, 0, len(stream) - 2) + 2 * len(eol)  # where the terminal event starts
    for cut in range(start, len(stream) - len(eol) + 1):  # a CR alone ends the blank line: its LF may follow later
        w = StreamWatcher(0.0, end)
        relayed = w.feed(stream[:cut])
        assert not w.done and not w.complete, cut
        assert relayed == stream[:start] and w.pending == stream[start:cut], cut
    w = StreamWatcher(0.0, end)
    assert w.feed(stream) == stream and w.done


@pytest.mark.parametrize(("name", "end", "stream", "usage"), STREAMS, ids=[s[0] for s in STREAMS])
def test_a_stream_cut_before_its_end_is_not_complete(name: str, end: StreamEnd, stream: bytes, usage: Any) -> None:
    terminal = {"chat": b"data: [DONE]", "responses": b"event: response.completed",
                "messages": b"event: message_stop"}[name]
    head = stream[: stream.index(terminal)]
    for cut in range(0, len(head) + 1, max(1, len(head) // 40)):
        w = watch(end, [head[:cut]])
        assert not w.done and not w.complete, cut


# --------------------------------------------------------------------------- each wire's end


@pytest.mark.parametrize(("stream", "done"), [
    (b"data: [DONE]\n\n", True),
    (b"data:[DONE]\n\n", True),
    (b"data:   [DONE]  \r\n\r\n", True),
    (b"data: [DONE]\r\r", True),
    (b"data: [DONE]\n", False),  # the line is complete, but no blank line dispatched the event
    (b"data: [DONE]", False),  # the line never ended
    (b"data: \"[DONE]\"\n\n", False),
    (b"data: [DONE] now\n\n", False),
    (b": [DONE]\n\n", False),  # a comment
    (b"event: [DONE]\n\n", False),
    (b"DATA: [DONE]\n\n", False),
])
def test_chat_ends_only_on_a_done_data_line(stream: bytes, done: bool) -> None:
    assert watch(CHAT, [stream]).done is done


@pytest.mark.parametrize("kind", ["response.completed", "response.failed", "response.incomplete"])
def test_responses_terminal_events(kind: str) -> None:
    assert watch(RESPONSES, [event(kind, {"type": kind, "response": {}})]).done
    assert not watch(RESPONSES, [b"event: " + kind.encode() + b"\n"]).done  # the event line alone is not the end
    assert not watch(RESPONSES, [b"event: " + kind.encode() + b"\n\n"]).done  # an event without data is not one
    assert watch(RESPONSES, [data({"type": kind, "response": {}})]).done  # data-only streams: by the type


@pytest.mark.parametrize("stream", [
    b"data: [DONE]\n\n",  # not how the Responses API ends
    event("response.in_progress", {"type": "response.in_progress"}),
    event("response.output_text.delta", {"type": "response.output_text.delta", "delta": "response.completed"}),
    data({"type": "response.output_text.delta", "delta": "\"type\": \"response.completed\""}),
    data(b"{not json \"type\""),
    data(["response.completed"]),
])
def test_responses_non_terminal(stream: bytes) -> None:
    assert not watch(RESPONSES, [stream]).done


@pytest.mark.parametrize(("stream", "done"), [
    (event("message_stop", {"type": "message_stop"}), True),
    (b"event: message_stop\n", False),  # its event line alone
    (b"event: message_stop\ndata: {\"type\": \"message_stop\"}\n", False),  # not yet dispatched
    (b"event: message_stop\rdata: {\"type\": \"message_stop\"}\r\r", True),
    (data({"type": "message_stop"}), True),  # a data-only stream
    (event("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"}}), False),
    (event("content_block_delta", {"type": "content_block_delta", "delta": {"text": "\"message_stop\""}}), False),
    (b"data: [DONE]\n\n", False),
])
def test_messages_terminal(stream: bytes, done: bool) -> None:
    assert watch(MESSAGES, [stream]).done is done


@pytest.mark.parametrize(("end", "stream"), [
    (CHAT, data({"error": {"message": "The server had an error", "type": "server_error"}})),
    (RESPONSES, event("error", {"type": "error", "code": "server_error", "message": "failed"})),
    (RESPONSES, data({"type": "error", "code": "server_error", "message": "failed"})),
    (MESSAGES, event("error", {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})),
])
def test_an_upstreams_error_event_ends_its_stream_as_failed(end: StreamEnd, stream: bytes) -> None:
    """The upstream closes after its own error event: the stream is over (nothing is appended), and failed."""
    w = watch(end, [stream])
    assert w.done and w.failed


@pytest.mark.parametrize("chunk", [
    data({"error": None, "id": "c1", "object": "chat.completion.chunk", "choices": [{"delta": {"content": "x"}}]}),
    data({"id": "c1", "choices": [{"delta": {"content": "\"error\""}}]}),
    data({"error": "not an object"}),
])
def test_a_chat_chunk_that_only_mentions_error_does_not_end_the_stream(chunk: bytes) -> None:
    w = watch(CHAT, [chunk])
    assert not w.done and not w.failed


def test_an_error_object_with_spaces_ends_a_chat_stream() -> None:
    w = watch(CHAT, [b'data: { "error" : {"message": "boom", "type": "server_error"} }\n\n'])
    assert w.done and w.failed


def test_an_error_stays_a_failure_when_done_follows() -> None:
    """vLLM ends a failed stream with data: {"error": …} and then data: [DONE]."""
    w = watch(CHAT, [data({"error": {"message": "boom", "type": "server_error"}}), b"data: [DONE]\n\n"])
    assert w.done and w.failed


def test_a_terminal_event_is_not_a_failure() -> None:
    assert not watch(CHAT, [b"data: [DONE]\n\n"]).failed
    assert not watch(MESSAGES, [event("message_stop", {"type": "message_stop"})]).failed


def test_the_event_name_lasts_until_the_blank_line() -> None:
    w = watch(RESPONSES, [b"event: response.output_text.delta\n", b"data: {}\n", b"\n",
                          b"data: {\"type\": \"response.output_text.delta\"}\n\n"])
    assert not w.done


def test_an_unknown_stream_is_complete_on_a_clean_close() -> None:
    w = watch(SSE, [b"data: 0\n\n", b"data: 1\n\n"])
    assert not w.done and w.complete
    assert watch(SSE, []).complete


# --------------------------------------------------------------------------- usage


def test_chat_usage_null_chunks_keep_what_was_seen() -> None:
    w = watch(CHAT, [data({"choices": [], "usage": CHAT_USAGE}), data({"choices": [], "usage": None})])
    assert w.usage == CHAT_USAGE


def test_usage_in_unparseable_data_is_ignored() -> None:
    w = watch(CHAT, [b"data: {\"usage\": {broken\n\n", b"data: [\"usage\"]\n\n"])
    assert w.usage is None


def test_responses_usage_is_read_from_the_response_object_only() -> None:
    w = watch(RESPONSES, [data({"type": "response.output_text.delta", "usage": {"input_tokens": 1}}),
                          data({"type": "response.in_progress", "response": {"usage": None}})])
    assert w.usage is None


def test_anthropic_usage_merges_start_and_delta() -> None:
    start = {"type": "message_start", "message": {"usage": {"input_tokens": 10, "output_tokens": 1}}}
    delta = {"type": "message_delta", "usage": {"output_tokens": 99, "input_tokens": None}}
    w = watch(MESSAGES, [event("message_start", start), event("message_delta", delta)])
    assert w.usage == {"input_tokens": 10, "output_tokens": 99}
    # the delta alone (a stream joined late) still gives what it has
    assert watch(MESSAGES, [event("message_delta", delta)]).usage == {"output_tokens": 99}
    # other events with a usage key are ignored
    other = {"type": "content_block_delta", "usage": {"output_tokens": 5}}
    assert watch(MESSAGES, [event("content_block_delta", other)]).usage is None


def test_ttft_is_the_first_feed() -> None:
    times = iter([2.0, 9.0])
    w = StreamWatcher(0.5, CHAT, clock=lambda: next(times))
    w.feed(b"data: {}\n\n")
    w.feed(b"data: [DONE]\n\n")
    assert w.ttft == 1.5


# --------------------------------------------------------------------------- error events


def parse_events(raw: bytes) -> list[tuple[str | None, Any]]:
    out = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        name = None
        payload = None
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                payload = json.loads(line[6:])
        out.append((name, payload))
    return out


@pytest.mark.parametrize("error", [UpstreamUnreachable("The upstream closed the stream before it was complete."),
                                   UpstreamTimeout("stalled"),
                                   ContextLengthExceeded("too long", param="messages")])
def test_error_events_in_each_wires_shape(error: Any) -> None:
    for end in (CHAT, SSE):
        (name, payload), = parse_events(end.error_event(error))
        assert name is None and payload == error.to_openai()
    (name, payload), = parse_events(RESPONSES.error_event(error))
    body = error.to_openai()["error"]
    assert name == "error"
    assert payload == {"type": "error", "code": body["code"], "message": body["message"], "param": body["param"],
                       "sequence_number": 0, "error": body}  # the error object: the SDK raises APIError on it
    (name, payload), = parse_events(MESSAGES.error_event(error))
    assert name == "error"
    assert payload["type"] == "error" and payload["error"]["message"] == error.message
    assert payload["error"]["type"] in ("api_error", "invalid_request_error")


def test_an_anthropic_upstreams_own_error_is_relayed_in_its_stream() -> None:
    raw = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    error = UpstreamStatus(529, {"error": {"message": "Overloaded"}}, raw=raw)
    (_, payload), = parse_events(MESSAGES.error_event(error))
    assert payload == raw


def test_error_events_are_single_sse_events() -> None:
    error = UpstreamUnreachable("line one\nline two\r\n\n data: [DONE]")
    for end in (CHAT, RESPONSES, MESSAGES, SSE):
        raw = end.error_event(error)
        assert raw.endswith(b"\n\n") and raw.count(b"\n\n") == 1
        lines = raw[:-2].split(b"\n")
        assert all(line.startswith((b"event: ", b"data: ")) for line in lines)
        assert b"data: [DONE]" not in lines  # the message's own text never forms a line of its own


# --------------------------------------------------------------------------- relayed paths


@pytest.mark.parametrize(("path", "end"), [
    ("/v1/chat/completions", CHAT),
    ("/v1/chat/completions/", CHAT),
    ("/v1/chat/completions?stream=true", CHAT),
    ("/v1/responses", RESPONSES),
    ("/v1/responses/compact", RESPONSES),
    ("/v1/responses?x=1", RESPONSES),
    ("/v1/messages", MESSAGES),
    ("/v1/messages/", MESSAGES),
    ("/v1/completions", SSE),
    ("/v1/responses/resp_123", SSE),  # a stored response's stream resumes with the generic rule
    ("/v1/threads/runs", SSE),
    ("/v1/audio/speech", SSE),
    ("/", SSE),
])
def test_stream_end_for_path(path: str, end: StreamEnd) -> None:
    assert stream_end_for_path(path) is end
