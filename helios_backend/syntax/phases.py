"""The engine's phases (see engine.py for the transitions)."""

from __future__ import annotations

import enum

# Longest name or header the engine waits for before it calls the text malformed (characters).
MAX_NAME = 256
# Longest fenced text held back as a possible call before it is released as answer text (characters).
MAX_FENCE = 16384


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
    FENCE = "fence"                 # inside a fence that may hold a JSON call (ToolSyntax.fence_open)
    FRAME_IDLE = "frame_idle"
    FRAME_HEADER = "frame_header"
    FRAME_REASONING = "frame_reasoning"
    FRAME_CONTENT = "frame_content"
    FRAME_TOOL = "frame_tool"
    FRAME_TOOL_DONE = "frame_tool_done"


TOOL_PHASES = frozenset(
    {Phase.BLOCK, Phase.INVOKE_NAME, Phase.ARGS_JSON, Phase.ARGS_TAGGED, Phase.PARAM_NAME, Phase.PARAM_VALUE, Phase.AFTER_INVOCATION}
)
