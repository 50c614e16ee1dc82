"""``ctxproxy validate`` and ``ctxproxy assemble`` (proxy.cli), in-process and as a real process."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.cli import main
from tests.conftest import ROOT
from tests.fake_upstream import FakeUpstream
from tests.helpers import REPO, assistant, call, pairing_problems, recount, system, tool, user, words
from tests.outside import chat_body
from tests.store.test_summaries_http import config as summarising_config
from tests.store.test_summaries_http import conversation

CTXPROXY = Path(sys.executable).parent / "ctxproxy"
REPORT_KEYS = {"tokens_before", "tokens_after", "window", "reserve", "margin", "hard_budget", "threshold",
               "turns_kept", "turns_summarised", "turns_dropped", "wm_rows_dropped", "repairs", "summary"}


def write_config(tmp_path: Path, **extra: Any) -> Path:
    raw: dict[str, Any] = {
        "upstreams": {"u": {"base_url": "http://127.0.0.1:9"}},
        "cache": {"backend": "memory"},
        "models": [{"name": "gpt-4o", "context_window": 4_000, "max_output_tokens": 1_000}],
        "trimmer": {"reserve_tokens": 256},
        **extra,
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw, allow_unicode=True))
    return path


def write_json(tmp_path: Path, body: Any, name: str = "request.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(body))
    return path


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def long_conversation(turns: int = 30) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [system("You are an airline agent.")]
    for t in range(turns):
        msgs += [user(f"q{t} " + words(40, t)), call((f"c{t}", "lookup")), tool(f"c{t}", words(80, t)),
                 assistant(f"a{t} " + words(30, t))]
    return [*msgs, user("final question")]


# --------------------------------------------------------------------------- validate


@pytest.mark.parametrize(
    ("context_manager", "path"),
    [
        (42, "context_manager"),
        ("bogus-manager", "context_manager"),
        ({"type": "stack", "params": {"bogus": 1}}, "context_manager.params.bogus"),
        ({"type": "summarising", "params": {"summarizer": "bogus"}}, "context_manager.params.summarizer"),
        ({"ref": "definitely_not_a_module:Plugin"}, "context_manager.ref"),
    ],
)
def test_validate_rejects_bad_bindings_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], context_manager: Any, path: str
) -> None:
    code, out, err = run(["validate", str(write_config(tmp_path, context_manager=context_manager))], capsys)
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert lines and lines[0].startswith(path), err
    assert any(line.startswith("context_manager") for line in lines)


@pytest.mark.parametrize(("extra", "path"), [
    ({"mode": "shadow"}, "mode"),
    ({"models": [{"name": "gpt-4o", "mode": "dry-run"}]}, "models[0].mode"),
    ({"tenants": [{"name": "team", "keys": ["sk-team"], "mode": "watch"}]}, "tenants[0].mode"),
])
def test_validate_refuses_a_mode_that_is_not_observe_or_enforce(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: dict[str, Any], path: str) -> None:
    code, out, err = run(["validate", str(write_config(tmp_path, **extra))], capsys)
    assert (code, out) == (2, "") and err.startswith(f"{path}:"), err
    good = {key: ([{**value[0], "mode": "observe"}] if isinstance(value, list) else "observe")
            for key, value in extra.items()}
    assert run(["validate", str(write_config(tmp_path, **good))], capsys)[:2] == (0, "ok\n")


def test_validate_reports_missing_env_var_with_key_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CTXPROXY_TEST_UNSET_VAR", raising=False)
    path = tmp_path / "c.yaml"
    path.write_text("upstreams:\n  u:\n    base_url: http://127.0.0.1:9\n    api_key: ${CTXPROXY_TEST_UNSET_VAR}\n"
                    "cache: {backend: memory}\n")
    code, _, err = run(["validate", str(path)], capsys)
    assert code == 2
    assert err.strip().startswith("upstreams.u.api_key:") and "CTXPROXY_TEST_UNSET_VAR" in err
    monkeypatch.setenv("CTXPROXY_TEST_UNSET_VAR", "sk-test")
    assert run(["validate", str(path)], capsys)[0] == 0


def test_validate_env_default_substitution(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CTXPROXY_TEST_CM", raising=False)
    path = tmp_path / "c.yaml"
    path.write_text("upstreams:\n  u:\n    base_url: http://127.0.0.1:9\ncache: {backend: memory}\n"
                    "context_manager: ${CTXPROXY_TEST_CM:-stack}\n")
    assert run(["validate", str(path)], capsys)[:2] == (0, "ok\n")
    monkeypatch.setenv("CTXPROXY_TEST_CM", "nonsense")
    code, _, err = run(["validate", str(path)], capsys)
    assert code == 2 and err.startswith("context_manager")


@pytest.mark.parametrize("text", ["upstreams: [unclosed", "- just\n- a list\n", ""])
def test_validate_rejects_unreadable_yaml(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    code, out, err = run(["validate", str(path)], capsys)
    assert code == 2 and out == "" and err.strip()


def test_validate_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["validate", str(tmp_path / "nope.yaml")], capsys)
    assert code == 2 and "nope.yaml" in err


UNWORKABLE = {
    "cache_url": ("upstreams: {u: {base_url: 'http://127.0.0.1:9'}}\ncache: {backend: redis, url: 'http://cache:6379'}\n",
                  "cache.url: "),
    "summarizer_model": ("upstreams: {u: {base_url: 'http://127.0.0.1:9'}}\ncache: {backend: memory}\n"
                         "models: [{name: big}]\nallow_unknown_models: false\nsummarizer_model: small\n",
                         "summarizer_model: 'small' is not a configured model"),
    "duplicate_key": ("upstreams: {u: {base_url: 'http://127.0.0.1:9'}}\ncache: {backend: memory}\n"
                      "tenants:\n  - name: t\n    keys: [k-1]\n    max_context_tokens: 1000\n"
                      "    max_context_tokens: 900000\n",
                      "tenants[0].max_context_tokens: written twice (lines 6 and 7)"),
}


@pytest.mark.parametrize("case", sorted(UNWORKABLE))
def test_validate_refuses_configs_that_load_but_cannot_work(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str) -> None:
    """Each used to pass validate: the server then died at start, or every summary failed, or a value was lost."""
    text, first = UNWORKABLE[case]
    path = tmp_path / "c.yaml"
    path.write_text(text)
    code, out, err = run(["validate", str(path)], capsys)
    assert (code, out) == (2, "") and err.startswith(first), err


def test_serve_and_report_refuse_a_cache_url_that_is_not_redis_in_one_line(tmp_path: Path) -> None:
    """They used to open the cache with it and die with redis-py's traceback (exit 1)."""
    path = tmp_path / "c.yaml"
    path.write_text(UNWORKABLE["cache_url"][0])
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    for argv in (["serve", "--config", str(path), "--port", "0"], ["report", "--config", str(path)]):
        done = subprocess.run([str(CTXPROXY), *argv], capture_output=True, text=True, env=env, timeout=60)
        assert done.returncode == 2, (argv, done.stderr)
        assert done.stderr.startswith("cache.url: ") and "Traceback" not in done.stderr, done.stderr
        assert len(done.stderr.splitlines()) == 1


def _shipped_env(path: Path) -> dict[str, str]:
    import re

    return {n: "test-value" for n in re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", path.read_text())}


@pytest.mark.parametrize("path", sorted((REPO / "config").glob("*.yaml")), ids=lambda p: p.name)
def test_validate_accepts_every_shipped_config(path: Path, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in _shipped_env(path).items():
        monkeypatch.setenv(name, value)
    code, out, err = run(["validate", str(path)], capsys)
    assert (code, out) == (0, "ok\n"), err


def test_validate_as_a_real_process(tmp_path: Path) -> None:
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    good = subprocess.run([str(CTXPROXY), "validate", str(REPO / "config" / "ctxproxy.yaml")],
                          capture_output=True, text=True, env=env, timeout=60)
    assert good.returncode == 0 and good.stdout == "ok\n", good.stderr
    bad = write_config(tmp_path, context_manager={"type": "stack", "params": {"bogus": 1}})
    out = subprocess.run([str(CTXPROXY), "validate", str(bad)], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().startswith("context_manager.params.bogus"), out.stderr
    assert "Traceback" not in out.stderr


# --------------------------------------------------------------------------- assemble


def test_assemble_prints_messages_and_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path, context_manager={"type": "summarising", "params": {"keep_turns": 3}})
    msgs = long_conversation()
    req = write_json(tmp_path, {"model": "gpt-4o", "messages": msgs, "tools": []})
    code, out, err = run(["assemble", "--offline", "--config", str(cfg), str(req)], capsys)
    assert code == 0, err
    result = json.loads(out)
    assert set(result) == {"messages", "report"}
    report = result["report"]
    assert set(report) >= REPORT_KEYS
    assert report["window"] == 4_000 and report["reserve"] == 256 and report["margin"] == 400
    assert report["hard_budget"] == 4_000 - 256 - 400
    assert report["threshold"] == int(report["hard_budget"] / 1.1)
    assert report["tokens_before"] == recount(msgs) > report["hard_budget"]
    assert report["tokens_after"] == recount(result["messages"]) <= report["hard_budget"]
    assert report["summary"] == "none"  # --offline: the llm summariser degrades to drop
    assert report["turns_dropped"] > 0 and report["turns_summarised"] == 0
    assert result["messages"][0] == msgs[0] and result["messages"][-1] == msgs[-1]
    assert not pairing_problems(result["messages"])


def test_assemble_in_observe_mode_shows_the_body_as_sent_and_what_enforce_would_send(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Under a policy in observe mode the client's body is what is forwarded: assemble prints it, with a report of
    what enforce would have done; ``--mode enforce`` prints what enforce would forward, with the same figures."""
    cfg = write_config(
        tmp_path, mode="observe", context_manager={"type": "sliding-window", "params": {"keep_turns": 3}}
    )
    msgs = long_conversation()
    req = write_json(tmp_path, {"model": "gpt-4o", "messages": msgs})
    outputs = []
    for extra in ([], ["--mode", "enforce"], ["--mode", "observe"]):
        code, out, err = run(["assemble", "--config", str(cfg), *extra, str(req)], capsys)
        assert code == 0, err
        outputs.append(json.loads(out))
    observed, enforced, asked = outputs
    assert observed == asked
    assert observed["messages"] == msgs and observed["report"]["mode"] == "observe"
    assert enforced["report"]["mode"] == "enforce" and len(enforced["messages"]) < len(msgs)
    assert observed["report"]["tokens_before"] == recount(msgs) > observed["report"]["hard_budget"]
    assert observed["report"]["tokens_after"] == enforced["report"]["tokens_after"] == recount(enforced["messages"])
    with pytest.raises(SystemExit) as refused:
        main(["assemble", "--config", str(cfg), "--mode", "shadow", str(req)])
    assert refused.value.code == 2 and "--mode: invalid choice: 'shadow'" in capsys.readouterr().err


@pytest.mark.parametrize("wire", ["chat", "responses", "messages"])
def test_assemble_shows_what_observation_masking_masked(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        wire: str) -> None:
    """The report lists every masked output (call id, tool, tokens removed); the forwarded body carries the
    placeholders in their place, on every wire."""
    from tests.wire.messages_helpers import from_chat
    from tests.wire.responses_helpers import chat_to_responses

    cfg = write_config(tmp_path, context_manager={"type": "mask-observations", "params": {"keep_recent": 3,
                                                                                          "mask_step": 2}})
    msgs = long_conversation(20)
    body: dict[str, Any] = {"model": "gpt-4o", "messages": msgs}
    if wire == "responses":
        body = {"model": "gpt-4o", "input": chat_to_responses(msgs)}
    elif wire == "messages":
        system_prompt, converted = from_chat(msgs)
        body = {"model": "gpt-4o", "max_tokens": 256, "system": system_prompt, "messages": converted}
    req = write_json(tmp_path, body)
    code, out, err = run(["assemble", "--wire", wire, "--config", str(cfg), str(req)], capsys)
    assert code == 0, err
    result = json.loads(out)
    report = result["report"]
    assert report["context_manager"] == "observation-masking" and report["wire"] == wire
    masked = report["masked"]
    assert masked and [m["call_id"] for m in masked] == [f"c{t}" for t in range(len(masked))] and len(masked) % 2 == 0
    assert {m["tool"] for m in masked} == {"lookup"} and all(m["tokens_removed"] > 0 for m in masked)
    assert report["removed"]["masked"] == sum(m["tokens_removed"] for m in masked)
    text = json.dumps(result)
    assert text.count("ctxproxy removed this lookup output") == len(masked)


def test_assemble_unchanged_request_round_trips(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path)
    msgs = [system("s", cache_control={"type": "ephemeral"}), user("hi Zürich 🚀", name="alice")]
    req = write_json(tmp_path, {"model": "gpt-4o", "messages": msgs})
    code, out, _ = run(["assemble", "--offline", "--config", str(cfg), str(req)], capsys)
    assert code == 0
    result = json.loads(out)
    assert result["messages"] == msgs
    assert result["report"]["repairs"] == {} and result["report"]["tokens_before"] == result["report"]["tokens_after"]


def test_assemble_reports_repairs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path)
    msgs = [user("q"), tool("ghost", "orphan"), call(("c1", "f")), user("next")]
    req = write_json(tmp_path, {"model": "gpt-4o", "messages": msgs})
    code, out, _ = run(["assemble", "--offline", "--config", str(cfg), str(req)], capsys)
    assert code == 0
    result = json.loads(out)
    assert result["report"]["repairs"] == {"orphan_result": 1, "unanswered_calls": 1, "empty_assistant": 1}
    assert result["messages"] == [msgs[0], msgs[3]]


def test_assemble_refusal_is_an_openai_error_with_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path)
    req = write_json(tmp_path, {"model": "gpt-4o", "messages": [system(words(5_000)), user("hi")]})
    code, out, _ = run(["assemble", "--offline", "--config", str(cfg), str(req)], capsys)
    assert code == 1
    body = json.loads(out)
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == "context_length_exceeded"
    assert body["error"]["type"] == "invalid_request_error"
    assert str(3_344) in body["error"]["message"]


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"model": "gpt-4o", "messages": []}, "empty_messages"),
        ({"model": "gpt-4o", "messages": [{"role": "wizard", "content": "x"}]}, "invalid_role"),
        ({"messages": [{"role": "user", "content": "x"}]}, "missing_model"),
    ],
)
def test_assemble_invalid_request_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str], body: Any,
                                         code: str) -> None:
    cfg = write_config(tmp_path)
    rc, out, _ = run(["assemble", "--offline", "--config", str(cfg), str(write_json(tmp_path, body))], capsys)
    assert rc == 1
    assert json.loads(out)["error"]["code"] == code


def test_assemble_not_json_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path)
    req = tmp_path / "r.json"
    req.write_text("{not json")
    rc, out, _ = run(["assemble", "--offline", "--config", str(cfg), str(req)], capsys)
    assert rc == 1 and json.loads(out)["error"]["code"] == "invalid_json"


def test_assemble_reads_stdin(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                              monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = write_config(tmp_path, context_manager="stack")
    msgs = long_conversation()
    raw = json.dumps({"model": "gpt-4o", "messages": msgs}).encode()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(raw)))
    code, out, err = run(["assemble", "--offline", "--config", str(cfg), "-"], capsys)
    assert code == 0, err
    result = json.loads(out)
    assert result["report"]["tokens_after"] <= result["report"]["hard_budget"] < result["report"]["tokens_before"]
    assert result["messages"][-1] == msgs[-1]


def test_assemble_bad_config_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path, context_manager=42)
    req = write_json(tmp_path, {"model": "gpt-4o", "messages": [user("x")]})
    code, out, err = run(["assemble", "--offline", "--config", str(cfg), str(req)], capsys)
    assert code == 2 and out == "" and err.startswith("context_manager")


def test_assemble_missing_request_file_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["assemble", "--offline", "--config", str(write_config(tmp_path)), str(tmp_path / "x.json")],
                       capsys)
    assert code == 2 and "x.json" in err


def test_assemble_as_a_real_process_from_stdin(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, context_manager={"type": "sliding-window", "params": {"keep_turns": 2}})
    msgs = long_conversation()
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    proc = subprocess.run([str(CTXPROXY), "assemble", "--offline", "--config", str(cfg), "-"],
                          input=json.dumps({"model": "gpt-4o", "messages": msgs}), capture_output=True, text=True,
                          env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert set(result["report"]) >= REPORT_KEYS
    assert result["report"]["turns_dropped"] >= 28
    users = [m for m in result["messages"] if m["role"] == "user"]
    assert len(users) <= 3 and users[-1] == msgs[-1]
    refused = subprocess.run([str(CTXPROXY), "assemble", "--offline", "--config", str(cfg), "-"],
                             input=json.dumps({"model": "gpt-4o", "messages": [user(words(6_000))]}),
                             capture_output=True, text=True, env=env, timeout=60)
    assert refused.returncode == 1
    assert json.loads(refused.stdout)["error"]["code"] == "context_length_exceeded"


# --------------------------------------------------------------------------- assemble: which wire


RESPONSES_INPUT: list[dict[str, Any]] = [
    {"role": "user", "content": "read it"},
    {"type": "function_call", "call_id": "c1", "name": "read", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c1", "output": "text"},
    {"role": "user", "content": "and now?"}]


@pytest.mark.parametrize("named", [[], ["--wire", "responses"]])
def test_assemble_reads_a_responses_body_as_responses_without_wire(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], named: list[str]) -> None:
    """Without --wire it answered "'messages' must be an array" (exit 1): the default was chat."""
    cfg = write_config(tmp_path)
    req = write_json(tmp_path, {"model": "gpt-4o", "input": RESPONSES_INPUT})
    code, out, err = run(["assemble", "--offline", "--config", str(cfg), *named, str(req)], capsys)
    assert code == 0, out + err
    result = json.loads(out)
    assert set(result) == {"input", "report"} and result["input"] == RESPONSES_INPUT
    assert result["report"]["wire"] == "responses"


def test_assemble_without_wire_reads_any_other_body_as_chat(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path)
    req = write_json(tmp_path, {"model": "gpt-4o", "messages": [user("hi")], "input": "also here"})
    code, out, _ = run(["assemble", "--offline", "--config", str(cfg), str(req)], capsys)
    assert code == 0 and json.loads(out)["report"]["wire"] == "chat"
    code, out, _ = run(["assemble", "--offline", "--config", str(cfg), "--wire", "chat",
                        str(write_json(tmp_path, {"model": "gpt-4o", "input": RESPONSES_INPUT}))], capsys)
    assert code == 1 and json.loads(out)["error"]["param"] == "messages"  # a named wire wins over the body


# ------------------------------------------------------------------- assemble --wire messages: context_management


def test_assemble_messages_applies_the_emulated_context_management(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """It showed the tool results uncleared, while the server forwards them cleared (an upstream without the beta)."""
    cfg = write_config(tmp_path, upstreams={"u": {"base_url": "http://127.0.0.1:9", "api": "anthropic",
                                                  "context_management": "emulate"}},
                       models=[{"name": "claude-sonnet-4-5", "context_window": 200_000, "max_output_tokens": 8192}],
                       context_manager={"type": "stack"})
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "Fix it."}]
    for i in range(4):
        msgs += [{"role": "assistant", "content": [{"type": "tool_use", "id": f"t{i}", "name": "Read", "input": {}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{i}",
                                               "content": words(300, i)}]}]
    edit = {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 500},
            "keep": {"type": "tool_uses", "value": 1}}
    req = write_json(tmp_path, {"model": "claude-sonnet-4-5", "max_tokens": 64, "messages": msgs,
                                "context_management": {"edits": [edit]}})
    code, out, err = run(["assemble", "--offline", "--config", str(cfg), "--wire", "messages", str(req)], capsys)
    assert code == 0, out + err
    result = json.loads(out)
    results = [m["content"][0]["content"] for m in result["messages"] if m["role"] == "user"
               and isinstance(m["content"], list)]
    assert results[3] == words(300, 3) and all(r != words(300, i) for i, r in enumerate(results[:3]))
    emulation = result["report"]["context_management"]
    assert emulation["emulated"] is True and emulation["applied_edits"][0]["cleared_tool_uses"] == 3


@pytest.mark.usefixtures("shared_model_map")
async def test_assemble_cli_never_calls_the_summariser(upstream: FakeUpstream, tmp_path: Path) -> None:
    """`ctxproxy assemble` (no --offline) prints the assembly without calling any provider."""
    cfg = summarising_config(upstream.base_url)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    (tmp_path / "request.json").write_text(json.dumps(chat_body(conversation(40))))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy.cli", "assemble", "--config", str(tmp_path / "config.yaml"),
        str(tmp_path / "request.json"), cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env=dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True"))
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert set(json.loads(out)) >= {"messages", "report"}
    assert upstream.summaries == [] and upstream.chat == []


@pytest.mark.usefixtures("shared_model_map")
async def test_assemble_cli_summarizes_only_when_asked(upstream: FakeUpstream, tmp_path: Path) -> None:
    """`ctxproxy assemble --summarize` makes (and bills) the summary, nothing else."""
    cfg = summarising_config(upstream.base_url)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    (tmp_path / "request.json").write_text(json.dumps(chat_body(conversation(40))))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy.cli", "assemble", "--config", str(tmp_path / "config.yaml"), "--summarize",
        str(tmp_path / "request.json"), cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env=dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True"))
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert json.loads(out)["report"]["summary"] == "created"
    assert len(upstream.summaries) >= 1 and upstream.chat == []  # the summariser called; the request never sent
