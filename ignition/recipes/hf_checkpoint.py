"""Recipe builder: a user's local Hugging Face checkpoint directory (llama or qwen2 family).

    helios-prepare ./path/to/checkpoint --out my-model.core

`recipe_for(directory)` returns a recipe module like the named ones: the shared Llama-family
decoder (llama_decoder.py) over `HFCheckpoint`, with the metadata a named recipe declares by
hand taken from the checkpoint's own files:

  * served id: the directory name; no aliases;
  * EOS ids and sampling defaults: generation_config.json (else config.json's eos_token_id and
    neutral sampling: temperature 1, no top-p/top-k cut);
  * tokenizer: tokenizer.json verbatim; chat template and bos/eos/pad spellings:
    tokenizer_config.json;
  * RoPE: half-split pairs (Hugging Face stores q/k in rotate-half order for both families);
  * tool syntax: JSON-call blocks when the template writes `<tool_call>` (the convention of the
    families' tool-calling templates), else none (tool_choice required/named then answer 400).

Same core format, same runtime: nothing downstream knows which source a core came from.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from helios_proto import contract_pb2 as C

from helios_backend.kernel_abi.rope import ROPE_HALF_PAIRS
from ignition.recipes import llama_decoder
from ignition.recipes.chatml_tool_template import chatml_frontend
from ignition.sources.hf_checkpoint import HFCheckpoint

NAMESPACE = "helios.local/checkpoints"


@dataclass(frozen=True)
class RecipeOptions(llama_decoder.DecoderOptions):
    rope_pairing: int = ROPE_HALF_PAIRS


def _frontend(checkpoint: HFCheckpoint) -> C.FrontendContract:
    tokens = C.TemplateTokens(bos_token=checkpoint.special_token("bos_token"),
                              eos_token=checkpoint.special_token("eos_token"),
                              pad_token=checkpoint.special_token("pad_token"),
                              unk_token=checkpoint.special_token("unk_token"))
    writes_calls = "<tool_call>" in (checkpoint.chat_template or "")
    return chatml_frontend(C.TOOL_PARSER_JSON_CALL_TAGS if writes_calls else C.TOOL_PARSER_NONE, tokens)


def _sampling(checkpoint: HFCheckpoint) -> C.SamplingDefaults:
    g = checkpoint.generation_config()
    return C.SamplingDefaults(temperature=1.0 if g.temperature is None else float(g.temperature),
                              top_p=1.0 if g.top_p is None else float(g.top_p), top_k=int(g.top_k or 0), min_p=0.0,
                              presence_penalty=0.0, frequency_penalty=0.0,
                              repetition_penalty=1.0 if g.repetition_penalty is None else float(g.repetition_penalty))


def decoder_recipe(package: str, name: str, doc: str) -> ModuleType:
    """A recipe module `package`.`name` holding the shared Llama-family decoder's functions; the
    caller adds its source, frontend and metadata."""
    module = ModuleType(f"{package}.{name.replace('-', '_').replace('.', '_')}")
    module.__dict__.update({k: getattr(llama_decoder, k) for k in (
        "WeightTensor", "SCRATCH", "weight_tensors", "weight_tensor_count", "declare_scratch", "forward", "paged_kv",
        "rank_shape", "tensor_parallel_dimensions")})
    module.__doc__ = doc
    return module


def recipe_for(directory: str | Path) -> ModuleType:
    """A recipe module for `ignition.preparation.prepare` reading `directory`."""
    path = Path(directory).resolve()
    checkpoint = HFCheckpoint.open(path)     # read once here: errors name the file before any work
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", path.name).strip("-") or "checkpoint"
    module = decoder_recipe(__name__, name, f"The {checkpoint.family} checkpoint at {path}.")
    module.__dict__.update(
        NAME=name, SERVED_ID=name, ALIASES=(), PUBLISHER_NAMESPACE=NAMESPACE, RecipeOptions=RecipeOptions,
        EOS_TOKEN_IDS=checkpoint.generation_config().eos_token_ids, SAMPLING_DEFAULTS=_sampling(checkpoint),
        open_source=lambda options: HFCheckpoint.open(path), frontend=lambda: _frontend(checkpoint),
        TEMPLATE_TOKENS=_frontend(checkpoint).template_tokens,
        chat_template=lambda source: source.chat_template or "")
    return module
