"""Recipe builder: a model layout from a Hugging Face config.json alone (the hf_families.py families).

    helios-prepare bench/layouts/qwen2.5-1.5b.json --out qwen-1.5b-layout.core

`recipe_for_layout(path)` returns a recipe module like `hf_checkpoint.recipe_for` does, over
`HFLayout` (ignition/sources/hf_layout.py): the shared Llama-family decoder at the config's shape,
seeded random weights (`RecipeOptions.weights_seed`; None leaves the weight bytes to the loader,
as the device bundles do for layouts too large to carry), a byte-level tokenizer with the ChatML
control tokens, a ChatML template and no tool syntax. Served id: the file's stem (or its folder's
name for a `config.json`). For speed and conformance runs: the outputs of random weights mean
nothing, the programs are the checkpoint's.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from helios_proto import contract_pb2 as C

from helios_backend.kernel_abi.rope import ROPE_HALF_PAIRS
from ignition.recipes import llama_decoder
from ignition.recipes.chatml_tool_template import chatml_frontend, chatml_tool_template
from ignition.recipes.hf_checkpoint import decoder_recipe, options_for
from ignition.sources.hf_layout import CONTROL_TOKENS, HFLayout

NAMESPACE = "helios.local/layouts"
NEUTRAL_SAMPLING = C.SamplingDefaults(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, presence_penalty=0.0,
                                      frequency_penalty=0.0, repetition_penalty=1.0)
TEMPLATE_TOKENS = C.TemplateTokens(bos_token="", eos_token="<|im_end|>", pad_token=CONTROL_TOKENS[0], unk_token="")


@dataclass(frozen=True)
class RecipeOptions(llama_decoder.DecoderOptions):
    rope_pairing: int = ROPE_HALF_PAIRS
    weights_seed: int | None = 0     # None: no weight bytes in the prepared core (the loader makes them)


def layout_name(path: Path) -> str:
    stem = path.parent.name if path.name == "config.json" else path.stem
    return re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip("-") or "layout"


def recipe_for_layout(config: str | Path) -> ModuleType:
    """A recipe module for `ignition.preparation.prepare` at the layout of `config` (a config.json)."""
    path = Path(config).resolve()
    layout = HFLayout.open(path)          # read once here: errors name the file before any work
    name = layout_name(path)
    module = decoder_recipe(__name__, name, f"The {layout.family.model_type} layout of {path} (random weights).")
    options = options_for(layout.options, RecipeOptions)
    module.__dict__.update(
        NAME=name, SERVED_ID=name, ALIASES=(), PUBLISHER_NAMESPACE=NAMESPACE, RecipeOptions=options,
        EOS_TOKEN_IDS=layout.eos_token_ids(), SAMPLING_DEFAULTS=NEUTRAL_SAMPLING, TEMPLATE_TOKENS=TEMPLATE_TOKENS,
        open_source=lambda options: HFLayout.open(path, seed=options.weights_seed),
        frontend=lambda: chatml_frontend(C.TOOL_PARSER_NONE, TEMPLATE_TOKENS),
        chat_template=lambda source: chatml_tool_template("You are a helpful assistant."))
    return module
