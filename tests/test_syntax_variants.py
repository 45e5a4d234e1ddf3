"""Test-core recipes: the SmolLM2 recipe with other frontend syntax data (issue #6 item 5)."""

from __future__ import annotations

import pytest
from helios_proto import contract_pb2 as pb

from helios_backend.contract.catalog import CheckContext
from helios_backend.contract.checks_frontend import check_frontend
from helios_backend.syntax.tables import FrontendSyntax
from ignition.recipes import smollm2_135m_instruct as base
from ignition.recipes.syntax_variants import VARIANTS, recipe_module, recipes


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.suffix)
def test_variant_differs_from_the_base_recipe_only_in_frontend_syntax(variant):
    # spec: FE-2, FE-7
    module = recipe_module(variant)
    assert module.forward is base.forward and module.weight_tensors is base.weight_tensors
    assert module.EOS_TOKEN_IDS == base.EOS_TOKEN_IDS and module.SAMPLING_DEFAULTS == base.SAMPLING_DEFAULTS
    fe, base_fe = module.frontend(), base.frontend()
    assert (fe.tool_parser, fe.reasoning_parser) == (variant.tool_parser, variant.reasoning_parser)
    assert fe.template_tokens == base_fe.template_tokens
    assert (fe.image_preparation, fe.image_layout) == (base_fe.image_preparation, base_fe.image_layout)
    contract = pb.ServingContract()
    contract.model.frontend.CopyFrom(fe)
    check_frontend(CheckContext(contract, None, {}, {}, {}, {}, None))  # type: ignore[arg-type]
    assert FrontendSyntax.from_contract(fe).has_tools


def test_every_syntax_pairing_has_a_test_core_with_a_distinct_served_id():
    # spec: FE-3, FE-4, FE-5, FE-6, FE-26
    pairs = {(v.tool_parser, v.reasoning_parser) for v in VARIANTS}
    assert pairs == {
        (pb.TOOL_PARSER_QWEN_CODER_FUNCTION_TAGS, pb.REASONING_PARSER_THINK_TAGS),
        (pb.TOOL_PARSER_GLM_ARGUMENT_TAGS, pb.REASONING_PARSER_THINK_TAGS),
        (pb.TOOL_PARSER_DSML, pb.REASONING_PARSER_THINK_TAGS),
        (pb.TOOL_PARSER_XTML, pb.REASONING_PARSER_XTML_THINK),
        (pb.TOOL_PARSER_ATEM, pb.REASONING_PARSER_RECIPIENT_HEADER),
    }
    served = [m.SERVED_ID for m in recipes().values()]
    assert len(set(served)) == len(VARIANTS) and base.SERVED_ID not in served
