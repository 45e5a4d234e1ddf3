"""The streaming syntax engine with hand-written streams, per syntax, including malformed and
truncated output. Every test feeds token by token; test_syntax_streaming checks the other modes."""

from __future__ import annotations

import json

import pytest

from helios_backend.syntax.events import (
    ContentDelta,
    ParseErrorKind,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
    coalesce,
)
from helios_backend.syntax.prompt_state import InitialState, ReasoningStart
from tests.syntax_cases import (
    A, D, FRAMES, G, Q, THINK, X, XTHINK, engine, feed_by_token, model, parse, stream, tok,
)

OPEN = InitialState(ReasoningStart.OPEN)
CLOSED = InitialState(ReasoningStart.CLOSED)
QWEN = model(Q, THINK)


def kinds(out):
    return [e.kind for e in out.errors]


# ---- think tags -------------------------------------------------------------------------------
def test_close_token_ends_reasoning_once():
    # spec: FE-10
    out = parse(QWEN, stream(tok("<think>"), "\nweigh it\n", tok("</think>"), "\n\nThe answer."))
    assert out.reasoning == "weigh it"
    assert out.content == "The answer."
    assert out.errors == []


def test_later_close_token_is_markup_and_dropped():
    # spec: FE-11
    out = parse(QWEN, stream(tok("<think>"), "a", tok("</think>"), "b", tok("</think>"), "c"))
    assert (out.reasoning, out.content) == ("a", "bc")


def test_plain_text_spelling_of_an_atomic_delimiter_stays_text():
    # spec: FE-9, FE-12
    out = parse(QWEN, stream(tok("<think>"), "I could write </think> here", tok("</think>"), "then </think> too"))
    assert out.reasoning == "I could write </think> here"
    assert out.content == "then </think> too"


def test_textual_delimiters_match_as_text_when_the_tokenizer_has_no_such_token():
    # spec: FE-9
    plain = model(Q, THINK, atoms={})
    out = parse(plain, stream("<think>", "\nhm\n</th", "ink>\nok"))
    assert (out.reasoning, out.content) == ("hm", "ok")


def test_prompt_opened_reasoning_starts_inside_reasoning():
    # spec: FE-14
    out = parse(QWEN, stream("thinking", tok("</think>"), "done"), initial=OPEN)
    assert (out.reasoning, out.content) == ("thinking", "done")


def test_closed_prompt_reasoning_leaves_open_tag_as_markup():
    # spec: FE-11, FE-14
    out = parse(QWEN, stream(tok("<think>"), "x"), initial=CLOSED)
    assert (out.reasoning, out.content) == ("", "x")


def test_unterminated_reasoning_is_kept_and_reported():
    out = parse(QWEN, stream(tok("<think>"), "still thinking"))
    assert out.reasoning == "still thinking"
    assert kinds(out) == [ParseErrorKind.UNTERMINATED_REASONING]


QWEN_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=options>\n{\"units\": \"metric\"}\n</parameter>\n</function>\n</tool_call>"
)


def test_qwen_coder_function_tags_with_think_reasoning():
    # spec: FE-3, FE-25
    out = parse(QWEN, stream(tok("<think>"), "\nneed weather\n", tok("</think>"), "\n\n", QWEN_CALL))
    assert out.reasoning == "need weather"
    assert out.content == ""
    [call] = out.tool_calls
    assert call.name == "get_weather" and call.complete
    assert json.loads(call.arguments) == {"city": "Paris", "days": 3, "options": {"units": "metric"}}


def test_tool_call_events_stream_with_a_stable_id():
    # spec: FE-40
    e = engine(QWEN, CLOSED)
    events = []
    for piece in ["<tool_call>\n<function=get_weather>\n<parameter=city>\nPa", "ri", "s\n</parameter>\n</function>\n</tool_call>"]:
        events.append(e.feed(7, piece))
    events.append(e.finish())
    assert isinstance(events[0][0], ToolCallStart) and events[0][0].call_id == "call_0"
    fragments = [ev.fragment for batch in events for ev in batch if isinstance(ev, ToolCallArgumentsDelta)]
    assert len(fragments) >= 3, "arguments stream as they arrive"
    assert json.loads("".join(fragments)) == {"city": "Paris"}
    ids = {ev.index for batch in events for ev in batch if isinstance(ev, (ToolCallArgumentsDelta, ToolCallEnd))}
    assert ids == {0}


def test_parallel_calls_get_distinct_ordered_ids():
    # spec: FE-40
    second = "<tool_call>\n<function=get_time>\n</function>\n</tool_call>"
    out = parse(QWEN, stream(QWEN_CALL, "\n", second), initial=CLOSED)
    assert [(c.call_id, c.name) for c in out.tool_calls] == [("call_0", "get_weather"), ("call_1", "get_time")]
    assert json.loads(out.tool_calls[1].arguments) == {}


def test_terminal_marker_ends_reasoning_and_opens_the_tool_block():
    # spec: FE-8
    out = parse(QWEN, stream(tok("<think>"), "\ncall it\n", QWEN_CALL))
    assert out.reasoning == "call it"
    assert [c.name for c in out.tool_calls] == ["get_weather"]


def test_content_before_a_tool_call_is_content():
    out = parse(QWEN, stream("Let me check.\n", QWEN_CALL), initial=CLOSED)
    assert out.content == "Let me check.\n"
    assert len(out.tool_calls) == 1


def test_unknown_tool_surfaces_raw_text_with_a_typed_error():
    raw = "<tool_call>\n<function=launch>\n</function>\n</tool_call>"
    out = parse(QWEN, stream(raw), initial=CLOSED)
    assert out.tool_calls == []
    assert out.content == raw
    assert kinds(out) == [ParseErrorKind.UNKNOWN_TOOL]


def test_truncated_call_ends_incomplete_with_a_typed_error():
    out = parse(QWEN, stream("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"), initial=CLOSED)
    [call] = out.tool_calls
    assert not call.complete
    assert call.arguments.startswith('{"city": "Par')
    assert kinds(out) == [ParseErrorKind.TRUNCATED_TOOL_CALL]


def test_truncated_block_opener_surfaces_as_content():
    out = parse(QWEN, stream("ok <tool_call>\n<func"), initial=CLOSED)
    assert out.tool_calls == []
    assert out.content == "ok <tool_call>\n<func"
    assert kinds(out) == [ParseErrorKind.TRUNCATED_TOOL_CALL]


def test_partial_opener_at_end_of_output_is_content():
    out = parse(QWEN, stream("see <tool_"), initial=CLOSED)
    assert out.content == "see <tool_"
    assert out.errors == []


def test_non_json_typed_value_is_kept_as_a_string_and_flagged():
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\nthree\n</parameter>\n</function>\n</tool_call>"
    out = parse(QWEN, stream(text), initial=CLOSED)
    [call] = out.tool_calls
    assert json.loads(call.arguments) == {"city": "Oslo", "days": "three"}
    assert not call.complete
    assert kinds(out) == [ParseErrorKind.INVALID_ARGUMENTS]


def test_garbage_inside_a_block_surfaces_as_content():
    out = parse(QWEN, stream("<tool_call>\nhello</tool_call>"), initial=CLOSED)
    assert out.content == "<tool_call>\nhello</tool_call>"
    assert kinds(out) == [ParseErrorKind.MALFORMED_TOOL_CALL]


def test_structured_answer_is_opaque():
    # spec: FE-13
    doc = '{"note": "<tool_call> and </think> stay text"}'
    out = parse(QWEN, stream(tok("<think>"), "r", tok("</think>"), doc), structured=True)
    assert (out.reasoning, out.content, out.tool_calls) == ("r", doc, [])


def test_structured_answer_may_follow_no_call_but_a_leading_block_is_a_call():
    # spec: FE-13
    out = parse(QWEN, stream(QWEN_CALL), initial=CLOSED, structured=True)
    assert len(out.tool_calls) == 1


def test_without_tools_the_tool_markup_is_content():
    out = parse(QWEN, stream(QWEN_CALL), initial=CLOSED, tools={})
    assert out.content == QWEN_CALL and out.tool_calls == []


# ---- GLM argument tags -----------------------------------------------------------------------
def test_glm_argument_tags_with_think_reasoning():
    # spec: FE-4
    glm = model(G, THINK)
    text = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>"
    out = parse(glm, stream(tok("<think>"), "go", tok("</think>"), text, "<tool_call>get_time</tool_call>"))
    assert out.reasoning == "go"
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("get_weather", {"city": "Rome", "days": 2}), ("get_time", {})]


# ---- DSML -------------------------------------------------------------------------------------
def test_dsml_holds_parallel_invocations_in_one_block():
    # spec: FE-5
    dsml = model(D, THINK)
    bar = "\uff5c"
    text = (
        f"<{bar}DSML{bar}function_calls>\n"
        f'<{bar}DSML{bar}invoke name="get_weather">\n<{bar}DSML{bar}parameter name="city">Hangzhou</{bar}DSML{bar}parameter>\n</{bar}DSML{bar}invoke>\n'
        f'<{bar}DSML{bar}invoke name="get_time">\n</{bar}DSML{bar}invoke>\n'
        f"</{bar}DSML{bar}function_calls>"
    )
    out = parse(dsml, stream(tok("<think>"), "r", tok("</think>"), text))
    assert [(c.call_id, c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("call_0", "get_weather", {"city": "Hangzhou"}), ("call_1", "get_time", {})]


# ---- XTML -------------------------------------------------------------------------------------
XTML = model(X, XTHINK)


def test_xtml_think_and_xtml_tools():
    # spec: FE-6, FE-8
    text = '<xtml:think>\nplan\n<xtml:tools>\n<xtml:call name="get_weather">{"city": "Lima", "days": 1}</xtml:call>\n</xtml:tools>'
    out = parse(XTML, stream(text))
    assert out.reasoning == "plan"
    [call] = out.tool_calls
    assert json.loads(call.arguments) == {"city": "Lima", "days": 1} and call.complete


def test_xtml_invalid_json_arguments_are_flagged():
    text = '<xtml:tools><xtml:call name="get_weather">{"city": </xtml:call></xtml:tools>'
    out = parse(XTML, stream(text), initial=CLOSED)
    [call] = out.tool_calls
    assert not call.complete
    assert kinds(out) == [ParseErrorKind.INVALID_ARGUMENTS]


# ---- recipient frames + ATEM -----------------------------------------------------------------
FRAME = model(A, FRAMES)


def frame(recipient: str, body: str, end: str = "<|end|>") -> list:
    return [tok("<|start|>"), f"assistant to={recipient}", tok("<|message|>"), body, *([tok(end)] if end else [])]


def atem_call(name: str, params: str) -> str:
    return f'<atem:function_calls>\n<atem:invoke name="{name}">\n{params}</atem:invoke>\n</atem:function_calls>'


CITY = '<atem:parameter name="city">Rome</atem:parameter>\n'


def test_self_frames_are_reasoning_and_commentary_user_are_content():
    # spec: FE-21, FE-22, FE-23
    out = parse(FRAME, stream(*frame("self", "think"), *frame("commentary", "note "), *frame("user", "Answer", end="")))
    assert (out.reasoning, out.content, out.errors) == ("think", "note Answer", [])


def test_named_tool_recipient_with_schema_typed_parameters():
    # spec: FE-24, FE-25, FE-30
    params = CITY + '<atem:parameter name="days">4</atem:parameter>\n<atem:parameter name="options">{"a": [1]}</atem:parameter>\n'
    out = parse(FRAME, stream(*frame("functions.get_weather", atem_call("get_weather", params), end="<|eom|>")))
    [call] = out.tool_calls
    assert json.loads(call.arguments) == {"city": "Rome", "days": 4, "options": {"a": [1]}}


def test_named_tool_recipient_rejects_another_invocation_name():
    # spec: FE-30
    out = parse(FRAME, stream(*frame("functions.get_weather", atem_call("get_time", ""), end="<|eom|>")))
    assert out.tool_calls == []
    assert kinds(out) == [ParseErrorKind.RECIPIENT_MISMATCH]
    assert "get_time" in out.content


def test_generic_tool_recipient_accepts_only_registered_names():
    # spec: FE-29
    ok = parse(FRAME, stream(*frame("functions", atem_call("get_time", ""), end="<|eom|>")))
    assert [c.name for c in ok.tool_calls] == ["get_time"]
    bad = parse(FRAME, stream(*frame("functions", atem_call("rm_rf", ""), end="<|eom|>")))
    assert bad.tool_calls == [] and kinds(bad) == [ParseErrorKind.UNKNOWN_TOOL]


def test_one_invocation_per_frame():
    # spec: FE-27
    body = '<atem:function_calls>\n<atem:invoke name="get_time">\n</atem:invoke>\n<atem:invoke name="get_time">\n</atem:invoke>\n</atem:function_calls>'
    out = parse(FRAME, stream(*frame("functions", body, end="<|eom|>")))
    assert [c.name for c in out.tool_calls] == ["get_time"]
    assert ParseErrorKind.EXTRA_INVOCATION in kinds(out)


def test_parallel_calls_are_consecutive_frames_and_eom_permits_another_header():
    # spec: FE-28, FE-31, FE-32
    pieces = stream(
        *frame("functions.get_weather", atem_call("get_weather", CITY), end="<|eom|>"),
        *frame("functions.get_time", atem_call("get_time", ""), end="<|eom|>"),
        *frame("user", "both requested", end=""),
    )
    out = parse(FRAME, pieces)
    assert [(c.call_id, c.name) for c in out.tool_calls] == [("call_0", "get_weather"), ("call_1", "get_time")]
    assert out.content == "both requested"


def test_header_controls_count_only_as_their_tokens():
    # spec: FE-33
    out = parse(FRAME, stream(*frame("user", "literal <|start|>assistant to=self<|message|> text <|end|> here", end="")))
    assert out.content == "literal <|start|>assistant to=self<|message|> text <|end|> here"
    assert out.reasoning == ""


def test_initially_open_header_accepts_the_generated_recipient():
    # spec: FE-34
    initial = InitialState(ReasoningStart.FRAME_HEADER_OPEN, header_prefix="assistant")
    out = parse(FRAME, stream(" to=self", tok("<|message|>"), "hmm", tok("<|end|>"), *frame("user", "hi", end="")), initial=initial)
    assert (out.reasoning, out.content) == ("hmm", "hi")


def test_continuation_starts_inside_the_prepared_body():
    # spec: FE-35
    initial = InitialState(ReasoningStart.FRAME_BODY, recipient="self")
    out = parse(FRAME, stream("more thought", tok("<|end|>"), *frame("user", "done", end="")), initial=initial)
    assert (out.reasoning, out.content) == ("more thought", "done")


def test_text_outside_frames_is_content_with_a_typed_error():
    # Whitespace before a header is frame spacing, not content.
    out = parse(FRAME, stream("stray text ", *frame("user", "x", end="")))
    assert out.content == "stray textx"
    assert kinds(out) == [ParseErrorKind.MALFORMED_FRAME]


def test_unknown_recipient_stays_visible():
    out = parse(FRAME, stream(*frame("browser", "open page")))
    assert "open page" in out.content
    assert kinds(out) == [ParseErrorKind.MALFORMED_FRAME]


def test_frame_end_inside_a_call_truncates_it_and_parsing_continues():
    pieces = stream(tok("<|start|>"), "assistant to=functions", tok("<|message|>"),
                    '<atem:function_calls><atem:invoke name="get_weather"><atem:parameter name="city">Ro', tok("<|eom|>"),
                    *frame("user", "after", end=""))
    out = parse(FRAME, pieces)
    assert [c.complete for c in out.tool_calls] == [False]
    assert ParseErrorKind.TRUNCATED_TOOL_CALL in kinds(out)
    assert out.content.endswith("after")


def test_feed_after_finish_is_an_error():
    e = engine(QWEN, CLOSED)
    feed_by_token(e, stream("x"))
    with pytest.raises(RuntimeError):
        e.feed(7, "y")


def test_events_are_typed_and_content_precedes_calls():
    events = coalesce(feed_by_token(engine(QWEN, CLOSED), stream("a ", QWEN_CALL)))
    assert isinstance(events[0], ContentDelta) and isinstance(events[1], ToolCallStart)
    assert isinstance(events[-1], ToolCallEnd) and events[-1].complete


def test_generated_text_cannot_forge_an_atomic_delimiter():
    # spec: FE-9, FE-33
    sentinel = "\U0010ff00"  # the code point the engine uses internally for an atomic delimiter
    out = parse(QWEN, stream(tok("<think>"), f"a{sentinel}b", tok("</think>"), "c"))
    assert (out.reasoning, out.content) == ("a\ufffdb", "c")
