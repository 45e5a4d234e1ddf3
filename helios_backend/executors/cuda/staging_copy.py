"""The step's transport: which bytes of the staging frame a program needs, and how they move.

A frame holds every destination of every operation (admission histograms, grammar masks,
...: about a megabyte for a 49k vocabulary), but one program reads only the destinations
its nodes point at. `staging_runs` derives, once per program, the byte runs to copy: the
referenced destinations (plus the transport header), merged into at most MAX_RUNS runs.

Two ways to move them, chosen at load (CudaExecutorOptions.transport; "auto" picks per
program by the bytes to move, see KERNEL_COPY_LIMIT):
  "kernel": one `helios_stage_in` kernel node reading the mapped pinned frame, one
            `helios_complete_out` node writing the mapped pinned completion frame
            (staging_copy.cu; about a microsecond each, PDL-aware where the device has PDL);
  "memcpy": one H2D memcpy node per run and one D2H memcpy node.
"""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Sequence

import numpy as np

from helios_proto import contract_pb2, manifest_pb2

from .plan import NUMPY_DTYPES, KernelLaunch, align_up

# sm_80 .. sm_100a machine code and compute_80 PTX: the driver loads the device's image
IMAGE_PATH = pathlib.Path(__file__).with_name("staging_copy.fatbin")
STAGE_IN, COMPLETE_OUT = "helios_stage_in", "helios_complete_out"
MAX_RUNS = 4
RUN_ALIGNMENT = 16                 # uint4 copies
MERGE_GAP = 4096                   # closer runs are copied as one (a gap costs less than a run)
THREADS = 256
HEADER_DESTINATION = "transport.header"
# Measured on the H200 (bench/gpu_decode.py): the copy kernel reads mapped memory at only
# ~7.5 GB/s (217 KB took 29 µs) but costs ~1 µs for a few KB; a memcpy node moves ~25 GB/s
# after a few µs of setup. "auto" uses the kernel up to this many bytes, memcpy above.
KERNEL_COPY_LIMIT = 32 * 1024
Runs = tuple[tuple[int, int], ...]       # (byte offset, bytes) of a frame, ascending, disjoint


def _destination_nbytes(destination: manifest_pb2.Destination) -> int:
    itemsize = NUMPY_DTYPES.get(destination.dtype, np.dtype(np.uint8)).itemsize
    return int(destination.elements) * itemsize


_ROW_MODES = (contract_pb2.INDEX_MODE_SUBMISSION_ROW, contract_pb2.INDEX_MODE_ACTIVE_ROW)


def binding_extents(graphs: Sequence[contract_pb2.GraphContract],
                    transport: manifest_pb2.Transport) -> dict[str, dict[str, int]]:
    """Bytes of each destination that a program's bindings can write: program -> name -> bytes.

    Shared packing writes a row-indexed destination as [rows of the program, width] with
    width = Destination.row_elements (older cores: elements / most rows of any graph binding
    it), and packed tokens up to the program's token capacity; the rest of the destination is
    never written for that program, so it need not be copied (a 1-row decode copies one
    grammar-mask row, not 128). Physical-row and scalar bindings keep the whole destination.
    """
    destinations = {d.name: d for d in transport.destinations}
    row_capacity: dict[str, int] = {}
    for graph in graphs:
        for b in graph.bindings:
            if b.index in _ROW_MODES:
                row_capacity[b.destination] = max(row_capacity.get(b.destination, 0), graph.capacity.rows)
    extents: dict[str, dict[str, int]] = {}
    for graph in graphs:
        mine = extents.setdefault(graph.program, {})
        for b in graph.bindings:
            d = destinations.get(b.destination)
            if d is None:
                continue
            full = _destination_nbytes(d)
            itemsize = full // max(int(d.elements), 1)
            if b.index in _ROW_MODES:
                width = int(d.row_elements) or int(d.elements) // max(row_capacity[b.destination], 1)
                nbytes = graph.capacity.rows * width * itemsize
            elif b.index == contract_pb2.INDEX_MODE_PACKED_TOKEN:
                nbytes = graph.capacity.tokens * itemsize
            else:
                nbytes = full
            mine[d.name] = min(full, max(mine.get(d.name, 0), nbytes))
    return extents


def staging_runs(program: manifest_pb2.Program, transport: manifest_pb2.Transport,
                 extents: dict[str, int] | None = None) -> list[tuple[int, int]]:
    """(offset, nbytes) runs of the frame that `program` reads, 16-byte aligned, <= MAX_RUNS.

    extents: bytes per destination that the program's bindings write (binding_extents);
    a destination not in it is copied whole.
    """
    frame = int(transport.frame_nbytes)
    limits = extents or {}
    spans = sorted((int(d.byte_offset),
                    int(d.byte_offset) + min(_destination_nbytes(d), limits.get(d.name, _destination_nbytes(d))),
                    d.name)
                   for d in transport.destinations)
    wanted: list[tuple[int, int]] = [(s, e) for s, e, name in spans if name == HEADER_DESTINATION]
    for node in program.nodes:
        for arg in node.args:
            if arg.WhichOneof("value") != "pointer" or arg.pointer.buffer != transport.staging_buffer:
                continue
            offset = int(arg.pointer.byte_offset)
            hit = [(s, e) for s, e, _ in spans if s <= offset < max(e, s + 1)]
            if not hit:                          # a window no destination declares: copy it all
                return [(0, align_up(frame, RUN_ALIGNMENT))]
            wanted.extend(hit)
    if not wanted:
        return []
    runs: list[list[int]] = []
    for start, end in sorted(wanted):
        start = start // RUN_ALIGNMENT * RUN_ALIGNMENT
        end = align_up(end, RUN_ALIGNMENT)
        if runs and start - runs[-1][1] <= MERGE_GAP:
            runs[-1][1] = max(runs[-1][1], end)
        else:
            runs.append([start, end])
    while len(runs) > MAX_RUNS:                  # merge across the smallest gap
        gap = min(range(len(runs) - 1), key=lambda i: runs[i + 1][0] - runs[i][1])
        runs[gap][1] = runs[gap + 1][1]
        del runs[gap + 1]
    return [(start, end - start) for start, end in runs]


def launch_runs(manifest: manifest_pb2.ExecutionManifest, graphs: Sequence[contract_pb2.GraphContract],
                programs: Sequence[str]) -> dict[str, Runs]:
    """Per program, the (offset, bytes) runs of the staging frame that any rank's copy of it
    reads (each rank's staging_runs, overlaps merged): a rank process's LAUNCH carries
    only these and the host executors copy only these into their ranks' staging buffers, as the
    CUDA executor copies only its runs to the device."""
    transport = manifest.transport
    frame = int(transport.frame_nbytes)
    extents = binding_extents([g for g in graphs if g.rank == 0], transport) if graphs else {}
    out: dict[str, Runs] = {}
    for name in programs:
        spans = sorted((start, min(start + nbytes, frame)) for p in manifest.programs if p.name == name
                       for start, nbytes in staging_runs(p, transport, extents.get(name)))
        merged: list[list[int]] = []
        for start, end in spans:
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            elif end > start:
                merged.append([start, end])
        out[name] = tuple((start, end - start) for start, end in merged)
    return out


class RawParams:
    """Kernel parameters given as raw byte blocks, one per parameter (struct params too)."""

    __slots__ = ("blocks", "argv")

    def __init__(self, blocks: Sequence[bytes]) -> None:
        self.blocks = [np.frombuffer(bytes(b) + b"\0" * (-len(b) % 8), dtype=np.uint8).copy() for b in blocks]
        self.argv = np.array([b.ctypes.data for b in self.blocks], dtype=np.uint64)


def _u64(value: int) -> bytes:
    return int(value).to_bytes(8, "little")


def _grid(nbytes: int) -> int:
    # one uint4 per thread per pass; enough blocks that a 256 KiB run takes a few passes
    return max(1, min(64, -(-nbytes // (16 * THREADS * 4))))


def stage_in_launch(staging: int, frame_device: int, runs: Sequence[tuple[int, int]]) -> KernelLaunch:
    offsets = [r[0] for r in runs] + [0] * (MAX_RUNS - len(runs))
    sizes = [r[1] for r in runs] + [0] * (MAX_RUNS - len(runs))
    struct = np.array(offsets + sizes, dtype=np.uint32).tobytes()
    params = RawParams([_u64(staging), _u64(frame_device), struct])
    return KernelLaunch(STAGE_IN, "transport.stage_in", (_grid(sum(sizes)), 1, 1), (THREADS, 1, 1), 0,
                        False, params)  # first node: no predecessor to overlap with


def complete_out_launch(host_device: int, completion: int, nbytes: int, pdl: bool = True) -> KernelLaunch:
    """The completion copy; `pdl`: overlap its launch with the last node (devices from sm_90)."""
    nbytes = align_up(nbytes, RUN_ALIGNMENT)
    params = RawParams([_u64(host_device), _u64(completion), int(nbytes).to_bytes(4, "little")])
    return KernelLaunch(COMPLETE_OUT, "transport.complete_out", (_grid(nbytes), 1, 1), (THREADS, 1, 1), 0,
                        pdl, params)


@dataclasses.dataclass(frozen=True)
class HeaderWindow:
    """Where the executor writes [sequence, frame] into each host frame at launch."""
    word_offset: int               # int32 index of the header inside the frame


def header_window(transport: manifest_pb2.Transport) -> HeaderWindow | None:
    for destination in transport.destinations:
        if destination.name == HEADER_DESTINATION:
            if destination.dtype not in (contract_pb2.DTYPE_I32, contract_pb2.DTYPE_U32) or destination.elements < 2:
                return None
            return HeaderWindow(int(destination.byte_offset) // 4)
    return None


def copy_kernel_suits(transport: str, runs: Sequence[tuple[int, int]]) -> bool:
    """Whether the staging copy of these runs goes through the copy kernel (else memcpy nodes)."""
    if transport == "auto":
        return sum(nbytes for _, nbytes in runs) <= KERNEL_COPY_LIMIT
    return transport == "kernel"
