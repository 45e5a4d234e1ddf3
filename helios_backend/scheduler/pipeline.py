"""What may follow a round in flight: the rules of the second execution frame.

While round N runs, Scheduler.pipeline_next plans round N+1 from what is known on the host
before N's completion is read (SPEC-43); the worker packs and launches it on the other
staging frame. None (no round N+1) unless every running request either continues from N,
sits N+1 out with its completion observed, or is excluded for a reason that resolves at N's
completion. Per request of N's main submission:

  * a lane that read its device-owned pending token continues (one more token), unless N
    ends it by its output or context limit: then it has nothing to add and is left out; EOS
    at N suppresses its next token (SPEC-50) and retires it;
  * a host-fed lane (a prompt chunk: PREFILL, or the MIXED round's new request) changes
    phase or needs its next chunk, so it waits for N's completion (SPEC-44, SPEC-49) and
    rejoins the round after.

A running request outside N whose last round completed rejoins with its pending token; one
that needs host input (its next prompt chunk) stops the second frame, so schedule() runs
with completion feedback and nobody waits forever. Grammar, withheld ids (min_tokens), host
stops, restoration and cancellation fall back to completion feedback (SPEC-45..48). A
waiting request may join as a host-fed lane of a MIXED round (its initialization before
it): its prompt needs nothing from N. A burst of waiting requests gets a round of prompts
only instead (prompt_rounds.py), and a constrained request at the head of the queue waits
for completion feedback (MET-8).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from operator import attrgetter

import numpy as np

from helios_proto import contract_pb2 as cp
from helios_proto import exchange_pb2 as ep

from helios_backend.scheduler.config import SchedulerConfig
from helios_backend.scheduler.decode_block import DecodeBlock
from helios_backend.scheduler.plan import PENDING_TOKEN, Lane, RoundPlan
from helios_backend.scheduler.request import Request
from helios_backend.scheduler.round_builder import reads_pending

# rounds the second frame may follow: their host-fed lanes sit the next round out
PIPELINE_AFTER = frozenset({cp.OPERATION_DECODE, cp.OPERATION_MIXED, cp.OPERATION_PREFILL})
_PENDING = [PENDING_TOKEN]               # a decode lane's query: its device-owned pending token (shared, never mutated)
_SERIAL = attrgetter("request.serial")


def may_follow(plan: RoundPlan, host_stops: bool, waiting: Sequence[tuple[object, Request]]) -> bool:
    """A round may be planned behind `plan` at all: nothing restored in it, no host-stop
    request active (width one, one round outstanding) and no constrained request at the head
    of the queue (a constrained submission runs alone, MET-8: schedule() admits it)."""
    return (plan.restoration is None and not host_stops and plan.main.operation in PIPELINE_AFTER
            and not (waiting and waiting[0][1].spec.constrained))


def prompts_may_follow(waiting: Sequence[tuple[object, Request]], rows: int) -> bool:
    """A round of prompts only may go behind the round in flight: its tokens are known on the
    host and the stream orders its device work, unless a constrained prompt is among the
    `rows` it would take (MET-8)."""
    return not any(req.spec.constrained for _, req in waiting[:rows])


def continues_on_device(req: Request, eos_ids: tuple[int, ...]) -> bool:
    """Its next round may be planned before its last one completed: nothing of that
    completion decides the round (no host mask, no cancel, no finish already decided)."""
    # Request.needs_mask inline: once per lane and round
    return not (req.grammar is not None or req.cancelled or (req.spec.min_tokens > 0 and req.withholds(eos_ids))
                or req.finish != ep.FINISH_REASON_UNSPECIFIED)


def continuing_lanes(main: Sequence[Lane], running: Iterable[Request],
                     config: SchedulerConfig) -> tuple[list[Lane], list[Lane]] | None:
    """Every running request's next decode lane behind the round in flight (`main` its main
    lanes), each reading its device-owned pending token, and those of them whose position opens
    a page, which the caller reserves once all fit; None when a request needs completion
    feedback (the second frame stays empty). Once per lane and round: the checks read the
    request's fixed facts (host_values, token_limit) before any call."""
    eos_ids, pt = config.eos_ids, config.page_tokens
    lanes: list[Lane] = []
    opening: list[Lane] = []                      # lanes whose next position opens a page
    in_main = set(map(_SERIAL, main))
    for lane in main:
        if lane.tokens != _PENDING:
            continue                              # host-fed: rejoins after the completion
        req = lane.request
        if req.inflight != 1 or req.cancelled or req.finish != ep.FINISH_REASON_UNSPECIFIED \
                or (req.host_values and not continues_on_device(req, eos_ids)):
            return None
        if len(req.tokens) + 1 >= req.token_limit:
            continue                              # the round in flight emits its last token
        start = lane.start + 1
        nxt = Lane(req, lane.slot, lane.generation, start, _PENDING, True, lane.output_limit - 1)
        lanes.append(nxt)
        if start // pt >= len(req.pages):         # position `start` is past the pages held
            opening.append(nxt)
    for req in running:
        if req.serial in in_main:
            continue
        if req.inflight or not reads_pending(req, 1, config.device_pending_token) \
                or not continues_on_device(req, eos_ids):
            return None                           # it needs completion feedback: schedule() takes it
        start = req.computed
        nxt = Lane(req, req.slot, req.generation, start, _PENDING, True, req.spec.max_tokens - req.output_len)
        lanes.append(nxt)
        if start // pt >= len(req.pages):
            opening.append(nxt)
    return lanes, opening


def outsider_block(outsiders: list[Request], config: SchedulerConfig) -> DecodeBlock | None:
    """The next decode lanes of `outsiders` (running requests outside the round in flight, in
    running order, columnar) as a block; None when one needs completion feedback."""
    eos_ids = config.eos_ids
    for req in outsiders:
        if req.inflight or not reads_pending(req, 1, config.device_pending_token) \
                or not continues_on_device(req, eos_ids):
            return None                           # it needs completion feedback: schedule() takes it
    return DecodeBlock.of(outsiders, [req.computed for req in outsiders],
                          [req.spec.max_tokens - req.output_len for req in outsiders])


def continuing_block(main: DecodeBlock, outsiders: list[Request], config: SchedulerConfig,
                     rejoining: DecodeBlock | None = None) -> tuple[DecodeBlock, np.ndarray, bool] | None:
    """continuing_lanes for a round whose main lanes are a block, as a block: the same lanes in
    the same order, with numpy over the columns. The caller's conditions: no running request is
    cancelled or has its finish decided, and `outsiders` (the running requests outside `main`, in
    running order) are columnar. A block lane's request has exactly this round in flight, no host
    values, and len(tokens) == start + 1 (its previous round completed), so of continuing_lanes'
    checks only the length limit is left. Returns the block, the indices of its lanes whose
    position opens a page, and whether each of them needs exactly one page (its position is the
    first of the page after those it holds); None when an outsider needs completion feedback.
    `rejoining`: the outsiders' lanes already as a block (Scheduler._rejoining), in place of
    `outsiders`."""
    block = main.advance(main.rooms > 2)          # len(tokens) + 1 < token_limit: start + 2 < token_limit
    if outsiders:
        rejoining = outsider_block(outsiders, config)
        if rejoining is None:
            return None
    if rejoining is not None:
        block = block.joined(rejoining)
    past = block.starts // config.page_tokens - block.page_counts     # pages short of the position, less one
    opening = (past >= 0).nonzero()[0]
    return block, opening, not opening.size or int(np.maximum.reduce(past)) == 0
