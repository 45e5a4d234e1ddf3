"""The kernels at the shapes users serve: each layout's programs and operations against the roofline.

    here:   python -m bench.kernels build --out .kcarry/bundles        # the layouts' device bundles
    device: python -m bench.pytorch_peer --out $OUT/peer.json           # peaks + the PyTorch peer
            python -m bench.kernels run --bundles .kcarry/bundles --peer $OUT/peer.json --out $OUT \
                [--llama-cpp $OUT/llama_cpp_layouts.json]          # bench/gpu_llama_peer.py run --kernel-shapes

`build` prepares each layout of bench/layouts/ (a config.json alone: ignition/sources/hf_layout.py)
with the kernel library for sm_90a and no weight bytes, at the variants measured here (decode
rows 1, 16, 64, 128, 256; one-row prefill of 512 and 4,096 tokens), into bundles of a few MB;
`run` fills the weights with seeded random fp16 there (tests/gpu/model_bundle.py), starts the
CUDA executor with the server's own setup and measures, per layout:

  * decode at each batch: every row attends over CONTEXT positions (a CONTEXT - 1 token prompt
    prefilled first); the device time of one step (graph replays back to back, staging copies
    included) gives `tokens_per_s`; the host loop with both staging frames in flight (packing
    included, 32 steps) gives `engine_tokens_per_s`;
  * prefill of 512 and 4,096 tokens of one row from position 0 (device time of one step);
  * per operation: each node's device time with events between nodes, summed over the layers by
    operation (`qkv`, `attention`, `attn_output`, `gate_up`, `down`, `logits`, ...).

Bytes and FLOPs come from the manifest (bench/roofline.py); the roofline is max(bytes / copy
bandwidth, FLOPs / fp16 tensor-core peak) with the copy bandwidth measured here and the fp16 peak
measured by bench/pytorch_peer.py in the same device call (cuBLAS 8192^3; this process measures
it itself when no peer file is given). `roofline_fraction` = roofline time / measured time.
Steps of PRODUCT_PATH_TOKENS tokens and more take the product path (plain f16 products: cuBLASLt
where it loads, `run --no-vendor-products` their cubins; docs/kernels.md); each layout's entry
names which served them. `build --attention-tiles flash` compiles attention.paged.v1 with its
FlashAttention-2-class large-step tiles (docs/kernels.md, "Flash-class prefill attention") for an
A/B against the default in one device call. Writes kernels.json (`programs`: one row per layout x program; `operations`: per-operation rows)
and prints a table. llama.cpp is not run here: `--llama-cpp` reads its figures at the same
shapes, measured in the same device call before this one (`python3 -m bench.gpu_llama_peer run
--kernel-shapes`: llama-batched-bench decode of B sequences around CONTEXT positions, llama-bench
prefill of 512 and 4,096 tokens, random F16 weights of each layout's shape); without it
`llama_cpp_tokens_per_s` is null.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import statistics
import time
from typing import Any

import numpy as np
from helios_proto import contract_pb2 as C

from bench.harness import commit, device_slug
from bench.roofline import Step, program_costs
from ignition.gpu_kernels.specs import ATTENTION_TILES, DEFAULT_ATTENTION_TILES
from ignition.recipes.llama_decoder import DecoderOptions

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYOUT_DIR = ROOT / "bench" / "layouts"
LAYOUTS = ("smollm2-135m", "qwen2.5-0.5b", "qwen2.5-1.5b", "llama-3.1-8b")
DECODE_BATCHES = (1, 16, 64, 128, 256)
PREFILL_TOKENS = (512, 4096)
CONTEXT = 256            # positions each decode row attends to
HOST_STEPS = 32          # pipelined host-loop steps per decode batch
REPLAYS = 50             # graph replays timed per decode program (10 for prefill)
GEMM_SIZE = 8192


# steps of this many tokens and more take the product path: the recipes' default
PRODUCT_PATH_TOKENS = DecoderOptions().product_path_tokens


def layout_options(recipe: Any, product_path_tokens: int = PRODUCT_PATH_TOKENS) -> Any:
    """The measured variants only (a fast start on the device), no weight bytes in the bundle."""
    return recipe.RecipeOptions(weights_seed=None, decode_rows=DECODE_BATCHES, product_path_tokens=product_path_tokens,
                                prefill_variants=tuple((1, t) for t in PREFILL_TOKENS), mixed_variants=(),
                                admission_rows=(1,), resume_rows=(), scored_prefill_variants=(), snapshot_rows=0,
                                context_tokens=8192, prepared_pages=4096)


# ---- here: bundles ----------------------------------------------------------------------------

def build(out: pathlib.Path, layouts: list[str], archs: list[str], product_path_tokens: int,
          attention_tiles: str = DEFAULT_ATTENTION_TILES) -> None:
    from ignition.gpu_kernels.library import KernelLibrary
    from ignition.preparation.prepare import prepare
    from ignition.recipes.hf_layout import recipe_for_layout
    from tests.gpu.model_bundle import write_bundle

    library = KernelLibrary(archs=archs, attention_tiles=attention_tiles)
    for name in layouts:
        started = time.time()
        recipe = recipe_for_layout(LAYOUT_DIR / f"{name}.json")
        options = layout_options(recipe, product_path_tokens)
        prepared = prepare(recipe, options, kernel_library=library)
        path = out / f"{name}.bin"
        write_bundle(prepared, options, path, compress=True)
        print(f"{name}: {path.stat().st_size / 1e6:.1f} MB, {time.time() - started:.0f} s", flush=True)


# ---- device: measurements ---------------------------------------------------------------------

def gemm_tflops() -> float:
    """fp16 tensor-core peak through cuBLAS (PyTorch, benchmarks only): 8192^3 on random data."""
    import torch  # type: ignore[import-not-found]

    a = torch.randn(GEMM_SIZE, GEMM_SIZE, device="cuda", dtype=torch.float16)
    b = torch.randn(GEMM_SIZE, GEMM_SIZE, device="cuda", dtype=torch.float16)
    for _ in range(3):
        a @ b
    samples = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    del a, b
    torch.cuda.empty_cache()
    return 2 * GEMM_SIZE ** 3 / (statistics.median(samples) * 1e-3) / 1e12


class LayoutRun:
    """One layout's model on the CUDA executor, its lanes admitted once for every decode batch."""

    def __init__(self, bundle: pathlib.Path, vendor_products: bool = True) -> None:
        from bench.gpu_decode import Bench
        from helios_backend.engine.settings import StartupOptions
        from helios_backend.engine.setup import derive_setup
        from tests.gpu.model_bundle import materialize, read_payload

        started = time.perf_counter()
        contract, manifest, read = materialize(read_payload(bundle))
        self.weights_s = time.perf_counter() - started
        self.manifest = manifest
        self.model = derive_setup(contract, manifest, read, StartupOptions(
            core_path=bundle, executor="cuda", vendor_products=vendor_products)).model
        self.startup_s = time.perf_counter() - started - self.weights_s
        self.bench = Bench(self.model)
        self.lanes = self.bench.admit(list(range(max(DECODE_BATCHES))), CONTEXT - 1, HOST_STEPS + 16)

    def program(self, name: str) -> Any:
        return next(p for p in self.manifest.programs if p.name == name and p.rank == 0)

    def _decode_lanes(self, batch: int, step: int) -> list:
        from helios_backend.packing import PackedLane

        return [PackedLane(slot=l.slot, generation=l.generation, start=l.start + step, page_table=l.page_table)
                for l in self.lanes[:batch]]

    def decode(self, batch: int) -> dict:
        from helios_backend.executors.cuda.driver import load_driver
        from tests.gpu import timing

        executor: Any = self.model.executor      # the CUDA executor (profile_nodes)
        packer = self.model.packer
        program = self.model.program(C.OPERATION_DECODE, batch, batch)
        per_step = [self._decode_lanes(batch, k) for k in range(HOST_STEPS + executor.frames)]
        for frame in range(executor.frames):                # warm-up, every staging frame packed
            packer.pack(program, frame, per_step[frame])
            executor.launch(program, frame)
            executor.wait(frame)
        host_us, _ = timing.pipelined_us(executor, program, HOST_STEPS, lambda frame, k: packer.pack(
            program, frame, per_step[executor.frames + k]))
        packer.pack(program, 0, self._decode_lanes(batch, 0))   # the measured step: CONTEXT positions a row
        executor.launch(program, 0)
        executor.wait(0)
        # the launches above, made on the executor directly (warm-up, the pipelined loop, the step)
        self.model.submissions.advance(2 * executor.frames + HOST_STEPS + 1)
        device_us = timing.gpu_us(load_driver(), executor, program, REPLAYS)
        nodes = executor.profile_nodes(program, frame=0, repeats=10)
        return {"program": program, "us": device_us, "engine_us": host_us, "nodes": nodes,
                "step": Step(rows=batch, tokens=batch, context=CONTEXT)}

    def prefill(self, tokens: int) -> dict:
        from helios_backend.executors.cuda.driver import load_driver
        from helios_backend.packing import PackedLane
        from tests.gpu import timing

        executor: Any = self.model.executor
        program = self.model.program(C.OPERATION_PREFILL, 1, tokens)
        [lane] = self.bench.admit([0], 16, tokens)      # after the decode runs: slot 0 is free again
        prompt = self.bench.rng.integers(0, self.bench.vocab, tokens).astype(np.int32)
        chunk = PackedLane(slot=lane.slot, generation=lane.generation, start=0, tokens=prompt, sample=True,
                           page_table=lane.page_table)
        self.model.packer.pack(program, 0, [chunk])
        executor.launch(program, 0)
        executor.wait(0)
        self.model.submissions.advance(1)               # the launch above, made directly
        device_us = timing.gpu_us(load_driver(), executor, program, 10)
        nodes = executor.profile_nodes(program, frame=0, repeats=5)
        self.bench.release([lane])
        return {"program": program, "us": device_us, "engine_us": None, "nodes": nodes,
                "step": Step(rows=1, tokens=tokens, context=0)}

    def close(self) -> None:
        self.model.executor.close()


def operation_name(label: str) -> str:
    """'layer3.qkv' -> 'qkv': one operation summed over the layers."""
    return re.sub(r"^layer\d+\.", "", label)


def rows_of(layout: str, device: str, result: dict, run: LayoutRun, gbps: float, tflops: float,
            peer: dict[tuple[str, str, int], float],
            llama: dict[tuple[str, str, int], float] | None = None) -> tuple[dict, list[dict]]:
    """The program row and its per-operation rows."""
    step: Step = result["step"]
    program = run.program(result["program"])
    total, node_costs = program_costs(run.manifest, program, step)
    phase = "decode" if step.context else "prefill"
    size_key, size = ("batch", step.rows) if phase == "decode" else ("tokens", step.tokens)
    floor_us = total.roofline_us(gbps, tflops)
    tokens = step.tokens
    row = {"device": device, "layout": layout, "phase": phase, size_key: size, "program": result["program"],
           "context": step.context or None, "us": round(result["us"], 2),
           "tokens_per_s": round(tokens / (result["us"] * 1e-6), 1),
           "engine_tokens_per_s": round(tokens / (result["engine_us"] * 1e-6), 1) if result["engine_us"] else None,
           "bytes": int(total.nbytes), "flops": int(total.flops), "roofline_us": round(floor_us, 2),
           "bound": "bandwidth" if total.nbytes / (gbps * 1e3) >= total.flops / (tflops * 1e6) else "compute",
           "roofline_fraction": round(floor_us / result["us"], 4),
           "pytorch_tokens_per_s": peer.get((layout, phase, size)), "llama_cpp_tokens_per_s": (llama or {}).get((layout, phase, size)),
           "nodes": len(result["nodes"])}
    by_label = {node.label: cost for node, cost in node_costs}
    grouped: dict[tuple[str, str], dict] = {}
    for label, kernel, us in result["nodes"]:
        key = (operation_name(label), kernel)
        entry = grouped.setdefault(key, {"count": 0, "us": 0.0, "bytes": 0.0, "flops": 0.0})
        cost = by_label.get(label)
        entry["count"] += 1
        entry["us"] += us
        if cost is not None:
            entry["bytes"] += cost.nbytes
            entry["flops"] += cost.flops
    operations = []
    for (operation, kernel), entry in sorted(grouped.items(), key=lambda kv: -kv[1]["us"]):
        floor = max(entry["bytes"] / (gbps * 1e3), entry["flops"] / (tflops * 1e6))
        operations.append({"device": device, "layout": layout, "phase": phase, size_key: size,
                           "program": result["program"], "operation": operation, "kernel": kernel,
                           "count": entry["count"], "us": round(entry["us"], 2), "bytes": int(entry["bytes"]),
                           "flops": int(entry["flops"]), "roofline_us": round(floor, 2),
                           "roofline_fraction": round(floor / entry["us"], 4) if entry["us"] > 0 else None})
    return row, operations


def read_peer(path: pathlib.Path | None) -> tuple[dict, dict[tuple[str, str, int], float]]:
    if path is None or not path.exists():
        return {}, {}
    report = json.loads(path.read_text())
    figures = {(r["layout"], r["phase"], r.get("batch") or r.get("tokens")): r["tokens_per_s"]
               for r in report.get("rows", [])}
    return report, figures


def read_llama_cpp(path: pathlib.Path | None) -> tuple[dict, dict[tuple[str, str, int], float]]:
    """bench/gpu_llama_peer.py's kernel-shape figures: {(layout, phase, batch or tokens): tokens/s}."""
    if path is None or not path.exists():
        return {}, {}
    report = json.loads(path.read_text())
    figures = {}
    for layout, entry in report.get("layouts", {}).items():
        for phase in ("decode", "prefill"):
            figures.update({(layout, phase, int(size)): value
                            for size, value in entry.get(phase, {}).items() if value})
    return report, figures


def run(bundles: pathlib.Path, layouts: list[str], out: pathlib.Path, peer_path: pathlib.Path | None,
        vendor_products: bool = True, name: str = "kernels.json", llama_path: pathlib.Path | None = None) -> dict:
    from helios_backend.executors.cuda.driver import check, load_driver
    from helios_backend.executors.cuda.vendor_products import VENDOR_PRODUCTS
    from tests.gpu import timing

    out.mkdir(parents=True, exist_ok=True)
    peer_report, peer = read_peer(peer_path)
    llama_report, llama = read_llama_cpp(llama_path)
    driver = load_driver()
    check(driver.cuInit(0))
    check(driver.cuCtxSetCurrent(check(driver.cuDevicePrimaryCtxRetain(check(driver.cuDeviceGet(0))))))
    gbps = timing.copy_bandwidth_gbs(driver)
    tflops = peer_report.get("fp16_tflops") or gemm_tflops()
    device = peer_report.get("device") or _device_name()
    report: dict[str, Any] = {"device": device, "device_slug": device_slug(device),
                              "commit": commit(), "copy_GBps": round(gbps, 1),
                              "fp16_tflops": round(tflops, 1), "fp16_tflops_from": "pytorch_peer" if peer_report
                              else "this process", "context": CONTEXT, "layouts": {}, "programs": [],
                              "operations": [],
                              "llama_cpp": {k: llama_report[k] for k in ("device", "llama_cpp", "settings")
                                            if k in llama_report} or None}
    for layout in layouts:
        run_ = LayoutRun(bundles / f"{layout}.bin", vendor_products)
        executor: Any = run_.model.executor
        products = sorted({n.kernel for p in run_.manifest.programs for n in p.nodes} & set(VENDOR_PRODUCTS))
        report["layouts"][layout] = {"weights_s": round(run_.weights_s, 1), "startup_s": round(run_.startup_s, 1),
                                     "cache_pages": executor.cache_pages,
                                     # the product path's ids: served by this library, or by their cubins
                                     "product_path": (executor.product_library() or "cubins") if products else None}
        print(f"{layout}: weights {run_.weights_s:.1f} s, startup {run_.startup_s:.1f} s", flush=True)
        try:
            measured = [(run_.decode, b) for b in DECODE_BATCHES] + [(run_.prefill, t) for t in PREFILL_TOKENS]
            for measure, size in measured:
                result = measure(size)
                row, operations = rows_of(layout, device, result, run_, gbps, tflops, peer, llama)
                report["programs"].append(row)
                report["operations"] += operations
                print(json.dumps(row), flush=True)
        finally:
            run_.close()
        (out / name).write_text(json.dumps(report, indent=1))
    print_table(report)
    return report


def _device_name() -> str:
    from helios_backend.executors.cuda.driver import check, load_driver

    driver = load_driver()
    check(driver.cuInit(0))
    name = check(driver.cuDeviceGetName(128, check(driver.cuDeviceGet(0))))
    return name.split(b"\0")[0].decode()


def print_table(report: dict) -> None:
    print(f"\n{report['device']} commit {report['commit']}: copy {report['copy_GBps']:.0f} GB/s, "
          f"fp16 {report['fp16_tflops']:.0f} TFLOP/s, decode context {report['context']}")
    print(f"{'layout':<14} {'phase':<8} {'size':>5} {'us':>9} {'tok/s':>10} {'engine':>10} {'roofline':>8} "
          f"{'pytorch':>10} {'llama.cpp':>10} {'/pytorch':>8} {'/llama':>7}")
    for r in report["programs"]:
        size = r.get("batch") or r.get("tokens")
        engine = f"{r['engine_tokens_per_s']:.0f}" if r["engine_tokens_per_s"] else "-"
        peers = [r.get("pytorch_tokens_per_s"), r.get("llama_cpp_tokens_per_s")]
        figures = [f"{v:.0f}" if v else "-" for v in peers]
        ratios = [f"x{r['tokens_per_s'] / v:.2f}" if v else "-" for v in peers]
        print(f"{r['layout']:<14} {r['phase']:<8} {size:>5} {r['us']:>9.1f} {r['tokens_per_s']:>10.0f} "
              f"{engine:>10} {r['roofline_fraction']:>8.2f} {figures[0]:>10} {figures[1]:>10} {ratios[0]:>8} {ratios[1]:>7}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    b = commands.add_parser("build", help="prepare the layouts' device bundles (here)")
    b.add_argument("--out", type=pathlib.Path, required=True)
    b.add_argument("--layout", action="append", default=None, help="a bench/layouts name (repeatable)")
    b.add_argument("--arch", action="append", default=None, help="kernel architecture (default sm_90a)")
    b.add_argument("--product-path-tokens", type=int, default=PRODUCT_PATH_TOKENS,
                   help="steps of this many tokens and more run the product path (0: never)")
    b.add_argument("--attention-tiles", choices=sorted(ATTENTION_TILES), default=DEFAULT_ATTENTION_TILES,
                   help="attention.paged.v1's large-step tiles (specs.py ATTENTION_TILES; build both "
                        "into separate --out folders to compare them)")
    r = commands.add_parser("run", help="measure (on the device)")
    r.add_argument("--bundles", type=pathlib.Path, required=True)
    r.add_argument("--layout", action="append", default=None)
    r.add_argument("--peer", type=pathlib.Path, default=None, help="bench/pytorch_peer.py's JSON of this run")
    r.add_argument("--out", type=pathlib.Path, default=pathlib.Path(os.environ.get("OUT", "out")))
    r.add_argument("--no-vendor-products", action="store_true",
                   help="run the product path's ids on their cubins, not cuBLASLt")
    r.add_argument("--name", default="kernels.json", help="the JSON file written under --out")
    r.add_argument("--llama-cpp", type=pathlib.Path, default=None,
                   help="bench/gpu_llama_peer.py run --kernel-shapes' JSON of this device call")
    args = parser.parse_args()
    layouts = args.layout or list(LAYOUTS)
    if args.command == "build":
        build(args.out, layouts, args.arch or ["sm_90a"], args.product_path_tokens, args.attention_tiles)
    else:
        run(args.bundles, layouts, args.out, args.peer, not args.no_vendor_products, args.name, args.llama_cpp)


if __name__ == "__main__":
    main()
