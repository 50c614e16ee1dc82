"""The provider's ``usage`` object of any wire, normalised: what calibration and cost accounting read.

Each wire reports input tokens its own way, and says where (a ``UsageForm``, declared by the wire:
``proxy.wire.<name>.translator``): the input count either includes the cached tokens (OpenAI's wires)
or does not (Anthropic's, whose cache reads and writes come on top of it).

``normalise_usage`` turns any of them into one ``Usage`` whose ``input_tokens`` is the whole input the
provider counted. Provider data is untrusted: a count that is missing, negative, fractional, a bool or
a string is not a count; parts that do not add up (cached above the input) are clamped and the usage is
marked inconsistent, so nothing downstream divides by a lie.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MAX_COUNT = 10**12  # beyond any real request: a larger "count" is garbage


@dataclass(frozen=True)
class Usage:
    """One answer's usage: ``input_tokens`` is every input token, of which ``cached_tokens`` were read from
    the provider's prompt cache and ``cache_write_tokens`` written to it (Anthropic)."""

    input_tokens: int
    cached_tokens: int = 0
    cache_write_tokens: int = 0
    output_tokens: int = 0
    consistent: bool = True

    @property
    def uncached_tokens(self) -> int:
        return self.input_tokens - self.cached_tokens


def count(value: Any) -> int | None:
    """A token count, or None when ``value`` is not one (bool, negative, fractional, text, absurd)."""
    if type(value) is int:  # (the usual case; a bool is not of type int)
        return value if 0 <= value <= MAX_COUNT else None
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and 0 <= value <= MAX_COUNT:
        return value
    return None


def _at(usage: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    """The value at ``path`` inside ``usage`` (None when any step is missing or not an object)."""
    value: Any = usage
    for key in path:
        if type(value) is not dict and not isinstance(value, Mapping):  # (a dict: no ABC check)
            return None
        value = value.get(key)
    return value


@dataclass(frozen=True)
class UsageForm:
    """Where one wire's ``usage`` object keeps its counts: a wire declares it (``proxy.wire.<name>``),
    ``normalise_usage`` reads it.

    ``additive``: cached reads and writes come on top of ``input`` (Anthropic), not inside it.
    ``marker``: a key that tells this form apart from the others when the wire is not known.
    """

    input: str
    cached: tuple[str, ...]
    writes: tuple[str, ...] = ()
    output: str = "output_tokens"
    additive: bool = False
    marker: str = ""


def normalise_usage(usage: Any, form: UsageForm) -> Usage | None:
    """``usage`` read in ``form`` as a ``Usage``, or None when it carries no usable input count."""
    if type(usage) is not dict and not isinstance(usage, Mapping):  # (a dict: no ABC check)
        return None
    base = count(usage.get(form.input))
    if base is None:
        return None
    cached, writes, output = _part(usage, form.cached), _part(usage, form.writes), _part(usage, (form.output,))
    consistent = cached >= 0 and writes >= 0 and output >= 0
    cached, writes, output = max(0, cached), max(0, writes), max(0, output)
    if form.additive:
        return Usage(base + cached + writes, cached, writes, output, consistent)
    total = base
    if cached > total:
        cached, consistent = total, False
    if writes > total - cached:
        writes, consistent = total - cached, False
    return Usage(total, cached, writes, output, consistent)


def _part(usage: Mapping[str, Any], path: tuple[str, ...]) -> int:
    """The count at ``path`` inside ``usage``: 0 when it is missing, -1 when what is there is not a count."""
    value = _at(usage, path) if path else None
    if value is None:
        return 0
    n = count(value)
    return -1 if n is None else n


def guess_form(usage: Any, forms: Sequence[UsageForm]) -> UsageForm:
    """The first of ``forms`` whose marker ``usage`` carries, else the first: for a usage of an unknown wire."""
    if isinstance(usage, Mapping):
        for form in forms:
            if form.marker and form.marker in usage:
                return form
    return forms[0]
