"""NativeModel.load: choose capacities, back each rank's buffers and cache, load weights.

    model = NativeModel.load(contract, manifest, read_resource, ModelOptions(concurrency=8))
    model.manifests        # per-rank execution geometry that loading produced (OWN-11)
    model.executor         # Executor protocol: ModelOptions.executor selects "numpy", "cpu" or "cuda"
    model.packer           # shared packing over the executor's staging frames
    model.program(operation, rows, tokens)  # smallest loaded variant that fits, else CapacityError

Capacity rules: `concurrency` may reduce the captured request rows, never raise them
(SRV-7); graphs with more rows than the selected concurrency are not loaded. Physical
cache pages are chosen here, after the graphs are known, and replace preparation's
working-set count (SRV-9/10): the startup option wins, then the core's page_capacity
default, then prepared_pages. A selected graph whose program is missing from the
execution catalog fails the load (MissingVariantError, OWN-19).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Protocol, Sequence

from helios_proto import contract_pb2 as C
from helios_proto import manifest_pb2 as M

from helios_backend.executors.base import (
    Executor, ExecutorLoadError, MissingVariantError, RankPlacement, ResourceReader)
from helios_backend.executors.numpy_executor import NumpyExecutor, NumpyExecutorOptions
from helios_backend.engine.settings import RANK_PEERS
from helios_backend.packing import CapacityError, Packer


class ModelLoadError(ExecutorLoadError):
    """Startup options that the core cannot honour (e.g. more rows than were captured)."""


@dataclass(frozen=True)
class ModelOptions:
    concurrency: Optional[int] = None   # request rows to serve; None = the captured concurrency
    cache_pages: Optional[int] = None   # physical pages per cache plane; None = core default
    cache_memory_share: Optional[float] = None   # cuda: share of free memory for pages; None = core default
    rank: int = 0
    widen_f16_cache: bool = True        # numpy executor: hold f16 cache planes as f32 (speed)
    executor: str = "numpy"             # a key of EXECUTORS: "numpy" (CPU oracle), "cpu" (CPU, compiled
                                        # kernels) or "cuda" (GPU, CUDA graphs)
    kernel_arch: Optional[str] = None   # cuda: KernelModule.arch to load; None: the device's own
    threads: int = 2                    # cpu executor: threads of its compiled kernels and product workers
    # tensor-parallel ranks (OWN-14/15): "threads" (every rank in this process) or "processes"
    # (rank 0 here, every other rank a helios-rank process; helios_backend/ranks/)
    rank_peers: str = "threads"
    rank_store: str = ""                # processes: HOST:PORT of the rendezvous store rank 0 listens on
    rank_timeout_s: float = 30.0        # processes: the bound on every answer of a peer
    rank_join_timeout_s: float = 600.0  # processes: how long rank 0 waits for every peer to join
    core_digest: str = ""               # processes: Core.content_digest(), which every rank must share


@dataclass(frozen=True)
class RankGeometry:
    """What loading produced for one rank."""

    rank: int
    request_slots: int                  # physical slots (captured; rows beyond concurrency unused)
    concurrency: int                    # selected request rows
    cache_pages: int
    page_tokens: int
    pages_per_row: int
    programs: tuple[str, ...]           # loaded programs, by name
    buffer_offsets: Mapping[str, int]   # arena byte offset of every buffer
    arena_nbytes: int


def _choose_pages(contract: C.ServingContract, options: ModelOptions) -> int:
    if options.cache_pages is not None:
        return options.cache_pages
    if contract.defaults.HasField("page_capacity"):
        return contract.defaults.page_capacity
    return contract.prepared_pages


def _local_ranks(placement: Optional[RankPlacement]) -> dict:
    """The keyword arguments binding only the placement's rank (none: every rank, threads)."""
    return {} if placement is None else {"local_ranks": (placement.rank,), "reduce": placement.reduce}


def _numpy_executor(contract: C.ServingContract, manifest: M.ExecutionManifest, read_resource: ResourceReader,
                    options: ModelOptions, graphs: Sequence[C.GraphContract],
                    placement: Optional[RankPlacement] = None) -> Executor:
    return NumpyExecutor(manifest, read_resource, NumpyExecutorOptions(
        cache_pages=_choose_pages(contract, options), programs=frozenset(g.program for g in graphs),
        widen_f16_cache=options.widen_f16_cache), **_local_ranks(placement))


def _cpu_executor(contract: C.ServingContract, manifest: M.ExecutionManifest, read_resource: ResourceReader,
                  options: ModelOptions, graphs: Sequence[C.GraphContract],
                  placement: Optional[RankPlacement] = None) -> Executor:
    """Compiled CPU kernels over the numpy executor's replay (F16 cache planes held as f32)."""
    from helios_backend.executors.cpu_executor import CpuExecutor, CpuExecutorOptions

    return CpuExecutor(manifest, read_resource, CpuExecutorOptions(
        cache_pages=_choose_pages(contract, options), programs=frozenset(g.program for g in graphs),
        threads=options.threads), **_local_ranks(placement))


def _cuda_executor(contract: C.ServingContract, manifest: M.ExecutionManifest, read_resource: ResourceReader,
                   options: ModelOptions, graphs: Sequence[C.GraphContract],
                   placement: Optional[RankPlacement] = None) -> Executor:
    """CUDA graphs; without an explicit page count the executor sizes the cache from the memory
    left after its graphs (SRV-9), at the core's cache_memory_share when it declares one. The
    graphs trim each program's staging copy to the bytes its bindings write."""
    from helios_backend.executors.cuda_executor import CudaExecutor, CudaExecutorOptions  # GPU builds only

    pages = options.cache_pages
    if pages is None and contract.defaults.HasField("page_capacity"):
        pages = contract.defaults.page_capacity
    share = options.cache_memory_share if options.cache_memory_share is not None else (
        contract.defaults.cache_memory_share if contract.defaults.HasField("cache_memory_share") else 0.90)
    rank = options.rank if placement is None else placement.rank
    local = None if placement is None else (placement.rank,)
    devices = None if placement is None else (rank if placement.device is None else placement.device,)
    return CudaExecutor(manifest, read_resource,
                        CudaExecutorOptions(cache_pages=pages, cache_memory_share=share,
                                            programs=frozenset(g.program for g in graphs),
                                            kernel_arch=options.kernel_arch, local_ranks=local, devices=devices),
                        graphs=[g for g in graphs if g.rank == rank],
                        nccl_unique_id=None if placement is None else placement.nccl_unique_id,
                        agree_pages=None if placement is None else placement.agree_pages)


class ExecutorFactory(Protocol):
    def __call__(self, contract: C.ServingContract, manifest: M.ExecutionManifest, read_resource: ResourceReader,
                 options: ModelOptions, graphs: Sequence[C.GraphContract],
                 placement: Optional[RankPlacement] = None) -> Executor: ...

EXECUTORS: Mapping[str, ExecutorFactory] = {"numpy": _numpy_executor, "cpu": _cpu_executor, "cuda": _cuda_executor}


class NativeModel:
    def __init__(self, contract: C.ServingContract, manifest: M.ExecutionManifest, graphs: Sequence[C.GraphContract],
                 executor: Executor, packer: Packer, concurrency: int) -> None:
        self.contract = contract
        self.execution_manifest = manifest        # the proto; .manifests is the per-rank geometry
        self.graphs = tuple(graphs)
        self.executor = executor
        self.packer = packer
        self.concurrency = concurrency
        self._slot_generations = [0] * manifest.request_slots
        self.manifests: tuple[RankGeometry, ...] = tuple(
            RankGeometry(rank=rank, request_slots=manifest.request_slots, concurrency=concurrency,
                         cache_pages=executor.cache_pages, page_tokens=contract.model.cache.page_tokens,
                         pages_per_row=manifest.max_pages_per_row, programs=tuple(g.program for g in graphs),
                         buffer_offsets=executor.buffer_offsets(rank), arena_nbytes=executor.arena_nbytes(rank))
            for rank in range(max(1, manifest.world_size)))

    @classmethod
    def load(cls, contract: C.ServingContract, manifest: M.ExecutionManifest, read_resource: ResourceReader,
             options: ModelOptions = ModelOptions()) -> "NativeModel":
        captured = contract.concurrency
        concurrency = captured if options.concurrency is None else options.concurrency
        if not 1 <= concurrency <= captured:
            raise ModelLoadError(f"concurrency {concurrency} outside 1..{captured} captured rows (load may only reduce it)")
        graphs = [g for g in contract.model.graphs if g.rank == options.rank and g.capacity.rows <= concurrency]
        present = {p.name for p in manifest.programs}
        missing = sorted(g.program for g in graphs if g.program not in present)
        if missing:
            raise MissingVariantError(f"graphs name programs absent from the execution catalog: {missing}")
        if not any(g.operation == C.OPERATION_DECODE for g in graphs):
            raise MissingVariantError(f"no DECODE variant with at most {concurrency} rows")
        factory = EXECUTORS.get(options.executor)
        if factory is None:
            raise ModelLoadError(f"unknown executor {options.executor!r}; known: {sorted(EXECUTORS)}")
        # every rank's programs of the selected variants (the graphs above are rank `options.rank`'s)
        selected = {(g.operation, g.capacity.rows, g.capacity.tokens) for g in graphs}
        every_rank = [g for g in contract.model.graphs if (g.operation, g.capacity.rows, g.capacity.tokens) in selected]
        if options.rank_peers not in RANK_PEERS:
            raise ModelLoadError(f"rank_peers {options.rank_peers!r} is not one of {RANK_PEERS}")
        if options.rank_peers == "processes" and manifest.world_size > 1:
            from helios_backend.ranks.rank_zero import start_rank_zero

            executor: Executor = start_rank_zero(
                lambda placement: factory(contract, manifest, read_resource, options, every_rank, placement),
                contract, manifest, options, every_rank)
        else:
            executor = factory(contract, manifest, read_resource, options, every_rank)
        # the auxiliary frames (INITIALIZATION, RESTORATION only) follow the declared ones
        frames = [executor.staging(f) for f in range(max(1, manifest.transport.frames) + executor.auxiliary_frames)]
        packer = Packer(graphs, manifest.transport, manifest.request_slots, frames,     # row widths of older cores:
                        layout_graphs=[g for g in contract.model.graphs if g.rank == options.rank])  # every graph
        return cls(contract, manifest, graphs, executor, packer, concurrency)

    def next_generation(self, slot: int) -> int:
        """A fresh generation for a physical slot being (re)assigned: packing then forgets the
        page-table entries it remembers for the slot (BND-34). One counter per model, so drivers
        sharing a model never reuse a (slot, generation) pair."""
        self._slot_generations[slot] += 1
        return self._slot_generations[slot]

    def program(self, operation: C.Operation.ValueType, rows: int, tokens: int = 0) -> str:
        """The smallest loaded variant of `operation` with >= rows rows and >= tokens packed tokens."""
        fitting = [g for g in self.graphs if g.operation == operation and g.capacity.rows >= rows
                   and g.capacity.tokens >= tokens]
        if not fitting:
            raise CapacityError(f"no {C.Operation.Name(operation)} variant for {rows} rows, {tokens} tokens")
        return min(fitting, key=lambda g: (g.capacity.rows, g.capacity.tokens)).program

    def close(self) -> None:
        self.executor.close()
