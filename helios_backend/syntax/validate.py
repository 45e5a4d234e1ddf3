"""Cross-checks of the frontend selectors and their syntax data (FE-1, FE-6, FE-7, FE-8, FE-26).

helios_backend/contract/checks_frontend.py enforces the pairing rules at contract decoding; this
module additionally checks what the syntax engine and grammar builder rely on (every delimiter a
selected syntax needs, whitespace separators, one-invocation blocks). Recipes run it before
export and Bootstrap may run it at load; every violation is reported, none is repaired.
"""

from __future__ import annotations

from helios_proto import contract_pb2 as pb

from .tables import FrontendSyntax
from .tool_phases import fence_arguments_key


class FrontendSyntaxError(ValueError):
    """The frontend selectors or syntax data are inconsistent; `problems` lists every finding."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


_TOOL_REQUIRED = ("block_open", "block_close", "invocation_open_suffix")
_TAGGED_REQUIRED = ("parameter_open_prefix", "parameter_open_suffix", "parameter_close")
_RECIPIENT_REQUIRED = (
    "header_start",
    "header_role",
    "recipient_prefix",
    "message_start",
    "message_end",
    "message_continue",
    "reasoning_recipient",
    "generic_tool_recipient",
    "named_tool_prefix",
)


def frontend_problems(syntax: FrontendSyntax) -> list[str]:
    """Every inconsistency found; empty when the syntax data may be served."""
    problems: list[str] = []
    if syntax.tool_parser == pb.TOOL_PARSER_UNSPECIFIED:
        problems.append("frontend.tool_parser is unspecified")
    if syntax.reasoning_parser == pb.REASONING_PARSER_UNSPECIFIED:
        problems.append("frontend.reasoning_parser is unspecified")
    if syntax.tool_parser not in pb.ToolParser.values():
        problems.append(f"frontend.tool_parser {syntax.tool_parser} is unknown")
    if syntax.reasoning_parser not in pb.ReasoningParser.values():
        problems.append(f"frontend.reasoning_parser {syntax.reasoning_parser} is unknown")

    # pairing rules
    if syntax.reasoning_parser == pb.REASONING_PARSER_XTML_THINK and syntax.tool_parser != pb.TOOL_PARSER_XTML:
        problems.append("XTML think reasoning requires the XTML tool parser")
    recipient = syntax.reasoning_parser == pb.REASONING_PARSER_RECIPIENT_HEADER
    if recipient != (syntax.tool_parser == pb.TOOL_PARSER_ATEM):
        problems.append("recipient-header reasoning and the ATEM tool parser are selected only together")

    tool, reasoning = syntax.tool, syntax.reasoning
    if syntax.has_tools:
        for name in _TOOL_REQUIRED:
            if not getattr(tool, name):
                problems.append(f"tool_syntax.{name} is empty")
        if tool.argument_encoding == pb.ARGUMENT_ENCODING_UNSPECIFIED:
            problems.append("tool_syntax.argument_encoding is unspecified")
        if tool.argument_encoding == pb.ARGUMENT_ENCODING_TAGGED_PARAMETERS:
            for name in _TAGGED_REQUIRED:
                if not getattr(tool, name):
                    problems.append(f"tool_syntax.{name} is empty (tagged parameters)")
        if tool.tag_separator.strip():
            problems.append("tool_syntax.tag_separator must be whitespace (the parser skips whitespace between tags)")
        if not tool.invocation_close and tool.invocations_per_block != 1:
            problems.append("tool_syntax without invocation_close must declare invocations_per_block = 1")
        if bool(tool.fence_open) != bool(tool.fence_close):
            problems.append("tool_syntax.fence_open and .fence_close are declared together")
        if tool.fence_open and (tool.argument_encoding != pb.ARGUMENT_ENCODING_JSON_OBJECT or fence_arguments_key(tool) is None):
            problems.append("tool_syntax.fence_open needs JSON-object arguments whose invocation_open_suffix names their member")
    if syntax.has_delimited_reasoning:
        if not reasoning.open or not reasoning.close:
            problems.append("reasoning_syntax.open and .close are required for delimited reasoning")
    if reasoning.terminal_marker and reasoning.terminal_marker != tool.block_open:
        problems.append(
            f"reasoning_syntax.terminal_marker {reasoning.terminal_marker!r} is not the tool syntax opener {tool.block_open!r}"
        )
    if recipient:
        for name in _RECIPIENT_REQUIRED:
            if not getattr(reasoning, name):
                problems.append(f"reasoning_syntax.{name} is empty (recipient-header frames)")
        if not reasoning.content_recipients:
            problems.append("reasoning_syntax.content_recipients is empty (recipient-header frames)")
    for rule in syntax.prefix_rules:
        if not rule.role or not rule.open or not rule.close:
            problems.append(f"prefix rule {rule.role!r} needs role, open and close")
    return problems


def validate_frontend(syntax: FrontendSyntax) -> None:
    """Raise FrontendSyntaxError listing every problem; return when the data is consistent."""
    problems = frontend_problems(syntax)
    if problems:
        raise FrontendSyntaxError(problems)
