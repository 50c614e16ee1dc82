"""bench/calibration_runs.py: the ways of setting the factor it compares, and one run through the proxy."""

from __future__ import annotations

import pytest

from bench.calibration_runs import RUNS, Envelope, Median, Split, measure

TOOLS, BUDGET = 15_000, 39_200


def test_split_finds_the_two_ratios_and_solves_the_budget_for_the_tool_list() -> None:
    way = Split(1.2)
    assert way.factor(TOOLS, BUDGET) == 1.2  # nothing seen yet: the default
    for rest in (1000, 4000, 9000, 16000):
        way.answered(TOOLS, TOOLS + rest, round(0.5 * TOOLS + 1.3 * rest))
    assert way.fit() == pytest.approx((0.5, 1.3), abs=0.01)
    factor = way.factor(TOOLS, BUDGET)
    left = BUDGET / factor - TOOLS  # what the budget leaves for the messages, in the proxy's count
    assert 0.5 * TOOLS + 1.3 * left == pytest.approx(BUDGET, rel=0.01)


def test_split_falls_back_to_the_single_ratio_while_the_mix_never_changed() -> None:
    way = Split(1.2)
    for _ in range(5):
        way.answered(TOOLS, TOOLS + 1000, round(0.5 * TOOLS + 1.3 * 1000))
    assert way.fit() is None and way.factor(TOOLS, BUDGET) == 1.2


def test_the_rule_before_followed_the_median_and_a_refusal_floored_it() -> None:
    way = Median(1.2)
    for _ in range(3):
        way.answered(TOOLS, 16_000, 8_800)
    assert way.factor(TOOLS, BUDGET) == 0.55  # three tool-heavy answers and the default is gone
    way.refused(TOOLS, 40_000, 52_000)
    assert way.factor(TOOLS, BUDGET) == 1.3


def test_the_envelope_holds_the_default_until_three_answers() -> None:
    way = Envelope(1.2)
    for _ in range(2):
        way.answered(TOOLS, 16_000, 8_800)
    assert way.factor(TOOLS, BUDGET) == 1.2


@pytest.mark.slow
async def test_the_first_run_through_the_proxy() -> None:
    """The measurement docs/cost.md records: the rule before let one request through to a refusal; the shipped
    proxy none."""
    before, shipped = await measure(RUNS["0.5/1.3"], "median"), await measure(RUNS["0.5/1.3"], "shipped")
    assert (before.refused, before.errors) == (1, 1)
    assert (shipped.refused, shipped.errors) == (0, 0)
