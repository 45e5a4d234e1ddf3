"""Decode and prefill throughput of the CUDA executor on the GPU, beside the roofline and peers.

    python -m bench.gpu_decode [--out DIR | --results] [--steps 128] [--prompt 128] [--kernel-arch compute_80]
    python -m bench.gpu_decode --core var/cores/smollm2-135m-instruct.core     # a prepared core instead

Runs on a GPU machine with the model bundle (tests/gpu/model_bundle.py: the real weights
rebuilt from the GGUF), or with a prepared core (`--core`; the batches and prefills its
variants do not hold are left out). For each decode batch B in 1, 8, 32, 64, 128: B requests
are admitted and prefilled with a `--prompt`-token prompt, then `--steps` decode steps run
with both staging frames in flight (the host packs step k+1 while step k runs); reported:
tokens/s over the batch, step time, the device time of one graph replay, and the host
time per step split into packing and launch. Prefill: one request of 512 and of 4096
tokens (round trip per chunk). Beside them: the HBM roofline from the manifest's bytes
(weights + KV read per step) at the copy bandwidth measured in the same run, and the peer
figures of ../shared/bench/anchors.md (llama.cpp, HF transformers; same shape, same GPU
model, measured 2026-11-30, not in this run). Finally per-node GPU times (event nodes
between nodes) for decode at B=1 and B=64 (or the widest batch held), summed per kernel id: what
bounds the step.
Writes gpu_decode.json (gpu_decode_<arch>.json with --kernel-arch) to the GPU's folder
(bench/harness.py: var/bench/<gpu>/, --results bench/results/<gpu>/, or --out DIR).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from bench.harness import add_output_arguments, output_dir
from helios_backend.executors.cuda.driver import load_driver
from helios_backend.engine.settings import StartupOptions
from helios_backend.engine.setup import derive_setup
from helios_backend.packing import SlotInitialization, PackedLane
from helios_backend.sampling_parameters import SamplingParameters
from helios_backend.lockstep.raw_lanes import RawLanes
from helios_proto import contract_pb2 as C
from helios_proto import manifest_pb2 as M
from tests.gpu import timing

BATCHES = (1, 8, 32, 64, 128)
PREFILLS = (512, 4096)
# ../shared/bench/anchors.md, decode tokens/s (batch -> figure) of the recipe's model on the H200;
# prefill pp512 llama.cpp ~100,000. Other recipes have no anchors yet (printed as "-").
PEERS_BY_RECIPE = {"smollm2-135m-instruct": {1: ("827-970", "376-384"), 8: ("3,989", "3,230"),
                                             32: ("10,988", "11,108"), 64: ("16,614", "19,424-19,497"),
                                             128: ("24,557", "-")}}


class Bench:
    def __init__(self, model: Any) -> None:      # NativeModel, or tests/gpu's ExecutorModel
        self.model = model
        self.driver = RawLanes(model)
        self.vocab = model.contract.model.vocabulary.sampled_tokens
        self.bins = model.contract.model.vocabulary.histogram_bins
        self.generation = 0
        self.rng = np.random.default_rng(0)

    def admit(self, slots: list[int], prompt_tokens: int, extra_tokens: int) -> list[PackedLane]:
        """Admit and prefill one request per slot; lanes ready to decode (pages for extra tokens)."""
        init = self.model.program(C.OPERATION_INITIALIZATION, 1)
        prefill = self.model.program(C.OPERATION_PREFILL, 1, prompt_tokens)
        lanes = []
        for slot in slots:
            self.generation += 1
            prompt = self.rng.integers(0, self.vocab, prompt_tokens).astype(np.int32)
            admission = SlotInitialization.for_prompt(prompt, self.bins, slot, SamplingParameters(logprobs=-1), 1 << 20,
                                             (self.vocab - 1,))   # no logprobs asked, as by default in the API
            self.driver.step(init, [PackedLane(slot=slot, generation=self.generation, initialization=admission)])
            pages = [self.driver.pages.take()
                     for _ in range(-(-(prompt_tokens + extra_tokens) // self.driver.page_tokens))]
            self.driver.step(prefill, [PackedLane(slot=slot, generation=self.generation, start=0, tokens=prompt,
                                            sample=True, page_table=pages)])
            lanes.append(PackedLane(slot=slot, generation=self.generation, start=prompt_tokens, page_table=pages))
        return lanes

    def release(self, lanes: list[PackedLane]) -> None:
        for lane in lanes:
            self.driver.pages.give_back(lane.page_table)

    def decode(self, batch: int, prompt: int, steps: int) -> dict:
        executor, packer = self.model.executor, self.model.packer
        program = self.model.program(C.OPERATION_DECODE, batch, batch)
        lanes = self.admit(list(range(batch)), prompt, steps + 16)
        # lane lists per step, built before timing: the scheduler's bookkeeping is not measured here
        per_step = [[PackedLane(slot=l.slot, generation=l.generation, start=l.start + k, page_table=l.page_table)
                     for l in lanes] for k in range(steps + 8)]
        for k in range(8):                               # warm-up, synchronous
            packer.pack(program, 0, per_step[k])
            executor.launch(program, 0)
            executor.wait(0)
        pack_us, launch_us = [], []
        frames = executor.frames
        start = time.perf_counter_ns()
        for k in range(steps):
            frame = k % frames
            if k >= frames:
                executor.wait(frame)
            t0 = time.perf_counter_ns()
            packer.pack(program, frame, per_step[8 + k])
            t1 = time.perf_counter_ns()
            executor.launch(program, frame)
            t2 = time.perf_counter_ns()
            pack_us.append((t1 - t0) / 1e3)
            launch_us.append((t2 - t1) / 1e3)
        for frame in range(min(frames, steps)):
            executor.wait((steps - 1 - frame) % frames)
        elapsed_us = (time.perf_counter_ns() - start) / 1e3
        round_trip = []
        for k in range(20):
            t0 = time.perf_counter_ns()
            packer.pack(program, 0, per_step[8 + steps - 1])
            executor.launch(program, 0)
            executor.wait(0)
            round_trip.append((time.perf_counter_ns() - t0) / 1e3)
        self.model.submissions.advance(8 + steps + len(round_trip))   # the launches above, made directly
        gpu = timing.gpu_us(load_driver(), executor, program, 50)
        self.release(lanes)
        return {"program": program, "nodes": executor.node_count(program), "staging_bytes": executor.staging_nbytes(program),
                "step_us": elapsed_us / steps,
                "tokens_per_s": batch * steps / (elapsed_us * 1e-6), "gpu_us": gpu,
                "round_trip_us": statistics.median(round_trip), "pack_us": statistics.median(pack_us),
                "launch_us": statistics.median(launch_us), "context": prompt + steps // 2}

    def prefill(self, tokens: int, repeats: int = 10) -> dict:
        executor = self.model.executor
        program = self.model.program(C.OPERATION_PREFILL, 1, tokens)
        [lane] = self.admit([0], 16, tokens)
        prompt = self.rng.integers(0, self.vocab, tokens).astype(np.int32)
        chunk = PackedLane(slot=0, generation=lane.generation, start=0, tokens=prompt, sample=True,
                           page_table=lane.page_table)
        samples = []
        for k in range(repeats + 2):
            t0 = time.perf_counter_ns()
            self.model.packer.pack(program, 0, [chunk])
            executor.launch(program, 0)
            executor.wait(0)
            if k >= 2:
                samples.append((time.perf_counter_ns() - t0) / 1e3)
        self.model.submissions.advance(repeats + 2)             # the launches above, made directly
        gpu = timing.gpu_us(load_driver(), executor, program, 10)
        self.release([lane])
        step = statistics.median(samples)
        return {"program": program, "nodes": executor.node_count(program), "step_us": step,
                "tokens_per_s": tokens / (step * 1e-6), "gpu_us": gpu, "gpu_tokens_per_s": tokens / (gpu * 1e-6)}


def roofline(manifest: M.ExecutionManifest, page_tokens: int, batch: int, context: int, gbps: float) -> float:
    weights = sum(b.nbytes for b in manifest.buffers if b.rank == 0 and b.kind == M.BUFFER_KIND_WEIGHT)
    kv_per_token = sum(b.nbytes for b in manifest.buffers if b.rank == 0 and b.kind == M.BUFFER_KIND_CACHE) / page_tokens
    step_s = (weights + batch * context * kv_per_token) / (gbps * 1e9)
    return batch / step_s


def profile(bench: Bench, batch: int, prompt: int) -> tuple[str, dict]:
    """Per-node GPU times of one decode step at `batch` rows (frame 0 packed with live lanes)."""
    executor, packer = bench.model.executor, bench.model.packer
    program = bench.model.program(C.OPERATION_DECODE, batch, batch)
    lanes = bench.admit(list(range(batch)), prompt, 16)
    packer.pack(program, 0, lanes)
    nodes = executor.profile_nodes(program, frame=0, repeats=10)
    bench.release(lanes)
    per_kernel: dict[str, list[float]] = {}
    for _label, kernel, us in nodes:
        per_kernel.setdefault(kernel, []).append(us)
    return program, {"sum_us": sum(us for _, _, us in nodes), "nodes": [(l, round(us, 2)) for l, _, us in nodes],
                     "per_kernel": {k: {"count": len(v), "total_us": round(sum(v), 1),
                                        "mean_us": round(sum(v) / len(v), 2)}
                                    for k, v in sorted(per_kernel.items(), key=lambda kv: -sum(kv[1]))}}


def held(model: Any, batches: Sequence[int], prefills: Sequence[int]) -> tuple[list[int], list[int]]:
    """The decode batches and prefill lengths some variant of the model holds (a core prepared
    for serving may stop below the bundle's 128 rows and 4,096 tokens)."""
    rows = max((g.capacity.rows for g in model.graphs if g.operation == C.OPERATION_DECODE), default=0)
    tokens = max((g.capacity.tokens for g in model.graphs if g.operation == C.OPERATION_PREFILL), default=0)
    kept = [b for b in batches if b <= rows], [t for t in prefills if t <= tokens]
    if len(kept[0]) < len(batches) or len(kept[1]) < len(prefills):
        print(f"the model holds decode to {rows} rows and prefill to {tokens} tokens: batches {kept[0]}, "
              f"prefills {kept[1]}", flush=True)
    return kept


def load(core: pathlib.Path | None, acceptance: str) -> tuple[Any, Any, Any]:
    """(contract, manifest, resource reader) of `core`, or of the model bundle without one."""
    if core is None:
        from tests.gpu.model_bundle import load_bundle

        return load_bundle()
    from helios_backend.engine.bootstrap import Bootstrap

    bootstrap = Bootstrap.load(core, acceptance)
    return bootstrap.contract, bootstrap.manifest, bootstrap.read_resource


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_decode", description=__doc__.split("\n\n")[0])
    add_output_arguments(parser)
    parser.add_argument("--core", type=pathlib.Path, default=None, help="a prepared core (default: the model bundle)")
    parser.add_argument("--acceptance", default="helios.local/smollm2", help="with --core: its signer's namespace")
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--prefills", default=",".join(map(str, PREFILLS)))
    parser.add_argument("--kernel-arch", default=None,
                        help="KernelModule.arch to load (default: the device's own; e.g. compute_80); "
                             "the JSON is then gpu_decode_<arch>.json")
    args = parser.parse_args(argv)
    out = output_dir(args.out, args.results, "gpu")
    contract, manifest, read = load(args.core, args.acceptance)
    started = time.perf_counter()
    # the server's own setup: the same graphs, executor options and staging extents
    model = derive_setup(contract, manifest, read, StartupOptions(core_path=pathlib.Path("bundle"),
                                                                  executor="cuda", kernel_arch=args.kernel_arch)).model
    executor = model.executor
    startup = time.perf_counter() - started
    bench = Bench(model)
    gbps = timing.copy_bandwidth_gbs(load_driver())
    page_tokens = contract.model.cache.page_tokens
    report = {"architecture": executor.architecture(), "startup_s": startup,
              "startup_detail": executor.startup_seconds, "cache_pages": executor.cache_pages,
              "copy_GBps": gbps, "decode": {}, "prefill": {}, "profile": {}}
    batches, prefills = held(model, [int(b) for b in args.batches.split(",") if b],
                             [int(t) for t in args.prefills.split(",") if t])
    # per-node profiles at one row and at the widest measured batch up to 64
    for batch in sorted({1, max([b for b in batches if b <= 64], default=1)}):
        program, result = profile(bench, batch, args.prompt)
        report["profile"][program] = result
        top = list(result["per_kernel"].items())[:8]
        print(f"profile {program}: serialized sum {result['sum_us']:.0f} us; " +
              "; ".join(f"{k} {v['count']}x {v['mean_us']}us" for k, v in top), flush=True)
    for batch in batches:
        result = bench.decode(batch, args.prompt, args.steps)
        result["roofline_tokens_per_s"] = roofline(manifest, page_tokens, batch, result["context"], gbps)
        report["decode"][batch] = result
        print(json.dumps({batch: result}), flush=True)
    for tokens in prefills:
        report["prefill"][tokens] = bench.prefill(tokens)
        print(json.dumps({tokens: report["prefill"][tokens]}), flush=True)
    name = f"gpu_decode_{args.kernel_arch}" if args.kernel_arch else "gpu_decode"
    (out / f"{name}.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {out / name}.json")
    print(f"\nkernels {executor.architecture()}, startup {startup:.2f} s, cache pages {executor.cache_pages}, device copy {gbps:.0f} GB/s (read+write)")
    print(f"{'batch':>5} {'nodes':>5} {'tok/s':>9} {'step us':>8} {'gpu us':>7} {'rt us':>7} {'pack us':>7} "
          f"{'launch us':>9} {'roofline':>9} {'llama.cpp':>10} {'HF':>14}")
    for batch, r in report["decode"].items():
        peer = PEERS_BY_RECIPE.get(contract.rebuild.recipe, {}).get(batch, ("-", "-"))
        print(f"{batch:>5} {r['nodes']:>5} {r['tokens_per_s']:>9.0f} {r['step_us']:>8.1f} {r['gpu_us']:>7.1f} "
              f"{r['round_trip_us']:>7.1f} {r['pack_us']:>7.1f} {r['launch_us']:>9.1f} "
              f"{r['roofline_tokens_per_s']:>9.0f} {peer[0]:>10} {peer[1]:>14}")
    for tokens, r in report["prefill"].items():
        print(f"prefill {tokens}: {r['tokens_per_s']:.0f} tok/s (round trip {r['step_us']:.0f} us; device "
              f"{r['gpu_us']:.0f} us = {r['gpu_tokens_per_s']:.0f} tok/s); llama.cpp pp512 ~100,000")
    for program, p in report["profile"].items():
        top = list(p["per_kernel"].items())[:6]
        print(f"profile {program}: nodes serialized sum {p['sum_us']:.0f} us; " +
              "; ".join(f"{k} {v['count']}x {v['mean_us']}us" for k, v in top))
    executor.close()


if __name__ == "__main__":
    main()
