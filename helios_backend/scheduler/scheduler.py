"""The scheduler: one token-budget loop over running and waiting requests.

Every round (vLLM v1 style) each request's `computed` catches up with len(tokens):
chunked prefill, prefix hits, readmission after preemption and decode are the same
loop; a lane whose chunk reaches len(tokens) samples. The round's lanes pick the
smallest prepared capacity variant that holds them (variants.py).

Order inside a round (one RoundBuilder value carries the round being built through the
calls that add its lanes, round_builder.py):
  1. retire cancelled requests that have no round in flight (their fence passed);
  1b. a round of prompts only when a burst waits (prompt_rounds.py);
  2. running requests, oldest first: reserve pages for their chunk; on a shortage,
     evict snapshots, then preempt the newest lowest-priority running request
     (possibly the request itself), which goes back to the front of the queue;
  3. if nobody was preempted: admit waiting requests (priority, then arrival) while a
     slot, budget and pages are available: prefix match over complete pages, then a
     snapshot at an exact endpoint restored into a private page; a shortage waits.

While a round runs, pipeline_next plans the next one on the second execution frame
(the rules: pipeline.py).

Invariants (docs/scheduler.md): a page is written only by the one request whose page
table holds it privately; published pages are immutable; nothing is published before
its completion was validated; resources of a lane are released only after its last
submitted round completed (its fence).

Clock: add() stamps a request's receipt, and complete() reads the clock once per round only
when an observed request emits a token (OBS-15, OBS-16); building a round reads none.
"""
from __future__ import annotations

import bisect
import time
from operator import attrgetter
from collections.abc import Callable, Sequence

import numpy as np

from helios_proto import contract_pb2 as cp
from helios_proto import exchange_pb2 as ep

from helios_backend.scheduler.admission import check_admission, max_prompt_tokens
from helios_backend.scheduler.completion import CompletionRows
from helios_backend.scheduler.config import SchedulerConfig
from helios_backend.scheduler.decode_block import ADVANCE, COLUMNS, DecodeBlock, explicit_lanes
from helios_backend.scheduler.events import (
    Emitted, Event, SchedulerCounters, Terminal, TokenBlock, WorkerEvent, expand)
from helios_backend.scheduler.generations import SlotGenerations
from helios_backend.scheduler.host_stops import HostStopCheck
from helios_backend.scheduler.pages import PagePool
from helios_backend.scheduler.pipeline import (continuing_block, continuing_lanes, may_follow, outsider_block,
                                               prompts_may_follow)
from helios_backend.scheduler.plan import PENDING_TOKEN, Lane, RestoreCopy, RoundPlan, Submission
from helios_backend.scheduler.prefix_hash import chain_keys, chain_seed, next_key
from helios_backend.scheduler.prefix_match import match_prefix
from helios_backend.scheduler.prompt_rounds import PromptRounds
from helios_backend.scheduler.request import Grammar, Request, RequestSpec, RequestState
from helios_backend.scheduler.round_builder import RoundBuilder, reads_pending
from helios_backend.scheduler.snapshots import SnapshotStore
from helios_backend.scheduler.variants import VariantTable

__all__ = ["Emitted", "Event", "Scheduler", "SchedulerConfig", "SchedulerCounters", "Terminal", "TokenBlock",
           "WorkerEvent"]


StopFactory = Callable[[RequestSpec], HostStopCheck | None]
_CONSTRAINED = attrgetter("request.spec.constrained")
_HOST_VALUES = attrgetter("request.host_values")
_TOKENS = attrgetter("tokens")
_PENDING = [PENDING_TOKEN]               # a lane's tokens when it reads its device-owned pending token
_new_tuple = tuple.__new__               # a token event without NamedTuple's Python-level __new__


class Scheduler:
    def __init__(self, config: SchedulerConfig, variants: VariantTable,
                 stop_factory: StopFactory | None = None, generations: SlotGenerations | None = None) -> None:
        self.config = config
        self.variants = variants
        self._prompt_rounds = PromptRounds(config.admission_burst, variants)
        self._initialization_rows = variants.max_rows(cp.OPERATION_INITIALIZATION) \
            if variants.has(cp.OPERATION_INITIALIZATION) else max(variants.main_rows, 1)
        self.pool = PagePool(config.num_pages)
        snapshots_on = config.snapshot_capacity > 0 and variants.has(cp.OPERATION_RESTORATION)
        self.snapshots = SnapshotStore(config.snapshot_capacity if snapshots_on else 0, self.pool)
        self.counters = SchedulerCounters()
        self._stop_factory = stop_factory
        self._seed = chain_seed(config.cache_fingerprint)
        self._free_slots = list(range(config.request_slots - 1, -1, -1))
        self._slot_owner: list[Request | None] = [None] * config.request_slots   # the running request of a slot
        # per slot, set at each admission: its generation, and its admission's place in the running
        # order (the running list is in admission order), so that a round reads the running order
        # and the admissions of a set of slots with one numpy call
        self._slot_generation = np.full(config.request_slots, -1, np.int64)
        self._slot_admission = np.zeros(config.request_slots, np.int64)
        self._admissions = 0
        # the block of the last round completed as columns, until the next round is booked: the
        # round planned behind a round of prompts takes its lanes' next columns from it
        # (_continuing_block); None after any other completion or a failure
        self._parked: DecodeBlock | None = None
        # requests cancelled or whose finish is decided but not yet fenced: while any is known, a
        # round's decode lanes take the per-lane path (their checks are per request)
        self._unsettled: set[int] = set()
        # the model's (NativeModel.generations) when serving; a scheduler without one counts its own
        self._generations = generations if generations is not None else SlotGenerations(config.request_slots)
        self._waiting: list[tuple[tuple[int, int], Request]] = []    # sorted by (-priority, arrival)
        self._running: list[Request] = []                            # admission order
        self._by_serial: dict[int, Request] = {}
        self._stops: dict[int, HostStopCheck] = {}
        self._arrivals = 0
        self._admitted_ns: dict[int, int] = {}
        self._events: list[WorkerEvent] = []
        self._eos = frozenset(config.eos_ids)
        # bool [ids + 1]: an EOS id (a block's sampled tokens are looked up at once, one comparison
        # per EOS id cost more numpy calls); the last entry, False, is what an id past the table
        # reads (take(mode="clip")), so no vocabulary mismatch can raise or read an EOS there
        self._eos_table = np.zeros(max([config.vocab_size, *(i + 1 for i in config.eos_ids)]) + 1, bool)
        self._eos_table[list(config.eos_ids)] = True
        self.max_active = min(config.max_active, config.request_slots, variants.main_rows)
        self._max_prompt = max_prompt_tokens(config)
        self._chunk_limit = config.prefill_chunk_tokens or config.context_tokens

    # ---- queries ---------------------------------------------------------------
    @property
    def max_prompt_tokens(self) -> int:
        """Longest admissible prompt: room for the prompt and one output token."""
        return self._max_prompt

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def free_active(self) -> int:
        """Active places no live request holds or waits for: what the next round admits at once."""
        running, waiting = self._live()
        return max(0, self.max_active - running - waiting)

    @property
    def queued(self) -> int:
        """Live waiting requests that must wait for a place (HTTP-5 bounds these by queue_capacity).
        Those the free active places take at the next round are not queued, so a burst of
        queue_capacity + max_active into an idle scheduler is admitted whole, as HTTP admits it;
        cancelled requests not yet retired are not counted, as HTTP released their permits."""
        running, waiting = self._live()
        return max(0, waiting - max(0, self.max_active - running))

    def _live(self) -> tuple[int, int]:
        """(running, waiting) requests not cancelled (a cancel retires at the next round)."""
        return (sum(1 for r in self._running if not r.cancelled),
                sum(1 for _, r in self._waiting if not r.cancelled))

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def request(self, serial: int) -> Request | None:
        return self._by_serial.get(serial)

    @property
    def host_stop_barrier(self) -> bool:
        """Width one, one outstanding round: true while a host-stop request is active."""
        return bool(self._stops)

    def take_events(self) -> list[Event]:
        """The events since the last call, one Emitted per token."""
        events, self._events = self._events, []
        return expand(events)

    def take_worker_events(self) -> list[WorkerEvent]:
        """The events since the last call, the tokens of columnar decode lanes as TokenBlocks
        (what the worker delivers: its sinks send or expand them)."""
        events, self._events = self._events, []
        return events

    # ---- admission -------------------------------------------------------------
    def add(self, serial: int, spec: RequestSpec, grammar: Grammar | None = None) -> Request:
        """Queue a request or raise AdmissionRejected / InvalidSpecError (others go on)."""
        spec = check_admission(self.config, spec, self._max_prompt, queued=self.queued)
        stop = self._stop_factory(spec) if (self._stop_factory and spec.stops.host_stops) else None
        req = Request(serial, spec, self._arrivals, grammar=grammar)
        req.token_limit = min(req.prompt_len + spec.max_tokens, self.config.context_tokens)
        self._arrivals += 1
        self._by_serial[serial] = req
        if stop is not None:
            self._stops[serial] = stop
        self._admitted_ns[serial] = time.monotonic_ns()
        self._enqueue(req)
        self.counters.admitted += 1
        return req

    def cancel(self, serial: int) -> None:
        """Client cancel or dropped stream: retired at the next round, after its fence."""
        req = self._by_serial.get(serial)
        if req is not None and req.state is not RequestState.FINISHED:
            req.cancelled = True
            self._unsettled.add(serial)

    # ---- the token-budget loop -----------------------------------------------------
    def schedule(self) -> RoundPlan | None:
        self._retire_cancelled()
        if self._prompts_due():
            # a round of prompts only: a MIXED round admits one request beside the decode lanes,
            # which falls behind arrivals at high concurrency; every other round at most
            prompts = self._prompt_round()
            if prompts is not None:
                return prompts
        self._prompt_rounds.planned(prompts_only=False)
        columns = self._decode_columns()
        if columns is not None:
            return columns
        round_ = RoundBuilder(self.max_active)
        preempted: list[Request] = []
        running, variants, device_pending = self._running, self.variants, self.config.device_pending_token
        i = 0
        while i < len(running) and len(round_.lanes) < round_.row_limit:
            req = running[i]
            n = round_.fit_chunk(variants, min(req.remaining_tokens, self._chunk_limit),
                                 reads_pending(req, 1, device_pending))
            if n == 0:
                break
            while not self._reserve_pages(req, req.computed + n):
                victim = running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.state is not RequestState.RUNNING:
                break
            round_.add(self._lane(req, n), reads_pending(req, n, device_pending))
            i += 1
        if not preempted:
            self._admit_waiting(round_)
        if not round_.lanes:
            return None
        return self._plan(round_, preempted)

    def _decode_columns(self) -> RoundPlan | None:
        """schedule()'s round as a DecodeBlock when the lane-by-lane loop would plan a DECODE
        round of every running request, each reading its pending token, with no preemption,
        eviction or admission; None otherwise (the loop decides it). The same lanes in the same
        order, the same pages (each lane's opening pages, in lane order) and fences: the loop's
        plan, without a Lane, a chunk fit and a page check per lane (docs/scheduler.md)."""
        running = self._running
        n = len(running)
        config = self.config
        if not n or n > self.max_active or not config.columnar_decode or not config.device_pending_token \
                or self._unsettled or (self._waiting and self._free_slots and n < self.max_active):
            return None                               # (a waiting request would be admitted beside them)
        pt = config.page_tokens
        opening: list[Request] = []                   # the lanes whose position is past their pages
        needs: list[int] = []
        for req in running:
            start = req.computed
            if not req.columnar or req.fresh or not req.device_pending or start != len(req.tokens) - 1:
                return None
            past = start // pt - len(req.pages)       # pages short of the position, less one
            if past >= 0:
                opening.append(req)
                needs.append(past + 1)
        variant = self.variants.choose_shape(n, n, 0)
        if variant is None or variant.operation != cp.OPERATION_DECODE:
            return None
        if opening:
            total = sum(needs)
            if total > self.pool.available_pages:
                return None                           # a shortage: eviction or preemption lane by lane
            self._give_pages(opening, needs)        # before the block counts them
        block = DecodeBlock.of(list(running), [req.computed for req in running],
                               [req.spec.max_tokens - req.output_len for req in running])
        return self._book(RoundPlan(Submission(variant, block)))

    def _give_pages(self, requests: Sequence[Request], needs: Sequence[int]) -> None:
        """Each request its `needs` pages (<= 0: none), in request order, from one allocation:
        allocate_many gives them in the order lane-by-lane allocations would. The caller has
        checked that the pool has them all."""
        pages, at = self.pool.allocate_many(sum(k for k in needs if k > 0)), 0
        for req, k in zip(requests, needs):
            if k > 0:
                req.pages.extend(pages[at:at + k])
                at += k

    def _prompts_due(self) -> bool:
        return self._prompt_rounds.due(self._waiting, len(self._running), len(self._free_slots), self.max_active)

    def _admit_waiting(self, round_: RoundBuilder) -> None:
        # every admitted lane is initialized before the round (one INITIALIZATION submission):
        # a MIXED round that takes several prompts stops at the widest initialization variant
        while self._waiting and not round_.full and self._free_slots \
                and len(self._running) < self.max_active and round_.initializing < self._initialization_rows:
            _, req = self._waiting[0]
            if req.cancelled:
                self._waiting.pop(0)
                self._finish(req, ep.FINISH_REASON_CANCELLED)
                continue
            if not self._try_admit(req, round_):
                return                          # a temporary shortage waits (head of line)
            self._waiting.pop(0)

    def _try_admit(self, req: Request, round_: RoundBuilder) -> bool:
        pt = self.config.page_tokens
        tokens = req.tokens
        pending = reads_pending(req, 1, self.config.device_pending_token)
        if not pending and 0 < round_.host_fed < round_.rows and not round_.fit_chunk(self.variants, 1, False):
            # no host-fed token fits the round (a MIXED round that took its prompt), so no chunk
            # does (fit_chunk is monotone in the chunk for a host-fed lane): no prefix lookup
            return False
        match = match_prefix(self.pool, self.snapshots, self._seed, tokens, pt)
        snap = match.snapshot
        start = match.start(pt)
        n = round_.fit_chunk(self.variants, min(len(tokens) - start, self._chunk_limit), pending)
        if n == 0:
            return False
        if snap is not None:
            self.snapshots.pin(snap)            # not evictable while we look for pages
        need = -(-(start + n) // pt) - len(match.pages)
        hit = match.pages
        # (the hit pages that are cached count as available but are not: no generator without hits)
        while need > self.pool.available_pages - (sum(1 for p in hit if self.pool.refcount(p) == 0) if hit else 0):
            evicted = self.snapshots.evict_for_pages()
            hit = self.pool.match(match.keys[:len(hit)]) if evicted else hit
            if not evicted or len(hit) < len(match.pages):
                if snap is not None:            # a temporary shortage: wait for the next round
                    self.snapshots.unpin_row(snap.row)
                return False
        self.pool.acquire(hit)
        req.pages = list(hit)
        req.published_pages = len(hit)
        req.chain_keys = match.keys[:len(hit)]
        req.admission_keys = match.keys
        restore = None
        if snap is not None:
            page = self.pool.allocate()
            req.pages.append(page)
            self.snapshots.record_restore()
            restore = RestoreCopy(snap.row, page, len(hit), len(snap.partial))
        req.computed = start
        if not self._reserve_pages(req, start + n):
            raise RuntimeError("page availability was checked before admission")
        slot = self._free_slots.pop()
        self._slot_owner[slot] = req
        req.slot, req.generation = slot, self._generations.next(slot)
        self._slot_generation[slot] = req.generation
        self._admissions += 1
        self._slot_admission[slot] = self._admissions
        req.state = RequestState.RUNNING
        req.fresh = True
        self._running.append(req)
        self.counters.lookup_tokens += len(tokens)
        self.counters.reused_tokens += start
        if req.reused_prompt_tokens < 0:           # the first admission: its wait ends here
            # the receipt stamp add() took: building a round reads no clock; the engine loop
            # reads "now" once per admitting round and turns these into queue waits
            self.counters.first_admission_receipts_ns.append(self._admitted_ns.get(req.serial, 0))
            req.reused_prompt_tokens = min(start, req.prompt_len)
        else:
            self.counters.readmissions += 1
        lane = self._lane(req, n)
        lane.restore = restore
        round_.add(lane, reads_pending(req, n, self.config.device_pending_token))
        return True

    def _reserve_pages(self, req: Request, end: int) -> bool:
        """Pages covering positions [0, end); False on a shortage (nothing allocated)."""
        need = -(-end // self.config.page_tokens) - len(req.pages)
        if need <= 0:
            return True
        while need > self.pool.available_pages:
            if not self.snapshots.evict_for_pages():
                return False
        req.pages.extend(self.pool.allocate_many(need))
        return True

    def _lane(self, req: Request, n: int) -> Lane:
        start = req.computed
        snapshot_row = -1
        end = start + n
        pt = self.config.page_tokens
        if (self.snapshots.capacity and req.preemptions == 0 and end == req.prompt_len
                and req.prompt_len % pt and start < end):
            complete = req.prompt_len // pt
            # the keys its admission's prefix lookup hashed (the same chain), else hashed here
            keys = req.admission_keys[:complete]
            if len(keys) < complete:
                keys = chain_keys(self._seed, req.tokens, pt, complete)
            snap = self.snapshots.reserve(keys[-1] if keys else self._seed, req.pages[:complete],
                                          req.tokens[complete * pt:req.prompt_len], pt)
            if snap is not None:
                snapshot_row = snap.row
        return Lane(req, req.slot, req.generation, start, list(req.tokens[start:end]),
                    sample=end == len(req.tokens),
                    output_limit=req.spec.max_tokens - req.output_len,
                    snapshot_row=snapshot_row, initialize=req.fresh)

    def _plan(self, round_: RoundBuilder, preempted: list[Request]) -> RoundPlan:
        lanes = round_.lanes
        explicit = explicit_lanes(lanes)              # a block's columns read their pending token already
        variant = self.variants.choose_shape(round_.rows, round_.tokens, round_.host_fed)
        if variant is None:
            raise RuntimeError("lanes were fitted to a variant while the round was built")
        if variant.operation in (cp.OPERATION_DECODE, cp.OPERATION_MIXED) and round_.host_fed < len(lanes):
            device_pending = self.config.device_pending_token
            for lane in explicit:
                if reads_pending(lane.request, len(lane.tokens), device_pending):
                    lane.tokens = [PENDING_TOKEN]
        plan = RoundPlan(Submission(variant, lanes), preempted=preempted)
        restores = [lane for lane in explicit if lane.restore is not None]
        if restores:
            v = self.variants.fit(cp.OPERATION_RESTORATION, len(restores), 0) \
                or self.variants.fit(cp.OPERATION_RESTORATION, len(restores), len(restores))
            if v is None:
                raise RuntimeError("no RESTORATION variant holds the round's restores")
            plan.restoration = Submission(v, restores)
        if round_.initializing and self.variants.has(cp.OPERATION_INITIALIZATION):
            fresh = [lane for lane in explicit if lane.initialize]
            v = self.variants.fit(cp.OPERATION_INITIALIZATION, len(fresh), 0)
            if v is None:
                raise RuntimeError("no INITIALIZATION variant holds the round's new lanes")
            plan.initialization = Submission(v, fresh)
        return self._book(plan)

    def _book(self, plan: RoundPlan) -> RoundPlan:
        """Count the round's submissions and fence its lanes: each is in flight until the
        round's completion or failure is applied."""
        self._parked = None                           # its lanes' columns hold only until a round is booked
        for sub in plan.submissions():
            self.counters.launched(sub.operation)
            lanes = sub.lanes
            if isinstance(lanes, DecodeBlock):
                for req in lanes.take_fence():        # a lane carried from the round in flight: none
                    req.inflight += 1
                lanes = lanes.extra
            for lane in lanes:
                lane.request.inflight += 1
        return plan

    def pipeline_next(self, plan: RoundPlan) -> RoundPlan | None:
        """The next round, planned behind `plan` for the second execution frame while `plan`
        runs; None when a request needs `plan`'s completion first (the rules: pipeline.py)."""
        if not may_follow(plan, bool(self._stops), self._waiting):
            return None
        if self._prompts_due():
            # the round of prompts goes behind `plan`: its prompts need nothing from it
            if not prompts_may_follow(self._waiting, self._prompt_rounds.rows):
                return None
            prompts = self._prompt_round()
            if prompts is not None:
                self.counters.pipelined += 1
            return prompts
        # the next round's lanes, built once; pages are reserved only after all of them fit
        block = self._continuing_block(plan.main.lanes)
        lanes: list[Lane] | DecodeBlock
        if block is None:
            found = continuing_lanes(plan.main.lanes, self._running, self.config)
            if found is None or not found[0] or len(found[1]) > self.pool.available_pages:
                return None
            lanes, opening = found
            for lane in opening:                      # the lanes whose position opens a page
                if not self._reserve_pages(lane.request, lane.start + 1):
                    raise RuntimeError("page availability was checked before pipelining")
            if self.config.columnar_decode and all(lane.request.columnar for lane in lanes):
                lanes = DecodeBlock.of([lane.request for lane in lanes], [lane.start for lane in lanes],
                                       [lane.output_limit for lane in lanes])
        elif not block:
            return None
        else:
            lanes = block
        round_ = RoundBuilder.decoding(self.max_active, lanes, behind_inflight=True)
        decode_lanes = round_.rows
        if self._waiting and self.variants.has(cp.OPERATION_MIXED):
            self._admit_waiting(round_)               # host-fed lanes of a MIXED round, never PREFILL
        if round_.rows > decode_lanes:
            nxt = self._plan(round_, [])
        else:
            variant = self.variants.fit(cp.OPERATION_DECODE, decode_lanes, decode_lanes)
            if variant is None:
                return None
            nxt = self._book(RoundPlan(Submission(variant, round_.lanes)))
        self.counters.pipelined += 1
        self._prompt_rounds.planned(prompts_only=False)   # a decode round since the last round of prompts
        return nxt

    def _continuing_block(self, main: Sequence[Lane]) -> DecodeBlock | None:
        """The next round's decode lanes as a block when `main` is one, or a round of host-fed
        lanes only (a round of prompts: they all sit the next round out, so its lanes are the
        running requests outside it), and the columns decide them (pipeline.continuing_block),
        their opening pages reserved; an empty block when they need completion feedback; None:
        decide them lane by lane (continuing_lanes)."""
        if not self.config.columnar_decode or self._unsettled:
            return None
        if not isinstance(main, DecodeBlock):
            if not main or _PENDING in map(_TOKENS, main):
                return None
            prompts = DecodeBlock.of([], [], [])      # no lane continues: an empty block, `main` its tail
            prompts.extra = list(main)
            main = prompts
        # the running requests outside `main` (rejoining after sitting a round out), in running
        # order; every request of `main` is running (in flight: it cannot have been released)
        outsiders: list[Request] = []
        rejoining: DecodeBlock | None = None
        if len(self._running) > len(main):
            in_main = np.zeros(self.config.request_slots, bool)
            in_main[main.slots] = True
            for lane in main.extra:
                in_main[lane.slot] = True
            in_main[self._free_slots] = True
            slots = (~in_main).nonzero()[0]
            if slots.size > 1:                        # in running order: the order of their admissions
                slots = slots.take(self._slot_admission.take(slots).argsort())
            owners = self._slot_owner
            outsiders = [owners[slot] for slot in slots.tolist()]
            if None in outsiders:
                raise RuntimeError("an occupied slot has no running request")
            parked = self._parked
            if parked is not None and not main.size and slots.size > 4:
                rejoining = self._rejoining(parked, slots, outsiders)
                if rejoining is None or not rejoining:    # lane by lane / completion feedback
                    return rejoining
                outsiders = []
        if not all(req.columnar for req in outsiders):
            return None
        found = continuing_block(main, outsiders, self.config, rejoining)
        if found is None:
            return DecodeBlock.of([], [], [])
        block, opening, one_each = found
        if len(opening) > self.pool.available_pages:
            return DecodeBlock.of([], [], [])
        if not opening.size:
            return block
        # the lanes whose position opens a page: one page each (position `start` is the first
        # of the page after those held), taken in one call, in lane order as one by one
        page_counts = block.page_counts
        if one_each:
            requests = block.requests
            for i, page in zip(opening.tolist(), self.pool.allocate_many(opening.size)):
                requests[i].pages.append(page)
            page_counts[opening] += 1
            return block
        for i in opening.tolist():
            req = block.requests[i]
            if not self._reserve_pages(req, int(block.starts[i]) + 1):
                raise RuntimeError("page availability was checked before pipelining")
            page_counts[i] = len(req.pages)
        return block

    def _rejoining(self, parked: DecodeBlock, slots: np.ndarray, outsiders: list[Request]) -> DecodeBlock | None:
        """The decode lanes of `outsiders` (running requests of `slots`, in running order) behind a
        round of prompts, as a block, when the last round completed was the block `parked`: a lane
        of it whose slot still holds the same admission (generation) continues one position
        further, its columns the parked ones advanced (DecodeBlock.advance: start, output limit and
        room as the request now reads them, its pages those it held), with no check of its own:
        it was a plain decode lane, its round completed as columns while nothing was unsettled, no
        round was booked since, and a round of prompts holds no decode lane, so it is not in
        flight, reads its pending token and its finish is not decided (it would have been released,
        or be unsettled). The others (the admissions of the rounds before, which sat the parked
        round out) are checked and gathered as pipeline.continuing_block does: None when one is
        not columnar (the lanes are then decided lane by lane), an empty block when one needs
        completion feedback."""
        lane_of = np.full(self.config.request_slots, -1, np.int64)
        lane_of[parked.slots] = np.arange(parked.size)
        lanes = lane_of.take(slots)
        mine = lanes >= 0
        mine[mine] = parked.generations.take(lanes[mine]) == self._slot_generation.take(slots[mine])
        columns = np.empty((COLUMNS, len(slots)), np.int64)
        columns[:, mine] = parked.columns.take(lanes[mine], axis=1)
        columns[:, mine] += ADVANCE
        others = (~mine).nonzero()[0]
        if others.size:
            requests = [outsiders[i] for i in others.tolist()]
            if not all(req.columnar for req in requests):
                return None
            gathered = outsider_block(requests, self.config)
            if gathered is None:
                return DecodeBlock.of([], [], [])
            columns[:, others] = gathered.columns
        return DecodeBlock(outsiders, columns)

    def _prompt_round(self) -> RoundPlan | None:
        """A round of prompts only, as many rows as the widest PREFILL variant (prompt_rounds.py),
        from schedule() or behind the round in flight (pipeline_next): its prompts read nothing
        from the device, so it is built as any round is. None when none fits; the decoding
        requests sit it out and rejoin the round after it."""
        round_ = RoundBuilder(self._prompt_rounds.rows)
        self._admit_waiting(round_)
        if not round_.lanes:
            return None
        self._prompt_rounds.planned(prompts_only=True)
        return self._plan(round_, [])

    # ---- completion ----------------------------------------------------------------
    def complete(self, plan: RoundPlan, rows: CompletionRows) -> None:
        """Apply a round whose main completion was validated (completion.py).
        Its token and terminal events are then read with take_events()."""
        for sub in (plan.restoration, plan.initialization):
            if sub is not None:
                for lane in sub.lanes:
                    lane.request.inflight -= 1
        main = plan.main
        lanes = main.lanes
        # a block's columns are plain decode lanes (decode_block.py): applied as arrays, unless a
        # request is cancelled or its finish decided (then lane by lane, as any other lane)
        columns = isinstance(lanes, DecodeBlock) and not self._unsettled
        self._parked = lanes if columns and isinstance(lanes, DecodeBlock) else None
        explicit = explicit_lanes(lanes) if columns else lanes
        fenced = 0                                    # the explicit lanes from here release their fence below
        if isinstance(lanes, DecodeBlock):            # its columns' fence first (those it did not hand on)
            for req in lanes.release_fence():
                req.inflight -= 1
            fenced = 0 if columns else lanes.size
        # a constrained request has host values (Request.host_values): most rounds have none
        constrained = sum(map(_CONSTRAINED, explicit)) if any(map(_HOST_VALUES, explicit)) else 0
        if constrained:
            # the auxiliary submissions' lanes are main lanes: none constrained there either otherwise
            if main.operation == cp.OPERATION_DECODE and constrained < len(main.lanes):
                self.counters.mixed_grammar_decode_steps += 1
            for sub in plan.submissions():
                if any(lane.request.spec.constrained for lane in sub.lanes):
                    # the most executor frames the runner saw in flight right after a successful
                    # constrained submission (MET-8); completion feedback keeps it at one (MET-10)
                    self.counters.constrained_max_inflight = max(self.counters.constrained_max_inflight,
                                                                 sub.frames_outstanding)
        # once per lane per round: the row values as Python objects in one call each, the page
        # publication only when the lane completed a page, the finish by length against the
        # request's token limit, and the token event built as the tuple it is
        generated = 0
        stamp = None
        offset = 0                                    # the rows of the explicit lanes start here
        if columns:
            assert isinstance(lanes, DecodeBlock)
            stamp = self._complete_columns(lanes, rows)
            generated = offset = lanes.size
            if not explicit:
                self.counters.generated_tokens += generated
                return
        tokens = rows.tokens[offset:].tolist()
        logprobs = rows.logprobs[offset:].tolist() if rows.logprobs is not None else None
        top_ids = rows.top_ids[offset:] if rows.top_ids is not None else None
        top_logprobs = rows.top_logprobs[offset:] if rows.top_logprobs is not None else None
        pt = self.config.page_tokens
        events = self._events
        eos, stops = self._eos, self._stops
        for i, lane in enumerate(explicit):
            req = lane.request
            if i >= fenced:
                req.inflight -= 1
            if lane.restore is not None:
                self._unpin_restore(lane.restore.source_row)
            req.computed = end = lane.start + len(lane.tokens)
            req.fresh = False
            if end // pt > req.published_pages and len(req.pages) > req.published_pages:
                self._publish_pages(req)
            if lane.snapshot_row >= 0:
                if req.cancelled:
                    self.snapshots.discard(lane.snapshot_row)
                else:
                    self.snapshots.publish(lane.snapshot_row)
            if req.cancelled:
                self._finish_if_fenced(req, ep.FINISH_REASON_CANCELLED)
                continue
            if req.finish != ep.FINISH_REASON_UNSPECIFIED:
                # decided by the previous round while this one was in flight (two frames):
                # its token is not published; the lane retires at this fence
                self._finish_if_fenced(req, req.finish)
                continue
            if not lane.sample:
                continue
            token = tokens[i]
            known = req.tokens
            known.append(token)
            req.device_pending = True
            generated += 1
            spec = req.spec
            if spec.observe_timestamps:
                if stamp is None:
                    stamp = time.monotonic_ns() - self.config.clock_origin_ns
                ts = stamp
            else:
                ts = -1
            k = spec.top_logprobs
            events.append(_new_tuple(Emitted, (
                req.serial, token, ts, logprobs[i] if logprobs is not None else 0.0,
                top_ids[i, :k] if k and top_ids is not None else None,
                top_logprobs[i, :k] if k and top_logprobs is not None else None)))
            if req.grammar is not None:
                # a violating token leaves the matcher in error: its masks then allow only EOS
                req.grammar.consume(token)
            # _finish_reason inline: EOS, then a host stop, then the length limit
            if token in eos and not spec.ignore_eos:
                self._finish_if_fenced(req, ep.FINISH_REASON_EOS)
            elif stops and req.serial in stops:
                reason = self._finish_reason(req, token)
                if reason != ep.FINISH_REASON_UNSPECIFIED:
                    self._finish_if_fenced(req, reason)
            elif len(known) >= req.token_limit:
                self._finish_if_fenced(req, ep.FINISH_REASON_LENGTH)
        self.counters.generated_tokens += generated

    def _complete_columns(self, block: DecodeBlock, rows: CompletionRows) -> int | None:
        """complete() of a block's columns: the same state and events as lane by lane, with
        per-lane Python only for the token append and the lanes that complete a page or finish.
        Each lane's request is not fresh, reads its pending token, has no host stops, grammar or
        top logprobs, and its computed endpoint is `start` (decode_block.py). Returns the clock
        stamp when an observed request emitted."""
        k = block.size
        if not k:
            return None
        pt = self.config.page_tokens
        sampled = rows.tokens[:k]
        tokens = sampled.tolist()
        ends = block.starts + 1
        requests = block.requests
        for req, token, end in zip(requests, tokens, ends.tolist()):     # (their fence: complete())
            req.computed = end
            req.tokens.append(token)
        stamp = stamps = None
        observed = block.observed
        if observed.any():
            stamp = time.monotonic_ns() - self.config.clock_origin_ns
            stamps = np.where(observed == 1, stamp, -1)
        serials = block.serials
        logprobs = rows.logprobs[:k] if rows.logprobs is not None else None

        def emitted(a: int, b: int) -> TokenBlock:       # the token events of lanes [a, b)
            return TokenBlock(serials[a:b], sampled[a:b], None if stamps is None else stamps[a:b],
                              None if logprobs is None else logprobs[a:b])
        # the lanes that may complete a page (published >= (end - 1) // pt held before this round)
        # or finish by EOS or length: decided lane by lane, in lane order, as the per-lane path does
        flagged = (ends % pt == 0) | (block.rooms <= 2)          # ends + 1 >= token_limit
        if self._eos:                             # an EOS id where EOS ends it: one lookup (True > 0)
            flagged |= self._eos_table.take(sampled, mode="clip") > block.ignore_eos
        events = self._events
        done = 0
        eos = self._eos
        marked = flagged.nonzero()[0].tolist()          # (np.flatnonzero: ~4x the call)
        # the pages completed in this round first, in lane order: a finish below releases only its
        # own request's pages, published here already, so the pool ends as lane by lane
        self._publish_pages_of([requests[i] for i in marked])
        for i in marked:
            req = requests[i]
            if tokens[i] in eos and not req.spec.ignore_eos:
                reason = ep.FINISH_REASON_EOS
            elif len(req.tokens) >= req.token_limit:
                reason = ep.FINISH_REASON_LENGTH
            else:
                continue
            events.append(emitted(done, i + 1))       # its terminal follows its token
            done = i + 1
            self._finish_if_fenced(req, reason)
        if done < k:
            events.append(emitted(done, k))
        return stamp

    def fail(self, plan: RoundPlan, message: str) -> None:
        """The round failed (execution or validation): its lanes end with a typed failure;
        nothing of the round is published (CACHE-25); other requests go on."""
        self._parked = None
        seen: set[int] = set()
        for sub in plan.submissions():
            lanes = sub.lanes
            if isinstance(lanes, DecodeBlock):
                for req in lanes.release_fence():
                    req.inflight -= 1
                lanes = lanes.extra
            for lane in lanes:
                lane.request.inflight -= 1
        for lane in plan.main.lanes:
            if lane.snapshot_row >= 0:
                self.snapshots.discard(lane.snapshot_row)
            if lane.restore is not None:
                self._unpin_restore(lane.restore.source_row)
        for sub in plan.submissions():
            for lane in sub.lanes:
                req = lane.request
                if req.serial in seen or req.state is RequestState.FINISHED:
                    continue
                seen.add(req.serial)
                if req.finish != ep.FINISH_REASON_UNSPECIFIED and req.inflight == 0:
                    self._finish(req, req.finish)      # it had ended before this failed round
                    continue
                self._release(req)
                self.counters.failed += 1
                self._events.append(Terminal(req.serial, ep.TerminalEvent(
                    failed=ep.ExecutionFailure(message=message, completion_tokens=req.output_len))))

    def fail_all(self, message: str) -> list[Event]:
        """The worker is going away: every request still known ends with a failure."""
        for req in list(self._by_serial.values()):
            if req.state is not RequestState.FINISHED:
                self._release(req)
                self.counters.failed += 1
                self._events.append(Terminal(req.serial, ep.TerminalEvent(
                    failed=ep.ExecutionFailure(message=message, completion_tokens=req.output_len))))
        self._waiting.clear()
        return self.take_events()

    # ---- helpers -------------------------------------------------------------------
    def _finish_reason(self, req: Request, token: int) -> "ep.FinishReason.ValueType":
        if token in self._eos and not req.spec.ignore_eos:
            return ep.FINISH_REASON_EOS
        stop = self._stops.get(req.serial) if self._stops else None
        if stop is not None:
            match = stop.observe(token)
            if match is not None:
                req.stop = match
                return ep.FINISH_REASON_STOP_STRING if match.kind == ep.STOP_KIND_STRING \
                    else ep.FINISH_REASON_STOP_TOKEN
        if len(req.tokens) >= req.token_limit:
            return ep.FINISH_REASON_LENGTH
        return ep.FINISH_REASON_UNSPECIFIED

    def _publish_pages(self, req: Request) -> None:
        """Publish complete pages whose every position was consumed (validated)."""
        self._publish_pages_of((req,))

    def _publish_pages_of(self, requests: Sequence[Request]) -> None:
        """_publish_pages of each request in turn (a decode block's: about one lane in page_tokens
        completes a page each round)."""
        pt, seed = self.config.page_tokens, self._seed
        pages: list[int] = []                         # every page published, in order, and its key
        keys: list[bytes] = []
        for req in requests:
            complete = min(req.computed // pt, len(req.pages))
            first = req.published_pages
            if complete <= first:
                continue
            chain, hashed = req.chain_keys, req.admission_keys
            if complete == first + 1 and first >= len(hashed):    # a decode lane: one page
                key = next_key(chain[-1] if chain else seed, req.tokens[first * pt:complete * pt])
                chain.append(key)
                pages.append(req.pages[first])
                keys.append(key)
            else:
                tokens, held = req.tokens, req.pages
                key = chain[-1] if chain else seed
                for p in range(first, complete):
                    key = hashed[p] if p < len(hashed) else next_key(key, tokens[p * pt:(p + 1) * pt])
                    chain.append(key)
                    pages.append(held[p])
                    keys.append(key)
            req.published_pages = complete
        if pages:
            self.pool.publish_many(pages, keys)

    def _unpin_restore(self, row: int) -> None:
        self.snapshots.unpin_row(row)

    def _enqueue(self, req: Request) -> None:
        bisect.insort(self._waiting, ((-req.spec.priority, req.arrival), req), key=lambda e: e[0])

    def _preempt(self, req: Request) -> None:
        """Recompute preemption: pages released (published ones stay matchable)."""
        self._running.remove(req)
        self._free_slot(req)
        self.pool.release(req.pages)
        req.pages, req.published_pages, req.chain_keys, req.admission_keys = [], 0, [], []
        req.computed = 0
        req.device_pending = False
        req.state = RequestState.WAITING
        req.preemptions += 1
        self.counters.preemptions += 1
        self._enqueue(req)

    def _retire_cancelled(self) -> None:
        for req in [r for r in self._running if r.cancelled and r.inflight == 0]:
            self._finish(req, ep.FINISH_REASON_CANCELLED)
        for entry in [e for e in self._waiting if e[1].cancelled]:
            self._waiting.remove(entry)
            self._finish(entry[1], ep.FINISH_REASON_CANCELLED)

    def _finish_if_fenced(self, req: Request, reason: "ep.FinishReason.ValueType") -> None:
        req.finish = reason
        if req.inflight == 0:
            self._finish(req, reason)
        else:
            self._unsettled.add(req.serial)

    def _finish(self, req: Request, reason: "ep.FinishReason.ValueType") -> None:
        admitted_ns = self._admitted_ns.get(req.serial, 0)
        self._release(req)
        self.counters.finished[reason] = self.counters.finished.get(reason, 0) + 1
        event = ep.TerminalEvent()                # filled in place: a Finished built apart is copied in
        finished = event.finished
        finished.reason = reason
        usage = finished.usage
        usage.prompt_tokens, usage.completion_tokens = req.prompt_len, req.output_len
        usage.reused_prompt_tokens = max(req.reused_prompt_tokens, 0)
        if req.stop is not None:
            finished.stop.CopyFrom(req.stop)
        if req.spec.observe_timestamps:
            finished.performance.admitted_ns = admitted_ns - self.config.clock_origin_ns
            finished.performance.reused_prompt_tokens = max(req.reused_prompt_tokens, 0)
        self._events.append(Terminal(req.serial, event))

    def _release(self, req: Request) -> None:
        if req.state is RequestState.RUNNING:
            self._running.remove(req)
            self._free_slot(req)
        self.pool.release(req.pages)
        req.pages = []
        req.state = RequestState.FINISHED
        self._by_serial.pop(req.serial, None)
        self._stops.pop(req.serial, None)
        self._unsettled.discard(req.serial)
        self._admitted_ns.pop(req.serial, None)

    def _free_slot(self, req: Request) -> None:
        self._free_slots.append(req.slot)
        self._slot_owner[req.slot] = None
        req.slot = -1

