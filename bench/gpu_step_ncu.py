"""One decode step of the prepared model on the CUDA executor, for Nsight Compute.

    ncu --clock-control none --graph-profiling node --kernel-name regex:"<kernels>" \
        --launch-skip 150 --launch-count 5 --section SpeedOfLight --section LaunchStats \
        --section Occupancy python3 -m bench.gpu_step_ncu

Admits one request, prefills 16 tokens (one launch of every layer kernel per layer: the
--launch-skip above passes them), then runs one decode step at --batch rows. Needs the
model bundle (tests/gpu/model_bundle.py); HELIOS_RANDOM_WEIGHTS=1 is fine for timing.
"""
from __future__ import annotations

import argparse

from bench.gpu_decode import Bench
from helios_backend.executors.cuda_executor import CudaExecutor, CudaExecutorOptions
from helios_proto import contract_pb2 as C
from tests.gpu.executor_model import ExecutorModel
from tests.gpu.model_bundle import load_bundle


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    contract, manifest, read = load_bundle()
    executor = CudaExecutor(manifest, read, CudaExecutorOptions(cache_pages=4096),
                            graphs=[g for g in contract.model.graphs if g.rank == 0])
    model = ExecutorModel(contract, manifest, executor)
    bench = Bench(model)
    lanes = bench.admit(list(range(args.batch)), 16, 16)
    program = model.program(C.OPERATION_DECODE, args.batch, args.batch)
    model.packer.pack(program, 0, lanes)
    executor.launch(program, 0)
    executor.wait(0)
    print(f"decode step {program} done")
    executor.close()


if __name__ == "__main__":
    main()
