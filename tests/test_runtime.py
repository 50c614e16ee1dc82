"""proxy.runtime: the one tenant authentication, routes, services, and ``assemble`` with a calibration.

The calibration store itself is being built elsewhere; here a fake ``Calibration``
shows the runtime divides B by the route's factor and reports it.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from proxy.core.errors import AuthenticationError, BadRequest, ModelNotFound
from proxy.core.modelinfo import ModelMap
from proxy.core.tokens import Tokenizers
from proxy.policy import ModelRoute
from proxy.runtime import Runtime
from proxy.settings import load_config
from proxy.wire.chat import WIRE as CHAT

MODEL_MAP = ModelMap()


def runtime(**extra: Any) -> Runtime:
    raw: dict[str, Any] = {
        "upstreams": {"u": {"base_url": "http://127.0.0.1:9"}},
        "models": [{"name": "small", "model": "gpt-4o-mini", "context_window": 8000, "max_output_tokens": 1000}],
        "cache": {"backend": "memory"},
        "trimmer": {"reserve_tokens": 0},
    }
    raw.update(extra)
    return Runtime(load_config(raw, env={}), tokenizers=Tokenizers(), model_map=MODEL_MAP)


class Calibration:
    def __init__(self, factor: float, window: int | None = None) -> None:
        self.value = factor
        self.learned = window
        self.routes: list[ModelRoute] = []
        self.tenants: list[str] = []

    async def prime(self, route: ModelRoute, tenant: str) -> None:
        """Nothing to load: the factor is fixed."""

    def factor(self, route: ModelRoute, tenant: str) -> float:
        self.routes.append(route)
        self.tenants.append(tenant)
        return self.value

    def window(self, route: ModelRoute) -> int | None:
        """The provider's window its refusals showed (None: the route's holds)."""
        return self.learned


TENANTS = [{"name": "acme", "keys": ["sk-acme-1", "sk-acme-2"]},
           {"name": "globex", "keys": ["sha256:" + "a" * 64]}]


def test_without_tenants_nobody_is_authenticated() -> None:
    rt = runtime()
    assert rt.authenticate(None) is None
    assert rt.authenticate("anything") is None


@pytest.mark.parametrize(("key", "tenant"), [("sk-acme-1", "acme"), ("sk-acme-2", "acme")])
def test_a_proxy_key_picks_its_tenant(key: str, tenant: str) -> None:
    found = runtime(tenants=TENANTS).authenticate(key)
    assert found is not None and found.name == tenant


@pytest.mark.parametrize(("key", "message"), [
    (None, "Missing API key"), ("", "Missing API key"), ("sk-acme-3", "Incorrect API key"),
    ("SK-ACME-1", "Incorrect API key"), ("sk-acme-1 ", "Incorrect API key"), ("a" * 64, "Incorrect API key"),
])
def test_unknown_keys_are_refused(key: str | None, message: str) -> None:
    with pytest.raises(AuthenticationError) as err:
        runtime(tenants=TENANTS).authenticate(key)
    assert message in err.value.message
    assert err.value.status == 401
    if key:
        assert key not in err.value.message


def test_routes_and_windows() -> None:
    rt = runtime()
    route = rt.route("small")
    assert (route.upstream_model, route.window, route.max_output) == ("gpt-4o-mini", 8000, 1000)
    assert rt.window_of("small") == 8000
    assert rt.window_of("gpt-4o") >= 128_000  # from the model map
    strict = runtime(allow_unknown_models=False)
    with pytest.raises(ModelNotFound):
        strict.route("gpt-4o")
    assert strict.window_of("gpt-4o") == strict.routes.fallback_window()


def test_services_carry_the_policy_and_summariser_settings() -> None:
    rt = runtime(summarizer_model="small", summarizer={"timeout_seconds": 7, "max_summary_tokens": 200,
                                                       "max_calls_per_summary": 3})
    route = rt.route("small")
    policy = rt.policy(None, "small", None)
    s = rt.services(route, policy, request_id="rid-1", dry_run=True)
    assert (s.tenant, s.model, s.summarizer_model) == ("default", "small", "small")
    assert (s.summary_tokens, s.summarizer_timeout, s.summarizer_max_calls) == (200, 7, 3)
    assert (s.request_id, s.dry_run, s.summarizer_window) == ("rid-1", True, 8000)
    assert s.counter is rt.tokenizers.get(route.encoding)
    assert s.window_of is not None and s.window_of("small") == 8000


@pytest.mark.parametrize("model", [None, "", 7, ["small"]])
async def test_assemble_requires_a_model_name(model: Any) -> None:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}
    if model is not None:
        body["model"] = model
    with pytest.raises(BadRequest) as err:
        await runtime().assemble(CHAT, body, tenant=None)
    assert (err.value.code, err.value.param) == ("missing_model", "model")


async def test_assemble_renames_the_model_to_the_upstream_one() -> None:
    assembly, route, policy = await runtime().assemble(CHAT, {"model": "small", "messages": [
        {"role": "user", "content": "hi"}]}, tenant=None)
    assert assembly.changed
    assert assembly.body["model"] == "gpt-4o-mini"
    assert route.name == "small" and policy.tenant == "default"


@pytest.mark.parametrize("factor", [1.0, 1.25, 0.8])
async def test_assemble_divides_the_budget_by_the_routes_calibration(factor: float) -> None:
    rt = runtime()
    calibration = Calibration(factor)
    rt.calibration = calibration
    assembly, route, _ = await rt.assemble(CHAT, {"model": "small", "messages": [
        {"role": "user", "content": "hi"}]}, tenant=None)
    window_budget = 8000 - 0 - math.ceil(0.1 * 8000)
    assert assembly.report.calibration == factor
    assert assembly.report.hard_budget == int(window_budget / factor)
    assert calibration.routes == [route]
    assert calibration.tenants == ["default"]  # the tenant's own factor (no tenants configured: "default")


async def test_a_window_learned_from_the_provider_narrows_the_budget_and_the_summarisers_window() -> None:
    """The provider refused above 4000 tokens: B, the summariser's chunks and an explicit budget all use 4000."""
    rt = runtime(trimmer={"reserve_tokens": 0, "max_tokens": 7000})
    rt.calibration = Calibration(1.0, window=4000)
    assembly, route, policy = await rt.assemble(CHAT, {"model": "small", "messages": [
        {"role": "user", "content": "hi"}]}, tenant=None)
    assert (assembly.report.window, assembly.report.provider_window) == (4000, 4000)
    assert assembly.report.hard_budget == 4000 - 400  # not the explicit 7000
    assert rt.services(route, policy).summarizer_window == rt.window_of("small") == 4000
    rt.calibration = Calibration(1.0, window=None)
    assert rt.window_of("small") == 8000


async def test_a_tenant_may_not_assemble_a_model_outside_its_list() -> None:
    rt = runtime(tenants=[{"name": "acme", "keys": ["sk-acme"], "models": ["small"]}])
    acme = rt.authenticate("sk-acme")
    with pytest.raises(ModelNotFound):
        await rt.assemble(CHAT, {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, tenant=acme)
