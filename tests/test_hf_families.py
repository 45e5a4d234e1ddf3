"""The checkpoint families from Hugging Face folders: Llama 3.x, Qwen3, Mistral, Gemma 3.

Each test writes a tiny random bf16 checkpoint with that family's real config.json keys and
tensor names, a byte-level tokenizer holding the family's control tokens, and a small faithful
copy of its chat template (tests/family_templates.py). The prepared core's logits (numpy
executor) and greedy tokens (CPU executor) are checked against `oracle_logits` below: a plain
full-recompute forward pass written from each architecture's description (the transformers
modelling code's semantics), sharing nothing with the product's decoder or reader.
"""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import Any, Callable

import numpy as np
import pytest
from helios_proto import contract_pb2 as C
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from helios_backend.engine.model import ModelOptions, NativeModel
from helios_backend.frontend.chat_template import ChatTemplate
from helios_backend.lockstep.generator import GenerationRequest, LockstepGenerator
from helios_backend.syntax.engine import ModelSyntax
from helios_backend.syntax.events import collect
from helios_backend.syntax.markup import atomic_tokens_from_tokenizer_json
from helios_backend.syntax.prompt_state import InitialState, ReasoningStart
from helios_backend.syntax.tables import FrontendSyntax
from ignition.preparation.prepare import prepare
from ignition.recipes.hf_checkpoint import recipe_for
from ignition.sources.hf_checkpoint import CheckpointError, HFCheckpoint
from tests import family_templates
from tests.engine_fixtures import resource_reader
from tests.test_numpy_executor import prefill_logits
from tests.tiny_checkpoints import TinyShape, bf16_values, save_safetensors

# f16 weights and KV cache in the core against the f64 oracle: errors of about 1 % of the logit scale
RELATIVE_TOLERANCE = 1.5e-2
ALPHABET = sorted(pre_tokenizers.ByteLevel.alphabet())
TEXT = "the cat sat on a mat, then it ran to the tree."


@dataclasses.dataclass(frozen=True)
class Spec:
    """One family's tiny checkpoint: its config.json, control tokens, template and architecture."""

    name: str
    config: dict[str, Any]
    specials: tuple[str, ...]         # added tokens (ids 256.. in order)
    template: str
    tokens: dict[str, str]            # tokenizer_config.json bos/eos/pad spellings
    # the architecture, as the oracle reads it (from the family's description, not the product)
    shape: TinyShape = TinyShape()    # layers, hidden, heads, kv_heads, head_dim, ffn
    qkv_bias: bool = False
    qk_norm: bool = False
    sandwich: bool = False            # Gemma: post-attention / post-FFN norms, pre_feedforward_layernorm
    norm_offset: float = 0.0          # Gemma's RMSNorm multiplies by (1 + w)
    gelu: bool = False
    embedding_scale: bool = False
    scalar: float = 0.0               # query_pre_attn_scalar (0: head_dim)
    windows: tuple[int, ...] = ()     # per layer: 0 (whole context) or the window
    theta: float = 1_000_000.0
    local_theta: float = 0.0          # the sliding layers' RoPE base
    frequency_scale: Callable[[np.ndarray], np.ndarray] = lambda f: f   # rope_scaling of the global layers
    tied: bool = True
    prefix: str = "model."
    padding: int = 0                  # vocab_size past the tokenizer's ids
    eps: float = 1e-6


def _llama3_frequencies(f: np.ndarray) -> np.ndarray:
    """Llama 3.1's rope_scaling (factor 8, low 1, high 4, original context 64 here), per frequency."""
    out = []
    for frequency in f:
        wavelength = 2 * math.pi / frequency
        if wavelength > 64 / 1.0:
            out.append(frequency / 8)
        elif wavelength < 64 / 4.0:
            out.append(frequency)
        else:
            smooth = (64 / wavelength - 1.0) / (4.0 - 1.0)
            out.append((1 - smooth) * frequency / 8 + smooth * frequency)
    return np.array(out)


def _vocab(spec: Spec) -> int:
    return 256 + len(spec.specials) + spec.padding


QWEN3_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>")
MISTRAL_TOKENS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                  "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]")
GEMMA_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>")
LLAMA_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                "<|eom_id|>", "<|python_tag|>")


def _gemma_text_config(**extra: Any) -> dict[str, Any]:
    return {"_sliding_window_pattern": 3, "architectures": ["Gemma3ForCausalLM"], "attention_bias": False,
            "attention_dropout": 0.0, "attn_logit_softcapping": None, "bos_token_id": 258, "eos_token_id": 257,
            "final_logit_softcapping": None, "head_dim": 32, "hidden_activation": "gelu_pytorch_tanh",
            "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 96,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            "max_position_embeddings": 32768, "model_type": "gemma3_text", "num_attention_heads": 2,
            "num_hidden_layers": 3, "num_key_value_heads": 1, "pad_token_id": 256, "query_pre_attn_scalar": 24,
            "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000.0, "rope_scaling": None, "rope_theta": 1000000.0,
            "sliding_window": 8, "torch_dtype": "bfloat16", "use_bidirectional_attention": False, "use_cache": True,
            "vocab_size": 256 + len(GEMMA_TOKENS)} | extra


_GEMMA = dict(specials=GEMMA_TOKENS, template=family_templates.GEMMA3,
              tokens={"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"},
              shape=TinyShape(layers=3, heads=2, kv_heads=1, head_dim=32), qk_norm=True, sandwich=True,
              norm_offset=1.0, gelu=True,
              embedding_scale=True, windows=(8, 8, 0), local_theta=10_000.0)

SPECS = {s.name: s for s in (
    Spec("qwen3", {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
                   "bos_token_id": 256, "eos_token_id": 258, "head_dim": 32, "hidden_act": "silu", "hidden_size": 64,
                   "initializer_range": 0.02, "intermediate_size": 96, "max_position_embeddings": 40960,
                   "max_window_layers": 2, "model_type": "qwen3", "num_attention_heads": 4, "num_hidden_layers": 2,
                   "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
                   "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
                   "use_sliding_window": False, "vocab_size": 256 + len(QWEN3_TOKENS) + 9},
         QWEN3_TOKENS, family_templates.QWEN3, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
         shape=TinyShape(head_dim=32), qk_norm=True, padding=9),
    Spec("qwen3-untied", {"architectures": ["Qwen3ForCausalLM"], "head_dim": 16, "hidden_act": "silu",
                          "hidden_size": 64, "intermediate_size": 96, "max_position_embeddings": 40960,
                          "model_type": "qwen3", "num_attention_heads": 4, "num_hidden_layers": 2,
                          "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000,
                          "sliding_window": None, "tie_word_embeddings": False, "use_sliding_window": False,
                          "eos_token_id": 258, "vocab_size": 256 + len(QWEN3_TOKENS)},
         QWEN3_TOKENS, family_templates.QWEN3, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
         qk_norm=True, tied=False),
    Spec("mistral", {"architectures": ["MistralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 257,
                     "eos_token_id": 258, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64,
                     "initializer_range": 0.02, "intermediate_size": 96, "max_position_embeddings": 32768,
                     "model_type": "mistral", "num_attention_heads": 4, "num_hidden_layers": 2,
                     "num_key_value_heads": 2, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": None,
                     "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
                     "vocab_size": 256 + len(MISTRAL_TOKENS)},
         MISTRAL_TOKENS, family_templates.MISTRAL, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
         tied=False, eps=1e-5),
    # Mistral 7B v0.1's layout: every layer slides (here over 8 positions), RoPE base 10,000
    Spec("mistral-window", {"architectures": ["MistralForCausalLM"], "hidden_act": "silu", "hidden_size": 64,
                            "intermediate_size": 96, "max_position_embeddings": 32768, "model_type": "mistral",
                            "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
                            "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 8,
                            "tie_word_embeddings": False, "eos_token_id": 258,
                            "vocab_size": 256 + len(MISTRAL_TOKENS)},
         MISTRAL_TOKENS, family_templates.MISTRAL, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
         tied=False, eps=1e-5, theta=10_000.0, windows=(8, 8)),
    Spec("gemma3_text", _gemma_text_config(), **_GEMMA, scalar=24.0),
    # the multimodal checkpoint's text decoder: settings under text_config (the rest transformers'
    # defaults), tensors under language_model.model., linear rope_scaling on the global layers only
    Spec("gemma3", {"architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
                    "eos_token_id": [257, 261], "model_type": "gemma3", "mm_tokens_per_image": 256,
                    "text_config": {"hidden_size": 64, "intermediate_size": 96, "model_type": "gemma3_text",
                                    "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1,
                                    "head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 8,
                                    "sliding_window_pattern": 3, "max_position_embeddings": 4096,
                                    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                                    "vocab_size": 256 + len(GEMMA_TOKENS)},
                    "torch_dtype": "bfloat16",
                    "vision_config": {"hidden_size": 16, "model_type": "siglip_vision_model"}},
         **_GEMMA, prefix="language_model.model.", frequency_scale=lambda f: f / 8.0),
    Spec("llama3", {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
                    "bos_token_id": 256, "eos_token_id": [257, 260, 261], "head_dim": 16, "hidden_act": "silu",
                    "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 96,
                    "max_position_embeddings": 4096, "mlp_bias": False, "model_type": "llama",
                    "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "pretraining_tp": 1,
                    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0,
                                                            "low_freq_factor": 1.0,
                                                            "original_max_position_embeddings": 64,
                                                            "rope_type": "llama3"},
                    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
                    "vocab_size": 256 + len(LLAMA_TOKENS)},
         LLAMA_TOKENS, family_templates.LLAMA31, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
         theta=500_000.0, frequency_scale=_llama3_frequencies, eps=1e-5),
)}


# ---- the checkpoint folder --------------------------------------------------------------------

def tokenizer_json(specials: tuple[str, ...]) -> str:
    """A byte-level BPE of the 256 byte tokens (ids 0-255) plus the family's added tokens."""
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(ALPHABET)}, merges=[], fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return tokenizer.to_str()


def tensors(spec: Spec, seed: int = 5) -> dict[str, np.ndarray]:
    """Random weights by their Hugging Face names, bf16-representable float32."""
    rng = np.random.default_rng(seed)

    def normal(*dims: int, scale: float) -> np.ndarray:
        return bf16_values((rng.standard_normal(dims) * scale).astype(np.float32))

    def norm(width: int) -> np.ndarray:    # stored w: Gemma's means 1 + w, the others' is the factor
        return normal(width, scale=0.1) + np.float32(1 - spec.norm_offset)

    p, q, kv = spec.prefix, spec.shape.heads * spec.shape.head_dim, spec.shape.kv_heads * spec.shape.head_dim
    w = {p + "embed_tokens.weight": normal(_vocab(spec), spec.shape.hidden, scale=0.3 if spec.embedding_scale else 0.5),
         p + "norm.weight": norm(spec.shape.hidden)}
    if not spec.tied:
        w["lm_head.weight"] = normal(_vocab(spec), spec.shape.hidden, scale=0.2)
    for i in range(spec.shape.layers):
        b = f"{p}layers.{i}."
        w |= {b + "input_layernorm.weight": norm(spec.shape.hidden),
              b + "self_attn.q_proj.weight": normal(q, spec.shape.hidden, scale=0.15),
              b + "self_attn.k_proj.weight": normal(kv, spec.shape.hidden, scale=0.15),
              b + "self_attn.v_proj.weight": normal(kv, spec.shape.hidden, scale=0.15),
              b + "self_attn.o_proj.weight": normal(spec.shape.hidden, q, scale=0.1),
              b + "post_attention_layernorm.weight": norm(spec.shape.hidden),
              b + "mlp.gate_proj.weight": normal(spec.shape.ffn, spec.shape.hidden, scale=0.15),
              b + "mlp.up_proj.weight": normal(spec.shape.ffn, spec.shape.hidden, scale=0.15),
              b + "mlp.down_proj.weight": normal(spec.shape.hidden, spec.shape.ffn, scale=0.1)}
        if spec.qk_norm:
            w |= {b + "self_attn.q_norm.weight": norm(spec.shape.head_dim),
                  b + "self_attn.k_norm.weight": norm(spec.shape.head_dim)}
        if spec.sandwich:
            w |= {b + "pre_feedforward_layernorm.weight": norm(spec.shape.hidden),
                  b + "post_feedforward_layernorm.weight": norm(spec.shape.hidden)}
    return w


def write_checkpoint(root: pathlib.Path, spec: Spec, config: dict[str, Any] | None = None) -> pathlib.Path:
    directory = root / spec.name
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config if config is not None else spec.config))
    save_safetensors(tensors(spec), directory / "model.safetensors", "bfloat16")
    (directory / "tokenizer.json").write_text(tokenizer_json(spec.specials))
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": spec.template} | spec.tokens))
    return directory


# ---- the oracle: a full-recompute forward pass from the architecture's description --------------

def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, offset: float) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (offset + weight)


def _rotate(x: np.ndarray, frequencies: np.ndarray) -> np.ndarray:
    """rotate_half RoPE of x [T, heads, d] at positions 0..T-1: dimension i pairs with i + d/2."""
    angle = np.arange(x.shape[0])[:, None] * frequencies[None, :]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    first, second = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def oracle_logits(spec: Spec, w: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """[T, vocab] logits of every position of `ids`."""
    p, T, d = spec.prefix, len(ids), spec.shape.head_dim
    norm = lambda x, name: _rms_norm(x, w[name], spec.eps, spec.norm_offset)  # noqa: E731
    base = 1.0 / spec.theta ** (np.arange(0, d, 2) / d)
    local = 1.0 / (spec.local_theta or spec.theta) ** (np.arange(0, d, 2) / d)
    scale = math.sqrt(spec.shape.hidden) if spec.embedding_scale else 1.0
    h = w[p + "embed_tokens.weight"][ids].astype(np.float64) * scale
    for i in range(spec.shape.layers):
        b = f"{p}layers.{i}."
        window = spec.windows[i] if spec.windows else 0
        x = norm(h, b + "input_layernorm.weight")
        q = (x @ w[b + "self_attn.q_proj.weight"].T).reshape(T, spec.shape.heads, d)
        k = (x @ w[b + "self_attn.k_proj.weight"].T).reshape(T, spec.shape.kv_heads, d)
        v = (x @ w[b + "self_attn.v_proj.weight"].T).reshape(T, spec.shape.kv_heads, d)
        if spec.qk_norm:
            q, k = norm(q, b + "self_attn.q_norm.weight"), norm(k, b + "self_attn.k_norm.weight")
        # sliding layers with a base of their own rotate unscaled; the others by the global scaling
        frequencies = local if window and spec.local_theta else spec.frequency_scale(base)
        q, k = _rotate(q, frequencies), _rotate(k, frequencies)
        group = spec.shape.heads // spec.shape.kv_heads
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(spec.scalar or d)
        query, key = np.arange(T)[:, None], np.arange(T)[None, :]
        hidden = (key > query) | ((key <= query - window) if window else False)
        scores = np.where(hidden[None], -np.inf, scores)
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        scores /= scores.sum(axis=-1, keepdims=True)
        attention = np.einsum("hqk,khd->qhd", scores, v).reshape(T, spec.shape.heads * d)
        out = attention @ w[b + "self_attn.o_proj.weight"].T
        if spec.sandwich:
            h = h + norm(out, b + "post_attention_layernorm.weight")
            x = norm(h, b + "pre_feedforward_layernorm.weight")
        else:
            h = h + out
            x = norm(h, b + "post_attention_layernorm.weight")
        gate = x @ w[b + "mlp.gate_proj.weight"].T
        gate = _gelu_tanh(gate) if spec.gelu else gate / (1 + np.exp(-gate))
        down = (gate * (x @ w[b + "mlp.up_proj.weight"].T)) @ w[b + "mlp.down_proj.weight"].T
        h = h + (norm(down, b + "post_feedforward_layernorm.weight") if spec.sandwich else down)
    head = w[p + "embed_tokens.weight"] if spec.tied else w["lm_head.weight"]
    return norm(h, p + "norm.weight") @ head.T


def oracle_greedy(spec: Spec, w: dict[str, np.ndarray], prompt: list[int], count: int) -> list[int]:
    ids, spelled = list(prompt), 256 + len(spec.specials)
    for _ in range(count):
        ids.append(int(np.argmax(oracle_logits(spec, w, ids)[-1][:spelled])))
    return ids[len(prompt):]


# ---- preparing and running the cores ------------------------------------------------------------

def _options(recipe):
    return recipe.RecipeOptions(context_tokens=256, decode_rows=(1, 2), prefill_variants=((1, 8), (1, 32)),
                                mixed_variants=((2, 9),), admission_rows=(1, 2), resume_rows=(1,),
                                scored_prefill_variants=((1, 8),), snapshot_rows=2, restoration_rows=(1,),
                                prepared_pages=48, top_logprobs=4)


@pytest.fixture(scope="module", params=sorted(SPECS))
def family(request, tmp_path_factory: pytest.TempPathFactory):
    spec = SPECS[request.param]
    directory = write_checkpoint(tmp_path_factory.mktemp("families"), spec)
    recipe = recipe_for(directory)
    return spec, directory, prepare(recipe, _options(recipe))


def _prompt(spec: Spec) -> list[int]:
    tokenizer = Tokenizer.from_str(tokenizer_json(spec.specials))
    return tokenizer.encode(TEXT, add_special_tokens=False).ids      # 47 ids: longer than every window


def _model(prepared, executor: str) -> NativeModel:
    return NativeModel.load(prepared.contract, prepared.manifest, resource_reader(prepared),
                            ModelOptions(cache_pages=32, concurrency=2, executor=executor))


# spec: OWN-4, OWN-5
def test_prefill_logits_match_the_oracle(family) -> None:
    spec, _, prepared = family
    prompt, spelled = _prompt(spec), 256 + len(spec.specials)
    expected = oracle_logits(spec, tensors(spec), prompt)
    model = _model(prepared, "numpy")
    try:
        got = prefill_logits(model, prompt, chunk=8, vocab=prepared.contract.model.vocabulary.sampled_tokens)
    finally:
        model.close()
    assert prepared.contract.model.vocabulary.sampled_tokens == _vocab(spec)
    assert np.abs(expected[:, :spelled]).max() > 1.0          # logits of real scale, not a degenerate model
    for position, logits in got.items():
        scale = np.abs(expected[position, :spelled]).max()
        assert np.abs(logits[:spelled] - expected[position, :spelled]).max() <= RELATIVE_TOLERANCE * scale, position
        assert np.all(np.isneginf(logits[spelled:]))          # a padded vocabulary's ids are masked


# spec: OWN-4, OWN-5
@pytest.mark.parametrize("executor", ["numpy", "cpu"])
def test_greedy_tokens_match_the_oracle(family, executor: str) -> None:
    spec, _, prepared = family
    prompt = _prompt(spec)[:20]
    model = _model(prepared, executor)
    try:
        [result] = LockstepGenerator(model).generate([GenerationRequest(prompt, 6, eos_ids=(-1,))])
    finally:
        model.close()
    assert result.tokens == oracle_greedy(spec, tensors(spec), prompt, 6)


# ---- the frontend: tool and reasoning syntax from the shared tables ------------------------------

EXPECTED_SYNTAX = {
    "qwen3": (C.TOOL_PARSER_JSON_CALL_TAGS, C.REASONING_PARSER_THINK_TAGS),
    "qwen3-untied": (C.TOOL_PARSER_JSON_CALL_TAGS, C.REASONING_PARSER_THINK_TAGS),
    "mistral": (C.TOOL_PARSER_JSON_CALL_LIST, C.REASONING_PARSER_NONE),
    "mistral-window": (C.TOOL_PARSER_JSON_CALL_LIST, C.REASONING_PARSER_NONE),
    "gemma3_text": (C.TOOL_PARSER_NONE, C.REASONING_PARSER_NONE),
    "gemma3": (C.TOOL_PARSER_NONE, C.REASONING_PARSER_NONE),
    "llama3": (C.TOOL_PARSER_JSON_PARAMETERS, C.REASONING_PARSER_NONE),
}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER}}]


def _core_syntax(prepared) -> tuple[ModelSyntax, ChatTemplate]:
    frontend = prepared.contract.model.frontend
    resources = resource_reader(prepared)
    atoms = atomic_tokens_from_tokenizer_json(resources(frontend.tokenizer_resource).decode())
    tokens = {k: getattr(frontend.template_tokens, k) for k in ("bos_token", "eos_token")}
    return (ModelSyntax.build(FrontendSyntax.from_contract(frontend), atoms),
            ChatTemplate(resources(frontend.chat_template_resource).decode(), tokens))


def _tokens(prepared, text: str) -> list[tuple[int, str]]:
    """`text` as the core's tokenizer encodes it: (id, text) per token, added tokens atomic."""
    frontend = prepared.contract.model.frontend
    tokenizer = Tokenizer.from_str(resource_reader(prepared)(frontend.tokenizer_resource).decode())
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    return [(i, tokenizer.decode([i], skip_special_tokens=False)) for i in ids]


def _parse(syntax: ModelSyntax, pieces: list[tuple[int, str]], start: ReasoningStart = ReasoningStart.CLOSED):
    engine = syntax.engine(InitialState(start), {"get_weather": WEATHER})
    events = [event for token, text in pieces for event in engine.feed(token, text)]
    return collect(events + engine.finish())


# spec: FE-1, FE-8, FE-9
def test_the_core_declares_the_family_syntax(family) -> None:
    spec, _, prepared = family
    frontend = prepared.contract.model.frontend
    assert (frontend.tool_parser, frontend.reasoning_parser) == EXPECTED_SYNTAX[spec.name]
    if frontend.reasoning_parser == C.REASONING_PARSER_THINK_TAGS:     # FE-8: the tool opener also ends reasoning
        assert frontend.reasoning_syntax.terminal_marker == frontend.tool_syntax.block_open == "<tool_call>"
    if frontend.tool_parser == C.TOOL_PARSER_JSON_CALL_LIST:         # FE-9: the marker is the added token
        syntax, _ = _core_syntax(prepared)
        assert syntax.markup.is_atomic("[TOOL_CALLS]")


ARGUMENTS = {"city": "Paris {centre}", "days": 3}


# spec: FE-3, FE-43
@pytest.mark.parametrize("name", ["qwen3", "llama3"])
def test_the_family_template_renders_calls_the_declared_syntax_parses_back(tmp_path: pathlib.Path, name: str) -> None:
    spec = SPECS[name]
    recipe = recipe_for(write_checkpoint(tmp_path, spec))
    prepared = prepare(recipe, _options(recipe))
    syntax, template = _core_syntax(prepared)
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "", "reasoning_content": "The user wants a forecast.",
                "tool_calls": [{"id": "c0", "type": "function",
                                "function": {"name": "get_weather", "arguments": ARGUMENTS}}]},
               {"role": "tool", "tool_call_id": "c0", "content": "sunny"}]
    text = template.render(history, tools=TOOLS, add_generation_prompt=True)
    assert '"name": "get_weather"' in text and "sunny" in text
    opener = {"qwen3": "<|im_start|>assistant\n", "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n"}[name]
    close = {"qwen3": "<|im_end|>", "llama3": "<|eot_id|>"}[name]
    assistant = text.split("Weather in Paris?", 1)[1].split(opener, 1)[1].split(close, 1)[0]
    start = ReasoningStart.MAY_OPEN if name == "qwen3" else ReasoningStart.CLOSED
    pieces = _tokens(prepared, assistant)
    if name == "qwen3":
        assert (256 + spec.specials.index("<think>"), "<think>") in pieces    # generated as its token
    out = _parse(syntax, pieces, start)
    assert out.errors == [] and [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("get_weather", ARGUMENTS)]
    if name == "qwen3":
        assert out.reasoning == "The user wants a forecast."


# spec: FE-3, FE-9
def test_a_mistral_call_parses_from_its_marker_token(family) -> None:
    spec, _, prepared = family
    if EXPECTED_SYNTAX[spec.name][0] != C.TOOL_PARSER_JSON_CALL_LIST:
        pytest.skip("not a [TOOL_CALLS] family")
    syntax, template = _core_syntax(prepared)
    text = template.render([{"role": "user", "content": "Weather?"}], tools=TOOLS)
    assert text.startswith("<s>[AVAILABLE_TOOLS][") and text.endswith("[/AVAILABLE_TOOLS][INST]Weather?[/INST]")
    marker = 256 + spec.specials.index("[TOOL_CALLS]")
    call = '[{"name": "get_weather", "arguments": ' + json.dumps(ARGUMENTS) + "}]"
    out = _parse(syntax, [(marker, "[TOOL_CALLS]"), (7, call)])
    assert out.errors == [] and [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("get_weather", ARGUMENTS)]
    parallel = '[{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "get_weather", "arguments": ' + \
        json.dumps(ARGUMENTS) + "}]"                            # parallel calls share one list
    out = _parse(syntax, [(marker, "[TOOL_CALLS]"), (7, parallel)])
    assert out.errors == [] and [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("get_weather", {"city": "Rome"}), ("get_weather", ARGUMENTS)]
    plain = _parse(syntax, [(7, "[TOOL_CALLS]" + call)])      # the marker's spelling as text is text
    assert plain.tool_calls == [] and plain.content.startswith("[TOOL_CALLS]")


# ---- errors name the field -----------------------------------------------------------------------

@pytest.mark.parametrize("change, message", [
    ({"model_type": "falcon"}, "model_type 'falcon' is not supported; supported: .*'qwen3'"),
    ({"hidden_size": None}, "missing 'hidden_size'"),
    ({"num_hidden_layers": 2.5}, "num_hidden_layers 2.5 must be a whole number"),
    ({"use_sliding_window": True}, "use_sliding_window True is not supported for model_type 'qwen3'"),
    ({"attention_bias": True}, "attention_bias True is not supported"),
    ({"hidden_act": "relu"}, "hidden_act 'relu' is not supported"),
])
def test_an_unsupported_config_is_a_preparation_error_naming_the_field(tmp_path: pathlib.Path, change, message) -> None:
    spec = SPECS["qwen3"]
    config = {k: v for k, v in (spec.config | change).items() if v is not None}
    directory = write_checkpoint(tmp_path, spec, config)
    with pytest.raises(CheckpointError, match=message):
        HFCheckpoint.open(directory)


@pytest.mark.parametrize("change, message", [
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping 30.0 is not supported for model_type 'gemma3_text'"),
    ({"layer_types": ["full_attention", "sliding_attention", "full_attention"]},
     r"layer_types: the full-attention layers must recur every N layers .*not \[0, 2\]"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types must name"),
    ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar 0 must be a number > 0"),
])
def test_gemma_settings_the_decoder_cannot_express_are_refused(tmp_path: pathlib.Path, change, message) -> None:
    directory = write_checkpoint(tmp_path, SPECS["gemma3_text"], _gemma_text_config(**change))
    with pytest.raises(CheckpointError, match=message):
        HFCheckpoint.open(directory)


def test_a_multimodal_config_without_text_config_names_it(tmp_path: pathlib.Path) -> None:
    config = {k: v for k, v in SPECS["gemma3"].config.items() if k != "text_config"}
    with pytest.raises(CheckpointError, match="missing 'text_config'"):
        HFCheckpoint.open(write_checkpoint(tmp_path, SPECS["gemma3"], config))


def test_the_cli_exits_non_zero_naming_the_model_type(tmp_path: pathlib.Path, capsys) -> None:
    from ignition.cli import prepare_main

    directory = write_checkpoint(tmp_path, SPECS["mistral"], SPECS["mistral"].config | {"model_type": "mamba"})
    out = tmp_path / "x.core"
    assert prepare_main([str(directory), "--out", str(out), "--no-kernels", "--key", str(tmp_path / "k.pem")]) == 2
    assert "model_type 'mamba' is not supported" in capsys.readouterr().err and not out.exists()


# spec: FE-9, FE-40
@pytest.mark.parametrize("name", ["mistral", "llama3"])
@pytest.mark.parametrize("choice", ["required", "auto"])
def test_request_grammars_of_the_new_syntaxes_accept_the_family_call(tmp_path: pathlib.Path, name: str,
                                                                      choice: str) -> None:
    """The grammar built from the core's syntax data accepts the call as the family writes it
    (the marker as its token); under required another syntax's call is refused."""
    from helios_backend.frontend.grammar_runtime import GrammarSession, GrammarTokenizer
    from helios_backend.syntax.grammar import ConstraintRequest, ToolChoiceMode, ToolSpec, build_request_grammar

    spec = SPECS[name]
    recipe = recipe_for(write_checkpoint(tmp_path, spec))
    prepared = prepare(recipe, _options(recipe))
    syntax, _ = _core_syntax(prepared)
    eos = list(prepared.contract.defaults.eos_token_ids)
    tokenizer = GrammarTokenizer.from_json(
        resource_reader(prepared)(prepared.contract.model.frontend.tokenizer_resource).decode(), eos)
    request = ConstraintRequest(tools=(ToolSpec("get_weather", WEATHER),), tool_choice=ToolChoiceMode(choice))
    grammar = build_request_grammar(syntax, InitialState(ReasoningStart.CLOSED), request)
    assert grammar is not None
    call = {"mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]',
            "llama3": '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'}[name]
    calls = [call]
    if name == "mistral":     # parallel calls: later objects of the same list
        calls.append(call[:-1] + ', {"name": "get_weather", "arguments": {"city": "Rome"}}]')
    for text in calls:
        session = GrammarSession.create(tokenizer, grammar.grammar)
        assert all(session.consume(i) for i, _ in _tokens(prepared, text)) and session.is_accepting()
    other = _tokens(prepared, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    session = GrammarSession.create(tokenizer, grammar.grammar)
    if choice == "required":      # another syntax's call is refused from its first token
        assert not session.consume(other[0][0])
    else:                         # auto: an answer in words is content
        answer = _tokens(prepared, "It is sunny in Paris.")
        assert all(session.consume(i) for i, _ in answer) and session.is_accepting()
        assert _parse(syntax, answer).content == "It is sunny in Paris."


# ---- served: helios-serve --model DIR through the real gateway and the openai SDK ----------------

@pytest.mark.triton
@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3", "mistral"])
def test_a_served_family_folder_answers_a_required_tool_call(tmp_path: pathlib.Path, name: str) -> None:
    """The family's syntax reaches the gateway: a required call comes back as `tool_calls`."""
    import openai

    from tests.serve_process import ServeProcess

    folder = write_checkpoint(tmp_path, SPECS[name], SPECS[name].config | {"max_position_embeddings": 4096})
    env = {"HELIOS_HOME": str(tmp_path / "home"), "HELIOS_CORE_CACHE": str(tmp_path / "cores")}
    city = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": city}}]
    with ServeProcess(folder, tmp_path, "--executor", "numpy", "--max-active", "2", env=env,
                      source="--model") as serve:
        serve.wait_gateway_healthy(600)
        client = openai.OpenAI(base_url=serve.gateway_url + "/v1", api_key="unused", max_retries=0)
        extra = {"chat_template_kwargs": {"enable_thinking": False}} if name == "qwen3" else {}
        answer = client.chat.completions.create(
            model=folder.name, max_tokens=64, temperature=0, tools=tools, tool_choice="required",
            messages=[{"role": "user", "content": "Weather in Paris?"}], extra_body=extra)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    [call] = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
