"""The engine's buffer plumbing and state, shared by its phase groups.

`SyntaxEngine.__init__` sets every attribute annotated here; the phase mixins (tool_phases,
frame_phases) and the engine read and write them. One instance per response.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from .events import SyntaxEvent, ToolCallArgumentsDelta
from .json_extent import JsonExtent
from .markup import Markup
from .phases import Phase
from .tables import FrontendSyntax


class ScannerBase:
    _syntax: FrontendSyntax
    _markup: Markup
    _tools: dict[str, Mapping[str, Any]]
    _tools_enabled: bool
    _structured: bool
    _call_id_prefix: str
    # delimiter patterns (markup.py): "" when the syntax has no such delimiter
    _p_open: str
    _p_close: str
    _p_terminal: str
    _p_block_open: str
    _p_block_close: str
    _p_inv_prefix: str
    _p_next_prefix: str  # a later invocation of the same block (the first one's prefix unless declared)
    _p_inv_suffix: str
    _p_inv_close: str
    _p_param_prefix: str
    _p_param_suffix: str
    _p_param_close: str
    _p_fence_open: str
    _p_fence_close: str
    _fence_arguments_key: str  # the invocation object's arguments member (fenced calls)
    _p_header: str
    _p_message: str
    _p_frame_ends: list[str]
    _p_stray_markup: list[str]
    # parse state
    _buf: str  # parse text not yet decided
    _final: bool  # finish() was called: nothing more will arrive
    _events: list[SyntaxEvent]
    _phase: Phase
    _strip_lead: bool  # drop one wrapping newline at the start of the next text
    _in_frame: bool
    _required_name: str | None  # named tool recipient
    _frame_invocations: int
    _header: str
    _stray_reported: bool
    _raw: str  # parse text of the tool markup not yet represented by events
    _calls: int
    _call_open: bool
    _call_params: int
    _call_ok: bool
    _call_schema: Mapping[str, Any]
    _args_text: str
    _args_extent: JsonExtent  # where the JSON arguments object ends
    _value: str
    _value_is_string: bool
    _reported_unterminated: bool

    def _take(self, n: int) -> str:
        taken, self._buf = self._buf[:n], self._buf[n:]
        self._raw += taken
        return taken

    def _drop_wrapping_newline(self) -> bool:
        """After an open tag whose syntax wraps values in newlines, drop one leading newline.
        False while that cannot be decided yet (nothing buffered)."""
        if self._strip_lead:
            if not self._buf:
                return False
            if self._buf[0] == "\n":
                self._take(1)
            self._strip_lead = False
        return True

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
