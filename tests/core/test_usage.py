"""proxy.core.usage: the provider's usage of each wire, normalised in the form the wire declares; untrusted
values never pass as counts."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.core.usage import Usage, count
from proxy.core.usage import normalise_usage as normalise
from proxy.wire import WIRES


def normalise_usage(usage: Any, wire: str | None = None) -> Usage | None:
    """The usage in the named wire's form (``UsageForm``), or in the form its keys point to (no wire named)."""
    return normalise(usage, WIRES[wire].usage_form) if wire is not None else WIRES.guess_usage(usage)


def test_chat() -> None:
    usage = {"prompt_tokens": 5000, "completion_tokens": 12, "prompt_tokens_details": {"cached_tokens": 4096}}
    assert normalise_usage(usage, "chat") == Usage(5000, 4096, 0, 12)
    assert normalise_usage(usage) == Usage(5000, 4096, 0, 12)  # told apart by its keys


def test_responses() -> None:
    usage = {"input_tokens": 900, "output_tokens": 5, "input_tokens_details": {"cached_tokens": 512}}
    assert normalise_usage(usage, "responses") == Usage(900, 512, 0, 5)
    assert normalise_usage(usage) == Usage(900, 512, 0, 5)


def test_anthropic_counts_cache_reads_and_writes_on_top_of_input_tokens() -> None:
    usage = {"input_tokens": 50, "cache_read_input_tokens": 3000, "cache_creation_input_tokens": 700,
             "output_tokens": 9}
    assert normalise_usage(usage, "messages") == Usage(3750, 3000, 700, 9)
    assert normalise_usage(usage) == Usage(3750, 3000, 700, 9)
    assert normalise_usage({"input_tokens": 10, "cache_read_input_tokens": None}, "messages") == Usage(10)


@pytest.mark.parametrize("usage", [
    None, "usage", [], {}, {"completion_tokens": 3},
    {"prompt_tokens": -1}, {"prompt_tokens": True}, {"prompt_tokens": "100"}, {"prompt_tokens": 10.5},
    {"prompt_tokens": float("nan")}, {"prompt_tokens": 10**13},
])
def test_no_usable_input_count(usage: Any) -> None:
    assert normalise_usage(usage, "chat") is None


def test_odd_parts_are_clamped_and_flagged() -> None:
    assert normalise_usage({"prompt_tokens": 100.0}, "chat") == Usage(100)  # an integral float is a count
    got = normalise_usage({"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 500}}, "chat")
    assert got == Usage(100, 100, 0, 0, consistent=False)  # cached above the input
    got = normalise_usage({"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": "7"}}, "chat")
    assert got == Usage(100, 0, 0, 0, consistent=False)
    got = normalise_usage({"prompt_tokens": 0}, "chat")
    assert got == Usage(0)  # a provider that reports 0: a usage, but no calibration sample (proxy.store.calibration)
    got = normalise_usage({"input_tokens": 5, "cache_read_input_tokens": -3}, "messages")
    assert got == Usage(5, 0, 0, 0, consistent=False)


def test_count() -> None:
    assert [count(v) for v in (0, 7, 7.0, -1, True, "7", None, 1.5)] == [0, 7, 7, None, None, None, None, None]
