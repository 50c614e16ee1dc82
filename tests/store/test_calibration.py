"""The calibration store: samples, the envelope of recent ratios, family defaults, tenants, refusals, learned
windows, sharing, modes."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from proxy.policy import ModelRoute
from proxy.settings import load_config
from proxy.store.cache import SafeCache
from proxy.store.calibration import (
    DEADBAND,
    HOLD,
    MAX_FACTOR,
    MIN_FACTOR,
    MIN_SAMPLE_TOKENS,
    MIN_SAMPLES,
    POOLED,
    STEP,
    WINDOW,
    CalibrationStore,
    ConfiguredCalibration,
    cache_key,
    envelope,
    family_default,
    hidden_input,
    publish,
    refusal_sample,
    sample_of,
    spread,
)
from proxy.store.memory import MemoryCache

UP, MODEL = "fake", "SmolLM2-135M-Instruct"
T = "default"  # the tenant of a proxy without tenants
BIG = 4000  # a forwarded payload well above MIN_SAMPLE_TOKENS


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class CountingCache(MemoryCache):
    """A memory cache that counts reads (the request path must not read it)."""

    def __init__(self) -> None:
        super().__init__()
        self.gets = 0
        self.sets = 0

    async def get(self, key: str) -> dict[str, Any] | None:
        self.gets += 1
        return await super().get(key)

    async def set(self, key: str, value: dict[str, Any], ttl: float | None = None) -> None:
        self.sets += 1
        await super().set(key, value, ttl)


def store(cache: Any = None, **kw: Any) -> CalibrationStore:
    return CalibrationStore(SafeCache(cache if cache is not None else MemoryCache()), **kw)


def feed(s: CalibrationStore, ratios: list[float], model: str = MODEL, tenant: str = T) -> None:
    for r in ratios:
        assert s.observe(tenant, UP, model, round(BIG * r), BIG).result == "used"


@pytest.mark.parametrize(("model", "family", "factor"), [
    ("gpt-4o-mini", "openai", 1.0),
    ("openai/gpt-4o", "openai", 1.0),
    ("o3-mini", "openai", 1.0),
    ("anthropic/claude-sonnet-4-5", "claude", 1.20),
    ("SmolLM2-135M-Instruct", "small-vocabulary", 1.20),
    ("mistral-large-latest", "mistral", 1.20),
    ("gemini/gemini-2.0-flash", "gemini", 1.15),
    ("meta-llama/Llama-3.1-70B-Instruct", "llama", 1.15),
    ("Qwen/Qwen2.5-72B-Instruct", "qwen", 1.15),
    ("deepseek-chat", "deepseek", 1.15),
    ("small", "unknown", 1.0),
])
def test_family_defaults(model: str, family: str, factor: float) -> None:
    assert family_default(model) == (family, factor)


def test_what_is_a_sample() -> None:
    assert sample_of(None, BIG).result == "no_usage"
    assert sample_of(0, BIG).result == "zero"
    assert sample_of(-5, BIG).result == "zero"
    assert sample_of(50, MIN_SAMPLE_TOKENS - 1).result == "small"
    assert sample_of(5000, BIG, hidden="previous_response_id").result == "hidden_input"
    # the fake upstream's fixed usage (10 prompt tokens) is not a count of this payload
    assert sample_of(10, BIG).result == "implausible"
    assert sample_of(BIG * 4, BIG).result == "implausible"
    assert sample_of(1300, 1000) == sample_of(1300, 1000)
    assert sample_of(1300, 1000).ratio == pytest.approx(1.3)
    assert sample_of(2900, 1000).ratio == MAX_FACTOR  # plausible, clamped
    assert sample_of(400, 1000).ratio == MIN_FACTOR


def test_hidden_input() -> None:
    assert hidden_input({"model": "m", "messages": []}) is None
    assert hidden_input({"previous_response_id": "resp_1"}) == "previous_response_id"
    assert hidden_input({"conversation": "conv_1"}) == "conversation"
    assert hidden_input({"previous_response_id": None}) is None
    assert hidden_input({"tools": [{"type": "function", "function": {"name": "f"}}]}) is None
    assert hidden_input({"tools": [{"name": "get_weather", "input_schema": {}}]}) is None  # Anthropic client tool
    assert hidden_input({"tools": [{"type": "web_search_preview"}]}) == "server_tools"
    assert hidden_input({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}) == "server_tools"
    assert hidden_input(None) is None
    assert hidden_input({"tools": "garbage"}) is None


async def test_a_higher_ratio_tightens_at_once() -> None:
    """A provider that counts more than the default says tightens the very next request's budget: no waiting for
    a majority of samples (a payload counted higher than the proxy counted it is the one that overflows)."""
    s = store()
    assert s.factor(T, UP, MODEL) == 1.20  # the family default before any answer
    feed(s, [1.3])
    assert (s.factor(T, UP, MODEL), s.get(T, UP, MODEL).source) == (1.3, "learned")
    feed(s, [1.3] * (MIN_SAMPLES - 1))
    got = s.get(T, UP, MODEL)
    assert (got.factor, got.source, got.samples) == (1.3, "learned", MIN_SAMPLES)
    feed(s, [1.45])  # a new high, however late: at once
    assert s.factor(T, UP, MODEL) == 1.45
    await s.flush()


async def test_a_lower_ratio_loosens_only_slowly_and_only_after_several_samples() -> None:
    """Tool-heavy requests that the provider counts at half the proxy's count must not widen the budget of the
    text-heavy requests after them at once: the factor stays until HOLD consistent samples, then falls by at most
    10 % every HOLD samples, and never below what the samples show."""
    s = store()
    factors = []
    for _ in range(30):
        feed(s, [0.55])
        factors.append(s.factor(T, UP, MODEL))
    assert factors[:HOLD - 1] == [1.20] * (HOLD - 1)  # the default holds until HOLD samples agree
    steps = [b / a for a, b in itertools.pairwise(factors) if b != a]
    assert steps and all(step >= STEP - 0.01 for step in steps)  # never more than 10 % at once
    assert factors == sorted(factors, reverse=True) and factors[-1] == 0.55  # down to the evidence, not below
    assert sum(1 for f in factors if f > 0.7) >= 15  # it took the evidence of 15 requests to get below 0.7
    feed(s, [1.1])  # the conversation turns text-heavy: the next budget uses it at once
    assert s.factor(T, UP, MODEL) == 1.1
    await s.flush()


def test_the_envelope() -> None:
    assert envelope([], 1.2) == 1.2
    assert envelope([0.5, 0.5], 1.2) == 1.2  # the default is the oldest sample
    assert envelope([0.5] * HOLD, 1.2) == pytest.approx(1.2 * STEP)
    assert envelope([1.6] + [1.0] * (HOLD - 1), 1.0) == 1.6  # a high ratio holds for HOLD samples
    assert envelope([1.6] + [1.0] * HOLD, 1.0) == pytest.approx(1.6 * STEP)  # then steps down
    assert envelope([1.6] + [1.0] * 30, 1.0) == 1.0  # never below the recent ratios
    assert spread([1.0, 1.3, 1.1]) == 0.3 and spread([1.2]) is None


@given(st.lists(st.floats(MIN_FACTOR, MAX_FACTOR), max_size=5 * WINDOW), st.floats(MIN_FACTOR, MAX_FACTOR))
def test_the_envelope_is_its_definition(ratios: list[float], default: float) -> None:
    """Each ratio weighted by its age (weights made once, for any number of ratios a record keeps and more)."""
    n = len(ratios)
    top = default * STEP ** (n // HOLD)
    for i, ratio in enumerate(ratios):
        top = max(top, ratio * STEP ** ((n - 1 - i) // HOLD))
    assert envelope(ratios, default) == top


async def test_an_odd_high_ratio_narrows_the_budget_for_a_while_then_the_ratios_take_over() -> None:
    """The price of a conservative bound: one request the provider counted much higher (an image it prices
    differently) narrows the budget at once; it decays back to what the following requests show."""
    s = store()
    feed(s, [1.3] * 20)
    feed(s, [2.5])  # clamped to 2.0
    assert s.factor(T, UP, MODEL) == MAX_FACTOR
    feed(s, [1.3] * 20)
    assert s.factor(T, UP, MODEL) == 1.3
    feed(s, [1.1] * WINDOW)  # a new tokenizer behind the same name
    assert s.factor(T, UP, MODEL) == 1.1
    await s.flush()


def test_rounding_and_the_dead_band_for_loosening() -> None:
    assert publish(1.3049, None) == 1.31  # rounded up: a bound
    assert publish(1.301, 1.3) == 1.31  # any rise tightens at once
    assert publish(1.29, 1.3) == 1.3  # a small fall does not move it: no jitter in B
    assert publish(1.3 - DEADBAND, 1.3) == pytest.approx(1.28)
    assert publish(9.0, None) == MAX_FACTOR
    assert publish(0.1, None) == MIN_FACTOR


async def test_shared_through_the_cache_and_merged_without_duplicates() -> None:
    cache = MemoryCache()
    a, b = store(cache), store(cache)
    feed(a, [1.3] * 4)
    await a.flush()
    await b.load(T, UP, MODEL)  # a new replica (or a restart): the first request of a model awaits the read
    assert b.get(T, UP, MODEL).factor == 1.3
    feed(b, [1.3] * 2)
    await b.flush()
    await a.load(T, UP, MODEL)  # fresh: not re-read (a dict hit)
    a._entries[(T, UP, MODEL)].loaded = float("-inf")  # stale: refreshed in the background
    await a.load(T, UP, MODEL)
    await a.flush()
    record = await cache.get(cache_key(T, UP, MODEL))
    assert record is not None and len(record["samples"]) == 6  # 4 from a, 2 from b, none twice
    assert {o for _, _, o in record["samples"]} == {a.origin, b.origin}
    assert a.get(T, UP, MODEL).samples == 6


async def test_the_request_path_reads_no_cache() -> None:
    cache = CountingCache()
    s = store(cache)
    await s.load(T, UP, MODEL)
    assert cache.gets == 2  # the tenant's record and the pooled one
    for _ in range(1000):
        await s.load(T, UP, MODEL)
        s.factor(T, UP, MODEL)
    assert cache.gets == 2


async def test_a_stale_entry_is_refreshed_in_the_background() -> None:
    cache, clock = CountingCache(), Clock()
    s = store(cache, monotonic=clock, refresh=30.0)
    await s.load(T, UP, MODEL)
    clock.now += 31
    await s.load(T, UP, MODEL)  # returns at once, the refresh runs in the background
    await s.flush()
    assert cache.gets == 4


@pytest.mark.parametrize("stored", [
    "not a dict-shaped value",
    {"upstream": UP, "model": MODEL, "factor": 99, "samples": "garbage"},
    {"upstream": UP, "model": MODEL, "factor": True,
     "samples": [[1.3, 1.0], ["1.3", 1.0, "x"], [7.0, 1.0, "x"], [1.3, "t", "x"], [1.3, 1.0, 5], [True, 1.0, "x"]]},
    {"upstream": "other", "model": MODEL, "factor": 1.9, "samples": [[1.9, 1.0, "x"]] * 5},  # another key's record
    {"tenant": "other", "upstream": UP, "model": MODEL, "factor": 1.9, "samples": [[1.9, 1.0, "x"]] * 5},
])
async def test_a_corrupt_or_foreign_record_is_ignored(stored: Any) -> None:
    cache = MemoryCache()
    for key in (cache_key(T, UP, MODEL), cache_key(POOLED, UP, MODEL)):
        if isinstance(stored, dict):
            await cache.set(key, stored)
        else:
            cache._data[key] = (b"[1, 2", None)  # not JSON: SafeCache turns it into a miss
    s = store(cache)
    await s.load(T, UP, MODEL)
    got = s.get(T, UP, MODEL)
    assert (got.factor, got.source) == (1.20, "default")


async def test_a_failing_backend_never_fails_a_request() -> None:
    class Down(MemoryCache):
        async def get(self, key: str) -> dict[str, Any] | None:
            raise OSError("down")

        async def set(self, key: str, value: dict[str, Any], ttl: float | None = None) -> None:
            raise OSError("down")

    for s in (store(Down()), CalibrationStore(Down())):  # behind SafeCache, and bare
        await s.load(T, UP, MODEL)
        feed(s, [1.4] * 3)
        await s.flush()
        assert s.factor(T, UP, MODEL) == 1.4  # learned locally all the same


async def test_the_local_table_is_bounded() -> None:
    s = store(max_entries=5)
    for i in range(20):
        s.observe(T, UP, f"model-{i}", 1300, 1000)
    assert len(s._entries) == 5 and len(s.entries()) <= 5
    await s.flush()


async def test_config_modes() -> None:
    config = load_config({"upstreams": {"u": {"base_url": "http://127.0.0.1:9"}}, "models": [
        {"name": "auto", "model": MODEL}, {"name": "off", "model": MODEL, "calibration": "off"},
        {"name": "pinned", "model": MODEL, "calibration": 1.5}, {"name": "alias", "model": MODEL}]}, env={})
    s = store()
    view = ConfiguredCalibration(s, config)

    def route(name: str) -> ModelRoute:
        return ModelRoute(name, "u", MODEL, "openai", 8000, None, "o200k_base")

    s.observe(T, "u", MODEL, 1300, 1000)
    s.observe(T, "u", MODEL, 1300, 1000)
    s.observe(T, "u", MODEL, 1300, 1000)
    assert view.factor(route("auto"), T) == 1.3
    assert view.factor(route("alias"), T) == 1.3  # keyed by the upstream model, not the alias
    assert view.factor(route("unlisted"), T) == 1.3
    assert view.factor(route("off"), T) == 1.0
    assert view.factor(route("pinned"), T) == 1.5
    assert view.effective(route("pinned"), T).describe()["learned"] == 1.3  # still learned, shown beside
    assert view.effective(route("off"), T).source == "off"
    await s.flush()


# -- tenants ---------------------------------------------------------------------------------------------


async def test_one_tenants_samples_never_loosen_another_tenants_factor() -> None:
    """A tenant whose traffic the proxy overcounts (ratio at the 0.5 clamp) learns 0.5 for itself; the others
    keep the family default: a factor below the default only ever comes from a tenant's own samples."""
    s = store()
    feed(s, [0.5] * WINDOW, tenant="a")
    a, b = s.get("a", UP, MODEL), s.get("b", UP, MODEL)
    assert (a.factor, a.source) == (0.5, "learned")
    assert (b.factor, b.source, b.shared) == (1.20, "default", 0.5)
    await s.flush()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.sampled_from([0.5, 0.9, 1.0, 1.1, 1.2, 1.25, 1.5, 2.0])),
                max_size=3 * WINDOW),
       st.sampled_from([MODEL, "gpt-4o-mini", "small"]))
def test_the_request_paths_factor_is_the_factor_get_reports(samples: list[tuple[str, float]], model: str) -> None:
    """``factor`` (every request's budget) decides as ``get`` (explain, the gauge) does, for tenants with and
    without samples of their own and with or without a pool."""
    async def check() -> None:
        s = store()
        for tenant, ratio in samples:
            s.observe(tenant, UP, model, round(BIG * ratio), BIG)
        for tenant in ("a", "b", "c", "never-seen"):
            assert s.factor(tenant, UP, model) == s.get(tenant, UP, model).factor
        assert s.factor("a", "other-upstream", model) == s.get("a", "other-upstream", model).factor
        await s.flush()

    asyncio.run(check())


async def test_evidence_of_other_tenants_only_tightens() -> None:
    """Pooled samples above the default tighten a tenant without samples of its own; its own samples then rule."""
    s = store()
    feed(s, [1.5] * 3, tenant="a")
    b = s.get("b", UP, MODEL)
    assert (b.factor, b.source, b.learned) == (1.5, "shared", None)
    feed(s, [1.25] * 3, tenant="b")
    assert s.get("b", UP, MODEL).factor == 1.25 and s.get("b", UP, MODEL).source == "learned"
    assert s.get("c", UP, MODEL).source == "shared"  # the pool (1.5, 1.25: median above the default)
    await s.flush()


async def test_tenant_records_are_shared_apart_and_an_old_model_record_serves_as_the_pool() -> None:
    """Each tenant's record has its own key; the per-model record of earlier versions is the pooled one."""
    cache = MemoryCache()
    assert cache_key(POOLED, UP, MODEL) == "calib:v1:" + __import__("hashlib").sha256(
        f"{UP}\x00{MODEL}".encode()).hexdigest()[:40]
    assert len({cache_key("a", UP, MODEL), cache_key("b", UP, MODEL), cache_key(POOLED, UP, MODEL)}) == 3
    for ratio, shown in ((1.4, (1.4, "shared")), (0.6, (1.20, "default"))):
        await cache.set(cache_key(POOLED, UP, MODEL), {"upstream": UP, "model": MODEL, "factor": ratio,
                                                       "samples": [[ratio, float(i), "old"] for i in range(5)]})
        s = store(cache)
        await s.load("b", UP, MODEL)
        got = s.get("b", UP, MODEL)
        assert (got.factor, got.source) == shown
    a = store(cache)
    feed(a, [1.3] * 3, tenant="a")
    await a.flush()
    record = await cache.get(cache_key("a", UP, MODEL))
    assert record is not None and record["tenant"] == "a" and len(record["samples"]) == 3


async def test_the_hook_reports_each_tenants_factor() -> None:
    seen: list[tuple[str, str, str, float]] = []
    s = store(on_factor=lambda *args: seen.append(args))
    feed(s, [1.5] * 3, tenant="a")
    assert seen[-1] == ("a", UP, MODEL, 1.5)
    feed(s, [1.0], tenant="b")  # b is new: its factor (the pooled 1.5, above the default) is reported
    assert ("b", UP, MODEL, 1.5) in seen
    await s.flush()


# -- refusals for length ---------------------------------------------------------------------------------


def test_what_a_refusal_teaches() -> None:
    assert refusal_sample(None, 8000, 5000).ratio == pytest.approx(1.6)  # at least window / our count
    assert refusal_sample(11_059, 8000, 5000).ratio == pytest.approx(2.0)  # the stated count, clamped
    assert refusal_sample(None, 8000, 5000).result == "refused"
    assert refusal_sample(None, 8000, 5000, hidden="previous_response_id").result == "hidden_input"
    assert refusal_sample(None, 8000, MIN_SAMPLE_TOKENS - 1).result == "small"
    assert refusal_sample(None, 128_000, 1000).result == "implausible"  # counted something else entirely


async def test_a_refusal_lifts_the_factor_at_once() -> None:
    """A tenant whose learned factor let a payload overflow the window gets a factor of at least the refusal's
    bound from the next request on, and so does every tenant that has no factor of its own."""
    s = store()
    feed(s, [0.5] * WINDOW, tenant="a")
    assert s.factor("a", UP, MODEL) == 0.5
    assert s.refused("a", UP, MODEL, None, 8000, 5500).result == "refused"
    assert s.factor("a", UP, MODEL) >= 8000 / 5500
    assert s.factor("b", UP, MODEL) >= 8000 / 5500  # the pool learned it too: it tightens the others
    feed(s, [0.5] * (HOLD - 1), tenant="a")  # lower samples after it do not undo it at once
    assert s.factor("a", UP, MODEL) >= 8000 / 5500
    await s.flush()


async def test_a_learned_window_narrows_every_route_of_the_model_and_is_shared() -> None:
    cache, clock = MemoryCache(), Clock()
    a = store(cache, clock=clock)
    assert a.window(UP, MODEL, 120_000) is None
    assert a.learn_window(UP, MODEL, 12_000, 120_000, "stated") == 12_000
    assert a.learn_window(UP, MODEL, 15_000, 120_000, "stated") == 12_000  # a wider one does not widen it
    assert a.window(UP, MODEL, 120_000) == 12_000
    assert a.window(UP, MODEL, 60_000) == 12_000  # another alias of the model: what its provider taught holds
    assert a.window(UP, MODEL, 8_000) is None  # a route configured narrower: its own window holds
    await a.flush()
    b = store(cache, clock=clock)  # another replica, or a restart
    await b.load("other-tenant", UP, MODEL)
    assert b.window(UP, MODEL, 120_000) == 12_000
    record = await cache.get(cache_key(POOLED, UP, MODEL))
    assert record is not None and record["window"]["limit"] == 12_000 and record["window"]["source"] == "stated"
    clock.now += 25 * 3600  # a stated window is trusted for a day: then the configured window is tried again
    assert b.window(UP, MODEL, 120_000) is None
    assert b.learn_window(UP, MODEL, 20_000, 120_000, "stepped") == 20_000
    clock.now += 3601  # one the proxy stepped down to (or estimated), for an hour
    assert b.window(UP, MODEL, 120_000) is None


@pytest.mark.parametrize("window", [
    {"limit": "12000", "configured": 120_000, "source": "stated", "at": 1.0},
    {"limit": 12_000, "configured": True, "source": "stated", "at": 1.0},
    {"limit": 12_000, "configured": 120_000, "source": "guessed", "at": 1.0},
    {"limit": 12_000, "configured": 120_000, "source": "stated", "at": float("nan")},
    {"limit": -1, "configured": 120_000, "source": "stated", "at": 1.0},
    "12000",
])
async def test_a_corrupt_learned_window_is_ignored(window: Any) -> None:
    cache = MemoryCache()
    await cache.set(cache_key(POOLED, UP, MODEL), {"upstream": UP, "model": MODEL, "factor": 1.2, "samples": [],
                                                   "window": window})
    s = store(cache)
    await s.load(T, UP, MODEL)
    assert s.window(UP, MODEL, 120_000) is None


async def test_the_samples_of_a_few_seconds_make_one_write_of_each_record() -> None:
    """Each answer used to read and write both shared records (the tenant's and the pool's): more CPU than the rest
    of an agent's request. A changed record now waits ``write_delay`` for more samples; ``flush`` writes at once."""
    cache = CountingCache()
    s = store(cache, write_delay=0.3)
    feed(s, [1.3] * 5)  # five answers
    await asyncio.sleep(0.05)
    assert cache.sets == 0  # the records wait for more samples
    deadline = asyncio.get_running_loop().time() + 10
    while cache.sets < 2:
        assert asyncio.get_running_loop().time() < deadline, "the records were never written"
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.05)
    assert cache.sets == 2  # one write each, with all five samples
    for tenant in (T, POOLED):
        record = await cache.get(cache_key(tenant, UP, MODEL))
        assert record is not None and len(record["samples"]) == 5
    feed(s, [1.31])
    await s.flush()  # at once, not after the delay
    assert cache.sets == 4
    assert s.get(T, UP, MODEL).factor == s.factor(T, UP, MODEL)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([1.0, 1.17, 1.2, 1.29, 1.3, 1.31, 1.5]), st.booleans()), min_size=1,
                max_size=25))
@example([(1.3, False), (1.3, False), (1.3, True), (1.0, False), (1.0, False), (1.0, False), (1.29, True)])
@example([(1.2, False), (1.2, False), (1.2, True), (1.3, False), (1.29, False), (1.29, False), (1.29, True)])
def test_a_delayed_write_publishes_what_a_write_after_every_answer_did(answers: list[tuple[float, bool]]) -> None:
    """A record written seconds late holds the factor this process published since: its own earlier write's
    factor is not taken for another writer's (the factor jumped back to it when the write merged the record)."""
    async def check() -> None:
        each, delayed = store(write_delay=0), store(write_delay=30)
        for ratio, written in answers:
            feed(each, [ratio])
            await each.flush()  # written after every answer, as before the delay
            feed(delayed, [ratio])
            if written:
                await delayed.flush()  # written now and then: the merge reads its own older record
            assert delayed.factor(T, UP, MODEL) == each.factor(T, UP, MODEL)
            assert delayed.get(POOLED, UP, MODEL).factor == each.get(POOLED, UP, MODEL).factor
        await delayed.flush()
        assert delayed.factor(T, UP, MODEL) == each.factor(T, UP, MODEL)

    asyncio.run(check())


async def test_a_record_the_table_let_go_while_its_write_waited_is_written_with_its_samples() -> None:
    cache = MemoryCache()
    s = store(cache, max_entries=4, write_delay=30)
    feed(s, [1.3] * 3)  # the tenant's and the pooled entry, their write waiting
    for tenant in "bcde":
        feed(s, [1.2], model="claude-3-5-sonnet", tenant=tenant)  # five more entries: both first ones let go
    await s.close()
    record = await cache.get(cache_key(T, UP, MODEL))
    assert record is not None and len(record["samples"]) == 3 and record["factor"] == 1.3
    assert not s._evicted


async def test_a_sample_in_the_loop_turn_after_a_write_is_written_too() -> None:
    """A write task that had ended stayed in the table of pending writes for one more loop turn: a sample then
    started no write, and an eviction parked its entry where nothing took it out (the sample never written)."""
    cache = MemoryCache()
    s = store(cache, max_entries=2, write_delay=30)
    feed(s, [1.3])

    async def another_request() -> None:
        while await cache.get(cache_key(T, UP, MODEL)) is None:  # until the tenant's record is written
            await asyncio.sleep(0)
        feed(s, [1.4])  # a second answer of the tenant, in the very next turn
        feed(s, [1.2], tenant="b")  # another tenant: the first tenant's entry is let go

    other = asyncio.ensure_future(another_request())
    await asyncio.sleep(0)
    await s.flush()
    await other
    await s.close()
    record = await cache.get(cache_key(T, UP, MODEL))
    assert record is not None and [ratio for ratio, _, _ in record["samples"]] == [1.3, 1.4]
    assert not s._evicted and not s._writes


class LateCache(MemoryCache):
    """A network cache: the next read's value is the one served now, delivered ``late`` seconds later."""

    late = 0.0

    async def get(self, key: str) -> dict[str, Any] | None:
        value = await super().get(key)
        late, self.late = self.late, 0.0
        await asyncio.sleep(late)
        return value


async def test_a_late_read_of_its_own_older_record_does_not_move_the_factor() -> None:
    cache, clock = LateCache(), Clock()
    s = store(cache, clock=clock, write_delay=30)
    moves: list[float] = []
    s.on_factor = lambda tenant, upstream, model, factor: moves.append(factor)
    feed(s, [1.2] * 3)
    await s.flush()  # the record says 1.2
    clock.now += 1
    feed(s, [1.3, 1.29, 1.29, 1.29])  # 1.30, held by the dead band at a bound of 1.29; the write waits
    published = s.factor(T, UP, MODEL)
    s._entries[(T, UP, MODEL)].loaded = float("-inf")  # a refresh is due
    cache.late = 0.05
    await s.load(T, UP, MODEL)  # reads the 1.2 record now, delivers it after this process's own write
    await s.flush()
    await asyncio.sleep(0.1)
    assert s.factor(T, UP, MODEL) == published == 1.3
    before = len(moves)
    s._entries[(T, UP, MODEL)].loaded = float("-inf")
    await s.load(T, UP, MODEL)
    await s.flush()
    assert s.factor(T, UP, MODEL) == 1.3 and len(moves) == before  # no step away and back


async def test_another_replicas_record_is_told_apart_with_a_clock_that_does_not_move() -> None:
    clock, cache = Clock(), MemoryCache()  # never advanced: two records can carry the same (factor, updated)
    mine, theirs = store(cache, clock=clock, write_delay=30), store(cache, clock=clock, write_delay=30)
    feed(mine, [1.3] * 3)
    await mine.flush()
    await theirs.load(T, UP, MODEL)
    feed(theirs, [1.29])
    await theirs.flush()  # the same factor and time, other samples
    feed(mine, [1.2] * 3)
    await mine.flush()  # merges the other replica's record: its factor is the dead band's anchor
    assert mine.factor(T, UP, MODEL) == theirs.factor(T, UP, MODEL)


def test_a_store_used_under_two_event_loops_still_writes() -> None:
    cache = MemoryCache()
    s = store(cache, write_delay=30)

    async def answer(ratio: float) -> None:
        feed(s, [ratio])
        await asyncio.sleep(0.02)  # the write waits for more samples (on this loop's event)
        await s.flush()

    asyncio.run(answer(1.3))
    asyncio.run(answer(1.31))  # a new loop: the first loop's event is not waited on
    record = asyncio.run(cache.get(cache_key(T, UP, MODEL)))
    assert record is not None and len(record["samples"]) == 2


async def test_a_sample_that_arrives_while_the_record_is_being_written_is_written_too() -> None:
    """The pending write does not start another; the sample must still reach the shared record, not wait for
    shutdown (two replicas under load lost such samples)."""
    class Slow(MemoryCache):
        async def set(self, key: str, value: dict[str, Any], ttl: float | None = None) -> None:
            await asyncio.sleep(0.01)
            await super().set(key, value, ttl)

    cache = Slow()
    s = store(cache)
    feed(s, [1.3])
    await asyncio.sleep(0.005)  # the first write has built its record and waits on the backend
    feed(s, [1.31])
    await s.flush()
    record = await cache.get(cache_key(T, UP, MODEL))
    assert record is not None and len(record["samples"]) == 2
