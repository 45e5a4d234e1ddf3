"""The roofline's bytes and FLOPs of recorded programs (bench/roofline.py), on a tiny layout.

The step totals are checked against the layout's shape counted by hand: every matrix read once
and multiplied at every live token (the head at each row's last token), each decode row's K and V
read over its context and written at its token, the logits written once.
"""
from __future__ import annotations

import json

import pytest
from helios_proto import manifest_pb2 as M

from bench.roofline import Step, program_costs
from ignition.preparation.prepare import prepare
from ignition.recipes.hf_layout import recipe_for_layout
from ignition.sources.hf_layout import HFLayout
from tests.test_hf_layout import tiny_config, tiny_layout_options


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def prepared(request, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("roofline") / f"tiny-{request.param}.json"
    path.write_text(json.dumps(tiny_config(request.param)))
    recipe = recipe_for_layout(path)
    return HFLayout.open(path).shape, prepare(recipe, tiny_layout_options(recipe, weights_seed=None))


def _program(manifest: M.ExecutionManifest, name: str) -> M.Program:
    return next(p for p in manifest.programs if p.name == name)


def test_a_decode_step_moves_its_weights_once_and_each_rows_context(prepared) -> None:
    shape, model = prepared
    rows, context = 2, 40
    total, nodes = program_costs(model.manifest, _program(model.manifest, "decode.r2.t2"), Step(rows, rows, context))
    layer_matrix = shape.hidden * (shape.q_dim + 2 * shape.kv_dim) + shape.q_dim * shape.hidden \
        + 3 * shape.hidden * shape.ffn
    kv_row = 2 * shape.n_kv_heads * shape.head_dim                    # f16 bytes of one position's K (or V)
    attention = 4 * rows * context * shape.n_heads * shape.head_dim
    assert total.flops == shape.n_layers * (2 * rows * layer_matrix + attention) \
        + 2 * rows * shape.vocab * shape.hidden
    assert total.cache_bytes == shape.n_layers * 2 * (rows * context + rows) * kv_row
    assert total.output_bytes == rows * shape.vocab * 4
    weights = {b.name: b.nbytes for b in model.manifest.buffers if b.kind == M.BUFFER_KIND_WEIGHT}
    head = "weights.token_embedding" if shape.tied_embeddings else "weights.output"
    assert total.weights[head] == weights[head]                      # the head reads all of it
    assert total.nbytes == sum(total.weights.values()) + total.cache_bytes + total.output_bytes
    assert sum(cost.nbytes for _, cost in nodes) > total.nbytes        # nodes also move activations


def test_a_prefill_chunk_attends_causally_over_itself(prepared) -> None:
    shape, model = prepared
    tokens = 32
    total, _ = program_costs(model.manifest, _program(model.manifest, "prefill.r1.t32"), Step(1, tokens, 0))
    pairs = tokens * (tokens + 1) / 2
    layer_matrix = shape.hidden * (shape.q_dim + 2 * shape.kv_dim) + shape.q_dim * shape.hidden \
        + 3 * shape.hidden * shape.ffn
    assert total.flops == pytest.approx(shape.n_layers * (2 * tokens * layer_matrix
                                                          + 4 * pairs * shape.n_heads * shape.head_dim)
                                        + 2 * shape.vocab * shape.hidden)
    # the chunk's K and V written once and read once per layer
    assert total.cache_bytes == shape.n_layers * 2 * 2 * tokens * 2 * shape.n_kv_heads * shape.head_dim
