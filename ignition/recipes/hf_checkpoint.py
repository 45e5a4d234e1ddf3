"""Recipe builder: a user's local Hugging Face checkpoint directory (the families of hf_families.py).

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
  * RoPE: half-split pairs (Hugging Face stores q/k in rotate-half order for every family),
    with config.json's rope_scaling (ignition/sources/rope_scaling.py);
  * the family's features (q/k norm, post norms, sliding layers and their RoPE base, the
    activation, the embedding scale, the attention scalar): the decoder options its row sets
    (ignition/sources/hf_families.py, `HFCheckpoint.options`), as the defaults of RecipeOptions;
  * vocabulary: config.json's vocab_size; ids past tokenizer.json's are never sampled
    (ignition/preparation/vocabulary.py);
  * tool and reasoning syntax: the family's (its row), each declared when the template writes
    its opener (`<tool_call>`, `[TOOL_CALLS]`, `{"name": "`, `<think>`), else none (a base
    model's template: tool_choice required/named then answer 400); prompt envelopes: the row's.

Same core format, same runtime: nothing downstream knows which source a core came from.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, make_dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from helios_proto import contract_pb2 as C

from helios_backend.kernel_abi.rope import ROPE_HALF_PAIRS
from ignition.recipes import llama_decoder
from helios_backend.syntax.tables import preset
from helios_backend.syntax.validate import validate_frontend
from ignition.sources.hf_checkpoint import CheckpointError, HFCheckpoint
from ignition.sources.hf_families import Family

NAMESPACE = "helios.local/checkpoints"


# the default context of a checkpoint that declares a longer one (Llama 3.1: 131,072): 32,768
# tokens keep the per-request page table at 2,048 entries and a 128-wide head's rope table at 16 MiB
CONTEXT_CEILING = 32768


@dataclass(frozen=True)
class RecipeOptions(llama_decoder.DecoderOptions):
    rope_pairing: int = ROPE_HALF_PAIRS


def options_for(defaults: dict[str, Any], base: type = RecipeOptions) -> type:
    """`base` (a DecoderOptions dataclass) whose defaults are `defaults` (the checkpoint's context
    and the decoder options its family sets)."""
    fields = [(name, type(value), field(default=value)) for name, value in defaults.items()]
    return make_dataclass("CheckpointOptions", fields, bases=(base,), frozen=True)


def family_frontend(family: Family, template: str, tokens: C.TemplateTokens) -> C.FrontendContract:
    """The family's tool and reasoning syntaxes, each where `template` writes its opener."""
    tool = next((parser for parser in family.tool_parsers
                 if preset(parser, C.REASONING_PARSER_NONE).tool.block_open in template), C.TOOL_PARSER_NONE)
    opener = preset(C.TOOL_PARSER_NONE, family.reasoning_parser).reasoning.open
    reasoning = family.reasoning_parser if opener and opener in template else C.REASONING_PARSER_NONE
    contract = C.FrontendContract(image_preparation=C.IMAGE_PREPARATION_NONE, image_layout=C.IMAGE_LAYOUT_NONE,
                                  template_tokens=tokens)
    syntax = preset(tool, reasoning, prefix_rules=family.prefix_rules())
    validate_frontend(syntax)
    syntax.apply_to(contract)
    return contract


def _frontend(checkpoint: HFCheckpoint, template: str) -> C.FrontendContract:
    tokens = C.TemplateTokens(bos_token=checkpoint.special_token("bos_token"),
                              eos_token=checkpoint.special_token("eos_token"),
                              pad_token=checkpoint.special_token("pad_token"),
                              unk_token=checkpoint.special_token("unk_token"))
    return family_frontend(checkpoint.family, template, tokens)


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
    module = decoder_recipe(__name__, name, f"The {checkpoint.family.model_type} checkpoint at {path}.")
    frontend = _frontend(checkpoint, template)
    module.__dict__.update(
        NAME=name, SERVED_ID=served, ALIASES=(), PUBLISHER_NAMESPACE=NAMESPACE,
        RecipeOptions=options_for({"context_tokens": min(checkpoint.shape.context_length, CONTEXT_CEILING),
                                   **checkpoint.options}),
        EOS_TOKEN_IDS=checkpoint.generation_config().eos_token_ids, SAMPLING_DEFAULTS=_sampling(checkpoint),
        open_source=lambda options: HFCheckpoint.open(path), frontend=lambda: _frontend(checkpoint, template),
        TEMPLATE_TOKENS=frontend.template_tokens, chat_template=lambda source: template)
    return module
