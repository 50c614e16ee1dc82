"""Model limits and prices from litellm's bundled model map, read as JSON (no litellm import).

Importing litellm costs seconds and ~150 MB; its map is a JSON file inside the
package, so reading that file is all the proxy needs for windows and prices.

Prices: a model's ``models[]`` entry in the config may set its own (``input_cost_per_token``,
``output_cost_per_token``, ``cache_read_input_token_cost``, ``cache_creation_input_token_cost``), for
private deployments or negotiated rates; they are looked up before litellm's map
(``ModelMap.set_price_overrides``, keyed by the upstream model name), field by field.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import cached_property
from importlib.util import find_spec
from pathlib import Path
from typing import Any

MAP_FILE = "model_prices_and_context_window_backup.json"
MEMO_SIZE = 4096


def offline_environment() -> None:
    """The one place litellm and tiktoken are told to stay offline.

    litellm reads its bundled model map (``LITELLM_LOCAL_MODEL_COST_MAP``) and sends no
    telemetry; tiktoken reads the encodings litellm ships (``TIKTOKEN_CACHE_DIR``), so
    nothing is ever fetched at run time.
    """
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    os.environ.setdefault("LITELLM_TELEMETRY", "False")
    if os.environ.get("TIKTOKEN_CACHE_DIR"):
        return
    root = _litellm_root()
    if root is not None and (root / "litellm_core_utils" / "tokenizers").is_dir():
        os.environ["TIKTOKEN_CACHE_DIR"] = str(root / "litellm_core_utils" / "tokenizers")


@dataclass(frozen=True)
class ModelInfo:
    max_input_tokens: int | None
    max_output_tokens: int | None
    input_cost_per_token: float
    output_cost_per_token: float
    priced: bool = True  # the map lists a price (a free model lists 0 explicitly)
    cache_read_input_token_cost: float | None = None  # a prompt-cache read, per token (None: not listed)
    cache_creation_input_token_cost: float | None = None  # a prompt-cache write (Anthropic), per token


@dataclass(frozen=True)
class PriceOverride:
    """A model's prices from the config; a field left None falls back to litellm's map."""

    input_cost_per_token: float | None = None
    output_cost_per_token: float | None = None
    cache_read_input_token_cost: float | None = None
    cache_creation_input_token_cost: float | None = None


@dataclass(frozen=True)
class Prices:
    """USD per token for one model. A cache price the map does not list is the input price: no
    discount (or premium) is known, so no cache effect is priced for it."""

    input: float
    output: float
    cache_read: float
    cache_write: float
    source: str  # "config", "map" or "config+map"

    def call(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, cache_writes: int = 0) -> float:
        """USD of one call whose prompt had ``cached_tokens`` read from and ``cache_writes`` written to the cache."""
        cached = min(max(0, cached_tokens), max(0, prompt_tokens))
        writes = min(max(0, cache_writes), max(0, prompt_tokens) - cached)
        plain = max(0, prompt_tokens) - cached - writes
        return (plain * self.input + cached * self.cache_read + writes * self.cache_write
                + max(0, completion_tokens) * self.output)


class ModelMap:
    """Lazily loaded view of litellm's model map (the app owns one instance)."""

    def __init__(self, path: Path | None = None) -> None:
        self._path = path
        self._overrides: dict[str, PriceOverride] = {}
        self._prices: dict[str, Prices | None] = {}  # memo of prices(): it is read after every answer

    def set_price_overrides(self, overrides: dict[str, PriceOverride]) -> None:
        """Replace the config's prices (built from a config; swapped whole on reload)."""
        self._overrides = dict(overrides)
        self._prices = {}

    @cached_property
    def _data(self) -> dict[str, Any]:
        path = self._path or _bundled_map()
        if path is None or not path.is_file():
            return {}
        with path.open("rb") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}

    def get(self, model: str) -> ModelInfo | None:
        data = self._data
        entry = data.get(model)
        if entry is None and "/" in model:
            entry = data.get(model.split("/", 1)[1])
        if not isinstance(entry, dict):
            return None
        return ModelInfo(
            _int(entry.get("max_input_tokens")),
            _int(entry.get("max_output_tokens") or entry.get("max_tokens")),
            _price(entry.get("input_cost_per_token")) or 0.0,
            _price(entry.get("output_cost_per_token")) or 0.0,
            "input_cost_per_token" in entry,
            _price(entry.get("cache_read_input_token_cost")),
            _price(entry.get("cache_creation_input_token_cost")),
        )

    def prices(self, model: str) -> Prices | None:
        """The model's prices, config first, else litellm's map; None when its input or output price is unknown."""
        try:
            return self._prices[model]
        except KeyError:
            pass
        prices = self._lookup(model)
        if len(self._prices) < MEMO_SIZE:  # names can come from clients: remember a bounded number
            self._prices[model] = prices
        return prices

    def _lookup(self, model: str) -> Prices | None:
        override = self._overrides.get(model)
        info = self.get(model)
        mapped = info if info is not None and info.priced else None
        if override is None and mapped is None:
            return None
        o = override or PriceOverride()

        def pick(own: float | None, fallback: float | None) -> float | None:
            return own if own is not None else fallback

        input_price = pick(o.input_cost_per_token, mapped.input_cost_per_token if mapped else None)
        output_price = pick(o.output_cost_per_token, mapped.output_cost_per_token if mapped else None)
        if input_price is None or output_price is None:
            return None
        read = pick(o.cache_read_input_token_cost, mapped.cache_read_input_token_cost if mapped else None)
        write = pick(o.cache_creation_input_token_cost, mapped.cache_creation_input_token_cost if mapped else None)
        source = "map" if override is None else ("config" if mapped is None else "config+map")
        return Prices(input_price, output_price, input_price if read is None else read,
                      input_price if write is None else write, source)

    def cost(self, model: str, prompt_tokens: int, completion_tokens: int) -> float | None:
        """USD for a call, or None when the model has no price (never a silent 0)."""
        prices = self.prices(model)
        if prices is None:
            return None
        return prompt_tokens * prices.input + completion_tokens * prices.output

    def input_price(self, model: str) -> float | None:
        prices = self.prices(model)
        return prices.input if prices is not None else None


def _price(value: Any) -> float | None:
    """A price from the map: a non-negative number, else None (the map has a few strings and nulls)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or value != value:
        return None
    return float(value)


def _int(value: Any) -> int | None:
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _litellm_root() -> Path | None:
    spec = find_spec("litellm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _bundled_map() -> Path | None:
    root = _litellm_root()
    return root / MAP_FILE if root is not None else None
