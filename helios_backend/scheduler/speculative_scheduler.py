"""The token-budget scheduler with speculative rounds: a subclass, so the loop itself is unchanged.

    scheduler = SpeculativeScheduler(config, variants, SpeculativeTable.select(graphs, options))
    runner = SpeculativeProgramRunner(...)          # helios_backend/engine/speculative_runner.py

A round that the base scheduler planned as plain DECODE (every lane reads its device-owned
pending token, nothing to restore or initialize) becomes a SPECULATIVE round when every lane may
carry proposals (no grammar, no host stops: those need width one and feedback, SPEC-44..49; no
logit bias or logprobs: the speculative programs have no logit-bias input and write no logprob
records), history drafting found at least one, and the adaptive width policy expects the round
to beat DECODE (scheduler/speculative_width.py: each lane is offered as many proposals as its
decaying acceptance makes worth it; none at all means plain DECODE without a history lookup).
The evidence comes from shadow lookups while the rounds are plain: every QUIET_ROUNDS rounds
each lane's copies are looked up and later compared with what it emitted, so neither a round
that waits for feedback nor a SPECULATIVE program is paid before a request's own history showed
that copying pays.
The cohort is the DECODE cohort, chosen from completed observations (SPEC-15); pages are
reserved for each lane's full ceiling (SPEC-21).

Completion: the runner validates the whole completion first (validate_completion, SPEC-40..42);
then each lane's emitted tokens are applied at once (`_apply_round`), with the state and events
that each token through the base scheduler's completion path as a one-token decode step would
leave (tests/test_speculative_completion.py runs both): the tokens up to the first that ends the
request (EOS before the length limit, as the base path checks them), the consumed endpoint, the
pages they complete published, the token events as one TokenBlock per run of lanes between
terminals, a cancelled lane retired at this fence with none of its tokens published (SPEC-50,
SPEC-51). Speculative lanes have no grammar, host stops, logit bias or logprobs (_candidates), so
nothing else of the base path applies to them. Timestamps: one clock read per round, when an
observed request emitted (OBS-12, OBS-16), as for a round of decode columns.

History lookups: a request's first drafted round builds its HistoryIndex (speculative.py), and
each later lookup, drafted or shadow, reads it instead of searching the history.
"""
from __future__ import annotations

import time
from typing import Sequence
from dataclasses import dataclass, field

import numpy as np
from helios_proto import contract_pb2 as cp
from helios_proto import exchange_pb2 as ep

from helios_backend.scheduler.completion import CompletionRows
from helios_backend.scheduler.events import TokenBlock
from helios_backend.scheduler.plan import PENDING_TOKEN, Lane, RoundPlan, Submission
from helios_backend.scheduler.request import Grammar, Request, RequestSpec
from helios_backend.scheduler.scheduler import Scheduler, StopFactory
from helios_backend.scheduler.speculative import (
    Candidate,
    HistoryIndex,
    LaneOutcome,
    SpeculativeLane,
    SpeculativeProgram,
    SpeculativeRound,
    SpeculativeTable,
    propose,
)
from helios_backend.scheduler.speculative_width import (
    QUIET_ROUNDS,
    DraftAcceptance,
    RoundCosts,
    WidthPolicy,
    expected_tokens,
)
from helios_backend.scheduler.config import SchedulerConfig
from helios_backend.scheduler.decode_block import DecodeBlock, explicit_lanes, lane_requests
from helios_backend.scheduler.generations import SlotGenerations
from helios_backend.scheduler.variants import VariantTable

_PENDING = [PENDING_TOKEN]               # a decode lane's query: its pending token (shared, never mutated)


@dataclass(slots=True)
class ScheduledSpeculativeLane(Lane):
    """A plan lane of a SPECULATIVE submission: the DECODE lane plus its proposals and ceiling."""
    proposals: list[int] = field(default_factory=list)
    ceiling: int = 1
    round: SpeculativeRound | None = None


@dataclass
class DraftingCounters:
    """Totals of the validated speculative lanes (benchmarks read them; no per-round cost)."""
    rounds: int = 0                 # SPECULATIVE rounds completed
    lanes: int = 0                  # lanes of those rounds
    offered: int = 0                # copied proposals verified
    accepted: int = 0               # of them accepted
    emitted: int = 0                # tokens those lanes emitted
    waited: int = 0                 # DECODE rounds not pipelined because drafting might pay
    shadows: int = 0                # shadow lookups started (copies found or not)


@dataclass
class Weighing:
    """A round's drafting evidence, read once per lane: each lane's acceptance, draft limit and
    acceptance rate p, and the tokens a round would be expected to emit with each lane's limit
    capped at a width (summed over the lanes once per width: the weighing, the width choice and
    the program's worth read the same sums)."""
    acceptance: list[DraftAcceptance]
    limits: list[int]
    rates: list[float]
    sums: dict[int, float] = field(default_factory=dict)

    def expected(self, width: int) -> float:
        """sum over lanes of expected_tokens(p, min(1 + limit, width))."""
        found = self.sums.get(width)
        if found is None:
            found = self.sums[width] = sum(expected_tokens(p, min(1 + limit, width))
                                           for p, limit in zip(self.rates, self.limits))
        return found


@dataclass
class SpeculativeRows(CompletionRows):
    """Validated rows of a SPECULATIVE submission: one outcome per lane."""
    outcomes: list[LaneOutcome] = field(default_factory=list)

    @classmethod
    def of(cls, outcomes: list[LaneOutcome]) -> "SpeculativeRows":
        """The rows of validated outcomes: the base rows carry each lane's last emitted token,
        its consumed endpoint and finish; the outcomes carry all of its tokens."""
        return cls(np.array([o.tokens[-1] for o in outcomes], np.int32),
                   np.array([o.consumed for o in outcomes], np.int32),
                   np.array([o.finish for o in outcomes], np.int32), None, None, None, outcomes=outcomes)


class SpeculativeScheduler(Scheduler):
    def __init__(self, config: SchedulerConfig, variants: VariantTable, table: SpeculativeTable,
                 stop_factory: StopFactory | None = None, generations: SlotGenerations | None = None,
                 policy: WidthPolicy | None = None) -> None:
        super().__init__(config, variants, stop_factory, generations)
        self.speculative = table
        self.policy = policy or WidthPolicy(max_drafts=max((p.lane_limit for p in table.programs), default=1) - 1)
        self._acceptance: dict[int, DraftAcceptance] = {}    # request serial -> its acceptance evidence
        self._indexes: dict[int, HistoryIndex] = {}          # request serial -> its history's n-grams (drafted)
        self.drafting = DraftingCounters()
        # measured seconds per round by program: planned (or previous completion, whichever is
        # later) to completion, so idle time between requests is never counted. DECODE counts
        # only rounds planned behind one in flight (the steady pipelined loop: completion to
        # completion), SPECULATIVE only rounds with none planned behind them (their own latency):
        # an executor that runs a round inside its launch (the CPU) would otherwise count the
        # next round's launch too, and rate the first DECODE round after a wait at two steps
        self.costs = RoundCosts()
        self._planned: dict[int, tuple[int, bool]] = {}       # id(submission) -> (perf_counter_ns, pipelined)
        self._behind: set[int] = set()                        # id(submission) with a round planned behind it
        self._last_complete = 0
        # DECODE rounds left before drafting is weighed again: a weighing that found it not worth
        # it starts the lanes' shadow lookups and skips the per-lane work of the next rounds (the
        # steady decode loop pays one counter per round); a new request ends it
        self._quiet = 0
        self._shadow_turn = 0                    # rotates the shadow lookups over the lanes
        self._widths: dict[int, list[int]] = {}                         # _widths_for

    def add(self, serial: int, spec: RequestSpec, grammar: Grammar | None = None) -> Request:
        req = super().add(serial, spec, grammar)
        self._quiet = 0                          # a request never observed: weigh drafting next round
        return req

    def _weighed(self, lanes: Sequence[Lane]) -> Weighing | None:
        """The lanes' acceptance and draft limits when drafting may pay this round; else None
        (the lanes' shadow lookups start and the quiet window with them). Pending shadows are
        settled first: their evidence decides this round. One pass over the lanes (a request's
        evidence is its own: the order of the lanes changes nothing)."""
        if self._quiet:
            self._quiet -= 1
            return None
        requests = lane_requests(lanes)
        policy, stops, known = self.policy, self._stops, self._acceptance
        acceptance: list[DraftAcceptance] = []
        limits: list[int] = []
        # the lanes open to a shadow lookup (drafted, none pending): never observed, and observed
        fresh: list[int] = []
        seen: list[int] = []
        for i, req in enumerate(requests):
            a = known.get(req.serial) or self._acceptance_of(req.serial)
            acceptance.append(a)
            spec = req.spec
            # a request never drafted: host values (grammar, min_tokens, logit bias), logprobs or
            # host stops (width one with completion feedback, SPEC-44..46; see _candidates); a
            # columnar request has none of them but logprobs
            if spec.logprobs if req.columnar else \
                    (req.host_values or spec.logprobs or spec.top_logprobs > 0 or req.serial in stops):
                limits.append(0)
                continue
            if a.shadow and a.settle(policy, req.tokens):
                limits.append(a.draft_limit(policy) if a.successes > 0.0 else 0)
                continue                         # still pending: not open to a lookup
            if a.successes > 0.0:                # (draft_limit's test first)
                limits.append(a.draft_limit(policy))
                seen.append(i)
            else:
                limits.append(0)
                (seen if a.failures > 0.0 else fresh).append(i)       # (DraftAcceptance.observed)
        # (no lane with a draft limit: no round can pay, and the rates are not read)
        weighing = Weighing(acceptance, limits, [a.rate for a in acceptance] if any(limits) else [])
        if self._may_pay(weighing):
            return weighing
        self._quiet = self._shadow(requests, acceptance, fresh, seen) - 1
        return None

    def _shadow(self, requests: Sequence[Request], acceptance: list[DraftAcceptance], fresh: list[int],
                seen: list[int]) -> int:
        """Start shadow lookups for lanes without one (`fresh`: those never observed, `seen`: the
        others, each in lane order), at most `shadow_lookups` per weighing (requests never
        observed first, then the others in turn: a lookup over 1024 tokens costs about 0.1 ms of
        host time), each taking as many copies as a program verifies; the rounds until the next
        weighing: QUIET_ROUNDS, or just enough to decide the lookup of a request never observed or
        whose acceptance is promising (p >= reach: drafting resumes soon after its copies match
        again)."""
        if seen:
            turn = self._shadow_turn % len(seen)
            seen = seen[turn:] + seen[:turn]
        chosen = (fresh + seen)[:self.policy.shadow_lookups]
        self._shadow_turn += len(chosen)
        quiet = QUIET_ROUNDS
        for i in chosen:
            a = acceptance[i]
            promising = not a.observed or a.rate >= self.policy.reach
            if self._shadow_lookup(requests[i], a) and promising:
                # enough rounds to decide it (the copies follow the round in flight: one more)
                quiet = min(quiet, min(len(a.shadow), self.policy.shadow_tokens) + 1)
        return quiet

    def _shadow_lookup(self, req: Request, a: DraftAcceptance) -> bool:
        """Start `req`'s shadow lookup (as many copies as a program verifies); whether copies were
        found (a shadow is pending)."""
        history, limit = req.tokens, self.policy.max_drafts
        index = self._indexes.get(req.serial)
        a.shadow_offer(self.policy, propose(history, limit) if index is None else index.propose(history, limit),
                       len(history))
        self.drafting.shadows += 1
        return bool(a.shadow)

    def schedule(self) -> RoundPlan | None:
        plan = self._speculative_schedule()
        if plan is not None:
            if len(self._planned) > 8:          # rounds that never completed (a failed launch)
                self._planned.clear()
                self._behind.clear()
            self._planned[id(plan.main)] = (time.perf_counter_ns(), False)
        return plan

    def _speculative_schedule(self) -> RoundPlan | None:
        plan = super().schedule()
        if plan is None or not self.speculative.active:
            return plan
        main = plan.main
        if plan.restoration or plan.initialization or main.operation != cp.OPERATION_DECODE:
            return plan
        if any(lane.tokens != [PENDING_TOKEN] for lane in explicit_lanes(main.lanes)):
            return plan                          # (a block's column lanes are plain decode lanes)
        weighing = self._weighed(main.lanes)
        if weighing is None:                     # plain decode, no history lookup
            return plan
        acceptance = weighing.acceptance
        limits = self._cheapest_width(weighing)
        fields = _LaneFields.of(main.lanes)
        candidates = self._candidates(fields, limits)
        if candidates is None:                   # a lane needs width one (grammar, host stops, ...)
            return plan
        round_ = self.speculative.plan(candidates, self._lookup)
        if round_ is None or len(round_.lanes) != len(main.lanes):
            self._idle(acceptance)
            return plan
        policy, rates = self.policy, weighing.rates
        for i, (a, limit, lane) in enumerate(zip(acceptance, limits, round_.lanes)):
            if limit and not lane.proposals:
                a.miss(policy)
                rates[i] = a.rate
        expected = sum(expected_tokens(p, 1 + len(lane.proposals)) for p, lane in zip(rates, round_.lanes))
        if not any(lane.proposals for lane in round_.lanes) or \
                not policy.worth(expected, len(round_.lanes), round_.program.width,
                                 self._ratio(round_.program, len(round_.lanes))):
            self._idle([a for a, lane in zip(acceptance, round_.lanes) if lane.proposals or not lane.candidate.draft_limit])
            return plan
        if not self._reserve_ceilings(fields.requests, round_.lanes):
            if isinstance(main.lanes, DecodeBlock):   # its page counts are its requests' pages (packing reads them)
                main.lanes.page_counts[:] = [len(req.pages) for req in main.lanes.requests]
            return plan                          # a shortage: plain decode this round
        lanes = [ScheduledSpeculativeLane(req, slot, generation, start, tokens, sample, output_limit,
                                          proposals=spec.proposals, ceiling=spec.ceiling, round=round_)
                 for req, slot, generation, start, tokens, sample, output_limit, spec
                 in zip(fields.requests, fields.slots, fields.generations, fields.starts, fields.tokens,
                        fields.samples, fields.output_limits, round_.lanes)]
        if isinstance(main.lanes, DecodeBlock) and not main.lanes.extra:
            round_.columns = (main.lanes.slots, main.lanes.generations, main.lanes.starts)
        plan.main = Submission(round_.program.variant, lanes)
        self.counters.launched(cp.OPERATION_DECODE, -1)           # the DECODE submission it replaces
        self.counters.launched(cp.OPERATION_SPECULATIVE)
        return plan

    def _reserve_ceilings(self, requests: Sequence[Request], lanes: Sequence[SpeculativeLane]) -> bool:
        """Pages for each lane's full ceiling (SPEC-21), in lane order; False on a shortage (the
        lanes before it keep theirs, as lane by lane). Where the pool has them all, one allocation
        gives each lane the pages lane-by-lane allocations would (PagePool.allocate_many)."""
        if len(lanes) == 1:                      # one lane: its reservation as it is
            return self._reserve_pages(requests[0], lanes[0].reserve_end)
        pt = self.config.page_tokens
        needs = [-(-lane.reserve_end // pt) - len(req.pages) for req, lane in zip(requests, lanes)]
        total = sum(k for k in needs if k > 0)
        if total <= self.pool.available_pages:
            if total:
                self._give_pages(requests, needs)
            return True
        for req, lane in zip(requests, lanes):    # snapshots evicted for them, lane by lane
            if not self._reserve_pages(req, lane.reserve_end):
                return False
        return True

    def pipeline_next(self, plan: RoundPlan) -> RoundPlan | None:
        """Behind a DECODE round whose requests may profit from drafting, nothing: the next round
        needs the completed history to copy from (completion feedback, SPEC-47). Otherwise the
        base scheduler's pipelined decode (shadow lookups gather the requests' evidence meanwhile,
        _weighed)."""
        main = plan.main
        if main.variant.operation == cp.OPERATION_DECODE and self.speculative.programs \
                and self._weighed(main.lanes) is not None:
            self.drafting.waited += 1
            return None
        nxt = super().pipeline_next(plan)
        if nxt is not None:
            self._planned[id(nxt.main)] = (time.perf_counter_ns(), True)
            self._behind.add(id(plan.main))
        return nxt

    def _may_pay(self, weighing: Weighing) -> bool:
        """Whether a round offering each lane its full draft limit would beat DECODE (before any
        history lookup: lanes whose lookup finds less only lower the gain)."""
        limits = weighing.limits
        longest = max(limits, default=0)
        if not longest:
            return False
        program = self._program_for(len(limits), 1 + longest)
        if program is None:
            return False
        # a lane gets at most what the program verifies per lane (at 64 rows the widest program may
        # be narrower than the limits earned at fewer rows): more would promise tokens the round
        # cannot give, and a DECODE round would wait for feedback in vain
        expected = weighing.expected(program.lane_limit)
        return self.policy.worth(expected, len(limits), program.width, self._ratio(program, len(limits)))

    def _cheapest_width(self, weighing: Weighing) -> list[int]:
        """The lanes' draft limits capped at the width whose program is expected to emit the most
        tokens per cost for this many lanes (costs measured, or estimated from the programs
        measured; the prior before any): a wider program verifies more copies, but where its
        extra rows cost (a small model's latency-bound step, a CPU) fewer of them per second."""
        limits = weighing.limits
        lanes = len(limits)
        best, best_rate = 0, 0.0
        for width in self._widths_for(lanes):
            program = self._program_for(lanes, width)
            if width <= 1 or program is None or program.lane_limit != width:
                continue
            ratio = self._ratio(program, lanes)
            if ratio is None or not self.policy.measured:
                ratio = 1.0 + self.policy.row_cost * (program.width - 1)
            rate = weighing.expected(width) / ratio
            if rate > best_rate:
                best, best_rate = width, rate
        return limits if not best else [min(limit, best - 1) for limit in limits]

    def _widths_for(self, lanes: int) -> list[int]:
        """The lane limits of the programs serving `lanes` lanes, ascending (kept per lane count)."""
        found = self._widths.get(lanes)
        if found is None:
            found = self._widths[lanes] = sorted({p.lane_limit for p in self.speculative.programs if p.rows >= lanes})
        return found

    def _program_for(self, lanes: int, rows: int) -> SpeculativeProgram | None:
        """The program plan_round would take for `lanes` lanes needing `rows` target rows each."""
        return self.speculative.program_for(lanes, rows)

    def _ratio(self, program: SpeculativeProgram, lanes: int) -> float | None:
        """`program`'s cost in DECODE rounds of the same lanes, measured or estimated from the
        programs measured so far (None: neither yet, the policy's prior decides)."""
        decode = self.variants.fit(cp.OPERATION_DECODE, lanes, lanes)
        return None if decode is None else self.costs.ratio(program.program, decode.program, program.packed)

    def _acceptance_of(self, serial: int) -> DraftAcceptance:
        found = self._acceptance.get(serial)
        if found is None:
            if len(self._acceptance) > 2 * len(self._by_serial) + 16:     # forget finished requests
                self._acceptance = {k: v for k, v in self._acceptance.items() if k in self._by_serial}
                self._indexes = {k: v for k, v in self._indexes.items() if k in self._by_serial}
            found = self._acceptance[serial] = DraftAcceptance()
        return found

    def _lookup(self, candidate: Candidate, limit: int) -> list[int]:
        """propose() of a drafted lane, from its request's HistoryIndex (built at its first)."""
        index = self._indexes.get(candidate.key)
        if index is None:
            index = self._indexes[candidate.key] = HistoryIndex()
        return index.propose(candidate.history, limit)

    def _idle(self, acceptance: list[DraftAcceptance], rounds: int = 1) -> None:
        for a in acceptance:
            a.idle(self.policy, rounds)

    def _candidates(self, fields: "_LaneFields", limits: list[int]) -> list[Candidate] | None:
        """The lanes as plan_round's candidates; None when one of them is constrained or has host
        stops (the round stays plain DECODE, width one with completion feedback)."""
        eos_ids, stops, context = self.config.eos_ids, self._stops, self.config.context_tokens
        candidates = []
        for req, slot, generation, start, output_limit, limit in zip(
                fields.requests, fields.slots, fields.generations, fields.starts, fields.output_limits, limits):
            spec = req.spec
            # speculative programs apply no logit bias and write no logprob records: such a
            # request decodes plainly (a request without host values needs no mask)
            if (req.host_values and (req.needs_mask(eos_ids) or spec.logit_bias is not None)) \
                    or spec.logprobs or spec.top_logprobs > 0 or req.serial in stops:
                return None
            tokens = req.tokens
            candidates.append(Candidate(req.serial, slot, generation, start, tokens, output_limit,
                                        context - len(tokens),
                                        req.inflight - 1,      # this round, planned but not submitted
                                        req.device_pending, False, False, limit))
        return candidates

    def complete(self, plan: RoundPlan, rows: CompletionRows) -> None:
        now = time.perf_counter_ns()
        main = plan.main
        key, variant = id(main), main.variant
        planned = self._planned.pop(key, None)
        behind = key in self._behind
        if behind:
            self._behind.discard(key)
        operation = variant.operation
        if planned is not None:
            stamp, pipelined = planned
            if (operation == cp.OPERATION_DECODE and pipelined) or \
                    (operation == cp.OPERATION_SPECULATIVE and not behind):
                self.costs.observe(variant.program, (now - max(stamp, self._last_complete)) / 1e9, variant.tokens)
        self._last_complete = now
        if operation != cp.OPERATION_SPECULATIVE:
            super().complete(plan, rows)
            return
        if not isinstance(rows, SpeculativeRows):
            raise TypeError("a SPECULATIVE round completes with SpeculativeRows (validated outcomes)")
        policy, known = self.policy, self._acceptance
        offered_total = accepted_total = emitted_total = 0
        for lane, outcome in zip(plan.main.lanes, rows.outcomes):
            offered = len(lane.proposals) if isinstance(lane, ScheduledSpeculativeLane) else 0
            acceptance = known.get(lane.request.serial)
            if acceptance is None:
                acceptance = self._acceptance_of(lane.request.serial)
            if acceptance.shadow:
                acceptance.drop_shadow()
            acceptance.observe(policy, offered, outcome.accepted)
            offered_total += offered
            accepted_total += outcome.accepted
            emitted_total += len(outcome.tokens)
        counters = self.drafting
        counters.rounds += 1
        counters.lanes += len(rows.outcomes)
        counters.offered += offered_total
        counters.accepted += accepted_total
        counters.emitted += emitted_total
        self._apply_round(plan.main.lanes, rows.outcomes)

    def _apply_round(self, lanes: Sequence[Lane], outcomes: Sequence[LaneOutcome]) -> None:
        """Each lane's emitted tokens, as the base completion path applies a one-token decode step
        per token (module docstring): per lane one pass over its tokens for an EOS, one append,
        one page publication; the token events of the lanes between terminals as one TokenBlock."""
        pt = self.config.page_tokens
        eos = self._eos
        events = self._events
        serials: list[int] = []                  # the token events not yet in a TokenBlock
        emitted: list[int] = []
        stamps: list[int] = []
        observed = False
        stamp = -1
        generated = 0
        for lane, outcome in zip(lanes, outcomes):
            req = lane.request
            req.inflight -= 1
            if req.cancelled or req.finish != ep.FINISH_REASON_UNSPECIFIED:
                # the first token's step: its position consumed, its pages published, nothing
                # emitted; a cancelled lane (SPEC-50) or one whose finish was decided retires
                self._consume(req, lane.start + 1, pt)
                if serials:
                    events.append(_token_block(serials, emitted, stamps if observed else None))
                    serials, emitted, stamps, observed = [], [], [], False
                self._finish_if_fenced(req, ep.FINISH_REASON_CANCELLED if req.cancelled else req.finish)
                continue
            tokens = outcome.tokens
            known = req.tokens
            # the tokens up to the one that ends the request: the length limit counted after each
            # append, an EOS first where both end it at the same token
            n = len(tokens)
            reason = ep.FINISH_REASON_UNSPECIFIED
            room = max(req.token_limit - len(known), 1)
            if room <= n:
                n, reason = room, ep.FINISH_REASON_LENGTH
            if eos and not req.spec.ignore_eos:
                for i in range(n):
                    if tokens[i] in eos:
                        n, reason = i + 1, ep.FINISH_REASON_EOS
                        break
            if n < len(tokens):
                tokens = tokens[:n]
            known.extend(tokens)
            req.device_pending = True
            self._consume(req, lane.start + n, pt)
            generated += n
            serials.extend([req.serial] * n)
            emitted.extend(tokens)
            if req.spec.observe_timestamps:
                if stamp < 0:
                    stamp = time.monotonic_ns() - self.config.clock_origin_ns
                observed = True
                stamps.extend([stamp] * n)
            else:
                stamps.extend([-1] * n)
            if reason != ep.FINISH_REASON_UNSPECIFIED:
                events.append(_token_block(serials, emitted, stamps if observed else None))
                serials, emitted, stamps, observed = [], [], [], False
                self._finish_if_fenced(req, reason)
        if serials:
            events.append(_token_block(serials, emitted, stamps if observed else None))
        self.counters.generated_tokens += generated

    def _consume(self, req: Request, end: int, pt: int) -> None:
        """The request's consumed endpoint is `end`: the pages it completes are published."""
        req.computed = end
        req.fresh = False
        if end // pt > req.published_pages and len(req.pages) > req.published_pages:
            self._publish_pages(req)


@dataclass(slots=True)
class _LaneFields:
    """A DECODE round's lanes as lists of their fields, read once: from a DecodeBlock's columns
    (no Lane made per column), else lane by lane."""
    requests: list[Request]
    slots: list[int]
    generations: list[int]
    starts: list[int]
    tokens: list[list[int]]
    samples: list[bool]
    output_limits: list[int]

    @classmethod
    def of(cls, lanes: Sequence[Lane]) -> "_LaneFields":
        if isinstance(lanes, DecodeBlock) and not lanes.extra:
            k = lanes.size
            return cls(lanes.requests, lanes.slots.tolist(), lanes.generations.tolist(), lanes.starts.tolist(),
                       [_PENDING] * k, [True] * k, lanes.limits.tolist())
        return cls([lane.request for lane in lanes], [lane.slot for lane in lanes],
                   [lane.generation for lane in lanes], [lane.start for lane in lanes],
                   [lane.tokens for lane in lanes], [lane.sample for lane in lanes],
                   [lane.output_limit for lane in lanes])


def _token_block(serials: list[int], tokens: list[int], stamps: list[int] | None) -> TokenBlock:
    return TokenBlock(np.array(serials, np.int64), np.array(tokens, np.int32),
                      None if stamps is None else np.array(stamps, np.int64), None)
