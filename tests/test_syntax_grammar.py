"""One llguidance grammar per request, with the real SmolLM2 tokenizer (FE-9, FE-13, FE-36, FE-37, FE-41).

The grammar and the engine are built from the same syntax data; these tests check they agree:
outputs the matcher accepts parse back into the calls and documents the request asked for, with
arguments valid against the tool schema, and outputs breaking the request's constraints are refused
by the matcher. `walk` lets the masks choose every token (a seeded random pick among the allowed
ones), so nothing but the grammar decides what a forced call looks like.
"""

from __future__ import annotations

import codecs
import json
import random

import llguidance as llg
import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer

from helios_backend.frontend.grammar_runtime import GrammarSession, GrammarTokenizer
from helios_backend.syntax.engine import ModelSyntax
from helios_backend.syntax.events import collect
from helios_backend.syntax.grammar import (
    AnswerFormat, ConstraintRequest, InvalidToolChoiceError, RequestGrammar, ToolChoiceMode, ToolSpec, build_request_grammar, check_grammar,
)
from helios_backend.syntax.markup import atomic_tokens_from_tokenizer_json
from helios_backend.syntax.prompt_state import InitialState, ReasoningStart
from helios_backend.syntax.schema_check import UnsupportedSchemaError
from helios_backend.syntax.tables import preset
from tests.syntax_cases import FRAMES, PAIRINGS, Q, THINK

EOS = 2  # <|im_end|>
FORECAST = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "units": {"enum": ["c", "f"]},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
# Every value is bounded: a random walk over the masks terminates.
BOUNDED = {
    "type": "object",
    "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 7}, "units": {"enum": ["c", "f"]}, "alert": {"type": "boolean"}},
    "required": ["days", "units", "alert"],
    "additionalProperties": False,
}
ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer", "score"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer_json() -> str:
    from ignition.sources.gguf import GGUFModel, default_gguf_path
    from ignition.sources.tokenizer import tokenizer_json_from_gguf
    return tokenizer_json_from_gguf(GGUFModel.open(default_gguf_path()))


@pytest.fixture(scope="module")
def grammar_tokenizer(tokenizer_json: str) -> GrammarTokenizer:
    return GrammarTokenizer.from_json(tokenizer_json, [EOS])


def _validate(value, schema) -> None:
    """The subset of JSON-schema validation these tests' schemas use."""
    if "enum" in schema:
        assert value in schema["enum"]
    kind = schema.get("type")
    if kind == "object":
        assert isinstance(value, dict)
        for name in schema.get("required", []):
            assert name in value, f"missing {name}"
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(schema.get("properties", {}))
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                _validate(value[name], sub)
    elif kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool)
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value)
    elif kind == "string":
        assert isinstance(value, str)
    elif kind == "boolean":
        assert isinstance(value, bool)


def _model(pairing: str, tokenizer_json: str) -> ModelSyntax:
    return ModelSyntax.build(preset(*PAIRINGS[pairing]), atomic_tokens_from_tokenizer_json(tokenizer_json))


def _walk_start(pairing: str, recipient: str) -> InitialState:
    """Where a mask-driven walk starts: free text (reasoning frames) never ends under random
    choices, so recipient frames start inside the prepared frame body."""
    if PAIRINGS[pairing][1] == FRAMES:
        return InitialState(ReasoningStart.FRAME_BODY, recipient=recipient)
    return InitialState(ReasoningStart.CLOSED)


def _start(pairing: str, reasoning: bool = False) -> InitialState:
    if PAIRINGS[pairing][1] == FRAMES:
        return InitialState(ReasoningStart.FRAME_EXPECT_HEADER)
    return InitialState(ReasoningStart.MAY_OPEN if reasoning else ReasoningStart.CLOSED)


def _session(gt: GrammarTokenizer, ms: ModelSyntax, initial: InitialState, request: ConstraintRequest) -> GrammarSession:
    grammar = build_request_grammar(ms, initial, request)
    assert grammar is not None
    check_grammar(grammar, gt.tokenizer)
    return GrammarSession.create(gt, grammar.grammar)


def _accepts(gt: GrammarTokenizer, session: GrammarSession, ids: list[int]) -> bool:
    return all(session.consume(i) for i in ids) and session.is_accepting()


def walk(gt: GrammarTokenizer, session: GrammarSession, seed: int, limit: int = 400) -> list[int]:
    """Let the masks pick every token: a seeded random choice among the allowed ids, until only
    EOS is allowed (or, when the grammar accepts, EOS is drawn)."""
    rng = random.Random(seed)
    words = np.zeros(gt.mask_words, dtype=np.int32)
    out: list[int] = []
    for _ in range(limit):
        session.fill_mask(words)
        allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[: gt.vocab_size])
        assert allowed.size, "the grammar allows nothing"
        if allowed.size == 1 and allowed[0] == EOS:
            return out
        choice = int(rng.choice(list(allowed)))
        if choice == EOS:
            return out
        assert session.consume(choice), session.error
        out.append(choice)
    raise AssertionError("the walk did not end")


def _parse(ms: ModelSyntax, gt: GrammarTokenizer, ids: list[int], initial: InitialState, request: ConstraintRequest):
    engine = ms.engine(initial, request.engine_tools(), structured_answer=request.structured_answer)
    # Decode incrementally as the gateway does: a character split over tokens arrives whole.
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    events = []
    for i in ids:
        events += engine.feed(i, decoder.decode(gt.tokenizer.decode_bytes([i])))
    return collect(events + engine.finish())


CANONICAL = {
    "qwen_coder+think": "<tool_call>\n<function=forecast>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
    "glm+think": "<tool_call>forecast\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
    "dsml+think": '<｜DSML｜function_calls>\n<｜DSML｜invoke name="forecast">\n<｜DSML｜parameter name="city">Paris</｜DSML｜parameter>\n'
                  '<｜DSML｜parameter name="days">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>',
    "xtml+xtml_think": '<xtml:tools>\n<xtml:call name="forecast">{"city": "Paris", "days": 3}</xtml:call>\n</xtml:tools>',
    "atem+recipient": '<|start|>assistant to=functions.forecast<|message|><atem:function_calls>\n<atem:invoke name="forecast">\n'
                      '<atem:parameter name="city">Paris</atem:parameter>\n<atem:parameter name="days">3</atem:parameter>\n'
                      '</atem:invoke>\n</atem:function_calls><|eom|>',
    "json_call+think": '<tool_call>\n{"name": "forecast", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
    "json_call_list+think": '[TOOL_CALLS][{"name": "forecast", "arguments": {"city": "Paris", "days": 3}}]',
    "json_parameters+think": '{"name": "forecast", "parameters": {"city": "Paris", "days": 3}}',
}


@pytest.mark.parametrize("pairing", sorted(PAIRINGS))
def test_required_call_in_each_syntax_is_accepted_and_parses_back(pairing, tokenizer_json, grammar_tokenizer):
    # spec: FE-3, FE-4, FE-5, FE-6, FE-24, FE-41
    gt, ms = grammar_tokenizer, _model(pairing, tokenizer_json)
    request = ConstraintRequest(tools=(ToolSpec("forecast", FORECAST),), tool_choice=ToolChoiceMode.REQUIRED)
    session = _session(gt, ms, _start(pairing), request)
    ids = gt.tokenizer.tokenize_str(CANONICAL[pairing])
    assert _accepts(gt, session, ids), session.error
    out = _parse(ms, gt, ids, _start(pairing), request)
    [call] = out.tool_calls
    assert call.name == "forecast" and call.complete and out.errors == []
    _validate(json.loads(call.arguments), FORECAST)


@pytest.mark.parametrize("pairing", sorted(PAIRINGS))
@pytest.mark.parametrize("seed", [0, 1])
def test_masks_alone_force_a_valid_call(pairing, seed, tokenizer_json, grammar_tokenizer):
    # spec: FE-41
    gt, ms = grammar_tokenizer, _model(pairing, tokenizer_json)
    request = ConstraintRequest(tools=(ToolSpec("alarm", BOUNDED),), tool_choice=ToolChoiceMode.NAMED, named_tool="alarm")
    initial = _walk_start(pairing, "functions.alarm")
    ids = walk(gt, _session(gt, ms, initial, request), seed)
    out = _parse(ms, gt, ids, initial, request)
    assert [c.name for c in out.tool_calls] == ["alarm"], gt.tokenizer.decode_str(ids)
    assert out.tool_calls[0].complete and out.errors == []
    _validate(json.loads(out.tool_calls[0].arguments), BOUNDED)


@pytest.mark.parametrize("pairing", sorted(PAIRINGS))
def test_masks_alone_force_a_document_matching_the_schema(pairing, tokenizer_json, grammar_tokenizer):
    # spec: FE-13, FE-37, FE-41
    gt, ms = grammar_tokenizer, _model(pairing, tokenizer_json)
    request = ConstraintRequest(answer_format=AnswerFormat.JSON_SCHEMA, answer_schema=ANSWER)
    initial = _walk_start(pairing, "user")
    ids = walk(gt, _session(gt, ms, initial, request), seed=3)
    out = _parse(ms, gt, ids, initial, request)
    assert out.tool_calls == [] and out.errors == []
    _validate(json.loads(out.content), ANSWER)


def test_required_refuses_plain_content(tokenizer_json, grammar_tokenizer):
    # spec: FE-41
    gt, ms = grammar_tokenizer, _model("qwen_coder+think", tokenizer_json)
    request = ConstraintRequest(tools=(ToolSpec("forecast", FORECAST),), tool_choice=ToolChoiceMode.REQUIRED)
    session = _session(gt, ms, _start("qwen_coder+think"), request)
    assert not _accepts(gt, session, gt.tokenizer.tokenize_str("Sure, it is sunny."))


def test_named_choice_refuses_another_tool(tokenizer_json, grammar_tokenizer):
    gt, ms = grammar_tokenizer, _model("qwen_coder+think", tokenizer_json)
    tools = (ToolSpec("forecast", FORECAST), ToolSpec("other", {"type": "object", "properties": {}}))
    request = ConstraintRequest(tools=tools, tool_choice=ToolChoiceMode.NAMED, named_tool="forecast")
    session = _session(gt, ms, _start("qwen_coder+think"), request)
    assert not _accepts(gt, session, gt.tokenizer.tokenize_str("<tool_call>\n<function=other>\n</function>\n</tool_call>"))


def test_parallel_calls_only_when_allowed(tokenizer_json, grammar_tokenizer):
    gt, ms = grammar_tokenizer, _model("qwen_coder+think", tokenizer_json)
    two = CANONICAL["qwen_coder+think"] + "\n" + CANONICAL["qwen_coder+think"]
    tools = (ToolSpec("forecast", FORECAST),)
    many = ConstraintRequest(tools=tools, tool_choice=ToolChoiceMode.REQUIRED, parallel_tool_calls=True)
    one = ConstraintRequest(tools=tools, tool_choice=ToolChoiceMode.REQUIRED, parallel_tool_calls=False)
    assert _accepts(gt, _session(gt, ms, _start("qwen_coder+think"), many), gt.tokenizer.tokenize_str(two))
    assert not _accepts(gt, _session(gt, ms, _start("qwen_coder+think"), one), gt.tokenizer.tokenize_str(two))


def test_auto_allows_content_then_a_call_or_content_alone(tokenizer_json, grammar_tokenizer):
    gt, ms = grammar_tokenizer, _model("glm+think", tokenizer_json)
    request = ConstraintRequest(tools=(ToolSpec("forecast", FORECAST),), tool_choice=ToolChoiceMode.AUTO)
    for text in ["It is sunny.", "Let me look.\n" + CANONICAL["glm+think"]]:
        session = _session(gt, ms, _start("glm+think", reasoning=True), request)
        assert _accepts(gt, session, gt.tokenizer.tokenize_str(text)), text


def test_reasoning_envelope_precedes_the_constrained_answer(tokenizer_json, grammar_tokenizer):
    # spec: FE-41
    gt, ms = grammar_tokenizer, _model("qwen_coder+think", tokenizer_json)
    request = ConstraintRequest(answer_format=AnswerFormat.JSON_SCHEMA, answer_schema=ANSWER)
    initial = InitialState(ReasoningStart.MAY_OPEN)
    text = '<think>\nA "{" here is fine.\n</think>{"answer": "yes", "score": 4}'
    ids = gt.tokenizer.tokenize_str(text)
    assert _accepts(gt, _session(gt, ms, initial, request), ids)
    out = _parse(ms, gt, ids, initial, request)
    assert out.reasoning == 'A "{" here is fine.'
    assert json.loads(out.content) == {"answer": "yes", "score": 4}
    assert not _accepts(gt, _session(gt, ms, initial, request), gt.tokenizer.tokenize_str("<think>x</think>not json"))


def test_frames_keep_recipients_and_constrain_the_user_answer(tokenizer_json, grammar_tokenizer):
    # spec: FE-36, FE-37
    gt, ms = grammar_tokenizer, _model("atem+recipient", tokenizer_json)
    request = ConstraintRequest(tools=(ToolSpec("forecast", FORECAST),), tool_choice=ToolChoiceMode.AUTO,
                                answer_format=AnswerFormat.JSON_SCHEMA, answer_schema=ANSWER)
    initial = InitialState(ReasoningStart.FRAME_EXPECT_HEADER)
    good = ["<|start|>assistant to=self<|message|>hm<|end|><|start|>assistant to=user<|message|>{\"answer\": \"no\", \"score\": 1}",
            CANONICAL["atem+recipient"]]
    for text in good:
        assert _accepts(gt, _session(gt, ms, initial, request), gt.tokenizer.tokenize_str(text)), text
    bad = "<|start|>assistant to=user<|message|>plain words"
    assert not _accepts(gt, _session(gt, ms, initial, request), gt.tokenizer.tokenize_str(bad))


def test_open_header_in_the_prompt_continues_with_the_recipient(tokenizer_json, grammar_tokenizer):
    # spec: FE-34
    gt, ms = grammar_tokenizer, _model("atem+recipient", tokenizer_json)
    request = ConstraintRequest(tools=(ToolSpec("forecast", FORECAST),), tool_choice=ToolChoiceMode.REQUIRED)
    initial = InitialState(ReasoningStart.FRAME_HEADER_OPEN, header_prefix="assistant")
    text = CANONICAL["atem+recipient"].removeprefix("<|start|>assistant")
    ids = gt.tokenizer.tokenize_str(text)
    assert _accepts(gt, _session(gt, ms, initial, request), ids)
    assert [c.name for c in _parse(ms, gt, ids, initial, request).tool_calls] == ["forecast"]


def test_atomic_delimiters_are_forced_as_tokens(tokenizer_json, grammar_tokenizer):
    # spec: FE-9, FE-12
    tk = Tokenizer.from_str(tokenizer_json)
    tk.add_special_tokens([AddedToken("<think>", special=True, normalized=False), AddedToken("</think>", special=True, normalized=False)])
    extended = tk.to_str()
    atoms = atomic_tokens_from_tokenizer_json(extended)
    open_id, close_id = atoms["<think>"], atoms["</think>"]
    gt = GrammarTokenizer.from_json(extended, [EOS])
    ms = ModelSyntax.build(preset(Q, THINK), atoms)
    request = ConstraintRequest(answer_format=AnswerFormat.JSON_OBJECT)
    initial = InitialState(ReasoningStart.MAY_OPEN)
    grammar = build_request_grammar(ms, initial, request)
    assert f"<[{close_id}]>" in grammar.lark
    # Spelled-out text is tokenized without the added tokens (the base vocabulary is the same).
    plain = grammar_tokenizer.tokenizer.tokenize_str
    ids = [open_id, *plain("I type </think> as text"), close_id, *plain('{"ok": true}')]
    assert _accepts(gt, GrammarSession.create(gt, grammar.grammar), ids)
    out = _parse(ms, gt, ids, initial, request)
    assert out.reasoning == "I type </think> as text"
    assert json.loads(out.content) == {"ok": True}
    # the spelled-out delimiter cannot stand in for the token
    text_only = plain('<think>x</think>{"ok": true}')
    assert not _accepts(gt, GrammarSession.create(gt, grammar.grammar), text_only)


def test_unconstrained_requests_get_no_grammar(tokenizer_json):
    ms = _model("qwen_coder+think", tokenizer_json)
    assert build_request_grammar(ms, InitialState(ReasoningStart.MAY_OPEN), ConstraintRequest()) is None
    none = ConstraintRequest(tools=(ToolSpec("forecast", FORECAST),), tool_choice=ToolChoiceMode.NONE)
    assert build_request_grammar(ms, InitialState(ReasoningStart.MAY_OPEN), none) is None


@pytest.mark.parametrize("keyword,schema", [
    ("if", {"type": "object", "if": {}}),
    ("uniqueItems", {"type": "array", "uniqueItems": True}),
    ("contentEncoding", {"type": "string", "contentEncoding": "base64"}),
    ("nullable", {"type": "object", "properties": {"a": {"type": "string", "nullable": True}}}),
    ("not", {"anyOf": [{"not": {"type": "string"}}]}),
    ("oneOf", {"oneOf": [{"type": "string"}, {"type": "integer"}]}),
])
def test_unsupported_schema_keywords_are_refused_by_name(keyword, schema, tokenizer_json):
    ms = _model("qwen_coder+think", tokenizer_json)
    request = ConstraintRequest(answer_format=AnswerFormat.JSON_SCHEMA, answer_schema=schema)
    with pytest.raises(UnsupportedSchemaError) as raised:
        build_request_grammar(ms, InitialState(ReasoningStart.CLOSED), request)
    assert raised.value.keyword == keyword and keyword in str(raised.value)
    tool = ConstraintRequest(tools=(ToolSpec("t", {"type": "object", "properties": {"x": schema}}),))
    with pytest.raises(UnsupportedSchemaError):
        build_request_grammar(ms, InitialState(ReasoningStart.CLOSED), tool)


def test_unknown_format_is_refused_by_name(tokenizer_json, grammar_tokenizer):
    ms = _model("qwen_coder+think", tokenizer_json)
    schema = {"type": "object", "properties": {"when": {"type": "string", "format": "lunar-date"}}}
    request = ConstraintRequest(answer_format=AnswerFormat.JSON_SCHEMA, answer_schema=schema)
    with pytest.raises(UnsupportedSchemaError) as raised:
        build_request_grammar(ms, InitialState(ReasoningStart.CLOSED), request)
    assert raised.value.keyword == "format"
    # llguidance's own refusal maps to the same typed error
    lark = 'start: %json {"type": "string", "format": "lunar-date"}\n'
    with pytest.raises(UnsupportedSchemaError) as raised:
        check_grammar(RequestGrammar(lark, llg.LLMatcher.grammar_from_lark(lark)), grammar_tokenizer.tokenizer)
    assert raised.value.keyword == "format"


def test_supported_keywords_compile_in_llguidance(tokenizer_json, grammar_tokenizer):
    ms = _model("qwen_coder+think", tokenizer_json)
    schema = {"type": "object", "title": "t", "properties": {
        "when": {"type": "string", "format": "date"}, "n": {"type": "number", "multipleOf": 2, "exclusiveMinimum": 0},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 1, "maxItems": 3},
        "kind": {"anyOf": [{"const": "a"}, {"$ref": "#/$defs/b"}]}}, "$defs": {"b": {"enum": ["b"]}},
        "minProperties": 1, "required": ["when"]}
    grammar = build_request_grammar(ms, InitialState(ReasoningStart.CLOSED),
                                    ConstraintRequest(answer_format=AnswerFormat.JSON_SCHEMA, answer_schema=schema))
    check_grammar(grammar, grammar_tokenizer.tokenizer)


def test_string_constraints_that_raw_tagged_values_cannot_carry_are_refused(tokenizer_json):
    ms = _model("qwen_coder+think", tokenizer_json)
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}}
    with pytest.raises(UnsupportedSchemaError, match="pattern"):
        build_request_grammar(ms, InitialState(ReasoningStart.CLOSED), ConstraintRequest(tools=(ToolSpec("t", schema),)))


@pytest.mark.parametrize("request_", [
    ConstraintRequest(tool_choice=ToolChoiceMode.REQUIRED),
    ConstraintRequest(tools=(ToolSpec("a"),), tool_choice=ToolChoiceMode.NAMED, named_tool="b"),
    ConstraintRequest(tools=(ToolSpec("a"), ToolSpec("a"))),
    ConstraintRequest(tools=(ToolSpec("bad name"),)),
    ConstraintRequest(tools=(ToolSpec("t", {"type": "object", "properties": {'a">': {"type": "string"}}}),)),
])
def test_impossible_tool_choices_are_request_errors(request_, tokenizer_json):
    with pytest.raises(InvalidToolChoiceError):
        build_request_grammar(_model("qwen_coder+think", tokenizer_json), InitialState(ReasoningStart.CLOSED), request_)


def test_grammar_text_is_valid_llguidance(tokenizer_json, grammar_tokenizer):
    ms = _model("dsml+think", tokenizer_json)
    request = ConstraintRequest(tools=(ToolSpec("forecast", FORECAST),), tool_choice=ToolChoiceMode.AUTO)
    grammar = build_request_grammar(ms, InitialState(ReasoningStart.MAY_OPEN), request)
    assert llg.LLMatcher.validate_grammar(grammar.grammar, grammar_tokenizer.tokenizer) == ""


def test_request_plan_gives_the_grammar_and_a_parser_per_choice(tokenizer_json, grammar_tokenizer):
    # spec: FE-38, FE-41
    from helios_backend.syntax.request import plan_request
    ms = _model("qwen_coder+think", tokenizer_json)
    prompt = "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n"
    request = ConstraintRequest(tools=(ToolSpec("forecast", FORECAST),), tool_choice=ToolChoiceMode.REQUIRED)
    plan = plan_request(ms, prompt, request, grammar_tokenizer.tokenizer)
    assert plan.initial.start is ReasoningStart.MAY_OPEN and plan.grammar is not None
    ids = grammar_tokenizer.tokenizer.tokenize_str(CANONICAL["qwen_coder+think"])
    assert _accepts(grammar_tokenizer, GrammarSession.create(grammar_tokenizer, plan.grammar.grammar), ids)
    first, second = plan.parser("call_a_"), plan.parser("call_b_")
    events = first.feed_many([(i, grammar_tokenizer.tokenizer.decode_str([i])) for i in ids]) + first.finish()
    assert collect(events).tool_calls[0].call_id == "call_a_0"
    assert second.finish() == []


@pytest.mark.parametrize("pairing", ["qwen_coder+think", "xtml+xtml_think", "atem+recipient"])
def test_reasoning_budget_forces_the_close(pairing, tokenizer_json, grammar_tokenizer):
    # spec: FE-41
    gt, ms = grammar_tokenizer, _model(pairing, tokenizer_json)
    request = ConstraintRequest(answer_format=AnswerFormat.JSON_SCHEMA, answer_schema=ANSWER, reasoning_max_chars=40)
    initial = (InitialState(ReasoningStart.FRAME_BODY, recipient="self") if PAIRINGS[pairing][1] == FRAMES
               else InitialState(ReasoningStart.OPEN))
    ids = walk(gt, _session(gt, ms, initial, request), seed=5)  # random text would never close by itself
    out = _parse(ms, gt, ids, initial, request)
    assert gt.tokenizer.decode_str(ids).count("to=self") <= 1  # one bounded reasoning frame at most
    assert 0 < len(out.reasoning) <= 40 * 2 and out.errors == []
    _validate(json.loads(out.content), ANSWER)


def _allowed(gt: GrammarTokenizer, session: GrammarSession) -> set[int]:
    words = np.zeros(gt.mask_words, dtype=np.int32)
    session.fill_mask(words)
    return set(np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[: gt.vocab_size]).tolist())


def _second_call(pairing: str) -> str:
    """CANONICAL followed by a second call as the syntax writes parallel calls: another block
    (one invocation per block), another invocation in the block, or another frame."""
    text = CANONICAL[pairing]
    if pairing in ("dsml+think", "xtml+xtml_think"):
        head, close = text.rsplit("\n", 1)
        invocation = head.split("\n", 1)[1]
        return f"{head}\n{invocation}\n{close}"
    if PAIRINGS[pairing][1] == FRAMES:
        return text + text
    if pairing == "json_call_list+think":     # later objects of the same list
        return text[:-1] + ", " + text.split("[", 2)[2]
    return text + "\n" + text


@pytest.mark.parametrize("pairing", sorted(PAIRINGS))
@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("tool_count", [1, 2])
def test_required_lets_the_model_end_after_a_complete_call(pairing, parallel, tool_count, tokenizer_json,
                                                           grammar_tokenizer):
    """After one complete call the model may stop (EOS; or the separator models write after a
    block, then EOS) under `required`; another call only where parallel calls are allowed. A
    separator that committed to another block made models that wanted to stop invent calls
    until their length limit."""
    # spec: FE-41
    gt, ms = grammar_tokenizer, _model(pairing, tokenizer_json)
    tools = (ToolSpec("forecast", FORECAST), ToolSpec("other", BOUNDED))[:tool_count]
    request = ConstraintRequest(tools=tools, tool_choice=ToolChoiceMode.REQUIRED, parallel_tool_calls=parallel)
    one = gt.tokenizer.tokenize_str(CANONICAL[pairing])
    session = _session(gt, ms, _start(pairing), request)
    assert _accepts(gt, session, one), session.error
    assert EOS in _allowed(gt, session)
    separator = ms.syntax.tool.tag_separator
    if PAIRINGS[pairing][1] != FRAMES and separator:
        session = _session(gt, ms, _start(pairing), request)
        assert _accepts(gt, session, gt.tokenizer.tokenize_str(CANONICAL[pairing] + separator)), session.error
        assert EOS in _allowed(gt, session)
        # a blank line after the separator leaves the tool calls: the output ends there
        session = _session(gt, ms, _start(pairing), request)
        assert _accepts(gt, session, gt.tokenizer.tokenize_str(CANONICAL[pairing] + separator + "\n")), session.error
        assert EOS in _allowed(gt, session)
        assert not _accepts(gt, _session(gt, ms, _start(pairing), request),
                            gt.tokenizer.tokenize_str(CANONICAL[pairing] + separator + "\n" + CANONICAL[pairing]))
    two = gt.tokenizer.tokenize_str(_second_call(pairing))
    assert _accepts(gt, _session(gt, ms, _start(pairing), request), two) is parallel


@pytest.mark.parametrize("pairing", sorted(PAIRINGS))
def test_a_named_choice_allows_exactly_one_call_then_the_end(pairing, tokenizer_json, grammar_tokenizer):
    # spec: FE-41
    gt, ms = grammar_tokenizer, _model(pairing, tokenizer_json)
    request = ConstraintRequest(tools=(ToolSpec("forecast", FORECAST),), tool_choice=ToolChoiceMode.NAMED,
                                named_tool="forecast")
    session = _session(gt, ms, _start(pairing), request)
    assert _accepts(gt, session, gt.tokenizer.tokenize_str(CANONICAL[pairing])), session.error
    assert EOS in _allowed(gt, session)
    assert not _accepts(gt, _session(gt, ms, _start(pairing), request),
                        gt.tokenizer.tokenize_str(_second_call(pairing)))
