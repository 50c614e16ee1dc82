"""Model limits and prices from litellm's bundled model map, read as JSON (no litellm import).

Importing litellm costs seconds and ~150 MB; its map is a JSON file inside the
package, so reading that file is all the proxy needs for windows and prices.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from importlib.util import find_spec
from pathlib import Path
from typing import Any

MAP_FILE = "model_prices_and_context_window_backup.json"


@dataclass(frozen=True)
class ModelInfo:
    max_input_tokens: int | None
    max_output_tokens: int | None
    input_cost_per_token: float
    output_cost_per_token: float


class ModelMap:
    """Lazily loaded view of litellm's model map (the app owns one instance)."""

    def __init__(self, path: Path | None = None) -> None:
        self._path = path

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
            float(entry.get("input_cost_per_token") or 0.0),
            float(entry.get("output_cost_per_token") or 0.0),
        )

    def cost(self, model: str, prompt_tokens: int, completion_tokens: int) -> float:
        info = self.get(model)
        if info is None:
            return 0.0
        return prompt_tokens * info.input_cost_per_token + completion_tokens * info.output_cost_per_token

    def input_price(self, model: str) -> float:
        info = self.get(model)
        return info.input_cost_per_token if info else 0.0


def _int(value: Any) -> int | None:
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _bundled_map() -> Path | None:
    spec = find_spec("litellm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / MAP_FILE
