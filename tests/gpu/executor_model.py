"""The NativeModel surface (executor, packer, program(), manifests) over any executor.

NativeModel.load builds the numpy executor today; the device scripts need the same
surface over the CUDA executor, so the runtime's Driver can run both unchanged.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from helios_backend.model import NativeModel
from helios_backend.packing import Packer
from helios_proto import contract_pb2, manifest_pb2


@dataclasses.dataclass(frozen=True)
class Geometry:
    cache_pages: int


class ExecutorModel:
    def __init__(self, contract: contract_pb2.ServingContract, manifest: manifest_pb2.ExecutionManifest,
                 executor: Any, graphs: Optional[list] = None) -> None:
        self.contract = contract
        self.manifest = manifest
        self.executor = executor
        self.graphs = tuple(graphs if graphs is not None else [g for g in contract.model.graphs if g.rank == 0])
        frames = [executor.staging(f) for f in range(max(1, manifest.transport.frames))]
        self.packer = Packer(self.graphs, manifest.transport, manifest.request_slots, frames)
        self.manifests = (Geometry(executor.cache_pages),)

    def program(self, operation: int, rows: int, tokens: int = 0) -> str:
        return NativeModel.program(self, operation, rows, tokens)   # uses self.graphs only

    def close(self) -> None:
        self.executor.close()
