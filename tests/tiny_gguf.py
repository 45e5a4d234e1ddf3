"""A small llama GGUF with seeded random weights and the packaged model's tokenizer.

Executor conformance needs a model whose every operation runs in seconds on a CPU, not the
real weights: this writes the real GGUF's metadata (tokenizer, template, EOS ids) with a
small shape (2 layers, 64 wide, 4 query / 2 kv heads of 16) and F32 random tensors under the
llama names, so the recipe prepares it like the real one.

    path = write_tiny_gguf(tmp_path / "tiny.gguf")
"""
from __future__ import annotations

import pathlib

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from ignition.sources.gguf import default_gguf_path

TINY_SHAPE = {"block_count": 2, "embedding_length": 64, "feed_forward_length": 128,
              "attention.head_count": 4, "attention.head_count_kv": 2, "rope.dimension_count": 16}


def write_tiny_gguf(path: pathlib.Path, seed: int = 0) -> pathlib.Path:
    source = GGUFReader(default_gguf_path())
    writer = GGUFWriter(str(path), "llama")
    for key, field in source.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        short = key.removeprefix("llama.")
        if short in TINY_SHAPE:
            writer.add_uint32(key, TINY_SHAPE[short])
            continue
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            writer.add_array(key, field.contents())
        else:
            writer.add_key_value(key, field.contents(), kind)
    dim, ffn = TINY_SHAPE["embedding_length"], TINY_SHAPE["feed_forward_length"]
    heads, kv_heads = TINY_SHAPE["attention.head_count"], TINY_SHAPE["attention.head_count_kv"]
    head_dim = dim // heads
    vocab = int(source.fields["llama.vocab_size"].contents())
    rng = np.random.default_rng(seed)

    def tensor(name: str, *shape: int, scale: float) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float32))

    def norm(name: str) -> None:
        writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(dim, dtype=np.float32)).astype(np.float32))

    tensor("token_embd.weight", vocab, dim, scale=1.0)
    norm("output_norm.weight")
    for i in range(TINY_SHAPE["block_count"]):
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
        tensor(f"blk.{i}.attn_q.weight", heads * head_dim, dim, scale=dim ** -0.5)
        tensor(f"blk.{i}.attn_k.weight", kv_heads * head_dim, dim, scale=dim ** -0.5)
        tensor(f"blk.{i}.attn_v.weight", kv_heads * head_dim, dim, scale=dim ** -0.5)
        tensor(f"blk.{i}.attn_output.weight", dim, heads * head_dim, scale=dim ** -0.5)
        tensor(f"blk.{i}.ffn_gate.weight", ffn, dim, scale=dim ** -0.5)
        tensor(f"blk.{i}.ffn_up.weight", ffn, dim, scale=dim ** -0.5)
        tensor(f"blk.{i}.ffn_down.weight", dim, ffn, scale=ffn ** -0.5)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
