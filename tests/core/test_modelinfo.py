"""proxy.core.modelinfo: windows and prices from litellm's model map (read as JSON), offline set-up."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from proxy.core.modelinfo import ModelInfo, ModelMap, offline_environment

MAP: dict[str, Any] = {
    "sample_spec": {"max_input_tokens": "max input", "input_cost_per_token": 0.0},
    "gpt-4o-mini": {"max_input_tokens": 128000, "max_output_tokens": 16384, "max_tokens": 16384,
                    "input_cost_per_token": 1.5e-07, "output_cost_per_token": 6e-07},
    "claude-3-5-sonnet-20241022": {"max_input_tokens": 200000, "max_tokens": 8192,
                                   "input_cost_per_token": 3e-06, "output_cost_per_token": 1.5e-05},
    "ollama/llama3": {"max_input_tokens": 8192, "max_output_tokens": 8192,
                      "input_cost_per_token": 0.0, "output_cost_per_token": 0.0},
    "unpriced-model": {"max_input_tokens": 32000, "max_output_tokens": 4096},
    "string-limits": {"max_input_tokens": "65536", "max_output_tokens": "n/a", "input_cost_per_token": None},
    "broken": "not an object",
    "input-only-price": {"input_cost_per_token": 1e-06},
}


@pytest.fixture
def model_map(tmp_path: Path) -> ModelMap:
    path = tmp_path / "map.json"
    path.write_text(json.dumps(MAP))
    return ModelMap(path)


@pytest.mark.parametrize(("model", "info"), [
    ("gpt-4o-mini", ModelInfo(128000, 16384, 1.5e-07, 6e-07, True)),
    ("openai/gpt-4o-mini", ModelInfo(128000, 16384, 1.5e-07, 6e-07, True)),  # a provider prefix is dropped
    ("claude-3-5-sonnet-20241022", ModelInfo(200000, 8192, 3e-06, 1.5e-05, True)),  # max_tokens as output
    ("anthropic/claude-3-5-sonnet-20241022", ModelInfo(200000, 8192, 3e-06, 1.5e-05, True)),
    ("ollama/llama3", ModelInfo(8192, 8192, 0.0, 0.0, True)),  # listed under its prefixed name
    ("unpriced-model", ModelInfo(32000, 4096, 0.0, 0.0, False)),
    ("string-limits", ModelInfo(65536, None, 0.0, 0.0, True)),
    ("input-only-price", ModelInfo(None, None, 1e-06, 0.0, True)),
])
def test_get(model_map: ModelMap, model: str, info: ModelInfo) -> None:
    assert model_map.get(model) == info


@pytest.mark.parametrize("model", ["no-such-model", "broken", "GPT-4O-MINI", "a/b/gpt-4o-mini-x", "", "/"])
def test_unknown_models_have_no_info(model_map: ModelMap, model: str) -> None:
    assert model_map.get(model) is None


def test_only_the_first_prefix_is_dropped(model_map: ModelMap) -> None:
    assert model_map.get("openrouter/openai/gpt-4o-mini") is None


@pytest.mark.parametrize(("model", "cost"), [
    ("gpt-4o-mini", 1000 * 1.5e-07 + 200 * 6e-07),
    ("ollama/llama3", 0.0),  # a free model is priced at 0 explicitly
])
def test_cost_of_priced_models(model_map: ModelMap, model: str, cost: float) -> None:
    assert model_map.cost(model, 1000, 200) == pytest.approx(cost)


@pytest.mark.parametrize("model", ["unpriced-model", "no-such-model", "broken"])
def test_unpriced_models_cost_none_never_zero(model_map: ModelMap, model: str) -> None:
    assert model_map.cost(model, 1000, 200) is None
    assert model_map.input_price(model) is None


def test_input_price(model_map: ModelMap) -> None:
    assert model_map.input_price("gpt-4o-mini") == 1.5e-07
    assert model_map.input_price("ollama/llama3") == 0.0


@pytest.mark.parametrize("content", ["[1, 2, 3]", '"a string"', "null"])
def test_a_map_that_is_not_an_object_is_empty(tmp_path: Path, content: str) -> None:
    path = tmp_path / "map.json"
    path.write_text(content)
    assert ModelMap(path).get("gpt-4o-mini") is None


def test_a_missing_map_is_empty(tmp_path: Path) -> None:
    assert ModelMap(tmp_path / "absent.json").get("gpt-4o-mini") is None
    assert ModelMap(tmp_path).get("gpt-4o-mini") is None  # a directory is not a map


def test_the_map_is_read_once(model_map: ModelMap, tmp_path: Path) -> None:
    assert model_map.get("gpt-4o-mini") is not None
    (tmp_path / "map.json").write_text("{}")
    assert model_map.get("gpt-4o-mini") is not None


def test_the_bundled_map_knows_current_models() -> None:
    bundled = ModelMap()
    info = bundled.get("gpt-4o")
    assert info is not None and info.priced
    assert info.max_input_tokens and info.max_input_tokens >= 128_000
    assert bundled.cost("gpt-4o", 1_000_000, 0) == pytest.approx(info.input_cost_per_token * 1_000_000)


def test_offline_environment_sets_defaults_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LITELLM_LOCAL_MODEL_COST_MAP", raising=False)
    monkeypatch.setenv("LITELLM_TELEMETRY", "operator-choice")
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR", raising=False)
    offline_environment()
    assert os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] == "True"
    assert os.environ["LITELLM_TELEMETRY"] == "operator-choice"
    cache_dir = os.environ.get("TIKTOKEN_CACHE_DIR")
    assert cache_dir is not None and Path(cache_dir).is_dir()


def test_offline_environment_keeps_an_operators_tiktoken_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    offline_environment()
    assert os.environ["TIKTOKEN_CACHE_DIR"] == str(tmp_path)
