"""The one streaming syntax engine: reasoning, content and tool calls from generated tokens.

Fed `(token_id, text)` pairs (a token's decoded text may be split over several calls; the text of
a delimiter token is ignored, its id identifies it), it emits the events of `events.py`. Every
syntax is the same state machine driven by the data of `tables.py`; nothing here knows a model.

Parsing works on one buffer of parse text (see `markup.py`: atomic delimiter tokens are sentinel
characters). A phase handler decides only from text it has seen; text that could still become a
delimiter (a proper prefix at the buffer's end, or a wrapping newline) waits for more input, and
`finish()` resolves it. Decisions therefore never depend on how the output was chunked: feeding
everything at once, token by token or character by character gives the same coalesced events.

Phases (think-tag family)::

    START -open-> REASONING -close|terminal-> ANSWER_LEAD -> ANSWER -block_open-> BLOCK
    BLOCK -> INVOKE_NAME -> ARGS_JSON | ARGS_TAGGED (PARAM_NAME -> PARAM_VALUE)* -> AFTER_INVOCATION
    AFTER_INVOCATION -block_close-> AFTER_BLOCK -> ANSWER | BLOCK

Phases (recipient frames)::

    FRAME_IDLE -header_start-> FRAME_HEADER -message_start-> FRAME_REASONING | FRAME_CONTENT | FRAME_TOOL
    FRAME_TOOL -block_open-> BLOCK ... -> FRAME_TOOL_DONE -end|eom-> FRAME_IDLE

Malformed output never raises and is never dropped: the raw text surfaces as content next to a
typed ParseError, and a started call is ended with `complete=False`.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from helios_proto import contract_pb2 as pb

from .events import (
    ContentDelta,
    ParseError,
    ParseErrorKind,
    ReasoningDelta,
    SyntaxEvent,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from .markup import Markup, earliest, partial_suffix
from .prompt_state import InitialState, ReasoningStart
from .tables import FrontendSyntax

# Longest name or header the engine waits for before it calls the text malformed (characters).
_MAX_NAME = 256


class Phase(enum.Enum):
    START = "start"
    REASONING = "reasoning"
    ANSWER_LEAD = "answer_lead"
    ANSWER = "answer"
    OPAQUE = "opaque"
    BLOCK = "block"
    INVOKE_NAME = "invoke_name"
    ARGS_JSON = "args_json"
    ARGS_TAGGED = "args_tagged"
    PARAM_NAME = "param_name"
    PARAM_VALUE = "param_value"
    AFTER_INVOCATION = "after_invocation"
    AFTER_BLOCK = "after_block"
    FRAME_IDLE = "frame_idle"
    FRAME_HEADER = "frame_header"
    FRAME_REASONING = "frame_reasoning"
    FRAME_CONTENT = "frame_content"
    FRAME_TOOL = "frame_tool"
    FRAME_TOOL_DONE = "frame_tool_done"


_TOOL_PHASES = frozenset(
    {Phase.BLOCK, Phase.INVOKE_NAME, Phase.ARGS_JSON, Phase.ARGS_TAGGED, Phase.PARAM_NAME, Phase.PARAM_VALUE, Phase.AFTER_INVOCATION}
)


def syntax_delimiters(syntax: FrontendSyntax) -> list[str]:
    """Every delimiter spelling of a syntax (the markup alphabet)."""
    t, r = syntax.tool, syntax.reasoning
    return [
        t.block_open, t.block_close, t.invocation_open_prefix, t.invocation_open_suffix, t.invocation_close,
        t.parameter_open_prefix, t.parameter_open_suffix, t.parameter_close,
        r.open, r.close, r.terminal_marker, r.header_start, r.message_start, r.message_end, r.message_continue,
    ]


@dataclass(frozen=True)
class ModelSyntax:
    """Syntax data plus its delimiter patterns for one tokenizer; built once at load."""

    syntax: FrontendSyntax
    markup: Markup

    @classmethod
    def build(cls, syntax: FrontendSyntax, atomic_tokens: Mapping[str, int]) -> "ModelSyntax":
        return cls(syntax, Markup.build(syntax_delimiters(syntax), atomic_tokens))

    def engine(
        self,
        initial: InitialState,
        tools: Mapping[str, Mapping[str, Any]] | None = None,
        *,
        structured_answer: bool = False,
        call_id_prefix: str = "call_",
    ) -> "SyntaxEngine":
        return SyntaxEngine(self, initial, tools, structured_answer=structured_answer, call_id_prefix=call_id_prefix)


def is_string_schema(schema: Mapping[str, Any] | None) -> bool:
    """Tagged parameter values are raw text for string parameters, JSON for every other type."""
    if not isinstance(schema, Mapping):
        return True
    kind = schema.get("type")
    if kind is None:
        values = schema.get("enum")
        if isinstance(values, list) and values:
            return all(isinstance(v, str) for v in values)
        return "properties" not in schema and "items" not in schema
    return kind == "string"


class SyntaxEngine:
    """Parser state of one response. Not thread-safe; one per request."""

    def __init__(
        self,
        model: ModelSyntax,
        initial: InitialState,
        tools: Mapping[str, Mapping[str, Any]] | None,
        *,
        structured_answer: bool,
        call_id_prefix: str,
    ) -> None:
        self._syntax = model.syntax
        self._markup = model.markup
        self._tools = dict(tools or {})
        self._tools_enabled = model.syntax.has_tools and bool(self._tools)
        self._structured = structured_answer
        self._call_id_prefix = call_id_prefix
        m = self._markup
        t, r = self._syntax.tool, self._syntax.reasoning
        p = m.pattern
        self._p_open, self._p_close, self._p_terminal = p(r.open), p(r.close), p(r.terminal_marker)
        self._p_block_open, self._p_block_close = p(t.block_open), p(t.block_close)
        self._p_inv_prefix, self._p_inv_suffix, self._p_inv_close = (
            p(t.invocation_open_prefix), p(t.invocation_open_suffix), p(t.invocation_close))
        self._p_param_prefix, self._p_param_suffix, self._p_param_close = (
            p(t.parameter_open_prefix), p(t.parameter_open_suffix), p(t.parameter_close))
        self._p_header, self._p_message = p(r.header_start), p(r.message_start)
        self._p_frame_ends = [x for x in (p(r.message_end), p(r.message_continue)) if x]
        # Atomic reasoning delimiters met after reasoning ended are markup and dropped (FE-11);
        # a plain-text spelling is ordinary text (FE-12), so only atomic ones are listed.
        self._p_stray_markup = [p(s) for s in (r.open, r.close) if s and m.is_atomic(s)]

        self._buf = ""
        self._final = False
        self._events: list[SyntaxEvent] = []
        self._strip_lead = False  # drop one wrapping newline at the start of the next text
        self._in_frame = False
        self._required_name: str | None = None  # named tool recipient
        self._frame_invocations = 0
        self._header = ""
        self._stray_reported = False
        self._raw = ""  # parse text of the tool markup not yet represented by events
        self._calls = 0
        self._call_open = False
        self._call_params = 0
        self._call_ok = True
        self._call_schema: Mapping[str, Any] = {}
        self._args_text = ""
        self._value = ""
        self._value_is_string = True
        self._reported_unterminated = False
        self._phase = self._initial_phase(initial)

    # ---- public API ---------------------------------------------------------------------------
    def feed(self, token_id: int, text: str) -> list[SyntaxEvent]:
        """One generated token (or a fragment of its text); returns the events it completes."""
        if self._final:
            raise RuntimeError("feed after finish")
        self._buf += self._markup.text_of(token_id, text)
        self._pump()
        return self._drain()

    def feed_many(self, pieces: Iterable[tuple[int, str]]) -> list[SyntaxEvent]:
        """Several tokens at once (a multi-token delta)."""
        if self._final:
            raise RuntimeError("feed after finish")
        for token_id, text in pieces:
            self._buf += self._markup.text_of(token_id, text)
        self._pump()
        return self._drain()

    def finish(self) -> list[SyntaxEvent]:
        """End of output (EOS, length, stop, cancel): resolve held text and report what is open."""
        if not self._final:
            self._final = True
            self._pump()
            if self._phase in _TOOL_PHASES:
                self._malformed(ParseErrorKind.TRUNCATED_TOOL_CALL, "output ended inside a tool call")
                self._pump()
            elif self._phase is Phase.FRAME_HEADER:
                self._header += self._markup.render(self._take(len(self._buf)))
                self._malformed_frame("output ended inside a frame header", self._header_raw())
                self._pump()
            if self._phase in (Phase.REASONING, Phase.FRAME_REASONING) and not self._reported_unterminated:
                self._reported_unterminated = True
                self._events.append(ParseError(ParseErrorKind.UNTERMINATED_REASONING, "output ended inside reasoning"))
        return self._drain()

    @property
    def phase(self) -> Phase:
        return self._phase

    # ---- plumbing -----------------------------------------------------------------------------
    def _initial_phase(self, initial: InitialState) -> Phase:
        start = initial.start
        if self._syntax.uses_recipient_frames:
            if start is ReasoningStart.FRAME_HEADER_OPEN:
                self._header = initial.header_prefix
                return Phase.FRAME_HEADER
            if start is ReasoningStart.FRAME_BODY:
                return self._enter_frame_body(initial.recipient, raw="")
            return Phase.FRAME_IDLE
        if not self._syntax.has_delimited_reasoning or start is ReasoningStart.CLOSED:
            return Phase.ANSWER_LEAD if self._syntax.has_delimited_reasoning else Phase.ANSWER
        if start is ReasoningStart.OPEN:
            self._strip_lead = self._syntax.reasoning.wrap_newlines and not initial.newline_consumed
            return Phase.REASONING
        return Phase.START

    def _drain(self) -> list[SyntaxEvent]:
        out, self._events = self._events, []
        return out

    def _pump(self) -> None:
        handlers = _HANDLERS
        while handlers[self._phase](self):
            pass

    def _take(self, n: int) -> str:
        taken, self._buf = self._buf[:n], self._buf[n:]
        self._raw += taken
        return taken

    def _skip_space(self) -> bool:
        n = len(self._buf) - len(self._buf.lstrip())
        if n:
            self._take(n)
        return n > 0

    def _text(self, kind: type, text: str) -> None:
        if text:
            self._events.append(kind(self._markup.render(text)))

    def _args(self, fragment: str) -> None:
        if fragment:
            self._events.append(ToolCallArgumentsDelta(self._calls - 1, fragment))

    def _waits_for(self, *patterns: str, text: str | None = None) -> bool:
        """`text` (default: the buffer) is a proper prefix of a pattern: wait, unless the output
        ended (then there is nothing more to wait for and the text is resolved as it is)."""
        return not self._final and self._is_partial(self._buf if text is None else text, patterns)

    def _tool_waits_for(self, *patterns: str) -> bool:
        """Inside a tool call a partial marker waits even at the end: `finish` reports the call
        as truncated, which is what it is."""
        return self._is_partial(self._buf, patterns)

    @staticmethod
    def _is_partial(text: str, patterns: Iterable[str]) -> bool:
        return any(p and p.startswith(text) and p != text for p in patterns)

    def _interrupts(self) -> list[str]:
        """Markers that cut a tool call short: a frame end or a new header inside a frame."""
        return [*self._p_frame_ends, self._p_header] if self._in_frame else []

    # ---- reasoning and answer -----------------------------------------------------------------
    def _start(self) -> bool:
        buf = self._buf
        rest = buf.lstrip()
        if not rest and not self._final:
            return False
        if self._p_open and rest.startswith(self._p_open):
            self._take(len(buf) - len(rest) + len(self._p_open))
            self._raw = ""
            self._strip_lead = self._syntax.reasoning.wrap_newlines
            self._phase = Phase.REASONING
            return True
        if self._waits_for(self._p_open, text=rest):
            return False
        self._phase = Phase.ANSWER
        return True

    def _reasoning(self) -> bool:
        wrap = self._syntax.reasoning.wrap_newlines
        if self._strip_lead:
            if not self._buf:
                return False
            if self._buf[0] == "\n":
                self._take(1)
            self._strip_lead = False
        ends = [self._p_close, *self._p_stray_markup]
        if self._tools_enabled and self._p_terminal:
            ends.append(self._p_terminal)
        hit = earliest(self._buf, ends)
        if hit is not None:
            at, pattern = hit
            text = self._buf[:at]
            if wrap and pattern in (self._p_close, self._p_terminal) and text.endswith("\n"):
                text = text[:-1]
            self._text(ReasoningDelta, text)
            self._take(at + len(pattern))
            if pattern == self._p_close:
                self._phase = Phase.ANSWER_LEAD
            elif pattern == self._p_terminal:
                self._begin_block(pattern)
            return True  # a re-opening token is markup: dropped
        hold = 0 if self._final else partial_suffix(self._buf, ends)
        emit = self._buf[: len(self._buf) - hold]
        if wrap and not self._final and emit.endswith("\n"):
            emit = emit[:-1]  # may be the wrapping newline before the close delimiter
        self._text(ReasoningDelta, emit)
        self._take(len(emit))
        return False

    def _answer_lead(self) -> bool:
        if self._syntax.reasoning.wrap_newlines:
            stripped = self._buf.lstrip("\n")
            self._take(len(self._buf) - len(stripped))
        if not self._buf and not self._final:
            return False
        self._phase = Phase.ANSWER
        return True

    def _answer(self) -> bool:
        if self._structured:
            # A structured answer is one opaque document; only a tool block may precede it.
            rest = self._buf.lstrip()
            if self._tools_enabled and rest.startswith(self._p_block_open):
                self._take(len(self._buf) - len(rest) + len(self._p_block_open))
                self._begin_block(self._p_block_open)
                return True
            if (not rest and not self._final) or (self._tools_enabled and self._waits_for(self._p_block_open, text=rest)):
                return False
            self._phase = Phase.OPAQUE
            return True
        markers = [*self._p_stray_markup]
        if self._tools_enabled:
            markers.append(self._p_block_open)
        hit = earliest(self._buf, markers)
        if hit is not None:
            at, pattern = hit
            self._text(ContentDelta, self._buf[:at])
            self._take(at + len(pattern))
            if pattern == self._p_block_open:
                self._begin_block(pattern)
            return True
        hold = 0 if self._final else partial_suffix(self._buf, markers)
        self._text(ContentDelta, self._buf[: len(self._buf) - hold])
        self._take(len(self._buf) - hold)
        return False

    def _opaque(self) -> bool:
        self._text(ContentDelta, self._buf)
        self._take(len(self._buf))
        return False

    # ---- tool blocks --------------------------------------------------------------------------
    def _begin_block(self, opener: str) -> None:
        self._raw = opener
        self._phase = Phase.BLOCK

    def _end_block(self) -> None:
        self._raw = ""
        self._phase = Phase.FRAME_TOOL_DONE if self._in_frame else Phase.AFTER_BLOCK

    def _invocation_end(self) -> str:
        return self._p_inv_close or self._p_block_close

    def _block(self) -> bool:
        self._skip_space()
        if not self._buf:
            return False
        if self._p_block_close and self._buf.startswith(self._p_block_close):
            self._take(len(self._p_block_close))
            self._end_block()
            return True
        if self._p_inv_prefix:
            if self._buf.startswith(self._p_inv_prefix):
                self._take(len(self._p_inv_prefix))
                self._phase = Phase.INVOKE_NAME
                return True
            if self._tool_waits_for(self._p_inv_prefix, self._p_block_close, *self._interrupts()):
                return False
            return self._malformed(ParseErrorKind.MALFORMED_TOOL_CALL, "expected an invocation")
        if self._tool_waits_for(self._p_block_close, *self._interrupts()):
            return False  # may still become an (empty) block close
        self._phase = Phase.INVOKE_NAME  # the name follows the block opener directly
        return True

    def _invoke_name(self) -> bool:
        ends = [self._p_inv_suffix, *self._interrupts()]
        if not self._p_inv_close:
            ends.append(self._p_block_close)  # a call without arguments
        hit = earliest(self._buf, ends)
        if hit is None:
            if len(self._buf) > _MAX_NAME:
                return self._malformed(ParseErrorKind.MALFORMED_TOOL_CALL, "invocation name too long")
            return False
        at, pattern = hit
        if pattern in self._interrupts():
            return self._malformed(ParseErrorKind.TRUNCATED_TOOL_CALL, "frame ended inside a tool call")
        name = self._markup.render(self._buf[:at]).strip()
        if self._in_frame and self._frame_invocations >= 1:
            return self._malformed(ParseErrorKind.EXTRA_INVOCATION, "a recipient frame carries one invocation")
        if self._required_name is not None and name != self._required_name:
            return self._malformed(
                ParseErrorKind.RECIPIENT_MISMATCH, f"invocation {name!r} in a frame addressed to {self._required_name!r}")
        if name not in self._tools:
            return self._malformed(ParseErrorKind.UNKNOWN_TOOL, f"tool {name!r} is not registered on the request")
        self._take(at + len(pattern))
        self._start_call(name)
        if pattern == self._p_inv_suffix:
            tagged = self._syntax.tool.argument_encoding == pb.ARGUMENT_ENCODING_TAGGED_PARAMETERS
            self._phase = Phase.ARGS_TAGGED if tagged else Phase.ARGS_JSON
        else:
            self._args("{}")
            self._end_call()
            self._end_block()
        return True

    def _start_call(self, name: str) -> None:
        index = self._calls
        self._calls += 1
        self._frame_invocations += 1
        self._call_open, self._call_params, self._call_ok = True, 0, True
        self._args_text = ""
        params = self._tools.get(name) or {}
        self._call_schema = params.get("properties", {}) if isinstance(params, Mapping) else {}
        self._raw = ""
        self._events.append(ToolCallStart(index, f"{self._call_id_prefix}{index}", name))

    def _end_call(self) -> None:
        self._call_open = False
        self._raw = ""
        self._events.append(ToolCallEnd(self._calls - 1, complete=self._call_ok))

    def _after_invocation_end(self, pattern: str) -> None:
        self._end_call()
        if pattern == self._p_inv_close:
            self._phase = Phase.AFTER_INVOCATION
        else:
            self._end_block()

    def _args_json(self) -> bool:
        end = self._invocation_end()
        if not self._args_text:
            self._skip_space()
        hit = earliest(self._buf, [end, *self._interrupts()])
        if hit is not None:
            at, pattern = hit
            if pattern != end:
                return self._malformed(ParseErrorKind.TRUNCATED_TOOL_CALL, "frame ended inside a tool call")
            text = self._markup.render(self._buf[:at]).rstrip()
            self._args_text += text
            self._args(text)
            self._take(at + len(pattern))
            if not self._args_text:
                self._args("{}")
            else:
                try:
                    valid = isinstance(json.loads(self._args_text), dict)
                except json.JSONDecodeError:
                    valid = False
                if not valid:
                    self._call_ok = False
                    self._events.append(
                        ParseError(ParseErrorKind.INVALID_ARGUMENTS, "arguments are not a JSON object", self._args_text))
            self._after_invocation_end(pattern)
            return True
        hold = 0 if self._final else partial_suffix(self._buf, [end, *self._interrupts()])
        emit = self._buf[: len(self._buf) - hold]
        if not self._final:
            emit = emit[: len(emit.rstrip())]  # trailing space may precede the end marker
        text = self._markup.render(emit)
        self._args_text += text
        self._args(text)
        self._take(len(emit))
        return False

    def _args_tagged(self) -> bool:
        self._skip_space()
        end = self._invocation_end()
        if not self._buf:
            return False
        if self._buf.startswith(self._p_param_prefix):
            self._take(len(self._p_param_prefix))
            self._phase = Phase.PARAM_NAME
            return True
        if self._buf.startswith(end):
            self._take(len(end))
            self._args("{}" if self._call_params == 0 else "}")
            self._after_invocation_end(end)
            return True
        if self._tool_waits_for(self._p_param_prefix, end, *self._interrupts()):
            return False
        if any(self._buf.startswith(p) for p in self._interrupts()):
            return self._malformed(ParseErrorKind.TRUNCATED_TOOL_CALL, "frame ended inside a tool call")
        return self._malformed(ParseErrorKind.MALFORMED_TOOL_CALL, "expected a parameter or the end of the invocation")

    def _param_name(self) -> bool:
        hit = earliest(self._buf, [self._p_param_suffix, *self._interrupts()])
        if hit is None:
            if len(self._buf) > _MAX_NAME:
                return self._malformed(ParseErrorKind.MALFORMED_TOOL_CALL, "parameter name too long")
            return False
        at, pattern = hit
        if pattern != self._p_param_suffix:
            return self._malformed(ParseErrorKind.TRUNCATED_TOOL_CALL, "frame ended inside a tool call")
        name = self._markup.render(self._buf[:at]).strip()
        self._take(at + len(pattern))
        self._value_is_string = is_string_schema(self._call_schema.get(name))
        fragment = ("{" if self._call_params == 0 else ", ") + json.dumps(name, ensure_ascii=False) + ": "
        self._args(fragment + ('"' if self._value_is_string else ""))
        self._call_params += 1
        self._value = ""
        self._strip_lead = self._syntax.tool.wrap_newlines
        self._phase = Phase.PARAM_VALUE
        return True

    def _param_value(self) -> bool:
        wrap = self._syntax.tool.wrap_newlines
        if self._strip_lead:
            if not self._buf:
                return False
            if self._buf[0] == "\n":
                self._take(1)
            self._strip_lead = False
        ends = [self._p_param_close, *self._interrupts()]
        hit = earliest(self._buf, ends)
        if hit is not None:
            at, pattern = hit
            text = self._buf[:at]
            if wrap and text.endswith("\n"):
                text = text[:-1]
            self._value_piece(text)
            if pattern != self._p_param_close:
                self._take(at)
                return self._malformed(ParseErrorKind.TRUNCATED_TOOL_CALL, "frame ended inside a tool call")
            self._take(at + len(pattern))
            self._close_value()
            self._phase = Phase.ARGS_TAGGED
            return True
        hold = 0 if self._final else partial_suffix(self._buf, ends)
        emit = self._buf[: len(self._buf) - hold]
        if wrap and not self._final and emit.endswith("\n"):
            emit = emit[:-1]
        self._value_piece(emit)
        self._take(len(emit))
        return False

    def _value_piece(self, parse_text: str) -> None:
        text = self._markup.render(parse_text)
        if self._value_is_string:
            self._args(json.dumps(text, ensure_ascii=False)[1:-1])
        else:
            self._value += text

    def _close_value(self) -> None:
        if self._value_is_string:
            self._args('"')
            return
        value = self._value.strip()
        try:
            json.loads(value)
            self._args(value)
        except json.JSONDecodeError:
            # Keep the model's text as a JSON string rather than dropping it; flag the call.
            self._call_ok = False
            self._args(json.dumps(value, ensure_ascii=False))
            self._events.append(ParseError(ParseErrorKind.INVALID_ARGUMENTS, "parameter value is not JSON", value))

    def _after_invocation(self) -> bool:
        self._skip_space()
        if not self._buf:
            return False
        if self._p_block_close and self._buf.startswith(self._p_block_close):
            self._take(len(self._p_block_close))
            self._end_block()
            return True
        if self._p_inv_prefix and self._buf.startswith(self._p_inv_prefix):
            self._take(len(self._p_inv_prefix))
            self._phase = Phase.INVOKE_NAME
            return True
        if self._tool_waits_for(self._p_block_close, self._p_inv_prefix, *self._interrupts()):
            return False
        return self._malformed(ParseErrorKind.MALFORMED_TOOL_CALL, "expected another invocation or the block end")

    def _after_block(self) -> bool:
        rest = self._buf.lstrip()
        if rest.startswith(self._p_block_open):
            self._take(len(self._buf) - len(rest) + len(self._p_block_open))
            self._begin_block(self._p_block_open)
            return True
        if (not rest and not self._final) or self._waits_for(self._p_block_open, text=rest):
            return False
        self._take(len(self._buf) - len(rest))  # whitespace between blocks and the answer
        self._phase = Phase.ANSWER
        return True

    def _malformed(self, kind: ParseErrorKind, message: str) -> bool:
        """Leave the tool block: the unrepresented raw text becomes content, with a typed note."""
        raw = self._markup.render(self._raw)
        self._events.append(ParseError(kind, message, raw))
        if self._call_open:
            self._call_ok = False
            self._end_call()
        else:
            self._text(ContentDelta, self._raw)
        self._raw = ""
        self._phase = Phase.FRAME_CONTENT if self._in_frame else Phase.ANSWER
        return True

    # ---- recipient frames ---------------------------------------------------------------------
    def _header_raw(self) -> str:
        return self._markup.render(self._p_header) + self._header

    def _frame_idle(self) -> bool:
        self._in_frame = False
        rest = self._buf.lstrip()
        space = len(self._buf) - len(rest)
        if not rest:
            if self._final:
                self._take(space)  # whitespace between frames is not content
            return False
        if rest.startswith(self._p_header):
            self._take(space + len(self._p_header))
            self._header = ""
            self._stray_reported = False
            self._phase = Phase.FRAME_HEADER
            return True
        for end in self._p_frame_ends:
            if rest.startswith(end):
                self._take(space + len(end))  # a stray message end is markup
                return True
        if self._waits_for(self._p_header, *self._p_frame_ends, text=rest):
            return False
        # Text outside any frame: surface it as content, noted once per stray run.
        hit = earliest(self._buf, [self._p_header, *self._p_frame_ends])
        hold = 0 if self._final else partial_suffix(self._buf, [self._p_header, *self._p_frame_ends])
        upto = hit[0] if hit is not None else len(self._buf) - hold
        # Trailing whitespace stays buffered: before a header or at the end it is frame spacing.
        upto = len(self._buf[:upto].rstrip())
        if upto == 0:
            return False
        text = self._buf[:upto]
        if not self._stray_reported:
            self._stray_reported = True
            # No raw copy here: the stray run may still grow, and the content carries it anyway.
            self._events.append(ParseError(ParseErrorKind.MALFORMED_FRAME, "text outside a recipient frame"))
        self._text(ContentDelta, text)
        self._take(upto)
        return True

    def _frame_header(self) -> bool:
        hit = earliest(self._buf, [self._p_message, self._p_header, *self._p_frame_ends])
        if hit is None:
            if len(self._header) + len(self._buf) > _MAX_NAME:
                self._header += self._markup.render(self._take(len(self._buf)))
                return self._malformed_frame("frame header too long", self._header_raw())
            return False
        at, pattern = hit
        self._header += self._markup.render(self._take(at))
        if pattern != self._p_message:
            return self._malformed_frame("frame header without a message start", self._header_raw())
        self._take(len(pattern))
        r = self._syntax.reasoning
        expected = r.header_role + r.recipient_prefix
        raw = self._header_raw() + self._markup.render(self._p_message)
        if not self._header.startswith(expected):
            self._phase = self._enter_frame_body("", raw)
            return True
        self._phase = self._enter_frame_body(self._header[len(expected):].strip(), raw)
        return True

    def _malformed_frame(self, message: str, raw: str) -> bool:
        self._events.append(ParseError(ParseErrorKind.MALFORMED_FRAME, message, raw))
        if raw:
            self._events.append(ContentDelta(raw))
        self._header = ""
        self._phase = Phase.FRAME_IDLE
        return True

    def _enter_frame_body(self, recipient: str, raw: str) -> Phase:
        r = self._syntax.reasoning
        self._in_frame = True
        self._frame_invocations = 0
        self._required_name = None
        if recipient == r.reasoning_recipient:
            return Phase.FRAME_REASONING
        if recipient in r.content_recipients:
            return Phase.FRAME_CONTENT
        if self._tools_enabled and recipient == r.generic_tool_recipient:
            return Phase.FRAME_TOOL
        if self._tools_enabled and r.named_tool_prefix and recipient.startswith(r.named_tool_prefix):
            self._required_name = recipient[len(r.named_tool_prefix):]
            return Phase.FRAME_TOOL
        # Unknown recipient: the frame stays visible as content, never silently dropped.
        self._events.append(ParseError(ParseErrorKind.MALFORMED_FRAME, f"unknown recipient {recipient!r}", raw))
        if raw:
            self._events.append(ContentDelta(raw))
        return Phase.FRAME_CONTENT

    def _frame_body(self, kind: type) -> bool:
        ends = [*self._p_frame_ends, self._p_header]
        hit = earliest(self._buf, ends)
        if hit is not None:
            at, pattern = hit
            self._text(kind, self._buf[:at])
            self._take(at)
            if pattern == self._p_header:
                self._events.append(ParseError(ParseErrorKind.MALFORMED_FRAME, "header inside an unclosed frame"))
            else:
                self._take(len(pattern))
            self._phase = Phase.FRAME_IDLE
            return True
        hold = 0 if self._final else partial_suffix(self._buf, ends)
        self._text(kind, self._buf[: len(self._buf) - hold])
        self._take(len(self._buf) - hold)
        return False

    def _frame_reasoning(self) -> bool:
        return self._frame_body(ReasoningDelta)

    def _frame_content(self) -> bool:
        return self._frame_body(ContentDelta)

    def _frame_tool(self) -> bool:
        self._skip_space()
        if not self._buf:
            return False
        if self._buf.startswith(self._p_block_open):
            self._take(len(self._p_block_open))
            self._begin_block(self._p_block_open)
            return True
        if self._waits_for(self._p_block_open):
            return False
        self._raw = ""
        return self._malformed(ParseErrorKind.MALFORMED_TOOL_CALL, "a tool frame must hold a tool block")

    def _frame_tool_done(self) -> bool:
        self._skip_space()
        if not self._buf:
            return False
        for end in self._p_frame_ends:
            if self._buf.startswith(end):
                self._take(len(end))
                self._phase = Phase.FRAME_IDLE
                return True
        if self._buf.startswith(self._p_header):
            self._phase = Phase.FRAME_IDLE
            return True
        if self._waits_for(self._p_header, *self._p_frame_ends):
            return False
        if self._buf.startswith(self._p_block_open) or self._buf.startswith(self._p_inv_prefix):
            return self._malformed(ParseErrorKind.EXTRA_INVOCATION, "a recipient frame carries one invocation")
        return self._malformed(ParseErrorKind.MALFORMED_TOOL_CALL, "text after the tool block of a frame")


_HANDLERS = {
    Phase.START: SyntaxEngine._start,
    Phase.REASONING: SyntaxEngine._reasoning,
    Phase.ANSWER_LEAD: SyntaxEngine._answer_lead,
    Phase.ANSWER: SyntaxEngine._answer,
    Phase.OPAQUE: SyntaxEngine._opaque,
    Phase.BLOCK: SyntaxEngine._block,
    Phase.INVOKE_NAME: SyntaxEngine._invoke_name,
    Phase.ARGS_JSON: SyntaxEngine._args_json,
    Phase.ARGS_TAGGED: SyntaxEngine._args_tagged,
    Phase.PARAM_NAME: SyntaxEngine._param_name,
    Phase.PARAM_VALUE: SyntaxEngine._param_value,
    Phase.AFTER_INVOCATION: SyntaxEngine._after_invocation,
    Phase.AFTER_BLOCK: SyntaxEngine._after_block,
    Phase.FRAME_IDLE: SyntaxEngine._frame_idle,
    Phase.FRAME_HEADER: SyntaxEngine._frame_header,
    Phase.FRAME_REASONING: SyntaxEngine._frame_reasoning,
    Phase.FRAME_CONTENT: SyntaxEngine._frame_content,
    Phase.FRAME_TOOL: SyntaxEngine._frame_tool,
    Phase.FRAME_TOOL_DONE: SyntaxEngine._frame_tool_done,
}
