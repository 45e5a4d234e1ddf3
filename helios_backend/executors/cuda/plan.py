"""Launch plans: a recorded Program turned into resolved, pre-packed launches (no driver).

Everything here is pure Python/numpy so it runs (and is tested) without a GPU:

* `layout_arena` places one rank's non-cache buffers in one arena (byte offsets, each
  start aligned) and lists the CACHE buffers, which live in their own address windows
  because their size is only known after graphs load (see arena.py).
* `plan_program` resolves every node of a program against the kernel table and the
  buffers' device addresses: a pointer argument becomes base + byte offset, immediates
  are packed once into a parameter block (`ParamPack`) whose `argv` is the `void*[]` the
  driver wants. Nothing is packed per step: the packs are consumed by graph capture.

Arena of one rank (fixed part, mapped at startup; cache windows follow, mapped later):

    | WEIGHT ... | TUNED ... | STATE ... | STAGING | COMPLETION | SCRATCH ... || CACHE 0 window | CACHE 1 ...
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Protocol, Sequence, Union

import numpy as np

from helios_proto import contract_pb2, manifest_pb2

from .errors import ManifestError, ProgramError
from .vendor_products import VENDOR_PRODUCTS, ProductLaunch

MIN_ALIGNMENT = 256                    # cudaMalloc's guarantee; every buffer start at least this
THREADS_PER_WARP = 32

# Order of the fixed part: read-only first, per-step temporaries last.
_FIXED_ORDER = (
    manifest_pb2.BUFFER_KIND_WEIGHT,
    manifest_pb2.BUFFER_KIND_TUNED,
    manifest_pb2.BUFFER_KIND_STATE,
    manifest_pb2.BUFFER_KIND_STAGING,
    manifest_pb2.BUFFER_KIND_COMPLETION,
    manifest_pb2.BUFFER_KIND_SCRATCH,
)

NUMPY_DTYPES: Mapping[int, np.dtype] = {
    contract_pb2.DTYPE_F16: np.dtype(np.float16),
    contract_pb2.DTYPE_BF16: np.dtype(np.uint16),     # raw bits: numpy has no bfloat16
    contract_pb2.DTYPE_F32: np.dtype(np.float32),
    contract_pb2.DTYPE_F64: np.dtype(np.float64),
    contract_pb2.DTYPE_I8: np.dtype(np.int8),
    contract_pb2.DTYPE_U8: np.dtype(np.uint8),
    contract_pb2.DTYPE_I16: np.dtype(np.int16),
    contract_pb2.DTYPE_I32: np.dtype(np.int32),
    contract_pb2.DTYPE_U32: np.dtype(np.uint32),
    contract_pb2.DTYPE_I64: np.dtype(np.int64),
    contract_pb2.DTYPE_U64: np.dtype(np.uint64),
}


def align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


@dataclasses.dataclass(frozen=True)
class ArenaLayout:
    """Byte offsets of one rank's fixed buffers, and its CACHE buffers' page sizes."""
    rank: int
    fixed_nbytes: int
    offsets: Mapping[str, int]          # fixed buffer name -> byte offset in the arena
    buffers: Mapping[str, manifest_pb2.Buffer]
    cache_page_nbytes: Mapping[str, int]  # CACHE buffer name -> bytes of one page

    @property
    def bytes_per_page(self) -> int:
        """Bytes one physical page costs over all CACHE buffers."""
        return sum(self.cache_page_nbytes.values())


def layout_arena(buffers: Sequence[manifest_pb2.Buffer], rank: int) -> ArenaLayout:
    """Place `rank`'s buffers: fixed ones packed in kind order, CACHE ones listed apart."""
    mine = [b for b in buffers if b.rank == rank]
    names = [b.name for b in mine]
    if len(set(names)) != len(names):
        raise ManifestError(f"rank {rank}: duplicate buffer names")
    offsets: dict[str, int] = {}
    cursor = 0
    for kind in _FIXED_ORDER:
        for buffer in (b for b in mine if b.kind == kind):
            if buffer.nbytes == 0:
                raise ManifestError(f"buffer {buffer.name}: zero bytes")
            cursor = align_up(cursor, max(MIN_ALIGNMENT, buffer.alignment))
            offsets[buffer.name] = cursor
            cursor += buffer.nbytes
    cache = {b.name: int(b.nbytes) for b in mine if b.kind == manifest_pb2.BUFFER_KIND_CACHE}
    unknown = [b.name for b in mine if b.kind not in _FIXED_ORDER
               and b.kind != manifest_pb2.BUFFER_KIND_CACHE]
    if unknown:
        raise ManifestError(f"buffers of unspecified kind: {unknown}")
    if any(n == 0 for n in cache.values()):
        raise ManifestError("a CACHE buffer declares zero bytes per page")
    return ArenaLayout(rank, align_up(cursor, MIN_ALIGNMENT), offsets,
                       {b.name: b for b in mine}, cache)


@dataclasses.dataclass(frozen=True)
class BufferAddresses:
    """Device address and byte size of every buffer of one rank, once memory is placed."""
    base: Mapping[str, int]
    nbytes: Mapping[str, int]

    def resolve(self, ref: manifest_pb2.BufferRef, where: str) -> int:
        if ref.buffer not in self.base:
            raise ProgramError(f"{where}: unknown buffer {ref.buffer!r}")
        if ref.byte_offset >= self.nbytes[ref.buffer]:
            raise ProgramError(f"{where}: offset {ref.byte_offset} outside {ref.buffer} "
                               f"({self.nbytes[ref.buffer]} bytes)")
        return self.base[ref.buffer] + int(ref.byte_offset)


class KernelParams(Protocol):
    """What a launch hands cuLaunchKernelEx: `argv`, the void*[] over the parameter values
    (ParamPack for recorded kernels, staging_copy.RawParams for the staging copy's own kernels)."""
    argv: np.ndarray


class ParamPack:
    """One launch's kernel parameters, packed once: 8-byte slots plus the void*[] over them.

    `argv.ctypes.data` is what cuLaunchKernel(Ex) takes as kernelParams; the driver reads
    each slot by the kernel's own parameter size (4 or 8 bytes, little endian), so every
    value sits at the start of its own 8-byte slot.
    """

    __slots__ = ("values", "argv")

    def __init__(self, slots: Sequence[tuple[int, int | float]]) -> None:
        # slots: (ParamKind, value); trailing null pointers are POINTER slots of value 0
        self.values = np.zeros(max(len(slots), 1), dtype=np.uint64)
        raw = self.values.view(np.uint8)
        for index, (kind, value) in enumerate(slots):
            piece = raw[index * 8:(index + 1) * 8]
            if kind in (manifest_pb2.PARAM_KIND_POINTER, manifest_pb2.PARAM_KIND_U64):
                piece.view(np.uint64)[0] = np.uint64(value)
            elif kind == manifest_pb2.PARAM_KIND_I64:
                piece.view(np.int64)[0] = np.int64(value)
            elif kind == manifest_pb2.PARAM_KIND_I32:
                piece[:4].view(np.int32)[0] = np.int32(value)
            elif kind == manifest_pb2.PARAM_KIND_F32:
                piece[:4].view(np.float32)[0] = np.float32(value)
            else:
                raise ProgramError(f"unspecified parameter kind at slot {index}")
        base = self.values.ctypes.data
        self.argv = np.array([base + 8 * i for i in range(len(slots))] or [0], dtype=np.uint64)

    def slot(self, index: int, kind: int) -> int | float:
        """Decode one slot back (tests and diagnostics)."""
        piece = self.values.view(np.uint8)[index * 8:(index + 1) * 8]
        if kind == manifest_pb2.PARAM_KIND_I32:
            return int(piece[:4].view(np.int32)[0])
        if kind == manifest_pb2.PARAM_KIND_F32:
            return float(piece[:4].view(np.float32)[0])
        if kind == manifest_pb2.PARAM_KIND_I64:
            return int(piece.view(np.int64)[0])
        return int(piece.view(np.uint64)[0])


@dataclasses.dataclass(frozen=True)
class KernelLaunch:
    kernel_id: str
    label: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int
    pdl: bool                          # launch with programmatic stream serialization
    params: KernelParams


@dataclasses.dataclass(frozen=True)
class AllReduceLaunch:
    label: str
    address: int                       # in-place buffer
    count: int                         # elements
    dtype: contract_pb2.DType.ValueType


Launch = Union[KernelLaunch, AllReduceLaunch, ProductLaunch]

_ARG_KIND = {"pointer": manifest_pb2.PARAM_KIND_POINTER, "i32": manifest_pb2.PARAM_KIND_I32,
             "i64": manifest_pb2.PARAM_KIND_I64, "f32": manifest_pb2.PARAM_KIND_F32,
             "u64": manifest_pb2.PARAM_KIND_U64}


def kernel_table(modules: Sequence[manifest_pb2.KernelModule]) -> dict[str, tuple[int, manifest_pb2.Kernel]]:
    """Kernel id -> (module index, Kernel entry); duplicate ids fail startup."""
    table: dict[str, tuple[int, manifest_pb2.Kernel]] = {}
    for index, module in enumerate(modules):
        for kernel in module.kernels:
            if kernel.id in table:
                raise ManifestError(f"kernel id {kernel.id!r} declared twice")
            table[kernel.id] = (index, kernel)
    return table


def _dim3(dim: manifest_pb2.Dim3) -> tuple[int, int, int]:
    return (max(dim.x, 1), max(dim.y, 1), max(dim.z, 1))


def _plan_kernel(node: manifest_pb2.Node, kernel: manifest_pb2.Kernel, addresses: BufferAddresses,
                 where: str) -> KernelLaunch:
    if len(node.args) != len(kernel.params):
        raise ProgramError(f"{where}: {len(node.args)} arguments for {len(kernel.params)} parameters "
                           f"of {kernel.id}")
    slots: list[tuple[int, int | float]] = []
    for index, (arg, kind) in enumerate(zip(node.args, kernel.params)):
        which = arg.WhichOneof("value")
        if which is None or _ARG_KIND[which] != kind:
            raise ProgramError(f"{where}: argument {index} is {which}, "
                               f"{kernel.id} expects {manifest_pb2.ParamKind.Name(kind)}")
        value = addresses.resolve(arg.pointer, where) if which == "pointer" else getattr(arg, which)
        slots.append((kind, value))
    slots.extend((manifest_pb2.PARAM_KIND_POINTER, 0) for _ in range(kernel.trailing_null_pointers))
    if node.grid.x == 0:
        raise ProgramError(f"{where}: empty grid")
    grid = _dim3(node.grid)
    threads = THREADS_PER_WARP * kernel.num_warps
    block = _dim3(node.block) if node.block.x else (threads, 1, 1)
    if kernel.num_warps and block[0] * block[1] * block[2] != threads:
        raise ProgramError(f"{where}: block {block} but {kernel.id} is compiled for {threads} threads")
    shared = node.shared_bytes or kernel.shared_bytes
    return KernelLaunch(kernel.id, node.label, grid, block, int(shared),
                        bool(kernel.programmatic_dependent_launch), ParamPack(slots))


def _plan_all_reduce(node: manifest_pb2.Node, addresses: BufferAddresses, where: str) -> AllReduceLaunch:
    if len(node.args) != 3 or node.args[0].WhichOneof("value") != "pointer":
        raise ProgramError(f"{where}: an all-reduce takes (pointer, count, dtype)")
    count_arg, dtype_arg = node.args[1], node.args[2]
    count = getattr(count_arg, count_arg.WhichOneof("value") or "i64")
    dtype = contract_pb2.DType.ValueType(int(getattr(dtype_arg, dtype_arg.WhichOneof("value") or "i32")))
    if dtype not in NUMPY_DTYPES:
        raise ProgramError(f"{where}: all-reduce of unsupported dtype {dtype}")
    address = addresses.resolve(node.args[0].pointer, where)
    buffer_end = addresses.base[node.args[0].pointer.buffer] + addresses.nbytes[node.args[0].pointer.buffer]
    if address + int(count) * NUMPY_DTYPES[dtype].itemsize > buffer_end:
        raise ProgramError(f"{where}: all-reduce runs past its buffer")
    return AllReduceLaunch(node.label, address, int(count), dtype)


def _plan_product(node: manifest_pb2.Node, kernel: manifest_pb2.Kernel, addresses: BufferAddresses,
                  where: str) -> ProductLaunch:
    """A product-path node as a vendor library call: its cubin's launch checks the arguments
    (kinds and addresses), then (out, x, weight, geometry, tokens, in_dim, out_dim) are read off."""
    _plan_kernel(node, kernel, addresses, where)
    out, x, weight = (addresses.resolve(node.args[i].pointer, where) for i in range(3))
    tokens, in_dim, out_dim = (int(node.args[i].i32) for i in range(4, 7))
    return ProductLaunch(node.kernel, node.label, out, x, weight, tokens, in_dim, out_dim)


def plan_program(program: manifest_pb2.Program,
                 kernels: Mapping[str, tuple[int, manifest_pb2.Kernel]],
                 addresses: BufferAddresses, vendor_products: bool = False) -> list[Launch]:
    """Resolve a program's nodes into launches; ProgramError on any ABI or layout mismatch.
    vendor_products: the product path's ids (vendor_products.VENDOR_PRODUCTS) become library calls."""
    launches: list[Launch] = []
    for index, node in enumerate(program.nodes):
        where = f"{program.name}[{index}] {node.label or node.kernel}"
        if node.kind == manifest_pb2.NODE_KIND_KERNEL:
            if node.kernel not in kernels:
                raise ProgramError(f"{where}: unknown kernel id {node.kernel!r}")
            if vendor_products and node.kernel in VENDOR_PRODUCTS:
                launches.append(_plan_product(node, kernels[node.kernel][1], addresses, where))
                continue
            launches.append(_plan_kernel(node, kernels[node.kernel][1], addresses, where))
        elif node.kind == manifest_pb2.NODE_KIND_ALL_REDUCE:
            launches.append(_plan_all_reduce(node, addresses, where))
        else:
            raise ProgramError(f"{where}: unspecified node kind")
    return launches
