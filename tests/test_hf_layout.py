"""Layouts from a Hugging Face config.json alone: programs recorded without any weights file.

A tiny config.json of each family prepares with seeded random weights and runs on the numpy
executor; its logits are checked against the independent numpy oracle reading a GGUF twin that
holds the same weights. Prepared without weight bytes (the device bundles' mode), the same
layout records the same programs and buffers. The shipped layouts (bench/layouts/) read as the
public models' shapes.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np
import pytest
from helios_proto import manifest_pb2 as M

from helios_backend.engine.model import ModelOptions, NativeModel
from ignition.cli import recipe_module
from ignition.preparation.prepare import prepare
from ignition.recipes.hf_layout import recipe_for_layout
from ignition.sources.hf_checkpoint import CheckpointError
from ignition.sources.hf_layout import HFLayout
from tests.engine_fixtures import resource_reader
from tests.reference.llama_numpy import ReferenceLlama, RopePairing
from tests.test_numpy_executor import prefill_logits
from tests.tiny_checkpoints import TinyShape, tiny_vocabulary, write_tiny_gguf

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYOUTS = ROOT / "bench" / "layouts"
PROMPT = [5, 77, 200, 31, 9, 140, 66, 250, 12, 3, 99, 180, 45, 7, 230, 101, 18]


def tiny_config(family: str, shape: TinyShape = TinyShape()) -> dict:
    return {"model_type": family, "hidden_size": shape.hidden, "intermediate_size": shape.ffn,
            "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
            "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim,
            "vocab_size": len(tiny_vocabulary()[0]), "max_position_embeddings": shape.context,
            "rms_norm_eps": shape.eps, "rope_theta": shape.rope_theta, "tie_word_embeddings": family == "llama"}


def tiny_layout_options(recipe, **overrides):
    return recipe.RecipeOptions(context_tokens=256, decode_rows=(1, 2), prefill_variants=((1, 8), (1, 32)),
                                mixed_variants=((2, 9),), admission_rows=(1, 2), resume_rows=(1,),
                                scored_prefill_variants=(), snapshot_rows=0, prepared_pages=48, top_logprobs=4, speculative_widths=(),
                                **overrides)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def layout(request, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    path = tmp_path_factory.mktemp(f"layout-{request.param}") / f"tiny-{request.param}.json"
    path.write_text(json.dumps(tiny_config(request.param)))
    return path


def _names(shape) -> list[str]:
    names = ["token_embd.weight", "output_norm.weight"] + ([] if shape.tied_embeddings else ["output.weight"])
    for i in range(shape.n_layers):
        parts = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                 "ffn_down"]
        names += [f"blk.{i}.{p}.weight" for p in parts]
        names += [f"blk.{i}.{p}.bias" for p in ("attn_q", "attn_k", "attn_v")] if shape.qkv_bias else []
    return names


PRODUCT_PATH = {"linear.product_f16.v1", "linear.residual_f16.v1", "norm.rms_f16.v1", "activation.to_f16.v1",
                "mlp.gate_activation_f16.v1", "linear.product_f32.v1"}
ROPE_STORE = {"llama": "attention.rope_store.v1", "qwen2": "attention.bias_rope_store.v1"}


# spec: FMT-3
@pytest.mark.parametrize("product_path_tokens", [0, 1, 9])
def test_a_config_alone_prepares_a_layout_that_runs_on_the_numpy_executor(layout, tmp_path,
                                                                         product_path_tokens) -> None:
    """Also with the product path (plain f16 products) from 1 token (every step, decode logits
    included) or from 9 (the larger prefill and mixed steps only): the same logits."""
    recipe = recipe_for_layout(layout)
    prepared = prepare(recipe, tiny_layout_options(recipe, product_path_tokens=product_path_tokens))
    family = json.loads(layout.read_text())["model_type"]
    assert prepared.contract.served_id == layout.stem
    kernels = {n.kernel for p in prepared.manifest.programs for n in p.nodes}
    # from 1 token every step takes the product path: no fused q/k/v node is left
    assert ("attention.qkv_bias_rope_store.v1" in kernels) == (family == "qwen2" and product_path_tokens != 1)
    assert (PRODUCT_PATH <= kernels) == bool(product_path_tokens)
    assert (ROPE_STORE[family] in kernels) == bool(product_path_tokens)
    # a decode step of at least product_path_tokens rows takes its logits as a product too
    logits = {n.kernel for p in prepared.manifest.programs for n in p.nodes if n.label == "logits"}
    assert ("linear.product_f32.v1" in logits) == (product_path_tokens == 1)
    # the `tokens` immediate: the fused MLP's 6th argument, the gate/up product's 5th
    fused = {n.args[5].i32 for p in prepared.manifest.programs for n in p.nodes if n.kernel == "mlp.norm_gate_up_silu.v1"}
    plain = {n.args[4].i32 for p in prepared.manifest.programs for n in p.nodes if n.kernel == "linear.product_f16.v1"}
    assert all(t < product_path_tokens for t in fused) if product_path_tokens else plain == set()
    assert all(t >= product_path_tokens for t in plain)
    source = HFLayout.open(layout, seed=0)
    assert source.shape.tied_embeddings == (family == "llama")
    # the oracle reads a GGUF twin holding the layout's own seeded weights
    twin = write_tiny_gguf(tmp_path / "twin.gguf", arch=family,
                           weights={name: source.tensor(name) for name in _names(source.shape)})
    oracle = ReferenceLlama.load(twin, RopePairing.HALF_SPLIT, max_context=256).with_weights_rounded(np.float16)
    expected = oracle.forward(PROMPT, 0)
    model = NativeModel.load(prepared.contract, prepared.manifest, resource_reader(prepared),
                             ModelOptions(cache_pages=32, concurrency=2))
    try:
        logits = prefill_logits(model, PROMPT, chunk=8, vocab=prepared.contract.model.vocabulary.sampled_tokens)
    finally:
        model.close()
    assert len(logits) == 3
    for position, row in logits.items():
        scale = np.abs(expected[position]).max()
        assert scale > 0.05      # random weights of a real scale, not all zeros
        assert np.abs(row - expected[position]).max() <= 5e-3 * scale, position
        assert int(np.argmax(row)) == int(np.argmax(expected[position]))


def test_a_layout_without_weight_bytes_records_the_same_programs(layout) -> None:
    recipe = recipe_for_layout(layout)
    with_weights = prepare(recipe, tiny_layout_options(recipe))
    without = prepare(recipe, tiny_layout_options(recipe, weights_seed=None))
    weights = {r.id: r.data for r in without.resources if r.id.startswith("weights.")}
    assert weights == {"weights.rank0": b""}
    assert list(without.manifest.programs) == list(with_weights.manifest.programs)
    assert list(without.manifest.buffers) == list(with_weights.manifest.buffers)
    end = max(b.weight.byte_offset + b.nbytes for b in without.manifest.buffers if b.kind == M.BUFFER_KIND_WEIGHT)
    data = {r.id: r.data for r in with_weights.resources}["weights.rank0"]
    assert isinstance(data, bytes) and end == len(data)


def test_helios_prepare_names_a_layout_file_and_its_errors(layout, tmp_path) -> None:
    assert recipe_module(str(layout)).NAME == layout.stem
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"model_type": "mamba"}))
    with pytest.raises(CheckpointError, match="model_type 'mamba'"):
        HFLayout.open(broken)
    config = tiny_config("qwen2")
    del config["hidden_size"]
    broken.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="'hidden_size'"):
        HFLayout.open(broken)
    with pytest.raises(CheckpointError, match="no layout file"):
        HFLayout.open(tmp_path / "absent.json")


def _parameters(shape) -> int:
    attention = shape.hidden * (shape.q_dim + 2 * shape.kv_dim) + shape.q_dim * shape.hidden
    bias = (shape.q_dim + 2 * shape.kv_dim) if shape.qkv_bias else 0
    layer = attention + bias + 3 * shape.hidden * shape.ffn + 2 * shape.hidden
    heads = 1 if shape.tied_embeddings else 2
    return shape.n_layers * layer + heads * shape.vocab * shape.hidden + shape.hidden


@pytest.mark.parametrize("name, parameters, tied, head_dim", [
    ("smollm2-135m", 134_515_008, True, 64), ("qwen2.5-0.5b", 494_032_768, True, 64),
    ("qwen2.5-1.5b", 1_543_714_304, True, 128), ("qwen2.5-7b", 7_615_616_512, False, 128),
    ("llama-3.1-8b", 8_030_261_248, False, 128)])
def test_the_shipped_layouts_have_the_public_models_shapes(name, parameters, tied, head_dim) -> None:
    shape = HFLayout.open(LAYOUTS / f"{name}.json").shape
    assert (_parameters(shape), shape.tied_embeddings, shape.head_dim) == (parameters, tied, head_dim)
    assert dataclasses.replace(shape).qkv_bias == name.startswith("qwen")
