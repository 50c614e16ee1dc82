"""``drop``: discards older turns instead of summarising them."""

from __future__ import annotations

from plugins.base import Params, Services, SummarizeFn, Summarizer


class DropParams(Params):
    pass


class DropSummarizer(Summarizer):
    name = "drop"
    Params = DropParams

    def bind(self, services: Services) -> SummarizeFn | None:
        return None
