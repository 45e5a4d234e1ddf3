"""Recipe builder: a user's local Hugging Face checkpoint directory (llama or qwen2 family).

    helios-prepare ./path/to/checkpoint --out my-model.core

`recipe_for(directory)` returns a recipe module like the named ones: the shared Llama-family
decoder (llama_decoder.py) over `HFCheckpoint`, with the metadata a named recipe declares by
hand taken from the checkpoint's own files:

  * served id: `served_name` (helios-prepare --served-model-name), else `served_name_for`: the
    repository id of a Hugging Face cache folder (`models--Org--Name/snapshots/<sha>` serves as
    `Org/Name`), else config.json's `_name_or_path` when it is a repository id, else the folder
    name; no aliases;
  * EOS ids and sampling defaults: generation_config.json (else config.json's eos_token_id and
    neutral sampling: temperature 1, no top-p/top-k/min-p cut, no repetition penalty);
  * tokenizer: tokenizer.json verbatim; chat template: `chat_template` (helios-prepare
    --chat-template FILE), else tokenizer_config.json's `chat_template` (or chat_template.jinja);
    none at all is a preparation error (a core without one answers every chat request 400);
    bos/eos/pad spellings: tokenizer_config.json;
  * context: config.json's max_position_embeddings, at most CONTEXT_CEILING tokens (the
    per-request page table, rope table and staging frame grow with it; --context-tokens
    chooses another);
  * RoPE: half-split pairs (Hugging Face stores q/k in rotate-half order for both families),
    with config.json's rope_scaling (ignition/sources/rope_scaling.py);
  * vocabulary: config.json's vocab_size; ids past tokenizer.json's are never sampled
    (ignition/preparation/vocabulary.py);
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
from ignition.sources.hf_checkpoint import CheckpointError, HFCheckpoint

NAMESPACE = "helios.local/checkpoints"


# the default context of a checkpoint that declares a longer one (Llama 3.1: 131,072): 32,768
# tokens keep the per-request page table at 2,048 entries and a 128-wide head's rope table at 16 MiB
CONTEXT_CEILING = 32768


@dataclass(frozen=True)
class RecipeOptions(llama_decoder.DecoderOptions):
    rope_pairing: int = ROPE_HALF_PAIRS


def _options_for(context: int) -> type[RecipeOptions]:
    @dataclass(frozen=True)
    class CheckpointOptions(RecipeOptions):
        context_tokens: int = context
    return CheckpointOptions


def _frontend(checkpoint: HFCheckpoint, template: str) -> C.FrontendContract:
    tokens = C.TemplateTokens(bos_token=checkpoint.special_token("bos_token"),
                              eos_token=checkpoint.special_token("eos_token"),
                              pad_token=checkpoint.special_token("pad_token"),
                              unk_token=checkpoint.special_token("unk_token"))
    writes_calls = "<tool_call>" in template
    return chatml_frontend(C.TOOL_PARSER_JSON_CALL_TAGS if writes_calls else C.TOOL_PARSER_NONE, tokens)


def _sampling(checkpoint: HFCheckpoint) -> C.SamplingDefaults:
    g = checkpoint.generation_config()
    return C.SamplingDefaults(temperature=1.0 if g.temperature is None else g.temperature,
                              top_p=1.0 if g.top_p is None else g.top_p, top_k=g.top_k or 0,
                              min_p=g.min_p or 0.0, presence_penalty=0.0, frequency_penalty=0.0,
                              repetition_penalty=1.0 if g.repetition_penalty is None else g.repetition_penalty)


def decoder_recipe(package: str, name: str, doc: str) -> ModuleType:
    """A recipe module `package`.`name` holding the shared Llama-family decoder's functions; the
    caller adds its source, frontend and metadata."""
    module = ModuleType(f"{package}.{name.replace('-', '_').replace('.', '_')}")
    module.__dict__.update({k: getattr(llama_decoder, k) for k in (
        "WeightTensor", "SCRATCH", "weight_tensors", "weight_tensor_count", "declare_scratch", "forward", "paged_kv",
        "rank_shape", "tensor_parallel_dimensions")})
    module.__doc__ = doc
    return module


_REPOSITORY_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")


def served_name_for(path: Path, config: dict) -> str:
    """The id a checkpoint folder is served as when no --served-model-name is given."""
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name.removeprefix("models--").replace("--", "/")
    declared = str(config.get("_name_or_path") or "")
    if _REPOSITORY_ID.fullmatch(declared) and not Path(declared).is_absolute():
        return declared
    return path.name


def _chat_template(checkpoint: HFCheckpoint, template_file: Path | None) -> str:
    if template_file is not None:
        try:
            return template_file.read_text()
        except OSError as exc:
            raise CheckpointError(f"--chat-template {template_file}: {exc.strerror or exc}") from exc
    if not checkpoint.chat_template:
        raise CheckpointError(f"{checkpoint.path / 'tokenizer_config.json'}: no chat_template (nor "
                              "chat_template.jinja beside it); give one with --chat-template FILE")
    return checkpoint.chat_template


def recipe_for(directory: str | Path, served_name: str | None = None,
               chat_template: str | Path | None = None) -> ModuleType:
    """A recipe module for `ignition.preparation.prepare` reading `directory`; `served_name`
    and `chat_template` (a template file) replace what the folder declares."""
    path = Path(directory).resolve()
    checkpoint = HFCheckpoint.open(path)     # read once here: errors name the file before any work
    template = _chat_template(checkpoint, None if chat_template is None else Path(chat_template))
    served = served_name or served_name_for(path, checkpoint.config)
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", served).strip("-") or "checkpoint"
    module = decoder_recipe(__name__, name, f"The {checkpoint.family} checkpoint at {path}.")
    frontend = _frontend(checkpoint, template)
    module.__dict__.update(
        NAME=name, SERVED_ID=served, ALIASES=(), PUBLISHER_NAMESPACE=NAMESPACE,
        RecipeOptions=_options_for(min(checkpoint.shape.context_length, CONTEXT_CEILING)),
        EOS_TOKEN_IDS=checkpoint.generation_config().eos_token_ids, SAMPLING_DEFAULTS=_sampling(checkpoint),
        open_source=lambda options: HFCheckpoint.open(path), frontend=lambda: _frontend(checkpoint, template),
        TEMPLATE_TOKENS=frontend.template_tokens, chat_template=lambda source: template)
    return module
