"""The cost report (proxy.serve.report) tells "no traffic" from "cannot read the ledger".

Both ways of asking: ``GET /admin/report`` on a live proxy and ``ctxproxy report`` as a process. A report
that cannot read its ledger used to print an all-zero table and exit 0 (200 on the endpoint); a mistyped
disk path did the same and created the folder. Now it fails, naming why: exit 1, 503 in the wire's shape.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
import yaml

from proxy.cli import main
from proxy.serve.report import parse_since, render
from tests.conftest import ROOT, RunningProxy, StartProxy
from tests.fake_upstream import FakeUpstream
from tests.outside import metric_samples, metric_total, scrape
from tests.redis_server import RedisServer
from tests.serve.test_costs import ALIAS, SUMMARISER, growing
from tests.serve.test_costs import config as costs_config
from tests.store.test_summaries_http import config, conversation, post

ADMIN = "sk-admin"
PASSWORD = "s3cret-redis-pw"


def report_cli(tmp_path: Path, cache: dict[str, Any], *args: str) -> subprocess.CompletedProcess[str]:
    """``ctxproxy report`` as its own process, on a config with this cache section."""
    path = tmp_path / "report.yaml"
    path.write_text(yaml.safe_dump(config("http://127.0.0.1:9/v1", cache=cache)))
    return subprocess.run([sys.executable, "-m", "proxy.cli", "report", "--config", str(path), "--since", "2h", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A TCP port that accepts connections and never answers (a stalled Redis, as the network sees it)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    try:
        yield int(listener.getsockname()[1])
    finally:
        listener.close()


async def get_report(proxy_url: str, query: str = "") -> tuple[int, str, bytes]:
    async with aiohttp.ClientSession() as s, s.get(proxy_url + "/admin/report?since=1h" + query,
                                                   headers={"Authorization": f"Bearer {ADMIN}"}) as r:
        return r.status, r.content_type, await r.read()


def unreadable(raw: bytes) -> str:
    """The 503's message, after checking its shape (OpenAI's error, no traceback)."""
    assert b"Traceback" not in raw and b'File "' not in raw
    body = json.loads(raw)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == "ledger_unavailable"
    message: str = body["error"]["message"]
    return message


# ---------------------------------------------------------------------------- the CLI


def test_cli_report_fails_when_redis_refuses(tmp_path: Path) -> None:
    port = free_port()
    done = report_cli(tmp_path, {"backend": "redis", "url": f"redis://:{PASSWORD}@127.0.0.1:{port}/0"})
    assert done.returncode == 1, done
    assert done.stdout == ""
    assert "cannot read the cost ledger" in done.stderr and f"redis://127.0.0.1:{port}/0" in done.stderr
    assert "ConnectionError" in done.stderr
    assert PASSWORD not in done.stderr


def test_cli_report_fails_when_redis_stalls(tmp_path: Path, silent_server: int) -> None:
    done = report_cli(tmp_path, {"backend": "redis", "url": f"redis://127.0.0.1:{silent_server}/0",
                                 "timeout_seconds": 0.5})
    assert done.returncode == 1, done
    assert "cannot read the cost ledger" in done.stderr and "Timeout" in done.stderr


def test_cli_report_on_a_mistyped_path_fails_and_creates_nothing(tmp_path: Path) -> None:
    typo = tmp_path / "cahce" / "ctxproxy"
    done = report_cli(tmp_path, {"backend": "disk", "path": str(typo)}, "--json")
    assert done.returncode == 1, done
    assert done.stdout == "" and f"{typo} does not exist" in done.stderr
    assert not (tmp_path / "cahce").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    done = report_cli(tmp_path, {"backend": "disk", "path": str(empty)})
    assert done.returncode == 1 and "no cost ledger at" in done.stderr, done
    assert list(empty.iterdir()) == []


async def test_no_traffic_is_an_empty_report_not_an_error(upstream: FakeUpstream, start_proxy: StartProxy,
                                                          tmp_path: Path) -> None:
    """A server that has answered nothing yet: 200 and exit 0, all zeros (the ledger exists, empty)."""
    cache = {"backend": "disk", "path": str(tmp_path / "cache")}
    proxy = await start_proxy(config(upstream.base_url, admin={"keys": [ADMIN]}, cache=cache))
    status, _, raw = await get_report(proxy.url)
    assert status == 200 and json.loads(raw)["total"]["requests"] == 0
    done = await asyncio.to_thread(report_cli, tmp_path, cache, "--json")
    assert done.returncode == 0, done
    assert json.loads(done.stdout)["total"]["requests"] == 0 and json.loads(done.stdout)["rows"] == []


# ---------------------------------------------------------------------------- the admin endpoint


async def test_admin_report_is_503_while_its_redis_is_down_then_complete(
        upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """Redis down: 503 naming why (the process holds figures it cannot write, and cannot read the others');
    back: 200, and the figures the process kept meanwhile are all there."""
    with RedisServer.started() as server:
        client = aioredis.Redis.from_url(server.url)
        await client.config_set("requirepass", PASSWORD)
        await client.aclose()
        url = f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0"
        proxy = await start_proxy(config(upstream.base_url, admin={"keys": [ADMIN]},
                                         cache={"backend": "redis", "url": url}))
        async with aiohttp.ClientSession() as s:
            for n in (30, 31, 32):
                assert (await post(s, proxy.url, conversation(n)))[0] == 200
        server.stop()
        async with aiohttp.ClientSession() as s:
            assert (await post(s, proxy.url, conversation(33)))[0] == 200  # served without the cache
        for query in ("", "&format=text"):
            status, content_type, raw = await get_report(proxy.url, query)
            assert (status, content_type) == (503, "application/json")
            message = unreadable(raw)
            assert f"redis://127.0.0.1:{server.port}/0" in message and "ConnectionError" in message
            assert PASSWORD not in message
        server.start()  # back, empty (no persistence): this process writes its whole buckets again
        client = aioredis.Redis.from_url(server.url)
        await client.config_set("requirepass", PASSWORD)
        await client.aclose()
        status, _, raw = await get_report(proxy.url)
        assert status == 200, raw
        text = await scrape(proxy)
        assert json.loads(raw)["total"]["requests"] == metric_total(text, "ctxproxy_requests_total") == 4


TENANTS = {"acme": "sk-acme", "globex": "sk-globex"}


def report_config(url: str, **extra: Any) -> dict[str, Any]:
    return costs_config(url, tenants=[{"name": n, "keys": [k]} for n, k in TENANTS.items()], admin={"keys": [ADMIN]},
                  **extra)


async def traffic(proxy: RunningProxy) -> None:
    """Two tenants, two models, summaries created and reused, cache effects, a refused request."""
    async with aiohttp.ClientSession() as s:
        for tenant, turns, model in (("acme", [10, 11, 40, 41], ALIAS), ("globex", [38, 39], ALIAS),
                                     ("globex", [3, 4], SUMMARISER)):
            for n in turns:
                async with s.post(proxy.url + "/v1/chat/completions", json={"model": model, "messages": growing(n)},
                                  headers={"Authorization": f"Bearer {TENANTS[tenant]}"}) as r:
                    assert r.status == 200
        async with s.post(proxy.url + "/v1/chat/completions", json={"model": ALIAS, "messages": [{"role": "wizard"}]},
                          headers={"Authorization": "Bearer sk-acme"}) as r:
            assert r.status == 400


def expected(text: str) -> dict[tuple[str, str], dict[str, float]]:
    """The report's columns, computed from /metrics (the enforced requests' and, beside them, the observed ones')."""
    out: dict[tuple[str, str], dict[str, float]] = {}
    keys = {(labels["tenant"], labels["model"]) for labels, _ in metric_samples(text, "ctxproxy_requests_total")}
    for tenant, model in keys:
        t = {"tenant": tenant, "model": model}
        e, o = {**t, "mode": "enforce"}, {**t, "mode": "observe"}
        out[(tenant, model)] = {
            "requests": metric_total(text, "ctxproxy_requests_total", **t),
            "tokens_received": metric_total(text, "ctxproxy_tokens_received_total", **e),
            "tokens_forwarded": metric_total(text, "ctxproxy_tokens_forwarded_total", **e),
            "tokens_removed": metric_total(text, "ctxproxy_tokens_removed_total", **e),
            "observed_tokens_received": metric_total(text, "ctxproxy_tokens_received_total", **o),
            "observed_tokens_forwarded": metric_total(text, "ctxproxy_tokens_forwarded_total", **o),
            "observed_tokens_removed": metric_total(text, "ctxproxy_tokens_removed_total", **o),
            "observed_gross_usd": metric_total(text, "ctxproxy_estimated_savings_usd_total", **o),
            "summarizer_usd": metric_total(text, "ctxproxy_request_summarizer_cost_usd_total", **t),
            "gross_usd": metric_total(text, "ctxproxy_estimated_savings_usd_total", **e),
            "cache_effect_usd": metric_total(text, "ctxproxy_prompt_cache_effect_usd_total", **t),
            "net_usd": metric_total(text, "ctxproxy_net_savings_usd_total", **t)
            - metric_total(text, "ctxproxy_net_loss_usd_total", **t),
        }
    return out


def check(report: dict[str, Any], text: str) -> None:
    want = expected(text)
    rows = {(row["tenant"], row["model"]): row for row in report["rows"]}
    assert set(rows) == set(want)
    for key, columns in want.items():
        for name, value in columns.items():
            assert rows[key][name] == pytest.approx(value, abs=1e-12), (key, name)
    for tenant in TENANTS:  # summaries are counted per tenant in the metrics
        for result in ("created", "reused"):
            assert sum(row[f"summaries_{result}"] for row in report["rows"] if row["tenant"] == tenant) \
                == metric_total(text, "ctxproxy_summaries_total", tenant=tenant, result=result)
    for name in ("requests", "gross_usd", "net_usd", "cache_effect_usd", "summarizer_usd"):
        assert report["total"][name] == pytest.approx(sum(row[name] for row in report["rows"]), abs=1e-12)
    # the run did exercise every column
    total = report["total"]
    assert total["summaries_created"] >= 2 and total["summaries_reused"] >= 1
    assert total["gross_usd"] > 0 and total["summarizer_usd"] > 0 and total["cache_effect_usd"] > 0


async def test_admin_report_totals_equal_the_metrics(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """``GET /admin/report``'s totals equal the metrics' counters: the report and /metrics read one ledger."""
    upstream.prompt_scale, upstream.report_cached = 1.0, True
    proxy = await start_proxy(report_config(upstream.base_url))
    await traffic(proxy)
    text = await scrape(proxy, ADMIN)
    async with aiohttp.ClientSession() as s:
        async with s.get(proxy.url + "/admin/report?since=1h", headers={"Authorization": f"Bearer {ADMIN}"}) as r:
            assert r.status == 200
            report = await r.json()
        async with s.get(proxy.url + "/admin/report?since=1h&format=text",
                         headers={"Authorization": f"Bearer {ADMIN}"}) as r:
            assert r.status == 200 and r.content_type == "text/plain"
            table = await r.text()
        async with s.get(proxy.url + "/admin/report", headers={"Authorization": "Bearer sk-acme"}) as r:
            assert r.status == 401  # a tenant's key is not an admin key
        async with s.get(proxy.url + "/admin/report?since=forever", headers={"Authorization": f"Bearer {ADMIN}"}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "since"
    check(report, text)
    assert "acme" in table and "globex" in table and "net $" in table
    assert table.splitlines()[:-1] == render(report).splitlines()[:-1]  # the same table (the footer has the time)


async def test_cli_report_reads_the_ledger_after_the_server_is_gone(
        upstream: FakeUpstream, start_proxy: StartProxy, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``ctxproxy report`` reads the disk ledger after the server has stopped: the figures outlive the process."""
    upstream.prompt_scale, upstream.report_cached = 1.0, True
    cfg = report_config(upstream.base_url, cache={"backend": "disk", "path": str(tmp_path / "cache")})
    path = tmp_path / "ctxproxy.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proxy = await start_proxy(cfg)
    await traffic(proxy)
    text = await scrape(proxy, ADMIN)
    await proxy.runner.cleanup()  # the server stops: its last buckets are flushed on the way out
    capsys.readouterr()
    code = await asyncio.to_thread(main, ["report", "--config", str(path), "--since", "2h", "--json"])
    assert code == 0
    check(json.loads(capsys.readouterr().out), text)
    code = await asyncio.to_thread(main, ["report", "--config", str(path)])
    out = capsys.readouterr().out
    assert code == 0 and "acme" in out and "gross $" in out
    assert await asyncio.to_thread(main, ["report", "--config", str(path), "--since", "40d"]) == 2


async def test_the_report_shows_what_observe_mode_would_have_saved_next_to_what_enforce_saved(
        upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """Two tenants send the same conversation, one in observe mode: the report's enforced columns are the other
    tenant's alone, and the observed columns say what enforce would have removed, saved (priced the same way) and
    refused; the ledger's figures equal the metrics' in both modes, and the table shows both."""
    upstream.prompt_scale = 1.0
    cfg = report_config(upstream.base_url)
    cfg["tenants"][1]["mode"] = "observe"  # globex
    proxy = await start_proxy(cfg)
    big = [{"role": "user", "content": "x " * 9_000}]  # over the window even after management: refused in enforce
    async with aiohttp.ClientSession() as s:
        for key in TENANTS.values():
            for n in (10, 11, 40, 41):
                async with s.post(proxy.url + "/v1/chat/completions", json={"model": ALIAS, "messages": growing(n)},
                                  headers={"Authorization": f"Bearer {key}"}) as r:
                    assert r.status == 200
            async with s.post(proxy.url + "/v1/chat/completions", json={"model": ALIAS, "messages": big},
                              headers={"Authorization": f"Bearer {key}"}) as r:
                assert r.status == (400 if key == "sk-acme" else 200)
        async with s.get(proxy.url + "/admin/report?since=1h", headers={"Authorization": f"Bearer {ADMIN}"}) as r:
            assert r.status == 200
            report = await r.json()
    text = await scrape(proxy, ADMIN)
    want = expected(text)
    rows = {(row["tenant"], row["model"]): row for row in report["rows"]}
    for row_key, columns in want.items():
        for name, value in columns.items():
            assert rows[row_key][name] == pytest.approx(value, abs=1e-12), (row_key, name)
    enforced, observed = rows[("acme", ALIAS)], rows[("globex", ALIAS)]
    assert enforced["requests"] == observed["requests"] == 5
    assert observed["observed_requests"] == 5 and enforced["observed_requests"] == 0
    assert observed["observed_refusals"] == 1 == metric_total(text, "ctxproxy_observed_refusals_total",
                                                               tenant="globex", code="context_length_exceeded")
    assert observed["tokens_received"] == observed["tokens_removed"] == observed["gross_usd"] == 0
    assert observed["summaries_created"] == observed["summarizer_usd"] == 0
    assert enforced["observed_tokens_removed"] == enforced["observed_gross_usd"] == 0
    assert observed["observed_tokens_received"] == enforced["tokens_received"]
    # the same conversation: what enforce would have removed, priced, is about what it did remove for acme (its
    # summaries are counted at their largest in observe mode, so it is no more than that)
    assert 0 < observed["observed_gross_usd"] <= enforced["gross_usd"]
    assert observed["observed_tokens_removed"] <= enforced["tokens_removed"]
    table = render(report)
    header = table.splitlines()[0]
    assert "gross $" in header and "would save $" in header and "would refuse" in header
    assert "observed: requests forwarded as sent" in table.splitlines()[-1]


def test_report_since_bounds() -> None:
    """``--since`` / ``?since=`` accept minutes, hours, days, seconds and bare hours, and refuse what they
    cannot bound."""
    assert [parse_since(x) for x in ("90m", "24h", "7d", "3600s", "2")] == [5400, 86400, 604800, 3600, 7200]
    for bad in ("", "forever", "-1h", "0h", "32d", "1w"):
        with pytest.raises(ValueError):
            parse_since(bad)
