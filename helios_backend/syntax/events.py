"""What the syntax engine emits, and the one-shot fold of those events.

The presentation layer maps ContentDelta to `delta.content`, ReasoningDelta to
`delta.reasoning_content`, ToolCall* to `delta.tool_calls[index]` (id and name on start, argument
fragments after), and ParseError to a typed note (the raw text has already been emitted as
content, so nothing the model produced is lost).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Iterable, Union


class ParseErrorKind(enum.Enum):
    UNKNOWN_TOOL = "unknown_tool"  # invocation names a tool the request did not register
    RECIPIENT_MISMATCH = "recipient_mismatch"  # named tool recipient vs invocation name
    MALFORMED_TOOL_CALL = "malformed_tool_call"  # unexpected text inside a tool block
    TRUNCATED_TOOL_CALL = "truncated_tool_call"  # output ended inside a tool block
    INVALID_ARGUMENTS = "invalid_arguments"  # arguments that are not the declared JSON
    EXTRA_INVOCATION = "extra_invocation"  # a second invocation in a one-invocation frame
    UNTERMINATED_REASONING = "unterminated_reasoning"  # output ended inside reasoning
    MALFORMED_FRAME = "malformed_frame"  # text outside frames, bad header, unknown recipient


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int  # position among this response's tool calls
    call_id: str  # stable for the whole response
    name: str


@dataclass(frozen=True)
class ToolCallArgumentsDelta:
    index: int
    fragment: str  # concatenated fragments form the JSON arguments object


@dataclass(frozen=True)
class ToolCallEnd:
    index: int
    complete: bool  # False: the call was cut off or malformed; its arguments are partial


@dataclass(frozen=True)
class ParseError:
    kind: ParseErrorKind
    message: str
    raw: str = ""  # the model text concerned, as generated


SyntaxEvent = Union[ContentDelta, ReasoningDelta, ToolCallStart, ToolCallArgumentsDelta, ToolCallEnd, ParseError]


@dataclass
class ParsedToolCall:
    call_id: str
    name: str
    arguments: str = ""
    complete: bool = False


@dataclass
class ParsedOutput:
    """All events of one response folded together (the non-streaming view)."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ParsedToolCall] = field(default_factory=list)
    errors: list[ParseError] = field(default_factory=list)


def collect(events: Iterable[SyntaxEvent], into: ParsedOutput | None = None) -> ParsedOutput:
    out = into if into is not None else ParsedOutput()
    for event in events:
        if isinstance(event, ContentDelta):
            out.content += event.text
        elif isinstance(event, ReasoningDelta):
            out.reasoning += event.text
        elif isinstance(event, ToolCallStart):
            if event.index != len(out.tool_calls):
                raise ValueError(f"tool call index {event.index} out of order")
            out.tool_calls.append(ParsedToolCall(event.call_id, event.name))
        elif isinstance(event, ToolCallArgumentsDelta):
            out.tool_calls[event.index].arguments += event.fragment
        elif isinstance(event, ToolCallEnd):
            out.tool_calls[event.index].complete = event.complete
        elif isinstance(event, ParseError):
            out.errors.append(event)
        else:
            raise TypeError(f"not a syntax event: {event!r}")
    return out


def coalesce(events: Iterable[SyntaxEvent]) -> list[SyntaxEvent]:
    """Merge adjacent deltas of the same channel (and the same call): the canonical event list,
    independent of how the output was chunked."""
    merged: list[SyntaxEvent] = []
    for event in events:
        last = merged[-1] if merged else None
        if isinstance(event, ContentDelta) and isinstance(last, ContentDelta):
            merged[-1] = ContentDelta(last.text + event.text)
        elif isinstance(event, ReasoningDelta) and isinstance(last, ReasoningDelta):
            merged[-1] = ReasoningDelta(last.text + event.text)
        elif isinstance(event, ToolCallArgumentsDelta) and isinstance(last, ToolCallArgumentsDelta) and last.index == event.index:
            merged[-1] = ToolCallArgumentsDelta(event.index, last.fragment + event.fragment)
        elif isinstance(event, (ContentDelta, ReasoningDelta)) and not event.text:
            continue
        elif isinstance(event, ToolCallArgumentsDelta) and not event.fragment:
            continue
        else:
            merged.append(event)
    return merged
