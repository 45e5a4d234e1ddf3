"""The numpy executor: replays recorded programs node by node over host arenas, one per rank.

A step: copy the bytes of the staging frame the program reads (its runs, those a rank
process's LAUNCH carries and the CUDA executor copies to the device: a frame holds every
destination of the widest variants, 14 MB for a core of 256 rows, and a decode step of one row
reads ~150 KB of it) into every rank's staging buffer, run the program's nodes, copy rank 0's
completion buffer out. With several ranks (a tensor-parallel manifest) the
ranks run in lockstep in this one process, which makes this executor the CPU oracle of
tensor parallelism:

    rank 0: kernels .. | all-reduce 0 | kernels .. | all-reduce 1 | .. | kernels
    rank 1: kernels .. |      ^       | kernels .. |      ^       | .. | kernels

each rank's nodes run up to the program's next ALL_REDUCE node; that node sums its region
over the ranks' arenas (in rank order, in the region's dtype) and writes the sum to every
rank; then the next segment runs. Every rank's program must have the same all-reduce nodes
(count and element count), checked at load. The per-rank arena, weight shadows and widened
cache planes are numpy_rank.RankReplay's.

With rank processes (RankPeers::Processes, helios_backend/ranks/) each process binds only
its own rank (`local_ranks`) and runs its segments alone; at each ALL_REDUCE node it calls
`reduce(index, region)`, which sums the region with the other processes' (ranks/reduce.py)
in the same rank order, so a process mode step is bit-identical to the lockstep one.

Load errors (typed, all raised before any step): UnknownKernelIdError for a kernel id
without a numpy reference, KernelArgumentError for args that do not fit the ABI (or
all-reduce nodes that differ between ranks), MissingVariantError for a selected program
absent from the manifest on any rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional, Sequence

import numpy as np
from helios_proto import contract_pb2 as C
from helios_proto import manifest_pb2 as M
from threadpoolctl import threadpool_limits

from helios_backend.executors.base import (
    FrameStateError,
    KernelArgumentError,
    MissingVariantError,
    ResourceReader,
    UnknownKernelIdError,
    UnknownProgramError,
)
from helios_backend.executors.numpy_rank import NUMPY_DTYPES, BoundProgram, RankArena, RankReplay
from helios_backend.kernel_abi import abi
from helios_backend.kernel_abi.activations import check as check_activations

__all__ = ["NUMPY_DTYPES", "NumpyExecutor", "NumpyExecutorOptions", "RankArena", "RankReplay", "Reduce"]

Reduce = Callable[[int, np.ndarray], None]    # (all-reduce index, this rank's region) -> the sum, in place


@dataclass(frozen=True)
class NumpyExecutorOptions:
    cache_pages: int = 64                         # physical pages backing each CACHE plane (every rank)
    programs: Optional[frozenset[str]] = None     # programs to load; None: every serving program
    blas_threads: int = 1                         # >1 BLAS threads are slower on small GEMMs
    widen_f16_cache: bool = True                  # hold F16 cache planes as f32 (see numpy_rank)
    # block-weight products' activations: "f32", or "q8" (kernel_abi/activations.py: the references
    # multiply the block weights by the activations' 8-bit round trip, the CPU executor's q8 option)
    activations: str = "f32"

    def __post_init__(self) -> None:
        if self.cache_pages < 1:
            raise ValueError("cache_pages must be >= 1")
        check_activations(self.activations)


class NumpyExecutor:
    """Executor protocol over numpy reference kernels, every rank of the manifest in one process."""

    def __init__(self, manifest: M.ExecutionManifest, read_resource: ResourceReader,
                 options: NumpyExecutorOptions = NumpyExecutorOptions(), *,
                 implementations: Mapping[str, Callable[..., None]] = {}, weight_shadows: bool = True,
                 local_ranks: Optional[Sequence[int]] = None, reduce: Optional[Reduce] = None,
                 graphs: Sequence[C.GraphContract] = ()) -> None:
        """`implementations` and `weight_shadows` are the CPU executor's (numpy_rank.RankReplay).
        `local_ranks` (default: every rank) are the ranks this process binds; one local rank of a
        larger world needs `reduce`, the all-reduce with the ranks of the other processes.
        `graphs`: the programs' graphs, whose bindings bound the staging bytes a step copies to
        the rows of its program (without them a step copies each destination it reads whole)."""
        from helios_backend.executors.cuda.staging_copy import launch_runs   # plain host code
        self.manifest = manifest
        self.options = options
        self.cache_pages = options.cache_pages
        self.world_size = max(1, manifest.world_size)
        local = tuple(range(self.world_size)) if local_ranks is None else tuple(local_ranks)
        if len(local) < self.world_size and (reduce is None or len(local) != 1):
            raise KernelArgumentError(f"ranks {list(local)} of a world of {self.world_size} need one local rank "
                                      "and the all-reduce between processes")
        per_rank = [{p.name: p for p in manifest.programs if p.rank == rank} for rank in range(self.world_size)]
        wanted = set(options.programs) if options.programs is not None else set(per_rank[0])
        for rank, programs in enumerate(per_rank):
            missing = sorted(wanted - set(programs))
            if missing:
                raise MissingVariantError(f"programs absent from the execution catalog of rank {rank}: {missing}")
            self._check_kernels(programs[name] for name in wanted)
        self._check_reductions(per_rank, sorted(wanted))
        self.local_ranks = local
        self._reduce = reduce if len(local) < self.world_size else None
        self.ranks = tuple(RankReplay(manifest, rank, read_resource, options.cache_pages, options.widen_f16_cache,
                                      {name: per_rank[rank][name] for name in sorted(wanted)},
                                      implementations, weight_shadows, options.activations)
                           for rank in local)
        transport = manifest.transport
        self._frames = [np.zeros(transport.frame_nbytes, dtype=np.uint8) for _ in range(max(1, transport.frames))]
        self._runs = launch_runs(manifest, graphs, sorted(wanted))   # program -> the frame bytes it reads
        self._results: list[Optional[np.ndarray]] = [None] * len(self._frames)
        self._sequence = 0
        self._blas = threadpool_limits(options.blas_threads)   # held for the executor's lifetime

    # ---- load ----------------------------------------------------------------------------
    @staticmethod
    def _check_kernels(programs: Iterable[M.Program]) -> None:
        for program in programs:
            for index, node in enumerate(program.nodes):
                if node.kind == M.NODE_KIND_ALL_REDUCE:
                    continue
                if node.kind != M.NODE_KIND_KERNEL:
                    raise KernelArgumentError(f"{program.name}.nodes[{index}]: node kind "
                                              f"{M.NodeKind.Name(node.kind)} is not supported on numpy")
                if node.kernel not in abi.KERNELS:
                    raise UnknownKernelIdError(f"{program.name}.nodes[{index}]: kernel id {node.kernel!r} "
                                               "has no numpy reference")

    @staticmethod
    def _check_reductions(per_rank: Sequence[Mapping[str, M.Program]], names: Iterable[str]) -> None:
        """Lockstep needs the same all-reduces on every rank, in the same order, of the same size
        (checked on the manifest, so a process binding one rank checks every rank too)."""
        def shape(program: M.Program) -> tuple:
            return tuple(tuple(getattr(a, a.WhichOneof("value") or "i64") for a in n.args[1:])
                         for n in program.nodes if n.kind == M.NODE_KIND_ALL_REDUCE)

        for name in names:
            shapes = [shape(programs[name]) for programs in per_rank]
            if any(s != shapes[0] for s in shapes[1:]):
                raise KernelArgumentError(f"{name}: ranks record different all-reduce nodes")

    # ---- Executor protocol -----------------------------------------------------------------
    @property
    def programs(self) -> frozenset[str]:
        return frozenset(self.ranks[0].programs) if self.ranks else frozenset()

    @property
    def arena(self) -> RankArena:
        """Rank 0's arena (the one whose completion words the host reads)."""
        return self.ranks[0].arena

    @property
    def frames(self) -> int:
        return len(self._frames)

    @property
    def auxiliary_frames(self) -> int:
        return 0                       # launch runs the step at once: nothing to overlap

    def _local(self, rank: int) -> RankReplay:
        try:
            return self.ranks[self.local_ranks.index(rank)]
        except ValueError:
            raise KeyError(f"rank {rank} is not one of this process's ranks {list(self.local_ranks)}") from None

    def buffer_offsets(self, rank: int = 0) -> dict[str, int]:
        return dict(self._local(rank).arena.offsets)

    def arena_nbytes(self, rank: int = 0) -> int:
        return int(self._local(rank).arena.memory.nbytes)

    def node_count(self, program: str) -> int:
        """Nodes of rank 0's program: kernels plus all-reduces."""
        bound = self.ranks[0].programs[program]
        return len(bound.kernel_nodes) + len(bound.regions)

    def staging(self, frame: int) -> np.ndarray:
        return self._frames[frame]

    def staging_runs(self, program: str) -> tuple[tuple[int, int], ...]:
        """(byte offset, bytes) of the frame a step of `program` copies into each rank's staging."""
        return self._runs[program]

    def launch(self, program: str, frame: int) -> None:
        if program not in self.ranks[0].programs:
            raise UnknownProgramError(program)
        if self._results[frame] is not None:
            raise FrameStateError(f"frame {frame} still holds an unread completion")
        source = self._frames[frame]
        for rank in self.ranks:
            for start, nbytes in self._runs[program]:
                rank.staging[start:start + nbytes] = source[start:start + nbytes]
            rank.header[0] = self._sequence
            rank.header[1] = frame
        self._sequence += 1
        bound = [rank.programs[program] for rank in self.ranks]
        if self._reduce is None:
            self._run_lockstep(bound)
        else:
            self._run_with_peers(bound[0], self._reduce)
        self._results[frame] = self.ranks[0].completion.copy()

    @staticmethod
    def _run_with_peers(program: BoundProgram, reduce: Reduce) -> None:
        """This process's rank alone; the other ranks run the same segments in their processes."""
        reductions = len(program.regions)
        for index, segment in enumerate(program.segments):
            for function, args in segment:
                function(*args)
            if index < reductions:
                reduce(index, program.regions[index])

    @staticmethod
    def _run_lockstep(bound: list[BoundProgram]) -> None:
        reductions = len(bound[0].regions)
        for index in range(reductions + 1):
            for rank_program in bound:
                for function, args in rank_program.segments[index]:
                    function(*args)
            if index < reductions:
                regions = [rank_program.regions[index] for rank_program in bound]
                total = regions[0].copy()
                for region in regions[1:]:
                    total += region
                for region in regions:
                    region[...] = total

    def wait(self, frame: int) -> np.ndarray:
        result = self._results[frame]
        if result is None:
            raise FrameStateError(f"nothing submitted on frame {frame}")
        self._results[frame] = None
        return result

    def read_buffer(self, name: str, rank: int = 0) -> np.ndarray:
        return self._local(rank).read_buffer(name)

    def buffer_view(self, name: str, dtype: np.dtype, rank: int = 0) -> np.ndarray:
        """A live typed view of a rank's buffer (tests and the single-request driver's diagnostics)."""
        return self._local(rank).arena.typed(name, dtype)

    def bind_thread(self) -> None:
        """Host memory only: every thread may step it already."""

    def abort(self) -> None:
        """Nothing waits on another process here: the all-reduce raises when a link breaks."""

    def close(self) -> None:
        self.ranks = ()
        self._blas.restore_original_limits()
