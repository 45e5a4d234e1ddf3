"""KernelLibrary: the ahead-of-time compiled kernel set as the recorder and the core see it.

    library = KernelLibrary()
    grid, block, shared = library.geometry("rmsnorm_matmul", args)   # args in ABI order
    for cubin, module in library.build_modules("sm_90a", progress=print): ...

One KernelModule (one cubin resource) per kernel id. Kernel.params lists the ABI params
only; Triton appends two pointer params (global and profile scratch), recorded as
trailing_null_pointers = 2 and passed as 0 at launch.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable, Sequence

from helios_backend.kernels import abi
from helios_proto import manifest_pb2

from ignition.kernels import compiler
from ignition.kernels.signature import triton_signature
from ignition.kernels.specs import KERNEL_SPECS, SPECS_BY_ID, Grid, KernelSpec

Geometry = tuple[Grid, tuple[int, int, int], int]
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "helios" / "kernels"

def capability_of(arch: str) -> int:
    """"sm_90a" -> 90. Only arch-specific ("a") Hopper+ targets are produced by Triton."""
    found = re.fullmatch(r"sm_(\d+)a", arch)
    if not found:
        raise ValueError(f"unsupported arch {arch!r}; expected e.g. 'sm_90a'")
    return int(found.group(1))


class KernelLibrary:
    def __init__(self, cache_dir: Path | None = None, pdl: bool = True) -> None:
        self._cache = compiler.CubinCache(cache_dir or DEFAULT_CACHE_DIR)
        self._pdl = pdl
        self._compiled: dict[str, dict[str, compiler.CompiledKernel]] = {}   # arch -> id -> kernel

    def kernel_ids(self) -> list[str]:
        return [spec.kernel_id for spec in KERNEL_SPECS]

    def signature(self, kernel_id: str) -> tuple[tuple[str, str], ...]:
        return triton_signature(kernel_id)

    def compile_request(self, spec: KernelSpec, arch: str) -> compiler.CompileRequest:
        return compiler.CompileRequest(
            kernel_id=spec.kernel_id, module=spec.module, function=spec.function,
            signature=tuple(self.signature(spec.kernel_id)),
            constexprs=tuple(spec.constexprs.items()) + (("PDL", int(self._pdl)),),
            num_warps=spec.num_warps, num_stages=spec.num_stages, pdl=self._pdl,
            capability=capability_of(arch))

    def compile(self, arch: str = "sm_90a", progress: Callable[[str], None] | None = None,
                ) -> dict[str, compiler.CompiledKernel]:
        if arch not in self._compiled:
            requests = [self.compile_request(spec, arch) for spec in KERNEL_SPECS]
            self._compiled[arch] = compiler.compile_all(requests, self._cache, progress)
        return self._compiled[arch]

    def geometry(self, kernel_id: str, args: Sequence, arch: str = "sm_90a") -> Geometry:
        """(grid, block, dynamic shared bytes) of one launch; args in ABI order (pointers may
        be anything; only the immediates are read)."""
        spec = SPECS_BY_ID[kernel_id]
        names = [name for name, _ in self.signature(kernel_id)]
        if len(args) != len(names):
            raise ValueError(f"{kernel_id}: {len(args)} args, ABI has {len(names)}")
        immediates = {name: value for (name, kind), value
                      in zip(self.signature(kernel_id), args) if not kind.startswith("*")}
        kernel = self.compile(arch)[kernel_id]
        grid = tuple(int(d) for d in spec.grid(immediates, spec.constexprs))
        return grid, (32 * kernel.num_warps, 1, 1), kernel.shared_bytes

    def build_modules(self, arch: str = "sm_90a", progress: Callable[[str], None] | None = None,
                      ) -> list[tuple[bytes, manifest_pb2.KernelModule]]:
        """One (cubin bytes, KernelModule) per kernel id. KernelModule.resource is left empty
        for the caller, who names the resource it stores the cubin under."""
        modules = []
        for kernel_id, kernel in self.compile(arch, progress).items():
            entry = manifest_pb2.Kernel(
                id=kernel_id, symbol=kernel.symbol,
                params=[p.kind for p in abi.kernel(kernel_id).params],
                shared_bytes=kernel.shared_bytes, num_warps=kernel.num_warps,
                trailing_null_pointers=kernel.trailing_null_pointers,
                programmatic_dependent_launch=kernel.pdl)
            modules.append((kernel.cubin, manifest_pb2.KernelModule(
                arch=arch, toolchain=kernel.toolchain, kernels=[entry])))
        return modules
