"""One llguidance grammar per request, built from the same syntax data the engine parses.

The grammar covers the whole assistant output: the reasoning envelope (or recipient frames), the
tool syntax with each registered tool's parameters, and the answer (free text, JSON object or a
JSON schema). The engine reads the same structure back: every free-text span is a *lazy* lexeme
that ends at the first occurrence of its delimiter, which is exactly where the engine's scanner
cuts (greedy text followed by a textual delimiter would need backtracking, which llguidance's
lexer does not do). Delimiters the tokenizer holds as added tokens are written `<[id]>`, so the
grammar forces the token, never its spelling (FE-9).

    tool_choice  none      answer only (text or the response_format document)
                 auto      answer, or content then tool calls (JSON answers: calls or document)
                 required  one or more tool calls (one when parallel_tool_calls is false); after
                           each complete call the model may end or (parallel) call again
                 named     exactly one call of that tool

A request without tools and without response_format gets no grammar (None): it is unconstrained
on purpose, not by failure. Any schema keyword that would not be enforced is refused
(UnsupportedSchemaError), and a grammar llguidance rejects is an error, never a silent fallback.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import llguidance as llg
from helios_proto import contract_pb2 as pb

from .engine import ModelSyntax
from .tool_phases import is_string_schema
from .prompt_state import InitialState, ReasoningStart
from .schema_check import GrammarRequestError, UnsupportedSchemaError, check_schema


class ToolChoiceMode(enum.Enum):
    AUTO = "auto"
    NONE = "none"
    REQUIRED = "required"
    NAMED = "named"


class AnswerFormat(enum.Enum):
    TEXT = "text"
    JSON_OBJECT = "json_object"
    JSON_SCHEMA = "json_schema"
    REGEX = "regex"                      # vLLM structured_outputs.regex / guided_regex
    CHOICE = "choice"                    # vLLM structured_outputs.choice / guided_choice
    GRAMMAR = "grammar"                  # vLLM structured_outputs.grammar / structural_tag: a whole
                                         # llguidance grammar, referenced as a nested grammar


class InvalidToolChoiceError(GrammarRequestError):
    """tool_choice names an unregistered tool, or requires tools the request does not have."""


class GrammarBuildError(RuntimeError):
    """llguidance rejected a grammar this module built: a bug, not a request error (HTTP 500)."""


@dataclass(frozen=True)
class ToolSpec:
    name: str
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})


@dataclass(frozen=True)
class ConstraintRequest:
    """The request fields that shape the output grammar (already validated as JSON by the gateway)."""

    tools: tuple[ToolSpec, ...] = ()
    tool_choice: ToolChoiceMode = ToolChoiceMode.AUTO
    named_tool: str = ""
    parallel_tool_calls: bool = True
    answer_format: AnswerFormat = AnswerFormat.TEXT
    answer_schema: Mapping[str, Any] | None = None
    answer_pattern: str = ""             # REGEX: the answer matches it whole
    answer_choices: tuple[str, ...] = ()  # CHOICE: the answer is exactly one of them
    answer_grammar: str = ""             # GRAMMAR: an llguidance grammar (Lark text or grammars JSON)
    reasoning_max_chars: int | None = None  # reasoning budget; then the close delimiter is forced

    def engine_tools(self) -> dict[str, Mapping[str, Any]]:
        """Tools the output parser accepts (none when tool_choice is none)."""
        if self.tool_choice is ToolChoiceMode.NONE:
            return {}
        return {t.name: t.parameters for t in self.tools}

    @property
    def structured_answer(self) -> bool:
        return self.answer_format is not AnswerFormat.TEXT


@dataclass(frozen=True)
class RequestGrammar:
    lark: str  # the Lark source (kept for diagnostics)
    grammar: str  # llguidance grammar text: what exchange.proto carries to the backend


_ANY_TEXT = "(?s:.*)"
# Whitespace a model may write after its last tool call's separator before the output ends
TRAILING_SPACE_CHARS = 2
_NO_VALUE_LEAD = "\\s<"  # regex class body: whitespace and "<"
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_STRING_ANNOTATIONS = frozenset({"type", "description", "title", "default", "examples", "deprecated", "$comment"})
_REGEX_META = set("\\.+*?()|[]{}^$#&-~/")


def _regex_literal(text: str) -> str:
    """Escape text for a Lark /regex/ (Rust regex syntax plus the / delimiter)."""
    out = []
    for ch in text:
        if ch in _REGEX_META:
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        else:
            out.append(ch)
    return "".join(out)


class _LarkWriter:
    """Accumulates rules; every helper returns a Lark expression."""

    def __init__(self, model: ModelSyntax) -> None:
        self._markup = model.markup
        self._lines: list[str] = []
        self._count = 0

    def _name(self, stem: str) -> str:
        self._count += 1
        return f"{stem}_{self._count}"

    def rule(self, body: str, stem: str = "r") -> str:
        name = self._name(stem)
        self._lines.append(f"{name}: {body}")
        return name

    def lit(self, spelling: str) -> str:
        """A delimiter: its token when atomic, else its text ("" for an absent delimiter)."""
        if not spelling:
            return ""
        token = self._markup.token_of_spelling.get(spelling)
        if token is not None:
            return f"<[{token}]>"
        return json.dumps(spelling, ensure_ascii=False)

    def text_lit(self, text: str) -> str:
        return json.dumps(text, ensure_ascii=False) if text else ""

    def text_until(self, end: str | Sequence[str], forbid: Sequence[str] = (), wrap_newline: bool = False,
                   no_leading: str = "", max_chars: int | None = None) -> str:
        """Free text up to and including the first of the `end` delimiters; `forbid` delimiters
        may not occur in the text (they would end the span in the engine). `no_leading` is a
        regex class body of characters a non-empty text may not start with; `max_chars` bounds
        the text (then an end delimiter is the only continuation). Several ends make ONE lexeme
        (parallel bounded lexemes multiply llguidance's lexer states past its limit: measured)."""
        ends = [end] if isinstance(end, str) else [e for e in end if e]
        forbidden = [f for f in forbid if f and f not in ends]
        span = _ANY_TEXT if max_chars is None else f"(?s:.){{0,{int(max_chars)}}}"
        lead = f" & ~/[{no_leading}]{_ANY_TEXT}/" if no_leading else ""
        tokens = [self._markup.token_of_spelling.get(e) for e in ends]
        if all(t is not None for t in tokens):
            # Text can never contain a special token, so greedy text then the token is exact.
            terminal = self._name("TEXT").upper()
            body = f"/{span}/" + lead
            if forbidden:
                alts = "|".join(_regex_literal(f) for f in forbidden)
                body += f" & ~/{_ANY_TEXT}({alts}){_ANY_TEXT}/"
            self._lines.append(f"{terminal}: {body}")
            return f"{terminal} " + _alt([f"<[{t}]>" for t in tokens])
        if any(t is not None for t in tokens):
            return _alt([self.text_until(e, forbid, wrap_newline, no_leading, max_chars) for e in ends])
        terminal = self._name("UPTO").upper()
        ending = "(" + "|".join(("\\n" if wrap_newline else "") + _regex_literal(e) for e in ends) + ")"
        alts = "|".join(_regex_literal(f) for f in [*forbidden, *ends])
        # No forbidden pattern (nor an end) before the final end; the final end may begin with a
        # forbidden pattern ("</" before "</parameter>").
        body = f"/{span}{ending}/ & ~/{_ANY_TEXT}({alts}){_ANY_TEXT}{ending}/"
        if no_leading:
            body = f"({body}{lead}) | /{ending}/"  # the empty text stays allowed
        self._lines.append(f"{terminal}: {body}")
        rule = self._name("upto")
        self._lines.append(f"{rule}[lazy]: {terminal}")
        return rule

    def free_text(self, forbid: Sequence[str] = ()) -> str:
        """Text to the end of output, free of the `forbid` delimiters."""
        terminal = self._name("FREE").upper()
        body = f"/{_ANY_TEXT}/"
        forbidden = [f for f in forbid if f]
        if forbidden:
            alts = "|".join(_regex_literal(f) for f in forbidden)
            body += f" & ~/{_ANY_TEXT}({alts}){_ANY_TEXT}/"
        self._lines.append(f"{terminal}: {body}")
        return terminal

    def whitespace(self, max_chars: int) -> str:
        """1..max_chars whitespace characters (a bounded lexeme: then nothing but the end)."""
        terminal = self._name("SPACE").upper()
        self._lines.append(f"{terminal}: /[ \\t\\r\\n]{{1,{int(max_chars)}}}/")
        return terminal

    def json(self, schema: Mapping[str, Any]) -> str:
        # Fixed separators, no free whitespace: flexible JSON whitespace lets a small model pad
        # arguments with blank lines until the length limit (measured with a mask-driven walk).
        compiled = {**schema, "x-guidance": _JSON_LAYOUT}
        return "%json " + json.dumps(compiled, ensure_ascii=False)

    def source(self, start: str) -> str:
        return "\n".join([f"start: {start}", *self._lines]) + "\n"


def answer_regex(pattern: str) -> str:
    """A Lark expression matching the whole of a regex (llguidance's regex syntax)."""
    return "/" + llg.regex_to_lark(pattern) + "/"


def answer_choice(choices: Sequence[str]) -> str:
    """A Lark expression matching exactly one of the strings."""
    return " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


ANSWER_GRAMMAR = "request_answer"   # the nested grammar a GRAMMAR answer's `@` reference names


def grammar_list(grammar: str) -> list[dict[str, Any]]:
    """An llguidance top-level grammar (Lark text, or its JSON {"grammars": [...]}) as its list of
    grammars, the first one the start."""
    if grammar.lstrip().startswith("{"):
        grammars = json.loads(grammar).get("grammars")
        if not isinstance(grammars, list) or not grammars or not all(isinstance(g, dict) for g in grammars):
            raise GrammarRequestError("an llguidance grammar document needs a nonempty `grammars` list")
        return [dict(g) for g in grammars]
    return [{"lark_grammar": grammar}]


def nest_grammar(lark: str, answer: str) -> str:
    """llguidance's grammars JSON of `lark`, whose `@request_answer` is the whole grammar `answer`
    (its own rules stay apart: a separate grammar, named so the reference finds it)."""
    nested = grammar_list(answer)
    if any(g.get("name") == ANSWER_GRAMMAR for g in nested):
        raise GrammarRequestError(f"the grammar name {ANSWER_GRAMMAR!r} is reserved")
    nested[0]["name"] = ANSWER_GRAMMAR
    return json.dumps({"grammars": [{"lark_grammar": lark}, *nested]}, ensure_ascii=False)


def _seq(*parts: str) -> str:
    return " ".join(p for p in parts if p)


def _alt(options: Sequence[str]) -> str:
    return "(" + " | ".join(options) + ")"


class _Builder:
    def __init__(self, model: ModelSyntax, initial: InitialState, request: ConstraintRequest) -> None:
        self.model = model
        self.syntax = model.syntax
        self.tool = model.syntax.tool
        self.reasoning = model.syntax.reasoning
        self.initial = initial
        self.request = request
        self.w = _LarkWriter(model)
        self.sep = self.w.text_lit(self.tool.tag_separator)

    # ---- tool calls ---------------------------------------------------------------------------
    def _sep_after(self, spelling: str) -> str:
        """The separator, unless the literal before it already ends with it."""
        return "" if self.tool.tag_separator and spelling.endswith(self.tool.tag_separator) else self.sep

    def _invocation_end(self) -> str:
        return self.tool.invocation_close or self.tool.block_close

    def _param(self, name: str, schema: Any) -> str:
        t, w = self.tool, self.w
        head = _seq(w.lit(t.parameter_open_prefix), w.text_lit(name), w.lit(t.parameter_open_suffix))
        if not is_string_schema(schema):
            # Typed values are JSON documents (the engine parses them back with json.loads).
            wrap = w.text_lit("\n") if t.wrap_newlines else ""
            return _seq(head, wrap, w.json(schema if isinstance(schema, dict) else {}), wrap, w.lit(t.parameter_close))
        # String values are raw text (the engine JSON-quotes them), so string constraints must be
        # expressible on raw text: an enum becomes alternatives, other keywords are refused.
        wrap = w.text_lit("\n") if t.wrap_newlines else ""
        constraints = set(schema) - _STRING_ANNOTATIONS if isinstance(schema, dict) else set()
        if constraints - {"enum"}:
            raise UnsupportedSchemaError(sorted(constraints - {"enum"})[0], f"tagged string parameter {name!r}")
        if "enum" in constraints:
            values = _alt([w.text_lit(v) for v in schema["enum"]])
            close = (w.text_lit("\n") if t.wrap_newlines else "") + " " + w.lit(t.parameter_close)
            return _seq(head, wrap, values, close)
        # The syntax's own tags may not appear inside a value: the engine would read them as text,
        # but a small model that drifts into tag soup there never closes the value (measured).
        forbid = [t.parameter_open_prefix, t.invocation_close, t.block_close, t.block_open, *self._frame_interrupts()]
        lead = ""
        if self.request.tool_choice in (ToolChoiceMode.REQUIRED, ToolChoiceMode.NAMED):
            # A forced call may come from a model that does not know the syntax: its string values
            # are one line that does not start with whitespace or markup and holds no closing-tag
            # start other than the parameter close (measured with a 135M model: it closes values
            # with invented tags, opens new ones on the next line, or writes paragraphs). Calls
            # the model chose itself (auto) keep values free: multi-line, "</" allowed.
            forbid += [t.parameter_close[:2], "\n"]
            lead = _NO_VALUE_LEAD
        value = w.text_until(t.parameter_close, forbid=forbid, wrap_newline=t.wrap_newlines, no_leading=lead)
        return _seq(head, wrap, value)

    def _call(self, spec: ToolSpec, prefix: str | None = None) -> str:
        """One invocation of `spec`, opened by `prefix` (default: the first invocation's prefix)."""
        t, w = self.tool, self.w
        opener = t.invocation_open_prefix if prefix is None else prefix
        head = _seq(w.lit(opener), w.text_lit(spec.name), w.lit(t.invocation_open_suffix))
        end = w.lit(self._invocation_end())
        if t.argument_encoding == pb.ARGUMENT_ENCODING_JSON_OBJECT:
            return w.rule(_seq(head, w.json(spec.parameters), end), "call")
        props = spec.parameters.get("properties", {}) or {}
        required = set(spec.parameters.get("required", []) or [])
        parts = [head, self._sep_after(t.invocation_open_suffix)]
        for name, schema in props.items():
            param = _seq(self._param(name, schema), self.sep)
            parts.append(param if name in required else f"({param})?")
        parts.append(end)
        return w.rule(_seq(*parts), "call")

    def _calls(self) -> list[ToolSpec]:
        if self.request.tool_choice is ToolChoiceMode.NAMED:
            return [t for t in self.request.tools if t.name == self.request.named_tool]
        return list(self.request.tools)

    def _block_body(self, many: bool) -> str:
        """Everything after a block opener: one invocation, or several when the syntax holds many
        per block and parallel calls are allowed."""
        t, w = self.tool, self.w
        call = w.rule(_alt([self._call(s) for s in self._calls()]), "calls")
        if not t.invocation_close:  # the block close ends the single invocation
            return call
        lead = "" if not t.invocation_open_prefix else self.sep
        body = call
        if many and t.invocations_per_block != 1:
            later = call if not t.next_invocation_open_prefix else w.rule(
                _alt([self._call(s, t.next_invocation_open_prefix) for s in self._calls()]), "calls")
            body = f"{call} ({self.sep} {later})*"
        return _seq(lead, body, self.sep, w.lit(t.block_close))

    def _many(self) -> bool:
        return self.request.parallel_tool_calls and self.request.tool_choice is not ToolChoiceMode.NAMED

    def tool_calls_after_open(self) -> str:
        """The rest of the tool calls once the first block opener has been generated: at least
        one complete call, then the model ends them (EOS; or the separator, then EOS or a
        little whitespace and the end: a model that leaves the block with a blank line wants
        text, not another call) or, where parallel calls are allowed, opens another block
        after the separator. A separator that committed to another block made models that
        wanted to stop invent calls until their length limit (measured)."""
        many = self._many()
        body = self.w.rule(self._block_body(many), "block")
        end = f"({self.sep} ({self.w.whitespace(TRAILING_SPACE_CHARS)})?)?" if self.sep else ""
        if many and self.tool.invocations_per_block == 1:
            block = _seq(self.w.lit(self.tool.block_open), body)
            return _seq(f"{body} ({self.sep} {block})*", end)
        return _seq(body, end)

    def tool_calls(self) -> str:
        return _seq(self.w.lit(self.tool.block_open), self.tool_calls_after_open())

    # ---- answers ------------------------------------------------------------------------------
    def _document(self) -> str:
        fmt = self.request.answer_format
        if fmt is AnswerFormat.JSON_SCHEMA:
            return self.w.json(self.request.answer_schema or {})
        if fmt is AnswerFormat.REGEX:
            return self.w.rule(answer_regex(self.request.answer_pattern), "answer")
        if fmt is AnswerFormat.CHOICE:
            return self.w.rule(answer_choice(self.request.answer_choices), "answer")
        if fmt is AnswerFormat.GRAMMAR:
            return "@" + ANSWER_GRAMMAR
        return self.w.json({"type": "object"})

    def _tools_allowed(self) -> bool:
        return self.syntax.has_tools and bool(self.request.tools) and self.request.tool_choice is not ToolChoiceMode.NONE

    def answer(self) -> str:
        mode = self.request.tool_choice
        if not self._tools_allowed():
            return self._document() if self.request.structured_answer else self.w.free_text()
        if mode in (ToolChoiceMode.REQUIRED, ToolChoiceMode.NAMED):
            return self.tool_calls()
        if self.request.structured_answer:
            return _alt([self.tool_calls(), self._document()])
        opener = self.tool.block_open
        content = self.w.free_text(forbid=[opener])
        before_tools = _seq(self.w.text_until(opener), self.tool_calls_after_open())
        return _alt([before_tools, content])

    # ---- reasoning envelope -------------------------------------------------------------------
    def _after_reasoning_open(self) -> str:
        r = self.reasoning
        terminal = r.terminal_marker if self._tools_allowed() else ""
        budget = self.request.reasoning_max_chars
        options = [_seq(self.w.text_until(r.close, forbid=[terminal], max_chars=budget), self.answer())]
        if terminal and budget is None:
            # Under a budget reasoning ends at its close only: a second bounded lexeme in parallel
            # exceeds llguidance's lexer limits (measured), and the call still follows the close.
            options.append(_seq(self.w.text_until(terminal, forbid=[r.close]), self.tool_calls_after_open()))
        return _alt(options)

    def delimited(self) -> str:
        start = self.initial.start
        if not self.syntax.has_delimited_reasoning or start is ReasoningStart.CLOSED:
            return self.answer()
        if start is ReasoningStart.OPEN:
            return self._after_reasoning_open()
        return _alt([_seq(self.w.lit(self.reasoning.open), self._after_reasoning_open()), self.answer()])

    # ---- recipient frames ---------------------------------------------------------------------
    def _frame_interrupts(self) -> list[str]:
        if not self.syntax.uses_recipient_frames:
            return []
        r = self.reasoning
        return [r.message_end, r.message_continue, r.header_start]

    def _header(self, recipient: str, partial: str | None = None) -> str:
        """A frame header; `partial` is the header text still to generate when the prompt
        already opened it (the header start and some of the role text are in the prompt)."""
        r, w = self.reasoning, self.w
        if partial is not None:
            return _seq(w.text_lit(partial + recipient), w.lit(r.message_start))
        return _seq(w.lit(r.header_start), w.text_lit(r.header_role + r.recipient_prefix + recipient), w.lit(r.message_start))

    def _frame_end(self) -> str:
        r = self.reasoning
        return _alt([self.w.lit(r.message_end), self.w.lit(r.message_continue)])

    def _text_body(self, max_chars: int | None = None) -> str:
        r, w = self.reasoning, self.w
        return w.rule(w.text_until([r.message_end, r.message_continue], forbid=[r.header_start], max_chars=max_chars), "textbody")

    def _final_body(self) -> str:
        r, w = self.reasoning, self.w
        if self.request.structured_answer:
            return w.rule(_seq(self._document(), f"({w.lit(r.message_end)})?"), "finalbody")
        ends = [r.message_end, r.message_continue, r.header_start]
        return w.rule(_alt([w.text_until(r.message_end, forbid=ends), w.free_text(forbid=ends)]), "finalbody")

    def _tool_body(self, spec: ToolSpec) -> str:
        w, t = self.w, self.tool
        call = self._call(spec)
        return w.rule(_seq(w.lit(t.block_open), self.sep, call, self.sep, w.lit(t.block_close), self._frame_end()), "toolbody")

    def _frame_kinds(self) -> tuple[list[tuple[str, str]], list[tuple[str, str]], tuple[str, str]]:
        """(prelude frames, tool frames, final frame) as (recipient, body expression) pairs."""
        r = self.reasoning
        text = self._text_body()
        prelude = [(r.reasoning_recipient, self._text_body(self.request.reasoning_max_chars))]
        forced = self.request.tool_choice in (ToolChoiceMode.REQUIRED, ToolChoiceMode.NAMED) and self._tools_allowed()
        if not forced and not self.request.structured_answer:
            # Visible commentary only where a free-text answer may follow: commentary is content,
            # so before a JSON document it would make the content invalid, and a forced call may
            # only be preceded by reasoning.
            prelude += [(c, text) for c in r.content_recipients[:-1]]
        tools: list[tuple[str, str]] = []
        if self._tools_allowed():
            for spec in self._calls():
                body = self._tool_body(spec)
                tools += [(r.named_tool_prefix + spec.name, body), (r.generic_tool_recipient, body)]
        user = r.content_recipients[-1] if r.content_recipients else "user"
        return prelude, tools, (user, self._final_body())

    def frames(self) -> str:
        w = self.w
        prelude, tools, final = self._frame_kinds()
        frame = lambda kinds, partial=None: [_seq(self._header(rec, partial), body) for rec, body in kinds]  # noqa: E731
        prelude_rule = w.rule(_alt(frame(prelude)), "prelude")
        final_rule = w.rule(_alt(frame([final])), "final")
        forced = self.request.tool_choice in (ToolChoiceMode.REQUIRED, ToolChoiceMode.NAMED)
        if tools:
            tool_rule = w.rule(_alt(frame(tools)), "toolframe")
            more_tools = f"{tool_rule}*" if self._many() else ""
            ending = _seq(tool_rule, more_tools) if forced else _alt([_seq(tool_rule, more_tools), final_rule])
        else:
            more_tools, ending = "", final_rule
        # A reasoning budget bounds the response's reasoning: one bounded prelude frame at most.
        repeat = "*" if self.request.reasoning_max_chars is None else "?"
        sequence = w.rule(_seq(f"{prelude_rule}{repeat}", ending), "frames")
        start = self.initial.start
        if start is ReasoningStart.FRAME_HEADER_OPEN:
            r = self.reasoning
            expected = r.header_role + r.recipient_prefix
            done = self.initial.header_prefix
            partial = expected[len(done):] if expected.startswith(done) else expected
            options = [_seq(f, sequence) for f in frame(prelude, partial)]
            options += [_seq(f, more_tools) for f in frame(tools, partial)]
            if not (tools and forced):
                options += frame([final], partial)
            return _alt(options)
        if start is ReasoningStart.FRAME_BODY:
            return self._continue_body(prelude, tools, final, sequence, more_tools)
        return sequence

    def _continue_body(self, prelude: list[tuple[str, str]], tools: list[tuple[str, str]], final: tuple[str, str],
                       sequence: str, more_tools: str) -> str:
        """The prompt ends inside a prepared frame body: continue that body, then the frames."""
        recipient = self.initial.recipient
        for rec, body in prelude:
            if rec == recipient:
                return _seq(body, sequence)
        for rec, body in tools:
            if rec == recipient:
                return _seq(body, more_tools)
        if recipient == final[0]:
            return final[1]
        return self.w.free_text()

    def build(self) -> str:
        start = self.frames() if self.syntax.uses_recipient_frames else self.delimited()
        return self.w.source(start)


def _check_request(model: ModelSyntax, request: ConstraintRequest) -> None:
    names = [t.name for t in request.tools]
    if len(set(names)) != len(names):
        raise InvalidToolChoiceError("tool names must be unique")
    for spec in request.tools:
        if not spec.name or any(ch.isspace() or ch in "<>\"" for ch in spec.name):
            raise InvalidToolChoiceError(f"tool name {spec.name!r} cannot be written in the tool syntax")
        try:
            check_schema(spec.parameters, f"tools[{spec.name}].parameters")
        except UnsupportedSchemaError:
            raise
        if spec.parameters.get("type", "object") != "object":
            raise InvalidToolChoiceError(f"tool {spec.name!r}: parameters must be an object schema")
        if model.syntax.tool.argument_encoding == pb.ARGUMENT_ENCODING_TAGGED_PARAMETERS:
            for name in spec.parameters.get("properties", {}) or {}:
                if not name or any(ch.isspace() or ch in "<>\"" for ch in name):
                    raise InvalidToolChoiceError(
                        f"tool {spec.name!r}: parameter name {name!r} cannot be written as a parameter tag")
    if request.answer_format is AnswerFormat.JSON_SCHEMA:
        if request.answer_schema is None:
            raise GrammarRequestError("response_format json_schema needs a schema")
        check_schema(request.answer_schema, "response_format.json_schema.schema")
    if request.answer_format is AnswerFormat.GRAMMAR and not request.answer_grammar:
        raise GrammarRequestError("a grammar answer needs its grammar")
    if request.reasoning_max_chars is not None and request.reasoning_max_chars < 0:
        raise GrammarRequestError("the reasoning budget cannot be negative")
    if request.tool_choice in (ToolChoiceMode.REQUIRED, ToolChoiceMode.NAMED):
        if not request.tools:
            raise InvalidToolChoiceError(f"tool_choice {request.tool_choice.value} needs tools")
        if not model.syntax.has_tools:
            raise InvalidToolChoiceError("this model declares no tool syntax")
    if request.tool_choice is ToolChoiceMode.NAMED and request.named_tool not in names:
        raise InvalidToolChoiceError(f"tool_choice names unregistered tool {request.named_tool!r}")


def build_request_grammar(model: ModelSyntax, initial: InitialState, request: ConstraintRequest) -> RequestGrammar | None:
    """The grammar for one request, or None when nothing constrains it.

    Raises GrammarRequestError subclasses for requests that cannot be enforced (HTTP 400).
    """
    _check_request(model, request)
    tools_active = bool(request.tools) and request.tool_choice is not ToolChoiceMode.NONE and model.syntax.has_tools
    if not tools_active and not request.structured_answer:
        return None
    lark = _Builder(model, initial, request).build()
    if request.answer_format is AnswerFormat.GRAMMAR:
        return RequestGrammar(lark=lark, grammar=nest_grammar(lark, request.answer_grammar))
    return RequestGrammar(lark=lark, grammar=llg.LLMatcher.grammar_from_lark(lark))


def check_grammar(grammar: RequestGrammar, tokenizer: llg.LLTokenizer) -> None:
    """Validate with llguidance; schema features it refuses are request errors naming the keyword."""
    error = llg.LLMatcher.validate_grammar(grammar.grammar, tokenizer)
    if not error:
        return
    # Inside Lark the JSON compiler's message is wrapped ("at L(C): failed to compile JSON schema: ...").
    keys = re.search(r"Unimplemented keys: (\[[^\]]*\])", error)
    if keys:
        names = json.loads(keys.group(1))
        raise UnsupportedSchemaError(str(names[0]) if names else "<unknown>", "schema", error)
    if "Unknown format:" in error:
        raise UnsupportedSchemaError("format", "schema", error)
    if "failed to compile JSON schema" in error:
        raise GrammarRequestError(f"the JSON schema cannot be enforced: {error}")
    raise GrammarBuildError(error)
