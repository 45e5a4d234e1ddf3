"""The real SmolLM2 weights under the request grammar of each test-core syntax (issue #6 item 5,
frontend half): the numpy reference model decodes greedily with the grammar's masks applied, the
syntax engine parses the decoded text, and the result must be the requested call with arguments
valid against the tool schema, or a document valid against the response schema.

This is the frontend's own end-to-end check (prompt rendering -> prompt state -> grammar -> masks ->
real logits -> parser). The served path (gateway -> Triton -> backend GrammarSession) is tested
by the gateway/backend parts once they wire the plan in.
"""

from __future__ import annotations

import codecs
import json

import numpy as np
import pytest

from helios_backend.frontend.chat_template import ChatTemplate
from helios_backend.frontend.grammar_runtime import GrammarSession, GrammarTokenizer
from helios_backend.frontend.prompt import encode_chat
from helios_backend.syntax.engine import ModelSyntax
from helios_backend.syntax.events import ParsedOutput, collect
from helios_backend.syntax.grammar import AnswerFormat, ConstraintRequest, ToolChoiceMode, ToolSpec
from helios_backend.syntax.markup import atomic_tokens_from_tokenizer_json
from helios_backend.syntax.request import plan_request
from helios_backend.syntax.tables import FrontendSyntax
from helios_backend.frontend.tokenizer import FrontendTokenizer
from ignition.recipes.syntax_variants import VARIANTS, SyntaxVariant, variant_frontend

pytestmark = pytest.mark.slow

EOS_IDS = (2, 0)
# The 135M model never trained on these syntaxes may reason forever once it opens reasoning;
# a budget (in characters) makes the close delimiter the only continuation.
REASONING_BUDGET = 200
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
VERDICT = {
    "type": "object",
    "properties": {"capital": {"type": "string", "maxLength": 20}, "confident": {"type": "boolean"}},
    "required": ["capital", "confident"],
    "additionalProperties": False,
}


class _Frontend:
    def __init__(self) -> None:
        from ignition.sources.gguf import GGUFModel, default_gguf_path
        from ignition.sources.tokenizer import tokenizer_json_from_gguf
        from tests.reference.llama_numpy import ReferenceLlama

        source = GGUFModel.open(default_gguf_path())
        self.tokenizer_json = tokenizer_json_from_gguf(source)
        self.template = ChatTemplate(source.chat_template)
        self.tokenizer = FrontendTokenizer.from_json(self.tokenizer_json)
        self.grammar_tokenizer = GrammarTokenizer.from_json(self.tokenizer_json, EOS_IDS)
        self.model = ReferenceLlama.load(default_gguf_path(), max_context=512)


@pytest.fixture(scope="module")
def fe() -> _Frontend:
    return _Frontend()


def generate(fe: _Frontend, variant: SyntaxVariant, messages: list[dict], request: ConstraintRequest,
             max_tokens: int = 160) -> tuple[ParsedOutput, str]:
    syntax = ModelSyntax.build(FrontendSyntax.from_contract(variant_frontend(variant)),
                               atomic_tokens_from_tokenizer_json(fe.tokenizer_json))
    prompt_ids = encode_chat(fe.template, fe.tokenizer, messages).ids
    plan = plan_request(syntax, fe.tokenizer.decode(prompt_ids), request, fe.grammar_tokenizer.tokenizer)
    assert plan.grammar is not None
    session = GrammarSession.create(fe.grammar_tokenizer, plan.grammar.grammar)
    oracle = fe.model.with_rope_pairing(fe.model.rope_pairing)  # a fresh KV cache
    logits = oracle.forward(prompt_ids, 0)[-1]
    position = len(prompt_ids)
    words = np.zeros(fe.grammar_tokenizer.mask_words, dtype=np.int32)
    parser = plan.parser("call_")
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    events, text = [], ""
    for _ in range(max_tokens):
        session.fill_mask(words)
        allowed = np.unpackbits(words.view(np.uint8), bitorder="little")[: logits.size].astype(bool)
        token = int(np.where(allowed, logits, -np.inf).argmax())
        assert session.consume(token), session.error
        if token in EOS_IDS:
            break
        piece = decoder.decode(fe.grammar_tokenizer.tokenizer.decode_bytes([token]))
        text += piece
        events += parser.feed(token, piece)
        logits = oracle.forward([token], position)[-1]
        position += 1
    else:
        pytest.fail(f"no EOS within {max_tokens} tokens: {text!r}")
    return collect(events + parser.finish()), text


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.suffix)
def test_forced_call_in_each_syntax_has_schema_valid_arguments(fe, variant):
    # spec: FE-3, FE-4, FE-5, FE-6, FE-24, FE-41
    messages = [{"role": "system", "content": "You can call get_weather(city, days)."},
                {"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
    request = ConstraintRequest(tools=(ToolSpec("get_weather", WEATHER),), tool_choice=ToolChoiceMode.REQUIRED,
                                parallel_tool_calls=False, reasoning_max_chars=REASONING_BUDGET)
    out, text = generate(fe, variant, messages, request)
    assert [c.name for c in out.tool_calls] == ["get_weather"], text
    call = out.tool_calls[0]
    assert call.complete and out.errors == [], text
    arguments = json.loads(call.arguments)
    assert set(arguments) == {"city", "days"} and isinstance(arguments["city"], str)
    assert isinstance(arguments["days"], int) and 1 <= arguments["days"] <= 7


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.suffix)
def test_json_schema_answer_in_each_syntax_validates(fe, variant):
    # spec: FE-13, FE-37, FE-41
    messages = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
    request = ConstraintRequest(answer_format=AnswerFormat.JSON_SCHEMA, answer_schema=VERDICT,
                                reasoning_max_chars=REASONING_BUDGET)
    out, text = generate(fe, variant, messages, request)
    document = json.loads(out.content)
    assert set(document) == {"capital", "confident"}, text
    assert isinstance(document["capital"], str) and len(document["capital"]) <= 20
    assert isinstance(document["confident"], bool)
    assert out.tool_calls == [] and out.errors == []
