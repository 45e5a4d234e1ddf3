"""Read a local Hugging Face checkpoint directory: config.json, safetensors, tokenizer files.

A second source beside GGUF for Llama-shaped families (`model_type` llama or qwen2). The
directory holds `config.json`, the weights as `model.safetensors` or shards listed in
`model.safetensors.index.json`, `tokenizer.json` (carried into the core verbatim: it is already
the serving tokenizer's format) and `tokenizer_config.json` (its `chat_template`, and the
bos/eos/pad spellings). `generation_config.json` is optional (EOS ids, sampling defaults).

The reader exposes what the shared decoder reads from a GGUF: a `LlamaShape` and tensors by
their GGUF names (`blk.N.attn_q.weight`, ...) in PyTorch (out, in) layout, float32. Hugging Face
stores q/k in the rotate-half (NEOX) order for both families, so recipes rotate half-split pairs
with the weights as stored (no permutation). `lm_head.weight` is the separate head unless
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
from ignition.sources.rope_scaling import RopeScaling, RopeScalingError
from ignition.sources.safetensors_file import SafetensorsError, SafetensorsFile

FAMILIES = frozenset({"llama", "qwen2"})
# GGUF tensor name (per block: "blk.{i}." prefix) -> Hugging Face name (per block: "model.layers.{i}.")
_BLOCK = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
          "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
          "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
          "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
          "attn_v.bias": "self_attn.v_proj.bias", "ffn_gate.weight": "mlp.gate_proj.weight",
          "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight"}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}


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


def shape_from_config(config: dict[str, Any], where: Path, *, has_head: bool, qkv_bias: bool,
                      tokenizer_tokens: int = 0) -> LlamaShape:
    """The `LlamaShape` of a config.json (`where` names it in errors); `has_head`: a separate
    lm_head is present, `qkv_bias`: the q/k/v projections carry biases, `tokenizer_tokens`: the
    ids the tokenizer spells (0: no tokenizer, as for a layout; else ids past it are masked)."""
    def integer(key: str, default: int | None = None) -> int:
        value = config.get(key, default)
        if value is None:
            raise CheckpointError(f"{where}: missing {key!r}")
        return int(value)

    hidden, heads = integer("hidden_size"), integer("num_attention_heads")
    head_dim = integer("head_dim", hidden // heads)
    vocab = integer("vocab_size")
    if tokenizer_tokens > vocab:
        raise CheckpointError(f"{where}: vocab_size {vocab} is smaller than the {tokenizer_tokens} ids of tokenizer.json")
    try:
        rope_scaling = RopeScaling.from_config(config, str(where))
    except RopeScalingError as exc:
        raise CheckpointError(str(exc)) from exc
    return LlamaShape(
        architecture=str(config.get("model_type", "")), n_layers=integer("num_hidden_layers"), hidden=hidden,
        n_heads=heads, n_kv_heads=integer("num_key_value_heads", heads), head_dim=head_dim,
        ffn=integer("intermediate_size"), vocab=vocab,
        rope_theta=float(config.get("rope_theta", 10000.0)), rope_dim=head_dim,
        rms_eps=float(config.get("rms_norm_eps", 1e-6)),
        context_length=integer("max_position_embeddings", 2048),
        tied_embeddings=bool(config.get("tie_word_embeddings", False)) or not has_head, qkv_bias=qkv_bias,
        tokenizer_tokens=tokenizer_tokens if tokenizer_tokens < vocab else 0, rope_scaling=rope_scaling)


class HFCheckpoint:
    """An opened checkpoint directory (safetensors files are memory-mapped, read per tensor)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.config = _json(path / "config.json")
        self.family = str(self.config.get("model_type", ""))
        if self.family not in FAMILIES:
            raise CheckpointError(f"{path / 'config.json'}: model_type {self.family!r}; supported: {sorted(FAMILIES)}")
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
        self.shape = self._read_shape()

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

    def _read_shape(self) -> LlamaShape:
        return shape_from_config(self.config, self.path / "config.json", has_head="lm_head.weight" in self._where,
                                 qkv_bias="model.layers.0.self_attn.q_proj.bias" in self._where,
                                 tokenizer_tokens=self.tokenizer_tokens)

    # ---- what the decoder and preparation read -------------------------------------------------
    def hf_name(self, name: str) -> str:
        if name in _GLOBAL:
            return _GLOBAL[name]
        block, _, rest = name.partition(".")[2].partition(".")
        if name.startswith("blk.") and rest in _BLOCK:
            return f"model.layers.{block}.{_BLOCK[rest]}"
        raise UnknownTensorError(f"{self.path}: no mapping for tensor {name!r}")

    def tensor(self, name: str) -> np.ndarray:
        """The tensor of GGUF name `name` as float32 (out, in)."""
        key = self.hf_name(name)
        handle = self._where.get(key)
        if handle is None:
            raise UnknownTensorError(f"{self.path}: no tensor {key!r}")
        try:
            return np.ascontiguousarray(handle.tensor(key), dtype=np.float32)
        except SafetensorsError as exc:
            raise CheckpointError(str(exc)) from exc

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
