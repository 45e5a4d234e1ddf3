"""The JSON-call tool syntax: the name inside the invocation's JSON object, "}" as its close.

Its invocation close is a character JSON arguments contain, so the engine finds the end of the
arguments object by counting braces outside strings (syntax/json_extent.py). These cases feed
arguments with nested objects, braces inside strings and escaped quotes under every chunking.
"""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from helios_proto import contract_pb2 as pb

from helios_backend.syntax.events import collect
from helios_backend.syntax.json_extent import JsonExtent
from helios_backend.syntax.prompt_state import InitialState, ReasoningStart
from tests.syntax_cases import J, PLAIN_ID, canonical_events, engine, feed_random_deltas, model, parse, stream

NONE = pb.REASONING_PARSER_NONE
START = InitialState(ReasoningStart.MAY_OPEN)


def call(name: str, arguments: object) -> str:
    return '<tool_call>\n{"name": ' + json.dumps(name) + ', "arguments": ' + json.dumps(arguments) + "}\n</tool_call>"


TRICKY = {"city": "Pa}ris {\"x\"} \\", "days": 3, "options": {"a": {"b": [1, {"c": "}}"}]}}}


# spec: FE-3, FE-24, FE-40
def test_arguments_holding_braces_parse_back_under_every_chunking():
    ms = model(J, NONE)
    pieces = stream("Let me check. ", call("get_weather", TRICKY))
    modes = canonical_events(ms, pieces, START)
    first = next(iter(modes.values()))
    assert all(events == first for events in modes.values())
    out = parse(ms, pieces, START)
    assert out.content == "Let me check. " and out.errors == []
    [parsed] = out.tool_calls
    assert (parsed.name, json.loads(parsed.arguments), parsed.complete) == ("get_weather", TRICKY, True)


# spec: FE-40
@settings(max_examples=60, deadline=None)
@given(arguments=st.dictionaries(st.sampled_from(["city", "days", "options"]),
                                 st.recursive(st.text(alphabet='{}[]"\\ ab\n', max_size=6) | st.integers(),
                                              lambda inner: st.lists(inner, max_size=3)
                                              | st.dictionaries(st.text("xy}", max_size=2), inner, max_size=2),
                                              max_leaves=6)),
       seed=st.integers(0, 2**20))
def test_any_arguments_object_parses_back_under_random_chunking(arguments: dict, seed: int) -> None:
    ms = model(J, NONE)
    pieces = [(PLAIN_ID, call("get_weather", arguments) + "\n" + call("get_time", {}))]
    out = collect(feed_random_deltas(engine(ms, START), pieces, [], seed))
    assert out.errors == []
    assert [(c.name, json.loads(c.arguments), c.complete) for c in out.tool_calls] == [
        ("get_weather", arguments, True), ("get_time", {}, True)]


def test_junk_after_the_arguments_object_is_an_invalid_call_not_a_lost_one():
    ms = model(J, NONE)
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}, "extra": 1}\n</tool_call>'
    out = parse(ms, stream(text), START)
    [parsed] = out.tool_calls
    assert parsed.name == "get_weather" and not parsed.complete
    assert [e.kind.name for e in out.errors] == ["INVALID_ARGUMENTS"]


def test_unregistered_name_leaves_the_block_as_content():
    ms = model(J, NONE)
    out = parse(ms, stream(call("launch", {"x": 1})), START)
    assert out.tool_calls == [] and "launch" in out.content
    assert [e.kind.name for e in out.errors] == ["UNKNOWN_TOOL"]


@pytest.mark.parametrize("text, closes_at", [('{"a": "}"}', 10), ('{"a": {"b": 1}} }', 15), ('[1]}', 0),
                                             ('  {"a": "\\"}"} x', 14), ('{"a": 1', None)])
def test_extent_finds_where_the_object_closes(text: str, closes_at: int | None):
    assert JsonExtent().end_search_start(text) == closes_at
    scan = JsonExtent()
    scan.advance(text[:4])   # state carries across pieces
    assert scan.end_search_start(text[4:]) == (closes_at if closes_at in (None, 0) else closes_at - 4)


def test_a_model_without_tool_syntax_refuses_forced_calls():
    from helios_backend.syntax.grammar import (ConstraintRequest, InvalidToolChoiceError, ToolChoiceMode,
                                                        ToolSpec, build_request_grammar)

    request = ConstraintRequest(tools=(ToolSpec("get_time"),), tool_choice=ToolChoiceMode.REQUIRED)
    with pytest.raises(InvalidToolChoiceError, match="declares no tool syntax"):
        build_request_grammar(model(pb.TOOL_PARSER_NONE, NONE), START, request)


# ---- fenced calls (ToolSyntax.fence_open / fence_close) ---------------------------------------
FENCED = '```json\n{\n  "name": "get_weather",\n  "arguments": {"city": "Pa}ris"}\n}\n```'   # pretty-printed, as models write it


# spec: FE-40
@pytest.mark.parametrize("before, after, content, calls", [
    ("", "", "", 1),
    ("Let me look that up.\n", "\nOne moment.", "Let me look that up.\nOne moment.", 1),
    ("", "\n" + call("get_time", {}), "", 2),                  # a declared block may follow
])
def test_a_fenced_json_call_is_a_call_under_every_chunking(before: str, after: str, content: str, calls: int) -> None:
    ms = model(J, NONE)
    pieces = stream(before, FENCED, after)
    modes = canonical_events(ms, pieces, START)
    first = next(iter(modes.values()))
    assert all(events == first for events in modes.values())
    out = parse(ms, pieces, START)
    assert out.errors == [] and out.content == content and len(out.tool_calls) == calls
    assert (out.tool_calls[0].name, json.loads(out.tool_calls[0].arguments), out.tool_calls[0].complete) == (
        "get_weather", {"city": "Pa}ris"}, True)


# spec: FE-40
@pytest.mark.parametrize("text", [
    '```json\n{"a": 1}\n```',                                               # JSON that is no call
    '```json\n{"name": "launch", "arguments": {}}\n```',                    # a tool the request did not register
    '```json\n{"name": "get_weather", "arguments": {"city": "x"}, "id": 3}\n```',   # another member
    '```json\n{"name": "get_weather", "arguments": "city"}\n```',           # arguments not an object
    '```python\nprint({"name": "get_weather"})\n```',                       # another language
    '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}\n```',  # unbalanced
    '```json\n{"name": "get_weather", "arguments": {',                      # cut by the output limit
])
def test_a_fence_holding_anything_else_is_answer_text(text: str) -> None:
    ms = model(J, NONE)
    pieces = stream("Here:\n", text, "\nBye.")
    out = parse(ms, pieces, START)
    assert out.tool_calls == [] and out.errors == [] and out.content == "Here:\n" + text + "\nBye."
    modes = canonical_events(ms, pieces, START)
    first = next(iter(modes.values()))
    assert all(events == first for events in modes.values())


def test_fences_are_answer_text_without_tools_and_in_structured_answers() -> None:
    ms = model(J, NONE)
    text = '```json\n{"name": "get_weather", "arguments": {}}\n```'
    assert parse(ms, stream(text), START, tools={}).content == text
    structured = collect(engine(ms, START, structured=True).feed(PLAIN_ID, text))
    assert structured.tool_calls == [] and structured.content == text


def test_fence_fields_are_declared_together_with_json_object_arguments() -> None:
    from helios_backend.syntax.tables import preset
    from helios_backend.syntax.validate import frontend_problems

    syntax = preset(J, NONE)
    assert frontend_problems(syntax) == []
    syntax.tool.fence_close = ""
    assert "tool_syntax.fence_open and .fence_close are declared together" in frontend_problems(syntax)
    tagged = preset(pb.TOOL_PARSER_QWEN_CODER_FUNCTION_TAGS, NONE)
    tagged.tool.fence_open, tagged.tool.fence_close = "```json", "```"
    assert any("fence_open needs JSON-object arguments" in p for p in frontend_problems(tagged))
