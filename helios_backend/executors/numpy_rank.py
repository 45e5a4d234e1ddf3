"""One rank of the numpy executor: its arena, weight shadows, widened cache planes and bound programs.

Arena of one rank (uint8, allocated once at load):

    | fixed buffers, kind order, 256-byte aligned | CACHE plane 0: pages x page bytes | plane 1 | ...

Load does all the resolving: every kernel node becomes (reference function, argument tuple)
with pointer arguments already turned into flat typed views of the arena. A program is bound
as segments of kernel nodes separated by its ALL_REDUCE nodes (each bound to the typed view of
the region it sums), so the executor can run every rank up to the next all-reduce, sum, go on.

Weight buffers declared in a block layout (kernel_abi/blocks.py) get their f32 expansion as shadow
(with q8 activations a kernel_abi/activations.Q8Weight: its products quantize their activations).
Weight buffers declared F16 get an f32 shadow copy (numpy has no f16 BLAS; converting
per step would dominate the step time); kernels receive the shadow wherever a node
passes a pointer into such a buffer. The CPU executor (executors/cpu/) binds through the
same class with `weight_shadows=False` (its compiled kernels read the f16 bytes in place)
and `implementations` replacing the references of the kernel ids it compiles. CACHE planes (and F16 STATE such as snapshot
continuation rows) declared F16 are, by default, held widened to f32 (`widen_f16_cache`):
kernels index cache planes by element, so the layout in elements is unchanged, and
converting gathered pages back from f16 was the largest cost of a decode step. Widened
planes skip the fp16 rounding of cached keys/values, so results differ from a device
executor by that rounding (|dlogit| ~1e-2); with widen_f16_cache=False every buffer keeps
its declared dtype. Other state keeps its dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np
import numpy.typing as npt
from helios_proto import contract_pb2 as C
from helios_proto import manifest_pb2 as M

from helios_backend.executors.base import KernelArgumentError, ResourceReader
from helios_backend.kernel_abi import abi, blocks
from helios_backend.kernel_abi.activations import Q8Weight
from helios_backend.kernel_abi.state import TRANSPORT_HEADER_WORDS

NUMPY_DTYPES = {C.DTYPE_F16: np.float16, C.DTYPE_BF16: None, C.DTYPE_F32: np.float32, C.DTYPE_F64: np.float64,
                C.DTYPE_I8: np.int8, C.DTYPE_U8: np.uint8, C.DTYPE_I16: np.int16, C.DTYPE_I32: np.int32,
                C.DTYPE_U32: np.uint32, C.DTYPE_I64: np.int64, C.DTYPE_U64: np.uint64}
ALIGNMENT = 256
_FIXED_KINDS = (M.BUFFER_KIND_WEIGHT, M.BUFFER_KIND_TUNED, M.BUFFER_KIND_STATE, M.BUFFER_KIND_STAGING,
                M.BUFFER_KIND_SCRATCH, M.BUFFER_KIND_COMPLETION)
_IMMEDIATE_FIELD = {abi.I32: "i32", abi.I64: "i64", abi.F32: "f32", M.PARAM_KIND_U64: "u64"}

BoundNode = tuple[Callable[..., None], tuple]


def _align(value: int) -> int:
    return -(-value // ALIGNMENT) * ALIGNMENT


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

    def typed(self, name: str, dtype: npt.DTypeLike, byte_offset: int = 0) -> np.ndarray:
        region = self.bytes(name)[byte_offset:]
        usable = region.size - region.size % np.dtype(dtype).itemsize
        return region[:usable].view(dtype)


@dataclass(frozen=True)
class BoundProgram:
    """A program of one rank: kernel segments, and between segment i and i+1 the region of all-reduce i."""

    segments: tuple[tuple[BoundNode, ...], ...]   # len(regions) + 1
    regions: tuple[np.ndarray, ...]               # typed view of exactly `count` elements per all-reduce
    labels: tuple[str, ...]                       # the all-reduce nodes' labels (diagnostics)

    @property
    def kernel_nodes(self) -> tuple[BoundNode, ...]:
        return tuple(node for segment in self.segments for node in segment)


class RankReplay:
    """Everything one rank owns in the numpy executor."""

    def __init__(self, manifest: M.ExecutionManifest, rank: int, read_resource: ResourceReader,
                 cache_pages: int, widen_f16_cache: bool, programs: Mapping[str, M.Program],
                 implementations: Mapping[str, Callable[..., None]] = {}, weight_shadows: bool = True,
                 activations: str = "f32") -> None:
        self.rank = rank
        self.implementations = implementations    # kernel id -> function replacing its reference
        self.activations = activations            # block weights' products: f32 or q8 activations
        buffers = [b for b in manifest.buffers if b.rank == rank]
        widened = [b for b in buffers if widen_f16_cache and b.dtype == C.DTYPE_F16
                   and b.kind in (M.BUFFER_KIND_CACHE, M.BUFFER_KIND_STATE)]
        # f32 per widened buffer, outside the arena: cache planes [pages * page elements], and f16 state
        # (snapshot continuation rows hold cache pages, so they widen with the planes they copy)
        self.wide_cache = {b.name: np.zeros((cache_pages if b.kind == M.BUFFER_KIND_CACHE else 1)
                                            * (b.nbytes // 2), dtype=np.float32) for b in widened}
        self.arena = RankArena(buffers, cache_pages, frozenset(self.wide_cache))
        self._load_weights(read_resource)
        self.shadows = {b.name: self.arena.typed(b.name, np.float16).astype(np.float32)
                        for b in self.arena.buffers.values()
                        if weight_shadows and b.kind == M.BUFFER_KIND_WEIGHT and b.dtype == C.DTYPE_F16}
        # block weights (kernel_abi/blocks.py): the oracle reads their f32 expansion; without shadows a
        # replacing implementation reads the blocks in place, a reference their expansion (made once)
        self.block_weights = {b.name: blocks.BlockWeight(blocks.LAYOUTS[b.dtype], self.arena.bytes(b.name),
                                                         *blocks.matrix_shape(b))
                              for b in self.arena.buffers.values()
                              if b.kind == M.BUFFER_KIND_WEIGHT and blocks.is_block(b.dtype)}
        if weight_shadows:
            for name in self.block_weights:
                self._expanded(name)
        transport = manifest.transport
        self.staging = self.arena.bytes(transport.staging_buffer)[:transport.frame_nbytes]
        self.completion = self.arena.typed(transport.completion_buffer, np.int32)[:transport.completion_nbytes // 4]
        header = next(d for d in transport.destinations if d.name == "transport.header")
        self.header = self.staging[header.byte_offset:header.byte_offset + 4 * TRANSPORT_HEADER_WORDS].view(np.int32)
        self.programs = {name: self._bind_program(program) for name, program in programs.items()}

    # ---- load ----------------------------------------------------------------------------
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

    def _bind_program(self, program: M.Program) -> BoundProgram:
        segments: list[tuple[BoundNode, ...]] = []
        regions: list[np.ndarray] = []
        labels: list[str] = []
        current: list[BoundNode] = []
        for index, node in enumerate(program.nodes):
            where = f"rank {self.rank} {program.name}.nodes[{index}]"
            if node.kind == M.NODE_KIND_ALL_REDUCE:
                segments.append(tuple(current))
                current = []
                regions.append(self._region(node, where))
                labels.append(node.label)
            else:
                current.append(self._bind(node, where))
        segments.append(tuple(current))
        return BoundProgram(tuple(segments), tuple(regions), tuple(labels))

    def _region(self, node: M.Node, where: str) -> np.ndarray:
        """The `count` elements an all-reduce sums: (pointer, i64 count, i32 dtype)."""
        if len(node.args) != 3 or node.args[0].WhichOneof("value") != "pointer":
            raise KernelArgumentError(f"{where}: an all-reduce takes (pointer, count, dtype)")
        ref, count = node.args[0].pointer, int(getattr(node.args[1], node.args[1].WhichOneof("value") or "i64"))
        dtype_id = getattr(node.args[2], node.args[2].WhichOneof("value") or "i32")
        dtype = NUMPY_DTYPES.get(dtype_id)
        buffer = self.arena.buffers.get(ref.buffer)
        if dtype is None or not np.issubdtype(dtype, np.floating):
            raise KernelArgumentError(f"{where}: all-reduce of unsupported dtype {dtype_id}")
        if ref.buffer in self.wide_cache:
            start = int(ref.byte_offset) // 2
            view = self.wide_cache[ref.buffer][start:start + count]
        elif buffer is None or buffer.kind == M.BUFFER_KIND_WEIGHT:
            raise KernelArgumentError(f"{where}: all-reduce over {ref.buffer!r}, not a writable buffer of this rank")
        else:
            view = self.arena.typed(ref.buffer, np.dtype(dtype), int(ref.byte_offset))[:count]
        if count < 1 or view.size != count or int(ref.byte_offset) % np.dtype(dtype).itemsize:
            raise KernelArgumentError(f"{where}: {count} elements at byte {ref.byte_offset} do not fit {ref.buffer}")
        return view

    def _expanded(self, name: str) -> np.ndarray:
        """The f32 matrix a block weight expands to, flat (made on first use, then kept); with q8
        activations as a Q8Weight (its products take their activations' q8 round trip)."""
        if name not in self.shadows:
            weight = self.block_weights[name]
            expanded = blocks.expand(weight.layout.dtype, weight.data, (weight.rows, weight.cols)).reshape(-1)
            self.shadows[name] = expanded.view(Q8Weight) if self.activations == "q8" else expanded
        return self.shadows[name]

    def _pointer(self, param: abi.Param, ref: M.BufferRef, where: str,
                 in_place_blocks: bool = False) -> np.ndarray | blocks.BlockWeight:
        if ref.buffer in self.wide_cache:
            return self.wide_cache[ref.buffer][int(ref.byte_offset) // 2:]
        if ref.buffer not in self.arena.offsets:
            raise KernelArgumentError(f"{where}: unknown buffer {ref.buffer!r}")
        if ref.buffer in self.block_weights:
            if int(ref.byte_offset) != 0 or param.dtype != C.DTYPE_F16:
                raise KernelArgumentError(f"{where}: block weight {ref.buffer} read at byte {ref.byte_offset} "
                                          f"as {C.DType.Name(param.dtype)} (an F16 weight parameter, byte 0 only)")
            return self.block_weights[ref.buffer] if in_place_blocks else self._expanded(ref.buffer)
        dtype = np.dtype(NUMPY_DTYPES[param.dtype])
        offset = int(ref.byte_offset)
        if offset % dtype.itemsize or offset >= self.arena.nbytes[ref.buffer]:
            raise KernelArgumentError(f"{where}: offset {offset} misaligned or outside {ref.buffer}")
        if ref.buffer in self.shadows:
            return self.shadows[ref.buffer][offset // 2:]
        return self.arena.typed(ref.buffer, dtype, offset)

    def _bind(self, node: M.Node, where: str) -> BoundNode:
        spec = abi.KERNELS[node.kernel]
        if len(node.args) != len(spec.params):
            raise KernelArgumentError(f"{where}: {len(node.args)} args, {node.kernel} declares {len(spec.params)}")
        args: list[object] = []
        compiled = node.kernel in self.implementations
        for param, arg in zip(spec.params, node.args):
            kind = arg.WhichOneof("value")
            if param.is_pointer:
                if kind != "pointer":
                    raise KernelArgumentError(f"{where}.{param.name}: expected a pointer, got {kind}")
                args.append(self._pointer(param, arg.pointer, f"{where}.{param.name}", compiled))
            else:
                if kind != _IMMEDIATE_FIELD[param.kind]:
                    raise KernelArgumentError(f"{where}.{param.name}: expected {_IMMEDIATE_FIELD[param.kind]}, got {kind}")
                args.append(getattr(arg, kind))
        return self.implementations.get(node.kernel, spec.reference), tuple(args)

    # ---- diagnostics ---------------------------------------------------------------------
    def read_buffer(self, name: str) -> np.ndarray:
        if name in self.wide_cache:   # back in the declared f16 layout
            return self.wide_cache[name].astype(np.float16).view(np.uint8)
        return self.arena.bytes(name).copy()
