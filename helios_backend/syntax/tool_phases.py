"""Tool-block phases of the engine: block, invocation name, JSON or tagged arguments."""

from __future__ import annotations

import json
import re
from typing import Any, Mapping, Optional

from helios_proto import contract_pb2 as pb

from .events import ContentDelta, ParseError, ParseErrorKind, ToolCallEnd, ToolCallStart
from .json_extent import JsonExtent
from .markup import earliest, partial_suffix
from .phases import MAX_FENCE, MAX_NAME, Phase
from .scanner import ScannerBase


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



_FENCED_CALL_START = '{"name":"'   # a fenced call's text, whitespace removed, starts so
_FENCE_LOOK = 256                  # characters of a fence read for that start
_MEMBER = re.compile(r'"([^"]+)"\s*:')


def fence_arguments_key(tool: pb.ToolSyntax) -> Optional[str]:
    """The member that holds a fenced call's arguments: the one the invocation's suffix names
    (`", "arguments": ` -> arguments); None where the suffix names none."""
    found = _MEMBER.search(tool.invocation_open_suffix)
    return found.group(1) if found else None


class ToolPhases(ScannerBase):
    # ---- tool blocks --------------------------------------------------------------------------
    def _begin_block(self, opener: str) -> None:
        self._raw = opener
        self._phase = Phase.BLOCK

    def _end_block(self) -> None:
        self._raw = ""
        self._phase = Phase.FRAME_TOOL_DONE if self._in_frame else Phase.AFTER_BLOCK

    def _invocation_end(self) -> str:
        return self._p_inv_close or self._p_block_close

    def _closes_block(self) -> bool:
        """Skip whitespace; if the block's closing tag follows, consume it and end the block."""
        self._skip_space()
        if self._p_block_close and self._buf.startswith(self._p_block_close):
            self._take(len(self._p_block_close))
            self._end_block()
            return True
        return False

    def _block(self) -> bool:
        if self._closes_block():
            return True
        if not self._buf:
            return False
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
            if len(self._buf) > MAX_NAME:
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
        self._args_extent = JsonExtent()
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
        hit = self._json_arguments_end(end)
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
        self._args_extent.advance(emit)
        self._take(len(emit))
        return False

    def _json_arguments_end(self, end: str) -> tuple[int, str] | None:
        """The first interrupt or invocation end. An end delimiter that starts like a JSON closer
        ("}": the JSON-call syntax) only counts after the arguments object's final brace; any
        other delimiter ends the arguments wherever it appears (a truncated object included)."""
        hit = earliest(self._buf, self._interrupts())
        start = self._args_extent.end_search_start(self._buf) if end[:1] in "}]" else 0
        if start is None:
            return hit
        found = earliest(self._buf[start:], [end])
        if found is None:
            return hit
        at = found[0] + start
        if hit is None or at < hit[0] or (at == hit[0] and len(end) > len(hit[1])):
            return at, end
        return hit

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
            if len(self._buf) > MAX_NAME:
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
        if not self._drop_wrapping_newline():
            return False
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
        if self._closes_block():
            return True
        if not self._buf:
            return False
        if self._p_next_prefix and self._buf.startswith(self._p_next_prefix):
            self._take(len(self._p_next_prefix))
            self._phase = Phase.INVOKE_NAME
            return True
        if self._tool_waits_for(self._p_block_close, self._p_next_prefix, *self._interrupts()):
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

    # ---- fenced calls ------------------------------------------------------------------------
    def _fence(self) -> bool:
        """Inside a fence that may hold a JSON call (ToolSyntax.fence_open): held back until its
        close, then a call if it holds exactly {"name": a registered tool, <arguments key>: an
        object}; released as answer text as soon as it cannot be one (another first member, too
        long, or not such an object at its close or the end of output)."""
        hit = earliest(self._buf, [self._p_fence_close])
        body = self._buf if hit is None else self._buf[:hit[0]]
        # the first characters decide the start (whitespace aside): a bounded look, not the whole
        # held text again for every token of a long fence
        compact = "".join(self._markup.render(body[:_FENCE_LOOK]).split())[:len(_FENCED_CALL_START)]
        if len(body) > MAX_FENCE or not (compact.startswith(_FENCED_CALL_START) or _FENCED_CALL_START.startswith(compact)):
            return self._release_fence()
        if hit is None and not self._final:
            return False
        call = self._fenced_call(self._markup.render(body))
        if call is None:
            return self._release_fence()
        self._take(len(body) + (len(hit[1]) if hit is not None else 0))
        name, arguments = call
        self._start_call(name)
        self._args(json.dumps(arguments, ensure_ascii=False))
        self._end_call()
        self._phase = Phase.AFTER_BLOCK
        return True

    def _fenced_call(self, body: str) -> tuple[str, dict[str, Any]] | None:
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(value, dict) or not set(value) <= {"name", self._fence_arguments_key}:
            return None
        name, arguments = value.get("name"), value.get(self._fence_arguments_key, {})
        if not isinstance(name, str) or name not in self._tools or not isinstance(arguments, dict):
            return None
        return name, arguments

    def _release_fence(self) -> bool:
        """Not a call: the fence opener is answer text; what follows it is read as answer again."""
        self._text(ContentDelta, self._raw)
        self._raw = ""
        self._phase = Phase.ANSWER
        return True

    def _malformed(self, kind: ParseErrorKind, message: str, visible: bool = True) -> bool:
        """Leave the tool block: the unrepresented raw text becomes content (unless not
        `visible`: cut markup), with a typed note that carries it."""
        raw = self._markup.render(self._raw)
        self._events.append(ParseError(kind, message, raw))
        if self._call_open:
            self._call_ok = False
            self._end_call()
        elif visible:
            self._text(ContentDelta, self._raw)
        self._raw = ""
        self._phase = Phase.FRAME_CONTENT if self._in_frame else Phase.ANSWER
        return True
