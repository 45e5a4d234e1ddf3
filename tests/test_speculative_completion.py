"""A speculative round's completion applied lane by lane (SpeculativeScheduler._apply_round)
against the reference: each emitted token through the base scheduler's completion path as a
one-token decode step, which is how the scheduler applied them before.

Two schedulers, one applying each lane's tokens at once and one the reference, run the worker's
loop over the same random workload on a model that mostly repeats its history (so copies are
accepted, in part: history drafting goes speculative), with EOS ids, ignore_eos, output limits,
observed requests, page boundaries and cancels while a speculative round is in flight; every
round's plans, events (timestamps as observed or not: the reference read the clock per token)
and the page pool must be identical. Then hand-made outcomes (an EOS among the accepted tokens,
more tokens than the length limit leaves, a cancelled lane) on copies of one scheduler state.
"""
from __future__ import annotations

import copy
import hashlib
import random
from typing import Callable

import numpy as np
import pytest
from helios_proto import contract_pb2 as cp
from helios_proto import exchange_pb2 as ep

from helios_backend.scheduler.completion import CompletionRows
from helios_backend.scheduler.decode_block import lane_columns, lane_requests
from helios_backend.scheduler.events import expand
from helios_backend.scheduler.plan import PENDING_TOKEN, Lane, RoundPlan, Submission, Variant
from helios_backend.scheduler.request import RequestSpec, RequestState, SamplingSettings
from helios_backend.scheduler.scheduler import Scheduler, SchedulerConfig
from helios_backend.scheduler.speculative import (
    LaneOutcome,
    SpeculativeOptions,
    SpeculativeProgram,
    SpeculativeTable,
)
from helios_backend.scheduler.speculative_scheduler import ScheduledSpeculativeLane, SpeculativeRows, SpeculativeScheduler
from helios_backend.scheduler.speculative_width import WidthPolicy
from helios_backend.scheduler.variants import VariantTable
from tests.scheduler_sim import variants
from tests.test_decode_block import _event_record

VOCAB = 64
EOS = (5, 9)
QL = cp.VALUE_SOURCE_QUERY_LENGTH
ROWS = (1, 2, 4, 8, 16)


class PerTokenScheduler(SpeculativeScheduler):
    """The reference: each emitted token through Scheduler.complete as a one-token DECODE step."""

    def _apply_round(self, lanes, outcomes) -> None:  # type: ignore[no-untyped-def]
        decode = Variant(cp.OPERATION_DECODE, "decode_b1", 1, 1)
        for lane, outcome in zip(lanes, outcomes):
            req = lane.request
            for j, token in enumerate(outcome.tokens):
                if j:
                    req.inflight += 1                    # the base path retires one step per call
                step = Lane(req, lane.slot, lane.generation, lane.start + j, [PENDING_TOKEN], sample=True,
                            output_limit=lane.output_limit - j)
                one = CompletionRows(np.array([token], np.int32), np.array([step.end], np.int32),
                                     np.zeros(1, np.int32), None, None, None)
                Scheduler.complete(self, RoundPlan(Submission(decode, [step])), one)
                if req.state is RequestState.FINISHED or req.cancelled or req.finish:
                    break


def _table() -> SpeculativeTable:
    programs = [SpeculativeProgram(f"spec_b{b}_w{w}", rows=b, drafts=w - 1, width=w, packed=b * w, length_source=QL,
                                   reports_cursor=True, lag=0) for b in ROWS for w in (1, 4, 8)]
    return SpeculativeTable(programs, SpeculativeOptions(enabled=True, history_drafting=True))


def _model(history: list[int]) -> int:
    """Mostly the token `period` positions back (its copies are right), now and then another."""
    digest = int.from_bytes(hashlib.blake2b(np.asarray(history, np.int32).tobytes(), digest_size=8).digest(), "little")
    period = 3 + history[0] % 5
    if len(history) > period and digest % 8:
        return history[-period]
    return digest % VOCAB


def _outcomes(plan: RoundPlan) -> SpeculativeRows:
    """What a validated completion of the round says: each lane accepts its copies while they are
    the model's tokens and emits the model's next one; the device stops at an EOS."""
    outcomes = []
    for lane in plan.main.lanes:
        assert isinstance(lane, ScheduledSpeculativeLane)
        req = lane.request
        history = list(req.tokens[:lane.start + 1])
        tokens: list[int] = []
        accepted = 0
        for proposal in [*lane.proposals, None]:
            token = _model(history)
            tokens.append(token)
            history.append(token)
            if token != proposal or (token in EOS and not req.spec.ignore_eos):
                break
            accepted += 1
        accepted = min(accepted, len(lane.proposals))
        finish = 1 if tokens[-1] in EOS and not req.spec.ignore_eos else 0
        consumed = lane.start + accepted + 1
        outcomes.append(LaneOutcome(req.serial, tokens, 1 + len(lane.proposals), accepted, consumed, finish, consumed))
    return SpeculativeRows(np.array([o.tokens[-1] for o in outcomes], np.int32),
                           np.array([o.consumed for o in outcomes], np.int32),
                           np.array([o.finish for o in outcomes], np.int32), None, None, None, outcomes=outcomes)


def _rows(plan: RoundPlan) -> CompletionRows:
    """A plain round's rows, read from the histories when the round completes (a round planned
    behind another reads the token that one appended)."""
    if plan.main.operation == cp.OPERATION_SPECULATIVE:
        return _outcomes(plan)
    _, _, ends, sampled = lane_columns(plan.main.lanes)
    tokens = [_model(req.tokens[:end]) if s else -1
              for req, end, s in zip(lane_requests(plan.main.lanes), ends.tolist(), sampled.tolist())]
    return CompletionRows(np.array(tokens, np.int32), ends.astype(np.int32), np.zeros(len(tokens), np.int32),
                          None, None, None)


def _plan_record(plan: RoundPlan) -> list:
    return [(sub.variant.program, [(lane.request.serial, lane.slot, lane.generation, lane.start, list(lane.tokens),
                                    lane.sample, lane.output_limit, list(getattr(lane, "proposals", ())))
                                   for lane in sub.lanes]) for sub in plan.submissions()]


def _config(rng: random.Random) -> SchedulerConfig:
    return SchedulerConfig(page_tokens=4, num_pages=rng.choice((64, 400)), request_slots=16, max_active=16,
                           queue_capacity=256, context_tokens=96, max_pages_per_row=24, vocab_size=VOCAB,
                           input_vocab_size=VOCAB, eos_ids=EOS)


def _scheduler(kind: type, rng: random.Random) -> SpeculativeScheduler:
    sched = kind(_config(rng), VariantTable(variants(rows=ROWS, tokens=(16, 64))), _table(),
                 policy=WidthPolicy(7, row_cost=0.05, measured=False))
    assert isinstance(sched, SpeculativeScheduler)
    return sched


def _spec(rng: random.Random) -> RequestSpec:
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(2, 14))]
    return RequestSpec(tuple(prompt), rng.randrange(1, 40), SamplingSettings(), ignore_eos=rng.random() < 0.4,
                       observe_timestamps=rng.random() < 0.4)


def _drive(sched: SpeculativeScheduler, rng: random.Random, steps: int, spec: Callable[[random.Random], RequestSpec],
           plan_record: Callable[[RoundPlan], list] = _plan_record, arrivals: tuple[int, ...] = (0, 0, 0, 0, 0, 1, 1, 3),
           fences: bool = False) -> list:
    """The worker's two-frame loop over a random workload drawn from `rng` (arrivals of `spec`,
    cancels while a round is in flight), recording every plan, the events, (`fences`: each
    request's rounds in flight) and the page pool after every round."""
    trace: list = []
    serial = 0
    inflight: list[RoundPlan] = []
    for step in range(steps + 5000):
        if step >= steps and not inflight and not sched.has_work():
            break
        # the same inputs in both runs: drawn from the seed whatever the scheduler did
        arriving = rng.choice(arrivals) if step < steps else 0
        cancel = rng.randrange(serial + 1) if step < steps and rng.random() < 0.04 else -1
        for _ in range(arriving):
            sched.add(serial, spec(rng))
            serial += 1
        if not inflight:
            plan = sched.schedule()
            if plan is None:
                trace.append(("idle", step))
                continue
            trace.append(("plan", plan_record(plan)))
            inflight.append(plan)
        if len(inflight) == 1:
            nxt = sched.pipeline_next(inflight[0])
            if nxt is not None:
                trace.append(("plan", plan_record(nxt)))
                inflight.append(nxt)
        if cancel >= 0:                                  # while the round is in flight
            sched.cancel(cancel)
        plan = inflight.pop(0)
        sched.complete(plan, _rows(plan))
        trace.append(("events", [_event_record(ev) for ev in expand(sched.take_worker_events())]))
        if fences:
            trace.append(("fence", sorted((req.serial, req.inflight) for req in sched._by_serial.values())))
        pool = sched.pool
        trace.append(("pool", sorted(pool._key_of.items()), list(pool._lru), pool.free_pages))
    return trace


def _trace(kind: type, seed: int, steps: int = 300) -> tuple[list, dict]:
    rng = random.Random(seed)
    sched = _scheduler(kind, rng)
    trace = _drive(sched, rng, steps, _spec)
    state = {"finished": dict(sched.counters.finished), "generated": sched.counters.generated_tokens,
             "launches": dict(sched.counters.launches), "drafting": vars(sched.drafting)}
    return trace, state


@pytest.mark.parametrize("seed", range(6))
def test_lanes_applied_at_once_equal_each_token_through_the_base_path(seed: int) -> None:
    # spec: SPEC-40, SPEC-50, SPEC-51, OBS-12, OBS-16, CACHE-20
    reference, want = _trace(PerTokenScheduler, seed)
    lanes, got = _trace(SpeculativeScheduler, seed)
    assert want["launches"].get(cp.OPERATION_SPECULATIVE, 0) > 10, want["launches"]
    assert want["drafting"]["accepted"] > 20 and want["generated"] > 200
    assert want["finished"].get(ep.FINISH_REASON_EOS, 0) > 0 and want["finished"].get(ep.FINISH_REASON_CANCELLED, 0) > 0
    assert len(lanes) == len(reference)
    for i, (expected, actual) in enumerate(zip(reference, lanes)):
        assert actual == expected, f"record {i} differs"
    assert got == want


def _speculative_state(seed: int) -> tuple[SpeculativeScheduler, RoundPlan]:
    """A scheduler with a SPECULATIVE round of several lanes planned."""
    rng = random.Random(seed)
    sched = _scheduler(SpeculativeScheduler, rng)
    for serial in range(4):
        prompt = tuple([11, 12, 13, 14, 15 + serial] * 4)
        sched.add(serial, RequestSpec(prompt, 30 + serial, SamplingSettings(), ignore_eos=serial == 2,
                                      observe_timestamps=serial % 2 == 1))
    for _ in range(200):
        plan = sched.schedule()
        assert plan is not None
        if plan.main.operation == cp.OPERATION_SPECULATIVE and len(plan.main.lanes) == 4:
            return sched, plan
        sched.complete(plan, _rows(plan))
        sched.take_events()
    raise AssertionError("no speculative round of four lanes")


def _apply(kind: type, state: tuple[SpeculativeScheduler, RoundPlan], tokens: list[list[int]],
           cancel: tuple[int, ...] = (), token_limits: dict[int, int] | None = None) -> tuple:
    sched, plan = copy.deepcopy(state)
    sched.__class__ = kind
    for serial in cancel:
        sched.cancel(serial)
    for serial, limit in (token_limits or {}).items():
        req = sched.request(serial)
        assert req is not None
        req.token_limit = len(req.tokens) + limit
    outcomes = [LaneOutcome(lane.request.serial, lane_tokens, len(lane_tokens), len(lane_tokens) - 1,
                            lane.start + len(lane_tokens), 0, lane.start + len(lane_tokens))
                for lane, lane_tokens in zip(plan.main.lanes, tokens)]
    rows = SpeculativeRows(np.array([t[-1] for t in tokens], np.int32), np.zeros(len(tokens), np.int32),
                           np.zeros(len(tokens), np.int32), None, None, None, outcomes=outcomes)
    sched.complete(plan, rows)
    events = [_event_record(ev) for ev in expand(sched.take_worker_events())]
    requests = [(req.serial, req.state, req.finish, list(req.tokens), req.computed, req.inflight, req.published_pages,
                 list(req.pages), req.device_pending, req.fresh)
                for req in (lane.request for lane in plan.main.lanes)]
    pool = sched.pool
    return (events, requests, sorted(pool._key_of.items()), list(pool._lru), pool.free_pages,
            dict(sched.counters.finished), sched.counters.generated_tokens)


@pytest.mark.parametrize("case", ["plain", "eos", "length", "cancelled", "all"])
def test_hand_made_outcomes_apply_as_the_reference(case: str) -> None:
    # spec: SPEC-50, SPEC-51, OBS-12
    state = _speculative_state(1)
    tokens = [[20, 21, 22], [30, 31], [5, 41, 9, 42], [50]]     # lane 2 ignores EOS
    cancel: tuple[int, ...] = ()
    limits: dict[int, int] = {}
    if case in ("eos", "all"):
        tokens[0] = [20, 9, 22]                                   # EOS among the accepted tokens
        tokens[1] = [30, 5]
    if case in ("length", "all"):
        limits = {0: 2, 3: 1, 2: 3}                               # fewer tokens left than emitted
    if case in ("cancelled", "all"):
        cancel = (1,)
    want = _apply(PerTokenScheduler, state, tokens, cancel, limits)
    got = _apply(SpeculativeScheduler, state, tokens, cancel, limits)
    assert got == want
    events = want[0]
    assert any(e[0] == "token" for e in events)
    if case != "plain":
        assert any(e[0] == "terminal" for e in events)


def _completion(rng: random.Random) -> tuple:
    """A valid completion of a random speculative round on a small hand-made layout."""
    from helios_backend.kernel_abi.speculative import extension_words
    from helios_backend.scheduler.completion import CompletionFormat
    from helios_backend.scheduler.speculative import Candidate, SpeculativeLane, SpeculativeRound

    names = ("slot", "generation", "token", "consumed", "emitted", "finish", "draft_cursor", "reserved_model")
    fmt = CompletionFormat(4, 8, 8, {"sequence": 0, "live_rows": 1, "operation": 2}, {n: i for i, n in enumerate(names)}, 0)
    allocates = rng.random() < 0.3
    program = SpeculativeProgram("spec", rows=8, drafts=7, width=8, packed=rng.choice((64, 20)),
                                 length_source=cp.VALUE_SOURCE_SPECULATIVE_PREFIX_LIMIT if allocates else QL,
                                 reports_cursor=rng.random() < 0.7, lag=rng.choice((0, 2)))
    round_ = SpeculativeRound(program, [], sequence=rng.randrange(1, 99))
    stride = extension_words(8)
    base = fmt.header_words + fmt.capacity * fmt.row_words
    n = rng.randrange(0, 9)
    words = np.zeros(base + fmt.capacity * stride, np.int32)
    words[:3] = (round_.sequence, n, cp.OPERATION_SPECULATIVE)
    for i in range(n):
        ceiling = rng.randrange(1, 9)
        proposals = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, ceiling))]
        start = rng.randrange(0, 300)
        round_.lanes.append(SpeculativeLane(Candidate(i, i, 1, start, [], 99, 99), proposals, ceiling))
        offers = rng.randrange(1, ceiling + 1) if allocates else 1 + len(proposals)
        accepted = rng.randrange(0, min(offers, 1 + len(proposals)))
        tokens = proposals[:accepted] + [rng.randrange(VOCAB)]
        finish = rng.choice((0, 0, 1, 2))
        if finish and rng.random() < 0.5:
            tokens = tokens[:rng.randrange(1, len(tokens) + 1)]
        consumed = start + accepted + 1
        cursor = max(consumed - program.lag, 0) if program.reports_cursor else -1
        words[4 + 8 * i:12 + 8 * i] = (i, 1, tokens[-1], consumed, len(tokens), finish, cursor, -1)
        words[base + stride * i:base + stride * i + 2 + len(tokens)] = [offers, accepted, *tokens]
    return fmt, round_, words, base, stride


# validate_completion's rules in the order it checks them, over one row's values as numpy scalars
# (how it read them before): (broken, message); the first broken rule of the first row is the error
_RULES = (
    (lambda v: not 1 <= v["offers"] <= v["ceiling"], "{offers} offers outside the reserved ceiling {ceiling}"),
    (lambda v: v["exact"] and v["offers"] != v["length"], "{offers} offers, the host selected {length}"),
    (lambda v: not 0 <= v["accepted"] <= v["offers"] - 1, "{accepted} accepted drafts of {offers} offers"),
    (lambda v: (v["finish"] == 0 and v["emitted"] != v["accepted"] + 1) or not 1 <= v["emitted"] <= v["accepted"] + 1,
     "{emitted} emitted with {accepted} accepted (finish {finish})"),
    (lambda v: any(not 0 <= t < VOCAB for t in v["ids"]), "emitted ids {ids} outside vocabulary [0, {vocab})"),
    (lambda v: v["ids"][:v["accepted"]] != v["proposals"][:v["accepted"]],
     "accepted ids {taken} are not the proposals offered"),
    (lambda v: v["token"] != v["ids"][-1], "token word {token} != last emitted {last}"),
    (lambda v: v["consumed"] != v["start"] + v["accepted"] + 1, "consumed endpoint {consumed} != {start} + {accepted} + 1"),
    (lambda v: v["reserved"] != -1, "reserved model field {reserved} != -1"),
    (lambda v: v["cursor"] != v["expected"], "draft cursor {cursor} != {expected}"),
)


def _reference_validate(fmt, words, round_, extension_width: int) -> list[LaneOutcome]:  # type: ignore[no-untyped-def]
    """validate_completion by its rules, one row at a time from numpy scalars: the reference."""
    from helios_backend.kernel_abi.speculative import EXTENSION_FIXED_WORDS, extension_words
    from helios_backend.scheduler.completion import validate_header
    from helios_backend.scheduler.errors import CompletionMismatch

    body = validate_header(fmt, words, round_.submission())
    stride = extension_words(extension_width)
    base = fmt.header_words + fmt.capacity * fmt.row_words
    program, r = round_.program, fmt.row
    outcomes = []
    for i, lane in enumerate(round_.lanes):
        row, extra = body[i], np.asarray(words)[base + i * stride:base + (i + 1) * stride]
        v = {"offers": int(extra[0]), "accepted": int(extra[1]), "ceiling": lane.ceiling, "length": lane.length,
             "exact": program.length_source == QL, "emitted": int(row[r["emitted"]]), "finish": int(row[r["finish"]]),
             "proposals": lane.proposals, "token": int(row[r["token"]]), "consumed": int(row[r["consumed"]]),
             "start": lane.candidate.consumed, "reserved": int(row[r["reserved_model"]]),
             "cursor": int(row[r["draft_cursor"]]), "vocab": VOCAB}
        v["ids"] = [int(t) for t in extra[EXTENSION_FIXED_WORDS:EXTENSION_FIXED_WORDS + v["emitted"]]]
        v["taken"], v["last"] = v["ids"][:v["accepted"]], v["ids"][-1] if v["ids"] else None
        v["expected"] = max(v["consumed"] - program.lag, 0) if program.reports_cursor else -1
        for broken, message in _RULES:
            if broken(v):
                raise CompletionMismatch(f"row {i}: " + message.format(**v))
        outcomes.append(LaneOutcome(lane.candidate.key, v["ids"], v["offers"], v["accepted"], v["consumed"],
                                    v["finish"], v["cursor"]))
    total = sum(o.offers for o in outcomes)
    if total > program.packed:
        raise CompletionMismatch(f"{total} offers exceed P={program.packed}")
    return outcomes


def test_a_completion_read_as_python_ints_is_accepted_or_refused_as_before() -> None:
    # spec: SPEC-40, SPEC-41, SPEC-42, CACHE-12, CACHE-13, CACHE-14, CACHE-17, CACHE-18
    from helios_backend.scheduler.errors import CompletionMismatch
    from helios_backend.scheduler.speculative import validate_completion

    def verdict(check):  # type: ignore[no-untyped-def]
        try:
            return check()
        except CompletionMismatch as error:
            return str(error)

    rng = random.Random(5)
    refused = accepted = 0
    for _ in range(3000):
        fmt, round_, words, base, stride = _completion(rng)
        n = len(round_.lanes)
        bad = words.copy()
        for _ in range(rng.choice((0, 1, 1, 2))):                  # a word of a row or an extension record
            where = rng.choice((4 + rng.randrange(8 * max(n, 1)), base + rng.randrange(stride * max(n, 1))))
            bad[where] += rng.choice((-1, 1, 7, -300, VOCAB))
        want = verdict(lambda: _reference_validate(fmt, bad, round_, 8))
        assert verdict(lambda: validate_completion(fmt, bad, round_, VOCAB, 8)) == want
        refused += isinstance(want, str)
        accepted += not isinstance(want, str)
    assert refused > 500 and accepted > 500
