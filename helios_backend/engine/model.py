"""NativeModel.load: choose capacities, back each rank's buffers and cache, load weights.

    model = NativeModel.load(contract, manifest, read_resource, ModelOptions(concurrency=8))
    model.manifests        # per-rank execution geometry that loading produced (OWN-11)
    model.executor         # Executor protocol: ModelOptions.executor selects "numpy", "cpu" or "cuda"
    model.packer           # shared packing over the executor's staging frames
    model.program(operation, rows, tokens)  # smallest loaded variant that fits, else CapacityError
    model.generations, model.submissions   # slot generations and submission numbers: one owner per model

Capacity rules: `concurrency` may reduce the captured request rows, never raise them
(SRV-7); graphs with more rows than the selected concurrency are not loaded. Physical
cache pages are chosen here, after the graphs are known, and replace preparation's
working-set count (SRV-9/10): the startup option wins, then the core's page_capacity
default (settings.layered), then prepared_pages (the cuda executor sizes the cache from the
memory left instead, executors/factory.py). A selected graph whose program is missing from the
execution catalog fails the load (MissingVariantError, OWN-19).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping, Sequence

from helios_proto import contract_pb2 as C
from helios_proto import manifest_pb2 as M

from helios_backend.executors.base import Executor, ExecutorLoadError, MissingVariantError, ResourceReader
from helios_backend.executors.factory import EXECUTORS, RANK_PEERS, ModelOptions, default_concurrency
from helios_backend.engine.settings import BUILT_IN, layered
from helios_backend.packing import CapacityError, Packer
from helios_backend.engine.submissions import SubmissionSequence
from helios_backend.ranks.rank_zero import start_rank_zero
from helios_backend.scheduler.generations import SlotGenerations

__all__ = ["ModelLoadError", "ModelOptions", "NativeModel", "RankGeometry"]


class ModelLoadError(ExecutorLoadError):
    """Startup options that the core cannot honour (e.g. more rows than were captured)."""


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


class NativeModel:
    def __init__(self, contract: C.ServingContract, manifest: M.ExecutionManifest, graphs: Sequence[C.GraphContract],
                 executor: Executor, packer: Packer, concurrency: int) -> None:
        self.contract = contract
        self.execution_manifest = manifest        # the proto; .manifests is the per-rank geometry
        self.graphs = tuple(graphs)
        self.executor = executor
        self.packer = packer
        self.concurrency = concurrency
        self.generations = SlotGenerations(manifest.request_slots)   # every driver of this model takes them here
        self.submissions = SubmissionSequence()                      # and the executor's submission numbers
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
        concurrency = (default_concurrency(options.executor, captured) if options.concurrency is None
                       else options.concurrency)
        if not 1 <= concurrency <= captured:
            raise ModelLoadError(f"concurrency {concurrency} outside 1..{captured} captured rows (load may only reduce it)")
        graphs = [g for g in contract.model.graphs if g.rank == options.rank and g.capacity.rows <= concurrency
                  and (options.speculative or g.operation != C.OPERATION_SPECULATIVE)]
        present = {p.name for p in manifest.programs}
        missing = sorted(g.program for g in graphs if g.program not in present)
        if missing:
            raise MissingVariantError(f"graphs name programs absent from the execution catalog: {missing}")
        if not any(g.operation == C.OPERATION_DECODE for g in graphs):
            raise MissingVariantError(f"no DECODE variant with at most {concurrency} rows")
        factory = EXECUTORS.get(options.executor)
        if factory is None:
            raise ModelLoadError(f"unknown executor {options.executor!r}; known: {sorted(EXECUTORS)}")
        defaults = contract.defaults
        options = dataclasses.replace(
            options, cache_pages=layered(options.cache_pages, defaults, "page_capacity", None),
            cache_memory_share=layered(options.cache_memory_share, defaults, "cache_memory_share",
                                       BUILT_IN.cache_memory_share))
        # every rank's programs of the selected variants (the graphs above are rank `options.rank`'s)
        selected = {(g.operation, g.capacity.rows, g.capacity.tokens) for g in graphs}
        every_rank = [g for g in contract.model.graphs if (g.operation, g.capacity.rows, g.capacity.tokens) in selected]
        if options.rank_peers not in RANK_PEERS:
            raise ModelLoadError(f"rank_peers {options.rank_peers!r} is not one of {RANK_PEERS}")
        if options.rank_peers == "processes" and manifest.world_size > 1:
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

    def program(self, operation: C.Operation.ValueType, rows: int, tokens: int = 0) -> str:
        """The smallest loaded variant of `operation` with >= rows rows and >= tokens packed tokens."""
        fitting = [g for g in self.graphs if g.operation == operation and g.capacity.rows >= rows
                   and g.capacity.tokens >= tokens]
        if not fitting:
            raise CapacityError(f"no {C.Operation.Name(operation)} variant for {rows} rows, {tokens} tokens")
        return min(fitting, key=lambda g: (g.capacity.rows, g.capacity.tokens)).program

    def close(self) -> None:
        self.executor.close()
