"""ctxproxy's net savings match what context management really saved (tests/cost_run.py, docs/cost.md).

One agent conversation is sent twice through a fake upstream that reports true counts and OpenAI-style
prompt caching: straight to it, and through ctxproxy. The difference of the two runs' costs (priced from
the upstream's usage) is the real saving; ctxproxy's net (its metrics) must land on it, whatever its
sign: on this short conversation at Claude's prices (cache reads at a tenth of the input price) context
management costs a little more than it saves, and the net says so. The gross figure alone (or less only
the summariser and the cache breaks) would claim a saving either way.
"""

from __future__ import annotations

import pytest

from tests.cost_run import run

MANAGERS = {  # the default (tool outputs masked before anything is summarised), and summaries alone
    "default": None,
    "summaries-only": {"type": "summarising", "params": {"mask_observations": False}},
}


@pytest.mark.parametrize("model", ["gpt-4o", "claude-sonnet-4-5"])
@pytest.mark.parametrize("manager", sorted(MANAGERS))
async def test_net_savings_match_the_real_difference(model: str, manager: str) -> None:
    f = await run(turns=16, budget=8_000, model=model, manager=MANAGERS[manager])
    if manager == "summaries-only":
        assert f.summaries_created >= 2 and f.summaries_reused > f.summaries_created
    else:  # masking first leaves less to summarise, but not nothing on this 8k budget
        assert f.summaries_created >= 1
    assert f.cache_break > 0 and f.cache_removed > 0 and f.summariser > 0
    assert abs(f.net - f.actual_saving) <= 0.05 * f.gross
    assert (f.net > 0) == (f.actual_saving > 0)
    # without the prompt-cache terms the figure would be far off: removed tokens would mostly have been cache reads
    assert (f.gross - f.summariser - f.cache_break) - f.actual_saving > 0.3 * f.gross
