"""The recorder: a recipe's forward pass runs against it and every kernel launch becomes a node.

    rec = Recorder(rank=0, geometry=launch_geometry)
    rec.declare(buffer)                      # physical buffers, shared by all programs of a rank
    rec.begin("decode.b8", OPERATION_DECODE, Capacity(rows=8, tokens=8))
    rec.launch("linear.residual.v1", hidden=rec.ref("hidden"), x=..., tokens=8, ...)
    rec.all_reduce("layer0.down", rec.ref("hidden"), count=8 * 576)   # world_size > 1 only
    program = rec.end()                      # manifest_pb2.Program with ordered nodes

`launch` checks every argument against the kernel ABI (helios_backend/kernel_abi/abi.py) at
record time: every parameter present, pointers into declared buffers and inside them,
immediates of the right kind. Launch geometry comes from one indirection (`geometry`),
so the AOT kernel library plugs in when it exists; without it every node gets (1,1,1).

One Recorder per tensor-parallel rank (`rank`, `world_size`): its buffers and programs are
that rank's. `all_reduce` records a NODE_KIND_ALL_REDUCE node (args: pointer, i64 element
count, i32 dtype), the in-place sum of a region across the ranks, which each executor
performs between the rank's neighbouring kernel nodes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from helios_proto import contract_pb2, manifest_pb2

from helios_backend.kernel_abi import abi, blocks

Dim = tuple[int, int, int]
Geometry = tuple[Dim, Dim, int]
GeometryFunction = Callable[[str, Sequence[object]], Geometry]


class RecordingError(ValueError):
    """A launch that does not fit the kernel ABI or the declared buffers."""


@dataclass(frozen=True)
class Ref:
    """A device address: a declared buffer plus a byte offset."""

    buffer: str
    byte_offset: int = 0


# Elements an all-reduce may sum: floating-point scratch (partial products of a rank)
_REDUCIBLE_DTYPES = {contract_pb2.DTYPE_F32: 4, contract_pb2.DTYPE_F16: 2}


def unit_geometry(kernel_id: str, args: Sequence[object]) -> Geometry:
    """Placeholder geometry used until the AOT kernel library provides real launch shapes."""
    return (1, 1, 1), (1, 1, 1), 0


def _dim3(d: Dim) -> manifest_pb2.Dim3:
    return manifest_pb2.Dim3(x=int(d[0]), y=int(d[1]), z=int(d[2]))


def _immediate(param: abi.Param, value: object) -> manifest_pb2.Arg:
    if param.kind == abi.F32:
        if not isinstance(value, (int, float)):
            raise RecordingError(f"{param.name}: expected a float, got {value!r}")
        return manifest_pb2.Arg(f32=float(value))
    if not isinstance(value, int) or isinstance(value, bool):
        raise RecordingError(f"{param.name}: expected an int, got {value!r}")
    if param.kind == abi.I32:
        if not -2**31 <= value < 2**31:
            raise RecordingError(f"{param.name}: {value} does not fit i32")
        return manifest_pb2.Arg(i32=value)
    if param.kind == abi.I64:
        return manifest_pb2.Arg(i64=value)
    return manifest_pb2.Arg(u64=value)


class Recorder:
    """Collects buffers and programs for one rank of `world_size`."""

    def __init__(self, rank: int = 0, geometry: GeometryFunction = unit_geometry, world_size: int = 1,
                 on_program: Callable[[], None] | None = None) -> None:
        """`on_program` is called as each program ends (preparation's progress)."""
        if not 0 <= rank < world_size:
            raise RecordingError(f"rank {rank} outside a world of {world_size}")
        self.rank = rank
        self.world_size = world_size
        self._geometry = geometry
        self.buffers: dict[str, manifest_pb2.Buffer] = {}
        self.programs: list[manifest_pb2.Program] = []
        self._current: manifest_pb2.Program | None = None
        self._on_program = on_program

    # ---- buffers --------------------------------------------------------------------------
    def declare(self, buffer: manifest_pb2.Buffer) -> Ref:
        existing = self.buffers.get(buffer.name)
        if existing is not None and existing != buffer:
            raise RecordingError(f"buffer {buffer.name!r} declared twice with different layouts")
        buffer.rank = self.rank
        self.buffers[buffer.name] = buffer
        return Ref(buffer.name)

    def ref(self, name: str, byte_offset: int = 0) -> Ref:
        if name not in self.buffers:
            raise RecordingError(f"no buffer named {name!r}")
        return Ref(name, byte_offset)

    # ---- programs -------------------------------------------------------------------------
    def begin(self, name: str, operation: contract_pb2.Operation.ValueType, capacity: contract_pb2.Capacity) -> None:
        if self._current is not None:
            raise RecordingError(f"program {self._current.name!r} is still open")
        if any(p.name == name for p in self.programs):
            raise RecordingError(f"program {name!r} recorded twice")
        self._current = manifest_pb2.Program(name=name, operation=operation, rank=self.rank)
        self._current.capacity.CopyFrom(capacity)

    def end(self) -> manifest_pb2.Program:
        if self._current is None:
            raise RecordingError("no open program")
        program, self._current = self._current, None
        self.programs.append(program)
        if self._on_program is not None:
            self._on_program()
        return program

    def launch(self, kernel_id: str, label: str = "", **args: object) -> None:
        """Append one kernel node; `args` are keyed by ABI parameter name."""
        if self._current is None:
            raise RecordingError("launch outside begin()/end()")
        spec = abi.kernel(kernel_id)
        missing = [p.name for p in spec.params if p.name not in args]
        extra = sorted(set(args) - {p.name for p in spec.params})
        if missing or extra:
            raise RecordingError(f"{kernel_id}: missing {missing}, unexpected {extra}")
        ordered = [args[p.name] for p in spec.params]
        node = manifest_pb2.Node(kind=manifest_pb2.NODE_KIND_KERNEL, kernel=kernel_id, label=label)
        for param, value in zip(spec.params, ordered):
            node.args.append(self._pointer(kernel_id, param, value) if param.is_pointer else _immediate(param, value))
        grid, block, shared = self._geometry(kernel_id, ordered)
        node.grid.CopyFrom(_dim3(grid))
        node.block.CopyFrom(_dim3(block))
        node.shared_bytes = int(shared)
        self._current.nodes.append(node)

    def all_reduce(self, label: str, region: Ref, count: int) -> None:
        """Append an in-place sum across ranks of `count` elements at `region` (its buffer's dtype)."""
        if self._current is None:
            raise RecordingError("all_reduce outside begin()/end()")
        if self.world_size < 2:
            raise RecordingError(f"{label}: an all-reduce needs more than one rank")
        buffer = self.buffers.get(region.buffer)
        if buffer is None:
            raise RecordingError(f"{label}: no buffer named {region.buffer!r}")
        itemsize = _REDUCIBLE_DTYPES.get(buffer.dtype)
        if itemsize is None:
            raise RecordingError(f"{label}: cannot sum {contract_pb2.DType.Name(buffer.dtype)} buffer {buffer.name!r}")
        if count < 1 or region.byte_offset % itemsize or region.byte_offset + count * itemsize > buffer.nbytes:
            raise RecordingError(f"{label}: {count} elements at byte {region.byte_offset} do not fit {buffer.name!r}")
        pointer = manifest_pb2.BufferRef(buffer=region.buffer, byte_offset=region.byte_offset)
        self._current.nodes.append(manifest_pb2.Node(
            kind=manifest_pb2.NODE_KIND_ALL_REDUCE, label=label,
            args=[manifest_pb2.Arg(pointer=pointer), manifest_pb2.Arg(i64=count), manifest_pb2.Arg(i32=buffer.dtype)]))

    def _pointer(self, kernel_id: str, param: abi.Param, value: object) -> manifest_pb2.Arg:
        if isinstance(value, str):
            value = Ref(value)
        if not isinstance(value, Ref):
            raise RecordingError(f"{kernel_id}.{param.name}: expected a buffer reference, got {value!r}")
        buffer = self.buffers.get(value.buffer)
        if buffer is None:
            raise RecordingError(f"{kernel_id}.{param.name}: no buffer named {value.buffer!r}")
        if not 0 <= value.byte_offset < buffer.nbytes:
            raise RecordingError(f"{kernel_id}.{param.name}: offset {value.byte_offset} outside {value.buffer}")
        if blocks.is_block(buffer.dtype) and not self._reads_blocks(param, buffer, value):
            raise RecordingError(f"{kernel_id}.{param.name}: {contract_pb2.DType.Name(buffer.dtype)} weight "
                                 f"{value.buffer} is read from byte 0 by an F16 weight parameter only")
        if (buffer.kind != manifest_pb2.BUFFER_KIND_STAGING and buffer.dtype != param.dtype
                and not blocks.is_block(buffer.dtype)):
            raise RecordingError(
                f"{kernel_id}.{param.name}: buffer {value.buffer} holds "
                f"{contract_pb2.DType.Name(buffer.dtype)}, parameter wants {contract_pb2.DType.Name(param.dtype)}")
        return manifest_pb2.Arg(pointer=manifest_pb2.BufferRef(buffer=value.buffer, byte_offset=value.byte_offset))

    @staticmethod
    def _reads_blocks(param: abi.Param, buffer: manifest_pb2.Buffer, value: Ref) -> bool:
        """A block weight (kernel_abi/blocks.py) stands for the F16 matrix it expands to: a kernel
        reads it through an F16 parameter, from its start (executors locate rows by the layout)."""
        return (buffer.kind == manifest_pb2.BUFFER_KIND_WEIGHT and param.dtype == contract_pb2.DTYPE_F16
                and value.byte_offset == 0)

    def last_args(self, kernel_id: str) -> dict[str, object]:
        """Args (Ref or immediate, by ABI name) of the open program's last node of `kernel_id`."""
        if self._current is None:
            raise RecordingError("no open program")
        for node in reversed(self._current.nodes):
            if node.kernel == kernel_id:
                out: dict[str, object] = {}
                for param, arg in zip(abi.kernel(kernel_id).params, node.args):
                    which = arg.WhichOneof("value")
                    if which is None:
                        raise RecordingError(f"{self._current.name}: {kernel_id}.{param.name} has no value")
                    out[param.name] = (Ref(arg.pointer.buffer, arg.pointer.byte_offset) if which == "pointer"
                                       else getattr(arg, which))
                return out
        raise RecordingError(f"{self._current.name}: no {kernel_id} node recorded")

    def node_counts(self) -> Mapping[str, int]:
        return {p.name: len(p.nodes) for p in self.programs}

    def forward_view(self) -> "ForwardRecorder":
        return ForwardRecorder(self)


# Buffers a recipe's forward pass may only read: weights, per-slot state, transport and completion records
# are written by the shared declarations alone (recipes cannot install state-update code, OWN-8).
_FORWARD_READ_ONLY_KINDS = (manifest_pb2.BUFFER_KIND_STATE, manifest_pb2.BUFFER_KIND_STAGING,
                      manifest_pb2.BUFFER_KIND_COMPLETION, manifest_pb2.BUFFER_KIND_WEIGHT)


class ForwardRecorder:
    """What a recipe's forward pass records through: launches that write scratch or cache only."""

    def __init__(self, recorder: Recorder) -> None:
        self._recorder = recorder

    @property
    def rank(self) -> int:
        return self._recorder.rank

    @property
    def world_size(self) -> int:
        return self._recorder.world_size

    def ref(self, name: str, byte_offset: int = 0) -> Ref:
        return self._recorder.ref(name, byte_offset)

    def all_reduce(self, label: str, region: Ref, count: int) -> None:
        """Sum a scratch region across ranks (a forward pass may not sum state or weights)."""
        self._writable(f"all_reduce {label}", region.buffer)
        self._recorder.all_reduce(label, region, count)

    def _writable(self, what: str, name: object) -> None:
        buffer = self._recorder.buffers.get(name) if isinstance(name, str) else None
        if buffer is not None and buffer.kind in _FORWARD_READ_ONLY_KINDS:
            raise RecordingError(f"{what}: a recipe's forward pass may not write "
                                 f"{manifest_pb2.BufferKind.Name(buffer.kind)} buffer {name!r}")

    def launch(self, kernel_id: str, label: str = "", **args: object) -> None:
        spec = abi.kernel(kernel_id)
        for param in spec.params:
            if not param.is_pointer or param.access == abi.Access.READ or param.name not in args:
                continue
            value = args[param.name]
            self._writable(f"{kernel_id}.{param.name}", value.buffer if isinstance(value, Ref) else value)
        self._recorder.launch(kernel_id, label, **args)
