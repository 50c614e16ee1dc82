"""proxy.wire.chat: the Chat Completions adapter (parse, render, summary, the two pairing edits, atoms).

Repair/check on chat messages is in tests/wire/test_chat_pairing.py and token counts against
tiktoken in tests/wire/test_chat_tokens.py; this module covers the adapter's own contract.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.core import media
from proxy.core.errors import BadRequest, PayloadError
from proxy.core.items import ASSISTANT, OTHER, SYSTEM, TOOL, USER, atom_digests, canonical_arguments
from proxy.core.pairing import PLACEHOLDER, is_paired
from proxy.core.tokens import REPLY_PRIMING, TokenCounter
from proxy.wire.chat import WIRE
from proxy.wire.chat.items import LEGACY, count_message
from tests import media_files as mf
from tests.conftest import StartProxy, base_config
from tests.fake_upstream import FakeUpstream
from tests.helpers import assistant, call, conversations, legacy_call, legacy_result, system, tool, user
from tests.outside import chat_body, post, text_of
from tests.wire.chat_helpers import check_messages, count, items_of, repair_messages, scan

Message = dict[str, Any]


@pytest.fixture(scope="module")
def counter() -> TokenCounter:
    return TokenCounter("o200k_base")


# --------------------------------------------------------------------------- parse


def test_parse_makes_one_item_per_message_with_its_own_json(counter: TokenCounter) -> None:
    messages = [system("Be brief."), {"role": "developer", "content": "Use metric units."}, user("Weather in Oslo?"),
                call(("call_1", "get_weather", '{"city":"Oslo"}')), tool("call_1", "4°C"), assistant("4°C in Oslo.")]
    body = {"model": "gpt-4o", "messages": messages}
    conv = WIRE.parse(body, counter)
    assert [i.role for i in conv.items] == [SYSTEM, SYSTEM, USER, ASSISTANT, TOOL, ASSISTANT]
    assert all(i.raw is m for i, m in zip(conv.items, messages))
    assert [i.source for i in conv.items] == list(range(6))
    assert conv.items[3].call_ids == ("call_1",)
    assert conv.items[4].result_id == "call_1"
    assert conv.paired is True
    assert [i.tokens for i in conv.items] == [count_message(counter, m) for m in messages]
    assert all(i.key for i in conv.items)
    assert conv.fixed_tokens == REPLY_PRIMING
    assert conv.notes == []


def test_parse_counts_tool_and_function_schemas_as_fixed(counter: TokenCounter) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    functions = [{"name": "lookup", "parameters": {"type": "object"}}]
    conv = WIRE.parse({"messages": [user("hi")], "tools": tools, "functions": functions}, counter)
    assert conv.fixed_tokens == REPLY_PRIMING + counter.tools(tools) + counter.tools(functions)


@pytest.mark.parametrize(("messages", "paired"), [
    ([user("a"), call(("c1", "f")), tool("c1")], True),
    ([user("a"), call(("c1", "f")), user("b"), tool("c1")], False),
    ([user("a"), tool("c9")], False),
    ([user("a"), call(("c1", "f"), ("c1", "f")), tool("c1")], False),  # one id twice in a message
    ([user("a"), legacy_call("lookup"), legacy_result("lookup")], True),  # legacy: checked on items
    ([user("a"), legacy_call("lookup"), legacy_result("other")], False),
])
def test_parse_reports_pairing(counter: TokenCounter, messages: list[Message], paired: bool) -> None:
    assert WIRE.parse({"messages": messages}, counter).paired is paired


def test_parse_never_mutates_the_body(counter: TokenCounter) -> None:
    body = {"model": "m", "messages": [user("a"), call(("c1", "f")), tool("c1", "x")], "tools": [{"a": 1}]}
    before = copy.deepcopy(body)
    WIRE.parse(body, counter)
    assert body == before


@pytest.mark.parametrize(("messages", "code"), [
    (None, "invalid_messages"),
    ({}, "invalid_messages"),
    ([], "empty_messages"),
    (["hi"], "invalid_message"),
    ([{"role": "robot", "content": "x"}], "invalid_role"),
    ([{"role": ["user"], "content": "x"}], "invalid_role"),
    ([{"role": "user"}], "missing_content"),
    ([{"role": "user", "content": 5}], "invalid_content"),
    ([{"role": "user", "content": [{"text": "no type"}]}], "invalid_content"),
    ([{"role": "tool", "content": "x"}], "missing_tool_call_id"),
    ([{"role": "function", "content": "x"}], "missing_tool_call_id"),
    ([{"role": "assistant", "tool_calls": {"id": "c"}}], "invalid_tool_call"),
    ([{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}], "invalid_tool_call"),
    ([{"role": "assistant", "tool_calls": [{"id": "", "type": "function", "function": {"name": "f"}}]}],
     "invalid_tool_call"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "type": "custom", "custom": {}}]}], "invalid_tool_call"),
    ([{"role": "assistant", "function_call": {"arguments": "{}"}}], "invalid_tool_call"),
])
def test_parse_refuses_malformed_messages(counter: TokenCounter, messages: Any, code: str) -> None:
    with pytest.raises(PayloadError) as err:
        WIRE.parse({"messages": messages}, counter)
    assert err.value.code == code
    assert err.value.status == 400


@pytest.mark.parametrize("tool_call", [
    {"id": "call_fn", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}},
    {"id": "call_custom", "type": "custom", "custom": {"name": "apply_patch", "input": "*** Begin Patch"}},
    {"id": "ws_1", "type": "web_search", "web_search": {"query": "oslo"}},  # an unknown type with an id
    {"id": "x_2", "type": "mcp"},
])
def test_every_tool_call_type_pairs_by_id(counter: TokenCounter, tool_call: dict[str, Any]) -> None:
    messages = [user("go"), {"role": "assistant", "content": None, "tool_calls": [tool_call]},
                tool(tool_call["id"], "done")]
    conv = WIRE.parse({"messages": messages}, counter)
    assert conv.items[1].call_ids == (tool_call["id"],)
    assert conv.paired is True
    check_messages(messages)


def test_legacy_function_call_pairs_by_name_in_its_own_namespace(counter: TokenCounter) -> None:
    messages = [user("go"), legacy_call("lookup"), legacy_result("lookup")]
    items = WIRE.parse({"messages": messages}, counter).items
    assert items[1].call_ids == (LEGACY + "lookup",)
    assert items[2].result_id == LEGACY + "lookup"
    assert is_paired(items)


def test_a_legacy_call_answered_by_a_tool_message_with_its_name_is_not_paired(counter: TokenCounter) -> None:
    messages = [user("go"), legacy_call("lookup"), tool("lookup", "result")]
    items = WIRE.parse({"messages": messages}, counter).items
    assert items[2].result_id == "lookup"
    assert not is_paired(items)
    repaired, repairs = repair_messages(messages)
    assert dict(repairs) == {"orphan_result": 1, "unanswered_calls": 1, "empty_assistant": 1}
    assert repaired == [user("go")]


def test_a_tool_call_answered_by_a_function_message_is_not_paired(counter: TokenCounter) -> None:
    messages = [user("go"), call(("lookup", "lookup")), legacy_result("lookup")]
    assert not is_paired(WIRE.parse({"messages": messages}, counter).items)


@pytest.mark.parametrize("message", [
    {"role": "tool", "tool_call_id": 7, "content": "x"},
    {"role": "function", "name": None, "content": "x"},
])
def test_a_result_without_a_string_id_is_an_other_item(message: Message) -> None:
    assert items_of([message])[0].role == OTHER


# --------------------------------------------------------------------------- render, count, summary


def test_render_forwards_kept_messages_as_the_same_objects(counter: TokenCounter) -> None:
    messages = [system("s"), user("a", cache_control={"type": "ephemeral"}), assistant("b", x_unknown=[1]), user("c")]
    body = {"model": "gpt-4o", "messages": messages, "temperature": 0.2, "x_vendor": {"k": 1}}
    items = WIRE.parse(body, counter).items
    out = WIRE.render(body, [items[0], items[3]], {"max_tokens": 100, "model": "upstream-name"})
    assert out["messages"][0] is messages[0] and out["messages"][1] is messages[3]
    assert out["temperature"] == 0.2 and out["x_vendor"] == {"k": 1}
    assert out["max_tokens"] == 100 and out["model"] == "upstream-name"
    assert body["messages"] is messages and len(messages) == 4 and "max_tokens" not in body
    assert orjson.dumps(out["messages"][1]) == orjson.dumps(messages[3])


def test_count_sets_key_and_tokens(counter: TokenCounter) -> None:
    item = items_of([user("hello there")])[0]
    assert (item.key, item.tokens) == (0, 0)
    WIRE.count(item, counter)
    assert item.key != 0
    assert item.tokens == count_message(counter, item.raw) == count(counter, item.raw)
    counted = items_of([user("hello there")], counter)[0]
    assert (counted.key, counted.tokens) == (item.key, item.tokens)


def test_summary_is_a_counted_system_message(counter: TokenCounter) -> None:
    item = WIRE.summary("- the user booked HAT001", 4, counter)
    assert item.raw == {"role": "system", "content": "- the user booked HAT001"}
    assert item.role == SYSTEM
    assert item.tokens == count_message(counter, item.raw) > 0
    assert item.key != 0


# --------------------------------------------------------------------------- the two pairing edits


@pytest.mark.parametrize(("message", "kept"), [
    (call(("c1", "f"), content="Let me check."), {"role": "assistant", "content": "Let me check."}),
    ({**call(("c1", "f")), "refusal": "I can't do that."}, {"role": "assistant", "content": None,
                                                           "refusal": "I can't do that."}),
    ({**call(("c1", "f")), "audio": {"id": "audio_1"}}, {"role": "assistant", "content": None,
                                                       "audio": {"id": "audio_1"}}),
    ({**call(("c1", "f"), content=[{"type": "text", "text": "x"}]), "name": "bot"},
     {"role": "assistant", "content": [{"type": "text", "text": "x"}], "name": "bot"}),
    ({**legacy_call("lookup"), "content": "Looking it up."}, {"role": "assistant", "content": "Looking it up."}),
    (call(("c1", "f")), None),
    (call(("c1", "f"), content="   \n"), None),
    (call(("c1", "f"), content=[]), None),
    ({**call(("c1", "f")), "refusal": ""}, None),
    (legacy_call("lookup"), None),
])
def test_without_calls(message: Message, kept: Message | None) -> None:
    item = items_of([user("u"), message])[1]
    before = copy.deepcopy(message)
    out = WIRE.without_calls(item)
    assert message == before
    if kept is None:
        assert out is None
    else:
        assert out is not None
        assert out.raw == kept
        assert out.role == ASSISTANT and out.call_ids == () and out.source == 1


def test_placeholders_answer_in_the_calls_own_form() -> None:
    items = items_of([user("u"), call(("call_7", "f"))])
    p = WIRE.placeholder(items[1], "call_7")
    assert p is not None
    assert p.raw == {"role": "tool", "tool_call_id": "call_7", "content": PLACEHOLDER}
    assert (p.role, p.result_id, p.source) == (TOOL, "call_7", 1)
    legacy = items_of([user("u"), legacy_call("lookup")])
    q = WIRE.placeholder(legacy[1], LEGACY + "lookup")
    assert q is not None
    assert q.raw == {"role": "function", "name": "lookup", "content": PLACEHOLDER}
    assert q.result_id == LEGACY + "lookup"


@pytest.mark.parametrize("result", [
    tool("call_7", "4°C in Oslo " * 50, name="get_weather", cache_control={"type": "ephemeral"}),
    {"role": "tool", "tool_call_id": "call_7", "content": [
        {"type": "text", "text": "chart:"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + mf.b64(mf.png(800, 600))}}]},
])
def test_mask_replaces_only_the_content_of_a_tool_message(counter: TokenCounter, result: Message) -> None:
    """Observation masking: the result keeps its tool_call_id and every other key; only its content (text,
    images and all) becomes the placeholder text; the client's message is never edited in place."""
    items = items_of([user("u"), call(("call_7", "get_weather")), result], counter)
    before = copy.deepcopy(result)
    masked = WIRE.mask(items[2], "[masked]", counter)
    assert masked is not None and result == before
    assert masked.raw == {**result, "content": "[masked]"}
    assert (masked.role, masked.result_id, masked.source) == (TOOL, "call_7", 2)
    assert masked.tokens == count_message(counter, masked.raw) and masked.key and masked.key != items[2].key
    assert is_paired([*items[:2], masked])
    check_messages([items[0].raw, items[1].raw, masked.raw])


def test_mask_of_a_legacy_function_result_keeps_its_name(counter: TokenCounter) -> None:
    items = items_of([user("u"), legacy_call("lookup"), legacy_result("lookup", "a long answer " * 40)], counter)
    masked = WIRE.mask(items[2], "[masked]", counter)
    assert masked is not None
    assert masked.raw == {"role": "function", "name": "lookup", "content": "[masked]"}
    assert masked.result_id == LEGACY + "lookup"


@pytest.mark.parametrize("index", [0, 1])
def test_mask_leaves_calls_and_messages_alone(counter: TokenCounter, index: int) -> None:
    items = items_of([user("u"), call(("call_7", "get_weather"))], counter)
    assert WIRE.mask(items[index], "[masked]", counter) is None


@pytest.mark.parametrize(("model", "field"), [
    ("gpt-4o", "max_tokens"), ("gpt-4o-mini", "max_tokens"), ("o1", "max_completion_tokens"),
    ("o3-mini", "max_completion_tokens"), ("o4-mini-2025-04-16", "max_completion_tokens"),
    ("gpt-5", "max_completion_tokens"), ("azure/gpt-5-nano", "max_completion_tokens"),
    ("openai/o1-preview", "max_completion_tokens"), ("claude-3-5-sonnet", "max_tokens"),
])
def test_output_field(model: str, field: str) -> None:
    assert WIRE.output_field(model) == field
    assert field in WIRE.output_fields


def test_adapter_constants() -> None:
    assert (WIRE.name, WIRE.field, WIRE.paths, WIRE.upstream_path("gpt-4o")) == (
        "chat", "messages", ("/chat/completions",), "/chat/completions")
    error = BadRequest("no")
    assert WIRE.error_body(error) == error.to_openai()  # OpenAI's shape
    assert WIRE.merge_call_runs is False
    assert WIRE.output_fields == ("max_completion_tokens", "max_tokens")
    assert WIRE.stream_end.name == "chat"


# --------------------------------------------------------------------------- canonical arguments and atoms


@pytest.mark.parametrize(("arguments", "canonical"), [
    ('{"b": 1, "a": [1, 2]}', '{"a":[1,2],"b":1}'),
    ('{"a":[1,2],"b":1}', '{"a":[1,2],"b":1}'),
    ({"b": 1, "a": [1, 2]}, '{"a":[1,2],"b":1}'),  # an object (Anthropic/Responses input) equals its JSON text
    ("not json {", "not json {"),
    ("", ""),
    ("  {\"x\": \"Zürich\"}  ", '{"x":"Zürich"}'),
    (None, "null"),
    ("null", "null"),
    (["a"], '["a"]'),
    ('"a string"', '"a string"'),
])
def test_canonical_arguments(arguments: Any, canonical: str) -> None:
    assert canonical_arguments(arguments) == canonical


def test_canonical_arguments_of_something_json_cannot_hold() -> None:
    assert canonical_arguments({"x": {1}}) == repr({"x": {1}})


@given(st.dictionaries(st.text(max_size=5), st.one_of(st.integers(-(2**63), 2**63 - 1), st.text(max_size=5),
                                                    st.booleans()), max_size=5))
def test_canonical_arguments_ignore_key_order_and_spacing(args: dict[str, Any]) -> None:
    reordered = dict(reversed(list(args.items())))
    assert canonical_arguments(json.dumps(args, indent=2)) == canonical_arguments(json.dumps(reordered)) \
        == canonical_arguments(args)


def atoms(message: Message, *context: Message) -> list[tuple[str, ...]]:
    return list(items_of([*context, message])[-1].atoms())


@pytest.mark.parametrize(("a", "b"), [
    (user("Book HAT001"), {"role": "user", "content": [{"type": "text", "text": "Book HAT001"}]}),
    (user("line 1\nline 2"), {"role": "user", "content": [{"type": "text", "text": "line 1"},
                                                          {"type": "text", "text": "line 2"}]}),
    (tool("c1", "ok"), {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "ok"}]}),
    (user("hi"), user("hi", name="alice", cache_control={"type": "ephemeral"})),  # not meaning: same atoms
    (call(("c1", "f", '{"a": 1, "b": 2}')), call(("c1", "f", '{"b":2,"a":1}'))),
    (call(("c1", "f")), {**call(("c1", "f")), "content": ""}),
    (system("be brief"), {"role": "developer", "content": "be brief"}),
])
def test_the_same_meaning_gives_the_same_atoms(a: Message, b: Message) -> None:
    assert atoms(a) == atoms(b)
    assert atom_digests(items_of([a])[0]) == atom_digests(items_of([b])[0])


@pytest.mark.parametrize(("a", "b"), [
    (user("Book HAT001"), user("Book HAT002")),
    (user("x"), assistant("x")),
    (call(("c1", "f", '{"a":1}')), call(("c1", "f", '{"a":2}'))),
    (call(("c1", "f")), call(("c2", "f"))),
    (call(("c1", "f")), call(("c1", "g"))),
    (tool("c1", "ok"), tool("c2", "ok")),
    (user("x"), {"role": "user", "content": [{"type": "text", "text": "x"},
                                             {"type": "image_url", "image_url": {"url": "https://a/cat.png"}}]}),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://a/cat.png"}}]},
     {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://a/dog.png"}}]}),
    (assistant(None), {"role": "assistant", "content": None, "refusal": "No."}),
])
def test_different_meanings_give_different_atoms(a: Message, b: Message) -> None:
    assert atoms(a) != atoms(b)


def test_atoms_of_each_kind() -> None:
    custom = {"role": "assistant", "content": "Patching.", "tool_calls": [
        {"id": "cu_1", "type": "custom", "custom": {"name": "apply_patch", "input": "*** Begin"}},
        {"id": "ws_1", "type": "web_search"},
        {"id": "fn_1", "type": "function", "function": {"name": "f", "arguments": '{"z":0,"a":1}'}}]}
    assert atoms(custom) == [("text", ASSISTANT, "Patching."), ("call", "cu_1", "apply_patch", "*** Begin"),
                             ("call", "ws_1", "web_search", "null"), ("call", "fn_1", "f", '{"a":1,"z":0}')]
    assert atoms(legacy_call("lookup", '{"q": 1}')) == [("call", LEGACY + "lookup", "lookup", '{"q":1}')]
    assert atoms(legacy_result("lookup", "found")) == [("result", LEGACY + "lookup", "found")]
    assert atoms(tool("c1", "")) == [("result", "c1", "")]
    assert atoms(assistant(None)) == []
    refusal = {"role": "assistant", "content": None, "refusal": "I can't help with that."}
    assert atoms(refusal) == [("text", "refusal", "I can't help with that.")]


def test_media_atoms_digest_the_reference_not_the_envelope() -> None:
    png = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAAB"
    a = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}",
                                                                        "detail": "low"}}]}
    b = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"data:image/webp;base64,{png}"}}]}
    assert atoms(a) == atoms(b)
    assert atoms(a)[0][0:2] == ("media", USER)
    audio = {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}]}
    file_by_id = {"role": "user", "content": [{"type": "file", "file": {"file_id": "file-abc"}}]}
    file_by_data = {
        "role": "user",
        "content": [{"type": "file", "file": {"filename": "a.pdf", "file_data": "data:application/pdf;base64,JVBE"}}],
    }
    kinds = {atoms(m)[0][2] for m in (a, audio, file_by_id, file_by_data)}
    assert len(kinds) == 4


# --------------------------------------------------------------------------- describe (what the summariser reads)


@pytest.mark.parametrize(("message", "text"), [
    (user("Weather in Oslo?"), "USER: Weather in Oslo?"),
    ({"role": "developer", "content": "Be brief."}, "DEVELOPER: Be brief."),
    (call(("call_1", "get_weather", '{"city": "Oslo"}'), content="Checking."),
     'ASSISTANT: Checking.\nTOOL CALL call_1 get_weather({"city": "Oslo"})'),
    (tool("call_1", "4°C"), "TOOL RESULT call_1: 4°C"),
    (legacy_call("lookup", '{"q":1}'), 'TOOL CALL  lookup({"q":1})'),
    (legacy_result("lookup", "found"), "TOOL RESULT lookup: found"),
    ({"role": "assistant", "content": None, "refusal": "No."}, "REFUSAL: No."),
    ({"role": "assistant", "content": None, "audio": {"id": "a1", "transcript": "Hello there"}},
     "ASSISTANT: [audio: Hello there]"),
    ({"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                  {"type": "image_url", "image_url": {"url": "https://x/cat.png", "detail": "odd"}},
                                  {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "mp3"}},
                                  {"type": "file", "file": {"filename": "report.pdf", "file_data": "JVBE"}},
                                  {"type": "file", "file": {"file_id": "file-1"}},
                                  {"type": "mystery"}]},
     "USER: What is this? [image] [audio] [file report.pdf] [file] [mystery]"),
    ({"role": "tool", "tool_call_id": "c2", "content": [{"type": "image_url", "image_url": {"url": "u"}}]},
     "TOOL RESULT c2: [image]"),
    ({"role": "assistant", "content": None, "tool_calls": [
        {"id": "cu_1", "type": "custom", "custom": {"name": "apply_patch", "input": "*** Begin"}}]},
     "TOOL CALL cu_1 apply_patch(*** Begin)"),
])
def test_describe(message: Message, text: str) -> None:
    assert items_of([message])[0].describe() == text


# --------------------------------------------------------------------------- the per-message formula


def test_count_message_formula(counter: TokenCounter) -> None:
    t = counter.text
    assert count_message(counter, user("hello")) == 3 + t("user") + t("hello")
    assert count_message(counter, user("hello", name="alice")) == 3 + t("user") + t("hello") + t("alice") + 1
    c = call(("call_1", "get_weather", '{"city":"Oslo"}'))
    assert count_message(counter, c) == 3 + t("assistant") + 3 + t("get_weather") + t('{"city":"Oslo"}')
    assert count_message(counter, legacy_call("lookup", "{}")) == 3 + t("assistant") + t("lookup") + t("{}")
    custom = {"role": "assistant", "tool_calls": [{"id": "c", "type": "custom",
                                                   "custom": {"name": "apply_patch", "input": "diff"}}]}
    assert count_message(counter, custom) == 3 + t("assistant") + 3 + t("apply_patch") + t("diff")
    unknown = {"role": "assistant", "tool_calls": [{"id": "w", "type": "web_search"}]}
    assert count_message(counter, unknown) == 3 + t("assistant") + 3 + counter.json(unknown["tool_calls"][0])
    spoken = {"role": "assistant", "content": None, "audio": {"id": "a", "transcript": "Hello"}}
    assert count_message(counter, spoken) == 3 + t("assistant") + t("Hello")


@pytest.mark.parametrize(("part", "tokens"), [
    ({"type": "image_url", "image_url": {"url": "https://x/cat.png"}}, media.IMAGE_TOKENS),
    ({"type": "image_url", "image_url": {"url": "https://x/cat.png", "detail": "low"}}, media.IMAGE_TOKENS_LOW),
    ({"type": "image_url", "image_url": {"url": "https://x/cat.png", "detail": "ultra"}}, media.IMAGE_TOKENS),
    ({"type": "image_url", "image_url": "https://x/cat.png"}, media.IMAGE_TOKENS),
    ({"type": "input_audio", "input_audio": {"data": "A" * 21_334, "format": "mp3"}}, 10),
    ({"type": "file", "file": {"file_id": "file-abc"}}, media.FILE_UNKNOWN_TOKENS),
    ({"type": "file", "file": {"filename": "a.pdf", "file_data": "A" * 40_000}}, media.FILE_PAGE_TOKENS),
    ({"type": "file", "file": "file-abc"}, media.FILE_UNKNOWN_TOKENS),
])
def test_media_parts_are_billed_estimates_not_base64(counter: TokenCounter, part: dict[str, Any], tokens: int) -> None:
    message = {"role": "user", "content": [part]}
    assert count_message(counter, message) == 3 + counter.text("user") + tokens


PAGES = [mf.prose(120, i) for i in range(5)]
PDF = mf.b64(mf.pdf(PAGES))


@pytest.mark.parametrize(("part", "tokens"), [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64," + mf.b64(mf.png(1, 1))}}, 85 + 170),
    ({"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + mf.b64(mf.jpeg(2048, 4096))}},
     85 + 170 * 6),
    ({"type": "image_url", "image_url": {"url": "data:image/gif;base64," + mf.b64(mf.gif(4000, 3000)),
                                         "detail": "low"}}, 85),
    ({"type": "file", "file": {"filename": "r.pdf", "file_data": "data:application/pdf;base64," + PDF}},
     "pdf"),
])
def test_images_count_by_their_size_and_pdfs_by_their_pages(
        counter: TokenCounter, part: dict[str, Any], tokens: int | str) -> None:
    """OpenAI's formulas: an image's 512-px tiles after scaling; a PDF's text plus a 765-token image per page."""
    expected = counter.text("\n".join(PAGES) + "\n") + 5 * 765 if tokens == "pdf" else int(tokens)
    message = {"role": "user", "content": [part]}
    assert count_message(counter, message) == 3 + counter.text("user") + expected


def test_malformed_audio_part_is_counted_as_its_json(counter: TokenCounter) -> None:
    part = {"type": "input_audio", "input_audio": "not an object"}
    assert count_message(counter, {"role": "user", "content": [part]}) == 3 + counter.text("user") + counter.json(part)


def test_scan_agrees_with_is_paired_on_legacy_mixes() -> None:
    mixes = [
        [user("a"), legacy_call("f"), legacy_result("f"), call(("c1", "g")), tool("c1")],
        [user("a"), call(("c1", "g")), legacy_result("g")],
        [user("a"), legacy_call("f"), tool("fn:f")],
    ]
    for messages in mixes:
        assert scan(messages) == is_paired(items_of(messages))


CUSTOM_CALL: Message = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "custom", "custom": {"name": "code_exec", "input": "print(1)"}}]}


@pytest.mark.usefixtures("shared_model_map")
async def test_custom_tool_call_is_accepted_and_forwarded(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """A GPT-5 custom tool call with its result is forwarded unchanged."""
    proxy = await start_proxy(base_config(upstream.base_url))
    messages = [{"role": "user", "content": "Run print(1)."}, CUSTOM_CALL,
                {"role": "tool", "tool_call_id": "call_1", "content": "1"}]
    status, _headers, body = await post(proxy, chat_body(messages, "gpt-4o-mini"))
    assert status == 200, body
    assert upstream.chat[-1].body["messages"] == messages


@pytest.mark.usefixtures("shared_model_map")
async def test_custom_tool_call_inputs_are_counted_and_paired(upstream: FakeUpstream, start_proxy: StartProxy
                                                              ) -> None:
    """A custom call's input counts as tokens, and an unanswered custom call is repaired like any call."""
    proxy = await start_proxy(base_config(upstream.base_url))
    big_input = text_of(3000, seed=6)
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_big", "type": "custom", "custom": {"name": "code_exec", "input": big_input}}]}
    answered = [{"role": "user", "content": "Run it."}, call,
                {"role": "tool", "tool_call_id": "call_big", "content": "done"}]
    status, headers, body = await post(proxy, chat_body(answered, "gpt-4o-mini"))
    assert status == 200, body
    assert int(headers["x-ctxproxy-tokens-in"]) >= 3000
    unanswered = [{"role": "user", "content": "Run it."}, CUSTOM_CALL, {"role": "user", "content": "Never mind."}]
    status, headers, body = await post(proxy, chat_body(unanswered, "gpt-4o-mini"))
    assert status == 200, body
    assert int(headers["x-ctxproxy-repairs"]) >= 1
    forwarded = upstream.chat[-1].body["messages"]
    assert not any(m.get("tool_calls") for m in forwarded)  # a call without a result never reaches a provider


MODEL = "gpt-4o-mini"


def error_of(payload: Any) -> dict[str, Any]:
    assert isinstance(payload, dict) and set(payload) == {"error"}, payload
    error = payload["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    return dict(error)


@pytest.mark.usefixtures("shared_model_map")
@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "Weather?"}, legacy_call("get_weather"),
     {"role": "tool", "tool_call_id": "\u0000fn:get_weather", "content": "sunny"},
     {"role": "user", "content": "Thanks."}],
    [{"role": "user", "content": "Weather?"},
     {"role": "assistant", "content": None, "tool_calls": [
         {"id": "\u0000fn:get_weather", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
     {"role": "function", "name": "get_weather", "content": "sunny"},
     {"role": "user", "content": "Thanks."}],
    [{"role": "user", "content": "Run it."},
     {"role": "assistant", "content": None, "tool_calls": [
         {"id": "\u0000x", "type": "custom", "custom": {"name": "code_exec", "input": "print(1)"}}]},
     {"role": "tool", "tool_call_id": "\u0000x", "content": "1"}],
], ids=["tool-result-for-a-legacy-call", "legacy-result-for-a-tool-call", "custom-call"])
async def test_ids_in_the_legacy_namespace_are_refused(upstream: FakeUpstream, start_proxy: StartProxy,
                                                       messages: list[Message]) -> None:
    """A NUL-prefixed id could pair a tool result with a legacy function_call: refused, never forwarded."""
    proxy = await start_proxy(base_config(upstream.base_url))
    for stream in (False, True):
        status, _headers, body = await post(proxy, {"model": MODEL, "messages": messages, "stream": stream})
        assert status == 400, body
        assert error_of(body)["code"] == "invalid_tool_call"
    assert upstream.chat == []


# --------------------------------------------------------------------------- resume (a warm request)

RESUME_EDITS = ("append", "same", "edit_middle", "truncate", "reorder", "other_tenant")


def _parsed(conversation: Any, messages: list[Message]) -> Any:
    """Everything a parse gives, with each item's JSON compared by identity to the request's own message (and the
    tokens in all a resumed parse gives, checked against its items')."""
    assert conversation.tokens is None or conversation.tokens == sum(i.tokens for i in conversation.items)
    return ([(type(i).__name__, i.role, i.call_ids, i.result_id, i.source, i.pinned, i.key, i.tokens,
              i.raw is messages[i.source]) for i in conversation.items],
            conversation.fixed_tokens, conversation.paired, dict(conversation.repairs), conversation.notes)


def _outcome(parse: Any, messages: list[Message]) -> Any:
    try:
        return _parsed(parse({"model": "gpt-4o-mini", "messages": messages}), messages)
    except PayloadError as exc:
        return ("refused", exc.message, exc.param)


@settings(max_examples=200, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(conversations(), conversations(max_turns=2), st.sampled_from(RESUME_EDITS), st.data())
def test_resume_gives_what_parse_gives_after_any_edit(first: list[Message], more: list[Message], edit: str,
                                                      data: st.DataObject) -> None:
    """A request of a conversation its tenant sent before is parsed from where that one ended: whatever the client
    did in between (appended, resent, edited the middle, truncated, reordered, or another tenant sent it), the
    items, counts, pairing and the identity of every item's JSON with the request's own are what a full parse gives."""
    counter = TokenCounter("o200k_base")
    earlier = copy.deepcopy(first)
    later = copy.deepcopy(first)
    if edit == "append":
        later += copy.deepcopy(more)
    elif edit == "edit_middle" and later:
        i = data.draw(st.integers(0, len(later) - 1))
        later[i] = {**later[i], "name": "edited"}
        later += copy.deepcopy(more)
    elif edit == "truncate" and later:
        later = later[: data.draw(st.integers(0, len(later) - 1))]
    elif edit == "reorder" and len(later) > 1:
        i, j = data.draw(st.integers(0, len(later) - 1)), data.draw(st.integers(0, len(later) - 1))
        later[i], later[j] = later[j], later[i]
    _outcome(lambda body: WIRE.resume(body, counter, "t"), earlier)
    tenant = "u" if edit == "other_tenant" else "t"
    warm = _outcome(lambda body: WIRE.resume(body, counter, tenant), later)
    cold = _outcome(lambda body: WIRE.parse(body, TokenCounter("o200k_base")), later)
    assert warm == cold


def test_resume_parses_only_what_a_growing_conversation_appends(counter: TokenCounter) -> None:
    """The items of the known prefix are the earlier request's (not built, scanned or counted again), each with this
    request's JSON; only the appended messages get new items."""
    base = [system(), user("Read the file."), call(("c1", "read_file")), tool("c1", "contents " * 50)]
    grown = [*copy.deepcopy(base), assistant("Done."), user("Next."), call(("c2", "read_file")), tool("c2")]
    first = WIRE.resume({"model": "m", "messages": copy.deepcopy(base)}, counter, "t")
    second = WIRE.resume({"model": "m", "messages": grown}, counter, "t")
    assert all(a is b for a, b in zip(second.items[:4], first.items))
    assert all(item.raw is message for item, message in zip(second.items, grown))
    assert not any(item is old for item in second.items[4:] for old in first.items)
    assert _parsed(second, grown) == _parsed(WIRE.parse({"model": "m", "messages": grown}, counter), grown)
    third = WIRE.resume({"model": "m", "messages": copy.deepcopy(grown)}, counter, "other")
    assert not any(a is b for a, b in zip(third.items, second.items))  # another tenant: its own parse
