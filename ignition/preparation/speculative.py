"""Reusable declarations of the complete SPECULATIVE operation with copied (history) proposals.

A recipe declares them through its options: `speculative_widths` (the default (1, 4, 8) derives
rectangular programs for the decode row counts, declared_variants) or an explicit
`speculative_variants = ((B, W, D, P), ...)`; nothing else is model specific, because the verify block runs the recipe's ordinary forward pass over
P one-token rows (kernel_abi/speculative.py explains why that is causal). One program per variant:

    speculative.expand        pending token + copied proposal ids -> P one-token target rows
    step.geometry             over the rows' token lengths
    recipe forward            ids, positions, per-row slot, page table -> logits [P, vocab]
    speculative.verify_commit target draws (DECODE's penalties and Philox keying), longest
                              accepted prefix, commit, one completion per lane

Staging destinations added after the shared ones (offsets of the shared ones do not move):

    proposal_ids         i32 [B_max, D_max]  PROPOSAL_IDS         SUBMISSION_ROW, padding -1
    proposal_count       i32 [B_max]         PROPOSAL_COUNT       SUBMISSION_ROW, padding 0
    proposal_generation  i32 [B_max]         PROPOSAL_GENERATION  SUBMISSION_ROW, padding -1
    proposal_consumed    i32 [B_max]         PROPOSAL_CONSUMED    SUBMISSION_ROW, padding -1

Width-one programs (D = 0) bind none of them: they draw no proposals (SPEC-4) but still write
the committed draft cursor (state.draft_cursor) that wider rounds continue from (SPEC-5).
The length source is QUERY_LENGTH (host-selected exact lengths, total <= P), or, for variants
declared with a fifth element 1, SPECULATIVE_PREFIX_LIMIT: copy_confidence + allocate write the
lengths inside the graph (`prefix_limit` i32 [B_max] destination, framed `state.proposal_confidence`).
The completion
buffer grows by one extension record per slot: [offers, accepted, tokens[W_max]].

History drafting itself is a startup option of the server (never recorded here, SRV-14).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from helios_proto import contract_pb2 as C
from helios_proto import manifest_pb2 as M

from helios_backend.kernel_abi.speculative import extension_words
from helios_backend.kernel_abi.state import geometry_words
from ignition.preparation import contract as shared
from ignition.preparation import vocabulary
from ignition.recorder import Recorder, RecordingError, Ref

DRAFT_CURSOR_STATE = "state.draft_cursor"   # i32 [slots]: committed draft cursor per slot
LAG_TOKENS = 0                              # copied proposals read the whole committed history


@dataclass(frozen=True)
class SpeculativeVariant:
    rows: int          # B
    width: int         # W, including the pending token
    drafts: int        # D, declared (never inferred from W)
    packed: int        # P, explicit even when P = B x W
    device_allocation: bool = False   # SPECULATIVE_PREFIX_LIMIT: the program allocates lengths within P

    @property
    def name(self) -> str:
        suffix = ".alloc" if self.device_allocation else ""
        return f"speculative.r{self.rows}.w{self.width}.t{self.packed}{suffix}"


# Rows beyond which no speculative program is derived: verification costs a batch of B lanes
# B x W target rows, and past ~64 decode rows a step is no longer bound by reading the weights,
# so extra target rows cost nearly as much as the tokens they might save.
DERIVED_MAX_ROWS = 64
# Target rows per derived program: the forward runs P one-token rows, and the AOT kernels take at
# most 256 rows per step (MAX_ROWS of step.geometry and attention, ignition/gpu_kernels/specs.py),
# so 64 rows are verified at width 4 at most and width 8 serves up to 32 rows.
DERIVED_MAX_PACKED = 256


def declared_variants(options: Any, max_tokens: int) -> tuple[SpeculativeVariant, ...]:
    """The options' explicit `speculative_variants` ((B, W, D, P[, allocating]) each) when set;
    else derived from `speculative_widths`: for each decode row count B <= DERIVED_MAX_ROWS and
    each width W, the rectangular program (B, W, D = W - 1, P = B x W) whose P fits the forward
    scratch (`max_tokens`) and the kernels' rows per step (DERIVED_MAX_PACKED). Width one (D = 0)
    draws nothing but keeps the draft cursor (SPEC-5)."""
    explicit = tuple(SpeculativeVariant(*v) for v in getattr(options, "speculative_variants", ()))
    if explicit:
        return explicit
    return tuple(SpeculativeVariant(rows, width, width - 1, rows * width)
                 for rows in sorted(set(getattr(options, "decode_rows", ()))) if rows <= DERIVED_MAX_ROWS
                 for width in sorted(set(getattr(options, "speculative_widths", ())))
                 if rows * width <= min(max_tokens, DERIVED_MAX_PACKED))


@dataclass(frozen=True)
class SpeculativeScratch:
    ids: str = "scratch.speculative.ids"                  # i32 [P_max] target-row input ids
    positions: str = "scratch.speculative.positions"      # i32 [P_max]
    token_slot: str = "scratch.speculative.token_slot"    # i32 [P_max] slot of each target row
    token_length: str = "scratch.speculative.token_length"  # i32 [P_max] 1 per live row
    lengths: str = "scratch.speculative.lengths"          # i32 [B_max] actual lane lengths
    geometry: str = "scratch.speculative.geometry"        # step geometry of P one-token rows
    logits: str = "scratch.speculative.logits"            # f32 [P_max, vocab]
    allocated: str = "scratch.speculative.allocated"      # i32 [B_max] device-allocated lane lengths


CONFIDENCE_STATE = "state.proposal_confidence"   # f32 [2, request_slots, D_max], framed (SPEC-35..39)


SCRATCH = SpeculativeScratch()
PROPOSAL_DESTINATIONS = ("proposal_ids", "proposal_count", "proposal_generation", "proposal_consumed")


@dataclass(frozen=True)
class SpeculativePlan:
    variants: tuple[SpeculativeVariant, ...]

    @classmethod
    def from_options(cls, options: Any, cap: shared.TextCapacities) -> "SpeculativePlan | None":
        declared = declared_variants(options, cap.max_tokens)
        if not declared:
            return None
        for v in declared:
            if v.rows > cap.request_slots:
                raise RecordingError(f"{v.name}: B={v.rows} exceeds the {cap.request_slots} request slots")
            if v.packed > cap.max_tokens:
                raise RecordingError(f"{v.name}: P={v.packed} exceeds the forward scratch of {cap.max_tokens} tokens")
            if not (v.width >= 1 and v.rows <= v.packed <= v.rows * v.width):
                raise RecordingError(f"{v.name}: needs W >= 1 and B <= P <= B x W")
            if (v.width == 1) != (v.drafts == 0):
                raise RecordingError(f"{v.name}: width one draws no proposals and wider programs declare D > 0")
            if v.device_allocation and v.width == 1:
                raise RecordingError(f"{v.name}: device allocation needs proposals (W > 1)")
        return cls(declared)

    @property
    def allocates(self) -> bool:
        return any(v.device_allocation for v in self.variants)

    @property
    def max_rows(self) -> int:
        return max(v.rows for v in self.variants)

    @property
    def max_drafts(self) -> int:
        return max(1, max(v.drafts for v in self.variants))

    @property
    def max_width(self) -> int:
        return max(v.width for v in self.variants)

    @property
    def max_packed(self) -> int:
        return max(v.packed for v in self.variants)

    @property
    def widths(self) -> list[int]:
        return sorted({v.width for v in self.variants})

    # ---- transport and buffers -----------------------------------------------------------
    def extend_transport(self, transport: M.Transport, cap: shared.TextCapacities) -> None:
        """Append the proposal destinations (before buffers are declared); the completion extension
        records are sized by cap.speculative_width (contract.build_transport)."""
        offset = int(transport.frame_nbytes)
        specs = [("proposal_ids", self.max_rows * self.max_drafts, self.max_drafts)] + [
            (n, self.max_rows, 1) for n in PROPOSAL_DESTINATIONS[1:]]
        if self.allocates:
            specs.append(("prefix_limit", self.max_rows, 1))
        for name, elements, row_elements in specs:   # row widths declared (Destination.row_elements)
            offset = -(-offset // shared.DESTINATION_ALIGNMENT) * shared.DESTINATION_ALIGNMENT
            transport.destinations.append(M.Destination(name=name, dtype=C.DTYPE_I32, byte_offset=offset,
                                                        elements=elements, row_elements=row_elements))
            offset += 4 * elements
        transport.frame_nbytes = -(-offset // shared.DESTINATION_ALIGNMENT) * shared.DESTINATION_ALIGNMENT
        if cap.speculative_width != self.max_width:
            raise RecordingError(f"the completion layout reserves extension records of width {cap.speculative_width}, "
                                 f"the programs need {self.max_width}")

    def declare_buffers(self, rec: Recorder, cap: shared.TextCapacities) -> None:
        P, B = self.max_packed, self.max_rows
        scratch, i32 = M.BUFFER_KIND_SCRATCH, C.DTYPE_I32
        rec.declare(shared.buffer(DRAFT_CURSOR_STATE, M.BUFFER_KIND_STATE, i32, [cap.request_slots]))
        for name in (SCRATCH.ids, SCRATCH.positions, SCRATCH.token_slot, SCRATCH.token_length):
            rec.declare(shared.buffer(name, scratch, i32, [P]))
        rec.declare(shared.buffer(SCRATCH.lengths, scratch, i32, [B]))
        rec.declare(shared.buffer(SCRATCH.geometry, scratch, i32, [geometry_words(P, P)]))
        rec.declare(shared.buffer(SCRATCH.logits, scratch, C.DTYPE_F32, [P, cap.vocab]))
        if self.allocates:
            rec.declare(shared.buffer(SCRATCH.allocated, scratch, i32, [B]))
            rec.declare(shared.buffer(CONFIDENCE_STATE, M.BUFFER_KIND_STATE, C.DTYPE_F32,
                                      [2, cap.request_slots, self.max_drafts]))

    # ---- programs ------------------------------------------------------------------------
    def record_programs(self, rec: Recorder, recipe: Any, shape: Any, options: Any, cap: shared.TextCapacities,
                        transport: M.Transport, cache: shared.PagedKV, resources: list[str]) -> list[C.GraphContract]:
        """Every speculative variant on `rec`'s rank; `shape` is that rank's model shape."""
        graphs = []
        for variant in self.variants:
            rec.begin(variant.name, C.OPERATION_SPECULATIVE, C.Capacity(rows=variant.rows, tokens=variant.packed))
            self._record(rec, recipe, shape, options, cap, transport, cache, variant)
            program = rec.end()
            graph = shared.graph_contract(program, bindings(variant), rec.buffers, resources, cap.request_slots)
            graph.speculative.CopyFrom(C.SpeculativeDescriptor(
                batch_capacity=variant.rows, draft_tokens=variant.drafts, token_capacity=variant.width,
                packed_token_capacity=variant.packed))
            if variant.device_allocation:
                graph.speculative.confidence_width = variant.drafts
                graph.speculative.confidence_buffer = CONFIDENCE_STATE
                graph.speculative.confidence_draft_capacity = self.max_drafts
            graph.cursor.CopyFrom(C.CompletionCursor(reports_draft_cursor=True, lag_tokens=LAG_TOKENS,
                                                     state_view=DRAFT_CURSOR_STATE))
            graphs.append(graph)
        return graphs

    def _record(self, rec: Recorder, recipe: Any, shape: Any, options: Any, cap: shared.TextCapacities,
                transport: M.Transport, cache: shared.PagedKV, v: SpeculativeVariant) -> None:
        s = lambda name: shared.staged(transport, name)  # noqa: E731
        slot_state = shared.SLOT_STATE
        requested = s("query_length")
        if v.device_allocation:
            rec.launch("speculative.copy_confidence.v1", "speculative.confidence", confidence=CONFIDENCE_STATE,
                       proposal_count=s("proposal_count"), proposal_generation=s("proposal_generation"),
                       proposal_consumed=s("proposal_consumed"), row_generation=s("row_generation"),
                       consumed=s("consumed"), row_slot=s("row_slot"), transport_header=s(shared.TRANSPORT_HEADER),
                       live_rows=s("live_rows"), rows=v.rows, request_slots=cap.request_slots,
                       draft_capacity=self.max_drafts, draft_tokens=v.drafts)
            rec.launch("speculative.allocate.v1", "speculative.allocate", lengths=SCRATCH.allocated,
                       confidence=CONFIDENCE_STATE, prefix_limit=s("prefix_limit"), row_slot=s("row_slot"),
                       transport_header=s(shared.TRANSPORT_HEADER), live_rows=s("live_rows"), rows=v.rows,
                       request_slots=cap.request_slots, draft_capacity=self.max_drafts, confidence_width=v.drafts,
                       packed_capacity=v.packed)
            requested = Ref(SCRATCH.allocated)
        rec.launch("speculative.expand.v1", "speculative.expand", ids=SCRATCH.ids, positions=SCRATCH.positions,
                   token_slot=SCRATCH.token_slot, token_length=SCRATCH.token_length, lengths=SCRATCH.lengths,
                   requested=requested, pending=slot_state.pending, proposal_ids=s("proposal_ids"),
                   proposal_count=s("proposal_count"), proposal_generation=s("proposal_generation"),
                   proposal_consumed=s("proposal_consumed"), row_slot=s("row_slot"),
                   row_generation=s("row_generation"), consumed=s("consumed"), live_rows=s("live_rows"),
                   rows=v.rows, tokens=v.packed, draft_stride=self.max_drafts, draft_tokens=v.drafts,
                   width=v.width)
        rec.launch("step.geometry.v1", "step.geometry", geometry=SCRATCH.geometry, query_length=SCRATCH.token_length,
                   rows=v.packed, tokens=v.packed)
        io = shared.StepIO(operation=C.OPERATION_SPECULATIVE, rows=v.packed, tokens=v.packed, ids=Ref(SCRATCH.ids),
                           positions=Ref(SCRATCH.positions), page_table=s("page_table"),
                           row_slot=Ref(SCRATCH.token_slot), geometry=Ref(SCRATCH.geometry),
                           logits=Ref(SCRATCH.logits), page_tokens=cap.page_tokens, pages_per_row=cap.pages_per_row)
        recipe.forward(rec.forward_view(), io, shape, cache, options)
        vocabulary.record_mask(rec, cap, io)
        rec.launch("speculative.verify_commit.v1", "speculative.verify_commit", completion=shared.COMPLETION,
                   pending=slot_state.pending, generated=slot_state.generated,
                   output_histogram=slot_state.output_histogram, draft_cursor=DRAFT_CURSOR_STATE,
                   logits=SCRATCH.logits, sampling=slot_state.sampling, seeds=slot_state.seeds,
                   prompt_histogram=slot_state.prompt_histogram, grammar_mask=s("grammar_mask"),
                   eos_ids=slot_state.eos_ids, output_limit=slot_state.output_limit, ids=SCRATCH.ids,
                   lengths=SCRATCH.lengths, row_slot=s("row_slot"), row_generation=s("row_generation"),
                   consumed=s("consumed"), transport_header=s(shared.TRANSPORT_HEADER), live_rows=s("live_rows"),
                   rows=v.rows, tokens=v.packed, vocab=cap.vocab, histogram_bins=cap.histogram_bins,
                   mask_words=cap.mask_words, eos_capacity=cap.eos_capacity, lag_tokens=LAG_TOKENS,
                   completion_rows=cap.request_slots, ext_width=extension_words(self.max_width),
                   operation=C.OPERATION_SPECULATIVE)


def _binding(destination: str, source: C.ValueSource.ValueType, padding: int = 0,
             index: C.IndexMode.ValueType = C.INDEX_MODE_SUBMISSION_ROW
             ) -> C.ValueBinding:
    return C.ValueBinding(destination=destination, source=source, index=index, padding=padding)


def bindings(variant: SpeculativeVariant) -> list[C.ValueBinding]:
    """Row identity, exactly one length source (QUERY_LENGTH, or SPECULATIVE_PREFIX_LIMIT for
    device allocation), consumed endpoints, page table,
    the first position's grammar mask and, for wider programs, the copied proposals."""
    out = [
        _binding("row_slot", C.VALUE_SOURCE_SLOT, padding=-1),
        _binding("row_generation", C.VALUE_SOURCE_GENERATION, padding=-1),
        _binding("live_rows", C.VALUE_SOURCE_LIVE_ROW_COUNT, index=C.INDEX_MODE_SCALAR),
        _binding("prefix_limit", C.VALUE_SOURCE_SPECULATIVE_PREFIX_LIMIT, padding=0) if variant.device_allocation
        else _binding("query_length", C.VALUE_SOURCE_QUERY_LENGTH, padding=0),
        _binding("consumed", C.VALUE_SOURCE_CONSUMED_TOKENS, padding=0),
        _binding("page_table", C.VALUE_SOURCE_PAGE_TABLE, index=C.INDEX_MODE_PHYSICAL_ROW),
        _binding("grammar_mask", C.VALUE_SOURCE_GRAMMAR_MASK, padding=-1),
    ]
    if variant.drafts:
        out += [
            _binding("proposal_ids", C.VALUE_SOURCE_PROPOSAL_IDS, padding=-1),
            _binding("proposal_count", C.VALUE_SOURCE_PROPOSAL_COUNT, padding=0),
            _binding("proposal_generation", C.VALUE_SOURCE_PROPOSAL_GENERATION, padding=-1),
            _binding("proposal_consumed", C.VALUE_SOURCE_PROPOSAL_CONSUMED, padding=-1),
        ]
    return out
