"""bench/retention_data.py: what counts as a value, where a dependency comes from, and the tau-bench sets."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bench.retention_data import (
    Conversation,
    Dependency,
    acted_values,
    argument_values,
    contains,
    detect_dependencies,
    request_points,
    tau_conversations,
    tau_sessions,
    text_values,
)


def test_text_values_are_ids_numbers_dates_paths_urls_and_emails() -> None:
    text = ("Booking NO6JO3 for mia_li_3668 (mia.li3818@example.com) on 2024-05-20, paid $1,250.50 with card 7447; "
            "logs in /var/log/app.log and src/core/sync.py, see https://example.com/a?b=1. I have 2 bags and 30 min.")
    assert list(text_values(text)) == ["NO6JO3", "mia_li_3668", "mia.li3818@example.com", "2024-05-20", "1,250.50",
                                       "7447", "/var/log/app.log", "src/core/sync.py", "https://example.com/a?b=1"]


def test_plain_words_and_small_numbers_are_not_values() -> None:
    assert list(text_values("Yes, please book the economy flight for 2 people at 10 am. Thanks!")) == []


def test_argument_values_are_the_short_leaves_and_the_values_inside_long_text() -> None:
    args = json.dumps({"user_id": "mia_li_3668", "cabin": "economy", "total_baggages": 2, "amount": 250,
                       "insurance": True, "passengers": [{"first_name": "Mia", "dob": "1990-04-05"}],
                       "thought": "The user wants to change reservation NO6JO3 and pay with certificate_7504069. " * 3})
    assert list(argument_values(args)) == ["mia_li_3668", "economy", "250", "Mia", "1990-04-05", "NO6JO3",
                                           "certificate_7504069", "NO6JO3", "certificate_7504069", "NO6JO3",
                                           "certificate_7504069"]
    assert list(argument_values("not json but has ticket PLAT-4821")) == ["PLAT-4821"]


def test_a_tool_output_holds_no_acted_value_but_user_and_assistant_messages_do() -> None:
    assert acted_values({"role": "tool", "tool_call_id": "c", "content": "reservation NO6JO3"}) == []
    assert acted_values({"role": "system", "content": "today is 2024-05-15"}) == []
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"id": "NO6JO3"}'}}
    assert acted_values({"role": "assistant", "content": "Cancelling NO6JO3 now.", "tool_calls": [call]}) == ["NO6JO3"]


def test_values_match_as_whole_tokens() -> None:
    assert contains("amount: 100.", "100")
    assert not contains("amount: 1000", "100")
    assert not contains("HAT1360", "HAT136")
    assert contains("flight HAT136-B", "HAT136")


def test_a_dependency_comes_first_from_a_tool_output_or_a_user_message() -> None:
    """The system prompt's date and the assistant's own suggestion are not dependencies; the user's id and the
    tool's reservation are, from where they first appeared."""
    def call(args: str) -> dict[str, Any]:
        return {"role": "assistant", "content": None,
                "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": args}}]}

    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "The current date is 2024-05-15."},
        {"role": "user", "content": "I am mia_li_3668."},
        call('{"user_id": "mia_li_3668"}'),
        {"role": "tool", "tool_call_id": "c", "content": '{"reservations": ["NO6JO3"]}'},
        {"role": "assistant", "content": "Shall I use flight HAT136?"},
        {"role": "user", "content": "Yes, and repeat mia_li_3668."},
        call('{"reservation_id": "NO6JO3", "flight": "HAT136", "date": "2024-05-15", "user": "mia_li_3668"}'),
    ]
    assert detect_dependencies(messages) == [Dependency("mia_li_3668", 1, 2), Dependency("NO6JO3", 3, 6),
                                             Dependency("mia_li_3668", 1, 6)]


def test_a_request_is_every_prefix_that_ends_where_the_model_is_called() -> None:
    roles = ["system", "user", "assistant", "tool", "assistant", "user", "assistant", "user"]
    assert request_points([{"role": r} for r in roles]) == [2, 4, 6, 8]
    assert request_points([{"role": r} for r in roles[:-1]]) == [2, 4, 6]


@pytest.fixture(scope="module")
def tau() -> list[Conversation]:
    return tau_conversations()


def test_the_tau_set_is_the_200_trajectories_as_recorded(tau: list[Conversation]) -> None:
    from bench.retention_data import tau_trajectories

    raw = tau_trajectories()
    assert len(tau) == 200
    assert all(c.messages == r["traj"] for c, r in zip(tau, raw))
    assert sum(len(c.dependencies) for c in tau) > 2000


def test_tau_sessions_chain_the_trajectories_in_order_under_one_system_prompt() -> None:
    from bench.retention_data import tau_trajectories

    raw = tau_trajectories()
    sessions = tau_sessions(min_tokens=40_000)
    assert len(sessions) >= 10
    chained = [m for s in sessions for m in s.messages if m["role"] != "system"]
    flat = [m for r in raw for m in r["traj"] if m["role"] != "system"]
    assert chained == flat[: len(chained)]
    for s in sessions:
        assert [m["role"] for m in s.messages].count("system") == 1
        assert sum(len(json.dumps(m)) // 4 for m in s.messages) >= 40_000
