"""Speculative rounds on the host: startup options, history drafting, cohort and program choice,
cache reservations and completion validation (docs/speculative.md).

    options = SpeculativeOptions(enabled=True, history_drafting=True)
    table = SpeculativeTable.select(graphs, options)          # typed SpeculativeStartupError
    round_ = table.plan([Candidate(...), ...])                 # from completed observations only
    outcomes = validate_completion(fmt, words, round_, vocab)  # CompletionMismatch before any update

Lane geometry (one lane = one request of the cohort):

    target rows  | pending | proposal 0 | ... | proposal n-2 |      n = lane length <= ceiling
    ceiling      = min(D + 1, W, output left, context left)      (SPEC-13/14)
    reservation  = pages for consumed + ceiling                  (SPEC-21: the full ceiling)

A lane's completion must satisfy, before request state changes (SPEC-40..42, CACHE-11..18):
    1 <= offers <= ceiling, sum(offers) <= P, accepted <= offers - 1, the accepted tokens equal
    the proposals they accept, emitted = accepted + 1 (fewer only when EOS/limit finished it),
    consumed = start + accepted + 1, draft cursor = max(consumed - lag, 0) or -1 without one.
"""
from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import numpy as np
from helios_proto import contract_pb2 as cp

from helios_backend.kernel_abi.speculative import EXTENSION_FIXED_WORDS, extension_words
from helios_backend.scheduler.completion import CompletionFormat, validate_header
from helios_backend.scheduler.errors import CompletionMismatch, ConfigurationError
from helios_backend.scheduler.plan import Variant

NGRAM_SIZES = (3, 2, 1)          # longest suffix first
HISTORY_WINDOW = 1024            # tokens searched per lookup: host work per round stays bounded


class SpeculativeStartupError(ConfigurationError):
    """Startup options that the selected speculative graphs cannot honour (SRV-8, SRV-11..13)."""


@dataclass(frozen=True)
class SpeculativeOptions:
    """Startup options; never recorded in the core (SRV-11, SRV-14)."""
    enabled: bool = False                      # learned (captured) speculation
    history_drafting: bool = False             # copied proposals from the request's own history
    widths: tuple[int, ...] | None = None      # load-time selection; None = every captured width


@dataclass(frozen=True)
class SpeculativeProgram:
    program: str
    rows: int                 # B
    drafts: int               # D
    width: int                # W
    packed: int               # P
    length_source: int        # VALUE_SOURCE_QUERY_LENGTH or VALUE_SOURCE_SPECULATIVE_PREFIX_LIMIT
    reports_cursor: bool
    lag: int

    @property
    def lane_limit(self) -> int:
        return min(self.drafts + 1, self.width)

    @property
    def variant(self) -> Variant:
        return Variant(cp.OPERATION_SPECULATIVE, self.program, self.rows, self.packed)


_LENGTH_SOURCES = (cp.VALUE_SOURCE_QUERY_LENGTH, cp.VALUE_SOURCE_SPECULATIVE_PREFIX_LIMIT)
_COPIED_INPUTS = (cp.VALUE_SOURCE_PROPOSAL_IDS, cp.VALUE_SOURCE_PROPOSAL_COUNT)


def _program(graph: cp.GraphContract) -> SpeculativeProgram:
    spec = graph.speculative
    sources = {b.source for b in graph.bindings if b.source in _LENGTH_SOURCES}
    if len(sources) != 1:
        raise SpeculativeStartupError(f"{graph.program}: binds {len(sources)} length sources, not exactly one")
    return SpeculativeProgram(graph.program, spec.batch_capacity, spec.draft_tokens, spec.token_capacity,
                              spec.packed_token_capacity, sources.pop(), graph.cursor.reports_draft_cursor,
                              int(graph.cursor.lag_tokens))


class SpeculativeTable:
    """The selected SPECULATIVE programs, by width; built once at startup."""

    def __init__(self, programs: Sequence[SpeculativeProgram], options: SpeculativeOptions) -> None:
        self.options = options
        self.programs = sorted(programs, key=lambda p: (p.width, p.packed, p.rows))
        self._max_width = max((p.width for p in self.programs), default=0)    # read per lane per round
        self._chosen: dict[tuple[int, int], SpeculativeProgram | None] = {}    # program_for

    @classmethod
    def select(cls, graphs: Sequence[cp.GraphContract], options: SpeculativeOptions,
               rank: int = 0) -> "SpeculativeTable":
        """Apply the startup options to the captured graphs; a typed error on a contradiction.

        History drafting requires enabled speculation (SRV-12) and, in every selected wider graph,
        concrete copied-token inputs: PROPOSAL_IDS and PROPOSAL_COUNT bindings (SRV-13)."""
        if options.history_drafting and not options.enabled:
            raise SpeculativeStartupError("history drafting requires speculation to be enabled")
        if not options.enabled:
            return cls([], options)
        captured = [g for g in graphs if g.rank == rank and g.operation == cp.OPERATION_SPECULATIVE]
        widths = {g.speculative.token_capacity for g in captured}
        if not captured:
            raise SpeculativeStartupError("speculation is enabled but the core captured no SPECULATIVE graph")
        chosen = widths if options.widths is None else set(options.widths)
        if not chosen <= widths:
            raise SpeculativeStartupError(f"widths {sorted(chosen - widths)} were not captured "
                                          f"(load may only reduce them: {sorted(widths)})")
        selected = [g for g in captured if g.speculative.token_capacity in chosen]
        if options.history_drafting:
            for g in selected:
                if g.speculative.token_capacity <= 1:
                    continue
                bound = {b.source for b in g.bindings}
                missing = [cp.ValueSource.Name(s) for s in _COPIED_INPUTS if s not in bound]
                if missing:
                    raise SpeculativeStartupError(f"{g.program}: history drafting needs copied-token inputs, "
                                                  f"missing {missing}")
        return cls([_program(g) for g in selected], options)

    @property
    def active(self) -> bool:
        return bool(self.programs)

    @property
    def max_width(self) -> int:
        return self._max_width

    def plan(self, candidates: Sequence["Candidate"], lookup: "Lookup | None" = None) -> "SpeculativeRound | None":
        return plan_round(self, candidates, lookup)

    def program_for(self, lanes: int, rows: int) -> SpeculativeProgram | None:
        """The smallest program (width, then P, then B) serving `lanes` lanes whose lane limit
        covers `rows` target rows per lane, else the one with the largest lane limit; None when
        no program has that many rows. Kept per (lanes, rows): the programs are fixed."""
        key = (lanes, rows)
        if key not in self._chosen:
            fitting = [p for p in self.programs if p.rows >= lanes]
            useful = [p for p in fitting if p.lane_limit >= rows] or \
                [max(fitting, key=lambda p: p.lane_limit)] if fitting else []
            self._chosen[key] = min(useful, key=lambda p: (p.width, p.packed, p.rows)) if useful else None
        return self._chosen[key]


# ---- history drafting --------------------------------------------------------------------------

def propose(history: Sequence[int], limit: int, ngram_sizes: Sequence[int] = NGRAM_SIZES,
            window: int = HISTORY_WINDOW) -> list[int]:
    """Prompt-lookup drafting: the tokens that followed the most recent earlier occurrence of the
    history's last n tokens (longest n first), at most `limit`; [] when nothing matches.
    Only the last `window` tokens are searched."""
    if limit <= 0:
        return []
    if isinstance(history, list):
        # every match ends at an earlier occurrence of the last token inside the window: where
        # there is none (a history with nothing to copy) the answer is known without converting
        # the window (list.index scans it in C, ~20x faster than the conversion)
        end = len(history)
        try:
            history.index(history[-1], max(0, end - window), end - 1)
        except (ValueError, IndexError):
            return []
    tail = np.asarray(history[-window:], dtype=np.int64)
    size = tail.size
    if size < 2:
        return []
    # every match of any length ends at an earlier occurrence j < size - 1 of the last token: find
    # those once, then test the longer suffixes only there (a lookup runs while the GPU steps, so
    # its host time is what matters; most tokens occur a few times in a window, not hundreds)
    ends = np.flatnonzero(tail[:size - 1] == tail[size - 1])
    for n in ngram_sizes:
        if size <= n or not ends.size:
            continue
        found = ends[ends >= n - 1]
        for back in range(1, n):
            found = found[tail[found - back] == tail[size - 1 - back]]
        if found.size:
            start = int(found[-1]) + 1
            return tail[start:start + limit].tolist()
    return []


class HistoryIndex:
    """propose() with the default n-gram sizes and window over one request's growing history,
    without searching it: per n-gram size, a dict from each n-gram to the latest position where
    one ends, brought up to date with the tokens appended since the last lookup. A lookup is then
    a few dict reads (~0.4 µs) where propose() converts and scans the window (~10 µs at 200
    tokens, ~18 at 1024); the first lookup indexes the whole history (~0.2 µs a token), so the
    scheduler keeps one only for requests that look up every round (the drafting ones).

    The history may only grow (Request.tokens does); a shorter one than indexed starts over.
    Positions older than the window are forgotten every `window` tokens (the dicts stay within
    about two windows of n-grams)."""

    __slots__ = ("_ends", "_indexed", "_since", "window")

    def __init__(self, window: int = HISTORY_WINDOW) -> None:
        self.window = window
        self._ends: tuple[dict[tuple[int, ...], int], dict[tuple[int, ...], int], dict[int, int]] = ({}, {}, {})
        self._indexed = 0           # n-grams ending before this position are in _ends
        self._since = 0             # first position indexed since the last reset

    def propose(self, history: Sequence[int], limit: int) -> list[int]:
        """propose(history, limit) (NGRAM_SIZES, `window`), the same proposals."""
        if limit <= 0:
            return []
        size = len(history)
        window = min(size, self.window)
        if window < 2:
            return []
        last = size - 1
        if last < self._indexed or last - self._since > 2 * self.window:
            self._reset(max(0, size - self.window))     # a new history, or forget what left the window
        if self._indexed < last:
            self._index(history, last)
        # the latest earlier end of the last n tokens, n = 3, 2, 1 (propose's order), if the n-gram
        # lies inside the window (the latest outside it means none inside)
        floor = size - window
        threes, twos, ones = self._ends
        token = history[last]
        if window > 3:
            end = threes.get((history[last - 2], history[last - 1], token))
            if end is not None and end - 2 >= floor:
                return list(history[end + 1:end + 1 + limit])
        if window > 2:
            end = twos.get((history[last - 1], token))
            if end is not None and end - 1 >= floor:
                return list(history[end + 1:end + 1 + limit])
        end = ones.get(token)
        if end is not None and end >= floor:
            return list(history[end + 1:end + 1 + limit])
        return []

    def _reset(self, since: int) -> None:
        self._ends = ({}, {}, {})
        self._indexed = self._since = since

    def _index(self, h: Sequence[int], last: int) -> None:
        """Index the n-grams ending at positions [indexed, last) (never at `last`: a match must be
        an earlier occurrence), each n-gram inside [since, last)."""
        threes, twos, ones = self._ends
        lo, since = self._indexed, self._since
        if last - lo <= 16 and lo - 2 >= since:   # a round's few tokens: no slices
            before, previous = h[lo - 2], h[lo - 1]
            for e in range(lo, last):
                token = h[e]
                ones[token] = e
                twos[(previous, token)] = e
                threes[(before, previous, token)] = e
                before, previous = previous, token
        else:                                    # a history at once: later ends overwrite earlier ones
            ones.update(zip(h[lo:last], range(lo, last)))
            a = max(lo, since + 1)
            twos.update(zip(zip(h[a - 1:last - 1], h[a:last]), range(a, last)))
            a = max(lo, since + 2)
            threes.update(zip(zip(h[a - 2:last - 2], h[a - 1:last - 1], h[a:last]), range(a, last)))
        self._indexed = last


Lookup = Callable[["Candidate", int], list[int]]


def _propose(candidate: "Candidate", limit: int) -> list[int]:
    return propose(candidate.history, limit)


# ---- cohort and program choice -------------------------------------------------------------------

class Candidate(NamedTuple):
    """A running request as of its last validated completion (SPEC-15: nothing in flight).
    Immutable; a tuple rather than a frozen dataclass: one is made per lane per round, and a
    tuple is made ~5x faster."""
    key: int                            # the scheduler's handle (request serial)
    slot: int
    generation: int
    consumed: int                       # validated consumed endpoint
    history: Sequence[int]              # prompt + validated output; history[-1] is the pending token
    output_left: int                    # tokens the request may still emit
    context_left: int                   # positions left in the context from `consumed`
    inflight: int = 0
    device_pending: bool = True         # the slot holds history[-1] as its device-owned pending token
    constrained: bool = False
    host_stops: bool = False
    draft_limit: int | None = None      # proposals worth offering (adaptive width); None: as many as fit


@dataclass(slots=True)
class SpeculativeLane:
    candidate: Candidate
    proposals: list[int]
    ceiling: int                        # reserved lane limit (rows incl. the pending token)

    @property
    def length(self) -> int:
        return 1 + len(self.proposals)

    @property
    def reserve_end(self) -> int:
        """Cache positions to reserve: the whole ceiling (SPEC-21)."""
        return self.candidate.consumed + self.ceiling


@dataclass
class SpeculativeRound:
    program: SpeculativeProgram
    lanes: list[SpeculativeLane]
    sequence: int = 0
    frame: int = 0
    cancelled: set[int] = field(default_factory=set)    # cancelled in flight: nothing of theirs publishes (SPEC-50)
    # the lanes' slots, generations and consumed endpoints (int64 [lanes]) where the scheduler
    # planned them from columns: the runner packs them as they are; None: read from the lanes
    columns: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def submission(self) -> _SubmittedRound:
        return _SubmittedRound(self.sequence, self.frame, self.program.variant.operation,
                               [_SubmissionLane(lane) for lane in self.lanes])


@dataclass(frozen=True)
class _SubmissionLane:
    """The slice of plan.Lane that completion.validate_header reads."""
    lane: SpeculativeLane

    @property
    def slot(self) -> int:
        return self.lane.candidate.slot

    @property
    def generation(self) -> int:
        return self.lane.candidate.generation


@dataclass(frozen=True)
class _SubmittedRound:
    """The round as completion.validate_header reads a submission."""
    sequence: int
    frame: int
    operation: cp.Operation.ValueType
    lanes: list[_SubmissionLane]


class FeedbackReason(enum.Enum):
    """Why a lane's next round waits for its completion (SPEC-44..49)."""
    HOST_FED_PENDING = "host-fed pending token"
    GRAMMAR = "grammar"
    HOST_STOPS = "host stops"
    HISTORY_INPUTS = "history inputs"
    STALE_COST = "unknown or stale cost"
    PHASE_CHANGE = "phase change"


def feedback_reasons(candidate: Candidate, proposals: Sequence[int] = (), phase_change: bool = False,
                     cost_known: bool = True) -> list[FeedbackReason]:
    """Reasons this lane cannot be planned ahead of its in-flight completion (empty: it may use
    the second execution frame, SPEC-43)."""
    reasons = []
    if not candidate.device_pending:
        reasons.append(FeedbackReason.HOST_FED_PENDING)
    if candidate.constrained:
        reasons.append(FeedbackReason.GRAMMAR)
    if candidate.host_stops:
        reasons.append(FeedbackReason.HOST_STOPS)
    if proposals:
        reasons.append(FeedbackReason.HISTORY_INPUTS)
    if not cost_known:
        reasons.append(FeedbackReason.STALE_COST)
    if phase_change:
        reasons.append(FeedbackReason.PHASE_CHANGE)
    return reasons


def lane_ceiling(program: SpeculativeProgram, candidate: Candidate) -> int:
    """min(D + 1, W, output left, context left), at least 1 (SPEC-13/14)."""
    return max(1, min(program.lane_limit, candidate.output_left, candidate.context_left))


def plan_round(table: SpeculativeTable, candidates: Sequence[Candidate],
               lookup: Lookup | None = None) -> SpeculativeRound | None:
    """Choose the cohort and the program from completed observations (SPEC-15), before any
    proposal is generated on the device. Candidates with a round in flight are skipped.
    Constrained, host-stop and host-fed lanes get no proposals (they need width one); a lane gets
    at most its `draft_limit` (the adaptive width, scheduler/speculative_width.py).
    The smallest program whose lane limit covers the longest useful draft is taken. QUERY_LENGTH:
    lane lengths are trimmed, longest lane first, until they fit P (exact lengths, SPEC-17);
    SPECULATIVE_PREFIX_LIMIT: the ceilings are submitted as they are (SPEC-18..20).
    `lookup(candidate, limit)`: its history's proposals (propose(), or the same from a
    HistoryIndex)."""
    ready = [c for c in candidates if c.inflight == 0]
    if not table.active or not ready:
        return None
    history_on = table.options.history_drafting
    lookup = lookup or _propose
    widest = table.max_width
    wanted: list[list[int]] = []
    for c in ready:
        if history_on and c.device_pending and not c.constrained and not c.host_stops:
            limit = min(widest, c.output_left, c.context_left) - 1
            if c.draft_limit is not None and c.draft_limit < limit:
                limit = c.draft_limit
            wanted.append(lookup(c, limit) if limit > 0 else [])
        else:
            wanted.append([])
    need = 1 + max(map(len, wanted))
    program = table.program_for(len(ready), need)
    if program is None:                      # more lanes than any program's rows: the first ones
        program = max(table.programs, key=lambda p: p.rows)
        ready, wanted = ready[:program.rows], wanted[:program.rows]
    lanes = []
    for c, proposals in zip(ready, wanted):
        ceiling = lane_ceiling(program, c)
        lanes.append(SpeculativeLane(c, proposals if len(proposals) < ceiling else proposals[:ceiling - 1], ceiling))
    if program.length_source != cp.VALUE_SOURCE_QUERY_LENGTH:
        return SpeculativeRound(program, lanes)      # ceilings may exceed P: the device allocates (SPEC-20)
    excess = len(lanes) + sum(len(lane.proposals) for lane in lanes) - program.packed
    while excess > 0:
        longest = max(lanes, key=lambda lane: lane.length)
        longest.proposals.pop()
        excess -= 1
    return SpeculativeRound(program, lanes)


# ---- completion validation -----------------------------------------------------------------------

class LaneOutcome(NamedTuple):
    """One lane's validated outcome (a tuple: one is made per lane per round)."""
    key: int
    tokens: list[int]           # emitted ids, accepted drafts first, then the target's own token
    offers: int
    accepted: int
    consumed: int
    finish: int                 # device view: 0 none, 1 EOS, 2 length
    draft_cursor: int


def validate_completion(fmt: CompletionFormat, words: np.ndarray, round_: SpeculativeRound, vocab_size: int,
                        extension_width: int) -> list[LaneOutcome]:
    """Check one speculative completion against what was submitted; raise CompletionMismatch on
    any disagreement, before any request state changes. `extension_width` is the core's largest
    speculative width W (the extension record holds [offers, accepted, tokens[W]]). The rows'
    words are read as Python ints once (two tolist() calls), then checked row by row in order:
    the first disagreement is the error."""
    sub = round_.submission()
    body = validate_header(fmt, words, sub)          # sequence, operation, live rows, slot/generation order
    words = np.asarray(words, dtype=np.int32).reshape(-1)
    stride = extension_words(extension_width)
    base = fmt.header_words + fmt.capacity * fmt.row_words
    program, lanes = round_.program, round_.lanes
    ext = words[base:base + len(lanes) * stride].reshape(len(lanes), stride).tolist()
    r = fmt.row
    rows = body[:, [r["emitted"], r["finish"], r["token"], r["consumed"], r["reserved_model"], r["draft_cursor"]]].tolist()
    exact = program.length_source == cp.VALUE_SOURCE_QUERY_LENGTH
    lag, reports = program.lag, program.reports_cursor
    outcomes = []
    total = 0
    for i, (lane, extra, (emitted, finish, token, consumed, reserved, cursor)) in enumerate(zip(lanes, ext, rows)):
        c = lane.candidate
        offers, accepted = extra[0], extra[1]
        if not 1 <= offers <= lane.ceiling:
            raise CompletionMismatch(f"row {i}: {offers} offers outside the reserved ceiling {lane.ceiling}")
        if exact and offers != lane.length:
            raise CompletionMismatch(f"row {i}: {offers} offers, the host selected {lane.length}")
        total += offers
        if not 0 <= accepted <= offers - 1:
            raise CompletionMismatch(f"row {i}: {accepted} accepted drafts of {offers} offers")
        if finish == 0 and emitted != accepted + 1 or not 1 <= emitted <= accepted + 1:
            raise CompletionMismatch(f"row {i}: {emitted} emitted with {accepted} accepted (finish {finish})")
        tokens = extra[EXTENSION_FIXED_WORDS:EXTENSION_FIXED_WORDS + emitted]
        if min(tokens) < 0 or max(tokens) >= vocab_size:
            raise CompletionMismatch(f"row {i}: emitted ids {tokens} outside vocabulary [0, {vocab_size})")
        if tokens[:accepted] != lane.proposals[:accepted]:
            raise CompletionMismatch(f"row {i}: accepted ids {tokens[:accepted]} are not the proposals offered")
        if token != tokens[-1]:
            raise CompletionMismatch(f"row {i}: token word {token} != last emitted {tokens[-1]}")
        if consumed != c.consumed + accepted + 1:
            raise CompletionMismatch(f"row {i}: consumed endpoint {consumed} != {c.consumed} + {accepted} + 1")
        if reserved != -1:
            raise CompletionMismatch(f"row {i}: reserved model field {reserved} != -1")
        expected = max(consumed - lag, 0) if reports else -1
        if cursor != expected:
            raise CompletionMismatch(f"row {i}: draft cursor {cursor} != {expected}")
        outcomes.append(LaneOutcome(c.key, tokens, offers, accepted, consumed, finish, cursor))
    if total > program.packed:
        raise CompletionMismatch(f"{total} offers exceed P={program.packed}")
    return outcomes


def publishable(round_: SpeculativeRound, outcomes: Sequence[LaneOutcome]) -> list[LaneOutcome]:
    """Outcomes whose request was not cancelled while the round was in flight (SPEC-50): a
    cancelled lane's tokens are dropped, its resources stay held until this fence (SPEC-51)."""
    return [o for o in outcomes if o.key not in round_.cancelled]


def ranks_agree(verdicts: Sequence[bool]) -> bool:
    """Validation agreement (SPEC-31): commit only when every rank accepted the cohort."""
    return bool(verdicts) and all(verdicts)


def validate_on_ranks(fmt: CompletionFormat, rank_words: Sequence[np.ndarray], round_: SpeculativeRound,
                      vocab_size: int, extension_width: int) -> list[LaneOutcome]:
    """Each rank (a thread, as RankPeers::Threads) validates its own completion of the round; the
    outcomes are committed only when every rank accepted it and all ranks report the same
    outcomes. One rank's rejection suppresses the commit on all ranks (SPEC-31):
    CompletionMismatch naming the rejecting ranks."""
    results: list[list[LaneOutcome] | CompletionMismatch | None] = [None] * len(rank_words)

    def check(rank: int) -> None:
        try:
            results[rank] = validate_completion(fmt, rank_words[rank], round_, vocab_size, extension_width)
        except CompletionMismatch as error:
            results[rank] = error

    threads = [threading.Thread(target=check, args=(rank,), name=f"rank{rank}-validation")
               for rank in range(len(rank_words))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    rejected = [rank for rank, result in enumerate(results) if not isinstance(result, list)]
    accepted = [result for result in results if isinstance(result, list)]
    if not ranks_agree([not rejected]) or not accepted:
        raise CompletionMismatch(f"ranks {rejected} rejected the cohort; no rank commits")
    if any(result != accepted[0] for result in accepted[1:]):
        raise CompletionMismatch("ranks disagree on the round's outcomes; no rank commits")
    return accepted[0]
