"""A prepared model that fits the device tool's 64 MiB transfer: built here, completed there.

The real GGUF (98 MB) and a prepared core (~270 MB of fp16 weights) are too large to travel
in one call. So:
  here  (`python tests/gpu/model_bundle.py build`): prepare with the AOT kernel library,
        keep contract + manifest + every resource except the fp16 weights in bundle.bin,
        record the weights' sha256, and split the GGUF into two halves for two calls;
  there (`load_bundle`): join the halves, rebuild the fp16 weight resource from the GGUF
        with the recipe's own tensor conversion, check its sha256, and serve resources.
The weights are the real model's; nothing model-specific is in the executor or this file
beyond the recipe module the preparation itself names.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import pathlib
import pickle
import sys
import time
from typing import Callable

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

BUNDLE_DIR = ROOT / ".carry_model"
GGUF_HALVES = (ROOT / ".carry_gguf1" / "part_a", ROOT / ".carry_gguf2" / "part_b")


def bench_options(recipe, gguf_path: str | None):
    """Variants the conformance script and the benchmark need (decode to 128 rows, 4096 prefill)."""
    return recipe.RecipeOptions(
        decode_rows=(1, 2, 4, 8, 16, 32, 64, 128),
        prefill_variants=((1, 32), (1, 128), (1, 512), (4, 512), (1, 4096)),
        mixed_variants=((8, 135), (32, 159)),
        admission_rows=(1, 4),
        context_tokens=8192, prepared_pages=4096, gguf_path=gguf_path)


def build(out: pathlib.Path = BUNDLE_DIR) -> None:
    from ignition.kernels.library import KernelLibrary
    from ignition.preparation.prepare import WEIGHTS_RESOURCE, prepare
    from ignition.recipes import smollm2_135m_instruct as recipe
    from ignition.sources.gguf import default_gguf_path

    started = time.time()
    prepared = prepare(recipe, bench_options(recipe, None), kernel_library=KernelLibrary())
    small, weights_sha = {}, ""
    for resource in prepared.resources:
        rid, data = resource.id, resource.data
        if rid == WEIGHTS_RESOURCE:
            weights_sha = hashlib.sha256(data).hexdigest()
        else:
            small[rid] = bytes(data)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"contract": prepared.contract.SerializeToString(), "manifest": prepared.manifest.SerializeToString(),
               "resources": small, "weights_resource": WEIGHTS_RESOURCE, "weights_sha256": weights_sha,
               "node_counts": prepared.node_counts}
    (out / "bundle.bin").write_bytes(pickle.dumps(payload))
    gguf = pathlib.Path(default_gguf_path()).read_bytes()
    half = len(gguf) // 2
    for path, piece in zip(GGUF_HALVES, (gguf[:half], gguf[half:])):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(piece)
    print(f"bundle: {len(payload['manifest'])} manifest bytes, {len(small)} small resources, "
          f"{sum(len(v) for v in small.values())} bytes; weights sha256 {weights_sha[:16]}; "
          f"{time.time() - started:.0f} s; node counts {dict(list(prepared.node_counts.items())[:6])}")


def load_bundle(directory: pathlib.Path | None = None):
    """(contract, manifest, read_resource) with the fp16 weights rebuilt from the joined GGUF.

    HELIOS_BUNDLE_DIR overrides the bundle folder; the GGUF is joined once into
    /tmp/helios_bundle_model.gguf from the halves (HELIOS_GGUF_PARTS: colon-separated paths).
    """
    directory = pathlib.Path(os.environ.get("HELIOS_BUNDLE_DIR", directory or BUNDLE_DIR))
    import numpy as np
    from helios_proto import contract_pb2, manifest_pb2

    payload = pickle.loads((directory / "bundle.bin").read_bytes())
    contract = contract_pb2.ServingContract.FromString(payload["contract"])
    manifest = manifest_pb2.ExecutionManifest.FromString(payload["manifest"])
    resources = dict(payload["resources"])
    if os.environ.get("HELIOS_RANDOM_WEIGHTS"):
        # speed runs only: seeded N(0, 0.02) fp16 of the prepared layout (dense fp16 speed does not
        # depend on the values); no GGUF needed
        end = max(b.weight.byte_offset + b.nbytes for b in manifest.buffers
                  if b.kind == manifest_pb2.BUFFER_KIND_WEIGHT)
        values = np.random.default_rng(0).standard_normal(int(end + 1) // 2, dtype=np.float32) * 0.02
        resources[payload["weights_resource"]] = values.astype(np.float16).tobytes()
        return contract, manifest, resources.__getitem__
    from ignition.preparation.prepare import _pack_weights
    from ignition.recipes import smollm2_135m_instruct as recipe
    from ignition.recorder import Recorder, unit_geometry
    gguf = pathlib.Path("/tmp/helios_bundle_model.gguf")   # outside the repo: never carried back
    if not gguf.exists():
        parts = os.environ.get("HELIOS_GGUF_PARTS")
        halves = [pathlib.Path(p) for p in parts.split(":")] if parts else GGUF_HALVES
        gguf.write_bytes(b"".join(p.read_bytes() for p in halves))
    options = bench_options(recipe, str(gguf))
    source = recipe.open_source(options)
    weights, _views = _pack_weights(Recorder(rank=0, geometry=unit_geometry), recipe, source, options, None)
    digest = hashlib.sha256(weights).hexdigest()
    if digest != payload["weights_sha256"]:
        # numpy 2 on the device rounds some dequantized values differently from numpy 1.26
        # here; both executors load these same bytes, so conformance is unaffected
        print(f"note: rebuilt weights differ from the prepared ones' digest ({digest[:16]})", flush=True)
    resources[payload["weights_resource"]] = weights
    read: Callable[[str], bytes] = resources.__getitem__
    return contract, manifest, read


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["build"])
    parser.parse_args()
    build()
