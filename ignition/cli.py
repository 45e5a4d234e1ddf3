"""helios-prepare: turn a recipe into a signed payload core.

    helios-prepare smollm2-135m-instruct --out var/cores/smollm2-135m-instruct.core
    helios-prepare smollm2-135m-instruct --tensor-parallel 2 --out var/cores/smollm2-tp2.core
    helios-prepare smollm2-135m-instruct --arch sm_90a --arch compute_80 --out h100-and-ptx.core

A local Ed25519 publisher key is created on first use (helios_backend.core.keys). The
AOT kernel library (ignition.gpu_kernels) contributes kernel modules for the kernel ids it
implements, one per kernel set and architecture: by default cubins for sm_80, sm_86, sm_89,
sm_90a and sm_100a plus compute_80 PTX (the portable fallback), less what the installed
Triton cannot target; `--arch` (repeatable) names the architectures instead. A Hugging Face
`config.json` alone (e.g. bench/layouts/qwen2.5-1.5b.json) prepares that layout with seeded
random weights. Preparation
needs no GPU and works without the library (--no-kernels skips it).

A local Hugging Face checkpoint directory prepares too (the families of
ignition/sources/hf_families.py: Llama 3.x, Qwen2.5, Qwen3, Mistral, Gemma 3):

    helios-prepare ./Qwen2.5-0.5B-Instruct --out var/cores/qwen.core
    helios-prepare ~/.cache/huggingface/hub/models--Org--Name/snapshots/SHA --served-model-name my-model --out m.core

It needs config.json, the safetensors weights, tokenizer.json and tokenizer_config.json (whose
chat_template is required unless --chat-template FILE is given); see docs/model-sources.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import sys
from types import ModuleType
from typing import Any, Mapping, Optional, Sequence

from helios_backend.core import load_or_create_publisher_key, write_payload_core
from ignition.gpu_kernels.specs import GeometryError
from ignition.gpu_kernels.targets import TargetError
from ignition.preparation.prepare import PreparedModel, prepare
from ignition.preparation.tensor_parallel import TensorParallelError
from ignition.progress import WRITING, ProgressBars
from ignition.recipes import (gemma_3_270m, hf_checkpoint, hf_layout, qwen2_5_coder_instruct, smollm2_135m_instruct,
                              syntax_variants)
from ignition.sources.gguf import GGUFError
from ignition.sources.hf_families import FAMILIES
from ignition.sources.packaged import PackagedSourceError

RECIPES: Mapping[str, ModuleType] = {smollm2_135m_instruct.NAME: smollm2_135m_instruct,
                                     **qwen2_5_coder_instruct.RECIPES,   # one per size
                                     gemma_3_270m.NAME: gemma_3_270m,
                                     **syntax_variants.recipes()}  # test cores: other syntax data


class UnknownRecipeError(KeyError):
    """No recipe of that name."""


def recipe_module(name: str, served_name: Optional[str] = None,
                  chat_template: Optional[pathlib.Path] = None) -> ModuleType:
    """A named recipe, a local Hugging Face checkpoint directory (hf_checkpoint.recipe_for) or a
    layout's config.json alone (hf_layout.recipe_for_layout: random weights);
    `served_name` replaces the served id, `chat_template` (a file) a checkpoint's template."""
    if name in RECIPES:
        if chat_template is not None:
            raise UnknownRecipeError(f"--chat-template applies to a checkpoint directory, not the recipe {name!r}")
        if served_name is None:
            return RECIPES[name]
        renamed = ModuleType(RECIPES[name].__name__, RECIPES[name].__doc__)
        renamed.__dict__.update({k: v for k, v in vars(RECIPES[name]).items() if not k.startswith("__")},
                                SERVED_ID=served_name)
        return renamed
    path = pathlib.Path(name)
    if path.is_dir():
        return hf_checkpoint.recipe_for(name, served_name, chat_template)
    if path.is_file() and path.suffix == ".json":     # a layout: config.json alone, random weights
        return hf_layout.recipe_for_layout(path)
    raise UnknownRecipeError(f"unknown recipe {name!r} (and no checkpoint directory or layout config.json there); "
                             f"known: {sorted(RECIPES)}")


def _kernel_library(archs: Optional[Sequence[str]]) -> Optional[Any]:
    """The AOT kernel library for `archs` (None: its default set) when its package is
    importable, else None. TargetError for an architecture it cannot compile for."""
    try:
        from ignition.gpu_kernels.library import KernelLibrary
    except ImportError:
        return None
    return KernelLibrary(archs=archs)


def prepare_core(recipe_name: str | ModuleType, out: str | os.PathLike[str], options: Any = None, *,
                 key_path: Optional[str] = None, kernels: bool = True, show_progress: bool = False,
                 archs: Optional[Sequence[str]] = None) -> PreparedModel:
    """Prepare `recipe_name` (or a recipe module) and write the signed core to `out` (atomically,
    via the core writer); `archs`: the kernel architectures (default: every one the kernel
    library can target)."""
    recipe = recipe_module(recipe_name) if isinstance(recipe_name, str) else recipe_name
    options = options or recipe.RecipeOptions()
    progress = ProgressBars(enabled=show_progress)
    prepared = prepare(recipe, options, progress=progress,
                       kernel_library=_kernel_library(archs) if kernels else None)
    target = pathlib.Path(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    write_payload_core(target, contract=prepared.contract, manifest=prepared.manifest,
                       resources=prepared.resources, namespace=recipe.PUBLISHER_NAMESPACE,
                       signing_key=load_or_create_publisher_key(key_path),
                       progress=lambda done, total: progress(WRITING, done, total))
    progress.close()
    return prepared


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="helios-prepare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", help=f"one of {sorted(RECIPES)}, or a local Hugging Face checkpoint directory "
                                       f"(model_type {', '.join(FAMILIES)}), which must hold config.json, model.safetensors "
                                       "(or shards with model.safetensors.index.json; f32, f16 or bf16), "
                                       "tokenizer.json and tokenizer_config.json (with its chat_template, unless "
                                       "--chat-template is given); generation_config.json is read when present; or a layout's config.json alone (random weights)")
    parser.add_argument("--out", required=True, type=pathlib.Path, help="core file to write (required)")
    parser.add_argument("--key", default=None, help="publisher key (PEM), created on first use (default: $HELIOS_HOME/keys/publisher.ed25519.pem, "
                                                  "else ~/.local/share/helios/keys/publisher.ed25519.pem)")
    parser.add_argument("--page-tokens", type=int, default=None, help="logical tokens per KV-cache page, in tokens (default: the recipe's)")
    parser.add_argument("--context-tokens", type=int, default=None,
                        help="context extent per request, in tokens (default: the recipe's; a checkpoint "
                             "directory's max_position_embeddings, at most 32768)")
    parser.add_argument("--served-model-name", default=None, metavar="NAME",
                        help="model id the core is served as (default: the recipe's; for a checkpoint "
                             "directory its Hugging Face repository id when it is a cache snapshot "
                             "(models--Org--Name/snapshots/SHA), else config.json's _name_or_path when "
                             "that is a repository id, else the directory name)")
    parser.add_argument("--chat-template", default=None, type=pathlib.Path, metavar="FILE",
                        help="Jinja chat template file for a checkpoint directory (default: "
                             "tokenizer_config.json's chat_template; preparation fails without one)")
    parser.add_argument("--no-kernels", action="store_true",
                        help="do not include AOT kernel modules: a core for the cpu and numpy executors only "
                             "(default: include them whenever the kernel library imports, even on a host without "
                             "a GPU, since the core may be served elsewhere; docs/preparation.md)")
    parser.add_argument("--arch", action="append", default=None, metavar="ARCH",
                        help="kernel architecture to compile for, repeatable: sm_80, sm_86, sm_89, sm_90a, "
                             "sm_100a, compute_80 (PTX, JIT-compiled at startup on any newer device); "
                             "default: all of them the installed Triton can target")
    parser.add_argument("--tensor-parallel", type=int, default=None, metavar="RANKS",
                        help="ranks the model is divided among (per-rank programs and weights; default 1)")
    return parser


def prepare_main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        recipe = recipe_module(args.recipe, args.served_model_name, args.chat_template)
    except (UnknownRecipeError, GGUFError) as exc:   # CheckpointError is a GGUFError
        print(f"helios-prepare: {exc}", file=sys.stderr)
        return 2
    overrides = {k: v for k, v in (("page_tokens", args.page_tokens), ("context_tokens", args.context_tokens),
                                   ("tensor_parallel", args.tensor_parallel)) if v is not None}
    options = dataclasses.replace(recipe.RecipeOptions(), **overrides)
    try:
        prepared = prepare_core(recipe, args.out, options, key_path=args.key, kernels=not args.no_kernels,
                                show_progress=True, archs=args.arch)
    except (TensorParallelError, GGUFError, PackagedSourceError, TargetError) as exc:   # a source or option the recipe cannot use
        print(f"helios-prepare: {exc}", file=sys.stderr)
        return 2
    except GeometryError as exc:    # a launch no compiled kernel tile covers (e.g. a head wider than its tiles)
        print(f"helios-prepare: the AOT kernels cannot run this model: {exc}; --no-kernels prepares a core "
              "for the numpy and CPU executors", file=sys.stderr)
        return 2
    for name, count in prepared.node_counts.items():
        print(f"{name}: {count} nodes per step")
    archs = list(dict.fromkeys(m.arch for m in prepared.manifest.modules))
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**20:.1f} MiB, "
          f"{len(prepared.manifest.programs)} programs over {max(1, prepared.manifest.world_size)} rank(s), "
          f"{len(prepared.manifest.modules)} kernel modules for {', '.join(archs) or 'no architecture'})")
    return 0


if __name__ == "__main__":
    sys.exit(prepare_main())
