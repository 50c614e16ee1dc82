"""Property tests (hypothesis) for observation masking on the three wires.

Generated conversations of each wire (tests/helpers.py, tests/wire/responses_helpers.py,
tests/wire/messages_helpers.py: parallel calls, reused ids, reasoning and thinking, media, unknown keys
and, unless valid, pairing defects) go through the pipeline with the masking manager (one result kept,
grid steps of 1 and 2) and with summarising masking first, over a range of budgets. Whatever happens:

(a) masking never touches a call, its arguments, reasoning or thinking, user or assistant text: every
    forwarded element is the client's own object, except masked results (the placeholder in place of
    the output, every other key as sent) and a summary;
(b) pairing stays valid, by each wire's independent checker;
(c) the forwarded tokens, recounted independently, never exceed B;
(d) a valid request under the threshold is forwarded as the client's own body.
"""

from __future__ import annotations

import asyncio
import copy
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from proxy.core.conversation import WireAdapter
from proxy.core.errors import ContextLengthExceeded, PayloadError
from proxy.core.modelinfo import ModelMap
from proxy.core.tokens import TokenCounter
from proxy.pipeline import Assembly, assemble
from proxy.policy import Routes, policy_for
from proxy.wire.chat import WIRE as CHAT
from proxy.wire.messages import WIRE as MESSAGES
from proxy.wire.responses import WIRE as RESPONSES
from tests import helpers
from tests.helpers import FakeEngine, make_config, services, summary_service
from tests.wire import messages_helpers as mh
from tests.wire import responses_helpers as rh

COUNTER = TokenCounter("o200k_base")
MODEL_MAP = ModelMap()
BUDGETS = (300, 700, 1_500, 4_000)
MANAGERS: dict[str, Any] = {
    "masking": {"type": "observation-masking", "params": {"keep_recent": 1, "mask_step": 1}},
    "masking-grid": {"type": "observation-masking", "params": {"keep_recent": 0, "mask_step": 2}},
    "summarising": {"type": "summarising", "params": {"keep_turns": 1, "keep_recent": 1, "mask_step": 1}},
}
PLACEHOLDER = re.compile(r"^\[ctxproxy removed this .* output \(.*tokens\) to save context; "
                         r"call the tool again if you need it\]$")
SUMMARY = "[Conversation summary"
PROPERTY = settings(max_examples=60, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.large_base_example])


@dataclass(frozen=True)
class Wire:
    """One wire as these properties see it: its bodies, its units (what masking may replace), its checkers."""

    adapter: WireAdapter
    model: str
    body: Callable[[Any], dict[str, Any]]  # a generated conversation as a request body
    units: Callable[[dict[str, Any]], list[Any]]  # a body's elements, at the level masking replaces
    result_text: Callable[[Any], Any]  # the output of a result unit (None: not a result)
    pairing: Callable[[dict[str, Any]], list[str]]
    recount: Callable[[dict[str, Any]], int]
    is_summary: Callable[[Any], bool]


def _chat_result(unit: Any) -> Any:
    return unit.get("content") if unit.get("role") in ("tool", "function") else None


def _responses_result(unit: Any) -> Any:
    if not isinstance(unit, dict) or rh.kind(unit) not in rh.OUTPUTS:
        return None
    output = unit.get("output")
    if isinstance(output, list) and output and isinstance(output[0], dict) and "stdout" in output[0]:
        return output[0]["stdout"]  # shell_call_output: its (first) chunk's stdout
    return output


def _messages_units(body: dict[str, Any]) -> list[Any]:
    out: list[Any] = []
    for m in body["messages"]:
        out.extend([m] if isinstance(m["content"], str) else m["content"])
    return out


def _messages_result(unit: Any) -> Any:
    return unit.get("content") if unit.get("type") == "tool_result" else None


def _text_of(unit: Any) -> str:
    content = unit.get("content") if isinstance(unit, dict) else None
    if isinstance(content, list) and content and isinstance(content[0], dict):
        content = content[0].get("text")
    return content if isinstance(content, str) else ""


WIRES = {
    "chat": Wire(CHAT, helpers.MODEL, lambda c: {"model": helpers.MODEL, "messages": c},
                 lambda b: list(b["messages"]), _chat_result,
                 lambda b: helpers.pairing_problems(b["messages"]), lambda b: helpers.recount(b["messages"]),
                 lambda u: u.get("role") == "system" and _text_of(u).startswith(SUMMARY)),
    "responses": Wire(RESPONSES, helpers.MODEL, lambda c: {"model": helpers.MODEL, "input": c},
                      lambda b: list(b["input"]), _responses_result,
                      lambda b: rh.pairing_problems(b["input"]), rh.recount,
                      lambda u: isinstance(u, dict) and u.get("role") == "system" and _text_of(u).startswith(SUMMARY)),
    "messages": Wire(MESSAGES, mh.CLAUDE, lambda c: c, _messages_units, _messages_result,
                     lambda b: mh.pairing_problems(b["messages"]), mh.recount,
                     lambda u: u.get("type") == "text" and u.get("text", "").startswith(SUMMARY)),
}
STRATEGIES = {"chat": helpers.conversations, "responses": rh.conversations, "messages": mh.conversations}


def fatten(unit: Any, factor: int) -> None:
    """Make a result's text ``factor`` times longer (in place, before the request is sent): generated outputs are
    short, and masking only replaces an output its placeholder would shrink."""
    if not isinstance(unit, dict) or factor == 1:
        return
    for key in ("content", "output"):
        value = unit.get(key)
        if isinstance(value, str):
            unit[key] = " ".join([value] * factor)
        elif isinstance(value, list):
            for part in value:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    part["text"] = " ".join([part["text"]] * factor)


def draw_request(data: st.DataObject, wire: str, *, valid: bool) -> dict[str, Any]:
    w = WIRES[wire]
    request = w.body(data.draw(STRATEGIES[wire](valid=valid)))
    factor = data.draw(st.sampled_from([1, 3, 8]))
    for unit in w.units(request):
        if w.result_text(unit) is not None:
            fatten(unit, factor)
    return request


class Setup:
    def __init__(self, wire: str, manager: str, budget: int) -> None:
        self.wire = WIRES[wire]
        config = make_config(window=200_000, max_tokens=budget, model=self.wire.model,
                             context_manager=MANAGERS[manager])
        self.route = Routes(config, MODEL_MAP).resolve(self.wire.model)
        self.policy = policy_for(config, None, self.wire.model, None)
        self.engine = manager == "summarising"

    def run(self, body: dict[str, Any]) -> Assembly:
        svc = services(COUNTER, engine=FakeEngine(), summaries=summary_service()) if self.engine \
            else services(COUNTER)
        return asyncio.run(assemble(body, wire=self.wire.adapter, route=self.route, policy=self.policy,
                                    counter=COUNTER, services=svc))


SETUPS = {(w, m, b): Setup(w, m, b) for w in WIRES for m in MANAGERS for b in BUDGETS}


def untouched_problems(wire: Wire, before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """(a): every forwarded unit is the client's own object, a masked result, or a summary."""
    sent = wire.units(before)
    own = {id(u) for u in sent}
    problems = []
    for unit in wire.units(after):
        if id(unit) in own or wire.is_summary(unit):
            continue
        output = wire.result_text(unit)
        if not isinstance(output, str) or not PLACEHOLDER.match(output):
            problems.append(f"changed: {str(unit)[:160]}")
            continue
        if not any(wire.result_text(u) is not None and _without_output(u) == _without_output(unit) for u in sent):
            problems.append(f"a masked result changed more than its output: {str(unit)[:160]}")
    return problems


def _without_output(unit: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in unit.items() if k not in ("content", "output")}


def masked_count(wire: Wire, body: dict[str, Any]) -> int:
    outputs = [wire.result_text(u) for u in wire.units(body)]
    return sum(1 for o in outputs if isinstance(o, str) and PLACEHOLDER.match(o))


@pytest.mark.parametrize("wire", sorted(WIRES))
@pytest.mark.parametrize("manager", sorted(MANAGERS))
@PROPERTY
@given(data=st.data(), budget=st.sampled_from(BUDGETS))
def test_masking_changes_only_outputs_keeps_pairing_and_fits_the_budget(
        wire: str, manager: str, data: st.DataObject, budget: int) -> None:
    setup = SETUPS[(wire, manager, budget)]
    w = setup.wire
    request = draw_request(data, wire, valid=True)
    before = copy.deepcopy(request)
    try:
        a = setup.run(request)
    except ContextLengthExceeded:
        return
    assert request == before, "the client's body was mutated"
    problems = untouched_problems(w, request, a.body) + w.pairing(a.body)
    assert not problems, problems
    n = w.recount(a.body)
    assert n == a.report.tokens_after <= a.report.hard_budget == budget
    assert len(a.report.masked) >= masked_count(w, a.body)  # every masked output is reported (some may be trimmed)
    event(f"masked {min(3, masked_count(w, a.body))}, summary {a.report.summary}")


@pytest.mark.parametrize("wire", sorted(WIRES))
@pytest.mark.parametrize("manager", ["masking", "summarising"])
@PROPERTY
@given(data=st.data(), budget=st.sampled_from(BUDGETS))
def test_damaged_conversations_are_repaired_and_masked_within_budget(
        wire: str, manager: str, data: st.DataObject, budget: int) -> None:
    setup = SETUPS[(wire, manager, budget)]
    w = setup.wire
    request = draw_request(data, wire, valid=False)
    before = copy.deepcopy(request)
    try:
        a = setup.run(request)
    except (ContextLengthExceeded, PayloadError):  # what cannot fit, or no repair can fix (one id twice in a run)
        return
    assert request == before, "the client's body was mutated"
    assert not w.pairing(a.body), w.pairing(a.body)
    assert w.recount(a.body) == a.report.tokens_after <= a.report.hard_budget


@pytest.mark.parametrize("wire", sorted(WIRES))
@pytest.mark.parametrize("manager", sorted(MANAGERS))
@PROPERTY
@given(data=st.data(), budget=st.sampled_from(BUDGETS))
def test_a_valid_request_under_the_threshold_is_the_clients_own_body(
        wire: str, manager: str, data: st.DataObject, budget: int) -> None:
    setup = SETUPS[(wire, manager, budget)]
    w = setup.wire
    request = draw_request(data, wire, valid=True)
    if w.pairing(request) or w.recount(request) > int(budget / 1.1):
        return
    a = setup.run(request)
    assert a.changed is False and a.body is request and a.report.masked == []
