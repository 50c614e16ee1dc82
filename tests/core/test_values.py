"""proxy.core.values: what summarised turns acted on, and the values section that carries it to the model."""

from __future__ import annotations

import json
import string
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core import values
from proxy.core.bands import split_turns
from proxy.core.items import Item
from proxy.core.tokens import TokenCounter
from proxy.core.values import Value
from tests.helpers import assistant, call, system, tool, user
from tests.wire.chat_helpers import items_of

COUNTER = TokenCounter("o200k_base")
GENERIC = "- The user asked for help; the assistant looked things up and went through the options."


def turns_of(messages: list[dict[str, Any]]) -> list[list[Item]]:
    return split_turns(items_of(messages))


@pytest.mark.parametrize(("text", "expected"), [
    ("Booking 8JXA2P on 2024-05-16 at 14:30 for $1,234.50, see https://x.io/a?b=1 and /srv/app.py; "
     "mail ada@example.com.",
     ["8JXA2P", "2024-05-16", "14:30", "1,234.50", "https://x.io/a?b=1", "/srv/app.py", "ada@example.com"]),
    ("I have 2 bags and 12 kids, no more", []),  # trivial numbers and words are not values
    ("order #A1B2 (id: user_42), commit 3f9a1c7", ["A1B2", "user_42", "3f9a1c7"]),
    ("error E404 at 2024-05-16T10:00:00, retry in 300ms", ["E404", "2024-05-16T10:00:00", "300ms"]),
])
def test_text_values(text: str, expected: list[str]) -> None:
    assert list(values.text_values(text)) == expected


def test_argument_values_are_every_leaf_keyed_by_its_argument() -> None:
    arguments = json.dumps({"user_id": "mia_li_3668", "flights": [{"flight_number": "HAT136", "date": "2024-05-20"}],
                            "passengers": 2, "insurance": "no", "nonstop": True, "note": None, "price": 412.5,
                            "query": "line one\nsee /etc/hosts and ticket ABC-123"})
    assert list(values.argument_values("book", arguments)) == [
        Value("user_id", "mia_li_3668"), Value("flight_number", "HAT136"), Value("date", "2024-05-20"),
        Value("passengers", "2"), Value("insurance", "no"), Value("price", "412.5"),
        Value("query", "/etc/hosts"), Value("query", "ABC-123")]
    # arguments that are not an object (a custom tool's free text) are keyed by the tool's name
    assert list(values.argument_values("shell", "ls -la /srv/app")) == [Value("shell", "ls -la /srv/app")]
    assert list(values.argument_values("shell", '"cat README.md"')) == [Value("shell", "cat README.md")]


def test_acted_on_lists_each_value_once_in_the_order_the_turns_used_it() -> None:
    """Calls and user and assistant text count; tool outputs and the system prompt do not (a value of an output a
    later call used is that call's); an argument's name wins over the role that mentioned the value first."""
    messages = [
        system("Agent. Escalation line 555-0100."),
        user("Hi, I am mia_li_3668 and want to change reservation 8JXA2P"),
        call(("c1", "get_reservation", json.dumps({"reservation_id": "8JXA2P"}))),
        tool("c1", json.dumps({"reservation_id": "8JXA2P", "flights": ["HAT136"], "payment": "gift_card_777"})),
        assistant("Found it: flight HAT136, 2 bags."),
        user("Move it to 2024-05-20"),
        call(("c2", "update", json.dumps({"reservation_id": "8JXA2P", "flight": "HAT136", "date": "2024-05-20",
                                          "bags": 2, "cabin": "economy"})),
             ("c3", "notify", json.dumps({"bags": 2, "to": "mia@example.com"}))),
        tool("c2", "ok"), tool("c3", "ok"),
    ]
    acted = values.acted_on(turns_of(messages))
    assert acted == [Value("user", "mia_li_3668"), Value("reservation_id", "8JXA2P"), Value("flight", "HAT136"),
                     Value("date", "2024-05-20"), Value("bags", "2"), Value("cabin", "economy"),
                     Value("to", "mia@example.com")]
    # nothing of the system prompt, nothing of the outputs alone (gift_card_777 was never used)
    assert "555-0100" not in {v.text for v in acted} and "gift_card_777" not in {v.text for v in acted}


def test_a_short_value_is_listed_once_per_key() -> None:
    messages = [user("go"), call(("c1", "f", json.dumps({"adults": 2, "bags": 2, "seat": "2"}))), tool("c1")]
    assert values.acted_on(turns_of(messages)) == [Value("adults", "2"), Value("bags", "2"), Value("seat", "2")]


def test_missing_is_a_whole_token_check_and_short_values_are_always_listed() -> None:
    acted = [Value("id", "HAT1"), Value("id", "HAT170"), Value("bags", "2"), Value("path", "/srv/app.py")]
    summary = "- booked HAT170 with 2 bags; edited /srv/app.py."
    assert values.missing(acted, summary) == [Value("id", "HAT1"), Value("bags", "2")]


def test_the_section_groups_by_key_in_order_and_quotes_what_holds_a_separator() -> None:
    acted = [Value("reservation_id", "8JXA2P"), Value("flight", "HAT170"), Value("reservation_id", "ZFA04Y"),
             Value("amount", "1,234.50"), Value("name", "Mia Li"), Value("q", 'a "quoted"; thing')]
    made = values.section(acted, 1000, COUNTER.text)
    assert made.text == ('Values these turns acted on: reservation_id=8JXA2P, ZFA04Y; flight=HAT170; '
                         'amount="1,234.50"; name=Mia Li; q="a \\"quoted\\"; thing"')
    assert (made.listed, made.left_out) == (6, 0)


def test_past_its_bound_the_section_leaves_the_oldest_values_out_and_says_so() -> None:
    acted = [Value("reservation_id", f"R{i:05d}X") for i in range(300)]
    whole = values.section(acted, 100_000, COUNTER.text)
    assert COUNTER.text(whole.text) > 200
    made = values.section(acted, 200, COUNTER.text)
    assert COUNTER.text(made.text) <= 200 and made.listed + made.left_out == 300 and made.left_out > 0
    assert made.text.startswith(f"Values these turns acted on ({made.left_out} older values left out): "
                                f"reservation_id=R{made.left_out:05d}X, ")
    assert made.text.endswith("R00299X")
    assert values.section(acted, 300, COUNTER.text).listed > made.listed  # a larger bound lists more
    assert values.section(acted, 3, COUNTER.text).text == ""  # not even one fits: no section
    assert values.section(acted, 0, COUNTER.text).text == ""  # the cap at 0: no section at all


def test_keep_values_appends_what_the_summary_leaves_out() -> None:
    messages = [user("change 8JXA2P please"), call(("c1", "get", json.dumps({"reservation_id": "8JXA2P"}))),
                tool("c1", "{}"), assistant("Done: HAT170 on 2024-05-20")]
    turns = turns_of(messages)
    assert values.keep_values(GENERIC, turns, 1000, COUNTER.text) == (
        f"{GENERIC}\n\nValues these turns acted on (ctxproxy lists those the summary leaves out): "
        "reservation_id=8JXA2P; assistant=HAT170, 2024-05-20")
    complete = "- 8JXA2P moved to HAT170 on 2024-05-20."
    assert values.keep_values(complete, turns, 1000, COUNTER.text) == complete  # nothing left out: no section
    # the most a summary can gain: the section of every value, which a summary keeping none of them gets
    largest = values.section_of(turns, 1000, COUNTER.text, values.SUMMARY_LEAD).text
    assert values.keep_values(GENERIC, turns, 1000, COUNTER.text) == GENERIC + values.SEPARATOR + largest


_leaf = st.one_of(st.text(string.ascii_letters + string.digits + "_-./:@ ", min_size=1, max_size=30),
                  st.integers(-10**9, 10**9), st.floats(allow_nan=False, allow_infinity=False, width=32))
_arguments = st.dictionaries(st.text(string.ascii_lowercase + "_", min_size=1, max_size=12),
                             st.one_of(_leaf, st.lists(_leaf, max_size=3),
                                       st.dictionaries(st.text(string.ascii_lowercase, min_size=1, max_size=8),
                                                       _leaf, max_size=3)), max_size=5)


@settings(max_examples=150, deadline=None)
@given(st.lists(_arguments, min_size=1, max_size=6))
def test_every_argument_leaf_reaches_the_model_whatever_the_summary(calls: list[dict[str, Any]]) -> None:
    """Property: with a summary that keeps nothing, every leaf of every call's arguments is in the summary
    message (the section is within its bound here), and the section is the same for the same turns."""
    messages: list[dict[str, Any]] = [user("go")]
    for i, arguments in enumerate(calls):
        messages += [call((f"c{i}", "tool", json.dumps(arguments))), tool(f"c{i}", "ok")]
    turns = turns_of(messages)
    text = values.keep_values(GENERIC, turns, 100_000, COUNTER.text)
    assert text == values.keep_values(GENERIC, turns_of(messages), 100_000, COUNTER.text)
    for value in values.acted_on(turns):
        assert value.text.strip() in text, value


def test_used_later_finds_the_output_values_a_later_call_or_message_used() -> None:
    output = json.dumps({"flights": [{"flight_number": f"HAT{i:03d}", "price": 100 + i} for i in range(50)]})
    messages = [user("find flights"), call(("c1", "search", "{}")), tool("c1", output),
                assistant("HAT017 is the cheapest"), call(("c2", "book", json.dumps({"flight": "HAT042"}))),
                tool("c2", "ok")]
    items = items_of(messages)
    uses = values.last_uses(items)
    found = values.used_later(items[2], 2, uses, values.spaced_values(uses))
    assert found == {"HAT017", "HAT042"}
    assert values.used_later(items[5], 5, uses) == frozenset()  # nothing used after the last one
    assert values.used_later(items[3], 3, uses) == frozenset()  # not a result


def test_hostile_arguments_and_text() -> None:
    """Arguments nested a thousand deep are read without recursion; a value with control characters or a
    separator is quoted; a pasted log of ten thousand numbers costs no more to bound than its newest values."""
    deep = "[" * 1000 + '"HAT170"' + "]" * 1000
    assert list(values.argument_values("f", deep)) == [Value("f", "HAT170")]
    made = values.section([Value("q", "a\x00b"), Value("q", "x\u2028y"), Value("q", "ok")], 100, COUNTER.text)
    assert made.text == 'Values these turns acted on: q="a\\u0000b", "x\\u2028y", ok'
    log = " ".join(str(100_000 + i) for i in range(10_000))
    acted = values.acted_on(turns_of([user(log)]))
    assert len(acted) == 10_000
    bounded = values.section(acted, 300, COUNTER.text)
    assert COUNTER.text(bounded.text) <= 300 and bounded.listed + bounded.left_out == 10_000
    assert bounded.text.endswith("109999")


@pytest.mark.parametrize("text", ["\u202egnp.exe\u2028next", "tab\there", "x\U000e0001y", "zero\u200bwidth"])
def test_a_value_with_invisible_or_reordering_characters_is_listed_escaped(text: str) -> None:
    """A value lands in the model's context: a right-to-left override, a line separator or a tag character
    written raw would hide or reorder what the model reads. Such values are quoted with those characters
    escaped, and the quoted text still decodes to the value itself."""
    listed = values.listing([Value("name", text)])
    assert listed.isprintable()
    key, written = listed.split("=", 1)
    assert key == "name" and json.loads(written) == text
    assert values.listing([Value("name", "café 日本")]) == "name=café 日本"  # printable text stays readable
