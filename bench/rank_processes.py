"""Tensor-parallel ranks as processes against ranks as threads: the same outputs, and what a step costs.

    python -m bench.rank_processes --bundles DIR [--out DIR | --results] [--executor cuda] [--steps 64] [--timed 200]

Needs the TP=1 and TP=2 bundles of tests/gpu/tensor_parallel.py (`build` there) and, for the
CUDA executor, two GPUs. Two parts, one report:

  1. equality: tests/gpu/tensor_parallel.py's run with the TP=2 core's rank 1 as a helios-rank
     process on device 1 (rank 0 on device 0, in this process): every program both cores
     record compared with TP=1, greedy --steps steps at batches 1 and 8, the ranks' state read
     back over the rank link, and the rank process's exit code after rank 0 closed it;
  2. per-step cost: the TP=2 core loaded in thread mode (both ranks in this process), then in
     process mode; at batch 1 and 64, --timed decode rounds after prefill (each round packs,
     launches, waits and reads its completion: RawLanes.decode_round); the median
     round in µs per mode and the ratio process / thread, measured in the same run.

Prints both tables and writes rank_processes.json (and tensor_parallel.json) to the device's
folder (bench/harness.py: the GPU's with the cuda executor, else the CPU's). CPU dry run (both parts on the
numpy executor; rank 1 then sums through the rank link, not NCCL):

    python tests/gpu/tensor_parallel.py build --no-kernels --out /tmp/tpb
    python -m bench.rank_processes --bundles /tmp/tpb --executor numpy --steps 8 --timed 8 --out /tmp/rp
"""
from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

from bench.harness import add_output_arguments, output_dir
from tests.gpu import tensor_parallel as tp

BATCHES = (1, 64)


def step_costs(bundle: pathlib.Path, executor: str, rank_peers: str, workdir: pathlib.Path, timed: int) -> dict:
    """Median µs of one decode round of the TP=2 core per batch, in one rank mode."""
    from helios_backend.lockstep.generator import GenerationRequest
    from helios_backend.lockstep.raw_lanes import RawLanes

    model, prompts = tp.load_model(bundle, executor, True, workdir, rank_peers)
    out: dict = {}
    try:
        vocab = model.contract.model.vocabulary.sampled_tokens
        for batch in BATCHES:
            driver = RawLanes(model)
            chosen = [prompts[i % len(prompts)] for i in range(batch)]
            requests = [GenerationRequest(list(p), timed + 8, eos_ids=(vocab - 1,)) for p in chosen]
            actives = driver.admit(requests, list(range(batch)))
            for active in actives:
                driver.prefill(active)
            for _ in range(3):                                 # warm
                driver.decode_round(actives)
            samples = []
            for _ in range(timed):
                started = time.perf_counter_ns()
                driver.decode_round(actives)
                samples.append((time.perf_counter_ns() - started) / 1e3)
            driver.pages.give_back(p for a in actives for p in a.pages)
            out[batch] = statistics.median(samples)
            print(f"{rank_peers:9s} batch {batch:3d}: {out[batch]:10.1f} µs per decode round", flush=True)
    finally:
        model.close()
        out["rank_exit_codes"] = tp.stop_rank_processes()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundles", default=None, help="folder holding tp1.bin and tp2.bin (default .carry_model)")
    add_output_arguments(parser)
    parser.add_argument("--executor", default="cuda", choices=["cuda", "numpy"])
    parser.add_argument("--steps", type=int, default=64, help="greedy steps of the equality part")
    parser.add_argument("--batches", default="1,8", help="greedy batches of the equality part")
    parser.add_argument("--timed", type=int, default=200, help="timed decode rounds per batch and mode")
    args = parser.parse_args(argv)
    out = output_dir(args.out, args.results, "gpu" if args.executor == "cuda" else "cpu")
    from tests.gpu.model_bundle import BUNDLE_DIR

    bundles = pathlib.Path(args.bundles or BUNDLE_DIR)
    started = time.time()
    code = tp.run(argparse.Namespace(out=str(out), bundles=str(bundles), executor=args.executor, steps=args.steps,
                                     batches=args.batches, only="", greedy_only=False, no_core=False,
                                     rank_peers="processes"))
    equality = json.loads((out / "tensor_parallel.json").read_text())
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="helios-rank-bench-"))
    try:
        costs = {mode: step_costs(bundles / tp.bundle_name(2), args.executor, mode, workdir, args.timed)
                 for mode in ("threads", "processes")}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    ratios = {batch: costs["processes"][batch] / costs["threads"][batch] for batch in BATCHES}
    report = {"executor": args.executor, "equality": equality, "step_us": costs,
              "process_over_thread": ratios, "seconds": round(time.time() - started, 1)}
    (out / "rank_processes.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"\n{'decode round':14s} {'threads µs':>11s} {'processes µs':>13s} {'processes / threads':>20s}")
    for batch in BATCHES:
        print(f"batch {batch:<8d} {costs['threads'][batch]:11.1f} {costs['processes'][batch]:13.1f} "
              f"{ratios[batch]:20.3f}")
    print(f"equality: {'PASS' if code == 0 else 'FAIL'} ({sum(r['pass'] for r in equality['results'])}/"
          f"{len(equality['results'])} cases); {report['seconds']} s")
    return code


if __name__ == "__main__":
    sys.exit(main())
