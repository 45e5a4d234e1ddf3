"""Frontend checks (FE-1, FE-6..8, FE-26): selector pairings and required syntax data.

Pairing rules and the syntax each selector needs are tables, so a new syntax adds rows.
"""
from __future__ import annotations

from helios_proto import contract_pb2 as c

from .catalog import CheckContext
from .errors import ContractError

# reasoning parser -> the only tool parser it may be paired with (FE-6, FE-26)
REASONING_REQUIRES_TOOL = {
    c.REASONING_PARSER_XTML_THINK: c.TOOL_PARSER_XTML,
    c.REASONING_PARSER_RECIPIENT_HEADER: c.TOOL_PARSER_ATEM,
}
# tool parser -> the only reasoning parser it may be paired with (FE-26: both ways)
TOOL_REQUIRES_REASONING = {
    c.TOOL_PARSER_ATEM: c.REASONING_PARSER_RECIPIENT_HEADER,
}
# reasoning parser -> ReasoningSyntax fields it needs
REASONING_SYNTAX_FIELDS = {
    c.REASONING_PARSER_THINK_TAGS: ("open", "close"),
    c.REASONING_PARSER_XTML_THINK: ("open", "close"),
    c.REASONING_PARSER_RECIPIENT_HEADER: (
        "header_start", "header_role", "recipient_prefix", "message_start", "message_end", "reasoning_recipient",
    ),
}
TOOL_SYNTAX_FIELDS = ("block_open",)


def check_frontend(ctx: CheckContext) -> None:
    model = ctx.model
    if not model.HasField("frontend"):
        raise ContractError("model.frontend.tool_parser", "TOOL_PARSER_UNSPECIFIED (zero) cannot select an implementation")
    fe = model.frontend
    path = "model.frontend"
    required_tool = REASONING_REQUIRES_TOOL.get(fe.reasoning_parser)
    if required_tool is not None and fe.tool_parser != required_tool:
        raise ContractError(
            f"{path}.tool_parser",
            f"{c.ReasoningParser.Name(fe.reasoning_parser)} requires {c.ToolParser.Name(required_tool)}",
        )
    required_reasoning = TOOL_REQUIRES_REASONING.get(fe.tool_parser)
    if required_reasoning is not None and fe.reasoning_parser != required_reasoning:
        raise ContractError(
            f"{path}.reasoning_parser",
            f"{c.ToolParser.Name(fe.tool_parser)} requires {c.ReasoningParser.Name(required_reasoning)}",
        )
    _check_tool_syntax(fe, path)
    _check_reasoning_syntax(fe, path)
    _check_images(ctx, fe, path)
    if ctx.resource_ids is not None:
        for name in ("tokenizer_resource", "chat_template_resource"):
            value = getattr(fe, name)
            if value and value not in ctx.resource_ids:
                raise ContractError(f"{path}.{name}", f"no resource {value!r} in the core")


def _check_tool_syntax(fe: c.FrontendContract, path: str) -> None:
    if fe.tool_parser == c.TOOL_PARSER_NONE:
        if fe.HasField("tool_syntax"):
            raise ContractError(f"{path}.tool_syntax", "TOOL_PARSER_NONE takes no tool syntax")
        return
    if not fe.HasField("tool_syntax"):
        raise ContractError(f"{path}.tool_syntax", f"{c.ToolParser.Name(fe.tool_parser)} needs its syntax data")
    for name in TOOL_SYNTAX_FIELDS:
        if not getattr(fe.tool_syntax, name):
            raise ContractError(f"{path}.tool_syntax.{name}", "required by the tool parser")


def _check_reasoning_syntax(fe: c.FrontendContract, path: str) -> None:
    if fe.reasoning_parser == c.REASONING_PARSER_NONE:
        if fe.HasField("reasoning_syntax"):
            raise ContractError(f"{path}.reasoning_syntax", "REASONING_PARSER_NONE takes no reasoning syntax")
        return
    if not fe.HasField("reasoning_syntax"):
        raise ContractError(f"{path}.reasoning_syntax", f"{c.ReasoningParser.Name(fe.reasoning_parser)} needs its syntax data")
    syntax = fe.reasoning_syntax
    for name in REASONING_SYNTAX_FIELDS.get(fe.reasoning_parser, ()):
        if not getattr(syntax, name):
            raise ContractError(f"{path}.reasoning_syntax.{name}", "required by the reasoning parser")
    if syntax.terminal_marker:
        # a terminal marker ends reasoning because the tool block opens (FE-8)
        opener = fe.tool_syntax.block_open if fe.HasField("tool_syntax") else ""
        if syntax.terminal_marker != opener:
            raise ContractError(
                f"{path}.reasoning_syntax.terminal_marker",
                f"{syntax.terminal_marker!r} must equal the tool syntax's opener {opener!r}",
            )


def _check_images(ctx: CheckContext, fe: c.FrontendContract, path: str) -> None:
    uses_images = fe.image_preparation != c.IMAGE_PREPARATION_NONE or fe.image_layout != c.IMAGE_LAYOUT_NONE
    if uses_images and not ctx.model.HasField("vision"):
        raise ContractError(f"{path}.image_layout", "image selectors need ModelContract.vision")
    if (fe.image_preparation == c.IMAGE_PREPARATION_NONE) != (fe.image_layout == c.IMAGE_LAYOUT_NONE):
        raise ContractError(f"{path}.image_layout", "image preparation and image layout are both NONE or both set")
    if fe.image_layout == c.IMAGE_LAYOUT_FIXED_SPAN and not fe.image_layout_data.feature_ids:
        raise ContractError(f"{path}.image_layout_data.feature_ids", "a fixed-span layout declares its feature ids")
    inputs = ctx.model.input_vocabulary
    sentinels = set(inputs.image_sentinels)
    for index, feature in enumerate(fe.image_layout_data.feature_ids):
        # feature ids are the declared nonsampled image sentinels (CON-4, FE-18)
        if feature not in sentinels:
            raise ContractError(f"{path}.image_layout_data.feature_ids[{index}]", f"{feature} is not a declared image sentinel")
    for span_index, span in enumerate(fe.image_layout_data.atomic_spans):
        for index, token in enumerate(span.token_ids):
            if token >= inputs.input_tokens:
                raise ContractError(
                    f"{path}.image_layout_data.atomic_spans[{span_index}].token_ids[{index}]", f"{token} is not a valid input id"
                )
    if fe.image_preparation == c.IMAGE_PREPARATION_RESIZE_NORMALIZE:
        settings = fe.image_preparation_settings
        if not settings.image_size or not settings.patch_size:
            raise ContractError(f"{path}.image_preparation_settings", "resize/normalise needs image_size and patch_size")


CHECKS = (check_frontend,)
