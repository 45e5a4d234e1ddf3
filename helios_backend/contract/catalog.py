"""An index of the execution manifest that the cross-checks consult."""
from __future__ import annotations

import dataclasses

from helios_proto import contract_pb2, manifest_pb2

from .errors import ContractError


@dataclasses.dataclass(frozen=True)
class CheckContext:
    """Everything a cross-check reads: the contract, the manifest, their indexes."""

    contract: contract_pb2.ServingContract
    manifest: manifest_pb2.ExecutionManifest
    programs: dict[tuple[str, int], manifest_pb2.Program]   # serving catalog by (name, rank)
    tuning: dict[tuple[str, int], manifest_pb2.Program]     # tuning catalog by (name, rank)
    buffers: dict[tuple[str, int], manifest_pb2.Buffer]  # (name, rank)
    destinations: dict[str, manifest_pb2.Destination]
    resource_ids: frozenset[str] | None                 # None: not checked (no core at hand)

    @property
    def model(self) -> contract_pb2.ModelContract:
        return self.contract.model

    def buffer(self, name: str, rank: int, field: str) -> manifest_pb2.Buffer:
        found = self.buffers.get((name, rank))
        if found is None:
            raise ContractError(field, f"no buffer {name!r} on rank {rank} in the execution manifest")
        return found

    def buffer_names(self) -> frozenset[str]:
        return frozenset(name for name, _ in self.buffers)

    @property
    def world_size(self) -> int:
        return max(self.manifest.world_size, 1)


def _unique(items, key, field: str) -> dict:
    out: dict = {}
    for index, item in enumerate(items):
        name = key(item)
        if name in out:
            raise ContractError(f"{field}[{index}]", f"duplicate name {name!r}")
        out[name] = item
    return out


def build_context(
    contract: contract_pb2.ServingContract,
    manifest: manifest_pb2.ExecutionManifest,
    resource_ids: frozenset[str] | None,
) -> CheckContext:
    # per-rank programs share their name (tensor parallelism): a name is unique within a rank
    programs = _unique(manifest.programs, lambda p: (p.name, p.rank), "manifest.programs")
    tuning = _unique(manifest.tuning, lambda p: (p.name, p.rank), "manifest.tuning")
    serving_names = {name for name, _ in programs}
    for index, program in enumerate(manifest.tuning):
        if program.name in serving_names:
            raise ContractError(f"manifest.tuning[{index}].name", f"{program.name!r} is also a serving program")
    buffers = _unique(manifest.buffers, lambda b: (b.name, b.rank), "manifest.buffers")
    destinations = _unique(manifest.transport.destinations, lambda d: d.name, "manifest.transport.destinations")
    return CheckContext(contract, manifest, programs, tuning, buffers, destinations, resource_ids)
