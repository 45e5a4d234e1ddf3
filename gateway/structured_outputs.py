"""vLLM's structured-output request shapes -> one typed output constraint.

vLLM accepts `structured_outputs: {json | regex | choice | json_object | grammar |
structural_tag}` and the older top-level `guided_json`, `guided_regex`, `guided_choice`.
At most one constraint per request (OpenAI's `response_format` counts as one). Chat requests
hand it to the syntax plan as an answer format (so it composes with the reasoning envelope);
completions have no syntax, so the constraint is the whole output grammar (Lark, compiled by
llguidance in the backend). Grammars are validated here with llguidance, so a bad regex or
schema is a 400 naming the field, never a backend failure.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import llguidance as llg

from helios_backend.frontend.syntax.grammar import AnswerFormat, answer_choice, answer_regex
from helios_proto import transport_pb2 as tp

from gateway.errors import InvalidRequestError
from gateway.schemas import SamplingFields


@dataclass(frozen=True, slots=True)
class OutputConstraint:
    format: AnswerFormat  # JSON_SCHEMA, REGEX or CHOICE
    param: str  # the request field it came from (named in errors)
    schema: dict[str, Any] | None = None
    pattern: str = ""
    choices: tuple[str, ...] = ()


def _schema(value: str | dict[str, Any], param: str) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    try:
        schema = json.loads(value)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"not a JSON schema document: {exc}", param=param) from exc
    if not isinstance(schema, dict):
        raise InvalidRequestError("a JSON schema must be an object", param=param)
    return schema


def requested_constraint(body: SamplingFields) -> OutputConstraint | None:
    """The one structured-output constraint the request asks for, or None."""
    found: list[OutputConstraint] = []
    so = body.structured_outputs
    if so is not None:
        for name in ("grammar", "structural_tag"):
            if getattr(so, name) is not None:
                raise InvalidRequestError(f"structured_outputs.{name} is not supported (json, regex, choice "
                                          "and json_object are)", param=f"structured_outputs.{name}")
        if so.json_ is not None:
            found.append(OutputConstraint(AnswerFormat.JSON_SCHEMA, "structured_outputs.json",
                                          schema=_schema(so.json_, "structured_outputs.json")))
        if so.json_object:
            found.append(OutputConstraint(AnswerFormat.JSON_SCHEMA, "structured_outputs.json_object",
                                          schema={"type": "object"}))
        if so.regex is not None:
            found.append(OutputConstraint(AnswerFormat.REGEX, "structured_outputs.regex", pattern=so.regex))
        if so.choice is not None:
            found.append(OutputConstraint(AnswerFormat.CHOICE, "structured_outputs.choice", choices=tuple(so.choice)))
    if body.guided_json is not None:
        found.append(OutputConstraint(AnswerFormat.JSON_SCHEMA, "guided_json",
                                      schema=_schema(body.guided_json, "guided_json")))
    if body.guided_regex is not None:
        found.append(OutputConstraint(AnswerFormat.REGEX, "guided_regex", pattern=body.guided_regex))
    if body.guided_choice is not None:
        found.append(OutputConstraint(AnswerFormat.CHOICE, "guided_choice", choices=tuple(body.guided_choice)))
    if len(found) > 1:
        raise InvalidRequestError("only one structured-output constraint per request: "
                                  + ", ".join(c.param for c in found), param=found[1].param)
    return found[0] if found else None


def _lark_expression(constraint: OutputConstraint) -> str:
    if constraint.format is AnswerFormat.REGEX:
        return answer_regex(constraint.pattern)
    if constraint.format is AnswerFormat.CHOICE:
        return answer_choice(constraint.choices)
    return "%json " + json.dumps(constraint.schema, ensure_ascii=False)


def check_grammar(grammar: str, tokenizer: llg.LLTokenizer | None, param: str) -> None:
    """llguidance's verdict on a request grammar; a refusal is a 400 naming `param`."""
    if tokenizer is None:
        raise InvalidRequestError("this model serves no constrained output (no EOS ids)", param=param)
    error = llg.LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        raise InvalidRequestError(f"the constraint cannot be enforced: {error}", param=param)


def completion_grammar(constraint: OutputConstraint, tokenizer: llg.LLTokenizer | None) -> tp.Grammar:
    """The whole-output grammar of a raw completion (validated)."""
    try:
        text = llg.grammar_from("lark", "start: " + _lark_expression(constraint))
    except (ValueError, RuntimeError) as exc:  # llguidance refuses the source it would compile
        raise InvalidRequestError(f"the constraint cannot be compiled: {exc}", param=constraint.param) from exc
    check_grammar(text, tokenizer, constraint.param)
    return tp.Grammar(kind=tp.GRAMMAR_KIND_LLGUIDANCE, text=text)
