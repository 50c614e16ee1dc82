"""The deployment files, checked fast (``make test``): compose.yaml, nginx, Prometheus, Grafana, Dockerfile,
and the build's own files (Makefile, .ci/).

Running them for real is ``make check`` (tests/check/): the image built and run under podman, the
compose file rendered by a compose implementation, nginx in front of three replicas.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
REPLICAS = ["ctxproxy-1", "ctxproxy-2", "ctxproxy-3"]


def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "compose.yaml").read_text(encoding="utf-8"))


def test_compose_has_three_read_only_replicas_redis_nginx_prometheus_grafana() -> None:
    services = compose()["services"]
    assert set(services) == {*REPLICAS, "redis", "nginx", "prometheus", "grafana"}
    for name in REPLICAS:
        s = services[name]
        assert s["read_only"] is True and "/tmp" in s["tmpfs"]
        assert s["build"]["args"]["BASE_IMAGE"].endswith("python:3.11-slim}")
        assert s["depends_on"]["redis"]["condition"] == "service_healthy"
        assert s["stop_signal"] == "SIGTERM"
        config = s["command"][s["command"].index("--config") + 1]
        mounts = dict(v.rsplit(":", 2)[:2] if v.count(":") >= 2 else v.split(":") for v in s["volumes"])
        assert config in mounts.values()
        assert "ports" not in s  # only nginx is published
    assert services["nginx"]["ports"] and all("ports" not in services[n] for n in REPLICAS)


def test_compose_mounts_exist() -> None:
    for name, s in compose()["services"].items():
        for volume in s.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), (name, source)


def test_replica_config_uses_the_redis_cache() -> None:
    """(`ctxproxy validate` runs on it in make check: tests/check/test_container.py.)"""
    config = yaml.safe_load((ROOT / "deploy" / "compose" / "ctxproxy.yaml").read_text(encoding="utf-8"))
    assert config["cache"]["backend"] == "redis" and config["cache"]["url"].startswith("${CTXPROXY_REDIS_URL")
    assert config["server"]["port"] == 8080 and config["server"]["host"] == "0.0.0.0"


def test_nginx_config_is_streaming_safe() -> None:
    text = (ROOT / "deploy" / "nginx" / "ctxproxy.conf").read_text(encoding="utf-8")
    code = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    for directive in ("proxy_buffering off;", "proxy_http_version 1.1;", 'proxy_set_header Connection "";',
                      "proxy_request_buffering off;", "proxy_next_upstream error timeout;"):
        assert directive in code, directive
    assert re.search(r"^\s*keepalive \d+;", code, re.M)
    assert "non_idempotent" not in code  # a POST already sent is never resent to another replica
    assert re.search(r"proxy_read_timeout (\d+)s;", code) and int(
        re.search(r"proxy_read_timeout (\d+)s;", code).group(1)) >= 300  # type: ignore[union-attr]
    assert sorted(re.findall(r"server (ctxproxy-\d):8080", code)) == REPLICAS


def test_nginx_accepts_the_config(tmp_path: Path) -> None:
    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").is_file() else None)
    if nginx is None:
        pytest.skip("nginx not installed (apt-get install nginx)")
    conf = (ROOT / "deploy" / "nginx" / "ctxproxy.conf").read_text(encoding="utf-8")
    (tmp_path / "ctxproxy.conf").write_text(re.sub(r"ctxproxy-\d+:8080", "127.0.0.1:9", conf), encoding="utf-8")
    (tmp_path / "nginx.conf").write_text(
        f"pid {tmp_path}/nginx.pid; error_log stderr; events {{}}\n"
        f"http {{ access_log off; client_body_temp_path {tmp_path}; proxy_temp_path {tmp_path};\n"
        f"fastcgi_temp_path {tmp_path}; uwsgi_temp_path {tmp_path}; scgi_temp_path {tmp_path};\n"
        f"include {tmp_path}/ctxproxy.conf; }}\n", encoding="utf-8")
    proc = subprocess.run([nginx, "-t", "-q", "-e", "stderr", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf")],
                          capture_output=True, text=True, check=False, timeout=30)
    assert proc.returncode == 0, proc.stderr


def test_prometheus_scrapes_every_replica(tmp_path: Path) -> None:
    path = ROOT / "deploy" / "prometheus" / "prometheus.yml"
    config = yaml.safe_load(path.read_text(encoding="utf-8"))
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "ctxproxy")
    assert job["metrics_path"] == "/metrics"
    # each replica's metrics port (no key; compose exposes it on its network, publishes only nginx)
    assert sorted(t for sc in job["static_configs"] for t in sc["targets"]) == [f"{r}:9464" for r in REPLICAS]
    replica = yaml.safe_load((ROOT / "deploy" / "compose" / "ctxproxy.yaml").read_text(encoding="utf-8"))
    assert replica["server"]["metrics_port"] == 9464 and replica["server"]["metrics_host"] == "0.0.0.0"
    assert all("9464" in compose()["services"][r]["expose"] for r in REPLICAS)
    promtool = shutil.which("promtool")
    if promtool:
        proc = subprocess.run([promtool, "check", "config", "--syntax-only", str(path)], capture_output=True,
                              text=True, check=False, timeout=30)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_grafana_provisioning_matches_the_dashboard() -> None:
    services = compose()["services"]
    datasource = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yaml").read_text())
    ds = datasource["datasources"][0]
    assert (ds["type"], ds["isDefault"], ds["url"]) == ("prometheus", True, "http://prometheus:9090")
    prom = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    assert ds["jsonData"]["timeInterval"] == prom["global"]["scrape_interval"]  # $__rate_interval >= 4 scrapes
    provider = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/ctxproxy.yaml").read_text())
    folder = provider["providers"][0]["options"]["path"]
    mounted = {v.split(":")[1]: v.split(":")[0] for v in services["grafana"]["volumes"]}
    dashboard_file = next(src for dst, src in mounted.items() if dst.startswith(folder + "/"))
    dashboard = json.loads((ROOT / dashboard_file).read_text(encoding="utf-8"))
    # the dashboard picks its data source through a datasource variable: the provisioned default fits it
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource" and variables["DS_PROMETHEUS"]["query"] == "prometheus"


def test_dockerfile_base_image_argument_healthcheck_and_user() -> None:
    text = (ROOT / "Dockerfile").read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert lines[0] == "ARG BASE_IMAGE=python:3.11-slim" and lines[1] == "FROM ${BASE_IMAGE}"
    assert re.search(r"^USER (\d+)$", text, re.M) and re.search(r"^USER (\d+)$", text, re.M).group(1) != "0"  # type: ignore[union-attr]
    assert "HEALTHCHECK" in text and "/healthz" in text
    assert "STOPSIGNAL SIGTERM" in text


def test_make_run_calls_a_module_and_embeds_no_program() -> None:
    """What make run prints is code that is linted, typed and tested (proxy/where.py), not a Python program
    kept in a Makefile variable where none of that reaches it."""
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert "define " not in text and " -c " not in text
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    dry = subprocess.run(["make", "-n", "-s", "run", "CONFIG=config/claude-code.yaml"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    commands = dry.stdout.splitlines()
    assert commands[-2:] == [".venv/bin/python -m proxy.cli where --config config/claude-code.yaml",
                             ".venv/bin/ctxproxy serve --config config/claude-code.yaml"]


def test_ci_lints_type_checks_and_tests() -> None:
    """CI runs every habit, not only the tests: `make test` lints (ruff and the commit subjects) and type-checks
    (mypy) before the suite, and CI runs `make test`."""
    commands = [line.split("#", 1)[0].strip() for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8")
                .splitlines() if line.strip().startswith("make ")]
    assert commands == ["make test"]
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^test: lint typecheck$", makefile, re.MULTILINE)
    lint = makefile.split("\nlint:", 1)[1].split("\n\n", 1)[0]
    assert ".ci/check-commits" in lint and "ruff check" in lint


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.com"}
    out = subprocess.run(["git", *args], cwd=repo, env=env, capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip()


def test_check_commits_refuses_a_subject_of_72_characters_after_the_baseline(tmp_path: Path) -> None:
    """A subject is a line a reader scans in a log: under 72 characters, the detail in the body. Commits before
    the baseline are history and are not checked; a long body is fine."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "check-commits", tmp_path / ".ci" / "check-commits")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "commit", "-q", "--allow-empty", "-m", "Old history with a subject that runs on " + "x" * 80)
    baseline = _git(tmp_path, "rev-parse", "HEAD")
    _git(tmp_path, "commit", "-q", "--allow-empty", "-m", "S" * 71 + "\n\n" + "A body line may be long. " * 10)
    check = [sys.executable, str(tmp_path / ".ci" / "check-commits"), baseline]
    ok = subprocess.run(check, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    _git(tmp_path, "commit", "-q", "--allow-empty", "-m", "é" * 72)  # characters, not bytes, are counted
    long = _git(tmp_path, "rev-parse", "--short", "HEAD")
    bad = subprocess.run(check, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1
    assert bad.stderr.splitlines() == [f"{long}: subject of 72 characters (under 72, please; details go in the body): "
                                       + "é" * 72]


def test_the_repository_keeps_its_commit_subjects_short() -> None:
    """This checkout itself passes (outside a git checkout there is nothing to check, and it says so)."""
    out = subprocess.run([sys.executable, str(ROOT / ".ci" / "check-commits")], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
