"""Small random-weight stand-ins of each architecture family, written by the tests themselves.

`write_tiny_gguf(path, family)` writes a GGUF with the family's metadata keys, tensor names and
conventions (qwen2: q/k/v biases, a separate output head, the `qwen2` pre-tokenizer) and a tiny
byte-level BPE vocabulary holding the family's control and user-defined tokens. Recipes prepare
these like their real checkpoints, so CI covers every architecture feature in seconds; the real
weights are exercised by the tests marked `real_weights`.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np

from ignition.recipes.chatml_tool_template import chatml_tool_template


@dataclasses.dataclass(frozen=True)
class TinyShape:
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    ffn: int = 96
    rope_theta: float = 1_000_000.0
    eps: float = 1e-6
    context: int = 4096


def byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet), in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    codes, extra = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    table = dict(zip(printable, codes))
    return [chr(table[b]) for b in range(256)]


MERGES = ("Ġ t", "h e", "Ġt he", "i n", "Ġ a", "o n", "Ġ P", "a r", "i s", "r e")
CONTROL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
USER_DEFINED = ("<tool_call>", "</tool_call>")


def tiny_vocabulary() -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token types): bytes, merge results, then control and user-defined tokens."""
    tokens = byte_alphabet()
    for merge in MERGES:
        tokens.append(merge.replace(" ", ""))
    types = [gguf.TokenType.NORMAL] * len(tokens)
    tokens += [*CONTROL, *USER_DEFINED]
    types += [gguf.TokenType.CONTROL] * len(CONTROL) + [gguf.TokenType.USER_DEFINED] * len(USER_DEFINED)
    return tokens, list(MERGES), [int(t) for t in types]


def _weights(shape: TinyShape, vocab: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    def normal(*dims: int, scale: float) -> np.ndarray:
        return (rng.standard_normal(dims) * scale).astype(np.float32)

    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    w = {"token_embd.weight": normal(vocab, shape.hidden, scale=1.0),
         "output_norm.weight": 1 + normal(shape.hidden, scale=0.1),
         "output.weight": normal(vocab, shape.hidden, scale=0.2)}
    for i in range(shape.layers):
        b = f"blk.{i}."
        w |= {b + "attn_norm.weight": 1 + normal(shape.hidden, scale=0.1),
              b + "attn_q.weight": normal(q, shape.hidden, scale=0.15),
              b + "attn_k.weight": normal(kv, shape.hidden, scale=0.15),
              b + "attn_v.weight": normal(kv, shape.hidden, scale=0.15),
              b + "attn_q.bias": normal(q, scale=0.5),
              b + "attn_k.bias": normal(kv, scale=3.0),      # large key biases, as in the real family
              b + "attn_v.bias": normal(kv, scale=0.5),
              b + "attn_output.weight": normal(shape.hidden, q, scale=0.1),
              b + "ffn_norm.weight": 1 + normal(shape.hidden, scale=0.1),
              b + "ffn_gate.weight": normal(shape.ffn, shape.hidden, scale=0.15),
              b + "ffn_up.weight": normal(shape.ffn, shape.hidden, scale=0.15),
              b + "ffn_down.weight": normal(shape.hidden, shape.ffn, scale=0.1)}
    return w


def write_tiny_gguf(path: Path, shape: TinyShape = TinyShape(), seed: int = 0) -> Path:
    """A qwen2-architecture GGUF with random weights (f32 tensors, PyTorch (out, in) layout)."""
    arch = "qwen2"
    tokens, merges, types = tiny_vocabulary()
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny random qwen2 stand-in")
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types(types)
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(chatml_tool_template("You are a tiny random model."))
    for name, array in _weights(shape, len(tokens), np.random.default_rng(seed)).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
