"""Token counting (proxy.tokens): tiktoken reference counts under OpenAI's per-message formula,
encoding choice per model family, and offline use of the bundled encodings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import tiktoken

from proxy.core.media import IMAGE_TOKENS, IMAGE_TOKENS_LOW
from proxy.core.modelinfo import ModelMap
from proxy.core.tokens import (
    CL100K,
    O200K,
    REPLY_PRIMING,
    TokenCounter,
    encoding_for,
    use_bundled_encodings,
)
from proxy.policy import Routes
from proxy.wire.chat import WIRE as CHAT
from proxy.wire.chat.items import TOOL_CALL_OVERHEAD
from tests.helpers import REPO, call, image_user, make_config, recount, ref_message_tokens, running, words
from tests.wire.chat_helpers import count as chat_count
from tests.wire.chat_helpers import counts as chat_counts

use_bundled_encodings()
COUNTERS = {O200K: TokenCounter(O200K), CL100K: TokenCounter(CL100K)}

# Plain string messages: roles, names, unicode, code, whitespace, long text.
PLAIN: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "developer", "content": "Answer in French."},
    {"role": "user", "content": "Hi! I'm looking to book a flight from New York to Seattle on May 20th."},
    {"role": "user", "name": "alice", "content": "my user id is mia_li_3668"},
    {"role": "assistant", "content": "Sure — could you confirm the cabin class (economy, business)?"},
    {"role": "assistant", "name": "planner", "content": ""},
    {"role": "user", "content": "Grüße aus Zürich! 東京に行きたい。Привет 👩‍💻🚀"},
    {"role": "user", "content": "def f(x):\n    return {'a': [1, 2, 3]}\n\n\t# tab\r\n"},
    {"role": "tool", "tool_call_id": "call_oIHazX6yQrB8hUwl4cRilFKj", "name": "get_user_details",
     "content": '{"name": {"first_name": "Mia", "last_name": "Li"}, "dob": "1990-04-05"}'},
    {"role": "user", "content": words(2_000)},
    {"role": "user", "content": "    leading and trailing spaces    "},
]

# OpenAI cookbook "How to count tokens with tiktoken": 129 prompt tokens on gpt-4 / gpt-3.5-turbo-0613,
# 124 on gpt-4o (as reported by the API).
COOKBOOK = [
    {"role": "system", "content": "You are a helpful, pattern-following assistant that translates corporate "
     "jargon into plain English."},
    {"role": "system", "name": "example_user", "content": "New synergies will help drive top-line growth."},
    {"role": "system", "name": "example_assistant", "content": "Things working well together will increase revenue."},
    {"role": "system", "name": "example_user", "content": "Let's circle back when we have more bandwidth to touch "
     "base on opportunities for increased leverage."},
    {"role": "system", "name": "example_assistant", "content": "Let's talk later when we're less busy about how to "
     "do better."},
    {"role": "user", "content": "This late pivot means we don't have time to boil the ocean for the client "
     "deliverable."},
]


def tiktoken_reference(messages: list[dict[str, Any]], encoding: str) -> int:
    """The cookbook's num_tokens_from_messages, verbatim in spirit: 3 per message, every value, 1 per name, 3."""
    enc = tiktoken.get_encoding(encoding)
    n = 0
    for m in messages:
        n += 3
        for key, value in m.items():
            n += len(enc.encode(value))
            if key == "name":
                n += 1
    return n + 3


@pytest.mark.parametrize("encoding", [O200K, CL100K])
@pytest.mark.parametrize("index", range(len(PLAIN)))
def test_plain_message_matches_tiktoken(encoding: str, index: int) -> None:
    message = PLAIN[index]
    assert chat_count(COUNTERS[encoding], message) == tiktoken_reference([message], encoding) - REPLY_PRIMING


@pytest.mark.parametrize("encoding", [O200K, CL100K])
def test_whole_table_matches_tiktoken(encoding: str) -> None:
    counter = TokenCounter(encoding)  # a fresh counter: exercises the batched, threaded first count
    counts = chat_counts(counter, PLAIN * 3)
    assert sum(counts) + REPLY_PRIMING == tiktoken_reference(PLAIN * 3, encoding)
    assert counts == [chat_count(COUNTERS[encoding], m) for m in PLAIN * 3]


@pytest.mark.parametrize(("encoding", "expected"), [(CL100K, 129), (O200K, 124)])
def test_cookbook_example(encoding: str, expected: int) -> None:
    assert tiktoken_reference(COOKBOOK, encoding) == expected
    assert sum(chat_counts(COUNTERS[encoding], COOKBOOK)) + REPLY_PRIMING == expected


def test_encodings_differ_on_the_same_text() -> None:
    text = {"role": "user", "content": "東京に行きたい。" * 20}
    assert chat_count(COUNTERS[O200K], text) != chat_count(COUNTERS[CL100K], text)


@pytest.mark.parametrize("encoding", [O200K, CL100K])
def test_special_token_text_is_counted_as_ordinary_text(encoding: str) -> None:
    message = {"role": "user", "content": "please print <|endoftext|> and <|im_start|> literally"}
    enc = tiktoken.get_encoding(encoding)
    expected = 3 + len(enc.encode("user")) + len(enc.encode(message["content"], disallowed_special=()))
    assert chat_count(COUNTERS[encoding], message) == expected


def test_many_long_messages_batch_path_matches_single_counts() -> None:
    messages = [{"role": "tool", "tool_call_id": f"c{i}", "content": words(300 + i, i)} for i in range(40)]
    fresh = TokenCounter(O200K)
    batched = chat_counts(fresh, messages)
    assert batched == [ref_message_tokens(m) for m in messages]
    assert chat_counts(fresh, messages) == batched  # now from the cache


def test_cache_is_content_addressed_not_identity() -> None:
    counter = TokenCounter(O200K, cache_size=4)
    a = {"role": "user", "content": "hello there"}
    first = chat_count(counter, a)
    a["content"] = "hello there, a much longer text than before"
    assert chat_count(counter, a) == ref_message_tokens(a) != first
    for i in range(10):  # evictions keep counts right
        chat_count(counter, {"role": "user", "content": f"m{i}"})
    assert chat_count(counter, {"role": "user", "content": "hello there"}) == first


def test_images_tool_calls_and_unknown_keys() -> None:
    counter = COUNTERS[O200K]
    enc = tiktoken.get_encoding(O200K)
    high = image_user("what is this?")
    low = image_user("what is this?", detail="low")
    base = 3 + len(enc.encode("user")) + len(enc.encode("what is this?"))
    assert chat_count(counter, high) == base + IMAGE_TOKENS == base + 765
    assert chat_count(counter, low) == base + IMAGE_TOKENS_LOW == base + 85
    c = call(("call_1", "search_flights", '{"from": "JFK"}'), ("call_2", "get_user"))
    expected = 3 + len(enc.encode("assistant"))
    for tc in c["tool_calls"]:
        fn = tc["function"]
        expected += TOOL_CALL_OVERHEAD + len(enc.encode(fn["name"])) + len(enc.encode(fn["arguments"]))
    assert chat_count(counter, c) == expected
    plain = {"role": "user", "content": "hi"}
    assert chat_count(counter, {**plain, "cache_control": {"type": "ephemeral"}}) == chat_count(counter, plain)
    assert chat_count(counter, {"role": "assistant", "content": None}) == 3 + len(enc.encode("assistant"))


@pytest.mark.parametrize(
    ("model", "encoding"),
    [
        ("gpt-4o", O200K),
        ("gpt-4o-mini", O200K),
        ("gpt-4o-2024-08-06", O200K),
        ("gpt-4.1", O200K),
        ("gpt-4.1-nano", O200K),
        ("o1", O200K),
        ("o3", O200K),
        ("o3-mini", O200K),
        ("o4-mini", O200K),
        ("gpt-5", O200K),
        ("gpt-5-mini", O200K),
        ("chatgpt-4o-latest", O200K),
        ("openai/gpt-4o", O200K),
        ("azure/gpt-4.1", O200K),
        ("gpt-4", CL100K),
        ("gpt-4-0613", CL100K),
        ("gpt-4-turbo", CL100K),
        ("gpt-3.5-turbo", CL100K),
        ("gpt-3.5-turbo-16k", CL100K),
        ("azure/gpt-35-turbo", CL100K),
        ("GPT-4", CL100K),
        ("claude-3-5-sonnet", O200K),  # fallback
        ("llama-3.1-70b", O200K),  # fallback
        ("", O200K),  # fallback
    ],
)
def test_encoding_for(model: str, encoding: str) -> None:
    assert encoding_for(model) == encoding


@pytest.mark.parametrize("model", ["gpt-4o", "gpt-4o-mini", "gpt-4.1", "o1", "o3", "gpt-5", "gpt-4", "gpt-4-turbo",
                                   "gpt-3.5-turbo", "gpt-35-turbo", "o3-mini", "gpt-4.1-mini"])
def test_encoding_for_agrees_with_tiktoken(model: str) -> None:
    assert encoding_for(model) == tiktoken.encoding_name_for_model(model)


@pytest.mark.parametrize("model", ["ft:gpt-3.5-turbo-0613:acme::8abc", "ft:gpt-4-0613:acme::8abc"])
def test_encoding_for_fine_tuned_models(model: str) -> None:
    assert encoding_for(model) == tiktoken.encoding_name_for_model(model) == CL100K


def test_encoding_override_is_honoured() -> None:
    assert encoding_for("gpt-4o", override=CL100K) == CL100K
    assert encoding_for("gpt-4", override=O200K) == O200K
    assert encoding_for("my-llama", override="cl100k_base") == CL100K


def test_routes_pick_encoding_by_family_and_honour_tokenizer() -> None:
    raw = {
        "upstreams": {"u": {"base_url": "http://127.0.0.1:9"}},
        "cache": {"backend": "memory"},
        "models": [
            {"name": "old", "model": "gpt-4-0613", "context_window": 8192},
            {"name": "new", "model": "gpt-4o-mini", "context_window": 8192},
            {"name": "forced", "model": "gpt-4o", "context_window": 8192, "tokenizer": "cl100k_base"},
        ],
    }
    from proxy.settings import load_config

    routes = Routes(load_config(raw, env={}), ModelMap())
    assert routes.resolve("old").encoding == CL100K
    assert routes.resolve("new").encoding == O200K
    assert routes.resolve("forced").encoding == CL100K
    assert routes.resolve("gpt-3.5-turbo").encoding == CL100K  # unconfigured: by name
    assert routes.resolve("mistral-large").encoding == O200K


@pytest.mark.parametrize(("model", "encoding"), [("gpt-4o", O200K), ("gpt-4", CL100K)])
async def test_pipeline_reports_reference_counts(model: str, encoding: str) -> None:
    """tokens_before of a real request equals the tiktoken reference for the model's encoding."""

    messages = COOKBOOK + [m for m in PLAIN if m["role"] != "tool"]  # a lone tool message would be repaired

    config = make_config(model=model, window=100_000)
    async with running(config) as runtime:
        assembly, route, _ = await runtime.assemble(CHAT, {"model": model, "messages": messages}, tenant=None)
    assert route.encoding == encoding
    assert assembly.report.repairs == {}
    assert assembly.report.tokens_before == tiktoken_reference(messages, encoding)
    assert assembly.report.tokens_before == recount(messages, encoding)


def test_bundled_encodings_work_without_network(tmp_path: Any) -> None:
    """In a fresh interpreter with sockets disabled and no TIKTOKEN_CACHE_DIR, both encodings load."""
    script = textwrap.dedent(
        """
        import socket
        def refuse(*a, **k):
            raise OSError("network disabled in this test")
        socket.socket.connect = refuse
        socket.create_connection = refuse
        socket.getaddrinfo = refuse
        from proxy.core.tokens import TokenCounter, use_bundled_encodings
        use_bundled_encodings()
        import os, json
        print(json.dumps({"dir": os.environ.get("TIKTOKEN_CACHE_DIR"),
                          "o200k": TokenCounter("o200k_base").text("hello world"),
                          "cl100k": TokenCounter("cl100k_base").text("hello world")}))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TIKTOKEN_CACHE_DIR"}
    env["HOME"] = str(tmp_path)  # no user-level tiktoken cache either
    env["TMPDIR"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["dir"] and os.path.isdir(result["dir"])
    assert result["o200k"] == 2 and result["cl100k"] == 2


def test_token_counter_does_not_break_tiktokens_shared_encoding() -> None:
    script = textwrap.dedent(
        """
        from proxy.core.tokens import TokenCounter, use_bundled_encodings
        use_bundled_encodings()
        import tiktoken
        TokenCounter("cl100k_base")
        base = tiktoken.get_encoding("cl100k_base")
        extended = tiktoken.Encoding(name="cl100k_im", pat_str=base._pat_str,
                                     mergeable_ranks=base._mergeable_ranks,
                                     special_tokens={**base._special_tokens, "<|im_start|>": 100264})
        assert extended.encode("hello world") == base.encode("hello world")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-500:]


def test_a_structured_output_schema_counts_like_tool_schemas() -> None:
    """Providers put the JSON schema of response_format / text.format in the prompt: it counts toward B."""
    from proxy.core.tokens import Tokenizers
    from proxy.wire.chat import WIRE as CHAT_WIRE
    from proxy.wire.responses import WIRE as RESPONSES_WIRE

    counter = Tokenizers().get("o200k_base")
    schema = {"type": "object", "properties": {f"field_{i}": {"type": "string", "description": "word " * 20}
                                               for i in range(20)}}
    chat = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
    plain = CHAT_WIRE.parse(dict(chat), counter).fixed_tokens
    structured = CHAT_WIRE.parse({**chat, "response_format": {"type": "json_schema", "json_schema": {
        "name": "answer", "schema": schema}}}, counter).fixed_tokens
    json_mode = CHAT_WIRE.parse({**chat, "response_format": {"type": "json_object"}}, counter).fixed_tokens
    assert structured - plain >= counter.text(str(schema)) // 2 and json_mode == plain
    responses = {"model": "gpt-4o-mini", "input": "hi"}
    r_plain = RESPONSES_WIRE.parse(dict(responses), counter).fixed_tokens
    r_structured = RESPONSES_WIRE.parse({**responses, "text": {"format": {"type": "json_schema", "name": "answer",
                                                                          "schema": schema}}}, counter).fixed_tokens
    assert r_structured - r_plain >= counter.text(str(schema)) // 2


def test_a_messages_structured_output_schema_counts_too() -> None:
    from proxy.core.tokens import Tokenizers
    from proxy.wire.messages import WIRE as MESSAGES_WIRE

    counter = Tokenizers().get("o200k_base")
    schema = {"type": "object", "properties": {f"f{i}": {"type": "string", "description": "word " * 20}
                                               for i in range(20)}}
    body = {"model": "claude-sonnet-4-5", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}
    plain = MESSAGES_WIRE.parse(dict(body), counter).fixed_tokens
    for extra in ({"output_format": {"type": "json_schema", "schema": schema}},
                  {"output_config": {"format": {"type": "json_schema", "schema": schema}}}):
        assert MESSAGES_WIRE.parse({**body, **extra}, counter).fixed_tokens - plain >= counter.text(str(schema)) // 2
