"""KernelLibrary: the ahead-of-time compiled kernel set as the recorder and the core see it.

    library = KernelLibrary(archs=("sm_90a", "compute_80"))   # default: targets.default_archs()
    grid, block, shared = library.geometry("attention.paged.v1", args)   # args in ABI order
    for image, module in library.build_modules(progress=lambda done, total: print(done, total)):
        ...  # store image as a resource, set module.resource to its id

One kernel set per kernel id, and one KernelModule per (kernel set, architecture): a cubin for
each cubin target, the PTX of the same compilation for a portable one (targets.py). Every
copy of a set declares the same kernel table (id, symbol, parameters, warps, trailing
pointers; checked here); what may differ is declared per module: programmatic dependent
launch (sm_90 and later), pipeline depth and dynamic shared memory. Kernel.params lists the
ABI params only; Triton appends two pointer params (global and profile scratch, both unused:
sizes are checked to be 0), recorded as trailing_null_pointers = 2 and passed as 0 at launch.

Geometry needs no compilation: grids follow the spec's tiles (the same for every target) and
the block its warps; nodes record no shared memory, so the chosen module's applies.
"""
from __future__ import annotations

import numbers
import re
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

from helios_backend.kernel_abi import abi
from helios_proto import manifest_pb2

from helios_backend.executors.cuda.modules import kernel_table_disagreements
from ignition.gpu_kernels import compiler, targets
from ignition.gpu_kernels.signature import triton_signature
from ignition.gpu_kernels.specs import (ALIGNMENT, DEFAULT_ATTENTION_TILES, GeometryError, Grid,
                                    KernelBuild, kernel_specs)

Dim3 = tuple[int, int, int]
Geometry = tuple[Grid, Dim3, int]          # (grid, block, dynamic shared bytes)
Widths = frozenset[tuple[str, int]]        # (kernel id, widest immediate its cubin serves)
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "helios" / "kernels"


class KernelTargetError(ValueError):
    """A compiled kernel does not fit its target (shared memory), or the copies of a kernel
    set disagree between targets."""


def _immediate(value) -> int | float:
    """A recorded immediate: a Python number or a manifest Arg (oneof i32/i64/f32/u64)."""
    if isinstance(value, manifest_pb2.Arg):
        which = value.WhichOneof("value")
        if which in (None, "pointer"):
            raise ValueError(f"expected an immediate, got {which}")
        return getattr(value, which)
    return value


def _widths(widened: Mapping[str, int] | None) -> Widths:
    return frozenset((widened or {}).items())


def _byte_offset(pointer) -> int:
    """Byte offset of a recorded pointer (recorder Ref, BufferRef or Arg); 0 if unknown.
    Buffers themselves start 256-byte aligned in every executor's arena."""
    if isinstance(pointer, manifest_pb2.Arg):
        pointer = pointer.pointer
    return int(getattr(pointer, "byte_offset", 0))


class KernelLibrary:
    """Compiles every ABI kernel id once per target (cached on disk under cache_dir);
    attention_tiles picks attention.paged.v1's large-step tiles (specs.ATTENTION_TILES)."""

    def __init__(self, cache_dir: Path | None = None, archs: Iterable[str] | None = None,
                 attention_tiles: str = DEFAULT_ATTENTION_TILES) -> None:
        self._cache = compiler.CubinCache(Path(cache_dir) if cache_dir else DEFAULT_CACHE_DIR)
        self.targets = targets.resolve(archs)
        self.attention_tiles = attention_tiles
        self._table = kernel_specs(attention_tiles)
        self._by_id = {spec.kernel_id: spec for spec in self._table}
        # (capability, widened ids with their widest immediates) -> id -> kernel
        self._compiled: dict[tuple[int, Widths], dict[str, compiler.CompiledKernel]] = {}

    @property
    def cache_dir(self) -> Path:
        return self._cache.root

    @property
    def archs(self) -> tuple[str, ...]:
        return tuple(target.name for target in self.targets)

    def kernel_ids(self) -> list[str]:
        """The ids of specs.KERNEL_SPECS that abi.py defines."""
        return [spec.kernel_id for spec in self._specs()]

    def _specs(self) -> list[KernelBuild]:
        return [spec for spec in self._table if spec.kernel_id in abi.KERNELS]

    def spec(self, kernel_id: str) -> KernelBuild:
        """The build of `kernel_id` this library compiles (its tiles, grid, warps)."""
        return self._by_id[kernel_id]

    def signature(self, kernel_id: str) -> tuple[tuple[str, str], ...]:
        """(param name, Triton type) in ABI order."""
        return triton_signature(kernel_id)

    def compile(self, arch: str = "sm_90a", progress: Callable[[int, int], None] | None = None,
                widened: Mapping[str, int] | None = None) -> dict[str, compiler.CompiledKernel]:
        """kernel id -> CompiledKernel of `arch` (a portable arch: the compilation holding its
        PTX), the ids in `widened` with their Widening's tiles for launches up to the immediate
        given (widening_of); compiles what the disk cache lacks."""
        return self._compile_targets([targets.target(arch)], progress, _widths(widened))[
            targets.compiled_target(targets.target(arch)).capability]

    def _compile_targets(self, wanted: Sequence[targets.Target],
                         progress: Callable[[int, int], None] | None = None,
                         widened: Widths = frozenset(),
                         ) -> dict[int, dict[str, compiler.CompiledKernel]]:
        """capability -> id -> CompiledKernel for every compilation `wanted` needs, all
        missing ones in one pool of workers."""
        compiled = {targets.compiled_target(t).capability: targets.compiled_target(t) for t in wanted}
        missing = [t for capability, t in compiled.items() if (capability, widened) not in self._compiled]
        widths = dict(widened)
        requests = [self._request(spec, t, widths.get(spec.kernel_id)) for t in missing for spec in self._specs()]
        kernels = iter(compiler.compile_all(requests, self._cache, progress))
        for t in missing:
            self._compiled[(t.capability, widened)] = {spec.kernel_id: next(kernels) for spec in self._specs()}
        return {capability: self._compiled[(capability, widened)] for capability in compiled}

    def _immediates(self, kernel_id: str, args: Sequence) -> dict[str, int | float]:
        signature = self.signature(kernel_id)
        if len(args) != len(signature):
            raise ValueError(f"{kernel_id}: {len(args)} args, the ABI has {len(signature)}")
        return {name: _immediate(value) for (name, kind), value in zip(signature, args)
                if not kind.startswith("*")}

    @staticmethod
    def _integers(immediates: Mapping[str, int | float]) -> dict[str, int]:
        """The integer immediates (grids and tiles depend on no float)."""
        return {name: int(value) for name, value in immediates.items() if isinstance(value, numbers.Integral)}

    def widening_of(self, kernel_id: str, args: Sequence) -> int | None:
        """The immediate a launch with these args needs its id's tiles widened for
        (build_modules(widened={id: the widest of a core's launches})), else None."""
        return self.spec(kernel_id).widening_of(self._integers(self._immediates(kernel_id, args)))

    def early_read_conflicts(self, nodes: Sequence[manifest_pb2.Node]) -> list[str]:
        """Nodes of one program whose early reads (KernelBuild.early_reads: read before the PDL
        wait) point into a buffer the node before them writes, which may still be running:
        one message per conflict, naming both nodes and the buffers. Every pointer of a node
        that is not an ABI kernel (a collective, a copy) counts as written."""
        problems = []
        for before, node in zip(nodes, nodes[1:]):
            early = self._by_id[node.kernel].early_reads if node.kernel in self._by_id else ()
            if not early:
                continue
            names = [param.name for param in abi.kernel(node.kernel).params]
            read = {node.args[names.index(name)].pointer.buffer for name in early}
            if before.kernel in abi.KERNELS:
                written = {arg.pointer.buffer for param, arg in zip(abi.kernel(before.kernel).params, before.args)
                           if param.is_pointer and param.access is not abi.Access.READ}
            else:
                written = {arg.pointer.buffer for arg in before.args if arg.WhichOneof("value") == "pointer"}
            if read & written:
                problems.append(f"{node.label} ({node.kernel}) reads {sorted(read & written)} before its "
                                f"PDL wait, which {before.label} ({before.kernel or 'a non-kernel node'}) writes")
        return problems

    def tiles(self, kernel_id: str, args: Sequence) -> Mapping[str, int]:
        """The constexprs a launch with these args runs with (widened where it needs it)."""
        return self.spec(kernel_id).tiles(self._integers(self._immediates(kernel_id, args)))

    def geometry(self, kernel_id: str, args: Sequence,
                 constexprs: Mapping[str, int] | None = None) -> Geometry:
        """Launch geometry of one node from its args in ABI order (pointers are not read):
        (grid, block, 0); dynamic shared memory is declared per module (Kernel.shared_bytes).
        `constexprs` replaces the table's tile sizes (the interpreter tests run smaller tiles).

        Raises specs.GeometryError when the immediates exceed the compiled tiles (e.g. more
        rows than MAX_ROWS), so a bad variant fails at preparation, not on the GPU."""
        spec = self.spec(kernel_id)
        signature = self.signature(kernel_id)
        immediates = self._immediates(kernel_id, args)
        for (name, kind), value in zip(signature, args):
            if kind.startswith("*") and _byte_offset(value) % ALIGNMENT:
                raise GeometryError(f"{kernel_id}.{name}: pointer offset {_byte_offset(value)} "
                                    f"is not {ALIGNMENT}-byte aligned")
        for name in spec.divisible:
            if int(immediates[name]) % ALIGNMENT:
                raise GeometryError(f"{kernel_id}.{name} = {immediates[name]} is not a multiple "
                                    f"of {ALIGNMENT} (the cubin assumes it)")
        integers = self._integers(immediates)
        grid = spec.grid(integers, constexprs if constexprs is not None else spec.tiles(integers))
        if any(d < 1 or d >= 2**31 for d in grid) or grid[1] > 65535 or grid[2] > 65535:
            raise ValueError(f"{kernel_id}: grid {grid} outside CUDA limits")
        return grid, (32 * spec.num_warps, 1, 1), 0

    def build_modules(self, archs: Iterable[str] | None = None,
                      progress: Callable[[int, int], None] | None = None,
                      widened: Mapping[str, int] | None = None,
                      ) -> list[tuple[bytes, manifest_pb2.KernelModule]]:
        """One (image bytes, KernelModule) per (target, kernel set), targets in table order
        (default: this library's), kernel sets in kernel_ids() order. KernelModule.resource
        is left empty: the caller names the resource holding the image; the ids in `widened`
        compile with their Widening's tiles for launches up to the immediate given (a core that
        launches them wider). progress(done, total)
        is called as each compilation is done or found in the cache. KernelTargetError when a
        kernel exceeds its target's shared memory or the sets' kernel tables disagree."""
        wanted = targets.resolve(archs) if archs is not None else self.targets
        compiled = self._compile_targets(wanted, progress, _widths(widened))
        modules = []
        for target in wanted:
            kernels = compiled[targets.compiled_target(target).capability]
            for index, kernel_id in enumerate(self.kernel_ids()):
                modules.append(self._module(target, f"kernels.{index}", kernels[kernel_id]))
        problems = kernel_table_disagreements([module for _, module in modules])
        if problems:
            raise KernelTargetError("; ".join(problems))
        return modules

    @staticmethod
    def _module(target: targets.Target, kernel_set: str, kernel: compiler.CompiledKernel,
                ) -> tuple[bytes, manifest_pb2.KernelModule]:
        if kernel.shared_bytes > target.shared_limit:
            raise KernelTargetError(f"{kernel.kernel_id} on {target.name}: {kernel.shared_bytes} "
                                    f"bytes of shared memory > the {target.shared_limit} it allows")
        entry = manifest_pb2.Kernel(
            id=kernel.kernel_id, symbol=kernel.symbol,
            params=[p.kind for p in abi.kernel(kernel.kernel_id).params],
            shared_bytes=kernel.shared_bytes, num_warps=kernel.num_warps,
            trailing_null_pointers=kernel.trailing_null_pointers,
            programmatic_dependent_launch=kernel.pdl, num_stages=kernel.num_stages)
        if target.portable:
            image = kernel.ptx
            found = re.search(rb"^\.version (\S+)", kernel.ptx, re.M)
            toolchain = f"{kernel.toolchain.split(' / ')[0]} / PTX {found.group(1).decode() if found else '?'}"
        else:
            image, toolchain = kernel.cubin, kernel.toolchain
        return image, manifest_pb2.KernelModule(
            arch=target.name, toolchain=toolchain, kernels=[entry], portable=target.portable,
            capability=target.capability, kernel_set=kernel_set)

    def _request(self, spec: KernelBuild, target: targets.Target, width: int | None = None,
                 ) -> compiler.CompileRequest:
        tiles = spec.widened_tiles(width)
        return compiler.CompileRequest(
            kernel_id=spec.kernel_id, module=spec.module, function=spec.function,
            signature=tuple(self.signature(spec.kernel_id)),
            constexprs=tuple(tiles.items()) + (("PDL", int(target.pdl)),),
            num_warps=spec.num_warps, num_stages=spec.num_stages, pdl=target.pdl,
            capability=target.capability,
            divisible_by_16=tuple(i for i, (name, kind) in enumerate(self.signature(spec.kernel_id))
                                  if kind.startswith("*") or name in spec.divisible))
