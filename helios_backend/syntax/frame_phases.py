"""Recipient-frame phases of the engine: headers, reasoning/content bodies, tool frames."""

from __future__ import annotations

from .events import ContentDelta, ParseError, ParseErrorKind, ReasoningDelta
from .markup import earliest, partial_suffix
from .phases import MAX_NAME, Phase
from .tool_phases import ToolPhases


class FramePhases(ToolPhases):
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
            if len(self._header) + len(self._buf) > MAX_NAME:
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
