"""bench/retention_engines.py: the two deterministic summariser engines."""

from __future__ import annotations

from bench.retention_engines import GENERIC, LINE_HEAD, ExtractiveEngine, GenericEngine, extract


async def test_the_generic_engine_always_answers_the_same_text_and_counts_its_calls() -> None:
    engine = GenericEngine()
    for _ in range(2):
        out = await engine.complete("m", [{"role": "user", "content": "New turns:\nUSER: book HAT136"}],
                                    max_tokens=100, timeout=1, purpose="summarize")
        assert out.text == GENERIC and "HAT136" not in out.text
    assert engine.calls == 2 and engine.prompt_tokens > 0


def test_the_extractive_engine_keeps_the_head_of_every_line_previous_summary_first() -> None:
    body = "Previous summary:\nUSER: book HAT136\n\nNew turns:\nTOOL RESULT c1: " + "x" * 400 + "\nASSISTANT: done"
    text = extract(body, 10_000)
    lines = text.splitlines()
    assert lines[0] == "USER: book HAT136"
    assert lines[1].startswith("TOOL RESULT c1: xxx") and len(lines[1]) == LINE_HEAD + 1
    assert lines[2] == "ASSISTANT: done"


def test_over_its_limit_the_extractive_engine_keeps_the_newest_lines() -> None:
    body = "New turns:\n" + "\n".join(f"line {i:03d}" for i in range(100))
    text = extract(body, 100)
    assert len(text) <= 100 and text.endswith("line 099") and "line 000" not in text


async def test_the_extractive_engine_answers_within_max_tokens() -> None:
    engine = ExtractiveEngine()
    body = "New turns:\n" + "\n".join(f"TOOL RESULT c{i}: {'y' * 300}" for i in range(200))
    out = await engine.complete("m", [{"role": "user", "content": body}], max_tokens=50, timeout=1, purpose="s")
    assert len(out.text) <= 150 and engine.calls == 1
