"""The initial reasoning state of a response, read from the rendered prompt (FE-14..17, FE-34/35).

Only the open assistant envelope counts: everything up to and including the last message-end
marker declared by the prefix-boundary rules belongs to completed user, tool and assistant
messages (including reasoning a completed message may contain) and is ignored. When a template
resumes the assistant turn after an embedded tool response, that response ends with a
message-end marker too, so again only the text after it can open reasoning.

    ...<|im_end|>\\n<|im_start|>assistant\\n<think>\\n      -> OPEN (output starts inside reasoning)
    ...<|im_end|>\\n<|im_start|>assistant\\n<think></think> -> CLOSED
    ...<|im_end|>\\n<|im_start|>assistant\\n                -> MAY_OPEN
    ...<|end|><|start|>assistant                          -> FRAME_HEADER_OPEN (recipient follows)
    ...<|end|><|start|>assistant to=self<|message|>       -> FRAME_BODY, recipient "self"
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .tables import FrontendSyntax


class ReasoningStart(enum.Enum):
    MAY_OPEN = "may_open"  # the output may open reasoning with the open delimiter
    OPEN = "open"  # the prompt opened reasoning: the output starts inside it
    CLOSED = "closed"  # reasoning is over or impossible: the output starts in the answer
    FRAME_EXPECT_HEADER = "frame_expect_header"  # recipient frames: the output starts a header
    FRAME_HEADER_OPEN = "frame_header_open"  # the prompt ends inside a header; the recipient follows
    FRAME_BODY = "frame_body"  # the prompt ends inside a prepared frame body


@dataclass(frozen=True)
class InitialState:
    start: ReasoningStart
    recipient: str = ""  # FRAME_BODY: the prepared frame's recipient
    header_prefix: str = ""  # FRAME_HEADER_OPEN: header text after the header start (e.g. "assistant")
    newline_consumed: bool = False  # OPEN: the prompt already holds the wrapping newline


def _open_envelope(prompt: str, syntax: FrontendSyntax) -> tuple[str, bool]:
    """The text after the last message-end marker and whether an envelope there may open
    reasoning. Without declared rules the whole prompt is the envelope."""
    rules = syntax.prefix_rules
    if not rules:
        return prompt, True
    end = -1
    for close in {r.close for r in rules}:
        at = prompt.rfind(close)
        if at >= 0:
            end = max(end, at + len(close))
    tail = prompt[end:] if end >= 0 else prompt
    opened = [(tail.rfind(r.open), r) for r in rules if r.open in tail]
    if not opened:
        return tail, False
    at, rule = max(opened, key=lambda item: (item[0], len(item[1].open)))
    return tail[at + len(rule.open) :], rule.may_open_reasoning


def initial_state(prompt: str, syntax: FrontendSyntax) -> InitialState:
    """Initial state for the engine and the grammar, from the rendered prompt text."""
    if syntax.uses_recipient_frames:
        return _frame_state(prompt, syntax)
    if not syntax.has_delimited_reasoning:
        return InitialState(ReasoningStart.CLOSED)
    envelope, may_open = _open_envelope(prompt, syntax)
    if not may_open:
        return InitialState(ReasoningStart.CLOSED)
    r = syntax.reasoning
    opened = envelope.rfind(r.open)
    if opened < 0:
        return InitialState(ReasoningStart.MAY_OPEN)
    after = envelope[opened + len(r.open) :]
    if r.close in after:
        return InitialState(ReasoningStart.CLOSED)
    return InitialState(ReasoningStart.OPEN, newline_consumed=r.wrap_newlines and after.startswith("\n"))


def _frame_state(prompt: str, syntax: FrontendSyntax) -> InitialState:
    r = syntax.reasoning
    end = max(prompt.rfind(r.message_end) + len(r.message_end) if r.message_end in prompt else -1,
              prompt.rfind(r.message_continue) + len(r.message_continue) if r.message_continue in prompt else -1)
    tail = prompt[end:] if end >= 0 else prompt
    header_at = tail.rfind(r.header_start)
    if header_at < 0:
        return InitialState(ReasoningStart.FRAME_EXPECT_HEADER)
    header = tail[header_at + len(r.header_start) :]
    if r.message_start in header:
        head, _ = header.split(r.message_start, 1)
        prefix = r.header_role + r.recipient_prefix
        recipient = head[len(prefix) :].strip() if head.startswith(prefix) else ""
        return InitialState(ReasoningStart.FRAME_BODY, recipient=recipient)
    return InitialState(ReasoningStart.FRAME_HEADER_OPEN, header_prefix=header)
