"""plugins.registry: what a config or a request may name as a plugin, and what it may never make the proxy load."""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import StartProxy, base_config
from tests.fake_upstream import FakeUpstream
from tests.outside import post

MODEL = "gpt-4o-mini"


TENANT_KEY = "sk-tenant-acme-7f3a"


OVERRIDE = "x-ctxproxy-context-manager"


def chat(messages: list[Any], model: str = MODEL, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": messages, **extra}


@pytest.mark.parametrize("tenants", [False, True], ids=["no-tenants", "tenants"])
async def test_an_override_header_never_imports_a_module(
    upstream: FakeUpstream, start_proxy: StartProxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tenants: bool
) -> None:
    """A per-request override naming a plugin by ``ref`` (``module:Class``) is ignored with a warning: a client
    must never make the proxy import a module of its choosing."""
    name = f"ctxproxy_probe_{uuid.uuid4().hex}"
    marker = tmp_path / "imported"
    (tmp_path / f"{name}.py").write_text(f"open({str(marker)!r}, 'w').write('side effect')\nclass Plugin: pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    extra: dict[str, Any] = {"tenants": [{"name": "acme", "keys": [TENANT_KEY]}]} if tenants else {}
    proxy = await start_proxy(base_config(upstream.base_url, **extra))
    header = json.dumps({"type": "summarising", "params": {"summarizer": {"ref": f"{name}:Plugin"}}})
    try:
        status, headers, body = await post(proxy, chat([{"role": "user", "content": "hi"}]),
                                           key=TENANT_KEY if tenants else "sk-client", headers={OVERRIDE: header})
        assert status == 200, body
        assert "ignored" in headers.get("x-ctxproxy-warning", "")
        assert not marker.exists(), "the client's override imported a module of its choosing"
        assert name not in sys.modules
    finally:
        sys.modules.pop(name, None)
