"""Test cores: the SmolLM2 recipe with other frontend syntax data, one core per syntax pairing.

Each variant is the base recipe module with the same weights, forward pass, capacities and
sampling defaults; only NAME/SERVED_ID and `frontend()` differ. The model was never trained on
these syntaxes: with tool_choice required or a JSON schema, the request grammar (built from the
same syntax data) forces the markup, which is what the end-to-end tests exercise.

SmolLM2's tokenizer holds none of the syntax delimiters as added tokens, so every delimiter of
these variants is plain text (FE-9 atomic delimiters are covered by the grammar tests with an
extended tokenizer).

    helios-prepare smollm2-135m-instruct+qwen-coder-think   # one core per variant
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

from helios_proto import contract_pb2 as C

from helios_backend.syntax.tables import chatml_prefix_rules, preset
from helios_backend.syntax.validate import validate_frontend
from ignition.recipes import smollm2_135m_instruct as base


@dataclass(frozen=True)
class SyntaxVariant:
    suffix: str  # appended to the base recipe name (the syntax pairing, never a model)
    tool_parser: C.ToolParser.ValueType
    reasoning_parser: C.ReasoningParser.ValueType


VARIANTS: tuple[SyntaxVariant, ...] = (
    SyntaxVariant("qwen-coder-think", C.TOOL_PARSER_QWEN_CODER_FUNCTION_TAGS, C.REASONING_PARSER_THINK_TAGS),
    SyntaxVariant("glm-think", C.TOOL_PARSER_GLM_ARGUMENT_TAGS, C.REASONING_PARSER_THINK_TAGS),
    SyntaxVariant("dsml-think", C.TOOL_PARSER_DSML, C.REASONING_PARSER_THINK_TAGS),
    SyntaxVariant("xtml", C.TOOL_PARSER_XTML, C.REASONING_PARSER_XTML_THINK),
    SyntaxVariant("atem-recipient", C.TOOL_PARSER_ATEM, C.REASONING_PARSER_RECIPIENT_HEADER),
)


def variant_frontend(variant: SyntaxVariant) -> C.FrontendContract:
    """The base frontend (template tokens, image selectors) with the variant's syntax data.

    Prefix rules stay ChatML: the chat template is the base model's, so the open assistant
    envelope is "<|im_start|>assistant\\n" for every variant.
    """
    syntax = preset(variant.tool_parser, variant.reasoning_parser, prefix_rules=chatml_prefix_rules())
    validate_frontend(syntax)
    frontend = base.frontend()
    syntax.apply_to(frontend)
    return frontend


def recipe_name(variant: SyntaxVariant) -> str:
    return f"{base.NAME}+{variant.suffix}"


def recipe_module(variant: SyntaxVariant) -> ModuleType:
    """A recipe module for `ignition.preparation.prepare`: the base recipe, another frontend."""
    module = ModuleType(f"{__name__}.{variant.suffix.replace('-', '_')}")
    module.__dict__.update({k: v for k, v in vars(base).items() if not k.startswith("__")})
    module.__dict__.update(NAME=recipe_name(variant), SERVED_ID=recipe_name(variant), ALIASES=(),
                           frontend=lambda: variant_frontend(variant))
    module.__doc__ = f"{base.NAME} with the {variant.suffix} frontend syntax (test core)."
    return module


def recipes() -> dict[str, ModuleType]:
    """Every variant by recipe name (for the preparation CLI's recipe lookup)."""
    return {recipe_name(v): recipe_module(v) for v in VARIANTS}
