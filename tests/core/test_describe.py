"""proxy.core.describe: the summariser's compact line shapes, shared by every wire."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.core import describe


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
