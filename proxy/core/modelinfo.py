"""Model limits and prices from litellm's bundled model map, read as JSON (no litellm import).

Importing litellm costs seconds and ~150 MB; its map is a JSON file inside the
package, so reading that file is all the proxy needs for windows and prices.
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
            "input_cost_per_token" in entry,
        )

    def cost(self, model: str, prompt_tokens: int, completion_tokens: int) -> float | None:
        """USD for a call, or None when the model has no price (never a silent 0)."""
        info = self.get(model)
        if info is None or not info.priced:
            return None
        return prompt_tokens * info.input_cost_per_token + completion_tokens * info.output_cost_per_token

    def input_price(self, model: str) -> float | None:
        info = self.get(model)
        return info.input_cost_per_token if info is not None and info.priced else None


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
