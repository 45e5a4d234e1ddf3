"""Reusable declarations: admission, sampling, state transfer and paged text.

A recipe declares its model (weights, forward pass, frontend metadata); everything a
text model shares with every other one lives here, so recipes only *declare*:

  * the staging frame (registered transport destinations) and the ValueBindings that
    fill it for each operation (which source, which index mode, padding);
  * per-slot state buffers (pending token, draw counter, sampling state, histograms);
  * the shared nodes every step starts and ends with: step geometry and input-id
    selection before the model, penalties / draw / commit after it, and the
    admission node of INITIALIZATION programs;
  * the completion record layout and the paged key/value cache region.

A recipe cannot install scheduling or state-update code: the only things it passes in
are buffer references for its forward pass; state updates are the shared kernels below.

Staging frame (one per submission, copied to the `staging` buffer first; 16-byte aligned):

    transport.header  i32[2]           sequence, frame   (written by the executor)
    row_slot ... logit_bias_values      per-row and per-token destinations, see destination_specs
    page_table        i32[slots, pages_per_row]  PHYSICAL_ROW: only new entries are written
    in_*                                admission values, INITIALIZATION only
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from helios_proto import contract_pb2, manifest_pb2

from helios_backend.kernel_abi import abi, blocks
from helios_backend.kernel_abi.state import (
    COMPLETION_HEADER_FIELDS,
    COMPLETION_HEADER_WORDS,
    COMPLETION_ROW_FIELDS,
    COMPLETION_ROW_WORDS,
    SAMPLING_PARAMETER_WORDS,
    TRANSPORT_HEADER_WORDS,
    geometry_words,
)
from helios_backend.kernel_abi.logprobs import logprob_record_words
from helios_backend.kernel_abi.speculative import extension_words
from helios_backend.kernel_abi.sampling import LOGIT_BIAS_CAPACITY, partial_words
from ignition.recorder import Recorder, Ref

C = contract_pb2
M = manifest_pb2
STAGING = "staging"
COMPLETION = "completion"
TRANSPORT_HEADER = "transport.header"
DESTINATION_ALIGNMENT = 16
BUFFER_ALIGNMENT = 256

_DTYPE_BYTES = {C.DTYPE_F16: 2, C.DTYPE_BF16: 2, C.DTYPE_F32: 4, C.DTYPE_F64: 8, C.DTYPE_I8: 1, C.DTYPE_U8: 1,
                C.DTYPE_I16: 2, C.DTYPE_I32: 4, C.DTYPE_U32: 4, C.DTYPE_I64: 8, C.DTYPE_U64: 8}


def dtype_bytes(dtype: C.DType.ValueType) -> int:
    return _DTYPE_BYTES[dtype]


def _align(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


@dataclass(frozen=True)
class TextCapacities:
    """Geometry shared by every program of a paged text model (one rank)."""

    vocab: int                 # sampled ids in [0, vocab)
    request_slots: int         # physical request slots = largest captured rows
    max_tokens: int            # largest packed-token capacity of any program
    max_admission_rows: int    # largest INITIALIZATION rows
    page_tokens: int
    context_tokens: int
    eos_capacity: int = 4
    snapshot_rows: int = 0      # continuation rows for exact-endpoint snapshots; 0 = no snapshots
    logprobs: bool = False      # logprob extension records (sampling.logprobs.v2) after the records
    top_logprobs: int = 0       # top-N alternatives per logprob record (with logprobs)
    scored_tokens: int = 0      # largest SCORED_PREFILL packed tokens: one f32 score word each; 0 = none
    # largest SPECULATIVE width W: one speculative extension record [offers, accepted, tokens[W]]
    # per slot right after the standard records (kernel_abi/speculative.py); 0 = no speculative programs
    speculative_width: int = 0
    logit_bias_capacity: int = LOGIT_BIAS_CAPACITY   # (id, bias) entries per row of sampling.logit_bias
    # ids [vocab - masked_tokens, vocab) that no tokenizer id spells: -inf after the forward pass
    # (ignition/preparation/vocabulary.py); 0 = every id is sampled
    masked_tokens: int = 0

    @property
    def speculative_words(self) -> int:
        """Words of the speculative extension records (0 without speculative programs)."""
        return self.request_slots * extension_words(self.speculative_width) if self.speculative_width else 0

    @property
    def logprob_base(self) -> int:
        """Word offset of the logprob extension records in the completion buffer: after the
        standard records and any speculative extension records (whose offset the speculative
        kernels fix), so one core serves both."""
        return COMPLETION_HEADER_WORDS + self.request_slots * COMPLETION_ROW_WORDS + self.speculative_words

    @property
    def score_base(self) -> int:
        """Word offset of the SCORED_PREFILL scores (after the records and any logprob records)."""
        return self.logprob_base + (self.request_slots * logprob_record_words(self.top_logprobs)
                                    if self.logprobs else 0)

    @property
    def pages_per_row(self) -> int:
        return -(-self.context_tokens // self.page_tokens)

    @property
    def mask_words(self) -> int:
        return -(-self.vocab // 32)

    @property
    def histogram_bins(self) -> int:
        return self.vocab


@dataclass(frozen=True)
class DestinationSpec:
    name: str
    dtype: C.DType.ValueType
    elements: int
    row_elements: int = 0       # elements per row of a row-indexed destination (Destination.row_elements)


def destination_specs(cap: TextCapacities) -> list[DestinationSpec]:
    rows, tokens, admit = cap.request_slots, cap.max_tokens, cap.max_admission_rows
    i32, u32, f32 = C.DTYPE_I32, C.DTYPE_U32, C.DTYPE_F32
    # row-indexed destinations declare their row width: the packer never infers it from the
    # rows of the graphs that bind them (those may be fewer than the destination's rows)
    return [
        DestinationSpec(TRANSPORT_HEADER, i32, TRANSPORT_HEADER_WORDS),
        DestinationSpec("row_slot", i32, rows, 1),
        DestinationSpec("row_generation", i32, rows, 1),
        DestinationSpec("live_rows", i32, 1),
        DestinationSpec("query_length", i32, rows, 1),
        DestinationSpec("consumed", i32, rows, 1),
        DestinationSpec("sample_flag", i32, rows, 1),
        DestinationSpec("prefill_row", i32, 1),
        DestinationSpec("prompt_tokens", i32, tokens),
        DestinationSpec("positions", i32, tokens),
        DestinationSpec("page_table", i32, cap.request_slots * cap.pages_per_row, cap.pages_per_row),
        DestinationSpec("grammar_mask", u32, rows * cap.mask_words, cap.mask_words),
    ] + (
        # beside the other per-step rows, before the admission values (a step's copy ends at the
        # last destination its bindings write)
        [DestinationSpec("logit_bias_ids", i32, rows * cap.logit_bias_capacity, cap.logit_bias_capacity),
         DestinationSpec("logit_bias_values", f32, rows * cap.logit_bias_capacity, cap.logit_bias_capacity)]
        if cap.logit_bias_capacity else []) + [
        DestinationSpec("in_seeds", u32, admit * 2, 2),
        DestinationSpec("in_sampling", f32, admit * SAMPLING_PARAMETER_WORDS, SAMPLING_PARAMETER_WORDS),
        DestinationSpec("in_output_limit", i32, admit, 1),
        DestinationSpec("in_eos_ids", i32, admit * cap.eos_capacity, cap.eos_capacity),
        DestinationSpec("in_histogram", i32, admit * cap.histogram_bins, cap.histogram_bins),
    ] + ([DestinationSpec("snapshot_row", i32, rows, 1), DestinationSpec("restore_row", i32, rows, 1)]
         if cap.snapshot_rows else []) + (
        [DestinationSpec("scored_targets", i32, cap.scored_tokens)] if cap.scored_tokens else [])


def build_transport(cap: TextCapacities, frames: int = 2) -> M.Transport:
    transport = M.Transport(frames=frames, staging_buffer=STAGING, completion_buffer=COMPLETION)
    offset = 0
    for spec in destination_specs(cap):
        offset = _align(offset, DESTINATION_ALIGNMENT)
        transport.destinations.append(M.Destination(name=spec.name, dtype=spec.dtype, byte_offset=offset,
                                                    elements=spec.elements, row_elements=spec.row_elements))
        offset += spec.elements * dtype_bytes(spec.dtype)
    transport.frame_nbytes = _align(offset, DESTINATION_ALIGNMENT)
    transport.completion_nbytes = 4 * (COMPLETION_HEADER_WORDS + cap.request_slots * COMPLETION_ROW_WORDS
                                       + cap.speculative_words)
    if cap.logprobs:
        transport.completion_nbytes += 4 * cap.request_slots * logprob_record_words(cap.top_logprobs)
    transport.completion_nbytes += 4 * cap.scored_tokens
    return transport


def completion_layout(cap: TextCapacities) -> M.CompletionLayout:
    layout = M.CompletionLayout(header_words=COMPLETION_HEADER_WORDS, row_words=COMPLETION_ROW_WORDS,
                                rows=cap.request_slots)
    for index, name in enumerate(COMPLETION_HEADER_FIELDS):
        layout.header.append(M.CompletionField(name=name, word=index, words=1, dtype=C.DTYPE_I32))
    for index, name in enumerate(COMPLETION_ROW_FIELDS):
        layout.row.append(M.CompletionField(name=name, word=index, words=1, dtype=C.DTYPE_I32))
    if cap.logprobs:
        # words past row_words: the row's logprob extension record at logprob_base (kernel_abi/logprobs.py)
        first, n = COMPLETION_ROW_WORDS, cap.top_logprobs
        layout.row.append(M.CompletionField(name="logprob", word=first, words=1, dtype=C.DTYPE_F32))
        if n:
            layout.row.append(M.CompletionField(name="top_ids", word=first + 1, words=n, dtype=C.DTYPE_I32))
            layout.row.append(M.CompletionField(name="top_logprobs", word=first + 1 + n, words=n,
                                                dtype=C.DTYPE_F32))
        layout.top_logprobs = n
        if cap.speculative_words:
            # the logprob records follow the speculative extension records instead of the standard
            # records: their absolute first word (cores without it read them right after the records)
            layout.header.append(M.CompletionField(name="logprob_records", word=cap.logprob_base,
                                                   words=cap.request_slots * logprob_record_words(n),
                                                   dtype=C.DTYPE_I32))
    if cap.scored_tokens:
        # SCORED_PREFILL scores: one f32 per packed token at an absolute word of the completion buffer
        # (past the header, the records and the logprob records), written by logits.score_targets.v1
        layout.header.append(M.CompletionField(name="scores", word=cap.score_base, words=cap.scored_tokens,
                                               dtype=C.DTYPE_F32))
    return layout


def buffer(name: str, kind: M.BufferKind.ValueType, dtype: C.DType.ValueType, shape: Iterable[int]) -> M.Buffer:
    shape = [int(s) for s in shape]
    count = 1
    for s in shape:
        count *= s
    nbytes = blocks.block_nbytes(dtype, shape) if blocks.is_block(dtype) else count * dtype_bytes(dtype)
    return M.Buffer(name=name, kind=kind, dtype=dtype, shape=shape, nbytes=nbytes, alignment=BUFFER_ALIGNMENT)


# ---- per-slot state ------------------------------------------------------------------------

@dataclass(frozen=True)
class SlotState:
    """Names of the shared persistent per-slot state buffers (one row per physical slot)."""

    pending: str = "state.pending"              # i32 [slots]   device-owned pending token
    generated: str = "state.generated"          # i32 [slots]   tokens sampled; the RNG draw counter
    output_limit: str = "state.output_limit"    # i32 [slots]
    seeds: str = "state.seeds"                  # u32 [slots, 2]
    sampling: str = "state.sampling"            # f32 [slots, 8]
    eos_ids: str = "state.eos_ids"              # i32 [slots, eos_capacity], -1 padded
    prompt_histogram: str = "state.prompt_histogram"  # i32 [slots, bins]
    output_histogram: str = "state.output_histogram"  # i32 [slots, bins]


SLOT_STATE = SlotState()


@dataclass(frozen=True)
class StepScratch:
    geometry: str = "scratch.geometry"
    ids: str = "scratch.ids"
    logits: str = "scratch.logits"
    sampled: str = "scratch.sampled"
    # the multi-program sampling kernels' per-chunk records and per-row arrival counters (zero
    # between steps: each kernel's last program of a row resets its counter)
    sampling_partials: str = "scratch.sampling_partials"    # i32 [rows, partial_words(vocab)]
    sampling_arrivals: str = "scratch.sampling_arrivals"    # i32 [rows]


STEP_SCRATCH = StepScratch()


def declare_shared_buffers(rec: Recorder, cap: TextCapacities, transport: M.Transport) -> None:
    S, B, T = cap.request_slots, cap.request_slots, cap.max_tokens
    rec.declare(buffer(STAGING, M.BUFFER_KIND_STAGING, C.DTYPE_U8, [transport.frame_nbytes]))
    rec.declare(buffer(COMPLETION, M.BUFFER_KIND_COMPLETION, C.DTYPE_I32, [transport.completion_nbytes // 4]))
    state = M.BUFFER_KIND_STATE
    rec.declare(buffer(SLOT_STATE.pending, state, C.DTYPE_I32, [S]))
    rec.declare(buffer(SLOT_STATE.generated, state, C.DTYPE_I32, [S]))
    rec.declare(buffer(SLOT_STATE.output_limit, state, C.DTYPE_I32, [S]))
    rec.declare(buffer(SLOT_STATE.seeds, state, C.DTYPE_U32, [S, 2]))
    rec.declare(buffer(SLOT_STATE.sampling, state, C.DTYPE_F32, [S, SAMPLING_PARAMETER_WORDS]))
    rec.declare(buffer(SLOT_STATE.eos_ids, state, C.DTYPE_I32, [S, cap.eos_capacity]))
    rec.declare(buffer(SLOT_STATE.prompt_histogram, state, C.DTYPE_I32, [S, cap.histogram_bins]))
    rec.declare(buffer(SLOT_STATE.output_histogram, state, C.DTYPE_I32, [S, cap.histogram_bins]))
    scratch = M.BUFFER_KIND_SCRATCH
    rec.declare(buffer(STEP_SCRATCH.geometry, scratch, C.DTYPE_I32, [geometry_words(B, T)]))
    rec.declare(buffer(STEP_SCRATCH.ids, scratch, C.DTYPE_I32, [T]))
    rec.declare(buffer(STEP_SCRATCH.logits, scratch, C.DTYPE_F32, [B, cap.vocab]))
    rec.declare(buffer(STEP_SCRATCH.sampled, scratch, C.DTYPE_I32, [B]))
    rec.declare(buffer(STEP_SCRATCH.sampling_partials, scratch, C.DTYPE_I32, [B, partial_words(cap.vocab)]))
    rec.declare(buffer(STEP_SCRATCH.sampling_arrivals, scratch, C.DTYPE_I32, [B]))


def staged(transport: M.Transport, name: str) -> Ref:
    for destination in transport.destinations:
        if destination.name == name:
            return Ref(STAGING, destination.byte_offset)
    raise KeyError(f"no transport destination {name!r}")


# ---- paged text: the key/value cache -------------------------------------------------------

@dataclass(frozen=True)
class PagedKV:
    """Two cache planes; one page holds every layer: [layers, page_tokens, kv_heads, head_dim] f16."""

    layers: int
    kv_heads: int
    head_dim: int
    page_tokens: int
    k_plane: str = "cache.k"
    v_plane: str = "cache.v"
    k_continuation: str = "continuation.k"   # STATE [snapshot rows, one page of the k plane]
    v_continuation: str = "continuation.v"
    # > 0: some layers attend over only this many last positions. Their history is kept in the
    # same pages as the full-attention layers' (a page holds every layer), declared as a
    # SLIDING_WINDOW region over the same planes; pages stay allocated for the whole context.
    window_tokens: int = 0

    @property
    def layer_elements(self) -> int:
        return self.page_tokens * self.kv_heads * self.head_dim

    @property
    def page_stride(self) -> int:
        """Elements per page in one plane."""
        return self.layers * self.layer_elements

    def layer_refs(self, layer: int) -> tuple[Ref, Ref]:
        offset = layer * self.layer_elements * 2  # f16 bytes
        return Ref(self.k_plane, offset), Ref(self.v_plane, offset)

    def declare(self, rec: Recorder, snapshot_rows: int = 0) -> None:
        shape = [self.layers, self.page_tokens, self.kv_heads, self.head_dim]
        rec.declare(buffer(self.k_plane, M.BUFFER_KIND_CACHE, C.DTYPE_F16, shape))
        rec.declare(buffer(self.v_plane, M.BUFFER_KIND_CACHE, C.DTYPE_F16, shape))
        if snapshot_rows:
            rows = [snapshot_rows] + shape
            rec.declare(buffer(self.k_continuation, M.BUFFER_KIND_STATE, C.DTYPE_F16, rows))
            rec.declare(buffer(self.v_continuation, M.BUFFER_KIND_STATE, C.DTYPE_F16, rows))

    def cache_contract(self, cap: TextCapacities) -> C.CacheContract:
        page_bytes = self.page_stride * 2
        region = C.HistoryRegion(name="attention", kind=C.HISTORY_KIND_PAGED_KV, tokens_per_record=1,
                                 planes=[C.CachePlane(buffer=self.k_plane, bytes_per_page=page_bytes),
                                         C.CachePlane(buffer=self.v_plane, bytes_per_page=page_bytes)])
        regions = [region]
        if self.window_tokens:
            regions.append(C.HistoryRegion(name="sliding_window", kind=C.HISTORY_KIND_SLIDING_WINDOW,
                                           tokens_per_record=1, window_tokens=self.window_tokens,
                                           planes=list(region.planes)))
        if cap.snapshot_rows:
            # partial-page payloads of snapshots: one page of each plane per continuation row
            regions.append(C.HistoryRegion(name="partial_pages", kind=C.HISTORY_KIND_CONTINUATION,
                                           bytes_per_row=2 * page_bytes))
        view = C.PageTableView(destination="page_table", page_offset=0, pages_per_row=cap.pages_per_row)
        return C.CacheContract(page_tokens=self.page_tokens, regions=regions, page_table_views=[view])


# ---- value bindings ------------------------------------------------------------------------

def _binding(destination: str, source: C.ValueSource.ValueType, index: C.IndexMode.ValueType, padding: int = 0, constant: int = 0) -> C.ValueBinding:
    return C.ValueBinding(destination=destination, source=source, index=index, padding=padding, constant=constant)


def _row_identity() -> list[C.ValueBinding]:
    return [
        _binding("row_slot", C.VALUE_SOURCE_SLOT, C.INDEX_MODE_SUBMISSION_ROW, padding=-1),
        _binding("row_generation", C.VALUE_SOURCE_GENERATION, C.INDEX_MODE_SUBMISSION_ROW, padding=-1),
        _binding("live_rows", C.VALUE_SOURCE_LIVE_ROW_COUNT, C.INDEX_MODE_SCALAR),
    ]


def generation_bindings(operation: C.Operation.ValueType, snapshots: bool = False,
                        logit_bias: bool = True) -> list[C.ValueBinding]:
    """Bindings of PREFILL / DECODE / MIXED programs (one forward step plus one draw per row);
    `logit_bias`: the epilogue records sampling.logit_bias (TextCapacities.logit_bias_capacity)."""
    bindings = _row_identity() + [
        _binding("query_length", C.VALUE_SOURCE_QUERY_LENGTH, C.INDEX_MODE_SUBMISSION_ROW, padding=0),
        _binding("consumed", C.VALUE_SOURCE_CONSUMED_TOKENS, C.INDEX_MODE_SUBMISSION_ROW, padding=0),
        _binding("sample_flag", C.VALUE_SOURCE_SAMPLING_DECISION, C.INDEX_MODE_SUBMISSION_ROW, padding=0),
        _binding("positions", C.VALUE_SOURCE_PROMPT_POSITIONS, C.INDEX_MODE_PACKED_TOKEN),
        _binding("page_table", C.VALUE_SOURCE_PAGE_TABLE, C.INDEX_MODE_PHYSICAL_ROW),
        _binding("grammar_mask", C.VALUE_SOURCE_GRAMMAR_MASK, C.INDEX_MODE_SUBMISSION_ROW, padding=-1),
    ]
    if logit_bias:
        # the per-lane (id, bias) entries of sampling.logit_bias; lanes without them pad id -1
        bindings += [
            _binding("logit_bias_ids", C.VALUE_SOURCE_LOGIT_BIAS_IDS, C.INDEX_MODE_SUBMISSION_ROW, padding=-1),
            _binding("logit_bias_values", C.VALUE_SOURCE_LOGIT_BIAS_VALUES, C.INDEX_MODE_SUBMISSION_ROW, padding=0),
        ]
    if operation in (C.OPERATION_PREFILL, C.OPERATION_MIXED, C.OPERATION_SCORED_PREFILL):
        bindings.append(_binding("prompt_tokens", C.VALUE_SOURCE_PROMPT_TOKENS, C.INDEX_MODE_PACKED_TOKEN,
                                 padding=-1))
    if operation == C.OPERATION_SCORED_PREFILL:
        bindings.append(_binding("scored_targets", C.VALUE_SOURCE_SCORED_TARGET_TOKENS, C.INDEX_MODE_PACKED_TOKEN,
                                 padding=-1))
    if operation == C.OPERATION_RESUME:
        # host-owned pending token (STA-6): one token per row, packed like prompt tokens
        bindings.append(_binding(RESUME_PENDING_DESTINATION, C.VALUE_SOURCE_PENDING_TOKEN,
                                 C.INDEX_MODE_PACKED_TOKEN, padding=-1))
    # MIXED binds no prefill row: its host-fed lanes are those whose prompt tokens are not the
    # padding (-1), so one round takes several prompts beside the decode lanes (select_input.v2)
    if operation == C.OPERATION_DECODE:
        # every decode row reads its device-owned pending token
        bindings.append(_binding("prefill_row", C.VALUE_SOURCE_CONSTANT, C.INDEX_MODE_SCALAR, constant=-1))
    if snapshots and operation in SNAPSHOT_OPERATIONS:
        bindings.append(_binding("snapshot_row", C.VALUE_SOURCE_SNAPSHOT_DESTINATION, C.INDEX_MODE_SUBMISSION_ROW,
                                 padding=-1))
    return bindings


# Steps that can end a prompt, so they may publish a snapshot at its endpoint.
SNAPSHOT_OPERATIONS = (C.OPERATION_PREFILL, C.OPERATION_MIXED)
# Steps whose input ids are all host tokens in `prompt_tokens` (no tokens.select_input node);
# RESUME feeds each row's host-owned pending token there (its GraphContract.pending_token names it).
HOST_INPUT_OPERATIONS = (C.OPERATION_PREFILL, C.OPERATION_RESUME, C.OPERATION_SCORED_PREFILL)
RESUME_PENDING_DESTINATION = "prompt_tokens"


def restoration_bindings() -> list[C.ValueBinding]:
    return _row_identity() + [
        _binding("restore_row", C.VALUE_SOURCE_RESTORE_SOURCE, C.INDEX_MODE_SUBMISSION_ROW, padding=-1),
        _binding("consumed", C.VALUE_SOURCE_CONSUMED_TOKENS, C.INDEX_MODE_SUBMISSION_ROW, padding=0),
        _binding("page_table", C.VALUE_SOURCE_PAGE_TABLE, C.INDEX_MODE_PHYSICAL_ROW),
    ]


def initialization_bindings() -> list[C.ValueBinding]:
    return _row_identity() + [
        _binding("in_seeds", C.VALUE_SOURCE_SEED_BITS, C.INDEX_MODE_SUBMISSION_ROW, padding=0),
        _binding("in_sampling", C.VALUE_SOURCE_SAMPLING_PARAMETERS, C.INDEX_MODE_SUBMISSION_ROW, padding=0),
        _binding("in_output_limit", C.VALUE_SOURCE_OUTPUT_LIMIT, C.INDEX_MODE_SUBMISSION_ROW, padding=0),
        _binding("in_eos_ids", C.VALUE_SOURCE_EOS_IDS, C.INDEX_MODE_SUBMISSION_ROW, padding=-1),
        _binding("in_histogram", C.VALUE_SOURCE_PROMPT_HISTOGRAM, C.INDEX_MODE_SUBMISSION_ROW, padding=0),
    ]


# ---- shared nodes --------------------------------------------------------------------------

@dataclass(frozen=True)
class StepIO:
    """What a recipe's forward pass reads and writes; everything else is shared."""

    operation: int
    rows: int
    tokens: int
    ids: Ref                 # i32 [tokens] input token ids
    positions: Ref           # i32 [tokens]
    page_table: Ref          # i32 [slots, pages_per_row]
    row_slot: Ref            # i32 [rows]
    geometry: Ref            # i32 step geometry
    logits: Ref              # f32 [rows, vocab] output of the forward pass
    page_tokens: int
    pages_per_row: int


def record_step_prologue(rec: Recorder, transport: M.Transport, cap: TextCapacities, operation: C.Operation.ValueType,
                         rows: int, tokens: int) -> StepIO:
    rec.launch("step.geometry.v1", "step.geometry", geometry=STEP_SCRATCH.geometry,
               query_length=staged(transport, "query_length"), rows=rows, tokens=tokens)
    ids = staged(transport, "prompt_tokens")
    if operation == C.OPERATION_MIXED:
        rec.launch("tokens.select_input.v2", "step.input_ids", ids=STEP_SCRATCH.ids,
                   prompt_tokens=staged(transport, "prompt_tokens"), pending=SLOT_STATE.pending,
                   row_slot=staged(transport, "row_slot"), geometry=STEP_SCRATCH.geometry,
                   rows=rows, tokens=tokens)
        ids = Ref(STEP_SCRATCH.ids)
    elif operation not in HOST_INPUT_OPERATIONS:
        rec.launch("tokens.select_input.v1", "step.input_ids", ids=STEP_SCRATCH.ids,
                   prompt_tokens=staged(transport, "prompt_tokens"), pending=SLOT_STATE.pending,
                   row_slot=staged(transport, "row_slot"), prefill_row=staged(transport, "prefill_row"),
                   geometry=STEP_SCRATCH.geometry, rows=rows, tokens=tokens)
        ids = Ref(STEP_SCRATCH.ids)
    return StepIO(operation=operation, rows=rows, tokens=tokens, ids=ids, positions=staged(transport, "positions"),
                  page_table=staged(transport, "page_table"), row_slot=staged(transport, "row_slot"),
                  geometry=Ref(STEP_SCRATCH.geometry), logits=Ref(STEP_SCRATCH.logits),
                  page_tokens=cap.page_tokens, pages_per_row=cap.pages_per_row)


def record_sampling_epilogue(rec: Recorder, transport: M.Transport, cap: TextCapacities,
                             operation: C.Operation.ValueType,
                             rows: int) -> None:
    s = lambda name: staged(transport, name)  # noqa: E731 - short local alias
    scratch = dict(partials=STEP_SCRATCH.sampling_partials, arrivals=STEP_SCRATCH.sampling_arrivals)
    # the request's logit bias goes into the logits themselves: the draw and the logprobs both
    # see it (OpenAI's logprobs reflect logit_bias)
    if cap.logit_bias_capacity:
        rec.launch("sampling.logit_bias.v1", "sampling.logit_bias", logits=STEP_SCRATCH.logits,
                   bias_ids=s("logit_bias_ids"), bias_values=s("logit_bias_values"), rows=rows, vocab=cap.vocab,
                   bias_capacity=cap.logit_bias_capacity)
    # the draw applies the penalties and grammar mask on the fly: the logits stay the (biased)
    # model logits, which the logprobs report (vLLM's default)
    rec.launch("sampling.draw.v2", "sampling.draw", sampled=STEP_SCRATCH.sampled, logits=STEP_SCRATCH.logits,
               sampling=SLOT_STATE.sampling, seeds=SLOT_STATE.seeds, generated=SLOT_STATE.generated,
               prompt_histogram=SLOT_STATE.prompt_histogram, output_histogram=SLOT_STATE.output_histogram,
               grammar_mask=s("grammar_mask"), row_slot=s("row_slot"), sample_flag=s("sample_flag"), **scratch,
               rows=rows, vocab=cap.vocab, histogram_bins=cap.histogram_bins, mask_words=cap.mask_words)
    rec.launch("state.commit.v1", "state.commit", completion=COMPLETION, pending=SLOT_STATE.pending,
               generated=SLOT_STATE.generated, output_histogram=SLOT_STATE.output_histogram,
               sampled=STEP_SCRATCH.sampled, eos_ids=SLOT_STATE.eos_ids, output_limit=SLOT_STATE.output_limit,
               row_slot=s("row_slot"), row_generation=s("row_generation"), query_length=s("query_length"),
               consumed=s("consumed"), sample_flag=s("sample_flag"), transport_header=s(TRANSPORT_HEADER),
               live_rows=s("live_rows"), rows=rows, eos_capacity=cap.eos_capacity,
               histogram_bins=cap.histogram_bins, operation=operation)
    if cap.logprobs:
        rec.launch("sampling.logprobs.v2", "sampling.logprobs", completion=COMPLETION, logits=STEP_SCRATCH.logits,
                   sampled=STEP_SCRATCH.sampled, sampling=SLOT_STATE.sampling, row_slot=s("row_slot"),
                   sample_flag=s("sample_flag"), live_rows=s("live_rows"), **scratch, rows=rows, vocab=cap.vocab,
                   top_n=cap.top_logprobs, record_base=cap.logprob_base)


LOGITS_KERNEL = "logits.norm_head.v1"


def record_scoring(rec: Recorder, transport: M.Transport, cap: TextCapacities, io: StepIO) -> None:
    """SCORED_PREFILL, after the forward pass: each packed token's log-probability of its target.

    Reads the recipe's own final norm and LM head from the forward pass's `logits.norm_head.v1`
    node (no per-recipe declaration); writes one f32 per packed token at `cap.score_base`."""
    head = rec.last_args(LOGITS_KERNEL)
    rec.launch("logits.score_targets.v1", "logits.score_targets", completion=COMPLETION, hidden=head["hidden"],
               norm_weight=head["norm_weight"], head=head["head"], targets=staged(transport, "scored_targets"),
               geometry=io.geometry, tokens=io.tokens, dim=head["dim"], vocab=head["vocab"], eps=head["eps"],
               record_base=cap.score_base)


def record_initialization(rec: Recorder, transport: M.Transport, cap: TextCapacities, rows: int) -> None:
    s = lambda name: staged(transport, name)  # noqa: E731
    rec.launch("state.admit.v1", "state.admit", seeds=SLOT_STATE.seeds, sampling=SLOT_STATE.sampling,
               output_limit=SLOT_STATE.output_limit, eos_ids=SLOT_STATE.eos_ids,
               prompt_histogram=SLOT_STATE.prompt_histogram, output_histogram=SLOT_STATE.output_histogram,
               generated=SLOT_STATE.generated, pending=SLOT_STATE.pending, completion=COMPLETION,
               in_seeds=s("in_seeds"), in_sampling=s("in_sampling"), in_output_limit=s("in_output_limit"),
               in_eos_ids=s("in_eos_ids"), in_histogram=s("in_histogram"), row_slot=s("row_slot"),
               row_generation=s("row_generation"), transport_header=s(TRANSPORT_HEADER),
               live_rows=s("live_rows"), rows=rows, eos_capacity=cap.eos_capacity,
               histogram_bins=cap.histogram_bins, operation=C.OPERATION_INITIALIZATION)


def _continuation_args(cache: PagedKV, cap: TextCapacities) -> dict:
    return dict(k_continuation=cache.k_continuation, v_continuation=cache.v_continuation,
                page_tokens=cap.page_tokens, pages_per_row=cap.pages_per_row, page_stride=cache.page_stride,
                row_stride=cache.page_stride)


def record_snapshot(rec: Recorder, transport: M.Transport, cap: TextCapacities, cache: PagedKV, rows: int) -> None:
    """After the forward pass of a step that may end a prompt: its partial page -> continuation row."""
    s = lambda name: staged(transport, name)  # noqa: E731
    rec.launch("cache.snapshot_partial.v1", "cache.snapshot", k_cache=cache.k_plane, v_cache=cache.v_plane,
               page_table=s("page_table"), row_slot=s("row_slot"), snapshot_row=s("snapshot_row"),
               consumed=s("consumed"), query_length=s("query_length"), live_rows=s("live_rows"), rows=rows,
               **_continuation_args(cache, cap))


def record_restoration(rec: Recorder, transport: M.Transport, cap: TextCapacities, cache: PagedKV,
                       rows: int) -> None:
    s = lambda name: staged(transport, name)  # noqa: E731
    rec.launch("cache.restore_partial.v1", "cache.restore", k_cache=cache.k_plane, v_cache=cache.v_plane,
               completion=COMPLETION, page_table=s("page_table"), row_slot=s("row_slot"),
               row_generation=s("row_generation"), restore_row=s("restore_row"), consumed=s("consumed"),
               transport_header=s(TRANSPORT_HEADER), live_rows=s("live_rows"), rows=rows,
               operation=C.OPERATION_RESTORATION, **_continuation_args(cache, cap))


# ---- graph contracts -----------------------------------------------------------------------

_ACCESS = {abi.Access.READ: C.ACCESS_READ, abi.Access.WRITE: C.ACCESS_WRITE, abi.Access.READ_WRITE: C.ACCESS_READ_WRITE}


def state_accesses(program: M.Program, buffers: dict[str, M.Buffer], request_slots: int) -> list[C.StateAccess]:
    """Per-graph accesses derived from the program's own nodes (never from another operation's).

    Buffers with one row per physical slot get a per-row view; others (snapshot continuation rows,
    indexed by snapshot row) one view over the whole buffer (row_stride 0)."""
    reads: dict[str, bool] = {}
    writes: dict[str, bool] = {}
    for node in program.nodes:
        if node.kind != M.NODE_KIND_KERNEL:   # an all-reduce sums scratch, never slot state
            continue
        spec = abi.kernel(node.kernel)
        for param, arg in zip(spec.params, node.args):
            if not param.is_pointer:
                continue
            target = buffers[arg.pointer.buffer]
            if target.kind != M.BUFFER_KIND_STATE:
                continue
            if param.access in (abi.Access.READ, abi.Access.READ_WRITE):
                reads[target.name] = True
            if param.access in (abi.Access.WRITE, abi.Access.READ_WRITE):
                writes[target.name] = True
    accesses = []
    for name in sorted(set(reads) | set(writes)):
        target = buffers[name]
        access = C.ACCESS_READ_WRITE if name in reads and name in writes else (
            C.ACCESS_READ if name in reads else C.ACCESS_WRITE)
        if target.shape[0] == request_slots:
            row_bytes = target.nbytes // target.shape[0]
            view = C.StateView(name=name, buffer=name, byte_offset=0, row_stride=row_bytes, byte_extent=row_bytes)
        else:
            view = C.StateView(name=name, buffer=name, byte_offset=0, row_stride=0, byte_extent=target.nbytes)
        accesses.append(C.StateAccess(view=view, access=access))
    return accesses


def graph_contract(program: M.Program, bindings: list[C.ValueBinding], buffers: dict[str, M.Buffer],
                   resources: list[str], request_slots: int) -> C.GraphContract:
    graph = C.GraphContract(program=program.name, operation=program.operation, rank=program.rank,
                            bindings=bindings, resources=resources, state_rows_per_request=1)
    graph.capacity.CopyFrom(program.capacity)
    graph.state_accesses.extend(state_accesses(program, buffers, request_slots))
    if program.operation == C.OPERATION_RESUME:
        # the host feeds the pending token (STA-6); state.commit still writes state.pending (STA-5)
        graph.pending_token.host_destination = RESUME_PENDING_DESTINATION
    elif program.operation not in (C.OPERATION_INITIALIZATION, C.OPERATION_RESTORATION):
        graph.pending_token.device_state_view = SLOT_STATE.pending
    graph.cursor.CopyFrom(C.CompletionCursor(reports_draft_cursor=False, lag_tokens=0))
    return graph
