"""The CPU executor: the numpy executor's replay with compiled kernels for the hot kernel ids.

It replays the same recorded programs through the same binding (numpy_rank.RankReplay: one
arena per rank, nodes resolved to (function, args) at load, lockstep all-reduces), with two
differences, both decided at load:

  * F16 weight buffers are kept as loaded, in their declared layout (no f32 shadow: half the
    resident weight bytes of the numpy executor's f16 + f32 pair, and a decode step streams
    each weight byte once); block weights likewise; F16 cache planes keep their f16
    (widen_f16_cache=False), widened in registers by the compiled attention;
  * the kernel ids that dominate a step (projections, attention, embedding, LM head) run
    CpuKernels' compiled implementations (executors/cpu/), on `threads` threads (the calling
    thread and threads - 1 helpers sharing chunks of each large call, cpu/sharing.py); every
    other id keeps its numpy reference. Once everything is compiled, LLVM's code pages leave
    the resident set (cpu/residency.py).

The numpy executor stays the conformance oracle: tests/test_cpu_executor.py compares logits
per operation and variant, and greedy output over 64 steps (docs/cpu-executor.md).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Iterable, Optional, Sequence

from helios_proto import contract_pb2 as C
from helios_proto import manifest_pb2 as M

from helios_backend.executors.cpu.warm_up import warm_up
from helios_backend.executors.cpu.kernels import SHARED_WORK_MACS, Capacity, CpuKernels
from helios_backend.executors.cpu.residency import release_free_heap, release_library_pages
from helios_backend.executors.numpy_executor import NumpyExecutor, NumpyExecutorOptions, Reduce
from helios_backend.executors.base import ResourceReader
from helios_backend.kernel_abi import abi
from helios_backend.kernel_abi.activations import check as check_activations

__all__ = ["CpuExecutor", "CpuExecutorOptions"]


@dataclass(frozen=True)
class CpuExecutorOptions:
    cache_pages: int = 64                         # physical pages backing each CACHE plane (every rank)
    programs: Optional[frozenset[str]] = None     # programs to load; None: every serving program
    threads: int = 2                              # the calling thread + helpers; capped at the usable cores
    share_above: int = SHARED_WORK_MACS           # multiply-adds from which one call is shared over threads
    # block-weight products' activations (kernel_abi/activations.py): "q8" (8-bit blocks and integer dot
    # products, as llama.cpp's CPU kernels; a token's product is the same bits whatever the tokens
    # beside it, so batching, drafting and prefill chunking leave an answer unchanged) or "f32".
    # None: `default_activations` of the core
    activations: Optional[str] = None

    def __post_init__(self) -> None:
        if self.activations is not None:
            check_activations(self.activations)
        if self.cache_pages < 1:
            raise ValueError("cache_pages must be >= 1")
        if self.threads < 1:
            raise ValueError("threads must be >= 1")
        if self.share_above < 1:
            raise ValueError("share_above must be >= 1")


def default_activations(manifest: M.ExecutionManifest) -> str:
    """The activations of a core whose options name none: q8, but f32 for a tensor-parallel core.

    Its ranks split K of the row-parallel products (attention output, down) and the all-reduce adds
    their partial sums, which rounds otherwise than one rank's block-by-block sum; with q8 a rounding
    difference can flip a quantization step of the next product and, some steps on, a token (the
    tp2 core of SmolLM2 sampled another 7th token than the tp1 core). With f32 the two differ by
    f32 rounding only, so a tensor-parallel core answers as the one-rank core with f32 activations
    (docs/cpu-executor.md)."""
    return "f32" if manifest.world_size > 1 else "q8"


def program_capacity(programs: Iterable[M.Program]) -> Capacity:
    """The largest tokens, rows, product width, heads and context that the programs' nodes pass."""
    tokens = rows = heads = context = 1
    width = 1
    for program in programs:
        for node in program.nodes:
            spec = abi.KERNELS.get(node.kernel)
            if node.kind != M.NODE_KIND_KERNEL or spec is None:
                continue
            values = {p.name: getattr(a, a.WhichOneof("value") or "i32")
                      for p, a in zip(spec.params, node.args) if not p.is_pointer}
            tokens = max(tokens, int(values.get("tokens", 1)))
            rows = max(rows, int(values.get("rows", 1)))
            heads = max(heads, int(values.get("q_heads", 1)))
            context = max(context, int(values.get("pages_per_row", 1)) * int(values.get("page_tokens", 1)))
            widths = [values.get(name, 1) for name in ("dim", "in_dim", "out_dim")]
            widths.append(2 * values.get("ffn_dim", 0))
            widths.append((values.get("q_heads", 0) + 2 * values.get("kv_heads", 0)) * values.get("head_dim", 0))
            width = max(width, *(int(w) for w in widths))
    return Capacity(tokens=tokens, rows=rows, width=width, heads=heads, context=context)


class CpuExecutor(NumpyExecutor):
    """Executor protocol on the CPU with compiled kernels; the numpy executor's methods and errors."""

    def __init__(self, manifest: M.ExecutionManifest, read_resource: ResourceReader,
                 options: CpuExecutorOptions = CpuExecutorOptions(), *,
                 local_ranks: Optional[Sequence[int]] = None, reduce: Optional[Reduce] = None,
                 graphs: Sequence[C.GraphContract] = ()) -> None:
        """`local_ranks`, `reduce` and `graphs`: as the numpy executor's."""
        threads = min(options.threads, len(os.sched_getaffinity(0)))   # the cores this process may use
        activations = options.activations or default_activations(manifest)
        options = replace(options, activations=activations)
        warm_up(activations)       # compile (or load from numba's cache) before the first step
        wanted = options.programs if options.programs is not None else {
            p.name for p in manifest.programs if p.rank == 0}
        self.kernels = CpuKernels(program_capacity(p for p in manifest.programs if p.name in wanted), threads,
                                  options.share_above, activations)
        self.cpu_options = options
        # F16 cache planes keep their declared dtype (half the bytes a decode step's attention streams,
        # and the cached values a device executor holds); the compiled kernels widen them in registers
        super().__init__(manifest, read_resource,
                         NumpyExecutorOptions(cache_pages=options.cache_pages, programs=options.programs,
                                              blas_threads=1, widen_f16_cache=False,
                                              activations=activations),
                         implementations=self.kernels.table, weight_shadows=False,
                         local_ranks=local_ranks, reduce=reduce, graphs=graphs)
        # every primitive is compiled (warm_up): LLVM's code pages are not needed again (cpu/residency.py)
        self.released_compiler_bytes = release_library_pages("libllvmlite")
        # what Bootstrap and the load freed stays resident in the C heap otherwise (cpu/residency.py)
        release_free_heap()

    def close(self) -> None:
        super().close()
        self.kernels.close()

    def resident_weight_bytes(self) -> int:
        """Bytes of weights held (declared layouts, no shadows): rank 0's, for the memory figures."""
        arena = self.ranks[0].arena
        return sum(arena.nbytes[b.name] for b in arena.buffers.values() if b.kind == M.BUFFER_KIND_WEIGHT)
