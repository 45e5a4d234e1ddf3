"""vLLM's structured-output request shapes -> one typed output constraint.

vLLM accepts `structured_outputs: {json | regex | choice | json_object | grammar |
structural_tag}` and the older top-level `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar`, `structural_tag`. At most one constraint per request (OpenAI's
`response_format` counts as one). A grammar is Lark or GBNF/EBNF, converted as vLLM's
llguidance backend does (`llguidance.grammar_from("grammar", ...)`); a structural tag is vLLM's
`{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`, turned into llguidance
StructTags (free text in which each trigger starts a constrained segment). Chat requests
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

from helios_backend.syntax.grammar import AnswerFormat, answer_choice, answer_regex
from helios_proto import exchange_pb2 as ep

from gateway.errors import InvalidRequestError
from gateway.schemas import ResponseFormat, SamplingFields


@dataclass(frozen=True, slots=True)
class OutputConstraint:
    format: AnswerFormat  # JSON_SCHEMA, REGEX, CHOICE or GRAMMAR
    param: str  # the request field it came from (named in errors)
    schema: dict[str, Any] | None = None
    pattern: str = ""
    choices: tuple[str, ...] = ()
    grammar: str = ""  # GRAMMAR: an llguidance grammar (Lark text or its grammars JSON)


def _grammar(text: str, param: str) -> OutputConstraint:
    """A Lark or GBNF grammar (vLLM's structured_outputs.grammar / guided_grammar)."""
    try:
        grammar = llg.grammar_from("grammar", text)
    except (ValueError, RuntimeError) as exc:
        raise InvalidRequestError(f"not a Lark or GBNF grammar: {exc}", param=param) from exc
    return OutputConstraint(AnswerFormat.GRAMMAR, param, grammar=grammar)


def structural_tag_grammar(value: str | dict[str, Any], param: str) -> OutputConstraint:
    """vLLM's structural tag: {"structures": [{"begin", "schema", "end"}], "triggers": [...]};
    each structure's begin starts with one of the triggers (as vLLM's llguidance backend)."""
    spec = _schema(value, param)
    structures, triggers = spec.get("structures"), spec.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise InvalidRequestError("a structural tag needs a nonempty `structures` list", param=param)
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise InvalidRequestError("a structural tag needs a `triggers` list of nonempty strings", param=param)
    tags = []
    for index, structure in enumerate(structures):
        where = f"{param}.structures[{index}]"
        if not isinstance(structure, dict) or not isinstance(structure.get("begin"), str) \
                or not isinstance(structure.get("end", ""), str) \
                or not isinstance(structure.get("schema"), (dict, str)):
            raise InvalidRequestError("a structure needs `begin` and `end` strings and a `schema`", param=where)
        trigger = next((t for t in triggers if structure["begin"].startswith(t)), None)
        if trigger is None:
            raise InvalidRequestError(f"begin {structure['begin']!r} starts with none of the triggers",
                                      param=where)
        tags.append(llg.StructTag(trigger=trigger, begin=structure["begin"], grammar=structure["schema"],
                                  end=structure.get("end", "")))
    return OutputConstraint(AnswerFormat.GRAMMAR, param, grammar=_top_level(llg.StructTag.to_grammar(tags)))


def _top_level(grammar: str) -> str:
    """StructTag.to_grammar gives Lark text or a grammars JSON; both as llguidance grammar text."""
    return grammar if grammar.lstrip().startswith("{") else llg.grammar_from("lark", grammar)


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


def response_format_constraint(fmt: ResponseFormat | None) -> OutputConstraint | None:
    """`response_format` as a whole-output constraint (vLLM's completions accept it too)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return OutputConstraint(AnswerFormat.JSON_SCHEMA, "response_format", schema={"type": "object"})
    if fmt.type == "structural_tag":
        return structural_tag_grammar({"structures": fmt.structures, "triggers": fmt.triggers}, "response_format")
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise InvalidRequestError("response_format json_schema needs json_schema.schema",
                                  param="response_format.json_schema")
    return OutputConstraint(AnswerFormat.JSON_SCHEMA, "response_format", schema=fmt.json_schema.schema_)


def requested_constraint(body: SamplingFields) -> OutputConstraint | None:
    """The one structured-output constraint the request asks for, or None."""
    found: list[OutputConstraint] = []
    so = body.structured_outputs
    if so is not None:
        # vLLM's backend options: one backend here, so nothing to fall back from; the whitespace
        # and additionalProperties switches are not implemented (400, never silently dropped)
        for name in sorted(set(so.model_extra or ()) - {"disable_fallback"}):
            raise InvalidRequestError(f"structured_outputs.{name} is not implemented here",
                                      param=f"structured_outputs.{name}")
        if so.grammar is not None:
            found.append(_grammar(so.grammar, "structured_outputs.grammar"))
        if so.structural_tag is not None:
            found.append(structural_tag_grammar(so.structural_tag, "structured_outputs.structural_tag"))
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
    if body.guided_grammar is not None:
        found.append(_grammar(body.guided_grammar, "guided_grammar"))
    if body.structural_tag is not None:
        found.append(structural_tag_grammar(body.structural_tag, "structural_tag"))
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


def completion_grammar(constraint: OutputConstraint, tokenizer: llg.LLTokenizer | None) -> ep.Grammar:
    """The whole-output grammar of a raw completion (validated)."""
    if constraint.format is AnswerFormat.GRAMMAR:
        check_grammar(constraint.grammar, tokenizer, constraint.param)
        return ep.Grammar(kind=ep.GRAMMAR_KIND_LLGUIDANCE, text=constraint.grammar)
    try:
        text = llg.grammar_from("lark", "start: " + _lark_expression(constraint))
    except (ValueError, RuntimeError) as exc:  # llguidance refuses the source it would compile
        raise InvalidRequestError(f"the constraint cannot be compiled: {exc}", param=constraint.param) from exc
    check_grammar(text, tokenizer, constraint.param)
    return ep.Grammar(kind=ep.GRAMMAR_KIND_LLGUIDANCE, text=text)
