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
import gguf.quants
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


def tiny_weights(shape: TinyShape, vocab: int, seed: int = 0, biases: bool = True,
                 tied: bool = False) -> dict[str, np.ndarray]:
    """Random weights by GGUF tensor name, (out, in) float32."""
    rng = np.random.default_rng(seed)

    def normal(*dims: int, scale: float) -> np.ndarray:
        return (rng.standard_normal(dims) * scale).astype(np.float32)

    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    w = {"token_embd.weight": normal(vocab, shape.hidden, scale=1.0),
         "output_norm.weight": 1 + normal(shape.hidden, scale=0.1)}
    if not tied:
        w["output.weight"] = normal(vocab, shape.hidden, scale=0.2)
    for i in range(shape.layers):
        b = f"blk.{i}."
        w |= {b + "attn_norm.weight": 1 + normal(shape.hidden, scale=0.1),
              b + "attn_q.weight": normal(q, shape.hidden, scale=0.15),
              b + "attn_k.weight": normal(kv, shape.hidden, scale=0.15),
              b + "attn_v.weight": normal(kv, shape.hidden, scale=0.15),
              b + "attn_output.weight": normal(shape.hidden, q, scale=0.1),
              b + "ffn_norm.weight": 1 + normal(shape.hidden, scale=0.1),
              b + "ffn_gate.weight": normal(shape.ffn, shape.hidden, scale=0.15),
              b + "ffn_up.weight": normal(shape.ffn, shape.hidden, scale=0.15),
              b + "ffn_down.weight": normal(shape.hidden, shape.ffn, scale=0.1)}
        if biases:
            w |= {b + "attn_q.bias": normal(q, scale=0.5),
                  b + "attn_k.bias": normal(kv, scale=3.0),      # large key biases, as in the real family
                  b + "attn_v.bias": normal(kv, scale=0.5)}
    return w


def write_tiny_gguf(path: Path, shape: TinyShape = TinyShape(), seed: int = 0, arch: str = "qwen2",
                    weights: dict[str, np.ndarray] | None = None, chat_template: str | None = None,
                    quantized: bool = False) -> Path:
    """A GGUF of `arch` with random weights (f32 tensors, PyTorch (out, in) layout, q/k rows as
    given: no permutation); `chat_template` replaces the ChatML tool template (a recipe that
    checks its checkpoint's template gets that one). `quantized` stores the matrices as the
    SmolLM2 GGUF does: the embedding (and a separate head) Q8_0, every layer's matrices Q4_1."""
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
    writer.add_chat_template(chat_template or chatml_tool_template("You are a tiny random model."))
    for name, array in (weights if weights is not None else tiny_weights(shape, len(tokens), seed)).items():
        if quantized and array.ndim == 2:
            kind = (gguf.GGMLQuantizationType.Q8_0 if name in ("token_embd.weight", "output.weight")
                    else gguf.GGMLQuantizationType.Q4_1)
            writer.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# Hugging Face names of the GGUF tensor names (written out here, independently of the reader)
_HF_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
_HF_BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def _hf_name(name: str) -> str:
    if name in _HF_GLOBAL:
        return _HF_GLOBAL[name]
    _, block, tensor, kind = name.split(".")
    return f"model.layers.{block}.{_HF_BLOCK[tensor]}.{kind}"


def bf16_round(array: np.ndarray) -> np.ndarray:
    """float32 -> the nearest bfloat16 bit patterns (uint16), ties to even (written out here,
    independently of the reader, which only widens)."""
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_values(array: np.ndarray) -> np.ndarray:
    """The float32 values a bf16 checkpoint of `array` stores."""
    return (bf16_round(array).astype(np.uint32) << 16).view(np.float32)


_SAFETENSORS_DTYPES = {"float32": ("F32", np.float32), "float16": ("F16", np.float16)}


def save_safetensors(tensors: dict[str, np.ndarray], path: Path, dtype: str) -> None:
    """Write a safetensors file by its published layout (8-byte header length, JSON header, data),
    every tensor in `dtype` ("float32", "float16" or "bfloat16")."""
    import json

    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        if dtype == "bfloat16":
            code, data = "BF16", bf16_round(tensors[name]).tobytes()
        else:
            code, numpy_dtype = _SAFETENSORS_DTYPES[dtype]
            data = np.ascontiguousarray(tensors[name], dtype=numpy_dtype).tobytes()
        header[name] = {"dtype": code, "shape": list(tensors[name].shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(len(encoded).to_bytes(8, "little") + encoded + b"".join(blobs))


NO_TEMPLATE = ""   # chat_template=NO_TEMPLATE writes a tokenizer_config.json without one


def write_tiny_hf_checkpoint(directory: Path, family: str, weights: dict[str, np.ndarray],
                             shape: TinyShape = TinyShape(), shards: int = 1, dtype: str = "float32",
                             config: dict | None = None, generation: dict | None = None,
                             chat_template: str | None = None) -> Path:
    """config.json, safetensors (`shards` files with an index when > 1; tensors stored as `dtype`:
    float32, float16 or bfloat16), tokenizer.json, tokenizer_config.json (with the chat template,
    or `chat_template`; NO_TEMPLATE: none) and generation_config.json (`generation` replaces it;
    {} writes none). `config` adds or replaces config.json keys (rope_scaling, ...). The weights'
    embedding rows give `vocab_size`: more rows than the tokenizer's ids make a padded vocabulary."""
    import json

    from ignition.sources.gguf import TokenizerFields
    from ignition.sources.tokenizer import tokenizer_from_fields

    directory.mkdir(parents=True, exist_ok=True)
    tokens, merges, types = tiny_vocabulary()
    tied = "output.weight" not in weights
    settings = {"model_type": family,
                "architectures": ["Qwen2ForCausalLM" if family == "qwen2" else "LlamaForCausalLM"],
                "hidden_size": shape.hidden, "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads,
                "num_hidden_layers": shape.layers, "intermediate_size": shape.ffn,
                "vocab_size": int(weights["token_embd.weight"].shape[0]),
                "rope_theta": shape.rope_theta, "rms_norm_eps": shape.eps, "max_position_embeddings": shape.context,
                "tie_word_embeddings": tied, "eos_token_id": tokens.index("<|im_end|>"), "torch_dtype": dtype}
    (directory / "config.json").write_text(json.dumps(settings | (config or {})))
    named = {_hf_name(k): np.ascontiguousarray(v) for k, v in weights.items()}
    keys = sorted(named)
    if shards == 1:
        save_safetensors(named, directory / "model.safetensors", dtype)
    else:
        weight_map = {}
        for index in range(shards):
            file = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
            part = {k: named[k] for k in keys[index::shards]}
            save_safetensors(part, directory / file, dtype)
            weight_map |= {k: file for k in part}
        (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    fields = TokenizerFields(model="gpt2", pre="qwen2", tokens=tuple(tokens), merges=tuple(merges),
                             token_types=tuple(types), bos_id=None, eos_id=None, unk_id=None, pad_id=None,
                             add_bos=False, add_space_prefix=False)
    (directory / "tokenizer.json").write_text(tokenizer_from_fields(fields).to_str())
    template = chatml_tool_template("You are a tiny random model.") if chat_template is None else chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(
        ({"chat_template": template} if template else {})
        | {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}))
    if generation is None:
        generation = {"eos_token_id": [tokens.index("<|im_end|>"), tokens.index("<|endoftext|>")],
                      "temperature": 0.6, "top_p": 0.9}
    if generation:
        (directory / "generation_config.json").write_text(json.dumps(generation))
    return directory


# ---- gemma3: SentencePiece vocabulary, q/k norms, sandwich norms, sliding windows ---------------

@dataclasses.dataclass(frozen=True)
class TinyGemmaShape:
    layers: int = 6            # layers 0-4 slide, layer 5 attends to everything (period 6)
    hidden: int = 64
    heads: int = 2
    kv_heads: int = 1
    head_dim: int = 48         # q width 96 != hidden, as in the real family
    ffn: int = 96
    rope_theta: float = 1_000_000.0
    window: int = 8            # short, so a few dozen tokens cross it
    eps: float = 1e-6
    context: int = 4096


_SPM_MERGED = ("▁t", "he", "▁the", "in", "er", "▁a", "an", "on", "re", "▁o", "▁of", "is", "▁is", "at", "en",
               "▁w", "or", "it", "es", "ing", "▁c", "ed", "▁s", "ar", "▁in", "▁an", "le", "ro", "al", "om")


def tiny_sentencepiece_vocabulary() -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) laid out like the family's: <pad> <eos> <bos> <unk> at 0-3,
    <start_of_turn> / <end_of_turn> at 105 / 106 (control), "\\n" user-defined, 256 <0xXX> byte
    tokens, single characters, and merged pieces scored best first."""
    singles = ["▁"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)] \
        + list("0123456789.,!?'-:;()")
    normal = singles + list(_SPM_MERGED)
    tokens: list[str] = ["<pad>", "<eos>", "<bos>", "<unk>"]
    types: list[int] = [3, 3, 3, 2]
    scores: list[float] = [0.0] * 4
    rest = iter(normal)
    merged_score = {piece: -float(i) for i, piece in enumerate(_SPM_MERGED)}
    def add_normal() -> None:
        piece = next(rest)
        tokens.append(piece)
        types.append(1)
        scores.append(merged_score.get(piece, -1000.0))
    while len(tokens) < 105:
        add_normal()
    tokens += ["<start_of_turn>", "<end_of_turn>", "\n"]
    types += [3, 3, 4]
    scores += [0.0, 0.0, 0.0]
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        types.append(6)
        scores.append(0.0)
    for piece in rest:
        tokens.append(piece)
        types.append(1)
        scores.append(merged_score.get(piece, -1000.0))
    return tokens, scores, types


def tiny_gemma_weights(shape: TinyGemmaShape, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def normal(*dims: int, scale: float) -> np.ndarray:
        return (rng.standard_normal(dims) * scale).astype(np.float32)

    q, kv, d = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.hidden
    w = {"token_embd.weight": normal(vocab, d, scale=0.2), "output_norm.weight": 1 + normal(d, scale=0.1)}
    for i in range(shape.layers):
        b = f"blk.{i}."
        w |= {b + "attn_norm.weight": 1 + normal(d, scale=0.1),
              b + "attn_q.weight": normal(q, d, scale=0.15), b + "attn_k.weight": normal(kv, d, scale=0.15),
              b + "attn_v.weight": normal(kv, d, scale=0.15),
              b + "attn_q_norm.weight": 1 + normal(shape.head_dim, scale=0.2),
              b + "attn_k_norm.weight": 1 + normal(shape.head_dim, scale=0.2),
              b + "attn_output.weight": normal(d, q, scale=0.1),
              b + "post_attention_norm.weight": 1 + normal(d, scale=0.1),
              b + "ffn_norm.weight": 1 + normal(d, scale=0.1),
              b + "ffn_gate.weight": normal(shape.ffn, d, scale=0.15),
              b + "ffn_up.weight": normal(shape.ffn, d, scale=0.15),
              b + "ffn_down.weight": normal(d, shape.ffn, scale=0.1),
              b + "post_ffw_norm.weight": 1 + normal(d, scale=0.1)}
    return w


def write_tiny_gemma_gguf(path: Path, shape: TinyGemmaShape = TinyGemmaShape(), seed: int = 0,
                          vocabulary_multiple: int = 1) -> Path:
    """A gemma3 GGUF with random weights, a tied head, the family's metadata keys (key_length,
    sliding_window) and a tiny SentencePiece vocabulary (scores, byte fallback, add_bos), padded
    with `<unused{i}>` control tokens to a multiple of `vocabulary_multiple` (16 for a core
    prepared with the GPU kernels, whose vocabulary widths must be multiples of 16)."""
    tokens, scores, types = tiny_sentencepiece_vocabulary()
    while len(tokens) % vocabulary_multiple:
        tokens.append(f"<unused{len(tokens)}>")
        scores.append(0.0)
        types.append(3)
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_name("tiny random gemma3 stand-in")
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_sliding_window(shape.window)
    writer.add_layer_norm_rms_eps(shape.eps)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)
    for name, array in tiny_gemma_weights(shape, len(tokens), seed).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
