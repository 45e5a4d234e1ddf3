"""Runs a RoundPlan on a loaded model: shared packing, the executor, completion checks.

Executor-agnostic: it only uses the Executor protocol (staging/launch/wait) and the
Packer, so the numpy and CUDA executors serve through the same code.

One round = its submissions in order (restoration, initialization, main step), each one
`pack -> launch -> wait -> validate`. launch() launches a round's main step on a frame and
collect() waits for it, so the worker can pack and launch round N+1 on the other frame
while round N runs. With an auxiliary frame (`auxiliary_frame`: the CUDA executor's third
host frame) the submissions before the main step are launched there and waited for by
collect(), before the main one: a round that admits requests then packs its main step while
its initialization queues behind round N on the stream, instead of waiting for both (the
frame is reused only after its previous submission was waited for). A round with a
constrained lane keeps the synchronous order: one frame in flight at its submissions (MET-8).
The executor numbers submissions (BND-20); this runner takes the mirrored count from the
model's SubmissionSequence (engine/submissions.py) to check each completion's sequence
(CACHE-16). It also counts the executor frames in flight (launched, not yet waited for) and
writes that count into each submission right after its launch: the scheduler reports the
largest one after a constrained submission (flare_constrained_max_inflight, MET-8).

The lockstep generator's raw lanes (lockstep/raw_lanes.py) come through launch_lanes /
step_lanes: hand-built packing lanes, packed, numbered, launched and header-checked the same way.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from operator import attrgetter
from typing import TYPE_CHECKING, Mapping, Protocol, Sequence, TypeVar, overload

import numpy as np

from helios_proto import contract_pb2 as cp
from helios_proto import manifest_pb2 as mp

from helios_backend.engine.submissions import SubmissionSequence
from helios_backend.executors.base import FrameStateError
from helios_backend.packing import LaneValues, SlotInitialization, PackedLane, seed_words
from helios_backend.sampling_parameters import sampling_vectors
from helios_backend.scheduler.completion import (
    CompletionFormat, CompletionRows, parse_and_validate, validate_header)
from helios_backend.scheduler.decode_block import SLOT, START, DecodeBlock, explicit_lanes
from helios_backend.scheduler.plan import PENDING_TOKEN, Lane, RoundPlan, Submission
from helios_backend.scheduler.request import Request

if TYPE_CHECKING:
    from helios_backend.engine.model import NativeModel

_PENDING = [PENDING_TOKEN]               # a lane's tokens when it reads its device-owned pending token
# the main steps whose lanes pack as columns when none carries host values (_pack_columns)
_COLUMNAR = frozenset({cp.OPERATION_DECODE, cp.OPERATION_MIXED, cp.OPERATION_PREFILL})
_CONSTRAINED = attrgetter("request.spec.constrained")
_HOST_VALUES = attrgetter("request.host_values")
_SLOT, _GENERATION, _START = attrgetter("slot"), attrgetter("generation"), attrgetter("start")
_SAMPLE, _SNAPSHOT_ROW = attrgetter("sample"), attrgetter("snapshot_row")
_TOKENS, _PAGES = attrgetter("tokens"), attrgetter("request.pages")
_REQUEST, _OUTPUT_LIMIT, _SAMPLING = attrgetter("request"), attrgetter("output_limit"), attrgetter("spec.sampling")
_KNOWN_TOKENS, _IGNORE_EOS = attrgetter("tokens"), attrgetter("spec.ignore_eos")
# what an INITIALIZATION step packed as columns gives (_pack_initialization): a program that binds
# only these takes that path, any other its PackedLanes
_INITIALIZATION_COLUMNS = frozenset({
    cp.VALUE_SOURCE_SLOT, cp.VALUE_SOURCE_GENERATION, cp.VALUE_SOURCE_LIVE_ROW_COUNT, cp.VALUE_SOURCE_CONSTANT,
    cp.VALUE_SOURCE_SEED_BITS, cp.VALUE_SOURCE_SAMPLING_PARAMETERS, cp.VALUE_SOURCE_OUTPUT_LIMIT,
    cp.VALUE_SOURCE_EOS_IDS, cp.VALUE_SOURCE_PROMPT_HISTOGRAM})


_CONSTANTS: dict[tuple[int, int], np.ndarray] = {}


def _constant(count: int, value: int) -> np.ndarray:
    """int64 [count] of `value`, read-only and made once per count: a block's query lengths,
    sampling decisions (1) and snapshot rows (-1) are these in every round."""
    column = _CONSTANTS.get((count, value))
    if column is None:
        column = _CONSTANTS[count, value] = np.full(count, value, np.int64)
        column.flags.writeable = False
    return column


class _BlockPages(Sequence[Sequence[int]]):
    """A block round's page tables, read lane by lane where the packer reads them: it is given
    their lengths (the block's page counts) and reads entries only of the lanes that took a page,
    so the requests of the other lanes are not touched."""

    __slots__ = ("requests", "extra")

    def __init__(self, requests: list[Request], extra: Sequence[Lane]) -> None:
        self.requests, self.extra = requests, extra

    def __len__(self) -> int:
        return len(self.requests) + len(self.extra)

    def select(self, rows: list[int]) -> list[Sequence[int]]:
        """self[r] for each of `rows` (the packer's read of the lanes with new entries)."""
        requests, extra = self.requests, self.extra
        k = len(requests)
        return [requests[r].pages if r < k else extra[r - k].request.pages for r in rows]

    @overload
    def __getitem__(self, index: int) -> Sequence[int]: ...
    @overload
    def __getitem__(self, index: slice) -> list[Sequence[int]]: ...

    def __getitem__(self, index: int | slice) -> Sequence[int] | list[Sequence[int]]:
        requests = self.requests
        if type(index) is int and 0 <= index < len(requests):
            return requests[index].pages              # a column lane: the packer's usual read
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        k = len(self.requests)
        if index < 0:
            index += len(self)
        return self.requests[index].pages if index < k else self.extra[index - k].request.pages


class ExecutorLike(Protocol):
    def launch(self, program: str, frame: int) -> None: ...
    def wait(self, frame: int) -> np.ndarray: ...


class PackerLike(Protocol):
    def sources(self, program: str) -> frozenset[int]: ...
    def pack(self, program: str, frame: int, lanes: Sequence[PackedLane]) -> None: ...
    def pack_columns(self, program: str, frame: int, count: int, columns: Mapping[int, np.ndarray],
                     values: Mapping[int, LaneValues], sizes: Mapping[int, np.ndarray] | None = None) -> None: ...


@dataclass
class RoundTimings:
    """Host time of the last round, nanoseconds (bench/engine_decode.py reads it)."""
    packing_ns: int = 0
    execution_ns: int = 0
    completion_ns: int = 0


@dataclass
class LaneSubmission:
    """One submission of hand-built packing lanes (the lockstep generator's raw lanes): what the
    completion's header check reads (scheduler/completion.SubmittedCohort)."""
    operation: cp.Operation.ValueType
    lanes: Sequence[PackedLane]
    sequence: int = 0
    frame: int = 0
    frames_outstanding: int = 0


R = TypeVar("R", bound="ProgramRunner")


@dataclass
class ProgramRunner:
    executor: ExecutorLike
    packer: PackerLike
    layout: mp.CompletionLayout
    vocab_size: int
    histogram_bins: int
    eos_ids: tuple[int, ...]
    mask_words: int = 0                  # grammar mask width (ceil(vocab / 32))
    frame: int = 0
    auxiliary_frame: int | None = None   # the executor's frame for submissions before a main step
    # the model's (NativeModel.submissions) when serving; a runner without one counts from 0
    submissions: SubmissionSequence = field(default_factory=SubmissionSequence)
    timings: RoundTimings = field(default_factory=RoundTimings)

    @classmethod
    def for_model(cls: type[R], model: "NativeModel", eos_ids: tuple[int, ...] | None = None,
                  auxiliary_frame: int | None = None) -> R:
        """The runner of a loaded model: its executor, packer, completion layout, vocabulary and
        submission numbers; `eos_ids` None: the core's EOS ids."""
        contract = model.contract
        vocab = contract.model.vocabulary
        return cls(model.executor, model.packer, model.execution_manifest.completion, vocab.sampled_tokens,
                   vocab.histogram_bins or vocab.sampled_tokens,
                   tuple(contract.defaults.eos_token_ids) if eos_ids is None else tuple(eos_ids),
                   mask_words=vocab.mask_words or -(-vocab.sampled_tokens // 32),
                   auxiliary_frame=auxiliary_frame, submissions=model.submissions)

    def __post_init__(self) -> None:
        self.fmt = CompletionFormat.from_layout(self.layout)
        self._outstanding = 0            # frames launched and not yet waited for
        self._timings: dict[int, RoundTimings] = {}
        self._auxiliary: Submission | None = None       # launched on the auxiliary frame, not waited for
        self._auxiliary_words: list[tuple[Submission, np.ndarray]] = []   # waited for, checked at collect
        self._initialization_columns: dict[str, bool] = {}   # per program, derived at its first step

    def run(self, plan: RoundPlan) -> CompletionRows:
        """Submit and collect one round on frame 0 (completion feedback)."""
        self.launch(plan, 0)
        return self.collect(plan)

    def launch(self, plan: RoundPlan, frame: int) -> None:
        """Pack and launch the round's submissions on `frame`. The ones before the main step
        (restoration, initialization) go to the auxiliary frame and are collected by collect(),
        or, without one (or in a constrained round), are collected and checked here, in order;
        the main submission is left running for collect()."""
        t = RoundTimings()
        auxiliary = self.auxiliary_frame
        # a constrained request has host values: a round without any has no constrained lane either
        explicit = explicit_lanes(plan.main.lanes)     # a block's columns carry no host values
        plain = not any(map(_HOST_VALUES, explicit))
        if auxiliary is not None and not plain and any(map(_CONSTRAINED, explicit)):
            auxiliary = None
        try:
            for sub in plan.submissions():
                main = sub is plan.main
                target = frame if main or auxiliary is None else auxiliary
                if target == self.auxiliary_frame:
                    self._settle_auxiliary()             # the frame's previous submission
                t0 = time.perf_counter_ns()
                self._pack(sub, target, plain if main else None)
                t1 = self._launch(sub.variant.program, target, sub)
                t.packing_ns += t1 - t0
                t.execution_ns += time.perf_counter_ns() - t1
                if main:
                    break
                if auxiliary is not None:
                    self._auxiliary = sub
                    continue
                t2 = time.perf_counter_ns()
                words = self._wait(frame)
                t3 = time.perf_counter_ns()
                validate_header(self.fmt, words, sub)
                t.execution_ns += t3 - t2
                t.completion_ns += time.perf_counter_ns() - t3
        except BaseException:
            self._drop_auxiliary(plan)                  # the round fails: nothing will collect it
            raise
        self._timings[id(plan)] = t

    def _submit(self, program: str, frame: int, lanes: Sequence[PackedLane],
                sub: Submission | LaneSubmission) -> int:
        """Pack and launch one submission on `frame`: it takes the next submission number and
        counts as a frame in flight. Returns the clock (ns) when packing ended."""
        self.packer.pack(program, frame, lanes)
        return self._launch(program, frame, sub)

    def _launch(self, program: str, frame: int, sub: Submission | LaneSubmission) -> int:
        """Launch a packed submission on `frame`: it takes the next submission number and
        counts as a frame in flight. Returns the clock (ns) when packing ended."""
        sub.sequence, sub.frame = self.submissions.take(), frame
        t1 = time.perf_counter_ns()
        self.executor.launch(program, frame)
        self._outstanding += 1
        sub.frames_outstanding = self._outstanding
        return t1

    def launch_lanes(self, program: str, operation: cp.Operation.ValueType, lanes: Sequence[PackedLane],
                     frame: int = 0) -> LaneSubmission:
        """Pack and launch hand-built lanes through `program` (an `operation` program); wait with
        wait_lanes. For the lockstep generator's raw lanes and speculative rounds."""
        sub = LaneSubmission(operation, lanes)
        self._submit(program, frame, lanes, sub)
        return sub

    def wait_lanes(self, sub: LaneSubmission) -> np.ndarray:
        """The completion words of a launch_lanes submission, not yet checked."""
        return self._wait(sub.frame)

    def step_lanes(self, program: str, operation: cp.Operation.ValueType, lanes: Sequence[PackedLane],
                   frame: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Launch, wait, check the header (sequence, frame, status, operation, rows, and each
        row's slot and generation in submission order); (the completion words, its rows)."""
        sub = self.launch_lanes(program, operation, lanes, frame)
        words = self.wait_lanes(sub)
        return words, validate_header(self.fmt, words, sub)

    def collect(self, plan: RoundPlan) -> CompletionRows:
        """Wait for the round's main submission; its validated rows."""
        t = self._timings.pop(id(plan), RoundTimings())
        t0 = time.perf_counter_ns()
        words = self._main_words(plan)
        t1 = time.perf_counter_ns()
        rows = parse_and_validate(self.fmt, words, plan.main, vocab_size=self.vocab_size)
        t.execution_ns += t1 - t0
        t.completion_ns += time.perf_counter_ns() - t1
        self.timings = t
        return rows

    def _main_words(self, plan: RoundPlan) -> np.ndarray:
        """The main submission's completion words, after the round's auxiliary submissions
        (run before it on the stream) were waited for and their headers checked. Every frame
        the round holds is waited for, also when one of them failed."""
        try:
            if self._auxiliary is not None and self._of(plan, self._auxiliary):
                self._settle_auxiliary()
        finally:
            words = self._wait(plan.main.frame)
        mine = [(sub, w) for sub, w in self._auxiliary_words if self._of(plan, sub)]
        if mine:
            self._auxiliary_words = [(sub, w) for sub, w in self._auxiliary_words if not self._of(plan, sub)]
            for sub, w in mine:
                validate_header(self.fmt, w, sub)
        return words

    @staticmethod
    def _of(plan: RoundPlan, sub: Submission) -> bool:
        return sub is plan.restoration or sub is plan.initialization

    def _settle_auxiliary(self) -> None:
        """Wait for the auxiliary frame's submission; its words are checked when its round is
        collected (the round may still be in flight)."""
        sub, self._auxiliary = self._auxiliary, None
        if sub is not None and self.auxiliary_frame is not None:
            self._auxiliary_words.append((sub, self._wait(self.auxiliary_frame)))

    def _drop_auxiliary(self, plan: RoundPlan) -> None:
        """A round whose launch failed: its auxiliary submission is waited for and forgotten."""
        if self._auxiliary is not None and self._of(plan, self._auxiliary):
            try:
                self._settle_auxiliary()
            except Exception:
                pass
        self._auxiliary_words = [(sub, w) for sub, w in self._auxiliary_words if not self._of(plan, sub)]

    def _wait(self, frame: int) -> np.ndarray:
        """The executor's wait for `frame`. The frame is no longer in flight afterwards, also
        when the wait failed on the device; FrameStateError means nothing was in flight."""
        try:
            words = self.executor.wait(frame)
        except FrameStateError:
            raise
        except BaseException:
            self._outstanding -= 1
            raise
        self._outstanding -= 1
        return words

    def _pack(self, sub: Submission, frame: int, plain: bool | None = None) -> None:
        """Pack one submission: a main step whose lanes carry no host values (no grammar or
        min_tokens mask, no logit bias; `plain` when the caller knows) and an INITIALIZATION step
        (whose program binds only what _pack_initialization gives) as columns gathered once per
        round, any other lane by lane (_packed); the same bytes either way
        (tests/test_packing_equivalence.py)."""
        operation, lanes = sub.operation, sub.lanes
        if operation == cp.OPERATION_INITIALIZATION and lanes and self._initializes_columns(sub.variant.program):
            self._pack_initialization(sub, frame)
            return
        if plain is None:
            plain = not any(map(_HOST_VALUES, explicit_lanes(lanes)))
        if operation in _COLUMNAR and plain:
            self._pack_columns(sub, frame)
            return
        self.packer.pack(sub.variant.program, frame, [self._packed(lane, operation) for lane in lanes])

    def _pack_columns(self, sub: Submission, frame: int) -> None:
        """The lanes of a DECODE / MIXED / PREFILL step as the packer's columns: a few C-level
        gathers per round instead of a PackedLane per lane (docs/scheduler.md, host work); a
        block's columns as they are, its explicit lanes gathered after them."""
        lanes = sub.lanes
        if isinstance(lanes, DecodeBlock):
            self._pack_block(sub.variant.program, frame, lanes)
            return
        n = len(lanes)
        tokens = list(map(_TOKENS, lanes))
        values: dict[int, list] = {cp.VALUE_SOURCE_PAGE_TABLE: list(map(_PAGES, lanes))}
        if tokens.count(_PENDING) == n:              # every lane reads its device-owned pending token
            lengths = np.ones(n, np.int64)           # (and no prompt tokens: the default, padding)
        else:
            values[cp.VALUE_SOURCE_PROMPT_TOKENS] = [None if t == _PENDING else np.asarray(t, dtype=np.int32)
                                                     for t in tokens]
            lengths = np.fromiter(map(len, tokens), np.int64, n)
        columns: dict[int, np.ndarray] = {
            cp.VALUE_SOURCE_SLOT: np.fromiter(map(_SLOT, lanes), np.int64, n),
            cp.VALUE_SOURCE_GENERATION: np.fromiter(map(_GENERATION, lanes), np.int64, n),
            cp.VALUE_SOURCE_CONSUMED_TOKENS: np.fromiter(map(_START, lanes), np.int64, n),
            cp.VALUE_SOURCE_QUERY_LENGTH: lengths,
            cp.VALUE_SOURCE_SAMPLING_DECISION: np.fromiter(map(_SAMPLE, lanes), np.int64, n),
            cp.VALUE_SOURCE_SNAPSHOT_DESTINATION: np.fromiter(map(_SNAPSHOT_ROW, lanes), np.int64, n),
        }
        self.packer.pack_columns(sub.variant.program, frame, n, columns, values)

    def _initializes_columns(self, program: str) -> bool:
        columnar = self._initialization_columns.get(program)
        if columnar is None:
            columnar = self._initialization_columns[program] = self.packer.sources(program) <= _INITIALIZATION_COLUMNS
        return columnar

    def _pack_initialization(self, sub: Submission, frame: int) -> None:
        """An INITIALIZATION step as the packer's columns: the values _packed puts in each lane's
        SlotInitialization (seed words, sampling vector, output limit, EOS ids, prompt counts),
        made for all lanes at once, the fixed-width ones as [lanes, k] arrays written in one go;
        the same bytes as its PackedLanes (tests/test_packing_equivalence.py)."""
        lanes = sub.lanes
        n = len(lanes)
        requests = list(map(_REQUEST, lanes))
        samplings = list(map(_SAMPLING, requests))
        # ignore_eos: the slot's program has no EOS ids, so only the output limit ends it
        eos = [() if ignore else self.eos_ids for ignore in map(_IGNORE_EOS, requests)]
        eos_values: LaneValues = np.array(eos, np.int64).reshape(n, len(eos[0])) if eos.count(eos[0]) == n \
            else [np.asarray(ids, dtype=np.int64) for ids in eos]
        columns: dict[int, np.ndarray] = {
            cp.VALUE_SOURCE_SLOT: np.fromiter(map(_SLOT, lanes), np.int64, n),
            cp.VALUE_SOURCE_GENERATION: np.fromiter(map(_GENERATION, lanes), np.int64, n),
            cp.VALUE_SOURCE_QUERY_LENGTH: np.fromiter(map(len, map(_TOKENS, lanes)), np.int64, n),
            cp.VALUE_SOURCE_OUTPUT_LIMIT: np.fromiter(map(_OUTPUT_LIMIT, lanes), np.int64, n),
        }
        values: dict[int, LaneValues] = {
            cp.VALUE_SOURCE_SEED_BITS: seed_words([s.seed for s in samplings]),
            cp.VALUE_SOURCE_SAMPLING_PARAMETERS: sampling_vectors(samplings),
            cp.VALUE_SOURCE_EOS_IDS: eos_values,
            # the full known token list: a readmitted request's histogram covers its output too
            cp.VALUE_SOURCE_PROMPT_HISTOGRAM: SlotInitialization.counts_of_prompts(
                list(map(_KNOWN_TOKENS, requests)), self.histogram_bins),
        }
        self.packer.pack_columns(sub.variant.program, frame, n, columns, values)

    def _pack_block(self, program: str, frame: int, block: DecodeBlock) -> None:
        """_pack_columns of a block: its columns, then its explicit lanes (a MIXED round's prompts)."""
        k, extra = block.size, block.extra
        m = len(extra)
        ones = _constant(k, 1)
        slots, generations, starts = block.slots, block.generations, block.starts
        lengths, samples, snapshot_rows = ones, ones, _constant(k, -1)
        values: dict[int, Sequence] = {cp.VALUE_SOURCE_PAGE_TABLE: _BlockPages(block.requests, extra)}
        page_counts = block.page_counts
        if m:
            tokens = list(map(_TOKENS, extra))
            values[cp.VALUE_SOURCE_PROMPT_TOKENS] = [None] * k + [
                None if t == _PENDING else np.asarray(t, dtype=np.int32) for t in tokens]
            # the columns and the explicit lanes' values after them in one [7, k + m] array (a
            # MIXED round's prompt: one array, not a concatenation per column); its rows are views
            joined = np.empty((7, k + m), np.int64)
            joined[:3, :k] = block.columns[SLOT:START + 1]          # slots, generations, starts
            joined[3:5, :k] = 1                                     # query lengths, sampling decisions
            joined[5, :k] = -1                                      # snapshot rows
            joined[6, :k] = page_counts
            joined[:, k:] = np.array([(lane.slot, lane.generation, lane.start, len(t), lane.sample, lane.snapshot_row,
                                       len(lane.request.pages)) for lane, t in zip(extra, tokens)], np.int64).T
            slots, generations, starts, lengths, samples, snapshot_rows, page_counts = joined
        columns: dict[int, np.ndarray] = {
            cp.VALUE_SOURCE_SLOT: slots, cp.VALUE_SOURCE_GENERATION: generations,
            cp.VALUE_SOURCE_CONSUMED_TOKENS: starts, cp.VALUE_SOURCE_QUERY_LENGTH: lengths,
            cp.VALUE_SOURCE_SAMPLING_DECISION: samples, cp.VALUE_SOURCE_SNAPSHOT_DESTINATION: snapshot_rows,
        }
        self.packer.pack_columns(program, frame, k + m, columns, values, {cp.VALUE_SOURCE_PAGE_TABLE: page_counts})

    def _packed(self, lane: Lane, operation: cp.Operation.ValueType) -> PackedLane:
        """The packing lane of one scheduler lane (once per lane per round: kept lean)."""
        req = lane.request
        tokens = lane.tokens
        # positional: half the construction time of keywords, for every lane of every round
        packed = PackedLane(lane.slot, lane.generation, lane.start,
                            None if tokens == _PENDING else np.asarray(tokens, dtype=np.int32),
                            lane.sample, lane.page_table)
        if operation == cp.OPERATION_INITIALIZATION:
            s = req.spec.sampling
            # the full known token list: a readmitted request's histogram covers its output too
            # ignore_eos: the slot's program has no EOS ids, so only the output limit ends it
            packed.initialization = SlotInitialization.for_prompt(req.tokens, self.histogram_bins, s.seed, s,
                                                    lane.output_limit, () if req.spec.ignore_eos else self.eos_ids)
            return packed
        # the step ending at a prompt's endpoint writes its partial page to the snapshot's
        # continuation row; RESTORATION copies a row into the page at `consumed`
        if operation == cp.OPERATION_RESTORATION:
            if lane.restore is not None:
                packed.restore_row = lane.restore.source_row
        else:
            packed.snapshot_row = lane.snapshot_row
        if lane.sample and (req.grammar is not None or req.spec.min_tokens):
            packed.grammar_mask = sampling_mask(req, self.eos_ids, self.mask_words)
        if lane.sample and req.spec.logit_bias is not None:   # unconstrained biased lanes too
            packed.logit_bias_ids, packed.logit_bias_values = req.spec.logit_bias.ids, req.spec.logit_bias.values
        return packed


def sampling_mask(req: Request, eos_ids: tuple[int, ...], mask_words: int) -> np.ndarray | None:
    """The mask of a lane's next sampled token (bit id % 32 of word id // 32 = allowed), or
    None when nothing constrains it: the grammar's, less the ids withheld until min_tokens
    (unless that leaves nothing: a finished grammar's EOS wins)."""
    withholds = req.withholds(eos_ids)
    if req.grammar is None and not withholds:
        return None
    if req.grammar is not None:
        words = np.zeros(mask_words, dtype=np.int32)
        req.grammar.fill_mask(words)
        words = words.view(np.uint32)
    else:
        words = np.full(mask_words, 0xFFFFFFFF, dtype=np.uint32)
    if withholds:
        withheld = words.copy()
        for token in req.spec.withheld_ids(eos_ids):
            if token < 32 * mask_words:
                withheld[token // 32] &= np.uint32(~(1 << (token % 32)) & 0xFFFFFFFF)
        if withheld.any():
            words = withheld
    return words
