"""Shared packing: the declared value bindings of a program, written into a staging frame.

Startup (Packer.__init__) resolves every binding of every selected graph once:
destination -> (frame byte offset, dtype, capacity in elements, per-row width), and the
(source, index mode) pair -> one small function from two tables. Per step, `pack`
only evaluates those functions for the submitted lanes and writes values.

    VALUE_SOURCES   source -> value of one lane (row modes, packed tokens) or of the whole
                    submission (scalar sources)
    INDEX_WRITERS   index mode -> how values land in the destination:
        SCALAR          dest[0] = value
        SUBMISSION_ROW  dest[r * w:(r + 1) * w] for r < lanes; rows lanes..capacity get padding
        ACTIVE_ROW      same, inactive tail untouched
        PHYSICAL_ROW    dest[slot * w:(slot + 1) * w]; page tables: only entries not yet written
        PACKED_TOKEN    lanes' values back to back, following each lane's actual token count

Page tables (BND-33/34): each frame remembers, per physical slot, the generation and the
number of page-table entries already written into that frame; a step writes only the new
entries. A different generation on the slot forgets the remembered length and rewrites.

Admission histograms (BND-32) are built once per request from its prompt (`Admission.for_prompt`)
and travel only in the INITIALIZATION program.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

import numpy as np
from helios_proto import contract_pb2 as C
from helios_proto import manifest_pb2 as M


_NUMPY = {C.DTYPE_I32: np.int32, C.DTYPE_U32: np.uint32, C.DTYPE_F32: np.float32, C.DTYPE_I64: np.int64,
          C.DTYPE_U64: np.uint64, C.DTYPE_U8: np.uint8, C.DTYPE_I8: np.int8, C.DTYPE_I16: np.int16}


class PackingError(ValueError):
    """A binding the packer cannot serve (raised at startup) or lanes beyond a program's capacity."""


class CapacityError(PackingError):
    """The submitted lanes do not fit the program's captured rows or packed tokens."""


@dataclass(frozen=True)
class SamplingParameters:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def vector(self) -> np.ndarray:
        return np.array([self.temperature, self.top_p, self.top_k, self.min_p, self.presence_penalty,
                         self.frequency_penalty, self.repetition_penalty, 0.0], dtype=np.float32)


@dataclass(frozen=True)
class Admission:
    """What INITIALIZATION copies into a slot: sampling state of one request."""

    seed: int                       # 64 bits; Philox key = (low word, high word)
    sampling: SamplingParameters
    output_limit: int
    eos_ids: tuple[int, ...]
    prompt_histogram: np.ndarray    # int32 [histogram_bins]

    @staticmethod
    def for_prompt(prompt: Sequence[int], histogram_bins: int, seed: int, sampling: SamplingParameters,
                   output_limit: int, eos_ids: Sequence[int]) -> "Admission":
        histogram = np.bincount(np.asarray(prompt, dtype=np.int64), minlength=histogram_bins)
        return Admission(seed, sampling, output_limit, tuple(eos_ids), histogram[:histogram_bins].astype(np.int32))


@dataclass
class Lane:
    """One request row of a submission."""

    slot: int
    generation: int
    consumed: int = 0                         # tokens already in the slot's history
    tokens: Optional[np.ndarray] = None       # host query tokens; None = one device-owned pending token
    sample: bool = True                       # draw a token after this step
    pages: Sequence[int] = ()                 # the slot's page list, covering consumed + query_length
    grammar_mask: Optional[np.ndarray] = None  # uint32 [mask_words]; None = unconstrained
    admission: Optional[Admission] = None     # INITIALIZATION lanes only
    snapshot_row: int = -1                    # continuation row receiving the partial page at the endpoint
    restore_row: int = -1                     # RESTORATION: continuation row copied into the endpoint's page
    pending_token: int = -1                   # RESUME: the host-owned pending token (tokens stays None)
    scored_targets: Optional[np.ndarray] = None   # SCORED_PREFILL: target token per query token (-1: none)
    # SPECULATIVE lanes (pending token + copied proposals; docs/speculative.md)
    proposals: Optional[np.ndarray] = None    # int32 copied candidate ids verified after the pending token
    proposal_generation: int = -1             # generation / consumed endpoint the copies were made for
    proposal_consumed: int = -1
    prefix_limit: int = 0                     # >0: device-allocated lane ceiling (SPECULATIVE_PREFIX_LIMIT)

    @property
    def query_length(self) -> int:
        if self.tokens is None:
            if self.prefix_limit:             # the program writes the actual length (<= ceiling, total <= P)
                return 1
            return 1 + (0 if self.proposals is None else len(self.proposals))
        return len(self.tokens)


def _need_admission(lane: Lane) -> Admission:
    if lane.admission is None:
        raise PackingError(f"lane of slot {lane.slot} has no admission values")
    return lane.admission


# ---- value sources ---------------------------------------------------------------------------
# Per-lane sources: lane -> int or 1-D array. Scalar sources: (lanes, binding) -> int.

LaneSource = Callable[[Lane], "int | np.ndarray | Sequence[int]"]
ScalarSource = Callable[[Sequence[Lane], C.ValueBinding], int]

LANE_SOURCES: Mapping[int, LaneSource] = {
    C.VALUE_SOURCE_SLOT: lambda lane: lane.slot,
    C.VALUE_SOURCE_GENERATION: lambda lane: lane.generation,
    C.VALUE_SOURCE_QUERY_LENGTH: lambda lane: lane.query_length,
    C.VALUE_SOURCE_SAMPLING_DECISION: lambda lane: int(lane.sample),
    C.VALUE_SOURCE_CONSUMED_TOKENS: lambda lane: lane.consumed,
    C.VALUE_SOURCE_PROMPT_TOKENS: lambda lane: lane.tokens,     # None -> padding (device token)
    C.VALUE_SOURCE_PROMPT_POSITIONS: lambda lane: np.arange(lane.consumed, lane.consumed + lane.query_length),
    C.VALUE_SOURCE_PAGE_TABLE: lambda lane: lane.pages,
    C.VALUE_SOURCE_SNAPSHOT_DESTINATION: lambda lane: lane.snapshot_row,
    C.VALUE_SOURCE_RESTORE_SOURCE: lambda lane: lane.restore_row,
    C.VALUE_SOURCE_PENDING_TOKEN: lambda lane: lane.pending_token,   # RESUME: host-owned pending token
    C.VALUE_SOURCE_SCORED_TARGET_TOKENS: lambda lane: lane.scored_targets,   # None -> padding (-1)
    C.VALUE_SOURCE_GRAMMAR_MASK: lambda lane: lane.grammar_mask,  # None -> padding (all allowed)
    C.VALUE_SOURCE_SEED_BITS: lambda lane: np.array([_need_admission(lane).seed & 0xFFFFFFFF,
                                                     (_need_admission(lane).seed >> 32) & 0xFFFFFFFF]),
    C.VALUE_SOURCE_SAMPLING_PARAMETERS: lambda lane: _need_admission(lane).sampling.vector(),
    C.VALUE_SOURCE_OUTPUT_LIMIT: lambda lane: _need_admission(lane).output_limit,
    C.VALUE_SOURCE_EOS_IDS: lambda lane: np.asarray(_need_admission(lane).eos_ids, dtype=np.int64),
    C.VALUE_SOURCE_PROMPT_HISTOGRAM: lambda lane: _need_admission(lane).prompt_histogram,
    C.VALUE_SOURCE_PROPOSAL_IDS: lambda lane: lane.proposals,      # None -> padding
    C.VALUE_SOURCE_PROPOSAL_COUNT: lambda lane: 0 if lane.proposals is None else len(lane.proposals),
    C.VALUE_SOURCE_PROPOSAL_GENERATION: lambda lane: lane.proposal_generation,
    C.VALUE_SOURCE_PROPOSAL_CONSUMED: lambda lane: lane.proposal_consumed,
    C.VALUE_SOURCE_SPECULATIVE_PREFIX_LIMIT: lambda lane: lane.prefix_limit,
}


def _mixed_prefill_row(lanes: Sequence[Lane], binding: C.ValueBinding) -> int:
    rows = [i for i, lane in enumerate(lanes) if lane.tokens is not None]
    if len(rows) > 1:
        raise CapacityError(f"a mixed step carries one prefill row, got {len(rows)}")
    return rows[0] if rows else int(binding.padding)


SCALAR_SOURCES: Mapping[int, ScalarSource] = {
    C.VALUE_SOURCE_LIVE_ROW_COUNT: lambda lanes, binding: len(lanes),
    C.VALUE_SOURCE_MIXED_PREFILL_ROW: _mixed_prefill_row,
    C.VALUE_SOURCE_CONSTANT: lambda lanes, binding: int(binding.constant),
}


# ---- index modes -----------------------------------------------------------------------------

@dataclass
class Target:
    """A resolved destination inside one frame."""

    view: np.ndarray          # typed view of the destination in the frame
    width: int                # elements per row (row modes) or 1
    rows: int                 # program's captured rows
    binding: C.ValueBinding
    memory: dict = field(default_factory=dict)   # PHYSICAL_ROW page tables: slot -> (generation, written)


def _as_values(value, target: Target, length: int) -> np.ndarray:
    """One lane's value as `length` elements of the destination dtype: the offset is added to the
    values, then the row is padded with the bare padding value (BND-17; like padding rows)."""
    if value is None:
        out = np.full(length, target.binding.padding, dtype=np.int64)
    else:
        out = np.asarray(value)
        if out.ndim == 0:
            out = out.reshape(1)
        if out.dtype.kind in "iu" and target.binding.offset:
            out = out + target.binding.offset
        if out.size < length:
            out = np.concatenate([out, np.full(length - out.size, target.binding.padding, dtype=out.dtype)])
    return out.astype(target.view.dtype, copy=False)


def _write_rows(target: Target, lanes: Sequence[Lane], source: LaneSource, pad_tail: bool) -> None:
    width = target.width
    rows = target.view[: target.rows * width].reshape(target.rows, width)
    for r, lane in enumerate(lanes):
        rows[r] = _as_values(source(lane), target, width)
    if pad_tail and len(lanes) < target.rows:
        rows[len(lanes):] = np.array(target.binding.padding).astype(target.view.dtype)


def _write_submission_rows(target: Target, lanes: Sequence[Lane], source: LaneSource) -> None:
    _write_rows(target, lanes, source, pad_tail=True)


def _write_active_rows(target: Target, lanes: Sequence[Lane], source: LaneSource) -> None:
    _write_rows(target, lanes, source, pad_tail=False)


def _write_packed_tokens(target: Target, lanes: Sequence[Lane], source: LaneSource) -> None:
    cursor = 0
    for lane in lanes:
        count = lane.query_length
        target.view[cursor:cursor + count] = _as_values(source(lane), target, count)[:count]
        cursor += count


def _write_physical_rows(target: Target, lanes: Sequence[Lane], source: LaneSource) -> None:
    """Each lane's values at its physical slot; entries already in this frame are skipped."""
    width = target.width
    for lane in lanes:
        values = np.asarray(source(lane))
        if values.size > width:
            raise CapacityError(f"slot {lane.slot}: {values.size} entries exceed the row width {width}")
        generation, written = target.memory.get(lane.slot, (None, 0))
        if generation != lane.generation:
            written = 0
        if values.size > written:
            start = lane.slot * width
            target.view[start + written:start + values.size] = _as_values(values[written:], target,
                                                                          values.size - written)
        target.memory[lane.slot] = (lane.generation, max(written, values.size))


def _write_scalar(target: Target, lanes: Sequence[Lane], value: int) -> None:
    target.view[0] = _as_values(value, target, 1)[0]


RowWriter = Callable[[Target, Sequence[Lane], LaneSource], None]
INDEX_WRITERS: Mapping[int, RowWriter] = {
    C.INDEX_MODE_SUBMISSION_ROW: _write_submission_rows,
    C.INDEX_MODE_ACTIVE_ROW: _write_active_rows,
    C.INDEX_MODE_PACKED_TOKEN: _write_packed_tokens,
    C.INDEX_MODE_PHYSICAL_ROW: _write_physical_rows,
}


# ---- the packer ------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Resolved:
    destination: str
    write: Callable[[Target, Sequence[Lane]], None]


def _resolve(binding: C.ValueBinding, where: str) -> Callable[[Target, Sequence[Lane]], None]:
    if binding.index == C.INDEX_MODE_SCALAR:
        scalar = SCALAR_SOURCES.get(binding.source)
        if scalar is None:
            raise PackingError(f"{where}: source {C.ValueSource.Name(binding.source)} has no scalar value")
        return lambda target, lanes: _write_scalar(target, lanes, scalar(lanes, binding))
    source = LANE_SOURCES.get(binding.source)
    writer = INDEX_WRITERS.get(binding.index)
    if source is None or writer is None:
        raise PackingError(f"{where}: no packing for {C.ValueSource.Name(binding.source)} "
                           f"indexed {C.IndexMode.Name(binding.index)}")
    return lambda target, lanes: writer(target, lanes, source)


class Packer:
    """Writes the selected graphs' bindings into staging frames; one instance per model."""

    def __init__(self, graphs: Sequence[C.GraphContract], transport: M.Transport, request_slots: int,
                 frames: Sequence[np.ndarray], layout_graphs: Sequence[C.GraphContract] = ()) -> None:
        """Row widths come from Destination.row_elements. Cores prepared before that field
        (FMT-8) derive them as elements // most rows of any graph binding the destination, over
        `graphs` and `layout_graphs` (pass every graph of the contract when `graphs` is a
        reduced selection)."""
        destinations = {d.name: d for d in transport.destinations}
        row_capacity: dict[str, int] = {}
        for graph in graphs:
            for b in graph.bindings:
                if b.destination not in destinations:
                    raise PackingError(f"{graph.program}: destination {b.destination!r} is not registered")
        for graph in list(graphs) + list(layout_graphs):
            for b in graph.bindings:
                if b.index in (C.INDEX_MODE_SUBMISSION_ROW, C.INDEX_MODE_ACTIVE_ROW):
                    row_capacity[b.destination] = max(row_capacity.get(b.destination, 0), graph.capacity.rows)
        self._capacity = {g.program: (g.capacity.rows, g.capacity.tokens, g.operation) for g in graphs}
        self._plans: dict[str, tuple[_Resolved, ...]] = {}
        # targets[frame][(program, destination)]: typed views and page-table memory, built once
        self._targets: list[dict[tuple[str, str], Target]] = [dict() for _ in frames]
        page_memory: list[dict[str, dict]] = [dict() for _ in frames]
        for graph in graphs:
            plan = []
            for index, b in enumerate(graph.bindings):
                where = f"{graph.program}.bindings[{index}]"
                d = destinations[b.destination]
                dtype = _NUMPY.get(d.dtype)
                if dtype is None:
                    raise PackingError(f"{where}: destination dtype {C.DType.Name(d.dtype)} is not packable")
                if b.index in (C.INDEX_MODE_SUBMISSION_ROW, C.INDEX_MODE_ACTIVE_ROW):
                    width = int(d.row_elements) or int(d.elements) // row_capacity[b.destination]
                    if width * graph.capacity.rows > d.elements:
                        raise PackingError(f"{where}: {d.name} holds {d.elements} < {graph.capacity.rows} rows "
                                           f"x {width} elements")
                elif b.index == C.INDEX_MODE_PHYSICAL_ROW:
                    width = int(d.row_elements) or int(d.elements) // request_slots
                    if width * request_slots > d.elements:
                        raise PackingError(f"{where}: {d.name} holds {d.elements} < {request_slots} slots "
                                           f"x {width} elements")
                else:
                    width = 1
                if b.index == C.INDEX_MODE_PACKED_TOKEN and d.elements < graph.capacity.tokens:
                    raise PackingError(f"{where}: {d.name} holds {d.elements} < {graph.capacity.tokens} tokens")
                for f, frame in enumerate(frames):
                    view = frame[d.byte_offset:d.byte_offset + d.elements * np.dtype(dtype).itemsize].view(dtype)
                    memory = page_memory[f].setdefault(d.name, {}) if b.index == C.INDEX_MODE_PHYSICAL_ROW else {}
                    self._targets[f][(graph.program, d.name)] = Target(view, width, graph.capacity.rows, b, memory)
                plan.append(_Resolved(d.name, _resolve(b, where)))
            self._plans[graph.program] = tuple(plan)

    def capacity(self, program: str) -> tuple[int, int]:
        rows, tokens, _ = self._capacity[program]
        return rows, tokens

    def pack(self, program: str, frame: int, lanes: Sequence[Lane]) -> None:
        rows, tokens, operation = self._capacity[program]
        if len(lanes) > rows:
            raise CapacityError(f"{program}: {len(lanes)} lanes > {rows} rows")
        if tokens > 0:
            packed = sum(lane.query_length for lane in lanes)
            if packed > tokens:
                raise CapacityError(f"{program}: {packed} packed tokens > {tokens}")
        targets = self._targets[frame]
        for resolved in self._plans[program]:
            resolved.write(targets[(program, resolved.destination)], lanes)

    def forget_slot(self, slot: int) -> None:
        """Drop remembered page-table lengths of a slot in every frame (e.g. after its pages moved)."""
        for frame_targets in self._targets:
            for target in frame_targets.values():
                target.memory.pop(slot, None)

