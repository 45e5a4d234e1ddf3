"""A NativeModel over an executor built by the caller (the device scripts build the CUDA
executor themselves: a counting driver, the contract's graphs for staging extents)."""
from __future__ import annotations

from typing import Any

from helios_backend.engine.model import NativeModel
from helios_backend.packing import Packer
from helios_proto import contract_pb2, manifest_pb2


def ExecutorModel(contract: contract_pb2.ServingContract, manifest: manifest_pb2.ExecutionManifest,
                  executor: Any) -> NativeModel:
    graphs = [g for g in contract.model.graphs if g.rank == 0]
    frames = [executor.staging(f) for f in range(max(1, manifest.transport.frames))]
    packer = Packer(graphs, manifest.transport, manifest.request_slots, frames)
    return NativeModel(contract, manifest, graphs, executor, packer, contract.concurrency)
