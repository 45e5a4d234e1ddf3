"""Where a CPU executor decode step's time goes: seconds per kernel id, and outside the nodes.

Run:  python -m bench.cpu_step_profile [--core var/cores/smollm2-135m-instruct.core] [--threads 2]

Loads the core as the serving path does (executor "cpu"), prefills B lanes with the bench's
prompt ids (bench/cpu_peer.py), then times `steps` greedy DECODE rounds with every bound node
wrapped by a timer: per kernel id the milliseconds a step and calls a step, the sum over
nodes, and the step's wall time (the difference is the host's work around the program:
packing, completion reading, Python per round). Per kernel id also the calling thread's CPU
time (`cpu_ms_per_step`): with `--threads 1` that is the kernel's own work, which other jobs on
a shared machine delay but do not inflate (wall times vary with the load, so the load average is
recorded; compare kernel ids within one run). `--prefill-tokens N` also times N prompt ids in one
PREFILL step (a warm-up, then `--prefill-runs` steps): per kernel id milliseconds and calling thread's
CPU time a step, the step's wall and process CPU time (with 2 threads the helper's share too).
`--isa` compiles the kernels for that ISA path
(executors/cpu/isa.py: `--isa avx2` on an AVX-512 host is the AVX2 code path on this core); the
path and the host's CPU and features are recorded. Writes
cpu_step_profile.json to the CPU's folder (bench/harness.py: var/bench/<cpu>/, --results
bench/results/<cpu>/, or --out DIR).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from bench.harness import DEFAULT_CORE, add_output_arguments, output_dir

Timings = dict[str, list[float]]      # kernel function name -> [seconds, calls, calling thread's CPU seconds]


def _timed(function: Callable[..., None], name: str, timings: Timings, enabled: list[bool]) -> Callable[..., None]:
    def timed(*args: Any) -> None:
        if not enabled[0]:
            function(*args)
            return
        start, cpu = time.perf_counter(), time.thread_time()
        function(*args)
        cell = timings[name]
        cell[0] += time.perf_counter() - start
        cell[1] += 1
        cell[2] += time.thread_time() - cpu
    return timed


def _kernel_figures(timings: Timings, steps: int) -> dict[str, dict[str, float]]:
    return {name: {"ms_per_step": 1e3 * seconds / steps, "calls_per_step": calls / steps,
                   "cpu_ms_per_step": 1e3 * cpu / steps}
            for name, (seconds, calls, cpu) in sorted(timings.items(), key=lambda item: -item[1][0])}


def profile(core: Path, batches: Sequence[int], steps: int, threads: int, prompt_tokens: int,
            activations: str | None = None, prefill_tokens: int = 0,
            prefill_runs: int = 3) -> tuple[dict[str, Any], str]:
    """Figures per batch (and "prefill" with `prefill_tokens`), and the activations the executor ran
    with (`activations`: its option, None: its default)."""
    from bench.cpu_peer import bench_prompt_ids
    from bench.timed_lanes import timed_prefill
    from helios_backend.engine.bootstrap import Bootstrap
    from helios_backend.engine.model import ModelOptions, NativeModel
    from helios_backend.lockstep.generator import GenerationRequest
    from helios_backend.lockstep.raw_lanes import RawLanes
    from helios_backend.sampling_parameters import SamplingParameters

    bootstrap = Bootstrap.load(core, "helios.local/smollm2")
    pages = max(batches) * (-(-(prompt_tokens + steps + 8) // 16)) + 16 + -(-prefill_tokens // 16)
    model = NativeModel.load(bootstrap.contract, bootstrap.manifest, bootstrap.read_resource,
                             ModelOptions(executor="cpu", threads=threads, concurrency=max(batches), cache_pages=pages,
                                          activations=activations))
    ran = model.executor.cpu_options.activations            # type: ignore[attr-defined]
    timings: Timings = collections.defaultdict(lambda: [0.0, 0, 0.0])
    enabled = [False]
    for rank in model.executor.ranks:                       # type: ignore[attr-defined]
        for name, bound in list(rank.programs.items()):
            segments = tuple(tuple((_timed(f, getattr(f, "__name__", repr(f)), timings, enabled), args)
                                   for f, args in segment) for segment in bound.segments)
            rank.programs[name] = dataclasses.replace(bound, segments=segments)
    ids = bench_prompt_ids(prompt_tokens)
    figures: dict[str, Any] = {}
    try:
        for batch in batches:
            driver = RawLanes(model)
            actives = driver.admit([GenerationRequest(ids, steps + 5, SamplingParameters(logprobs=-1), eos_ids=(-1,))
                                    for _ in range(batch)], list(range(batch)))
            for active in actives:
                driver.prefill(active)
            for _ in range(4):                               # warm-up rounds
                driver.decode_round(actives)
            timings.clear()
            enabled[0] = True
            start = time.perf_counter()
            for _ in range(steps):
                driver.decode_round(actives)
            wall = time.perf_counter() - start
            enabled[0] = False
            driver.pages.give_back(page for active in actives for page in active.pages)
            kernels = _kernel_figures(timings, steps)
            in_nodes = sum(seconds for seconds, _, _ in timings.values())
            figures[str(batch)] = {"steps": steps, "step_ms": 1e3 * wall / steps, "tokens_per_s": batch * steps / wall,
                                   "nodes_ms_per_step": 1e3 * in_nodes / steps,
                                   "outside_nodes_ms_per_step": 1e3 * (wall - in_nodes) / steps, "kernels": kernels}
        if prefill_tokens:
            prompt = bench_prompt_ids(prefill_tokens)
            timed_prefill(model, [prompt])                   # warm-up
            timings.clear()
            enabled[0] = True
            cpu = time.process_time()
            walls = [timed_prefill(model, [prompt]) for _ in range(prefill_runs)]
            cpu = time.process_time() - cpu
            enabled[0] = False
            figures["prefill"] = {"tokens": prefill_tokens, "steps": prefill_runs, "step_ms": 1e3 * sum(walls) / prefill_runs,
                                  "runs_ms": [1e3 * w for w in walls], "process_cpu_ms_per_step": 1e3 * cpu / prefill_runs,
                                  "tokens_per_s": prefill_tokens * prefill_runs / sum(walls),
                                  "nodes_ms_per_step": 1e3 * sum(t[0] for t in timings.values()) / prefill_runs,
                                  "kernels": _kernel_figures(timings, prefill_runs)}
    finally:
        model.close()
        bootstrap.close()
    return figures, ran


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--core", type=Path, default=DEFAULT_CORE)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--prefill-tokens", type=int, default=0,
                        help="also profile one PREFILL step of this many prompt ids (0: none)")
    parser.add_argument("--prefill-runs", type=int, default=3)
    parser.add_argument("--name", default="cpu_step_profile.json", help="the JSON file's name in the output folder")
    parser.add_argument("--isa", choices=["auto", "avx512", "avx2", "host"],
                        help="the ISA path the kernels are compiled for (HELIOS_CPU_ISA; default: inherited, else auto)")
    parser.add_argument("--activations", choices=["f32", "q8"],
                        help="block-weight products' activations (the CPU executor's option; default: its default)")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    if args.isa:
        os.environ["HELIOS_CPU_ISA"] = args.isa        # read when the executor package is first imported (below)
    before = os.getloadavg()
    figures, activations = profile(args.core, args.batches, args.steps, args.threads, args.prompt_tokens,
                                   args.activations, args.prefill_tokens, args.prefill_runs)
    from bench.cpu_executor import isa_figures, host_description, isa_line

    host, path = host_description(), isa_figures()
    summary = {"threads": args.threads, "prompt_tokens": args.prompt_tokens, "host": host, **path,
               "activations": activations, "batches": figures,
               "load_average": {"before": [round(x, 2) for x in before],
                                "after": [round(x, 2) for x in os.getloadavg()]},
               "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    print(isa_line(host, path["isa_path"]) + f", {activations} activations")
    for batch, f in figures.items():
        if batch == "prefill":
            print(f"prefill of {f['tokens']}: {f['step_ms']:.1f} ms/step ({f['tokens_per_s']:.1f} tok/s; runs "
                  + " / ".join(f"{ms:.0f}" for ms in f["runs_ms"]) + f"), process CPU {f['process_cpu_ms_per_step']:.1f} "
                  f"ms/step, nodes {f['nodes_ms_per_step']:.1f}")
        else:
            print(f"b={batch}: {f['step_ms']:.1f} ms/step ({f['tokens_per_s']:.1f} tok/s), nodes "
                  f"{f['nodes_ms_per_step']:.1f}, outside nodes {f['outside_nodes_ms_per_step']:.2f}")
        for name, k in f["kernels"].items():
            if k["ms_per_step"] >= 0.05:
                print(f"  {name:28s} {k['ms_per_step']:7.2f} ms/step  {k['calls_per_step']:5.1f} calls  "
                      f"{k['cpu_ms_per_step']:7.2f} ms CPU (calling thread)")
    print(f"load average {summary['load_average']['before']} -> {summary['load_average']['after']}")
    written = output_dir(args.out, args.results, "cpu") / args.name
    written.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {written}")


if __name__ == "__main__":
    main()
