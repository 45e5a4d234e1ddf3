"""Device script: the CUDA executor on the synthetic toy manifest (no model needed).

Checks (printed as a pass/fail table): results equal the float64 reference for steps that
alternate frames, the cache and tuned buffers hold what the graphs wrote, serving makes no
forbidden driver calls, PDL and non-PDL graphs agree; with --world-size 2, the all-reduce
node sums across ranks. Then measures step round trip, pipelined step time, host time and
GPU time for chains of N no-op nodes (PDL on/off), and the device copy bandwidth.

    python tests/gpu/executor_smoke.py [--world-size 2] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import timing  # noqa: E402
import toy_manifest as toy  # noqa: E402
from helios_backend.executors.cuda.driver import CountingDriver, check, load_driver  # noqa: E402
from helios_backend.executors.cuda_executor import CudaExecutor, CudaExecutorOptions  # noqa: E402

N = 1000
LAYERS = 6
NOP_COUNTS = (1, 150, 300)


def correctness(world_size: int, pdl: bool, transport: str, cubin: bytes, results: dict) -> None:
    counting = CountingDriver(load_driver())
    manifest = toy.build(n=N, world_size=world_size, chains={"chain": LAYERS}, pdl=pdl)
    tag = f"ws{world_size}.{'pdl' if pdl else 'nopdl'}.{transport}"
    started = time.perf_counter()
    executor = CudaExecutor(manifest, toy.resources(cubin, N, world_size).__getitem__,
                            CudaExecutorOptions(cache_pages=8, transport=transport), driver=counting)
    results[f"{tag}.startup_s"] = round(time.perf_counter() - started, 3)
    results[f"{tag}.node_count"] = executor.node_count("chain")
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal(N).astype(np.float32) for _ in range(8)]
    counting.counting = True
    outs = []
    # two frames in flight: pack and launch frame f+1 before waiting for frame f
    for step, x in enumerate(xs):
        frame = step % 2
        if step >= 2:
            outs.append((step - 2, executor.wait(frame).copy()))
        toy.pack(executor.staging(frame), x)
        executor.launch("chain", frame)
    for step in (len(xs) - 2, len(xs) - 1):
        outs.append((step, executor.wait(step % 2).copy()))
    counting.counting = False
    ok = True
    worst = 0.0
    for step, words in outs:
        expected = toy.reference(xs[step], LAYERS, world_size)
        got = words[2:2 + N].view(np.float32).astype(np.float64)
        worst = max(worst, float(np.max(np.abs(got - expected) / (np.abs(expected) + 1e-6))))
        ok &= words[0] == step and words[1] == step % 2
    ok &= worst < 1e-5
    results[f"{tag}.steps_match_reference"] = bool(ok)
    results[f"{tag}.max_rel_err"] = worst
    cache = executor.read_buffer("cache").view(np.float32).reshape(-1, N)
    results[f"{tag}.cache_page_written"] = bool(np.allclose(
        cache[toy.CACHE_PAGE], toy.reference(xs[-1], LAYERS, world_size), rtol=1e-5))
    results[f"{tag}.tuned_filled"] = bool(np.allclose(executor.read_buffer("tuned").view(np.float32), 0.5 * np.arange(N)))
    forbidden = counting.forbidden_calls()
    results[f"{tag}.serve_calls"] = dict(counting.calls)
    results[f"{tag}.no_forbidden_calls"] = not forbidden
    if world_size > 1:
        results[f"{tag}.rank1_equals_rank0"] = bool(np.array_equal(executor.read_buffer("cache", 1),
                                                                   executor.read_buffer("cache", 0)))
    executor.close()


def overheads(cubin: bytes, results: dict) -> None:
    driver = load_driver()
    for pdl, transport in ((True, "kernel"), (True, "memcpy"), (False, "kernel")):
        nops = {f"nop{c}x{g}": (c, g) for c in NOP_COUNTS for g in (1, 132)}
        manifest = toy.build(n=N, chains={}, nops=nops, pdl=pdl)
        executor = CudaExecutor(manifest, toy.resources(cubin, N).__getitem__,
                                CudaExecutorOptions(cache_pages=1, transport=transport))
        x = np.ones(N, np.float32)

        def pack(frame: int, step: int) -> None:
            toy.pack(executor.staging(frame), x)

        for name in nops:
            tag = f"{name}.{'pdl' if pdl else 'nopdl'}.{transport}"
            results[f"{tag}.round_trip_us"] = timing.round_trip_us(executor, name, 300, pack)
            step_us, host_us = timing.pipelined_us(executor, name, 300, pack)
            results[f"{tag}.pipelined_step_us"] = step_us
            results[f"{tag}.host_us"] = host_us
            results[f"{tag}.gpu_us"] = timing.gpu_us(driver, executor, name, 200)
        if pdl and transport == "kernel":
            profile = executor.profile_nodes("nop150x132", repeats=10)
            results["nop150x132.profile_us"] = [round(t, 2) for _, _, t in profile[:6]]
        executor.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--skip-bench", action="store_true")
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    driver = load_driver()
    check(driver.cuInit(0))
    results: dict = {"driver_version": check(driver.cuDriverGetVersion()),
                     "devices": check(driver.cuDeviceGetCount())}
    cubin = toy.compile_cubin(out)
    checks = []
    for world_size in sorted({1, args.world_size}):
        for pdl in (True, False):
            for transport in ("kernel", "memcpy"):
                try:
                    correctness(world_size, pdl, transport, cubin, results)
                except Exception as error:  # report and go on: this script's job is the table
                    results[f"ws{world_size}.{'pdl' if pdl else 'nopdl'}.{transport}.error"] = repr(error)
    if not args.skip_bench:
        try:
            overheads(cubin, results)
            device = check(driver.cuDeviceGet(0))
            context = check(driver.cuDevicePrimaryCtxRetain(device))
            check(driver.cuCtxSetCurrent(context))
            results["copy_bandwidth_GBps"] = timing.copy_bandwidth_gbs(driver)
        except Exception as error:
            results["bench.error"] = repr(error)
    (out / "executor_smoke.json").write_text(json.dumps(results, indent=1, default=str))
    for key, value in results.items():
        if isinstance(value, bool):
            checks.append((key, "PASS" if value else "FAIL"))
    print(json.dumps({k: v for k, v in results.items() if not isinstance(v, bool)}, default=str))
    print(f"{'check':60s} result")
    for key, verdict in checks:
        print(f"{key:60s} {verdict}")


if __name__ == "__main__":
    main()
