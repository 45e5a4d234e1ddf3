"""Syntax tables as data, their pairing rules and the absence of model identities (FE-1..8, FE-26, FE-51)."""

from __future__ import annotations

import pathlib
import re

import pytest
from helios_proto import contract_pb2 as pb

from helios_backend.contract.catalog import CheckContext
from helios_backend.contract.checks_frontend import check_frontend
from helios_backend.contract.errors import ContractError
from helios_backend.syntax.tables import FrontendSyntax, preset
from helios_backend.syntax.validate import FrontendSyntaxError, frontend_problems, validate_frontend
from tests.syntax_cases import A, D, FRAMES, G, PAIRINGS, Q, THINK, X, XTHINK

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _contract_check(syntax: FrontendSyntax) -> None:
    contract = pb.ServingContract()
    fe = contract.model.frontend
    syntax.apply_to(fe)
    fe.image_preparation = pb.IMAGE_PREPARATION_NONE
    fe.image_layout = pb.IMAGE_LAYOUT_NONE
    check_frontend(CheckContext(contract, None, {}, {}, {}, {}, None))  # type: ignore[arg-type]


def test_the_four_frontend_selectors_are_independent_enums():
    # spec: FE-1
    fields = {f.name: f.enum_type.name for f in pb.FrontendContract.DESCRIPTOR.fields if f.enum_type is not None}
    assert fields == {"tool_parser": "ToolParser", "reasoning_parser": "ReasoningParser",
                      "image_preparation": "ImagePreparation", "image_layout": "ImageLayout"}


@pytest.mark.parametrize("pairing", sorted(PAIRINGS))
def test_every_allowed_pairing_passes_both_checks(pairing):
    # spec: FE-3, FE-4, FE-5, FE-6, FE-26
    syntax = preset(*PAIRINGS[pairing])
    assert frontend_problems(syntax) == []
    _contract_check(syntax)


@pytest.mark.parametrize("tool", [Q, G, D])
def test_think_tags_pair_with_the_tag_syntaxes_and_end_at_their_opener(tool):
    # spec: FE-3, FE-4, FE-5, FE-8
    syntax = preset(tool, THINK)
    assert syntax.reasoning.terminal_marker == syntax.tool.block_open


@pytest.mark.parametrize("tool", [Q, G, D, A, pb.TOOL_PARSER_NONE])
def test_xtml_think_requires_the_xtml_tool_parser(tool):
    # spec: FE-6
    syntax = preset(tool, XTHINK)
    with pytest.raises(FrontendSyntaxError, match="XTML think reasoning requires the XTML tool parser"):
        validate_frontend(syntax)
    with pytest.raises(ContractError):
        _contract_check(syntax)


@pytest.mark.parametrize("tool,reasoning", [(A, THINK), (A, pb.REASONING_PARSER_NONE), (Q, FRAMES), (X, FRAMES)])
def test_recipient_frames_and_atem_are_selected_only_together(tool, reasoning):
    # spec: FE-26
    with pytest.raises(FrontendSyntaxError, match="only together"):
        validate_frontend(preset(tool, reasoning))


def test_terminal_marker_must_be_the_tool_opener():
    # spec: FE-8
    syntax = preset(Q, THINK)
    bad = FrontendSyntax(syntax.tool_parser, syntax.reasoning_parser, syntax.tool,
                         pb.ReasoningSyntax(open="<think>", close="</think>", terminal_marker="<call>"), syntax.prefix_rules)
    assert any("terminal_marker" in p for p in frontend_problems(bad))
    with pytest.raises(ContractError):
        _contract_check(bad)


def test_unspecified_selectors_select_nothing():
    problems = frontend_problems(FrontendSyntax(pb.TOOL_PARSER_UNSPECIFIED, pb.REASONING_PARSER_UNSPECIFIED))
    assert "frontend.tool_parser is unspecified" in problems
    assert "frontend.reasoning_parser is unspecified" in problems


def test_syntax_spellings_are_data_in_the_contract_messages():
    # spec: FE-7
    syntax = preset(Q, THINK)
    fe = pb.FrontendContract()
    syntax.apply_to(fe)
    again = FrontendSyntax.from_contract(pb.FrontendContract.FromString(fe.SerializeToString()))
    assert again == syntax
    assert fe.tool_syntax.tag_separator == "\n" and fe.tool_syntax.wrap_newlines
    assert fe.reasoning_syntax.wrap_newlines and fe.reasoning_syntax.terminal_marker == "<tool_call>"


def test_missing_tagged_parameter_markers_are_reported():
    # spec: FE-7
    syntax = preset(Q, THINK)
    tool = pb.ToolSyntax()
    tool.CopyFrom(syntax.tool)
    tool.parameter_close = ""
    tool.tag_separator = ";"
    problems = frontend_problems(FrontendSyntax(Q, THINK, tool, syntax.reasoning, syntax.prefix_rules))
    assert "tool_syntax.parameter_close is empty (tagged parameters)" in problems
    assert any("tag_separator must be whitespace" in p for p in problems)


_MODEL_NAMES = re.compile(r"qwen|glm|deepseek|llama|smollm|gpt-?oss|harmony|mistral|gemma|kimi|minimax|phi-?\d", re.I)
_SPEC_SYNTAX_IDS = re.compile(r"TOOL_PARSER_(QWEN_CODER_FUNCTION_TAGS|GLM_ARGUMENT_TAGS)")


def test_no_model_names_in_the_syntax_code():
    # spec: FE-2, FE-51
    frontend = ROOT / "helios_backend" / "frontend"
    paths = sorted((ROOT / "helios_backend" / "syntax").rglob("*.py")) + [frontend / "grammar_runtime.py"]
    offenders = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in paths
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if _MODEL_NAMES.search(_SPEC_SYNTAX_IDS.sub("", line))
    ]
    assert len(paths) >= 9 and offenders == []
