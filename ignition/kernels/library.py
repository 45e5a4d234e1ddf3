"""KernelLibrary: the ahead-of-time compiled kernel set as the recorder and the core see it.

    library = KernelLibrary()
    grid, block, shared = library.geometry("attention.paged.v1", args)   # args in ABI order
    for cubin, module in library.build_modules("sm_90a", progress=print):
        ...  # store cubin as a resource, set module.resource to its id

One KernelModule (one cubin) per kernel id. Kernel.params lists the ABI params only; Triton
appends two pointer params (global and profile scratch, both unused: sizes are checked to be
0), recorded as trailing_null_pointers = 2 and passed as 0 at launch. Every kernel executes
griddepcontrol.wait before reading predecessor output, so it is recorded with
programmatic_dependent_launch = true.
"""
from __future__ import annotations

import numbers
import re
from pathlib import Path
from typing import Callable, Sequence

from helios_backend.kernels import abi
from helios_proto import manifest_pb2

from ignition.kernels import compiler
from ignition.kernels.signature import triton_signature
from ignition.kernels.specs import (ALIGNMENT, KERNEL_SPECS, SPECS_BY_ID, GeometryError, Grid,
                                    KernelBuild)

Dim3 = tuple[int, int, int]
Geometry = tuple[Grid, Dim3, int]          # (grid, block, dynamic shared bytes)
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "helios" / "kernels"


def capability_of(arch: str) -> int:
    """'sm_90a' -> 90. Triton emits arch-specific ('a') code for Hopper and later."""
    found = re.fullmatch(r"sm_(\d+)a", arch)
    if not found or int(found.group(1)) < 90:
        raise ValueError(f"unsupported arch {arch!r}; expected e.g. 'sm_90a'")
    return int(found.group(1))


def _immediate(value) -> int | float:
    """A recorded immediate: a Python number or a manifest Arg (oneof i32/i64/f32/u64)."""
    if isinstance(value, manifest_pb2.Arg):
        which = value.WhichOneof("value")
        if which in (None, "pointer"):
            raise ValueError(f"expected an immediate, got {which}")
        return getattr(value, which)
    return value


def _byte_offset(pointer) -> int:
    """Byte offset of a recorded pointer (recorder Ref, BufferRef or Arg); 0 if unknown.
    Buffers themselves start 256-byte aligned in every executor's arena."""
    if isinstance(pointer, manifest_pb2.Arg):
        pointer = pointer.pointer
    return int(getattr(pointer, "byte_offset", 0))


class KernelLibrary:
    """Compiles every ABI kernel id once per arch (cubins cached on disk under cache_dir)."""

    def __init__(self, cache_dir: Path | None = None) -> None:
        self._cache = compiler.CubinCache(Path(cache_dir) if cache_dir else DEFAULT_CACHE_DIR)
        self._compiled: dict[str, dict[str, compiler.CompiledKernel]] = {}   # arch -> id -> kernel

    @property
    def cache_dir(self) -> Path:
        return self._cache.root

    def kernel_ids(self) -> list[str]:
        """The ids of specs.KERNEL_SPECS that abi.py defines."""
        return [spec.kernel_id for spec in self._specs()]

    @staticmethod
    def _specs() -> list[KernelBuild]:
        return [spec for spec in KERNEL_SPECS if spec.kernel_id in abi.KERNELS]

    def signature(self, kernel_id: str) -> tuple[tuple[str, str], ...]:
        """(param name, Triton type) in ABI order."""
        return triton_signature(kernel_id)

    def compile(self, arch: str = "sm_90a", progress: Callable[[str], None] | None = None,
                ) -> dict[str, compiler.CompiledKernel]:
        """kernel id -> CompiledKernel; compiles what the disk cache lacks (worker processes)."""
        if arch not in self._compiled:
            requests = [self._request(spec, arch) for spec in self._specs()]
            self._compiled[arch] = compiler.compile_all(requests, self._cache, progress)
        return self._compiled[arch]

    def geometry(self, kernel_id: str, args: Sequence, arch: str = "sm_90a") -> Geometry:
        """Launch geometry of one node from its args in ABI order (pointers are not read).

        Raises specs.GeometryError when the immediates exceed the compiled tiles (e.g. more
        rows than MAX_ROWS), so a bad variant fails at preparation, not on the GPU."""
        spec = SPECS_BY_ID[kernel_id]
        signature = self.signature(kernel_id)
        if len(args) != len(signature):
            raise ValueError(f"{kernel_id}: {len(args)} args, the ABI has {len(signature)}")
        immediates = {name: _immediate(value) for (name, kind), value in zip(signature, args)
                      if not kind.startswith("*")}
        for (name, kind), value in zip(signature, args):
            if kind.startswith("*") and _byte_offset(value) % ALIGNMENT:
                raise GeometryError(f"{kernel_id}.{name}: pointer offset {_byte_offset(value)} "
                                    f"is not {ALIGNMENT}-byte aligned")
        for name in spec.divisible:
            if int(immediates[name]) % ALIGNMENT:
                raise GeometryError(f"{kernel_id}.{name} = {immediates[name]} is not a multiple "
                                    f"of {ALIGNMENT} (the cubin assumes it)")
        integers = {name: int(value) for name, value in immediates.items() if isinstance(value, numbers.Integral)}
        grid = spec.grid(integers, spec.constexprs)
        if any(d < 1 or d >= 2**31 for d in grid) or grid[1] > 65535 or grid[2] > 65535:
            raise ValueError(f"{kernel_id}: grid {grid} outside CUDA limits")
        kernel = self.compile(arch)[kernel_id]
        return grid, (32 * kernel.num_warps, 1, 1), kernel.shared_bytes

    def build_modules(self, arch: str = "sm_90a", progress: Callable[[str], None] | None = None,
                      ) -> list[tuple[bytes, manifest_pb2.KernelModule]]:
        """One (cubin bytes, KernelModule) per kernel id, in kernel_ids() order.
        KernelModule.resource is left empty: the caller names the resource holding the cubin.
        progress(kernel_id) is called as each kernel is compiled or found in the cache."""
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

    def _request(self, spec: KernelBuild, arch: str) -> compiler.CompileRequest:
        return compiler.CompileRequest(
            kernel_id=spec.kernel_id, module=spec.module, function=spec.function,
            signature=tuple(self.signature(spec.kernel_id)),
            constexprs=tuple(spec.constexprs.items()) + (("PDL", 1),),
            num_warps=spec.num_warps, num_stages=spec.num_stages, pdl=True,
            capability=capability_of(arch),
            divisible_by_16=tuple(i for i, (name, kind) in enumerate(self.signature(spec.kernel_id))
                                  if kind.startswith("*") or name in spec.divisible))
