"""The container image, built and run as an operator would: podman, read-only root, cache volume, healthcheck,
non-root, SIGTERM drain. And compose.yaml checked by a compose implementation.

Needs podman + runc (Debian: ``apt-get install podman runc uidmap slirp4netns fuse-overlayfs``) and,
where no registry can be reached, mmdebstrap or debootstrap for the local base image
(``deploy/podman/build-base-image.sh``, cached: paid once per machine). ``CTXPROXY_BASE_IMAGE`` names
another base image instead (e.g. ``python:3.11-slim`` where a registry is reachable).
The container uses the host's network, so it reaches the fake upstream on the host's 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import yaml

from tests.check._support import ROOT, ctxproxy_command, free_port, record, wait_http
from tests.fake_upstream import REPLY, FakeUpstream
from tests.store.test_summaries_http import conversation

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

CONTAINERS_CONF = ROOT / "deploy" / "podman" / "containers.conf"
BASE_SCRIPT = ROOT / "deploy" / "podman" / "build-base-image.sh"
IMAGE = "localhost/ctxproxy:check"
MODEL = "gpt-4o-mini"
DRAIN = 10.0  # server.drain_timeout in the mounted config
RUNTIME_PATHS = {"/etc", "/etc/hosts", "/etc/hostname", "/etc/resolv.conf", "/run", "/run/.containerenv",
                 "/run/secrets", "/var/cache/ctxproxy"}
PODMAN_ENV = dict(os.environ, CONTAINERS_CONF=os.environ.get("CONTAINERS_CONF", str(CONTAINERS_CONF)))


def _need_podman() -> str:
    podman = shutil.which("podman")
    if podman is None:
        pytest.skip("podman not installed (apt-get install podman runc uidmap slirp4netns fuse-overlayfs)")
    if shutil.which("runc") is None and shutil.which("crun") is None:
        pytest.skip("no OCI runtime (apt-get install runc)")
    return podman


def podman(*args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["podman", *args], env=PODMAN_ENV, capture_output=True, text=True, timeout=timeout,
                          check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


async def apodman(*args: str, timeout: float = 120) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec("podman", *args, env=PODMAN_ENV, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace")


def base_image() -> str:
    given = os.environ.get("CTXPROXY_BASE_IMAGE")
    if given:
        return given
    if shutil.which("mmdebstrap") is None and shutil.which("debootstrap") is None:
        pytest.skip("no base image: set CTXPROXY_BASE_IMAGE, or apt-get install mmdebstrap to build one locally")
    proc = subprocess.run([str(BASE_SCRIPT)], env=PODMAN_ENV, capture_output=True, text=True, timeout=1500,
                          check=False)
    assert proc.returncode == 0, f"building the base image failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def image() -> dict[str, Any]:
    _need_podman()
    base = base_image()
    previous = podman("image", "inspect", "--format", "{{.Id}}", IMAGE, check=False).stdout.strip()
    started = time.monotonic()
    podman("build", "--format", "docker", "--network", "host", "--build-arg", f"BASE_IMAGE={base}",
           "-t", IMAGE, str(ROOT), timeout=1500)
    built = time.monotonic() - started
    if previous and previous != podman("image", "inspect", "--format", "{{.Id}}", IMAGE).stdout.strip():
        podman("rmi", previous, check=False)  # the last check's image, now untagged: do not pile them up
    info = json.loads(podman("image", "inspect", IMAGE).stdout)[0]
    return {"base": base, "build_seconds": round(built, 1), "size_mb": round(info["Size"] / 1e6, 1),
            "config": info["Config"], "healthcheck": info.get("Healthcheck") or info["Config"].get("Healthcheck")}


def write_config(tmp_path: Path, upstream: FakeUpstream) -> Path:
    """An operator's config, mounted read-only: a small window so a summary is made and cached on the volume."""
    config = {
        # host and port from the environment, as in the shipped config (the healthcheck reads CTXPROXY_PORT)
        "server": {"host": "${CTXPROXY_HOST:-0.0.0.0}", "port": "${CTXPROXY_PORT:-8080}", "drain_timeout": DRAIN},
        "upstreams": {"fake": {"base_url": upstream.base_url, "api_key": "sk-upstream-secret"}},
        "models": [{"name": "small-model", "context_window": 8000, "max_output_tokens": 1000},
                   {"name": MODEL, "context_window": 128000, "max_output_tokens": 16384}],
        "summarizer_model": MODEL,
        "context_manager": {"type": "summarising", "params": {"keep_turns": 4}},
        "summarizer": {"timeout_seconds": 10},
        "cache": {"backend": "disk", "path": "/var/cache/ctxproxy"},
    }
    path = tmp_path / "ctxproxy.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    path.chmod(0o644)
    return path


class Container:
    def __init__(self, name: str, port: int) -> None:
        self.name = name
        self.port = port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def run(self, volume: str, upstream: FakeUpstream, config: Path | None = None) -> float:
        """Start the container; returns the seconds from `podman run` to /healthz answering."""
        args = ["run", "-d", "--name", self.name, "--read-only", "--network", "host",
                "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
                "--health-interval", "disable",  # no systemd timers here: run the healthcheck by hand
                "-v", f"{volume}:/var/cache/ctxproxy",
                "-e", f"CTXPROXY_PORT={self.port}", "-e", f"OPENAI_BASE_URL={upstream.base_url}",
                "-e", "OPENAI_API_KEY=sk-upstream-secret"]
        if config is not None:
            args += ["-v", f"{config}:/etc/ctxproxy/ctxproxy.yaml:ro", IMAGE,
                     "ctxproxy", "serve", "--config", "/etc/ctxproxy/ctxproxy.yaml"]
        else:
            args += [IMAGE]
        started = time.monotonic()
        podman(*args)
        return started

    def logs(self) -> str:
        proc = podman("logs", self.name, check=False)
        return proc.stdout + proc.stderr

    def remove(self) -> None:
        podman("rm", "-f", "-t", "0", self.name, check=False)


@pytest.fixture
def volume() -> Any:
    name = f"ctxproxy-check-{uuid.uuid4().hex[:8]}"
    podman("volume", "create", name)
    yield name
    podman("volume", "rm", "-f", name, check=False)


async def _ready(container: Container, started: float) -> float:
    try:
        await wait_http(container.url + "/healthz", 60)
    except AssertionError:
        raise AssertionError("container never healthy:\n" + container.logs()) from None
    return time.monotonic() - started


async def test_image_runs_read_only_non_root_healthy_and_drains(image: dict[str, Any], upstream: FakeUpstream,
                                                               volume: str, tmp_path: Path) -> None:
    figures: dict[str, Any] = {k: image[k] for k in ("base", "build_seconds", "size_mb")}
    assert image["config"]["User"] not in ("", "0", "root")
    assert image["healthcheck"] and "healthz" in " ".join(image["healthcheck"]["Test"])

    # 1. the image as shipped: its own config, read-only root, the cache volume
    shipped = Container(f"ctxproxy-check-{uuid.uuid4().hex[:8]}", free_port())
    try:
        started = shipped.run(volume, upstream)
        figures["start_seconds"] = round(await _ready(shipped, started), 2)
        rc, out = await apodman("healthcheck", "run", shipped.name)
        assert rc == 0, f"HEALTHCHECK failed ({rc}): {out}"
        rc, uid = await apodman("exec", shipped.name, "id", "-u")
        assert rc == 0 and uid.strip() not in ("", "0"), uid
        figures["uid"] = int(uid.strip())
        rc, top = await apodman("top", shipped.name, "user", "pid", "args")
        assert "root" not in top.split("\n", 1)[1], top
        async with openai.AsyncOpenAI(base_url=shipped.url + "/v1", api_key="sk-client", max_retries=0) as c:
            raw = await c.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": "Hello from a container."}])
            stream = await c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hello again."}], stream=True)
            text = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
        assert raw.parse().choices[0].message.content == REPLY and text == REPLY
        assert raw.headers["x-ctxproxy-summary"] == "none"
        assert [r.headers["Authorization"] for r in upstream.chat] == ["Bearer sk-upstream-secret"] * 2
        # the read-only root was never written to (the volume is a mount, not part of the diff; podman
        # itself mounts /etc/hosts, /etc/resolv.conf, /etc/hostname and /run/.containerenv)
        rc, diff = await apodman("diff", shipped.name)
        changed = [line for line in diff.splitlines() if line.strip() and line.split()[-1] not in RUNTIME_PATHS]
        assert rc == 0 and changed == [], f"the container wrote to its root filesystem:\n{diff}"
        rc, _ = await apodman("exec", shipped.name, "touch", "/app/x")
        assert rc != 0, "the root filesystem is writable"
        rc, _ = await apodman("stop", "-t", "35", shipped.name, timeout=60)
        assert rc == 0
        assert json.loads(podman("inspect", shipped.name).stdout)[0]["State"]["ExitCode"] == 0
        assert "Traceback" not in shipped.logs()
    finally:
        shipped.remove()

    # 2. an operator's config mounted read-only: a summary made, cached on the volume, reused by the
    #    next container, and SIGTERM draining an in-flight slow stream to completion
    config = write_config(tmp_path, upstream)
    upstream.chat.clear()
    body = {"model": "small-model", "messages": conversation(40)}
    first = Container(f"ctxproxy-check-{uuid.uuid4().hex[:8]}", free_port())
    try:
        await _ready(first, first.run(volume, upstream, config))
        async with aiohttp.ClientSession() as s, s.post(first.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
            # a first request far over B waits for its summary (nothing else fits): made and cached
            assert r.headers["x-ctxproxy-summary"] == "waited"
        assert len(upstream.summaries) == 1
        await apodman("stop", "-t", "35", first.name, timeout=60)
    finally:
        first.remove()

    second = Container(f"ctxproxy-check-{uuid.uuid4().hex[:8]}", free_port())
    try:
        await _ready(second, second.run(volume, upstream, config))
        async with aiohttp.ClientSession() as s, s.post(second.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            assert r.headers["x-ctxproxy-summary"] == "reused"  # read back from the volume
        assert len(upstream.summaries) == 1
        figures["summary_on_volume"] = "created by the first container, reused by the second"

        upstream.mode, upstream.delay = "slow_first_byte", 3.0
        async with openai.AsyncOpenAI(base_url=second.url + "/v1", api_key="sk-client", max_retries=0) as c:

            async def consume() -> tuple[str, list[str]]:
                stream = await c.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "slow"}], stream=True,
                    stream_options={"include_usage": True})
                text, finishes = "", []
                async for ch in stream:
                    if ch.choices:
                        text += ch.choices[0].delta.content or ""
                        finishes += [ch.choices[0].finish_reason] if ch.choices[0].finish_reason else []
                return text, finishes

            task = asyncio.ensure_future(consume())
            deadline = time.monotonic() + 20
            while upstream.active == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert upstream.active == 1, "the slow request never reached the upstream"
            sent = time.monotonic()
            stop = asyncio.ensure_future(apodman("stop", "-t", "35", second.name, timeout=60))
            text, finishes = await asyncio.wait_for(task, 30)
            rc, out = await stop
            drained = time.monotonic() - sent
        assert rc == 0, out
        assert (text, finishes) == (REPLY, ["stop"]), "the in-flight stream was not drained to completion"
        state = json.loads(podman("inspect", second.name).stdout)[0]["State"]
        assert state["ExitCode"] == 0, state
        assert drained < DRAIN + 5
        figures["drain"] = {"in_flight_completed": True, "exit_code": state["ExitCode"],
                            "seconds_from_sigterm_to_exit": round(drained, 2)}
        log = second.logs()
        assert "Traceback" not in log
        assert "sk-upstream-secret" not in log and "sk-client" not in log
    finally:
        second.remove()
    record("container", figures)


UNSUPPORTED = ("invalid choice", "unknown shorthand flag", "unknown command", "is not a docker command")


def _render_compose() -> subprocess.CompletedProcess[str] | None:
    """``<compose> -f compose.yaml config`` with the first implementation that has it (None: none has)."""
    for argv in (["podman-compose"], ["docker", "compose"], ["podman", "compose"], ["docker-compose"]):
        beside = Path(sys.executable).parent / argv[0]  # installed in this venv by `make check`
        exe = str(beside) if beside.is_file() else shutil.which(argv[0])
        if exe is None:
            continue
        proc = subprocess.run([exe, *argv[1:], "-f", str(ROOT / "compose.yaml"), "config"], capture_output=True,
                              text=True, env=dict(PODMAN_ENV, OPENAI_API_KEY="sk-test"), cwd=ROOT, check=False,
                              timeout=120)
        # Debian's podman-compose 1.0 has no `config`, and podman 4.3 no `compose`: try the next one
        if proc.returncode != 0 and any(u in proc.stderr for u in UNSUPPORTED):
            continue
        return proc
    return None


def test_compose_config_renders() -> None:
    proc = _render_compose()
    if proc is None:
        pytest.skip("no compose implementation with `config` (pip install podman-compose, or docker compose)")
    assert proc.returncode == 0, proc.stderr
    rendered = yaml.safe_load(proc.stdout)
    services = rendered["services"]
    assert {"ctxproxy-1", "ctxproxy-2", "ctxproxy-3", "redis", "nginx", "prometheus", "grafana"} <= set(services)
    for name in ("ctxproxy-1", "ctxproxy-2", "ctxproxy-3"):
        assert services[name]["read_only"] in (True, "true")
        assert services[name]["environment"]["OPENAI_API_KEY"] == "sk-test"


def test_compose_replica_config_validates() -> None:
    """``ctxproxy validate`` (as a process) on the config every compose replica reads."""
    path = ROOT / "deploy" / "compose" / "ctxproxy.yaml"
    proc = subprocess.run([*ctxproxy_command(), "validate", str(path)], capture_output=True, text=True, cwd=ROOT,
                          check=False, timeout=120)
    assert (proc.returncode, proc.stdout.strip()) == (0, "ok"), proc.stderr
