"""A prepared model that fits the device tool's 64 MiB transfer: built here, completed there.

The real GGUF (98 MB for SmolLM2, 491 MB for Qwen2.5-Coder-0.5B) and a prepared core (~270 MB
/ 1.2 GB of fp16 weights) are too large to travel in one call. So:
  here  (`python tests/gpu/model_bundle.py build [--recipe NAME] [--arch sm_90a --arch compute_80]`):
        prepare the recipe (default smollm2-135m-instruct) with the AOT kernel library (for the
        named architectures; default: its full set), keep contract + manifest + every resource
        except the fp16 weights in bundle.bin, record the recipe, its options and each weight
        resource's sha256, and split the GGUF into pieces of at most 56 MiB, one per call (two
        halves, .carry_gguf1/part_a and .carry_gguf2/part_b, for SmolLM2; .carry_gguf_piece<i>/part_<i>
        for larger files: nine for qwen2);
  there (`load_bundle`): join the pieces (HELIOS_GGUF_PARTS, colon-separated, in order), rebuild
        every weight resource (one per tensor-parallel
        rank) from the GGUF with the recipe's own tensor conversion and sharding
        (prepare.pack_weights), check their sha256, and serve resources.
A layout (a config.json alone, ignition/sources/hf_layout.py, prepared with `weights_seed=None`:
bench/kernels.py builds these) has no GGUF: its bundle is the whole transfer, and `materialize`
fills its weight resources with seeded random fp16 there, as HELIOS_RANDOM_WEIGHTS=1 does for any
bundle. Otherwise the weights are the real model's; nothing model-specific is in the executor or this file
beyond the recipe module the preparation itself names.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import lzma
import os
import pathlib
import pickle
import sys
import time
from typing import Callable, Mapping

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

BUNDLE_DIR = ROOT / ".carry_model"
GGUF_HALVES = (ROOT / ".carry_gguf1" / "part_a", ROOT / ".carry_gguf2" / "part_b")
_XZ_MAGIC = b"\xfd7zXZ\x00"


def bench_options(recipe, gguf_path: str | None, product_path_tokens: int | None = None):
    """Variants the conformance script and the benchmarks need: the recipe's own serving rows
    (ignition/recipes/llama_decoder.py: decode to 256 rows, MIXED to 256 rows with chunks to 1,024
    tokens, admission of 1/4/16/64 rows, SPECULATIVE widths 1, 4 and 8 to 64 rows), plus prompts
    and context to 4,096 / 8,192 tokens. Weights stay f16 (`source_blocks` off where a recipe has
    it): the CUDA executor runs on f16 either way, and HELIOS_RANDOM_WEIGHTS fills the weight
    resources with random f16 values, which block layouts would read as scales."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(recipe.RecipeOptions)}
    f16 = {"source_blocks": False} if "source_blocks" in fields else {}
    if product_path_tokens is not None and "product_path_tokens" in fields:    # None: the recipe's default
        f16["product_path_tokens"] = product_path_tokens
    return recipe.RecipeOptions(
        **f16,
        prefill_variants=((1, 32), (1, 128), (1, 512), (4, 512), (16, 1024), (64, 4096), (1, 4096)),
        context_tokens=8192, prepared_pages=4096, gguf_path=gguf_path)


def write_bundle(prepared, options, path: pathlib.Path, compress: bool = False) -> dict:
    """Everything of `prepared` except its weight resources (their sha256 instead) and the recipe
    options that rebuild them; returns the payload written to `path` (xz-compressed with `compress`:
    manifests and the tokenizer shrink several times, which matters under the 64 MiB carry)."""
    from helios_backend.core import ResourceKind

    small, weights_sha = {}, {}
    for resource in prepared.resources:
        if resource.kind == ResourceKind.RESOURCE_KIND_WEIGHTS:
            weights_sha[resource.id] = hashlib.sha256(resource.data).hexdigest()
        else:
            small[resource.id] = bytes(resource.data)
    fields = {f.name: getattr(options, f.name) for f in dataclasses.fields(options) if f.name != "gguf_path"}
    payload = {"recipe": prepared.contract.rebuild.recipe,
               "contract": prepared.contract.SerializeToString(), "manifest": prepared.manifest.SerializeToString(),
               "resources": small, "weights_sha256": weights_sha, "recipe_options": fields,
               "node_counts": prepared.node_counts}
    path.parent.mkdir(parents=True, exist_ok=True)
    data = pickle.dumps(payload)
    path.write_bytes(lzma.compress(data) if compress else data)
    return payload


RANDOM_BLOCK = (1 << 24) - 3      # values drawn once, then repeated (an odd length: rows do not align)


def random_weights(nbytes: int, seed: int = 0):
    """`nbytes` (rounded up to whole fp16 values) of seeded N(0, 0.02) fp16: one block of
    RANDOM_BLOCK drawn values repeated, so an 8B layout's 16 GB take seconds, not minutes.
    An array (the executor takes it as the resource's bytes without another copy)."""
    import numpy as np

    block = (np.random.default_rng(seed).standard_normal(RANDOM_BLOCK, dtype=np.float32) * 0.02).astype(np.float16)
    values = np.empty((nbytes + 1) // 2, np.float16)
    for start in range(0, values.size, RANDOM_BLOCK):
        part = values[start:start + RANDOM_BLOCK]
        part[:] = block[:part.size]
    return values.view(np.uint8)     # bytes by offset, as both executors slice a resource


def read_payload(path: pathlib.Path) -> dict:
    data = path.read_bytes()
    return pickle.loads(lzma.decompress(data) if data.startswith(_XZ_MAGIC) else data)


def write_core(path: pathlib.Path, contract, manifest, resources: Mapping[str, bytes], namespace: str) -> None:
    """A signed payload core of a bundle's contract, manifest and resources (a fresh publisher key)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from helios_backend.core import ResourceInput, ResourceKind, write_payload_core

    frontend = contract.model.frontend
    kinds = {m.resource: ResourceKind.RESOURCE_KIND_KERNEL_MODULE for m in manifest.modules}
    kinds.update({b.weight.resource: ResourceKind.RESOURCE_KIND_WEIGHTS for b in manifest.buffers if b.weight.resource})
    kinds[frontend.tokenizer_resource] = ResourceKind.RESOURCE_KIND_TOKENIZER
    kinds[frontend.chat_template_resource] = ResourceKind.RESOURCE_KIND_CHAT_TEMPLATE
    unknown = sorted(set(resources) - set(kinds))
    if unknown:
        raise ValueError(f"resources of unknown kind: {unknown}")
    inputs = [ResourceInput(rid, kinds[rid], bytes(data)) for rid, data in resources.items()]
    write_payload_core(path, contract=contract, manifest=manifest, resources=inputs, namespace=namespace,
                       signing_key=Ed25519PrivateKey.generate())


DEFAULT_RECIPE = "smollm2-135m-instruct"
PIECE_BYTES = 56 << 20          # one GGUF piece per device call (64 MiB a call): SmolLM2 in two halves


def gguf_pieces(count: int) -> list[pathlib.Path]:
    """Where the GGUF's pieces go: GGUF_HALVES for two, .carry_gguf_piece<i>/part_<i> for more (folders of
    their own, so a piece never travels beside another model's half)."""
    if count == 2:
        return list(GGUF_HALVES)
    return [ROOT / f".carry_gguf_piece{i + 1}" / f"part_{i + 1}" for i in range(count)]


def split_gguf(recipe=None) -> list[pathlib.Path]:
    """The recipe's GGUF in pieces of at most PIECE_BYTES (at least two), one per device call."""
    if recipe is None:
        from ignition.recipes import smollm2_135m_instruct as recipe
    gguf = pathlib.Path(recipe.open_source(recipe.RecipeOptions()).path).read_bytes()
    count = max(2, -(-len(gguf) // PIECE_BYTES))
    size = -(-len(gguf) // count)
    paths = gguf_pieces(count)
    for index, path in enumerate(paths):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(gguf[index * size:(index + 1) * size])
    return paths


def build(out: pathlib.Path = BUNDLE_DIR, archs=None, recipe_name: str = DEFAULT_RECIPE,
          product_path_tokens: int | None = None, attention_tiles: str | None = None) -> None:
    from ignition.cli import recipe_module
    from ignition.gpu_kernels.library import KernelLibrary
    from ignition.gpu_kernels.specs import DEFAULT_ATTENTION_TILES
    from ignition.preparation.prepare import prepare

    recipe = recipe_module(recipe_name)
    started = time.time()
    options = bench_options(recipe, None, product_path_tokens)
    library = KernelLibrary(archs=archs, attention_tiles=attention_tiles or DEFAULT_ATTENTION_TILES)
    prepared = prepare(recipe, options, kernel_library=library)
    payload = write_bundle(prepared, options, out / "bundle.bin")
    pieces = split_gguf(recipe)
    print(f"GGUF pieces (one device call each, then HELIOS_GGUF_PARTS=... in that order): "
          f"{[str(p.relative_to(ROOT)) for p in pieces]}")
    small = payload["resources"]
    print(f"bundle: {len(payload['manifest'])} manifest bytes, {len(small)} small resources, "
          f"{sum(len(v) for v in small.values())} bytes; weights sha256 "
          f"{ {k: v[:16] for k, v in payload['weights_sha256'].items()} }; "
          f"{time.time() - started:.0f} s; node counts {dict(list(prepared.node_counts.items())[:6])}")


def joined_gguf() -> pathlib.Path:
    """The GGUF joined once from its pieces (HELIOS_GGUF_PARTS: colon-separated paths; default
    GGUF_HALVES) into /tmp, one file per list of pieces (another model's pieces join elsewhere)."""
    parts = os.environ.get("HELIOS_GGUF_PARTS")
    halves = [pathlib.Path(p) for p in parts.split(":")] if parts else list(GGUF_HALVES)
    key = hashlib.sha256(":".join(str(p.resolve()) for p in halves).encode()).hexdigest()[:12]
    gguf = pathlib.Path(f"/tmp/helios_bundle_model-{key}.gguf")   # outside the repo: never carried back
    if not gguf.exists():
        partial = gguf.with_suffix(".part")
        partial.write_bytes(b"".join(p.read_bytes() for p in halves))
        partial.replace(gguf)
    return gguf


def bundle_dir(directory: pathlib.Path | None = None) -> pathlib.Path:
    """The bundle folder: HELIOS_BUNDLE_DIR where set, else `directory`, else .carry_model."""
    return pathlib.Path(os.environ.get("HELIOS_BUNDLE_DIR", directory or BUNDLE_DIR))


def load_bundle(directory: pathlib.Path | None = None, name: str = "bundle.bin", gguf: pathlib.Path | None = None):
    """(contract, manifest, read_resource) with the fp16 weights rebuilt from the joined GGUF.

    HELIOS_BUNDLE_DIR overrides the bundle folder (bundle_dir); `gguf` (default: joined_gguf())
    is the source the weight resources are rebuilt from.
    """
    return materialize(read_payload(bundle_dir(directory) / name), gguf)


def materialize(payload: dict, gguf: pathlib.Path | None = None):
    """A bundle's (contract, manifest, read_resource), its weight resources rebuilt from `gguf`."""
    import numpy as np
    from helios_proto import contract_pb2, manifest_pb2

    contract = contract_pb2.ServingContract.FromString(payload["contract"])
    manifest = manifest_pb2.ExecutionManifest.FromString(payload["manifest"])
    resources = dict(payload["resources"])
    expected = payload["weights_sha256"]
    if isinstance(expected, str):                      # bundles written before per-rank weights
        expected = {payload["weights_resource"]: expected}
    # a layout prepared without weight bytes (ignition/sources/hf_layout.py) has only random ones
    layout = (payload.get("recipe_options") or {}).get("weights_seed", 0) is None
    if os.environ.get("HELIOS_RANDOM_WEIGHTS") or layout:
        # speed runs only: seeded N(0, 0.02) fp16 of the prepared layout (dense fp16 speed does not
        # depend on the values); no GGUF needed
        for resource in expected:
            end = max(b.weight.byte_offset + b.nbytes for b in manifest.buffers
                      if b.kind == manifest_pb2.BUFFER_KIND_WEIGHT and b.weight.resource == resource)
            resources[resource] = random_weights(int(end))
        return contract, manifest, resources.__getitem__
    from ignition.cli import recipe_module
    from ignition.preparation import tensor_parallel
    from ignition.preparation.prepare import pack_weights
    recipe = recipe_module(payload.get("recipe", DEFAULT_RECIPE))
    path = str(gguf or joined_gguf())
    fields = payload.get("recipe_options")
    options = (recipe.RecipeOptions(**fields, gguf_path=path) if fields is not None
               else bench_options(recipe, path))
    source = recipe.open_source(options)
    partition = tensor_parallel.plan_for(recipe, source.shape, getattr(options, tensor_parallel.OPTION, 1))
    for weights in pack_weights(recipe, source, options, partition):
        data = bytes(weights.blob)
        digest = hashlib.sha256(data).hexdigest()
        if digest != expected.get(weights.resource):
            # numpy 2 on the device rounds some dequantized values differently from numpy 1.26
            # here; both executors load these same bytes, so conformance is unaffected
            print(f"note: rebuilt {weights.resource} differs from the prepared digest ({digest[:16]})", flush=True)
        resources[weights.resource] = data
    read: Callable[[str], bytes] = resources.__getitem__
    return contract, manifest, read


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["build"])
    parser.add_argument("--arch", action="append", default=None, help="kernel architecture (repeatable)")
    parser.add_argument("--recipe", default=DEFAULT_RECIPE, help="the recipe to prepare (its GGUF is split)")
    parser.add_argument("--out", type=pathlib.Path, default=BUNDLE_DIR,
                        help="the bundle's folder (HELIOS_BUNDLE_DIR there; default .carry_model)")
    parser.add_argument("--product-path-tokens", type=int, default=None,
                        help="steps of this many tokens and more run the product path (0: never; "
                             "default: the recipe's)")
    # imported here only: the device machine loads bundles without the kernel library
    from ignition.gpu_kernels.specs import ATTENTION_TILES, DEFAULT_ATTENTION_TILES

    parser.add_argument("--attention-tiles", choices=sorted(ATTENTION_TILES), default=DEFAULT_ATTENTION_TILES,
                        help="attention.paged.v1's large-step tiles (ignition/gpu_kernels/specs.py ATTENTION_TILES)")
    arguments = parser.parse_args()
    build(out=arguments.out, archs=arguments.arch, recipe_name=arguments.recipe,
          product_path_tokens=arguments.product_path_tokens, attention_tiles=arguments.attention_tiles)
