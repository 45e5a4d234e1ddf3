"""The numpy executor: replays recorded programs node by node over one host arena.

Arena of one rank (uint8, allocated once at load):

    | fixed buffers, kind order, 256-byte aligned | CACHE plane 0: pages x page bytes | plane 1 | ...

Load does all the resolving: every node becomes (reference function, argument tuple)
with pointer arguments already turned into flat typed views of the arena. A step is
then: copy the staging frame in, call each bound node, copy the completion buffer out.

Weight buffers declared F16 get an f32 shadow copy (numpy has no f16 BLAS; converting
per step would dominate the step time); kernels receive the shadow wherever a node
passes a pointer into such a buffer. CACHE planes (and F16 STATE such as snapshot
continuation rows) declared F16 are, by default, held widened to f32 (`widen_f16_cache`):
kernels index cache planes by element, so the layout in elements is unchanged, and
converting gathered pages back from f16 was the largest cost of a decode step. Widened
planes skip the fp16 rounding of cached keys/values, so results differ from a device
executor by that rounding (|dlogit| ~1e-2); with widen_f16_cache=False every buffer keeps
its declared dtype. Other state keeps its dtype.

Load errors (typed, all raised before any step): UnknownKernelIdError for a kernel id
without a numpy reference, KernelArgumentError for args that do not fit the ABI,
MissingVariantError for a selected program absent from the manifest.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

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
from helios_backend.kernels import abi
from helios_backend.kernels.state import TRANSPORT_HEADER_WORDS

NUMPY_DTYPES = {C.DTYPE_F16: np.float16, C.DTYPE_BF16: None, C.DTYPE_F32: np.float32, C.DTYPE_F64: np.float64,
                C.DTYPE_I8: np.int8, C.DTYPE_U8: np.uint8, C.DTYPE_I16: np.int16, C.DTYPE_I32: np.int32,
                C.DTYPE_U32: np.uint32, C.DTYPE_I64: np.int64, C.DTYPE_U64: np.uint64}
ALIGNMENT = 256
_FIXED_KINDS = (M.BUFFER_KIND_WEIGHT, M.BUFFER_KIND_TUNED, M.BUFFER_KIND_STATE, M.BUFFER_KIND_STAGING,
                M.BUFFER_KIND_SCRATCH, M.BUFFER_KIND_COMPLETION)
_IMMEDIATE_FIELD = {abi.I32: "i32", abi.I64: "i64", abi.F32: "f32", M.PARAM_KIND_U64: "u64"}


def _align(value: int) -> int:
    return -(-value // ALIGNMENT) * ALIGNMENT


@dataclass(frozen=True)
class NumpyExecutorOptions:
    cache_pages: int = 64                         # physical pages backing each CACHE plane
    programs: Optional[frozenset[str]] = None     # programs to load; None: every serving program
    blas_threads: int = 1                         # >1 BLAS threads are slower on small GEMMs
    widen_f16_cache: bool = True                  # hold F16 cache planes as f32 (see module docstring)

    def __post_init__(self) -> None:
        if self.cache_pages < 1:
            raise ValueError("cache_pages must be >= 1")


class RankArena:
    """One rank's buffers placed in one uint8 array."""

    def __init__(self, buffers: Sequence[M.Buffer], cache_pages: int, outside: frozenset[str] = frozenset()) -> None:
        self.buffers = {b.name: b for b in buffers if b.name not in outside}
        buffers = list(self.buffers.values())
        self.offsets: dict[str, int] = {}
        self.nbytes: dict[str, int] = {}
        cursor = 0
        for kind in _FIXED_KINDS + (M.BUFFER_KIND_CACHE,):
            for b in (b for b in buffers if b.kind == kind):
                size = int(b.nbytes) * (cache_pages if kind == M.BUFFER_KIND_CACHE else 1)
                cursor = _align(cursor)
                self.offsets[b.name] = cursor
                self.nbytes[b.name] = size
                cursor += size
        self.memory = np.zeros(_align(cursor), dtype=np.uint8)

    def bytes(self, name: str) -> np.ndarray:
        start = self.offsets[name]
        return self.memory[start:start + self.nbytes[name]]

    def typed(self, name: str, dtype: np.dtype, byte_offset: int = 0) -> np.ndarray:
        region = self.bytes(name)[byte_offset:]
        usable = region.size - region.size % np.dtype(dtype).itemsize
        return region[:usable].view(dtype)


BoundNode = tuple[Callable[..., None], tuple]


class NumpyExecutor:
    """Executor protocol over numpy reference kernels (rank 0 of the manifest)."""

    def __init__(self, manifest: M.ExecutionManifest, read_resource: ResourceReader,
                 options: NumpyExecutorOptions = NumpyExecutorOptions()) -> None:
        if manifest.world_size > 1:
            raise KernelArgumentError("the numpy executor runs one rank; tensor-parallel manifests need CUDA")
        self.manifest = manifest
        self.options = options
        self.cache_pages = options.cache_pages
        programs = {p.name: p for p in manifest.programs if p.rank == 0}
        wanted = set(options.programs) if options.programs is not None else set(programs)
        missing = sorted(wanted - set(programs))
        if missing:
            raise MissingVariantError(f"programs absent from the execution catalog: {missing}")
        self._check_kernels(programs[name] for name in wanted)
        buffers = [b for b in manifest.buffers if b.rank == 0]
        widened = [b for b in buffers if options.widen_f16_cache and b.dtype == C.DTYPE_F16
                   and b.kind in (M.BUFFER_KIND_CACHE, M.BUFFER_KIND_STATE)]
        # f32 per widened buffer, outside the arena: cache planes [pages * page elements], and f16 state
        # (snapshot continuation rows hold cache pages, so they widen with the planes they copy)
        self._wide_cache = {b.name: np.zeros((options.cache_pages if b.kind == M.BUFFER_KIND_CACHE else 1)
                                             * (b.nbytes // 2), dtype=np.float32) for b in widened}
        self.arena = RankArena(buffers, options.cache_pages, frozenset(self._wide_cache))
        self._load_weights(read_resource)
        self._shadows = self._f32_shadows()
        transport = manifest.transport
        self._staging = self.arena.bytes(transport.staging_buffer)[:transport.frame_nbytes]
        self._completion = self.arena.typed(transport.completion_buffer, np.int32)[:transport.completion_nbytes // 4]
        header = next(d for d in transport.destinations if d.name == "transport.header")
        self._header = self._staging[header.byte_offset:header.byte_offset + 4 * TRANSPORT_HEADER_WORDS].view(np.int32)
        self._frames = [np.zeros(transport.frame_nbytes, dtype=np.uint8) for _ in range(max(1, transport.frames))]
        self._results: list[Optional[np.ndarray]] = [None] * len(self._frames)
        self._sequence = 0
        self._programs: dict[str, tuple[BoundNode, ...]] = {
            name: tuple(self._bind(node, f"{name}.nodes[{i}]") for i, node in enumerate(programs[name].nodes))
            for name in sorted(wanted)}
        self._blas = threadpool_limits(options.blas_threads)   # held for the executor's lifetime

    # ---- load ----------------------------------------------------------------------------
    @staticmethod
    def _check_kernels(programs: Iterable[M.Program]) -> None:
        for program in programs:
            for index, node in enumerate(program.nodes):
                if node.kind != M.NODE_KIND_KERNEL:
                    raise KernelArgumentError(f"{program.name}.nodes[{index}]: node kind "
                                              f"{M.NodeKind.Name(node.kind)} is not supported on numpy")
                if node.kernel not in abi.KERNELS:
                    raise UnknownKernelIdError(f"{program.name}.nodes[{index}]: kernel id {node.kernel!r} "
                                               "has no numpy reference")

    def _load_weights(self, read_resource: ResourceReader) -> None:
        blobs: dict[str, memoryview] = {}
        for b in self.arena.buffers.values():
            if b.kind != M.BUFFER_KIND_WEIGHT:
                continue
            if b.weight.resource not in blobs:
                blobs[b.weight.resource] = memoryview(read_resource(b.weight.resource))
            blob = blobs[b.weight.resource]
            start = int(b.weight.byte_offset)
            if start + b.nbytes > len(blob):
                raise KernelArgumentError(f"weight {b.name}: bytes {start}+{b.nbytes} beyond {b.weight.resource}")
            self.arena.bytes(b.name)[:] = np.frombuffer(blob[start:start + b.nbytes], dtype=np.uint8)

    def _f32_shadows(self) -> dict[str, np.ndarray]:
        return {b.name: self.arena.typed(b.name, np.float16).astype(np.float32)
                for b in self.arena.buffers.values()
                if b.kind == M.BUFFER_KIND_WEIGHT and b.dtype == C.DTYPE_F16}

    def _pointer(self, param: abi.Param, ref: M.BufferRef, where: str) -> np.ndarray:
        if ref.buffer in self._wide_cache:
            return self._wide_cache[ref.buffer][int(ref.byte_offset) // 2:]
        if ref.buffer not in self.arena.offsets:
            raise KernelArgumentError(f"{where}: unknown buffer {ref.buffer!r}")
        dtype = np.dtype(NUMPY_DTYPES[param.dtype])
        offset = int(ref.byte_offset)
        if offset % dtype.itemsize or offset >= self.arena.nbytes[ref.buffer]:
            raise KernelArgumentError(f"{where}: offset {offset} misaligned or outside {ref.buffer}")
        if ref.buffer in self._shadows:
            return self._shadows[ref.buffer][offset // 2:]
        return self.arena.typed(ref.buffer, dtype, offset)

    def _bind(self, node: M.Node, where: str) -> BoundNode:
        spec = abi.KERNELS[node.kernel]
        if len(node.args) != len(spec.params):
            raise KernelArgumentError(f"{where}: {len(node.args)} args, {node.kernel} declares {len(spec.params)}")
        args = []
        for param, arg in zip(spec.params, node.args):
            kind = arg.WhichOneof("value")
            if param.is_pointer:
                if kind != "pointer":
                    raise KernelArgumentError(f"{where}.{param.name}: expected a pointer, got {kind}")
                args.append(self._pointer(param, arg.pointer, f"{where}.{param.name}"))
            else:
                if kind != _IMMEDIATE_FIELD[param.kind]:
                    raise KernelArgumentError(f"{where}.{param.name}: expected {_IMMEDIATE_FIELD[param.kind]}, got {kind}")
                args.append(getattr(arg, kind))
        return spec.reference, tuple(args)

    # ---- Executor protocol -----------------------------------------------------------------
    @property
    def programs(self) -> frozenset[str]:
        return frozenset(self._programs)

    def node_count(self, program: str) -> int:
        return len(self._programs[program])

    def staging(self, frame: int) -> np.ndarray:
        return self._frames[frame]

    def launch(self, program: str, frame: int) -> None:
        nodes = self._programs.get(program)
        if nodes is None:
            raise UnknownProgramError(program)
        if self._results[frame] is not None:
            raise FrameStateError(f"frame {frame} still holds an unread completion")
        self._staging[:] = self._frames[frame]
        self._header[0] = self._sequence
        self._header[1] = frame
        self._sequence += 1
        for function, args in nodes:
            function(*args)
        self._results[frame] = self._completion.copy()

    def wait(self, frame: int) -> np.ndarray:
        result = self._results[frame]
        if result is None:
            raise FrameStateError(f"nothing submitted on frame {frame}")
        self._results[frame] = None
        return result

    def read_buffer(self, name: str, rank: int = 0) -> np.ndarray:
        if name in self._wide_cache:   # back in the declared f16 layout
            return self._wide_cache[name].astype(np.float16).view(np.uint8)
        return self.arena.bytes(name).copy()

    def buffer_view(self, name: str, dtype: np.dtype) -> np.ndarray:
        """A live typed view of a buffer (tests and the single-request driver's diagnostics)."""
        return self.arena.typed(name, dtype)

    def close(self) -> None:
        self._programs = {}
        self._shadows = {}
        self._wide_cache = {}
        self._blas.restore_original_limits()
