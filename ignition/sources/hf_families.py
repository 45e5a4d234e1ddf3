"""The Hugging Face checkpoint families, as data: how each `model_type` maps onto the shared decoder.

One `Family` row per `config.json` `model_type`; shared code (hf_checkpoint.py, the checkpoint
recipe) reads the row, never the name. A row says:

  * where the tensors live and what they are called (`prefixes` of the text decoder, `blocks`:
    the Hugging Face name of each per-layer tensor the decoder reads by its GGUF name);
  * `text_config`: the decoder's settings are config.json's `text_config` (a multimodal
    checkpoint whose text decoder is served alone), and `defaults`: the values transformers
    assumes for keys a config.json leaves out (Gemma 3's text_config omits most of them);
  * the architecture's features, each an existing mechanism of the shared decoder
    (ignition/recipes/llama_decoder.py): q/k norm, post norms, norm weights stored as w meaning
    (1 + w) (`norm_offset`), the activation key, sliding-window layers and their own RoPE base,
    embeddings times sqrt(hidden), the attention scalar;
  * `refused`: keys that must be absent, null or false because the decoder has no mechanism for
    what they turn on (preparation fails naming the key rather than serve other numbers);
  * the tool and reasoning syntaxes its chat templates write (helios_backend/syntax/tables.py),
    each declared when the folder's template writes the syntax's opener, and the prompt envelopes.

Adding a family is adding a row when its features are mechanisms the decoder has.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from helios_proto import contract_pb2 as C

from helios_backend.kernel_abi.linear import ACTIVATION_GELU_TANH, ACTIVATION_SILU
from helios_backend.syntax.tables import chatml_prefix_rules

# the Llama block tensors (GGUF name under "blk.N." -> Hugging Face name under "layers.N.")
LLAMA_BLOCKS: Mapping[str, str] = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias", "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight"}
QK_NORM_BLOCKS: Mapping[str, str] = {"attn_q_norm.weight": "self_attn.q_norm.weight",
                                     "attn_k_norm.weight": "self_attn.k_norm.weight"}
# Gemma's four norms per block: the FFN's input norm is pre_feedforward_layernorm, and
# post_attention_layernorm norms the attention output (not the FFN input, as in Llama)
SANDWICH_BLOCKS: Mapping[str, str] = {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
# the other tensors, by their name under the text decoder's prefix ("lm_head.weight" has none)
GLOBALS: Mapping[str, str] = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight"}
HEAD = "lm_head.weight"

ACTIVATIONS: Mapping[str, int] = {"silu": ACTIVATION_SILU, "gelu_pytorch_tanh": ACTIVATION_GELU_TANH}


def header_prefix_rules() -> list[C.PrefixBoundaryRule]:
    """Llama 3 envelopes: <|start_header_id|>ROLE<|end_header_id|>\\n\\n ... <|eot_id|>."""
    return [C.PrefixBoundaryRule(role=role, open=f"<|start_header_id|>{role}<|end_header_id|>\n\n", close="<|eot_id|>")
            for role in ("system", "user", "assistant", "ipython")]


def instruction_prefix_rules() -> list[C.PrefixBoundaryRule]:
    """Mistral envelopes: a user turn is [INST] ... [/INST]; the answer follows unwrapped."""
    return [C.PrefixBoundaryRule(role="user", open="[INST]", close="[/INST]")]


def turn_prefix_rules() -> list[C.PrefixBoundaryRule]:
    """Gemma envelopes: <start_of_turn>ROLE\\n ... <end_of_turn>, the assistant speaking as model."""
    return [C.PrefixBoundaryRule(role=role, open=f"<start_of_turn>{role}\n", close="<end_of_turn>")
            for role in ("user", "model")]


@dataclass(frozen=True)
class Family:
    model_type: str
    blocks: Mapping[str, str] = field(default_factory=lambda: LLAMA_BLOCKS)
    prefixes: tuple[str, ...] = ("model.",)     # where the text decoder's tensors live, first match
    text_config: bool = False
    defaults: Mapping[str, Any] = field(default_factory=dict)
    qkv_bias: bool = False          # q/k/v projections carry biases (and the output projection none)
    qk_norm: bool = False
    post_norms: bool = False
    norm_offset: float = 0.0        # every stored norm weight w means (norm_offset + w)
    activation_key: str = "hidden_act"
    sliding_window: bool = False    # config.json's sliding_window (null: none) windows the sliding layers
    local_rope_theta_key: str = ""  # the sliding layers' RoPE base ("": the global one)
    embedding_scale: bool = False
    attention_scalar_key: str = ""  # queries scaled by its value ** -0.5 ("": head_dim ** -0.5)
    refused: tuple[str, ...] = ()
    # tool syntaxes its templates write, in preference order: the first whose opener the
    # folder's template writes is declared (a Llama fine-tune with a ChatML template writes
    # <tool_call>, Llama 3.x's own template a bare {"name": ...} object); none written: none
    tool_parsers: tuple[C.ToolParser.ValueType, ...] = ()
    reasoning_parser: C.ReasoningParser.ValueType = C.REASONING_PARSER_NONE
    prefix_rules: Callable[[], list[C.PrefixBoundaryRule]] = chatml_prefix_rules


def _gemma3(model_type: str, text_config: bool, prefixes: tuple[str, ...]) -> Family:
    # Gemma3TextConfig's defaults (transformers): the 4B/12B/27B configs leave most keys out
    defaults = {"vocab_size": 262_208, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
                "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "query_pre_attn_scalar": 256,
                "sliding_window": 4096, "sliding_window_pattern": 6, "tie_word_embeddings": True}
    return Family(model_type, blocks={**LLAMA_BLOCKS, **QK_NORM_BLOCKS, **SANDWICH_BLOCKS}, prefixes=prefixes,
                  text_config=text_config, defaults=defaults, qk_norm=True, post_norms=True,
                  norm_offset=1.0, activation_key="hidden_activation", sliding_window=True,
                  local_rope_theta_key="rope_local_base_freq", embedding_scale=True,
                  attention_scalar_key="query_pre_attn_scalar",
                  refused=("attention_bias", "attn_logit_softcapping", "final_logit_softcapping",
                           "use_bidirectional_attention"),
                  prefix_rules=turn_prefix_rules)


FAMILIES: Mapping[str, Family] = {f.model_type: f for f in (
    # attention_bias (transformers) also puts a bias on the output projection, which the decoder has not
    Family("llama", refused=("attention_bias", "mlp_bias"),
           tool_parsers=(C.TOOL_PARSER_JSON_CALL_TAGS, C.TOOL_PARSER_JSON_PARAMETERS),
           prefix_rules=header_prefix_rules),
    Family("qwen2", qkv_bias=True, refused=("use_sliding_window",), tool_parsers=(C.TOOL_PARSER_JSON_CALL_TAGS,)),
    Family("qwen3", blocks={**LLAMA_BLOCKS, **QK_NORM_BLOCKS}, defaults={"head_dim": 128}, qk_norm=True,
           refused=("use_sliding_window", "attention_bias"), tool_parsers=(C.TOOL_PARSER_JSON_CALL_TAGS,),
           reasoning_parser=C.REASONING_PARSER_THINK_TAGS),
    Family("mistral", sliding_window=True, tool_parsers=(C.TOOL_PARSER_JSON_CALL_LIST,),
           prefix_rules=instruction_prefix_rules),
    _gemma3("gemma3_text", False, ("model.",)),
    # the multimodal checkpoint: its text decoder only (transformers < 4.52 / >= 4.52 tensor names)
    _gemma3("gemma3", True, ("language_model.model.", "model.language_model.")),
)}
