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
    ANSWER -fence_open-> FENCE -> AFTER_BLOCK (a JSON call) | ANSWER (anything else: text)

Phases (recipient frames)::

    FRAME_IDLE -header_start-> FRAME_HEADER -message_start-> FRAME_REASONING | FRAME_CONTENT | FRAME_TOOL
    FRAME_TOOL -block_open-> BLOCK ... -> FRAME_TOOL_DONE -end|eom-> FRAME_IDLE

Malformed output never raises and is never dropped: the raw text surfaces as content next to a
typed ParseError, and a started call is ended with `complete=False`. Output that ends inside tool
markup (an output limit) is the exception: the cut markup is in the TRUNCATED_TOOL_CALL error,
never content, as a client reads a cut call from the OpenAI API (finish_reason `length`).

Layout: `phases.py` (the Phase enum), `scanner.py` (buffer plumbing and the state attributes),
`tool_phases.py` and `frame_phases.py` (phase handlers by group), this module (reasoning and
answer phases, the public API and the handler table).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from .events import ContentDelta, ParseError, ParseErrorKind, ReasoningDelta, SyntaxEvent
from .frame_phases import FramePhases
from .json_extent import JsonExtent
from .markup import Markup, earliest, partial_suffix
from .phases import TOOL_PHASES, Phase
from .prompt_state import InitialState, ReasoningStart
from .tables import FrontendSyntax
from .tool_phases import fence_arguments_key, is_string_schema

END_FLUSH = -1          # the token id of text flushed at the end of output (held text, a split character)
_REPLACEMENT = "\ufffd"  # what the decoder makes of a character the end of output split
# Tool phases whose leftover text at the end cannot complete: everything held there is cut markup
# (values and JSON arguments flush their text into the call first)
_CUT_PHASES = TOOL_PHASES - {Phase.PARAM_VALUE, Phase.ARGS_JSON}

__all__ = ["ModelSyntax", "Phase", "SyntaxEngine", "is_string_schema", "syntax_delimiters"]


def syntax_delimiters(syntax: FrontendSyntax) -> list[str]:
    """Every delimiter spelling of a syntax (the markup alphabet)."""
    t, r = syntax.tool, syntax.reasoning
    return [
        t.block_open, t.block_close, t.invocation_open_prefix, t.next_invocation_open_prefix,
        t.invocation_open_suffix, t.invocation_close,
        t.parameter_open_prefix, t.parameter_open_suffix, t.parameter_close, t.fence_open, t.fence_close,
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



class SyntaxEngine(FramePhases):
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
        self._p_next_prefix = p(t.next_invocation_open_prefix) or self._p_inv_prefix
        self._p_param_prefix, self._p_param_suffix, self._p_param_close = (
            p(t.parameter_open_prefix), p(t.parameter_open_suffix), p(t.parameter_close))
        self._p_fence_open, self._p_fence_close = p(t.fence_open), p(t.fence_close)
        self._fence_arguments_key = fence_arguments_key(t) or ""
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
        self._args_extent = JsonExtent()
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
        if token_id == END_FLUSH:
            return []                 # finish() reads it: it may complete cut markup (a split character)
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
            if self._phase in _CUT_PHASES or self._cut_opener():
                self._truncated_markup()
            self._pump()
            if self._phase in TOOL_PHASES:
                self._truncated_markup()
            elif self._phase is Phase.FRAME_HEADER:
                self._header += self._markup.render(self._take(len(self._buf)))
                self._malformed_frame("output ended inside a frame header", self._header_raw(), visible=False)
                self._pump()
            if self._phase in (Phase.REASONING, Phase.FRAME_REASONING) and not self._reported_unterminated:
                self._reported_unterminated = True
                self._events.append(ParseError(ParseErrorKind.UNTERMINATED_REASONING, "output ended inside reasoning"))
        return self._drain()

    def _truncated_markup(self) -> None:
        """The output ended inside tool or frame markup (an output limit): a started call ends
        incomplete with the arguments it has; markup that began no call is reported, never
        content."""
        self._take(len(self._buf))
        if self._phase in (Phase.FRAME_IDLE, Phase.FRAME_TOOL_DONE):
            raw, self._raw = self._markup.render(self._raw), ""
            self._malformed_frame("output ended inside a frame header", raw.strip(), visible=False)
        else:
            self._malformed(ParseErrorKind.TRUNCATED_TOOL_CALL, "output ended inside a tool call", visible=False)
        self._pump()

    def _cut_opener(self) -> bool:
        """The output ends inside markup that the phase expects next: a tool block's opener
        after a block or in a tool frame, a frame header (or a frame end) between frames."""
        rest = self._buf.lstrip().rstrip(_REPLACEMENT)   # a character split by the cut
        expected = {Phase.AFTER_BLOCK: [self._p_block_open], Phase.FRAME_TOOL: [self._p_block_open],
                    Phase.FRAME_IDLE: [self._p_header],
                    Phase.FRAME_TOOL_DONE: [self._p_header, *self._p_frame_ends]}.get(self._phase, [])
        if self._phase is Phase.AFTER_BLOCK and not self._tools_enabled:
            return False
        return bool(rest) and any(p and p != rest and p.startswith(rest) for p in expected)

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
        if not self._drop_wrapping_newline():
            return False
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
            markers += [self._p_block_open, self._p_fence_open]
        hit = earliest(self._buf, markers)
        if hit is not None:
            at, pattern = hit
            self._text(ContentDelta, self._buf[:at])
            self._take(at + len(pattern))
            if pattern == self._p_block_open:
                self._begin_block(pattern)
            elif pattern == self._p_fence_open:
                self._raw = pattern
                self._phase = Phase.FENCE
            return True
        hold = 0 if self._final else partial_suffix(self._buf, markers)
        self._text(ContentDelta, self._buf[: len(self._buf) - hold])
        self._take(len(self._buf) - hold)
        return False

    def _opaque(self) -> bool:
        self._text(ContentDelta, self._buf)
        self._take(len(self._buf))
        return False


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
    Phase.FENCE: SyntaxEngine._fence,
    Phase.FRAME_IDLE: SyntaxEngine._frame_idle,
    Phase.FRAME_HEADER: SyntaxEngine._frame_header,
    Phase.FRAME_REASONING: SyntaxEngine._frame_reasoning,
    Phase.FRAME_CONTENT: SyntaxEngine._frame_content,
    Phase.FRAME_TOOL: SyntaxEngine._frame_tool,
    Phase.FRAME_TOOL_DONE: SyntaxEngine._frame_tool_done,
}
