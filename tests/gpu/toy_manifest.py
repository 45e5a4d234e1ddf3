"""A synthetic execution manifest over tests/gpu/toy_kernels.cu, for executor tests.

It exercises every executor mechanism without a prepared model: weights from a resource,
a tuning producer, staging in / completion out, scratch ping-pong, a cache write, PDL,
all-reduce nodes (world_size > 1), and chains of N nodes for overhead measurements.

Staging frame (bytes): [0:4) sequence i32 | [4:8) frame i32 | [64:64+4n) x f32[n]
Completion (i32 words): sequence, frame, then y[i] as f32 bits
"""
from __future__ import annotations

import pathlib
import shutil
import subprocess
import tempfile
from typing import Mapping

import numpy as np

from helios_proto import contract_pb2, manifest_pb2

HERE = pathlib.Path(__file__).resolve().parent
SOURCE = HERE / "toy_kernels.cu"
X_OFFSET = 64
P = manifest_pb2
PTR, I32, I64, F32 = P.PARAM_KIND_POINTER, P.PARAM_KIND_I32, P.PARAM_KIND_I64, P.PARAM_KIND_F32
KERNELS = {  # id -> (params, pdl)
    "toy_begin": ((PTR, PTR), True),
    "toy_axpb": ((PTR, PTR, PTR, F32, F32, I32), True),
    "toy_add_tuned": ((PTR, PTR, I32), True),
    "toy_fill": ((PTR, F32, I32), False),
    "toy_finish": ((PTR, PTR, I64, PTR, I32), True),
    "toy_nop": ((PTR, I32), True),
}
THREADS = 128
CACHE_PAGE = 3          # the page toy_finish writes


def compile_cubin(out_dir: pathlib.Path | None = None, nvcc: str = "nvcc") -> bytes:
    """sm_90a cubin of the toy kernels (nvcc 13.0 here and on the device machine)."""
    if shutil.which(nvcc) is None:
        raise FileNotFoundError("nvcc not found")
    out_dir = out_dir or pathlib.Path(tempfile.mkdtemp(prefix="toy"))
    target = out_dir / "toy.cubin"
    subprocess.run([nvcc, "-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-O3",
                    "-o", str(target), str(SOURCE)], check=True)
    return target.read_bytes()


def _ptr(buffer: str, offset: int = 0) -> P.Arg:
    return P.Arg(pointer=P.BufferRef(buffer=buffer, byte_offset=offset))


def _node(kernel: str, n: int, *args: P.Arg, label: str = "") -> P.Node:
    blocks = max(1, -(-n // THREADS))
    return P.Node(kind=P.NODE_KIND_KERNEL, kernel=kernel, grid=P.Dim3(x=blocks, y=1, z=1),
                  block=P.Dim3(x=THREADS, y=1, z=1), args=list(args), label=label or kernel)


def chain_program(name: str, rank: int, n: int, layers: int, world_size: int) -> P.Program:
    """x -> (2x + 1 + w) -> layers-1 times (0.5y + 0.25 + w) -> + tuned -> [all-reduce] -> out."""
    nodes = [_node("toy_begin", 1, _ptr("staging"), _ptr("completion"))]
    src, dst = _ptr("staging", X_OFFSET), 0
    for layer in range(layers):
        a, b = (2.0, 1.0) if layer == 0 else (0.5, 0.25)
        nodes.append(_node("toy_axpb", n, src, _ptr("weights"), _ptr("scratch", dst * 4 * n),
                           P.Arg(f32=a), P.Arg(f32=b), P.Arg(i32=n), label=f"layer{layer}.axpb"))
        src, dst = _ptr("scratch", dst * 4 * n), 1 - dst
    nodes.append(_node("toy_add_tuned", n, src, _ptr("tuned"), P.Arg(i32=n)))
    if world_size > 1:
        nodes.append(P.Node(kind=P.NODE_KIND_ALL_REDUCE, args=[src, P.Arg(i64=n), P.Arg(i32=contract_pb2.DTYPE_F32)],
                            label="all_reduce"))
    nodes.append(_node("toy_finish", n, src, _ptr("cache"), P.Arg(i64=CACHE_PAGE), _ptr("completion"),
                       P.Arg(i32=n)))
    return P.Program(name=name, operation=contract_pb2.OPERATION_DECODE, rank=rank,
                     capacity=contract_pb2.Capacity(rows=1, tokens=1), nodes=nodes)


def nop_program(name: str, rank: int, count: int, grid: int) -> P.Program:
    nodes = [_node("toy_begin", 1, _ptr("staging"), _ptr("completion"))]
    for i in range(count):
        node = _node("toy_nop", grid * THREADS, _ptr("scratch"), P.Arg(i32=i), label=f"nop{i}")
        nodes.append(node)
    return P.Program(name=name, operation=contract_pb2.OPERATION_DECODE, rank=rank,
                     capacity=contract_pb2.Capacity(rows=1, tokens=1), nodes=nodes)


def build(n: int = 1000, world_size: int = 1, chains: Mapping[str, int] = {"chain": 6},
          nops: Mapping[str, tuple[int, int]] = {}, pdl: bool = True,
          frame_nbytes: int = 8192) -> P.ExecutionManifest:
    m = P.ExecutionManifest(abi="toy", world_size=world_size, request_slots=1, max_pages_per_row=4)
    kernels = [P.Kernel(id=k, symbol=k, params=params, num_warps=THREADS // 32,
                        programmatic_dependent_launch=flag and pdl)
               for k, (params, flag) in KERNELS.items()]
    m.modules.append(P.KernelModule(resource="toy.cubin", arch="sm_90a", toolchain="nvcc 13.0",
                                    kernels=kernels))
    f32 = contract_pb2.DTYPE_F32
    for rank in range(world_size):
        m.buffers.extend([
            P.Buffer(name="weights", rank=rank, kind=P.BUFFER_KIND_WEIGHT, dtype=f32, shape=[n], nbytes=4 * n,
                     alignment=256, weight=P.WeightSource(resource=f"toy.weights.r{rank}", byte_offset=0)),
            P.Buffer(name="tuned", rank=rank, kind=P.BUFFER_KIND_TUNED, dtype=f32, shape=[n], nbytes=4 * n),
            P.Buffer(name="staging", rank=rank, kind=P.BUFFER_KIND_STAGING, dtype=contract_pb2.DTYPE_U8,
                     shape=[frame_nbytes], nbytes=frame_nbytes),
            P.Buffer(name="completion", rank=rank, kind=P.BUFFER_KIND_COMPLETION, dtype=contract_pb2.DTYPE_I32,
                     shape=[2 + n], nbytes=4 * (2 + n)),
            P.Buffer(name="scratch", rank=rank, kind=P.BUFFER_KIND_SCRATCH, dtype=f32, shape=[2, n], nbytes=8 * n),
            P.Buffer(name="cache", rank=rank, kind=P.BUFFER_KIND_CACHE, dtype=f32, shape=[n], nbytes=4 * n),
        ])
        for name, layers in chains.items():
            m.programs.append(chain_program(name, rank, n, layers, world_size))
        for name, (count, grid) in nops.items():
            m.programs.append(nop_program(name, rank, count, grid))
        m.tuning.append(P.Program(name="tune", rank=rank, nodes=[
            _node("toy_fill", n, _ptr("tuned"), P.Arg(f32=0.5), P.Arg(i32=n))]))
    m.transport.CopyFrom(P.Transport(frames=2, staging_buffer="staging", frame_nbytes=frame_nbytes,
                                     completion_buffer="completion", completion_nbytes=4 * (2 + n), destinations=[
                                         P.Destination(name="transport.header", dtype=contract_pb2.DTYPE_I32,
                                                       byte_offset=0, elements=2),
                                         P.Destination(name="x", dtype=f32, byte_offset=X_OFFSET, elements=n)]))
    return m


def weights(n: int, rank: int) -> np.ndarray:
    return (np.arange(n, dtype=np.float32) * 0.001 - 0.25 * rank).astype(np.float32)


def resources(cubin: bytes, n: int, world_size: int = 1) -> dict[str, bytes]:
    found = {"toy.cubin": cubin}
    for rank in range(world_size):
        found[f"toy.weights.r{rank}"] = weights(n, rank).tobytes()
    return found


def reference(x: np.ndarray, layers: int, world_size: int = 1) -> np.ndarray:
    """Expected output (float64 math; compare with a relative tolerance)."""
    n = x.size
    total = np.zeros(n)
    for rank in range(world_size):
        w = weights(n, rank).astype(np.float64)
        y = 2.0 * x.astype(np.float64) + 1.0 + w
        for _ in range(layers - 1):
            y = 0.5 * y + 0.25 + w
        total += y + 0.5 * np.arange(n)
    return total


def pack(frame: np.ndarray, x: np.ndarray) -> None:
    """Write x; the executor writes the [sequence, frame] header itself at launch."""
    frame[X_OFFSET:X_OFFSET + x.nbytes] = x.view(np.uint8)
