"""proxy.core.describe: the summariser's compact line shapes, shared by every wire."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.core import describe
from tests.conftest import StartProxy
from tests.fake_upstream import FakeUpstream
from tests.outside import (
    Message,
    chat_body,
    post,
)
from tests.store.test_summaries_http import config as summarising_config
from tests.store.test_summaries_http import conversation


@pytest.mark.parametrize(("text", "limit", "expected"), [
    ("short", 10, "short"),
    ("exactly10!", 10, "exactly10!"),
    ("abcdefghijkl", 10, "abcde […2 chars…] hijkl"),
    ("", 0, ""),
])
def test_shorten(text: str, limit: int, expected: str) -> None:
    assert describe.shorten(text, limit) == expected


@given(st.text(max_size=400), st.integers(2, 100))
def test_shorten_keeps_both_ends(text: str, limit: int) -> None:
    out = describe.shorten(text, limit)
    if len(text) <= limit:
        assert out == text
    else:
        half = limit // 2
        assert out.startswith(text[:half]) and out.endswith(text[-half:])
        assert f"[…{len(text) - limit} chars…]" in out


@pytest.mark.parametrize(("value", "text"), [
    ("plain", "plain"),
    ({"city": "Zürich", "n": 1}, '{"city":"Zürich","n":1}'),
    ([1, 2], "[1,2]"),
    (None, "null"),
    (3.5, "3.5"),
])
def test_as_text(value: object, text: str) -> None:
    assert describe.as_text(value) == text


def test_as_text_of_something_json_cannot_hold() -> None:
    assert describe.as_text({1, 2}) in ("{1, 2}", "{2, 1}")


def test_said() -> None:
    assert describe.said("user", "hello") == "USER: hello"
    assert describe.said("assistant", "") == ""


def test_call_shortens_long_arguments_only() -> None:
    assert describe.call("call_1", "search", '{"q":"x"}') == 'TOOL CALL call_1 search({"q":"x"})'
    assert describe.call("c", "f", {"q": 1}) == 'TOOL CALL c f({"q":1})'
    long = "a" * (describe.ARGUMENT_CHARS + 100)
    line = describe.call("c", "f", long)
    assert "[…100 chars…]" in line
    assert len(line) < len(long)
    assert describe.call("c", None, None) == "TOOL CALL c None(null)"


def test_result_shortens_long_outputs() -> None:
    assert describe.result("call_1", "ok") == "TOOL RESULT call_1: ok"
    long = "r" * (describe.TOOL_RESULT_CHARS * 2)
    assert f"[…{describe.TOOL_RESULT_CHARS} chars…]" in describe.result("c", long)


def test_lines_drops_empty_parts() -> None:
    assert describe.lines("USER: a", "", "REFUSAL: no", "") == "USER: a\nREFUSAL: no"
    assert describe.lines() == ""


def test_a_long_result_keeps_the_passages_that_hold_the_values_a_later_turn_used() -> None:
    """The middle of a long tool output is cut for the summariser, but not the lines a later turn used:
    the summariser (and so the summary) can only keep what it is shown."""
    lines = [f"{i:04d} flight HAT{i:03d} JFK-SEA seats {i % 9}" for i in range(400)]
    text = "\n".join(lines)
    out = describe.shorten(text, 1500, keep=["HAT123", "HAT250", "HAT001", "HAT999"])
    assert out.startswith(text[:750]) and out.endswith(text[-750:])
    assert "\n0123 flight HAT123 JFK-SEA seats 6\n" not in out  # the line is kept alone, between gap marks
    assert "] 0123 flight HAT123 JFK-SEA seats 6 [" in out and "] 0250 flight HAT250 JFK-SEA seats 7 [" in out
    assert out.count("chars…]") == 3  # head … HAT123 … HAT250 … tail (HAT001 is in the head; HAT999 nowhere)
    assert len(out) < 1500 + 2 * 200 + 3 * 20
    # without values to keep: both ends, as before
    assert describe.shorten(text, 1500) == f"{text[:750]} […{len(text) - 1500} chars…] {text[-750:]}"


def test_a_passage_in_a_long_line_is_the_text_around_the_value() -> None:
    """A one-line JSON output has no short line to keep: the text around the value is kept instead."""
    text = '{"flights": [' + ", ".join(f'{{"n": "HAT{i:03d}", "price": {100 + i}}}' for i in range(300)) + "]}"
    out = describe.shorten(text, 1000, keep=["HAT150"])
    assert "HAT150" in out and len(out) < 1000 + describe.PASSAGE_CHARS + 60
    assert "HAT149" in out and "HAT140" not in out


@given(st.text(alphabet="abc XY12\n", max_size=3000), st.lists(st.sampled_from(["XY12", "a1", "bXY", "12"]),
                                                             max_size=4))
def test_shorten_never_cuts_a_kept_value_away(text: str, keep: list[str]) -> None:
    import re

    out = describe.shorten(text, 200, keep)
    for value in keep:
        if re.search(r"(?<![A-Za-z0-9_])" + value + r"(?![A-Za-z0-9_])", text):
            assert re.search(r"(?<![A-Za-z0-9_])" + value + r"(?![A-Za-z0-9_])", out), value


def summariser_text(upstream: FakeUpstream) -> str:
    """Everything the summariser was sent, all calls together."""
    return "\n".join(m["content"] for call in upstream.summaries for m in call.body["messages"]
                     if isinstance(m.get("content"), str))


def conversation_with(special: list[Message]) -> list[Message]:
    """conversation(40) with ``special`` messages inserted into its second turn (aged out, summarised)."""
    messages = conversation(40)
    at = next(i for i, m in enumerate(messages) if m["role"] == "user" and m["content"].startswith("Turn 1:")) + 1
    return messages[:at] + special + messages[at:]


async def summarise(upstream: FakeUpstream, start_proxy: StartProxy, special: list[Message]) -> str:
    # what the summariser is sent is the subject: no observation masking first (it may make a summary needless)
    proxy = await start_proxy(summarising_config(upstream.base_url, context_manager={
        "type": "summarising", "params": {"keep_turns": 4, "mask_observations": False}}))
    status, headers, body = await post(proxy, chat_body(conversation_with(special)))
    assert (status, headers.get("x-ctxproxy-summary")) == (200, "waited"), body
    return summariser_text(upstream)


@pytest.mark.usefixtures("shared_model_map")
async def test_summariser_sees_a_legacy_function_call(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """Book_flight({"flight": "HAT001"}) as a legacy function_call reaches the summariser."""
    text = await summarise(upstream, start_proxy, [
        {"role": "assistant", "content": None,
         "function_call": {"name": "book_flight", "arguments": json.dumps({"flight": "HAT001"})}},
        {"role": "function", "name": "book_flight", "content": "confirmed, seat 3A"},
    ])
    assert "confirmed, seat 3A" in text  # the result is there today; the call's arguments are not
    assert "HAT001" in text


@pytest.mark.usefixtures("shared_model_map")
async def test_summariser_sees_an_assistant_refusal(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """An assistant message with only a refusal reaches the summariser."""
    text = await summarise(upstream, start_proxy, [
        {"role": "assistant", "content": None, "refusal": "I cannot share passport number PX-REFUSED-77."}])
    assert "PX-REFUSED-77" in text


@pytest.mark.usefixtures("shared_model_map")
async def test_summariser_sees_an_audio_transcript(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """An assistant audio answer with a transcript reaches the summariser as its transcript."""
    text = await summarise(upstream, start_proxy, [
        {"role": "assistant", "content": None,
         "audio": {"id": "audio_1", "transcript": "Your gate is B12, boarding at 09:40 (AUDIO-MARK)."}}])
    assert "AUDIO-MARK" in text


@pytest.mark.usefixtures("shared_model_map")
async def test_summariser_sees_an_image_placeholder(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """An image part reaches the summariser as a placeholder, next to the text."""
    text = await summarise(upstream, start_proxy, [
        {"role": "user", "content": [{"type": "text", "text": "Here is my boarding pass IMG-MARK."},
                                     {"type": "image_url", "image_url": {"url": "https://example.com/p.png"}}]}])
    assert "IMG-MARK" in text
    assert re.search(r"\[[^\]]*image[^\]]*\]", text, re.IGNORECASE)
