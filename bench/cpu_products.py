"""The CPU executor's weight products on each ISA path this host runs, one thread, CPU time.

Run:  python -m bench.cpu_products [--isa avx512 avx2] [--rounds 3] [--activations f32 q8]

Times the compiled products (executors/cpu/block_products.py, f16_products.py) at SmolLM2-135M's
shapes (q/k/v [960, 576], output [576, 576], gate/up [3072, 576], down [576, 1536] in Q4_1 and
F16, the LM head [49152, 576] in Q8_0) for 1 and 8 tokens, the block products with f32 and with q8
activations (kernel_abi/activations.py; rows "... q8"), each path in its own child process
(numba compiles for one target a process: executors/cpu/isa.py), the paths alternating for
`rounds`. A figure is the calling thread's CPU time per call (time.thread_time over `repeats`
calls, the median of 5 such runs): other jobs on a shared machine delay a run but add little
to its CPU time, so paths measured in one run compare. `--isa avx2` on an AVX-512 host is the
AVX2 code path on this core (same caches and memory), not an AVX2-only machine. Writes
cpu_products.json to the CPU's folder (bench/harness.py: var/bench/<cpu>/, --results
bench/results/<cpu>/, or --out DIR).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

import numpy as np

from bench.harness import add_output_arguments, output_dir

# (name, rows, columns, layout) of SmolLM2-135M's products
SHAPES = (("qkv", 960, 576, "Q4_1"), ("output", 576, 576, "Q4_1"), ("gate_up", 3072, 576, "Q4_1"),
          ("down", 576, 1536, "Q4_1"), ("head", 49152, 576, "Q8_0"),
          ("gate_up", 3072, 576, "F16"), ("down", 576, 1536, "F16"))


def _weights(layout: str, m: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random weights of a [m, k] matrix: f16 bits, or blocks with small scales."""
    from helios_backend.kernel_abi import blocks

    if layout == "F16":
        return (rng.standard_normal(m * k) * 0.05).astype(np.float16).view(np.uint16)
    block = blocks.BY_NAME[layout]
    data = rng.integers(0, 256, m * k // 32 * block.block_bytes, dtype=np.uint8).reshape(-1, block.block_bytes)
    data[:, 0:2] = np.float16(0.01).reshape(1, 1).view(np.uint8)
    if block is blocks.Q4_1:
        data[:, 2:4] = np.float16(-0.05).reshape(1, 1).view(np.uint8)
    return data.reshape(-1)


def _cpu_us(call: Callable[[], None], repeats: int) -> list[float]:
    call()                                        # compile or load, and warm the caches
    runs = []
    for _ in range(5):
        start = time.thread_time()
        for _ in range(repeats):
            call()
        runs.append(1e6 * (time.thread_time() - start) / repeats)
    return runs


def measure(tokens: Sequence[int], activations: Sequence[str]) -> dict[str, Any]:
    """This process's path and the CPU microseconds per call of every shape and token count; block
    products once per activations representation (q8: the activations' quantization included, as
    the executor makes it once a call)."""
    from helios_backend.executors.cpu import isa
    from helios_backend.executors.cpu.block_products import block_linear_rows, quantize_rows
    from helios_backend.kernel_abi.activations import Q8_BLOCK_BYTES
    from helios_backend.executors.cpu.f16_products import linear_rows
    from helios_backend.kernel_abi import blocks

    rng = np.random.default_rng(0)
    sums = np.zeros(16, dtype=np.float32)
    figures: dict[str, Any] = {}
    for name, m, k, layout in SHAPES:
        weight = _weights(layout, m, k, rng)
        for n in tokens:
            x = rng.standard_normal(n * k).astype(np.float32)
            out = np.zeros(n * m, dtype=np.float32)
            quantized = np.zeros(n * k // 32 * Q8_BLOCK_BYTES, dtype=np.int8)
            calls: dict[str, Callable[[], None]] = {}
            if layout == "F16":
                calls[""] = lambda: linear_rows(out, x, weight, n, k, m, False, 0, m, 0)
            else:
                code = blocks.BY_NAME[layout].code
                if "f32" in activations:
                    calls[""] = lambda: block_linear_rows(out, x, weight, code, n, k, m, False, 0, m, sums)
                if "q8" in activations:
                    def q8() -> None:
                        quantize_rows(quantized, x, n, k)
                        block_linear_rows(out, quantized, weight, code, n, k, m, False, 0, m, sums)
                    calls[" q8"] = q8
            for suffix, call in calls.items():
                runs = _cpu_us(call, max(2, int(2e7 // (m * k * max(n, 2)))))
                figures[f"{name} {layout} [{m}, {k}] n={n}{suffix}"] = {"median_us": statistics.median(runs),
                                                                        "runs_us": runs}
    path = isa.active()
    return {"isa_path": path.name, "vector_bits": path.vector_bits, "activations": list(activations),
            "products": figures}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--isa", nargs="+", help="ISA paths to compare (default: every path this host runs)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--activations", nargs="+", choices=["f32", "q8"], default=["f32", "q8"],
                        help="block products' activations to time (q8 rows are named so)")
    parser.add_argument("--name", default="cpu_products.json", help="the JSON file's name in the output folder")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.tokens, args.activations)))
        return
    from bench.cpu_executor import host_description, isa_line

    host = host_description()
    paths = args.isa or host["executable_isa_paths"]
    before = os.getloadavg()
    rounds: dict[str, list[dict[str, Any]]] = {path: [] for path in paths}
    for _ in range(args.rounds):
        for path in paths:
            done = subprocess.run([sys.executable, "-m", "bench.cpu_products", "--child", "--tokens",
                                   *map(str, args.tokens), "--activations", *args.activations],
                                  env=dict(os.environ, HELIOS_CPU_ISA=path),
                                  check=True, capture_output=True, text=True)
            rounds[path].append(json.loads(done.stdout.strip().splitlines()[-1]))
    shapes = list(rounds[paths[0]][0]["products"])
    table = {path: {shape: statistics.median(r["products"][shape]["median_us"] for r in runs) for shape in shapes}
             for path, runs in rounds.items()}
    lines = [isa_line(host, paths),
             "CPU us per call, one thread, median over rounds: " + " | ".join(paths)]
    for shape in shapes:
        cells = [f"{table[path][shape]:9.1f}" for path in paths]
        ratio = f"  x{table[paths[-1]][shape] / table[paths[0]][shape]:.2f}" if len(paths) > 1 else ""
        lines.append(f"  {shape:34s}" + " ".join(cells) + ratio)
    text = "\n".join(lines)
    print(text)
    summary = {"host": host, "paths": paths, "activations": args.activations, "median_us": table, "rounds": rounds,
               "load_average": {"before": [round(x, 2) for x in before],
                                "after": [round(x, 2) for x in os.getloadavg()]},
               "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    written = output_dir(args.out, args.results, "cpu") / args.name
    written.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {written}")


if __name__ == "__main__":
    main()
