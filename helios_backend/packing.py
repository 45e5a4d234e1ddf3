"""Shared packing: the declared value bindings of a program, written into a staging frame.

Startup (Packer.__init__) resolves every binding of every selected graph once, per frame:
destination -> Target (typed view of the frame, per-row width, [rows, width] table, padding and
offset), and the (source, index mode) pair -> one writer from two tables. Per step, `pack`
gathers each source the program binds once for all lanes (`_Step`: integer sources as one
int64 column, others as a list) and every writer places a whole destination at once:

    LANE_SOURCES    source -> value of one lane: an integer (INTEGER_SOURCES) or 1-D values / None
    SCALAR_SOURCES  source -> value of the whole submission
    TOKEN_VECTORS   source -> values of every packed token at once (positions)
    INDEX_WRITERS   (index mode, kind of source) -> how values land in the destination:
        SCALAR          dest[0] = value
        SUBMISSION_ROW  dest[r * w:(r + 1) * w] for r < lanes; rows lanes..capacity get padding
        ACTIVE_ROW      same, inactive tail untouched
        PHYSICAL_ROW    dest[slot * w:(slot + 1) * w]; page tables: only entries not yet written
        PACKED_TOKEN    lanes' values back to back, following each lane's actual token count

A step may also be given as its columns (`Packer.pack_columns`, `_Step.columnar`): integer
sources as int64 arrays, the others as lists or, where every lane has as many values, as one
[lanes, k] array written in one go; every source not given reads as a PackedLane's default
(sources whose default is None: no rows at all). The engine packs decode, mixed and prefill
rounds and INITIALIZATION steps so, without a PackedLane per lane.

Integer sources take one column write per destination; lanes without values (None: no grammar
mask, no logit bias, a decode lane's prompt tokens) take one padding write; only lanes that carry arrays
(prefill tokens, grammar masks, admission values, new page-table entries) are written one by
one. The bytes are those of the straightforward per-row writer (tests/packing_reference.py;
tests/test_packing_equivalence.py compares them over random lanes).

Page tables (BND-33/34): each frame remembers, per physical slot, the generation and the
number of page-table entries already written into that frame (`_PageMemory`, arrays over the
slots); a step writes only the new entries. A different generation on the slot forgets the
remembered length and rewrites. Row destinations that only per-lane values reach (grammar
masks, logit biases) remember how many leading rows already hold the padding
(`_PaddingMemory`): a round in which no lane has a mask or a bias writes nothing there.

SlotInitialization histograms (BND-32) are built once per request from its prompt (`SlotInitialization.for_prompt`)
and travel only in the INITIALIZATION program.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from itertools import accumulate, chain, repeat
from operator import attrgetter, getitem
from typing import Callable, Mapping, Optional, Protocol, Sequence, TypeAlias, Union, overload

import numpy as np
from helios_proto import contract_pb2 as C
from helios_proto import manifest_pb2 as M

from helios_backend.sampling_parameters import SamplingParameters


_NUMPY = {C.DTYPE_I32: np.int32, C.DTYPE_U32: np.uint32, C.DTYPE_F32: np.float32, C.DTYPE_I64: np.int64,
          C.DTYPE_U64: np.uint64, C.DTYPE_U8: np.uint8, C.DTYPE_I8: np.int8, C.DTYPE_I16: np.int16}


class PackingError(ValueError):
    """A binding the packer cannot serve (raised at startup) or lanes beyond a program's capacity."""


class CapacityError(PackingError):
    """The submitted lanes do not fit the program's captured rows or packed tokens."""


@dataclass(eq=False, slots=True)                 # not frozen: a frozen init costs ~3x (one per admitted prompt)
class PromptCounts:
    """A histogram row given by the ids it counts: the int32 counts of `ids` over `bins` bins.
    Packed by counting straight into the destination row (`_put`): a vocabulary-wide row built
    per admission and then copied cost an admission two more passes over its ~200 KB."""

    ids: np.ndarray                 # int64, each in [0, bins)
    bins: int

    def dense(self) -> np.ndarray:
        histogram = np.zeros(self.bins, np.int32)
        np.add.at(histogram, self.ids, np.int32(1))      # (a typed one: np.add.at's fast loop)
        return histogram


@dataclass(frozen=True)
class SlotInitialization:
    """What INITIALIZATION copies into a slot: sampling state of one request."""

    seed: int                       # 64 bits; Philox key = (low word, high word)
    sampling: SamplingParameters
    output_limit: int
    eos_ids: tuple[int, ...]
    prompt_counts: PromptCounts     # the prompt histogram (int32 [histogram_bins]) as the ids it counts

    @property
    def prompt_histogram(self) -> np.ndarray:
        """int32 [histogram_bins]: how often each id occurs in the prompt."""
        return self.prompt_counts.dense()

    @staticmethod
    def counts_of_prompts(prompts: Sequence[Sequence[int]], histogram_bins: int) -> list[PromptCounts]:
        """for_prompt's prompt_counts of several prompts, from one array of all their ids (the
        INITIALIZATION lanes of a round packed as columns: ProgramRunner._pack_initialization)."""
        lengths = list(map(len, prompts))
        ids = np.fromiter(chain.from_iterable(prompts), np.int64, sum(lengths))
        # the smallest and largest id decide both checks (a mask and its all() cost two more calls)
        low, high = (int(_smallest(ids)), int(_largest(ids))) if ids.size else (0, -1)
        if low < 0:                                   # the first prompt with one, as for_prompt
            first = next(p for p in prompts if len(p) and min(p) < 0)
            raise ValueError(f"prompt token id {int(min(first))} is negative")
        ends = list(accumulate(lengths))
        if high < histogram_bins:                     # each prompt's ids: a view of the one array
            return [PromptCounts(ids[end - n:end], histogram_bins) for n, end in zip(lengths, ends)]
        kept = ids < histogram_bins
        return [PromptCounts(ids[end - n:end][kept[end - n:end]], histogram_bins) for n, end in zip(lengths, ends)]

    @staticmethod
    def for_prompt(prompt: Sequence[int], histogram_bins: int, seed: int, sampling: SamplingParameters,
                   output_limit: int, eos_ids: Sequence[int]) -> "SlotInitialization":
        # the ids only (past the bins not counted; negative ids are an error): packing counts them
        # into the destination row itself (PromptCounts)
        ids = np.asarray(prompt, dtype=np.int64)
        if ids.size and ids.min() < 0:
            raise ValueError(f"prompt token id {int(ids.min())} is negative")
        return SlotInitialization(seed, sampling, output_limit, tuple(eos_ids),
                                  PromptCounts(ids[ids < histogram_bins], histogram_bins))


@dataclass(slots=True)
class PackedLane:
    """One request row of a submission: what packing writes of a scheduler Lane (scheduler/plan.py;
    the fields both have carry Lane's names) plus the values only packing needs."""

    slot: int
    generation: int
    start: int = 0                            # tokens already in the slot's history = first query position
    tokens: Optional[np.ndarray] = None       # host query tokens; None = one device-owned pending token
    sample: bool = True                       # draw a token after this step
    page_table: Sequence[int] = ()            # the slot's page list, covering start + query_len
    grammar_mask: Optional[np.ndarray] = None  # uint32 [mask_words]; None = unconstrained
    # the request's logit bias: distinct token ids and their biases (same length); None = none
    logit_bias_ids: Optional[np.ndarray] = None
    logit_bias_values: Optional[np.ndarray] = None
    initialization: Optional[SlotInitialization] = None   # INITIALIZATION lanes only
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
    def query_len(self) -> int:
        if self.tokens is None:
            if self.prefix_limit:             # the program writes the actual length (<= ceiling, total <= P)
                return 1
            return 1 + (0 if self.proposals is None else len(self.proposals))
        return len(self.tokens)


_DEFAULT_LANE = PackedLane(0, 0)          # a columnar step's lanes, for the sources it was not given


def _need_initialization(lane: PackedLane) -> SlotInitialization:
    if lane.initialization is None:
        raise PackingError(f"lane of slot {lane.slot} has no initialization values")
    return lane.initialization


# ---- value sources ---------------------------------------------------------------------------
# LANE_SOURCES: lane -> its value. Sources in INTEGER_SOURCES give one integer per lane and are
# gathered for all lanes of a step into one int64 column; the others give 1-D values or None
# (None = the binding's padding). SCALAR_SOURCES: (step, binding) -> one integer.

LaneSource = Callable[[PackedLane], "int | np.ndarray | Sequence[int] | PromptCounts | None"]


def seed_words(seeds: Sequence[int]) -> np.ndarray:
    """int64 [len(seeds), 2]: each 64-bit seed as its Philox key words (low, high)."""
    return np.array([(seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF) for seed in seeds],
                    np.int64).reshape(len(seeds), 2)


def _seed_bits(lane: PackedLane) -> np.ndarray:
    return seed_words((_need_initialization(lane).seed,))[0]


LANE_SOURCES: Mapping[int, LaneSource] = {
    C.VALUE_SOURCE_SLOT: attrgetter("slot"),
    C.VALUE_SOURCE_GENERATION: attrgetter("generation"),
    C.VALUE_SOURCE_QUERY_LENGTH: attrgetter("query_len"),
    C.VALUE_SOURCE_SAMPLING_DECISION: attrgetter("sample"),          # bool: 0 / 1 in the column
    C.VALUE_SOURCE_CONSUMED_TOKENS: attrgetter("start"),
    C.VALUE_SOURCE_PROMPT_TOKENS: attrgetter("tokens"),              # None -> padding (device token)
    C.VALUE_SOURCE_PROMPT_POSITIONS: lambda lane: np.arange(lane.start, lane.start + lane.query_len),
    C.VALUE_SOURCE_PAGE_TABLE: attrgetter("page_table"),
    C.VALUE_SOURCE_SNAPSHOT_DESTINATION: attrgetter("snapshot_row"),
    C.VALUE_SOURCE_RESTORE_SOURCE: attrgetter("restore_row"),
    C.VALUE_SOURCE_PENDING_TOKEN: attrgetter("pending_token"),       # RESUME: host-owned pending token
    C.VALUE_SOURCE_SCORED_TARGET_TOKENS: attrgetter("scored_targets"),   # None -> padding (-1)
    C.VALUE_SOURCE_GRAMMAR_MASK: attrgetter("grammar_mask"),         # None -> padding (all allowed)
    C.VALUE_SOURCE_LOGIT_BIAS_IDS: attrgetter("logit_bias_ids"),     # None -> padding (-1: no entry)
    C.VALUE_SOURCE_LOGIT_BIAS_VALUES: attrgetter("logit_bias_values"),
    C.VALUE_SOURCE_SEED_BITS: _seed_bits,
    C.VALUE_SOURCE_SAMPLING_PARAMETERS: lambda lane: _need_initialization(lane).sampling.vector(),
    C.VALUE_SOURCE_OUTPUT_LIMIT: lambda lane: _need_initialization(lane).output_limit,
    C.VALUE_SOURCE_EOS_IDS: lambda lane: np.asarray(_need_initialization(lane).eos_ids, dtype=np.int64),
    C.VALUE_SOURCE_PROMPT_HISTOGRAM: lambda lane: _need_initialization(lane).prompt_counts,   # counted in place
    C.VALUE_SOURCE_PROPOSAL_IDS: attrgetter("proposals"),           # None -> padding
    C.VALUE_SOURCE_PROPOSAL_COUNT: lambda lane: 0 if lane.proposals is None else len(lane.proposals),
    C.VALUE_SOURCE_PROPOSAL_GENERATION: attrgetter("proposal_generation"),
    C.VALUE_SOURCE_PROPOSAL_CONSUMED: attrgetter("proposal_consumed"),
    C.VALUE_SOURCE_SPECULATIVE_PREFIX_LIMIT: attrgetter("prefix_limit"),
}

def _none_by_default(source: int) -> bool:
    try:
        return LANE_SOURCES[source](_DEFAULT_LANE) is None
    except PackingError:                          # an INITIALIZATION source: a lane must give it
        return False


# sources a PackedLane's default leaves None (padding): a columnar step not given one has no rows
_ABSENT_BY_DEFAULT = frozenset(source for source in LANE_SOURCES if _none_by_default(source))

INTEGER_SOURCES = frozenset({
    C.VALUE_SOURCE_SLOT, C.VALUE_SOURCE_GENERATION, C.VALUE_SOURCE_QUERY_LENGTH, C.VALUE_SOURCE_SAMPLING_DECISION,
    C.VALUE_SOURCE_CONSUMED_TOKENS, C.VALUE_SOURCE_SNAPSHOT_DESTINATION, C.VALUE_SOURCE_RESTORE_SOURCE,
    C.VALUE_SOURCE_PENDING_TOKEN, C.VALUE_SOURCE_OUTPUT_LIMIT, C.VALUE_SOURCE_PROPOSAL_COUNT,
    C.VALUE_SOURCE_PROPOSAL_GENERATION, C.VALUE_SOURCE_PROPOSAL_CONSUMED, C.VALUE_SOURCE_SPECULATIVE_PREFIX_LIMIT,
})


class RaggedRows(Sequence[np.ndarray]):
    """Lanes' values of different counts back to back, one array for all of them (a speculative
    round's proposals: a lane's copies, then the next lane's): read as a sequence, lane r's values
    are flat[starts[r]:starts[r] + counts[r]]; a row writer puts them all in one write."""

    __slots__ = ("flat", "counts", "starts")

    def __init__(self, flat: np.ndarray, counts: np.ndarray) -> None:
        self.flat = flat                          # every lane's values, in lane order
        self.counts = counts                      # int64 [lanes]
        self.starts = counts.cumsum() - counts    # int64 [lanes]: each lane's first value in flat

    def __len__(self) -> int:
        return self.counts.size

    @overload
    def __getitem__(self, r: int) -> np.ndarray: ...
    @overload
    def __getitem__(self, r: slice) -> list[np.ndarray]: ...

    def __getitem__(self, r: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(r, slice):
            return [self[i] for i in range(*r.indices(len(self)))]
        start = int(self.starts[r])
        return self.flat[start:start + int(self.counts[r])]


# a source's values in a columnar step: one entry per lane (None = padding), a [lanes, k] array,
# or RaggedRows (a value in every lane)
LaneValues: TypeAlias = Union[Sequence, np.ndarray]


class _Step:
    """One submission's lanes; each source's values are gathered at most once per pack():
    integer sources as an int64 column [lanes], the others as a list (None = padding).
    A columnar step (`_Step.columnar`) has no lanes: its sources are given as columns, and a
    source not given reads as a PackedLane's default in every lane."""

    __slots__ = ("lanes", "count", "_columns", "_values", "_starts", "_columnar", "_absent", "_sizes")

    def __init__(self, lanes: Sequence[PackedLane]) -> None:
        self.lanes = lanes
        self.count = len(lanes)
        self._columns: dict[int, np.ndarray] = {}
        self._values: dict[int, LaneValues] = {}
        self._starts: Optional[np.ndarray] = None
        self._columnar = False
        self._absent: set[int] = set()   # sources a columnar step reads as None in every lane
        self._sizes: dict[int, np.ndarray] = {}   # a columnar step's given value counts per lane

    @classmethod
    def columnar(cls, count: int, columns: Mapping[int, np.ndarray], values: Mapping[int, LaneValues],
                 sizes: Mapping[int, np.ndarray] | None = None) -> "_Step":
        """A step given as its columns: `count` lanes whose integer sources are `columns` (int64
        [count], QUERY_LENGTH among them) and whose other sources are `values` (a list per
        source, None = padding, or a [count, k] array: k values in every lane). No PackedLane is
        built: the one-object-per-lane cost of a decode round (docs/scheduler.md, host work per
        round)."""
        if C.VALUE_SOURCE_QUERY_LENGTH not in columns:
            raise PackingError("a columnar step needs its query lengths")
        step = cls(())
        step.count = count
        step._columnar = True
        step._columns.update(columns)
        step._values.update(values)
        if sizes:
            step._sizes.update(sizes)
        return step

    def sizes(self, source: int) -> np.ndarray:
        """int64 [lanes]: how many values each lane has of `source` (given, or counted)."""
        sizes = self._sizes.get(source)
        if sizes is None:
            values = self.values(source)
            sizes = self._sizes[source] = values.counts if type(values) is RaggedRows \
                else np.fromiter(map(len, values), np.int64, self.count)
        return sizes

    def _not_given(self, source: int) -> list:
        """A columnar step's values of a source it was not given: derived from its columns, or
        a PackedLane's default in every lane."""
        if source == C.VALUE_SOURCE_PROMPT_POSITIONS:
            starts, lengths = self.column(C.VALUE_SOURCE_CONSUMED_TOKENS).tolist(), \
                self.column(C.VALUE_SOURCE_QUERY_LENGTH).tolist()
            return [np.arange(start, start + n) for start, n in zip(starts, lengths)]
        if source == C.VALUE_SOURCE_PROPOSAL_COUNT:
            return [0 if ids is None else len(ids) for ids in self.values(C.VALUE_SOURCE_PROPOSAL_IDS)]
        default = LANE_SOURCES[source](_DEFAULT_LANE)
        if default is None:
            self._absent.add(source)
        return [default] * self.count

    def column(self, source: int) -> np.ndarray:
        column = self._columns.get(source)
        if column is None:
            lanes = self._not_given(source) if self._columnar else map(LANE_SOURCES[source], self.lanes)
            column = np.fromiter(lanes, np.int64, self.count)
            self._columns[source] = column
        return column

    def values(self, source: int) -> LaneValues:
        values = self._values.get(source)
        if values is None:
            values = self._not_given(source) if self._columnar else list(map(LANE_SOURCES[source], self.lanes))
            self._values[source] = values
        return values

    def present(self, source: int) -> list[int]:
        """The rows whose value of `source` is not None (not padding)."""
        if self._columnar and source in _ABSENT_BY_DEFAULT and source not in self._values:
            return []                    # not given: None in every lane, without the list of them
        values = self.values(source)
        if source in self._absent:
            return []
        if type(values) is np.ndarray or type(values) is RaggedRows:   # a value in every lane
            return list(range(self.count))
        return [r for r, value in enumerate(values) if value is not None]

    def packed(self) -> int:
        """The lanes' packed tokens (their query lengths' sum): a decode step needs no starts."""
        if self._starts is not None:
            return int(self._starts[-1])
        return int(np.add.reduce(self.column(C.VALUE_SOURCE_QUERY_LENGTH)))

    def token_starts(self) -> np.ndarray:
        """int64 [lanes + 1]: where each lane's packed tokens begin; the last entry is their total."""
        if self._starts is None:
            self._starts = np.zeros(self.count + 1, np.int64)
            self._starts[1:] = self.column(C.VALUE_SOURCE_QUERY_LENGTH).cumsum()
        return self._starts


_largest = np.maximum.reduce       # ndarray.max() without its Python-level wrapper (a decode round calls it ~4 times)
_smallest = np.minimum.reduce


def _positions(step: _Step) -> np.ndarray:
    """int64 [packed tokens]: consumed, consumed + 1, ... for each lane's query tokens, back to back."""
    consumed = step.column(C.VALUE_SOURCE_CONSUMED_TOKENS)
    if step.packed() == step.count:       # one token per lane (lengths >= 0 summing to the lane count, ...
        if step.count == 0 or _largest(step.column(C.VALUE_SOURCE_QUERY_LENGTH)) == 1:   # ... none above 1)
            return consumed
    starts, lengths = step.token_starts(), step.column(C.VALUE_SOURCE_QUERY_LENGTH)
    return (consumed - starts[:-1]).repeat(lengths) + np.arange(starts[-1])


# Sources of PACKED_TOKEN destinations computed for every packed token at once.
TOKEN_VECTORS: Mapping[int, Callable[[_Step], np.ndarray]] = {
    C.VALUE_SOURCE_PROMPT_POSITIONS: _positions,
}


def _mixed_prefill_row(step: _Step, binding: C.ValueBinding) -> int:
    rows = [i for i, tokens in enumerate(step.values(C.VALUE_SOURCE_PROMPT_TOKENS)) if tokens is not None]
    if len(rows) > 1:
        raise CapacityError(f"a mixed step carries one prefill row, got {len(rows)}")
    return rows[0] if rows else int(binding.padding)


ScalarSource = Callable[[_Step, C.ValueBinding], int]
SCALAR_SOURCES: Mapping[int, ScalarSource] = {
    C.VALUE_SOURCE_LIVE_ROW_COUNT: lambda step, binding: step.count,
    C.VALUE_SOURCE_MIXED_PREFILL_ROW: _mixed_prefill_row,
    C.VALUE_SOURCE_CONSTANT: lambda step, binding: int(binding.constant),
}


# ---- destinations ----------------------------------------------------------------------------

_ROW_MODES = (C.INDEX_MODE_SUBMISSION_ROW, C.INDEX_MODE_ACTIVE_ROW)


class _PageMemory:
    """What one frame holds of one PHYSICAL_ROW destination (BND-33/34), per physical slot: the
    generation its entries belong to and how many entries are written (0: none known)."""

    def __init__(self, slots: int) -> None:
        self.generation = np.zeros(slots, np.int64)    # [S]
        self.written = np.zeros(slots, np.int64)       # [S] entries from the row's start

    def forget(self, slot: int) -> None:
        if 0 <= slot < self.written.size:
            self.written[slot] = 0


class _PaddingMemory:
    """Which rows of one frame's row-mode destination are known to hold the padding: a prefix
    [0, clean) and a tail [tail, rows). Only for destinations that no other writer touches (every
    binding of them packs by row, with one padding, all per-lane values or all integer columns):
    a 128-row grammar mask is 786 KB, and rewriting its padding every decode round took a third
    of the packing time (bench/packing.py), for rounds where no lane has a mask; an admission's
    histogram rows are 196 KB each, and the rows an INITIALIZATION program of 64 rows leaves
    empty were rewritten at every admitting round; and a decode round's integer columns (slot,
    generation, position, ...) fall short of its program's rows by the same padding round after
    round. Integer columns use the tail only: they write every lane's row.

    The window [lo, hi) is what a program of fewer rows than the tail knows of its own rows: the
    rows it padded after its lanes, while rows past its last one are not known (a larger program
    that never ran yet leaves the tail at the destination's end). Without it, an INITIALIZATION of
    a few lanes rewrote the histogram rows up to its program's end (196 KB each) at every
    admitting round. A write of lanes' values ends the window below them (`written`)."""

    def __init__(self, rows: int) -> None:
        self.clean = 0                                 # rows [0, clean) hold the padding
        self.tail = rows                               # rows [tail, rows) hold the padding
        self.lo = self.hi = 0                          # rows [lo, hi) hold the padding
        self.counts = False                            # rows hold PromptCounts (_count_over_padding)
        # rows that hold the padding except at these indices (a PromptCounts row counted over
        # the padding): the next counts in such a row clear those entries, not ~200 KB
        self.sparse: dict[int, np.ndarray] = {}

    def written(self, end: int) -> None:
        """Rows below `end` received values: the window starts at `end` at the earliest."""
        if self.lo < end:
            self.lo = min(end, self.hi)

    def padded(self, row: int) -> bool:
        """Whether `row` is known to hold the padding throughout."""
        return row < self.clean or row >= self.tail or self.lo <= row < self.hi


class Target:
    """A resolved destination inside one frame.

        view   typed 1-D view of the destination's elements in the frame
        table  row modes: view[:rows * width] as [rows, width]; row r = submission row r
        pad    the binding's bare padding in the destination dtype (BND-17)
    """

    def __init__(self, view: np.ndarray, width: int, rows: int, binding: C.ValueBinding,
                 memory: Optional[_PageMemory] = None) -> None:
        self.view, self.width, self.rows, self.binding = view, width, rows, binding
        self._memory = memory
        self.padding: Optional[_PaddingMemory] = None   # None: pad every time
        self._table = view[:rows * width].reshape(rows, width) if binding.index in _ROW_MODES else None
        self.offset = int(binding.offset)              # a Python int: numpy keeps the values' dtype
        self.pad = np.array(binding.padding).astype(view.dtype)
        self._pads: dict[np.dtype, np.ndarray] = {}

    @property
    def table(self) -> np.ndarray:
        """The [rows, width] table of a row mode (the row writers' view)."""
        if self._table is None:
            raise PackingError(f"{self.binding.destination}: not indexed by row")
        return self._table

    @property
    def memory(self) -> _PageMemory:
        """What a PHYSICAL_ROW destination of this frame already holds per slot."""
        if self._memory is None:
            raise PackingError(f"{self.binding.destination}: not indexed by physical row")
        return self._memory

    def pad_as(self, dtype: np.dtype) -> np.ndarray:
        """The padding that ends a short row of values of `dtype` (held in their dtype first)."""
        pad = self._pads.get(dtype)
        if pad is None:
            pad = self._pads[dtype] = np.full(1, self.binding.padding, dtype=dtype)
        return pad


def _put_rows(table: np.ndarray, values: np.ndarray, target: Target) -> None:
    """_put of each row of `values` [lanes, k] into the table's leading rows, in one write."""
    if target.offset and values.dtype.kind in "iu":
        values = values + target.offset
    n, size = values.shape
    width = table.shape[1]
    if size > width:
        raise CapacityError(f"{target.binding.destination}: {size} values exceed the row width {width}")
    table[:n, :size] = values
    if size < width:
        table[:n, size:] = target.pad_as(values.dtype)


def _put_ragged(table: np.ndarray, values: RaggedRows, target: Target) -> None:
    """_put of each lane's values into its row of the table's leading rows: the rows made the
    padding (held in the values' dtype, as _put ends a short row), then every value in one write."""
    counts, flat = values.counts, values.flat
    n, width = counts.size, table.shape[1]
    if n and _largest(counts) > width:
        raise CapacityError(f"{target.binding.destination}: {_largest(counts)} values exceed the row width {width}")
    table[:n] = target.pad_as(flat.dtype)
    if not flat.size:
        return
    if target.offset and flat.dtype.kind in "iu":
        flat = flat + target.offset
    # each value's row, and its column: its place in the flat array less its lane's start
    rows = np.repeat(np.arange(n), counts)
    table[rows, np.arange(flat.size) - values.starts[rows]] = flat


def _put(dst: np.ndarray, value, target: Target, cut: bool = False) -> None:
    """One lane's values into `dst` (its row, or its span of packed tokens): the offset is added
    to integer values, the rest of `dst` gets the bare padding (BND-17). Values beyond `dst` are
    an error in a row, cut off in a span (`cut`: a span follows the lane's query length)."""
    if type(value) is PromptCounts:
        if value.bins <= dst.size:                 # the counts' row: offset, then one per id
            dst[:value.bins] = target.offset
            if value.bins < dst.size:
                dst[value.bins:] = target.pad_as(np.dtype(np.int32))
            np.add.at(dst, value.ids, dst.dtype.type(1))
            return
        value = value.dense()
    values = np.asarray(value)
    if values.ndim != 1:
        values = values.reshape(-1)
    if target.offset and values.dtype.kind in "iu":
        values = values + target.offset
    size = values.size
    if size > dst.size:
        if not cut:
            raise CapacityError(f"{target.binding.destination}: {size} values exceed the row width {dst.size}")
        values, size = values[:dst.size], dst.size
    dst[:size] = values
    if size < dst.size:
        dst[size:] = target.pad_as(values.dtype)


# ---- index modes -----------------------------------------------------------------------------
# One writer per (index mode, kind of source): (target, step, source) -> None. Kinds: "integer"
# (INTEGER_SOURCES: one column write), "values" (per-lane arrays: padding rows in one write,
# then the lanes that carry values), "vector" (TOKEN_VECTORS: every packed token at once).

def _integer_rows(target: Target, step: _Step, source: int, pad_tail: bool) -> None:
    n, table = step.count, target.table
    values = step.column(source)
    if target.offset:
        values = values + target.offset
    table[:n, 0] = values
    if target.width > 1:
        table[:n, 1:] = target.pad
    memory = target.padding
    if memory is None:
        if pad_tail and n < target.rows:
            table[n:] = target.pad
        return
    memory.written(n)
    if pad_tail:
        _pad_after(table, n, target, memory)
    else:                                             # rows from n on untouched
        memory.tail = max(memory.tail, n)


def _value_rows(target: Target, step: _Step, source: int, pad_tail: bool) -> None:
    n, table, memory = step.count, target.table, target.padding
    present = step.present(source)
    values = step.values(source) if present or memory is None else ()
    if not present and memory is not None:
        end = target.rows if pad_tail else n          # rows [0, end) must read the padding
        if memory.clean < end:
            stop = min(end, memory.tail)              # and [tail, rows) do already
            if memory.clean < stop:
                table[memory.clean:stop] = target.pad
            memory.clean = end
        return
    if not present:
        table[:n] = target.pad
    elif len(present) < n:
        table[[r for r, value in enumerate(values) if value is None]] = target.pad
    if type(values) is np.ndarray or type(values) is RaggedRows:    # every row at once
        if memory is not None and memory.sparse:
            for r in present:
                memory.sparse.pop(r, None)
        if isinstance(values, RaggedRows):
            _put_ragged(table, values, target)
        else:
            _put_rows(table, values, target)
    else:
        counts_over_padding = memory is not None and target.binding.padding == target.offset
        counted: list[int] = []                       # rows whose counts are added over the padding
        for r in present:
            value = values[r]
            if memory is not None:
                if counts_over_padding and type(value) is PromptCounts and value.bins <= target.width:
                    counted.append(r)
                    continue
                memory.sparse.pop(r, None)
            _put(table[r], value, target)
        if counted:
            assert memory is not None
            _count_over_padding(table, [values[r] for r in counted], counted, target, memory)
    if memory is None:
        if pad_tail and n < target.rows:
            table[n:] = target.pad
        return
    memory.clean = min(memory.clean, present[0])      # rows before the first lane with values
    memory.written(present[-1] + 1)
    if not pad_tail:                                  # rows from n on untouched
        memory.tail = max(memory.tail, present[-1] + 1)
    else:
        _pad_after(table, n, target, memory)


def _pad_after(table: np.ndarray, n: int, target: Target, memory: _PaddingMemory) -> None:
    """Rows [n, target.rows) made the padding, where rows [memory.tail, rows) hold it already
    (or, with the tail past them, the window [lo, hi))."""
    rows = target.rows
    if memory.tail <= rows:
        if n < memory.tail:
            _pad_rows(table, n, memory.tail, target, memory)
        memory.tail = n
    elif n < rows:
        lo, hi = memory.lo, memory.hi                 # (rows of it below n do not matter here)
        if lo >= hi:
            lo = hi = rows
        if n < lo:                                    # the rows below the window
            _pad_rows(table, n, min(lo, rows), target, memory)
        if max(hi, n) < rows:                         # and above it
            _pad_rows(table, max(hi, n), rows, target, memory)
        memory.lo, memory.hi = n, max(rows, hi) if lo <= rows else rows


_NO_IDS = np.zeros(0, np.int64)      # a row of counts that counts nothing (the padding throughout)


def _pad_rows(table: np.ndarray, start: int, stop: int, target: Target, memory: _PaddingMemory) -> None:
    """Rows [start, stop) made the padding: a row that holds the padding but for its counts
    (`memory.sparse`) has those entries cleared, in one indexed write for all such rows, not its
    ~200 KB (a round of prompts after a larger one leaves such rows behind it)."""
    sparse = memory.sparse
    counted = [r for r in range(start, stop) if r in sparse]
    if not counted:
        table[start:stop] = target.pad
    else:
        for r in range(start, stop):
            if r not in sparse:
                table[r] = target.pad
        table.reshape(-1)[_flat_indices(counted, [sparse.pop(r) for r in counted], target.width)] = target.pad
    if memory.counts:
        # rows of counts, padded throughout now: the padding but for no entries, so that the next
        # counts into them (or the next padding) clear nothing rather than their ~200 KB again
        sparse.update(zip(range(start, stop), repeat(_NO_IDS)))




def _count_over_padding(table: np.ndarray, counts: list[PromptCounts], rows: list[int], target: Target,
                        memory: _PaddingMemory) -> None:
    """_put of counts whose zero (the offset) is the padding, into their rows: each row is made
    the padding (known already, or cleared where its last counts were), then counted into; the
    clearing and the counting of all rows in one indexed write and one np.add.at (a round of
    prompts admits tens of requests)."""
    width, sparse = target.width, memory.sparse
    memory.counts = True
    cleared: list[int] = []                           # rows whose last counts are cleared
    known: list[np.ndarray] = []
    for r, value in zip(rows, counts):
        last = sparse.get(r)
        if not memory.padded(r):                      # not known to hold the padding throughout
            if last is not None:
                cleared.append(r)
                known.append(last)
            else:
                table[r] = target.pad
        sparse[r] = value.ids
    flat = table.reshape(-1)
    if cleared:
        flat[_flat_indices(cleared, known, width)] = target.pad
    # one of the table's own type: np.add.at then takes its fast loop (~1 ns an id, against ~35 ns
    # and a fixed ~5 us with a Python int, which made np.unique the faster count past 256 ids)
    np.add.at(flat, _flat_indices(rows, [value.ids for value in counts], width), flat.dtype.type(1))


def _flat_indices(rows: list[int], ids: list[np.ndarray], width: int) -> np.ndarray:
    """The positions of each row's `ids` in its [rows, width] table read flat."""
    if len(rows) == 1:
        return ids[0] + rows[0] * width
    flat = np.concatenate(ids)
    flat += np.repeat(np.array(rows, np.int64) * width, [len(i) for i in ids])
    return flat


def _integer_tokens(target: Target, step: _Step, source: int) -> None:
    """One value per lane at its first packed token; its further tokens get padding."""
    starts, lengths = step.token_starts(), step.column(C.VALUE_SOURCE_QUERY_LENGTH)
    values = step.column(source)
    if target.offset:
        values = values + target.offset
    target.view[:starts[-1]] = target.pad
    live = lengths > 0
    target.view[starts[:-1][live]] = values[live]


def _vector_tokens(target: Target, step: _Step, source: int) -> None:
    values = TOKEN_VECTORS[source](step)
    if target.offset:
        values = values + target.offset
    target.view[:values.size] = values


def _value_tokens(target: Target, step: _Step, source: int) -> None:
    """Each lane's values over its span of packed tokens; lanes without values read padding."""
    starts, values, present = step.token_starts(), step.values(source), step.present(source)
    if len(present) < step.count:
        target.view[:starts[-1]] = target.pad          # lanes with values overwrite their spans
    elif len(present) > 1 and _spans_filled(step, source, values):
        flat = np.concatenate(values)                  # a round of prompts: every span at once
        target.view[:flat.size] = flat + target.offset if target.offset and flat.dtype.kind in "iu" else flat
        return
    for r in present:
        _put(target.view[starts[r]:starts[r + 1]], values[r], target, cut=True)


def _spans_filled(step: _Step, source: int, values: LaneValues) -> bool:
    """Every lane's values are a 1-D array of one dtype as long as its span of packed tokens:
    back to back they are the spans' values, as _put writes them lane by lane."""
    first = values[0]
    if type(first) is not np.ndarray or first.ndim != 1:
        return False
    dtype = first.dtype
    for value in values:
        if type(value) is not np.ndarray or value.ndim != 1 or value.dtype != dtype:
            return False
    return bool(np.array_equal(step.sizes(source), step.column(C.VALUE_SOURCE_QUERY_LENGTH)))


def _physical_rows(target: Target, step: _Step, source: int) -> None:
    """Each lane's values at its physical slot; entries this frame already holds are skipped."""
    n, memory = step.count, target.memory
    if n == 0:
        return
    values = step.values(source)
    sizes = step.sizes(source)
    slots, generations = step.column(C.VALUE_SOURCE_SLOT), step.column(C.VALUE_SOURCE_GENERATION)
    try:
        lanes_per_slot = np.bincount(slots)              # raises on a negative slot
    except ValueError:
        lanes_per_slot = None
    if lanes_per_slot is None or lanes_per_slot.size > memory.written.size:
        raise CapacityError(f"slots {slots.tolist()} outside the {memory.written.size} physical slots")
    if _largest(lanes_per_slot) == 1:
        _upload(target, values, sizes, slots, generations)
    else:                        # a slot named twice: in lane order, each lane sees the one before
        for r in range(n):
            _upload(target, values[r:r + 1], sizes[r:r + 1], slots[r:r + 1], generations[r:r + 1])


def _upload(target: Target, values: LaneValues, sizes: np.ndarray, slots: np.ndarray, generations: np.ndarray) -> None:
    """Lanes of distinct slots: entries [held, size) of each lane that has new ones (in decode,
    the few lanes that just took a page); a new generation holds none."""
    memory, width = target.memory, target.width
    held = np.where(memory.generation[slots] == generations, memory.written[slots], 0)
    new = sizes - held
    if sizes.size and _largest(sizes) > width:
        r = int(sizes.argmax())
        raise CapacityError(f"slot {slots[r]}: {int(sizes[r])} entries exceed the row width {width}")
    ones = (new == 1).nonzero()[0]
    if ones.size:                # a decode round: the lanes that just took a page, one entry each
        first = held[ones]
        entries = np.fromiter(map(getitem, _rows_of(values, ones.tolist()), first.tolist()), np.int64, ones.size)
        target.view[slots[ones] * width + first] = entries + target.offset if target.offset else entries
    many = (new > 1).nonzero()[0]
    # admitted lanes' tables (a round of prompts): every entry at once where _put_entries can
    if not (many.size > 1 and _put_entries(target, values, many, slots, held, sizes)):
        for r in many.tolist():
            start, size = int(slots[r]) * width, int(sizes[r])
            _put(target.view[start + held[r]:start + size], values[r][held[r]:], target)
    memory.written[slots] = np.maximum(held, sizes)
    memory.generation[slots] = generations


def _rows_of(values: LaneValues, rows: list[int]) -> list:
    """values[r] for each of `rows`: a sequence that can give several at once (`select`: the
    engine's block of page tables) does, in one call."""
    select = getattr(values, "select", None)
    return select(rows) if select is not None else list(map(values.__getitem__, rows))


def _put_entries(target: Target, values: LaneValues, lanes: np.ndarray, slots: np.ndarray, held: np.ndarray,
                 sizes: np.ndarray) -> bool:
    """_upload's writes of entries [held, size) of several lanes in one: where each lane's table is
    a list of exactly `size` entries (as _put would write them: int64, offset added); False
    (nothing written) otherwise."""
    rows, first, last = lanes.tolist(), held[lanes], sizes[lanes]
    tables = _rows_of(values, rows)
    for table, size in zip(tables, last.tolist()):
        if type(table) is not list or len(table) != size:
            return False
    counts = last - first
    total = int(counts.sum())
    entries = np.fromiter(chain.from_iterable(table[h:] for table, h in zip(tables, first.tolist())), np.int64, total)
    # flat position of each entry: its lane's row start + held, then one further per entry
    offsets = np.repeat(slots[lanes] * target.width + first - (counts.cumsum() - counts), counts) + np.arange(total)
    target.view[offsets] = entries + target.offset if target.offset else entries
    return True


class RowWriter(Protocol):
    def __call__(self, target: Target, step: _Step, source: int) -> None: ...


INDEX_WRITERS: Mapping[tuple[int, str], RowWriter] = {
    (C.INDEX_MODE_SUBMISSION_ROW, "integer"): partial(_integer_rows, pad_tail=True),
    (C.INDEX_MODE_SUBMISSION_ROW, "values"): partial(_value_rows, pad_tail=True),
    (C.INDEX_MODE_ACTIVE_ROW, "integer"): partial(_integer_rows, pad_tail=False),
    (C.INDEX_MODE_ACTIVE_ROW, "values"): partial(_value_rows, pad_tail=False),
    (C.INDEX_MODE_PACKED_TOKEN, "integer"): _integer_tokens,
    (C.INDEX_MODE_PACKED_TOKEN, "vector"): _vector_tokens,
    (C.INDEX_MODE_PACKED_TOKEN, "values"): _value_tokens,
    (C.INDEX_MODE_PHYSICAL_ROW, "values"): _physical_rows,
}


def _write_scalar(target: Target, step: _Step, scalar: ScalarSource) -> None:
    value = scalar(step, target.binding)
    if type(value) is int and target.view.dtype.kind == "i":
        target.view[0] = value + target.offset      # _put's result for one integer, without its arrays
        return
    _put(target.view[:1], value, target)


# ---- the packer ------------------------------------------------------------------------------

Write = Callable[[Target, _Step], None]


def _resolve(binding: C.ValueBinding, where: str) -> Write:
    source, index = binding.source, binding.index
    if index == C.INDEX_MODE_SCALAR:
        scalar = SCALAR_SOURCES.get(source)
        if scalar is None:
            raise PackingError(f"{where}: source {C.ValueSource.Name(source)} has no scalar value")
        return partial(_write_scalar, scalar=scalar)
    if index == C.INDEX_MODE_PACKED_TOKEN and source in TOKEN_VECTORS:
        kind = "vector"
    else:
        kind = "integer" if source in INTEGER_SOURCES else "values"
    writer = INDEX_WRITERS.get((index, kind))
    if source not in LANE_SOURCES or writer is None:
        raise PackingError(f"{where}: no packing for {C.ValueSource.Name(source)} "
                           f"indexed {C.IndexMode.Name(index)}")
    return partial(writer, source=source)


def _padding_remembered(graphs: Sequence[C.GraphContract]) -> frozenset[str]:
    """Destinations whose padding the packer may remember (_PaddingMemory): every binding of
    them, in every graph packed, writes by row with the same padding, all of them per-lane values
    or all of them integer columns (_value_rows or _integer_rows: no other writer)."""
    def writer(b: C.ValueBinding) -> str | None:
        return "integer" if b.source in INTEGER_SOURCES else "values" if b.source in LANE_SOURCES else None

    bindings: dict[str, list[C.ValueBinding]] = {}
    for graph in graphs:
        for b in graph.bindings:
            bindings.setdefault(b.destination, []).append(b)
    return frozenset(name for name, bs in bindings.items()
                     if all(b.index in _ROW_MODES for b in bs) and len({b.padding for b in bs}) == 1
                     and len({writer(b) for b in bs}) == 1 and writer(bs[0]) is not None)


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
                if b.index in _ROW_MODES:
                    row_capacity[b.destination] = max(row_capacity.get(b.destination, 0), graph.capacity.rows)
        self._capacity = {g.program: (g.capacity.rows, g.capacity.tokens, g.operation) for g in graphs}
        self._sources = {g.program: frozenset(b.source for b in g.bindings) for g in graphs}
        # writes[frame][program]: (target, write) per binding, in binding order, built once
        self._writes: list[dict[str, tuple[tuple[Target, Write], ...]]] = [dict() for _ in frames]
        page_memory: list[dict[str, _PageMemory]] = [dict() for _ in frames]
        remembered = _padding_remembered(graphs)
        padding_memory: list[dict[str, _PaddingMemory]] = [dict() for _ in frames]
        for graph in graphs:
            plans: list[list[tuple[Target, Write]]] = [[] for _ in frames]
            for index, b in enumerate(graph.bindings):
                where = f"{graph.program}.bindings[{index}]"
                d = destinations[b.destination]
                dtype = _NUMPY.get(d.dtype)
                if dtype is None:
                    raise PackingError(f"{where}: destination dtype {C.DType.Name(d.dtype)} is not packable")
                if b.index in _ROW_MODES:
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
                write = _resolve(b, where)
                for f, frame in enumerate(frames):
                    view = frame[d.byte_offset:d.byte_offset + d.elements * np.dtype(dtype).itemsize].view(dtype)
                    memory = None
                    if b.index == C.INDEX_MODE_PHYSICAL_ROW:
                        memory = page_memory[f].setdefault(d.name, _PageMemory(request_slots))
                    target = Target(view, width, graph.capacity.rows, b, memory)
                    if d.name in remembered:
                        target.padding = padding_memory[f].setdefault(d.name, _PaddingMemory(row_capacity[d.name]))
                    plans[f].append((target, write))
            for f, plan in enumerate(plans):
                self._writes[f][graph.program] = tuple(plan)
        self._page_memory = [memory for frame_memory in page_memory for memory in frame_memory.values()]

    def capacity(self, program: str) -> tuple[int, int]:
        rows, tokens, _ = self._capacity[program]
        return rows, tokens

    def sources(self, program: str) -> frozenset[int]:
        """The value sources the program binds (a caller may give a columnar step only those)."""
        return self._sources[program]

    def pack(self, program: str, frame: int, lanes: Sequence[PackedLane]) -> None:
        self._pack_step(program, frame, _Step(lanes))

    def pack_columns(self, program: str, frame: int, count: int, columns: Mapping[int, np.ndarray],
                     values: Mapping[int, LaneValues], sizes: Mapping[int, np.ndarray] | None = None) -> None:
        """pack() of `count` lanes given as columns (`_Step.columnar`): the same bytes as the
        PackedLanes they describe (tests/test_packing_equivalence.py). `sizes`: the length of
        each lane's values of a source, where the caller knows them (a page table's entries)."""
        self._pack_step(program, frame, _Step.columnar(count, columns, values, sizes))

    def _pack_step(self, program: str, frame: int, step: _Step) -> None:
        rows, tokens, _ = self._capacity[program]
        if step.count > rows:
            raise CapacityError(f"{program}: {step.count} lanes > {rows} rows")
        if tokens > 0:
            packed = step.packed()
            if packed > tokens:
                raise CapacityError(f"{program}: {packed} packed tokens > {tokens}")
        for target, write in self._writes[frame][program]:
            write(target, step)

    def forget_slot(self, slot: int) -> None:
        """Drop remembered page-table lengths of a slot in every frame (e.g. after its pages moved)."""
        for memory in self._page_memory:
            memory.forget(slot)
