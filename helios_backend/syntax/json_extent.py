"""Where a JSON object that opens a text ends: braces counted outside strings.

JSON-encoded tool arguments are followed by the invocation's closing delimiter. When that
delimiter can itself occur inside JSON (the JSON-call syntax closes its invocation with "}"),
the first occurrence is not the end; the end is the brace that balances the object's first one.
The scanner is fed the argument text in pieces as it is taken from the engine's buffer (state
carries across pieces, so each character is counted once) and can look ahead into the buffer
without consuming it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class JsonExtent:
    """Brace depth of the argument text taken so far (strings and escapes respected)."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    started: bool = False   # the first non-space character was seen
    is_object: bool = False  # ... and it was "{"
    closed: bool = False    # the object's final brace was seen

    def _step(self, ch: str) -> None:
        if not self.started:
            if ch.isspace():
                return
            self.started, self.is_object = True, ch == "{"
        if not self.is_object or self.closed:
            return
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            self.closed = self.depth == 0

    def advance(self, text: str) -> None:
        for ch in text:
            self._step(ch)

    def end_search_start(self, text: str) -> int | None:
        """Where in `text` (the not yet taken continuation) the closing delimiter may begin: just
        after the object's final brace; 0 when the arguments are not an object (their end is the
        first delimiter, and a malformed value is reported by the caller); None while the object
        is still open at the end of `text`."""
        if self.closed or (self.started and not self.is_object):
            return 0
        probe = JsonExtent(self.depth, self.in_string, self.escaped, self.started, self.is_object, self.closed)
        for at, ch in enumerate(text):
            probe._step(ch)
            if probe.closed:
                return at + 1
            if probe.started and not probe.is_object:
                return 0
        return None
