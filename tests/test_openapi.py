"""proxy/openapi.yaml describes what ctxproxy serves, and schemathesis fuzzes the live proxy from it.

The document check runs by default. The schemathesis run (package ``schemathesis``, CLI ``schemathesis run``
against a proxy on a free port with the fake upstream behind it) is ``slow``: ``make check`` runs it. It is
skipped with a message when schemathesis is not installed.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.settings import load_config
from tests.conftest import ROOT, base_config
from tests.fake_upstream import FakeUpstream
from tests.wire.chat_helpers import check_messages as check

SPEC = ROOT / "proxy" / "openapi.yaml"
CATCH_ALL = "/v1/{tail}"  # the generic relay: any other /v1/* path, not described in the document
OWN_NAMESPACE = "/v1/ctxproxy/{tail}"  # any other method/path under the proxy's own prefix: 404, never relayed


def spec() -> dict[str, Any]:
    return yaml.safe_load(SPEC.read_text())


def test_openapi_document_matches_the_routes() -> None:
    from aiohttp import web

    from proxy.serve.routes import add_routes

    doc = spec()
    assert doc["openapi"].startswith("3.0")
    app = web.Application()
    add_routes(app)
    served: set[tuple[str, str]] = set()
    for route in app.router.routes():
        info = route.resource.get_info() if route.resource is not None else {}
        path = str(info.get("path") or info.get("formatter"))
        if route.method in ("HEAD",) or path in ("/v1/{tail:.*}", CATCH_ALL, OWN_NAMESPACE):
            continue
        served.add((route.method.lower(), path))
    documented = {(method, path) for path, ops in doc["paths"].items() for method in ops}
    assert documented == served
    # every error response is OpenAI's error shape
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            for status, response in op["responses"].items():
                ref = response.get("$ref", "")
                if status.startswith(("4", "5")) and path != "/admin/reload" and path != "/readyz":
                    assert ref.startswith("#/components/responses/"), (method, path, status)


def test_openapi_document_is_valid() -> None:
    validator = pytest.importorskip("openapi_spec_validator", reason="openapi-spec-validator is not installed")
    validator.validate(spec())


def test_openapi_document_loads_in_schemathesis() -> None:
    schemathesis = pytest.importorskip(
        "schemathesis", reason="schemathesis is not installed (pip install schemathesis)"
    )
    schema = schemathesis.openapi.from_path(str(SPEC))
    operations = [op.ok() for op in schema.get_all_operations()]
    assert len(operations) == sum(len(ops) for ops in spec()["paths"].values())


def _schemathesis_cli() -> str | None:
    local = Path(sys.executable).with_name("schemathesis")
    if local.exists():
        return str(local)
    return shutil.which("schemathesis")


@pytest.mark.slow
@pytest.mark.timeout(900)  # the run itself may take up to 600 s (below): more than the suite's 120 s default
async def test_schemathesis_against_the_live_proxy(upstream: FakeUpstream, start_proxy: Any, tmp_path: Path) -> None:
    cli = _schemathesis_cli()
    if cli is None:
        pytest.skip("schemathesis is not installed (pip install schemathesis): the live fuzz run is skipped")
    config_path = tmp_path / "ctxproxy.yaml"
    cfg = base_config(
        upstream.base_url,
        models=[{"name": "gpt-4o-mini", "context_window": 128000, "max_output_tokens": 16384},
                {"name": "tiny", "context_window": 400, "max_output_tokens": 50}],
        admin={"keys": ["adm-schemathesis"]},
        logging={"level": "WARNING", "requests": False},
        summarizer={"retry_backoff_seconds": 0, "timeout_seconds": 5},
    )
    config_path.write_text(yaml.safe_dump(cfg))
    proxy = await start_proxy(load_config(config_path, env={}), config_path=str(config_path))
    report = tmp_path / "report.json"
    args = [
        cli, "run", str(SPEC), "--url", proxy.url,
        "--checks", "not_a_server_error,status_code_conformance,content_type_conformance,"
                    "response_schema_conformance",
        "--max-examples", "30", "--seed", "20240601", "--workers", "1", "--request-timeout", "20",
        "--phases", "examples,coverage,fuzzing",
        "--header", "Authorization: Bearer sk-client",
        "--suppress-health-check", "all",
        "--report", "json", "--report-json-path", str(report),
        "--output-truncate", "true",
    ]
    env = dict(os.environ, SCHEMATHESIS_TELEMETRY="false", NO_COLOR="1")
    proc = await asyncio.create_subprocess_exec(*args, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT, env=env, cwd=tmp_path)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), 600)
    except asyncio.TimeoutError:
        proc.kill()
        raise
    text = out.decode("utf-8", "replace")
    print(text[-4000:])
    if proc.returncode != 0 and ("ConnectionError" in text or "Network" in text) and not upstream.chat:
        pytest.skip("schemathesis could not reach the proxy offline:\n" + text[-2000:])
    assert proc.returncode == 0, text[-6000:]
    # whatever schemathesis sent, every body the upstream received was a valid payload
    assert upstream.chat, "schemathesis sent no request that reached the upstream"
    for rec in upstream.chat:
        assert isinstance(rec.body.get("messages"), list) and rec.body["messages"]
        check(rec.body["messages"])
    if report.exists():
        json.loads(report.read_text())  # a well-formed report was written
