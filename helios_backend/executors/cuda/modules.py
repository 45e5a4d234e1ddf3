"""Which of a core's kernel modules a device loads (pure Python: runs and is tested without a GPU).

A core carries each kernel set once per architecture (KernelModule.arch): cubins of machine
code for one exact compute capability each, and possibly a PTX copy that the driver
JIT-compiles at startup on any device at or above its capability. At startup the executor
takes, for the device's capability:

  1. the architecture whose cubins are for exactly that capability;
  2. else the PTX architecture of the highest capability not above it (JIT-compiled once,
     at startup: nothing is compiled while serving);
  3. else nothing: startup fails with ArchitectureError naming the device's capability and
     the core's architectures.

`forced` (CudaExecutorOptions.kernel_arch) picks an architecture by name instead, e.g.
"compute_80" to run the Ampere PTX path on a newer device; it must still run there. Every
copy of a kernel set declares the same kernel table (`kernel_table_disagreements`), so the
recorded programs plan against whichever architecture is chosen; launch attributes (PDL),
blocks and dynamic shared memory come from the chosen modules.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Optional, Sequence

from helios_proto import manifest_pb2

from .errors import ArchitectureError, ManifestError


@dataclasses.dataclass(frozen=True)
class Architecture:
    """The modules of one KernelModule.arch."""
    name: str                                    # "sm_90a", "compute_80"
    capability: int                              # major * 10 + minor
    portable: bool                               # PTX: JIT-compiled by the driver at startup
    modules: tuple[manifest_pb2.KernelModule, ...]

    def runs_on(self, capability: int) -> bool:
        return self.capability <= capability if self.portable else self.capability == capability


def capability_name(capability: int) -> str:
    """90 -> '9.0 (sm_90)'."""
    return f"{capability // 10}.{capability % 10} (sm_{capability})"


def module_capability(module: manifest_pb2.KernelModule) -> int:
    """KernelModule.capability, or (older cores) the number in its arch: 'sm_90a' -> 90."""
    if module.capability:
        return int(module.capability)
    found = re.fullmatch(r"(?:sm|compute)_(\d+)[a-z]?", module.arch)
    if not found:
        raise ManifestError(f"kernel module {module.resource}: arch {module.arch!r} names no capability")
    return int(found.group(1))


def architectures(modules: Sequence[manifest_pb2.KernelModule]) -> list[Architecture]:
    """The core's architectures in manifest order, each with its modules."""
    grouped: dict[str, list[manifest_pb2.KernelModule]] = {}
    for module in modules:
        grouped.setdefault(module.arch, []).append(module)
    found = []
    for name, members in grouped.items():
        capabilities = {module_capability(m) for m in members}
        portable = {m.portable for m in members}
        if len(capabilities) != 1 or len(portable) != 1:
            raise ManifestError(f"kernel modules of arch {name} disagree on capability or image kind (cubin or PTX)")
        found.append(Architecture(name, capabilities.pop(), portable.pop(), tuple(members)))
    return found


def select(modules: Sequence[manifest_pb2.KernelModule], capability: int,
           forced: Optional[str] = None) -> Architecture:
    """The architecture a device of `capability` loads (module docstring); ArchitectureError if none."""
    available = architectures(modules)
    names = ", ".join(a.name for a in available) or "none"
    if forced is not None:
        chosen = next((a for a in available if a.name == forced), None)
        if chosen is None:
            raise ArchitectureError(f"kernel_arch {forced!r}: the core serves {names}")
        if not chosen.runs_on(capability):
            raise ArchitectureError(f"kernel_arch {forced!r} does not run on a device of compute capability "
                                    f"{capability_name(capability)}")
        return chosen
    exact = [a for a in available if not a.portable and a.capability == capability]
    if exact:
        return exact[0]
    portable = sorted((a for a in available if a.portable and a.capability <= capability),
                      key=lambda a: a.capability)
    if portable:
        return portable[-1]
    raise ArchitectureError(f"no kernel module runs on this device: compute capability "
                            f"{capability_name(capability)}; the core serves {names} "
                            f"(prepare it with `helios-prepare --arch sm_{capability}`)")


def _table(modules: Sequence[manifest_pb2.KernelModule]) -> dict[str, tuple]:
    """kernel id -> what every architecture's copy must agree on."""
    return {k.id: (k.symbol, tuple(k.params), k.num_warps, k.trailing_null_pointers)
            for module in modules for k in module.kernels}


def kernel_table_disagreements(modules: Sequence[manifest_pb2.KernelModule]) -> list[str]:
    """Where an architecture's kernel table differs from the first one's (empty: they agree)."""
    found = architectures(modules)
    if not found:
        return []
    reference = _table(found[0].modules)
    problems = []
    for arch in found[1:]:
        table = _table(arch.modules)
        for kernel_id in sorted(set(reference) ^ set(table)):
            problems.append(f"{kernel_id}: in {found[0].name if kernel_id in reference else arch.name} only")
        for kernel_id in sorted(set(reference) & set(table)):
            if reference[kernel_id] != table[kernel_id]:
                problems.append(f"{kernel_id}: {arch.name} declares {table[kernel_id]}, "
                                f"{found[0].name} {reference[kernel_id]}")
    return problems
