"""The syntax presets, as data.

Every spelling the engine and the grammar builder need lives in a contract `ToolSyntax` or
`ReasoningSyntax` message; a recipe copies one of these tables into its FrontendContract. Adding a
syntax means adding a table here, never a parser class. The concrete spellings the spec leaves
open (XTML, ATEM, DSML, argument tags, function tags) are written down in docs/frontend-syntax.md;
the strings below are the source of truth. The enum identifiers are the spec's syntax names; no
table is chosen by, or specific to, a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from helios_proto import contract_pb2 as pb

TAGGED = pb.ARGUMENT_ENCODING_TAGGED_PARAMETERS
JSON_OBJECT = pb.ARGUMENT_ENCODING_JSON_OBJECT

# ---- tool syntaxes --------------------------------------------------------------------------


def function_tags() -> pb.ToolSyntax:
    """<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>"""
    return pb.ToolSyntax(
        block_open="<tool_call>",
        block_close="</tool_call>",
        invocation_open_prefix="<function=",
        invocation_open_suffix=">",
        invocation_close="</function>",
        parameter_open_prefix="<parameter=",
        parameter_open_suffix=">",
        parameter_close="</parameter>",
        tag_separator="\n",
        wrap_newlines=True,
        argument_encoding=TAGGED,
        invocations_per_block=1,
    )


def argument_tags() -> pb.ToolSyntax:
    """<tool_call>NAME\\n<arg_key>P</arg_key>\\n<arg_value>VALUE</arg_value>\\n</tool_call>

    The invocation has no closing tag of its own: the block close ends it (one per block).
    """
    return pb.ToolSyntax(
        block_open="<tool_call>",
        block_close="</tool_call>",
        invocation_open_prefix="",
        invocation_open_suffix="\n",
        invocation_close="",
        parameter_open_prefix="<arg_key>",
        parameter_open_suffix="</arg_key>\n<arg_value>",
        parameter_close="</arg_value>",
        tag_separator="\n",
        wrap_newlines=False,
        argument_encoding=TAGGED,
        invocations_per_block=1,
    )


def dsml() -> pb.ToolSyntax:
    """<｜DSML｜function_calls> holding one or more <｜DSML｜invoke name="NAME"> invocations whose
    <｜DSML｜parameter name="P">VALUE</｜DSML｜parameter> values are typed by the tool schema."""
    bar = "\uff5c"  # FULLWIDTH VERTICAL LINE, as in the DSML markup
    return pb.ToolSyntax(
        block_open=f"<{bar}DSML{bar}function_calls>",
        block_close=f"</{bar}DSML{bar}function_calls>",
        invocation_open_prefix=f'<{bar}DSML{bar}invoke name="',
        invocation_open_suffix='">',
        invocation_close=f"</{bar}DSML{bar}invoke>",
        parameter_open_prefix=f'<{bar}DSML{bar}parameter name="',
        parameter_open_suffix='">',
        parameter_close=f"</{bar}DSML{bar}parameter>",
        tag_separator="\n",
        wrap_newlines=False,
        argument_encoding=TAGGED,
        invocations_per_block=0,
    )


def xtml_tools() -> pb.ToolSyntax:
    """<xtml:tools> holding <xtml:call name="NAME">{JSON arguments}</xtml:call> invocations."""
    return pb.ToolSyntax(
        block_open="<xtml:tools>",
        block_close="</xtml:tools>",
        invocation_open_prefix='<xtml:call name="',
        invocation_open_suffix='">',
        invocation_close="</xtml:call>",
        tag_separator="\n",
        wrap_newlines=False,
        argument_encoding=JSON_OBJECT,
        invocations_per_block=0,
    )


def json_call_tags() -> pb.ToolSyntax:
    """<tool_call>\n{"name": "NAME", "arguments": {JSON arguments}}\n</tool_call>

    The name is a member of the invocation's JSON object, so the invocation opens with the start
    of that object and closes with its final brace; the engine finds the end of the arguments
    object by counting braces (JSON arguments may themselves hold "}"). One invocation per block;
    parallel calls repeat the block. The same JSON object written as a Markdown ```json block is
    a call too (the fence fields): small models trained on this template often answer that way.
    """
    return pb.ToolSyntax(
        block_open="<tool_call>",
        block_close="</tool_call>",
        invocation_open_prefix='{"name": "',
        invocation_open_suffix='", "arguments": ',
        invocation_close="}",
        tag_separator="\n",
        wrap_newlines=False,
        argument_encoding=JSON_OBJECT,
        invocations_per_block=1,
        fence_open="```json",
        fence_close="```",
    )


def json_call_list() -> pb.ToolSyntax:
    """[TOOL_CALLS][{"name": "NAME", "arguments": {JSON arguments}}, {"name": ...}]

    The marker (an added token where the tokenizer has one) opens the block; the list bracket
    and the first JSON object open the first invocation, ", {" each later one (parallel calls
    share the list); an object's final brace closes its invocation and the list's bracket
    closes the block. Whitespace after the marker is skipped, so "[TOOL_CALLS] [{" reads too.
    """
    return pb.ToolSyntax(
        block_open="[TOOL_CALLS]",
        block_close="]",
        invocation_open_prefix='[{"name": "',
        next_invocation_open_prefix=', {"name": "',
        invocation_open_suffix='", "arguments": ',
        invocation_close="}",
        tag_separator="",
        wrap_newlines=False,
        argument_encoding=JSON_OBJECT,
        invocations_per_block=0,
    )


def json_parameters() -> pb.ToolSyntax:
    """{"name": "NAME", "parameters": {JSON arguments}}

    A bare JSON object: its opening up to the name's quote opens the block, the name follows
    directly, and the object's final brace (counted after the arguments object's own) closes
    the block and the one invocation it holds. Parallel calls repeat the object.
    """
    return pb.ToolSyntax(
        block_open='{"name": "',
        block_close="}",
        invocation_open_prefix="",
        invocation_open_suffix='", "parameters": ',
        invocation_close="",
        tag_separator="\n",
        wrap_newlines=False,
        argument_encoding=JSON_OBJECT,
        invocations_per_block=1,
    )


def atem() -> pb.ToolSyntax:
    """<atem:function_calls><atem:invoke name="NAME"><atem:parameter name="P">VALUE</atem:parameter>
    </atem:invoke></atem:function_calls>, one invocation per recipient frame."""
    return pb.ToolSyntax(
        block_open="<atem:function_calls>",
        block_close="</atem:function_calls>",
        invocation_open_prefix='<atem:invoke name="',
        invocation_open_suffix='">',
        invocation_close="</atem:invoke>",
        parameter_open_prefix='<atem:parameter name="',
        parameter_open_suffix='">',
        parameter_close="</atem:parameter>",
        tag_separator="\n",
        wrap_newlines=False,
        argument_encoding=TAGGED,
        invocations_per_block=1,
    )


# ---- reasoning syntaxes ---------------------------------------------------------------------


def think_tags(terminal_marker: str = "") -> pb.ReasoningSyntax:
    """<think>\\n...\\n</think>; `terminal_marker` (the paired tool opener) also ends reasoning."""
    return pb.ReasoningSyntax(open="<think>", close="</think>", terminal_marker=terminal_marker, wrap_newlines=True)


def xtml_think() -> pb.ReasoningSyntax:
    """<xtml:think>...</xtml:think>; opening an <xtml:tools> block also ends reasoning, which is
    why this reasoning syntax only pairs with the XTML tool syntax."""
    return pb.ReasoningSyntax(
        open="<xtml:think>", close="</xtml:think>", terminal_marker=xtml_tools().block_open, wrap_newlines=True
    )


def recipient_header() -> pb.ReasoningSyntax:
    """<|start|>assistant to=RECIPIENT<|message|>BODY<|end|> frames (<|eom|>: internal message end)."""
    return pb.ReasoningSyntax(
        header_start="<|start|>",
        header_role="assistant",
        recipient_prefix=" to=",
        message_start="<|message|>",
        message_end="<|end|>",
        message_continue="<|eom|>",
        reasoning_recipient="self",
        content_recipients=["commentary", "user"],
        generic_tool_recipient="functions",
        named_tool_prefix="functions.",
    )


# ---- prompt envelopes -----------------------------------------------------------------------


def chatml_prefix_rules() -> list[pb.PrefixBoundaryRule]:
    """ChatML envelopes: only the assistant envelope may open reasoning."""
    return [
        pb.PrefixBoundaryRule(role=role, open=f"<|im_start|>{role}\n", close="<|im_end|>", may_open_reasoning=role == "assistant")
        for role in ("system", "user", "assistant", "tool")
    ]


def recipient_prefix_rules() -> list[pb.PrefixBoundaryRule]:
    """Recipient-header envelopes: a message ends at <|end|> or <|eom|>; only assistant frames
    may carry reasoning."""
    rules = []
    for role in ("system", "user", "assistant", "tool"):
        for close in ("<|end|>", "<|eom|>"):
            rules.append(pb.PrefixBoundaryRule(role=role, open=f"<|start|>{role}", close=close, may_open_reasoning=role == "assistant"))
    return rules


# ---- the bundle the engine and the grammar builder read ---------------------------------------

_TOOL_TABLES = {
    pb.TOOL_PARSER_QWEN_CODER_FUNCTION_TAGS: function_tags,
    pb.TOOL_PARSER_GLM_ARGUMENT_TAGS: argument_tags,
    pb.TOOL_PARSER_DSML: dsml,
    pb.TOOL_PARSER_XTML: xtml_tools,
    pb.TOOL_PARSER_ATEM: atem,
    pb.TOOL_PARSER_JSON_CALL_TAGS: json_call_tags,
    pb.TOOL_PARSER_JSON_CALL_LIST: json_call_list,
    pb.TOOL_PARSER_JSON_PARAMETERS: json_parameters,
}


@dataclass(frozen=True)
class FrontendSyntax:
    """The selectors plus the syntax data of one prepared model (read-only after load)."""

    tool_parser: pb.ToolParser.ValueType
    reasoning_parser: pb.ReasoningParser.ValueType
    tool: pb.ToolSyntax = field(default_factory=pb.ToolSyntax)
    reasoning: pb.ReasoningSyntax = field(default_factory=pb.ReasoningSyntax)
    prefix_rules: tuple[pb.PrefixBoundaryRule, ...] = ()

    @classmethod
    def from_contract(cls, frontend: pb.FrontendContract) -> "FrontendSyntax":
        return cls(
            tool_parser=frontend.tool_parser,
            reasoning_parser=frontend.reasoning_parser,
            tool=frontend.tool_syntax,
            reasoning=frontend.reasoning_syntax,
            prefix_rules=tuple(frontend.prefix_rules),
        )

    def apply_to(self, frontend: pb.FrontendContract) -> None:
        """Write the selectors and syntax data into a contract message (recipes use this)."""
        frontend.tool_parser = self.tool_parser
        frontend.reasoning_parser = self.reasoning_parser
        # NONE selectors take no syntax message at all (the contract checks reject an empty one).
        frontend.ClearField("tool_syntax")
        frontend.ClearField("reasoning_syntax")
        if self.has_tools:
            frontend.tool_syntax.CopyFrom(self.tool)
        if self.reasoning_parser not in (pb.REASONING_PARSER_NONE, pb.REASONING_PARSER_UNSPECIFIED):
            frontend.reasoning_syntax.CopyFrom(self.reasoning)
        del frontend.prefix_rules[:]
        frontend.prefix_rules.extend(self.prefix_rules)

    @property
    def has_tools(self) -> bool:
        return self.tool_parser not in (pb.TOOL_PARSER_UNSPECIFIED, pb.TOOL_PARSER_NONE)

    @property
    def uses_recipient_frames(self) -> bool:
        return self.reasoning_parser == pb.REASONING_PARSER_RECIPIENT_HEADER

    @property
    def has_delimited_reasoning(self) -> bool:
        return self.reasoning_parser in (pb.REASONING_PARSER_THINK_TAGS, pb.REASONING_PARSER_XTML_THINK)


def preset(tool_parser: pb.ToolParser.ValueType, reasoning_parser: pb.ReasoningParser.ValueType,
           prefix_rules: list[pb.PrefixBoundaryRule] | None = None) -> FrontendSyntax:
    """Build the syntax bundle for a selector pair from the tables above.

    Think tags take the paired tool opener as their terminal marker (FE-8), so a tool block opened
    without closing reasoning still ends it. Pairing rules are checked by `validate`, not here.
    """
    tool = _TOOL_TABLES[tool_parser]() if tool_parser in _TOOL_TABLES else pb.ToolSyntax()
    if reasoning_parser == pb.REASONING_PARSER_THINK_TAGS:
        reasoning = think_tags(terminal_marker=tool.block_open)
    elif reasoning_parser == pb.REASONING_PARSER_XTML_THINK:
        reasoning = xtml_think()
    elif reasoning_parser == pb.REASONING_PARSER_RECIPIENT_HEADER:
        reasoning = recipient_header()
    else:
        reasoning = pb.ReasoningSyntax()
    if prefix_rules is None:
        prefix_rules = recipient_prefix_rules() if reasoning_parser == pb.REASONING_PARSER_RECIPIENT_HEADER else chatml_prefix_rules()
    return FrontendSyntax(tool_parser, reasoning_parser, tool, reasoning, tuple(prefix_rules))
