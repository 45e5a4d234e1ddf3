"""Read a local Hugging Face checkpoint directory: config.json, safetensors, tokenizer files.

A second source beside GGUF for the families of ignition/sources/hf_families.py (llama, qwen2,
qwen3, mistral, gemma3_text, gemma3), each a row of data read by the shared code here. The
directory holds `config.json`, the weights as `model.safetensors` or shards listed in
`model.safetensors.index.json`, `tokenizer.json` (carried into the core verbatim: it is already
the serving tokenizer's format) and `tokenizer_config.json` (its `chat_template`, and the
bos/eos/pad spellings). `generation_config.json` is optional (EOS ids, sampling defaults).

The reader exposes what the shared decoder reads from a GGUF: a `LlamaShape`, the decoder
options the family's features set (`decoder_options`), and tensors by their GGUF names
(`blk.N.attn_q.weight`, ...) in PyTorch (out, in) layout, float32, with the family's stored norm
convention resolved (Gemma's w means 1 + w: the tensor read is 1 + w). Hugging Face stores q/k
in the rotate-half (NEOX) order for every family, so recipes rotate half-split pairs with the
weights as stored (no permutation). `lm_head.weight` is the separate head unless
`tie_word_embeddings`. Tensors may be stored f32, f16 or bf16 (safetensors_file.py reads all
three with numpy, no torch).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ignition.sources.gguf import GGUFError, LlamaShape, UnknownTensorError
from ignition.sources.hf_families import ACTIVATIONS, FAMILIES, GLOBALS, HEAD, Family
from ignition.sources.rope_scaling import RopeScaling, RopeScalingError
from ignition.sources.safetensors_file import SafetensorsError, SafetensorsFile

class CheckpointError(GGUFError):
    """The directory is not a readable checkpoint of a supported family (the message names the file/key)."""


@dataclass(frozen=True)
class GenerationConfig:
    eos_token_ids: tuple[int, ...]
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None


def _json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path.parent}: no {path.name}") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not JSON ({exc})") from exc


def family_of(config: dict[str, Any], where: Path) -> tuple[Family, dict[str, Any]]:
    """The family row of config.json's model_type and the decoder's settings: the config (or its
    text_config) over the family's defaults. Keys the family refuses name themselves."""
    model_type = str(config.get("model_type", ""))
    family = FAMILIES.get(model_type)
    if family is None:
        raise CheckpointError(f"{where}: model_type {model_type!r} is not supported; supported: {sorted(FAMILIES)}")
    declared = config.get("text_config") if family.text_config else config
    if not isinstance(declared, dict):
        raise CheckpointError(f"{where}: missing 'text_config' (a {model_type} checkpoint's text decoder)")
    settings = {**family.defaults, **declared}
    for key in family.refused:
        if settings.get(key):
            raise CheckpointError(f"{where}: {key} {settings[key]!r} is not supported for model_type "
                                  f"{model_type!r} (the shared decoder has no such mechanism)")
    return family, settings


def _integer(config: dict[str, Any], where: Path, key: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if value is None:
        raise CheckpointError(f"{where}: missing {key!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 0:
        raise CheckpointError(f"{where}: {key} {value!r} must be a whole number >= 0")
    return int(value)


def shape_from_config(config: dict[str, Any], where: Path, family: Family, *, has_head: bool,
                      tokenizer_tokens: int = 0) -> LlamaShape:
    """The `LlamaShape` of the decoder settings `config` (family_of's; `where` names the file in
    errors); `has_head`: a separate lm_head is present, `tokenizer_tokens`: the ids the
    tokenizer spells (0: no tokenizer, as for a layout; else ids past it are masked)."""
    def integer(key: str, default: int | None = None) -> int:
        return _integer(config, where, key, default)

    hidden, heads = integer("hidden_size"), integer("num_attention_heads")
    if heads == 0:
        raise CheckpointError(f"{where}: num_attention_heads must be at least 1")
    head_dim = integer("head_dim", hidden // heads)
    vocab = integer("vocab_size")
    if tokenizer_tokens > vocab:
        raise CheckpointError(f"{where}: vocab_size {vocab} is smaller than the {tokenizer_tokens} ids of tokenizer.json")
    try:
        rope_scaling = RopeScaling.from_config(config, str(where))
    except RopeScalingError as exc:
        raise CheckpointError(str(exc)) from exc
    window = integer("sliding_window", 0) if family.sliding_window and config.get("sliding_window") is not None else 0
    return LlamaShape(
        architecture=family.model_type, n_layers=integer("num_hidden_layers"), hidden=hidden,
        n_heads=heads, n_kv_heads=integer("num_key_value_heads", heads), head_dim=head_dim,
        ffn=integer("intermediate_size"), vocab=vocab,
        rope_theta=float(config.get("rope_theta", 10000.0)), rope_dim=head_dim,
        rms_eps=float(config.get("rms_norm_eps", 1e-6)),
        context_length=integer("max_position_embeddings", 2048),
        tied_embeddings=bool(config.get("tie_word_embeddings", False)) or not has_head, qkv_bias=family.qkv_bias,
        qk_norm=family.qk_norm, post_norms=family.post_norms, sliding_window=window,
        tokenizer_tokens=tokenizer_tokens if tokenizer_tokens < vocab else 0, rope_scaling=rope_scaling)


def full_attention_period(config: dict[str, Any], layers: int, where: Path) -> int:
    """Every how many layers one attends to the whole context (index period - 1 mod period; 0:
    every layer slides): config.json's `layer_types`, else its `sliding_window_pattern`."""
    types = config.get("layer_types")
    if types is None:
        key = next((k for k in ("sliding_window_pattern", "_sliding_window_pattern") if config.get(k) is not None), "")
        return _integer(config, where, key) if key else 0
    if (not isinstance(types, list) or len(types) != layers
            or not set(types) <= {"sliding_attention", "full_attention"}):
        raise CheckpointError(f"{where}: layer_types must name 'sliding_attention' or 'full_attention' for each "
                              f"of the {layers} layers")
    full = [i for i, kind in enumerate(types) if kind == "full_attention"]
    period = full[0] + 1 if full else 0
    if any((kind == "full_attention") != bool(period and i % period == period - 1) for i, kind in enumerate(types)):
        raise CheckpointError(f"{where}: layer_types: the full-attention layers must recur every N layers "
                              f"(layers N-1, 2N-1, ...), not {full}")
    return period


def decoder_options(config: dict[str, Any], where: Path, family: Family, shape: LlamaShape) -> dict[str, Any]:
    """The shared decoder's options (llama_decoder.DecoderOptions fields) the family's features set."""
    activation = str(config.get(family.activation_key, "silu"))
    if activation not in ACTIVATIONS:
        raise CheckpointError(f"{where}: {family.activation_key} {activation!r} is not supported; "
                              f"supported: {sorted(ACTIVATIONS)}")
    scalar = config.get(family.attention_scalar_key) if family.attention_scalar_key else None
    if scalar is not None and (isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or scalar <= 0):
        raise CheckpointError(f"{where}: {family.attention_scalar_key} {scalar!r} must be a number > 0")
    local_theta = config.get(family.local_rope_theta_key) if family.local_rope_theta_key else None
    return dict(activation=ACTIVATIONS[activation], embedding_scale=family.embedding_scale,
                attention_scalar=float(scalar or 0.0), local_rope_theta=float(local_theta or 0.0),
                full_attention_period=full_attention_period(config, shape.n_layers, where) if shape.sliding_window else 0)


class HFCheckpoint:
    """An opened checkpoint directory (safetensors files are memory-mapped, read per tensor)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.config = _json(path / "config.json")
        self.family, self.settings = family_of(self.config, path / "config.json")
        index = path / "model.safetensors.index.json"
        files = sorted(set(_json(index)["weight_map"].values())) if index.exists() else ["model.safetensors"]
        self.weight_files = [path / f for f in files]
        self._where: dict[str, SafetensorsFile] = {}
        for file in self.weight_files:
            if not file.is_file():
                raise CheckpointError(f"{path}: no {file.name}")
            try:
                handle = SafetensorsFile(file)
            except SafetensorsError as exc:
                raise CheckpointError(str(exc)) from exc
            for key in handle.keys():
                self._where[key] = handle
        self.tokenizer_config = _json(path / "tokenizer_config.json")
        if not (path / "tokenizer.json").is_file():
            raise CheckpointError(f"{path}: no tokenizer.json")
        self.tokenizer_tokens = self._count_tokenizer_ids()
        self.prefix = next((p for p in self.family.prefixes if p + GLOBALS["token_embd.weight"] in self._where),
                           self.family.prefixes[0])
        self.shape = shape_from_config(self.settings, path / "config.json", self.family,
                                       has_head=self._head_name() in self._where,
                                       tokenizer_tokens=self.tokenizer_tokens)
        self.options = decoder_options(self.settings, path / "config.json", self.family, self.shape)

    @classmethod
    def open(cls, path: str | Path) -> "HFCheckpoint":
        path = Path(path)
        if not path.is_dir():
            raise CheckpointError(f"no checkpoint directory at {path}")
        return cls(path)

    def _count_tokenizer_ids(self) -> int:
        """Ids tokenizer.json spells (its model's vocabulary with the added tokens), counted as
        the serving frontend counts them."""
        from tokenizers import Tokenizer

        try:
            return int(Tokenizer.from_str(self.tokenizer_json()).get_vocab_size(with_added_tokens=True))
        except Exception as exc:    # the tokenizers library raises plain exceptions for bad files
            raise CheckpointError(f"{self.path / 'tokenizer.json'}: not a tokenizers file ({exc})") from exc

    def _head_name(self) -> str:
        # a text decoder under "language_model.model." keeps its head beside it ("language_model.")
        outer = self.prefix.removesuffix("model.") if self.prefix.endswith(".model.") else ""
        return outer + HEAD

    # ---- what the decoder and preparation read -------------------------------------------------
    def hf_name(self, name: str) -> str:
        if name in GLOBALS:
            return self.prefix + GLOBALS[name]
        if name == "output.weight":
            return self._head_name()
        block, _, rest = name.partition(".")[2].partition(".")
        if name.startswith("blk.") and rest in self.family.blocks:
            return f"{self.prefix}layers.{block}.{self.family.blocks[rest]}"
        raise UnknownTensorError(f"{self.path}: no mapping for tensor {name!r}")

    def tensor(self, name: str) -> np.ndarray:
        """The tensor of GGUF name `name` as float32 (out, in); a norm weight as the factor it
        applies (the family's norm_offset added)."""
        key = self.hf_name(name)
        handle = self._where.get(key)
        if handle is None:
            raise UnknownTensorError(f"{self.path}: no tensor {key!r}")
        try:
            values = np.ascontiguousarray(handle.tensor(key), dtype=np.float32)
        except SafetensorsError as exc:
            raise CheckpointError(str(exc)) from exc
        return values + np.float32(self.family.norm_offset) if name.endswith("norm.weight") and self.family.norm_offset \
            else values

    def tokenizer_json(self) -> str:
        return (self.path / "tokenizer.json").read_text()

    @property
    def chat_template(self) -> str | None:
        template = self.tokenizer_config.get("chat_template")
        if isinstance(template, list):   # named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if template is None and (self.path / "chat_template.jinja").is_file():
            template = (self.path / "chat_template.jinja").read_text()
        return template

    def special_token(self, key: str) -> str:
        value = self.tokenizer_config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        return str(value or "")

    def generation_config(self) -> GenerationConfig:
        """EOS ids (one or a list; generation_config.json, else config.json) and the sampling
        defaults generation_config.json declares (temperature, top_p, top_k, min_p,
        repetition_penalty; absent keys: None). `do_sample` is not read: as in vLLM, the
        declared values are the defaults whatever it says."""
        path = self.path / "generation_config.json"
        generation = _json(path) if path.exists() else {}
        eos = generation.get("eos_token_id", self.config.get("eos_token_id"))
        if eos is None:
            raise CheckpointError(f"{self.path}: no eos_token_id in generation_config.json or config.json")
        ids = tuple(dict.fromkeys(eos if isinstance(eos, list) else [eos]))
        if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.tokenizer_tokens
                              for i in ids):
            raise CheckpointError(f"{path}: eos_token_id {eos!r} must be one id or a list of ids "
                                  f"in [0, {self.tokenizer_tokens}) (the ids of tokenizer.json)")

        def number(key: str, valid: Callable[[float], bool], rule: str) -> float | None:
            value = generation.get(key)
            if value is None:
                return None
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not valid(float(value)):
                raise CheckpointError(f"{path}: {key} {value!r} {rule}")
            return float(value)

        top_k = number("top_k", lambda v: v >= 0 and v == int(v), "must be a whole number >= 0 (0: off)")
        return GenerationConfig(
            ids, temperature=number("temperature", lambda v: v >= 0, "must be >= 0"),
            top_p=number("top_p", lambda v: 0 < v <= 1, "must lie in (0, 1]"),
            top_k=None if top_k is None else int(top_k),
            min_p=number("min_p", lambda v: 0 <= v <= 1, "must lie in [0, 1]"),
            repetition_penalty=number("repetition_penalty", lambda v: v > 0, "must be > 0 (1: off)"))

    def source_files(self) -> list[Path]:
        return [self.path / "config.json", *self.weight_files, self.path / "tokenizer.json",
                self.path / "tokenizer_config.json"]
