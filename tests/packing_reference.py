"""The straightforward packer: every binding written lane by lane, row by row.

The specification the production Packer (helios_backend/packing.py, vectorized per
destination) must match byte for byte: tests/test_packing_equivalence.py runs both over
random lanes, and bench/packing.py times it beside the Packer ("per-row" column: the
algorithm the Packer used before it was vectorized). Not used by serving code.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
from helios_proto import contract_pb2 as C
from helios_proto import manifest_pb2 as M

from helios_backend.packing import CapacityError, PackedLane, PackingError

_NUMPY = {C.DTYPE_I32: np.int32, C.DTYPE_U32: np.uint32, C.DTYPE_F32: np.float32, C.DTYPE_I64: np.int64,
          C.DTYPE_U64: np.uint64, C.DTYPE_U8: np.uint8, C.DTYPE_I8: np.int8, C.DTYPE_I16: np.int16}
_ROW_MODES = (C.INDEX_MODE_SUBMISSION_ROW, C.INDEX_MODE_ACTIVE_ROW)


def _initialization(lane: PackedLane):
    if lane.initialization is None:
        raise PackingError(f"lane of slot {lane.slot} has no initialization values")
    return lane.initialization


def _query_length(lane: PackedLane) -> int:
    if lane.tokens is not None:
        return len(lane.tokens)
    if lane.prefix_limit:
        return 1
    return 1 + (0 if lane.proposals is None else len(lane.proposals))


SOURCES = {
    C.VALUE_SOURCE_SLOT: lambda l: l.slot,
    C.VALUE_SOURCE_GENERATION: lambda l: l.generation,
    C.VALUE_SOURCE_QUERY_LENGTH: _query_length,
    C.VALUE_SOURCE_SAMPLING_DECISION: lambda l: int(l.sample),
    C.VALUE_SOURCE_CONSUMED_TOKENS: lambda l: l.start,
    C.VALUE_SOURCE_PROMPT_TOKENS: lambda l: l.tokens,
    C.VALUE_SOURCE_PROMPT_POSITIONS: lambda l: np.arange(l.start, l.start + _query_length(l)),
    C.VALUE_SOURCE_PAGE_TABLE: lambda l: l.page_table,
    C.VALUE_SOURCE_SNAPSHOT_DESTINATION: lambda l: l.snapshot_row,
    C.VALUE_SOURCE_RESTORE_SOURCE: lambda l: l.restore_row,
    C.VALUE_SOURCE_PENDING_TOKEN: lambda l: l.pending_token,
    C.VALUE_SOURCE_SCORED_TARGET_TOKENS: lambda l: l.scored_targets,
    C.VALUE_SOURCE_GRAMMAR_MASK: lambda l: l.grammar_mask,
    C.VALUE_SOURCE_LOGIT_BIAS_IDS: lambda l: l.logit_bias_ids,
    C.VALUE_SOURCE_LOGIT_BIAS_VALUES: lambda l: l.logit_bias_values,
    C.VALUE_SOURCE_SEED_BITS: lambda l: np.array([_initialization(l).seed & 0xFFFFFFFF,
                                               (_initialization(l).seed >> 32) & 0xFFFFFFFF]),
    C.VALUE_SOURCE_SAMPLING_PARAMETERS: lambda l: _initialization(l).sampling.vector(),
    C.VALUE_SOURCE_OUTPUT_LIMIT: lambda l: _initialization(l).output_limit,
    C.VALUE_SOURCE_EOS_IDS: lambda l: np.asarray(_initialization(l).eos_ids, dtype=np.int64),
    C.VALUE_SOURCE_PROMPT_HISTOGRAM: lambda l: _initialization(l).prompt_histogram,
    C.VALUE_SOURCE_PROPOSAL_IDS: lambda l: l.proposals,
    C.VALUE_SOURCE_PROPOSAL_COUNT: lambda l: 0 if l.proposals is None else len(l.proposals),
    C.VALUE_SOURCE_PROPOSAL_GENERATION: lambda l: l.proposal_generation,
    C.VALUE_SOURCE_PROPOSAL_CONSUMED: lambda l: l.proposal_consumed,
    C.VALUE_SOURCE_SPECULATIVE_PREFIX_LIMIT: lambda l: l.prefix_limit,
}


def _scalar(lanes: Sequence[PackedLane], b: C.ValueBinding) -> int:
    if b.source == C.VALUE_SOURCE_LIVE_ROW_COUNT:
        return len(lanes)
    if b.source == C.VALUE_SOURCE_CONSTANT:
        return int(b.constant)
    rows = [i for i, lane in enumerate(lanes) if lane.tokens is not None]      # MIXED_PREFILL_ROW
    if len(rows) > 1:
        raise CapacityError(f"a mixed step carries one prefill row, got {len(rows)}")
    return rows[0] if rows else int(b.padding)


def _values(value, b: C.ValueBinding, dtype, length: int) -> np.ndarray:
    """One value as `length` elements: offset added to integer values, then bare padding."""
    if value is None:
        return np.full(length, b.padding, dtype=np.int64).astype(dtype)
    out = np.asarray(value).reshape(-1)
    if out.dtype.kind in "iu" and b.offset:
        out = out + b.offset
    if out.size < length:
        out = np.concatenate([out, np.full(length - out.size, b.padding, dtype=out.dtype)])
    return out.astype(dtype)


class ReferencePacker:
    """Same constructor and pack() as helios_backend.packing.Packer, written per row."""

    def __init__(self, graphs: Sequence[C.GraphContract], transport: M.Transport, request_slots: int,
                 frames: Sequence[np.ndarray], layout_graphs: Sequence[C.GraphContract] = ()) -> None:
        self.destinations = {d.name: d for d in transport.destinations}
        self.graphs = {g.program: g for g in graphs}
        self.slots, self.frames = request_slots, frames
        self.most_rows: dict[str, int] = {}
        for g in list(graphs) + list(layout_graphs):
            for b in g.bindings:
                if b.index in _ROW_MODES:
                    self.most_rows[b.destination] = max(self.most_rows.get(b.destination, 0), g.capacity.rows)
        self.memory = [dict() for _ in frames]      # frame -> (destination, slot) -> (generation, written)

    def _view(self, frame: int, name: str) -> np.ndarray:
        d = self.destinations[name]
        dtype = _NUMPY[d.dtype]
        return self.frames[frame][d.byte_offset:d.byte_offset + d.elements * np.dtype(dtype).itemsize].view(dtype)

    def pack(self, program: str, frame: int, lanes: Sequence[PackedLane]) -> None:
        g = self.graphs[program]
        if len(lanes) > g.capacity.rows:
            raise CapacityError(f"{program}: {len(lanes)} lanes > {g.capacity.rows} rows")
        if g.capacity.tokens and sum(_query_length(lane) for lane in lanes) > g.capacity.tokens:
            raise CapacityError(f"{program}: too many packed tokens")
        for b in g.bindings:
            d, view = self.destinations[b.destination], self._view(frame, b.destination)
            if b.index == C.INDEX_MODE_SCALAR:
                view[0] = _values(_scalar(lanes, b), b, view.dtype, 1)[0]
            elif b.index in _ROW_MODES:
                width = int(d.row_elements) or int(d.elements) // self.most_rows[d.name]
                rows = view[:g.capacity.rows * width].reshape(g.capacity.rows, width)
                for r, lane in enumerate(lanes):
                    rows[r] = _values(SOURCES[b.source](lane), b, view.dtype, width)
                if b.index == C.INDEX_MODE_SUBMISSION_ROW:
                    rows[len(lanes):] = np.array(b.padding).astype(view.dtype)
            elif b.index == C.INDEX_MODE_PACKED_TOKEN:
                cursor = 0
                for lane in lanes:
                    count = _query_length(lane)
                    view[cursor:cursor + count] = _values(SOURCES[b.source](lane), b, view.dtype, count)[:count]
                    cursor += count
            else:                                                                   # PHYSICAL_ROW
                width = int(d.row_elements) or int(d.elements) // self.slots
                memory = self.memory[frame]
                for lane in lanes:
                    values = np.asarray(SOURCES[b.source](lane))
                    if values.size > width:
                        raise CapacityError(f"slot {lane.slot}: {values.size} entries exceed the row width {width}")
                    generation, written = memory.get((d.name, lane.slot), (None, 0))
                    if generation != lane.generation:
                        written = 0
                    start = lane.slot * width
                    if values.size > written:
                        view[start + written:start + values.size] = _values(values[written:], b, view.dtype,
                                                                            values.size - written)
                    memory[(d.name, lane.slot)] = (lane.generation, max(written, values.size))

    def forget_slot(self, slot: int) -> None:
        for memory in self.memory:
            for key in [k for k in memory if k[1] == slot]:
                del memory[key]
