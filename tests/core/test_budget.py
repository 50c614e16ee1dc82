"""proxy.core.budget: B and T, the bounded default reserve, why() and calibration."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from proxy.core.budget import (
    DEFAULT_RESERVE,
    RESERVE_WINDOW_SHARE,
    Budget,
    TrimmerParams,
    compute_budget,
    why,
)


def budget(window: int = 128_000, *, request: int | None = None, model_out: int | None = None,
           trimmer: TrimmerParams | None = None, cap: int | None = None, hysteresis: float = 0.1,
           threshold: int = 0, calibration: float = 1.0, provider: int | None = None) -> Budget:
    return compute_budget(window=window, request_max_tokens=request, model_max_output=model_out,
                          trimmer=trimmer or TrimmerParams(), tenant_cap=cap, hysteresis_ratio=hysteresis,
                          summary_threshold=threshold, calibration=calibration, provider_window=provider)


# --------------------------------------------------------------------------- the provider's real window


def test_the_providers_window_replaces_a_larger_configured_one() -> None:
    """Reserve, margin and B all come from the window the provider refused above, and a refusal says so."""
    b = budget(120_000, model_out=16_384, provider=12_000)
    assert (b.window, b.reserve, b.margin, b.hard_budget, b.limited_by) == (12_000, 3_000, 1_200, 7_800, "provider")
    assert why(b).startswith("the provider's window 12000 - completion reserve 3000")
    assert budget(120_000, provider=200_000) == budget(120_000)  # never widened
    assert budget(120_000, provider=None) == budget(120_000)


def test_the_providers_window_caps_an_explicit_budget_too() -> None:
    explicit = TrimmerParams(max_tokens=50_000)
    assert budget(120_000, trimmer=explicit, provider=12_000).hard_budget == 12_000 - 3_000 - 1_200
    assert budget(120_000, trimmer=explicit, provider=100_000).hard_budget == 50_000  # the smaller one holds
    assert budget(120_000, trimmer=explicit, provider=12_000, cap=5_000).limited_by == "cap"


# --------------------------------------------------------------------------- the completion reserve


@pytest.mark.parametrize(("window", "model_out", "reserve"), [
    (128_000, 16_384, 16_384),  # gpt-4o-mini: below a quarter of the window
    (128_000, 128_000, 32_000),  # a map that lists max output == window: capped at 25 %
    (200_000, 64_000, 50_000),  # claude-3-7-sonnet: 64k capped at 50k
    (8_000, 1_000, 1_000),
    (8_000, None, 2_000),  # no known max output: DEFAULT_RESERVE, still capped at 25 %
    (1_000_000, None, DEFAULT_RESERVE),
    (3, 100, 0),  # int(3 * 0.25) == 0
])
def test_default_reserve_is_bounded_by_a_quarter_of_the_window(window: int, model_out: int | None, reserve: int) -> None:
    b = budget(window, model_out=model_out)
    assert b.reserve == reserve
    assert b.reserve == min(model_out if model_out is not None else DEFAULT_RESERVE, int(window * RESERVE_WINDOW_SHARE))
    assert b.hard_budget > 0 or window < 10
    assert b.limited_by == "window"


@pytest.mark.parametrize(("trimmer", "request_max", "model_out", "reserve"), [
    (TrimmerParams(reserve_tokens=1_000), 5_000, 100_000, 1_000),  # configured reserve wins
    (TrimmerParams(reserve_tokens=0), 5_000, None, 0),
    (TrimmerParams(), 5_000, 100_000, 5_000),  # then the request's max tokens, never capped
    (TrimmerParams(), 100_000, 16_384, 100_000),
    (TrimmerParams(), None, 100_000, 32_000),
])
def test_reserve_precedence(trimmer: TrimmerParams, request_max: int | None, model_out: int | None,
                            reserve: int) -> None:
    assert budget(128_000, request=request_max, model_out=model_out, trimmer=trimmer).reserve == reserve


# --------------------------------------------------------------------------- margin, B and what limits it


@pytest.mark.parametrize(("ratio", "margin"), [(0.1, 12_800), (0.0, 0), (-1.0, 0), (0.5, 64_000), (0.9, 64_000),
                                               (0.0001, 13)])
def test_safety_margin_is_clamped_and_rounded_up(ratio: float, margin: int) -> None:
    assert budget(trimmer=TrimmerParams(safety_margin_ratio=ratio), request=1).margin == margin


def test_hard_budget_from_the_window() -> None:
    b = budget(128_000, request=4_000)
    assert b.hard_budget == 128_000 - 4_000 - 12_800
    assert b.limited_by == "window"
    assert b.threshold == int(b.hard_budget / 1.1)


@pytest.mark.parametrize(("trimmer_max", "cap", "hard", "limited_by"), [
    (50_000, None, 50_000, "budget"),
    (200_000, None, 200_000, "budget"),  # an explicit budget is taken as configured
    (None, 30_000, 30_000, "cap"),
    (50_000, 30_000, 30_000, "cap"),
    (30_000, 50_000, 30_000, "budget"),  # a cap above the budget does not apply
    (None, 10_000_000, 128_000 - 4_000 - 12_800, "window"),
])
def test_what_limits_the_hard_budget(trimmer_max: int | None, cap: int | None, hard: int, limited_by: str) -> None:
    b = budget(128_000, request=4_000, trimmer=TrimmerParams(max_tokens=trimmer_max), cap=cap)
    assert (b.hard_budget, b.limited_by) == (hard, limited_by)


def test_hard_budget_is_never_negative() -> None:
    b = budget(8_000, request=100_000)
    assert b.hard_budget == 0
    assert b.threshold == 0


@pytest.mark.parametrize(("threshold", "expected"), [(0, int(100_000 / 1.1)), (50_000, 50_000),
                                                     (500_000, 100_000)])
def test_summary_threshold_is_explicit_or_derived_and_never_above_b(threshold: int, expected: int) -> None:
    b = budget(trimmer=TrimmerParams(max_tokens=100_000), threshold=threshold)
    assert b.threshold == expected


@pytest.mark.parametrize(("ratio", "step"), [(0.1, 10_000), (0.0, 1), (-0.5, 1), (0.25, 25_000)])
def test_step_is_the_hysteresis_share_of_b(ratio: float, step: int) -> None:
    b = budget(trimmer=TrimmerParams(max_tokens=100_000), hysteresis=ratio)
    assert b.step == step
    assert b.hysteresis_ratio == max(0.0, ratio)


# --------------------------------------------------------------------------- calibration


@pytest.mark.parametrize(("calibration", "hard"), [(1.0, 100_000), (1.25, 80_000), (0.8, 125_000), (2.0, 50_000),
                                                   (0.0, 100_000), (-1.0, 100_000)])
def test_calibration_divides_b(calibration: float, hard: int) -> None:
    b = budget(trimmer=TrimmerParams(max_tokens=100_000), calibration=calibration)
    assert b.hard_budget == hard
    assert b.threshold <= b.hard_budget


def test_calibration_divides_a_tenant_cap_too() -> None:
    b = budget(trimmer=TrimmerParams(max_tokens=100_000), cap=40_000, calibration=2.0)
    assert (b.hard_budget, b.limited_by) == (20_000, "cap")


@given(st.integers(1, 2_000_000), st.one_of(st.none(), st.integers(1, 2_000_000)),
       st.one_of(st.none(), st.integers(1, 2_000_000)), st.floats(0.5, 3.0))
def test_budget_invariants(window: int, request: int | None, model_out: int | None, calibration: float) -> None:
    b = budget(window, request=request, model_out=model_out, calibration=calibration)
    assert 0 <= b.threshold <= b.hard_budget
    assert b.hard_budget <= max(0, math.floor((window - b.reserve - b.margin) / calibration) + 1)
    if request is None:
        assert b.reserve <= window // 4 + 1


# --------------------------------------------------------------------------- why()


def test_why_names_the_configured_budget() -> None:
    text = why(budget(trimmer=TrimmerParams(max_tokens=1_000)))
    assert "trimmer.max_tokens" in text
    assert "window" not in text


def test_why_names_the_tenant_cap() -> None:
    text = why(budget(cap=1_000))
    assert "max_context_tokens" in text


def test_why_spells_out_the_window_arithmetic() -> None:
    b = budget(8_000, request=1_000)
    text = why(b)
    assert text == "window 8000 - completion reserve 1000 - safety margin 800"


def test_why_blames_the_reserve_when_it_leaves_no_room() -> None:
    b = budget(8_000, request=7_500)
    text = why(b)
    assert "window 8000 - completion reserve 7500 - safety margin 800" in text
    assert "lower max_tokens" in text


def test_why_does_not_blame_the_reserve_when_the_window_leaves_room() -> None:
    assert "lower max_tokens" not in why(budget(8_000, request=100))


# --------------------------------------------------------------------------- TrimmerParams


def test_token_budget_is_an_alias_of_max_tokens() -> None:
    assert TrimmerParams(token_budget=5_000).max_tokens == 5_000  # type: ignore[call-arg]
    assert TrimmerParams.model_validate({"token_budget": 5_000, "max_tokens": 7_000}).max_tokens == 7_000


@pytest.mark.parametrize("bad", [{"max_tokens": 0}, {"reserve_tokens": -1}, {"unknown": 1}, {"max_tokens": "x"}])
def test_trimmer_params_refuse(bad: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        TrimmerParams.model_validate(bad)


def test_merged_over_takes_only_what_is_set() -> None:
    base = TrimmerParams(max_tokens=50_000, reserve_tokens=2_000, safety_margin_ratio=0.2)
    mine = TrimmerParams(reserve_tokens=500)
    merged = mine.merged_over(base)
    assert (merged.max_tokens, merged.reserve_tokens, merged.safety_margin_ratio) == (50_000, 500, 0.2)
    assert mine.merged_over(None) is mine
    assert TrimmerParams().merged_over(base) == base
