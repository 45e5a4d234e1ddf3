"""A model layout from a Hugging Face `config.json` alone: the shape, no weights, no tokenizer.

For measuring and checking the kernels at the shapes users serve (0.5B-8B) without carrying
checkpoints: preparation records the programs of the layout (every buffer, node and launch
geometry) from the config's hidden size, layers, heads, KV heads, intermediate size, vocabulary,
RoPE base and head tying, exactly as it would for the checkpoint (`HFCheckpoint` reads the same
keys through `family_of` and `shape_from_config`). Families: those of hf_families.py, with their
features (q/k/v biases, q/k norms, post norms, sliding layers) as the family row declares them.

Weights are data the layout does not have. `HFLayout.open(path, seed=N)` makes seeded random
ones on the host (small layouts: CPU tests, the numpy executor); `seed=None` leaves them to the
loader (`weights_in_core` False): preparation then lays out the weight buffers without bytes,
and the device bundle (tests/gpu/model_bundle.py) fills them with seeded random fp16 on the GPU
machine, so an 8B layout prepares here in seconds and never travels as 16 GB.

`rope_scaling` (Llama 3.1's long-context frequencies) is not applied: the RoPE table is the
plain `rope_theta` one. Speed does not depend on it, and a layout has no weights whose outputs
it would change. The tokenizer is a byte-level BPE of the 256 byte tokens plus the ChatML
control tokens (ids from 0; the model's vocabulary is larger), enough to serve a layout's core.
"""
from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from ignition.sources.gguf import UnknownTensorError
from ignition.sources.hf_checkpoint import CheckpointError, decoder_options, family_of, shape_from_config

CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
WEIGHT_SCALE = 0.02      # N(0, 0.02) matrices; norm weights 1 + N(0, 0.02)


class HFLayout:
    """An opened config.json; `tensor(name)` gives seeded random weights (seed set) by GGUF name."""

    def __init__(self, path: Path, seed: int | None) -> None:
        self.path = path
        try:
            self.config: dict[str, Any] = json.loads(path.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"no layout file at {path}") from None
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{path}: not JSON ({exc})") from exc
        self.family, settings = family_of(self.config, path)
        self.shape = shape_from_config(settings, path, self.family, has_head=not settings.get("tie_word_embeddings"))
        self.options = decoder_options(settings, path, self.family, self.shape)
        self.seed = seed
        self.weights_in_core = seed is not None
        self.chat_template: str | None = None

    @classmethod
    def open(cls, path: str | Path, seed: int | None = 0) -> "HFLayout":
        return cls(Path(path), seed)

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """The (out, in) shape of GGUF tensor `name` in this layout."""
        s = self.shape
        widths = {"attn_q": s.q_dim, "attn_k": s.kv_dim, "attn_v": s.kv_dim}
        if name in ("token_embd.weight", "output.weight"):
            return (s.vocab, s.hidden)
        if name == "output_norm.weight":
            return (s.hidden,)
        block, _, rest = name.partition(".")[2].partition(".")
        if name.startswith("blk.") and block.isdigit() and int(block) < s.n_layers:
            kind, _, part = rest.partition(".")
            if kind in ("attn_norm", "ffn_norm", "post_attention_norm", "post_ffw_norm") and part == "weight":
                return (s.hidden,)
            if kind in ("attn_q_norm", "attn_k_norm") and part == "weight":
                return (s.head_dim,)
            if kind in widths:
                return (widths[kind], s.hidden) if part == "weight" else (widths[kind],)
            shapes = {"attn_output": (s.hidden, s.q_dim), "ffn_gate": (s.ffn, s.hidden), "ffn_up": (s.ffn, s.hidden),
                      "ffn_down": (s.hidden, s.ffn)}
            if kind in shapes and part == "weight":
                return shapes[kind]
        raise UnknownTensorError(f"{self.path}: layout has no tensor {name!r}")

    def tensor(self, name: str) -> np.ndarray:
        """Seeded random float32 weights of `name` (the same every call); with no seed, a zero-cost
        placeholder of the right shape (preparation keeps no bytes of it)."""
        shape = self.tensor_shape(name)
        if self.seed is None:
            return np.broadcast_to(np.float32(0), shape)
        rng = np.random.default_rng([self.seed, zlib.crc32(name.encode())])
        values = rng.standard_normal(shape, dtype=np.float32) * WEIGHT_SCALE
        return values + 1 if name.endswith("norm.weight") else values

    def tokenizer_json(self) -> str:
        vocab = {token: i for i, token in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CONTROL_TOKENS])
        return tokenizer.to_str()

    def eos_token_ids(self) -> tuple[int, ...]:
        """The ChatML end token's id in the layout's tokenizer."""
        return (256 + CONTROL_TOKENS.index("<|im_end|>"),)

    def source_files(self) -> list[Path]:
        return [self.path]
