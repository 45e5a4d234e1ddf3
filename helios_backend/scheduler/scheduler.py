"""The scheduler: one token-budget loop over running and waiting requests.

Every round (vLLM v1 style) each request's `computed` catches up with len(tokens):
chunked prefill, prefix hits, readmission after preemption and decode are the same
loop; a lane whose chunk reaches len(tokens) samples. The round's lanes pick the
smallest prepared capacity variant that holds them (variants.py).

Order inside a round:
  1. retire cancelled requests that have no round in flight (their fence passed);
  2. running requests, oldest first: reserve pages for their chunk; on a shortage,
     evict snapshots, then preempt the newest lowest-priority running request
     (possibly the request itself), which goes back to the front of the queue;
  3. if nobody was preempted: admit waiting requests (priority, then arrival) while a
     slot, budget and pages are available: prefix match over complete pages, then a
     snapshot at an exact endpoint restored into a private page; a shortage waits.

Invariants (docs/scheduler.md): a page is written only by the one request whose page
table holds it privately; published pages are immutable; nothing is published before
its completion was validated; resources of a lane are released only after its last
submitted round completed (its fence).
"""
from __future__ import annotations

import bisect
import time
from collections.abc import Callable

from helios_proto import contract_pb2 as cp
from helios_proto import exchange_pb2 as ep

from helios_backend.scheduler.admission import check_admission, max_prompt_tokens
from helios_backend.scheduler.completion import CompletionRows
from helios_backend.scheduler.config import SchedulerConfig
from helios_backend.scheduler.events import Emitted, Event, SchedulerCounters, Terminal
from helios_backend.scheduler.host_stops import HostStopCheck
from helios_backend.scheduler.pages import PagePool
from helios_backend.scheduler.plan import PENDING_TOKEN, Lane, RestoreCopy, RoundPlan, Submission
from helios_backend.scheduler.prefix_hash import chain_keys, chain_seed, next_key
from helios_backend.scheduler.prefix_match import match_prefix
from helios_backend.scheduler.request import Grammar, Request, RequestSpec, RequestState
from helios_backend.scheduler.snapshots import SnapshotStore
from helios_backend.scheduler.variants import VariantTable

__all__ = ["Emitted", "Event", "Scheduler", "SchedulerConfig", "SchedulerCounters", "Terminal"]


StopFactory = Callable[[RequestSpec], HostStopCheck | None]


_PENDING = [PENDING_TOKEN]               # a decode lane's query: its device-owned pending token
# rounds the second frame may follow: their host-fed lanes sit the next round out
_PIPELINE_AFTER = frozenset({cp.OPERATION_DECODE, cp.OPERATION_MIXED, cp.OPERATION_PREFILL})


class Scheduler:
    def __init__(self, config: SchedulerConfig, variants: VariantTable,
                 stop_factory: StopFactory | None = None) -> None:
        self.config = config
        self.variants = variants
        self._shape: tuple[list[Lane], int, int, int] = ([], 0, 0, 0)   # _round_shape's running sums
        self._pipelining = False             # building a round behind one in flight (pipeline_next)
        self._admission_round = False        # the last round was prompts only (schedule)
        # prompt tokens a MIXED round takes beside its decode lanes, when it takes several
        # prompts (0: one at most, or no MIXED program): shorter prompts need no prompt rounds
        self._mixed_spare_tokens = 0 if variants.mixed_host_fed_rows() < 2 else max(
            v.tokens - v.rows for v in variants.variants(cp.OPERATION_MIXED))
        self._initialization_rows = variants.max_rows(cp.OPERATION_INITIALIZATION) \
            if variants.has(cp.OPERATION_INITIALIZATION) else max(variants.main_rows, 1)
        self.pool = PagePool(config.num_pages)
        snapshots_on = config.snapshot_capacity > 0 and variants.has(cp.OPERATION_RESTORATION)
        self.snapshots = SnapshotStore(config.snapshot_capacity if snapshots_on else 0, self.pool)
        self.counters = SchedulerCounters()
        self._stop_factory = stop_factory
        self._seed = chain_seed(config.cache_fingerprint)
        self._free_slots = list(range(config.request_slots - 1, -1, -1))
        self._slot_generation = [0] * config.request_slots
        self._waiting: list[tuple[tuple[int, int], Request]] = []    # sorted by (-priority, arrival)
        self._running: list[Request] = []                            # admission order
        self._by_serial: dict[int, Request] = {}
        self._stops: dict[int, HostStopCheck] = {}
        self._arrivals = 0
        self._admitted_ns: dict[int, int] = {}
        self._events: list[Event] = []
        self._eos = frozenset(config.eos_ids)
        self.max_active = min(config.max_active, config.request_slots, variants.main_rows)
        self._max_prompt = max_prompt_tokens(config)

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
        events, self._events = self._events, []
        return events

    # ---- admission -------------------------------------------------------------
    def add(self, serial: int, spec: RequestSpec, grammar: Grammar | None = None) -> Request:
        """Queue a request or raise AdmissionRejected / InvalidSpecError (others go on)."""
        spec = check_admission(self.config, spec, self._max_prompt, queued=self.queued)
        stop = self._stop_factory(spec) if (self._stop_factory and spec.stops.host_stops) else None
        req = Request(serial, spec, self._arrivals, grammar=grammar)
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

    # ---- the token-budget loop -----------------------------------------------------
    def schedule(self) -> RoundPlan | None:
        self._retire_cancelled()
        lanes: list[Lane] = []
        self._shape = (lanes, 0, 0, 0)
        if self._admission_round_due():
            # a round of prompts only: a MIXED round admits one request beside the decode lanes,
            # which falls behind arrivals at high concurrency; every other round at most
            prompts = self._prompt_round()
            if prompts is not None:
                return prompts
        self._admission_round = False
        preempted: list[Request] = []
        row_limit = self.max_active
        i = 0
        while i < len(self._running) and len(lanes) < row_limit:
            req = self._running[i]
            n = self._fit_chunk(lanes, req, req.remaining_tokens)
            if n == 0:
                break
            while not self._reserve_pages(req, req.computed + n):
                victim = self._running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.state is not RequestState.RUNNING:
                break
            lanes.append(self._lane(req, n))
            i += 1
        if not preempted:
            self._admit_waiting(lanes, row_limit)
        if not lanes:
            return None
        return self._plan(lanes, preempted)

    def _admission_round_due(self) -> bool:
        """Two or more requests wait, slots are free for them, the previous round was not one
        already, a PREFILL variant takes more than one of them, and no MIXED round takes the
        head of the queue whole beside the decode lanes (a MIXED program that takes several
        host-fed lanes admits a burst of short prompts without stopping the decoding ones)."""
        return (len(self._waiting) >= self.config.admission_burst and bool(self._running) and not self._admission_round
                and len(self._free_slots) >= 2 and len(self._running) + 2 <= self.max_active
                and self.variants.max_rows(cp.OPERATION_PREFILL) >= 2
                and len(self._waiting[0][1].tokens) > self._mixed_spare_tokens)

    def _fit_chunk(self, lanes: list[Lane], req: Request, want: int) -> int:
        """The largest chunk <= want that keeps the round inside some prepared variant."""
        if want <= 0:
            return 0
        rows, used, host_fed = self._round_shape(lanes)
        candidates = {want, 1}
        for v in self.variants.main_variants:
            if 0 < v.tokens - used < want:
                candidates.add(v.tokens - used)
        for n in sorted(candidates, reverse=True):
            if self._pipelining and host_fed and n < want:
                # a second prompt of a round behind the one in flight goes in whole: a part
                # would need its next chunk by completion feedback, stopping the second frame
                continue
            fed = host_fed + (0 if self._pending_ok(req, n) else 1)
            variant = self.variants.choose_shape(rows + 1, used + n, fed)
            if variant is not None and not (self._pipelining and variant.operation == cp.OPERATION_PREFILL):
                return n
        return 0

    def _round_shape(self, lanes: list[Lane]) -> tuple[int, int, int]:
        """(rows, tokens, host-fed lanes) of the round being built. A round's lane list only
        grows while it is built, so the sums extend from the last call: fitting N lanes is
        O(N), not O(N^2)."""
        known, counted, tokens, host_fed = self._shape
        if known is not lanes or counted > len(lanes):
            counted = tokens = host_fed = 0
        for lane in lanes[counted:]:
            q = lane.query_len
            tokens += q
            host_fed += 0 if self._pending_ok(lane.request, q) else 1
        self._shape = (lanes, len(lanes), tokens, host_fed)
        return len(lanes), tokens, host_fed

    def _pending_ok(self, req: Request, n: int) -> bool:
        """A one-token decode whose input is the slot's device-owned pending token."""
        return (self.config.device_pending_token and n == 1 and req.device_pending
                and req.computed == len(req.tokens) - 1)

    def _admit_waiting(self, lanes: list[Lane], row_limit: int) -> None:
        # every admitted lane is initialized before the round (one INITIALIZATION submission):
        # a MIXED round that takes several prompts stops at the widest initialization variant
        fresh = sum(1 for lane in lanes if lane.initialize)
        while self._waiting and len(lanes) < row_limit and self._free_slots \
                and len(self._running) < self.max_active and fresh < self._initialization_rows:
            _, req = self._waiting[0]
            if req.cancelled:
                self._waiting.pop(0)
                self._finish(req, ep.FINISH_REASON_CANCELLED)
                continue
            if not self._try_admit(req, lanes):
                return                          # a temporary shortage waits (head of line)
            self._waiting.pop(0)
            fresh += 1

    def _try_admit(self, req: Request, lanes: list[Lane]) -> bool:
        pt = self.config.page_tokens
        tokens = req.tokens
        match = match_prefix(self.pool, self.snapshots, self._seed, tokens, pt)
        snap = match.snapshot
        start = match.start(pt)
        n = self._fit_chunk(lanes, req, len(tokens) - start)
        if n == 0:
            return False
        if snap is not None:
            self.snapshots.pin(snap)            # not evictable while we look for pages
        need = -(-(start + n) // pt) - len(match.pages)
        hit = match.pages
        while need > self.pool.available_pages - sum(1 for p in hit if self.pool.refcount(p) == 0):
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
        self._slot_generation[slot] += 1
        req.slot, req.generation = slot, self._slot_generation[slot]
        req.state = RequestState.RUNNING
        req.fresh = True
        self._running.append(req)
        self.counters.lookup_tokens += len(tokens)
        self.counters.reused_tokens += start
        if req.reused_prompt_tokens < 0:           # the first admission: its wait ends here
            # the receipt stamp only: no clock read in the loop (OBS-16); metrics take "now"
            self.counters.first_admission_receipts_ns.append(self._admitted_ns.get(req.serial, 0))
            req.reused_prompt_tokens = min(start, req.prompt_len)
        else:
            self.counters.readmissions += 1
        lane = self._lane(req, n)
        lane.restore = restore
        lanes.append(lane)
        return True

    def _reserve_pages(self, req: Request, end: int) -> bool:
        """Pages covering positions [0, end); False on a shortage (nothing allocated)."""
        need = -(-end // self.config.page_tokens) - len(req.pages)
        if need <= 0:
            return True
        while need > self.pool.available_pages:
            if not self.snapshots.evict_for_pages():
                return False
        for _ in range(need):
            req.pages.append(self.pool.allocate())
        return True

    def _lane(self, req: Request, n: int) -> Lane:
        start = req.computed
        snapshot_row = -1
        end = start + n
        pt = self.config.page_tokens
        if (self.snapshots.capacity and req.preemptions == 0 and end == req.prompt_len
                and req.prompt_len % pt and start < end):
            complete = req.prompt_len // pt
            keys = chain_keys(self._seed, req.tokens, pt, complete)
            snap = self.snapshots.reserve(keys[-1] if keys else self._seed, req.pages[:complete],
                                          req.tokens[complete * pt:req.prompt_len], pt)
            if snap is not None:
                snapshot_row = snap.row
        return Lane(req, req.slot, req.generation, start, list(req.tokens[start:end]),
                    sample=end == len(req.tokens),
                    output_limit=req.spec.max_tokens - req.output_len,
                    snapshot_row=snapshot_row, initialize=req.fresh)

    def _plan(self, lanes: list[Lane], preempted: list[Request]) -> RoundPlan:
        variant = self.variants.choose([(lane.query_len, self._pending_ok(lane.request, lane.query_len))
                                        for lane in lanes])
        if variant is None:
            raise RuntimeError("lanes were fitted to a variant while the round was built")
        if variant.operation in (cp.OPERATION_DECODE, cp.OPERATION_MIXED):
            for lane in lanes:
                if self._pending_ok(lane.request, lane.query_len):
                    lane.tokens = [PENDING_TOKEN]
        plan = RoundPlan(Submission(variant, lanes), preempted=preempted)
        restores = [lane for lane in lanes if lane.restore is not None]
        if restores:
            v = self.variants.fit(cp.OPERATION_RESTORATION, len(restores), 0) \
                or self.variants.fit(cp.OPERATION_RESTORATION, len(restores), len(restores))
            if v is None:
                raise RuntimeError("no RESTORATION variant holds the round's restores")
            plan.restoration = Submission(v, restores)
        fresh = [lane for lane in lanes if lane.initialize]
        if fresh and self.variants.has(cp.OPERATION_INITIALIZATION):
            v = self.variants.fit(cp.OPERATION_INITIALIZATION, len(fresh), 0)
            if v is None:
                raise RuntimeError("no INITIALIZATION variant holds the round's new lanes")
            plan.initialization = Submission(v, fresh)
        for sub in plan.submissions():
            self.counters.launches[sub.operation] = self.counters.launches.get(sub.operation, 0) + 1
            for lane in sub.lanes:
                lane.request.inflight += 1
        return plan

    def pipeline_next(self, plan: RoundPlan) -> RoundPlan | None:
        """The next DECODE round, to occupy the second execution frame while `plan` runs;
        None unless every running request either continues from `plan`, sits it out with its
        completion observed, or is excluded for a reason that resolves at `plan`'s completion.

        Per request of `plan`'s main submission:
          * a lane that read its device-owned pending token continues (one more token), unless
            `plan` ends it by its output or context limit: then it has nothing to add and is
            left out; EOS at `plan` suppresses its next token (SPEC-50) and retires it;
          * a host-fed lane (a prompt chunk: PREFILL, or the MIXED round's new request) changes
            phase or needs its next chunk, so it waits for `plan`'s completion (SPEC-44, SPEC-49)
            and rejoins the round after;
        a running request outside `plan` whose last round completed rejoins with its pending
        token; one that needs host input (its next prompt chunk) stops the second frame, so
        `schedule()` runs with completion feedback and nobody waits forever. Grammar, withheld
        ids (min_tokens), host stops, restoration and cancellation fall back to completion
        feedback (SPEC-45..48). A waiting request may join as the round's one host-fed lane (a
        MIXED round, its initialization before it): its prompt needs nothing from `plan`.
        A burst of waiting requests gets a round of prompts only instead (_prompt_round), and
        a constrained request at the head of the queue waits for completion feedback (MET-8).
        """
        main = plan.main
        if plan.restoration or self._stops or main.operation not in _PIPELINE_AFTER:
            return None
        if self._waiting and self._waiting[0][1].spec.constrained:
            return None        # a constrained submission runs alone (MET-8): schedule() admits it
        if self._admission_round_due():
            # the round of prompts goes behind `plan`: its tokens are known on the host, the
            # stream orders its device work; a constrained prompt among them waits (MET-8)
            if any(req.spec.constrained for _, req in self._waiting[:self.variants.max_rows(cp.OPERATION_PREFILL)]):
                return None
            prompts = self._prompt_round()
            if prompts is not None:
                self.counters.pipelined += 1
            return prompts
        eos_ids, context = self.config.eos_ids, self.config.context_tokens
        pt = self.config.page_tokens
        # the next round's lanes, built once; pages are reserved only after all of them fit
        lanes: list[Lane] = []
        need = 0                                      # lanes whose next position opens a page
        in_main: set[int] = set()
        for lane in main.lanes:
            req = lane.request
            in_main.add(req.serial)
            if lane.tokens != _PENDING:
                continue                              # host-fed: rejoins after the completion
            spec = req.spec
            if (req.grammar is not None or req.cancelled or (spec.min_tokens and req.withholds(eos_ids))
                    or req.finish != ep.FINISH_REASON_UNSPECIFIED or req.inflight != 1):
                return None
            if len(req.tokens) - len(spec.prompt) + 1 >= spec.max_tokens or len(req.tokens) + 1 >= context:
                continue                              # `plan` emits its last token
            start = lane.start + 1
            need += -(-(start + 1) // pt) > len(req.pages)
            lanes.append(Lane(req, lane.slot, lane.generation, start, [PENDING_TOKEN], True, lane.output_limit - 1))
        for req in self._running:
            if req.serial in in_main:
                continue
            spec = req.spec
            if (req.inflight or not self._pending_ok(req, 1) or req.grammar is not None or req.cancelled
                    or (spec.min_tokens and req.withholds(eos_ids)) or req.finish != ep.FINISH_REASON_UNSPECIFIED):
                return None                           # it needs completion feedback: schedule() takes it
            start = req.computed
            need += -(-(start + 1) // pt) > len(req.pages)
            lanes.append(Lane(req, req.slot, req.generation, start, [PENDING_TOKEN], True,
                              spec.max_tokens - req.output_len))
        if not lanes:
            return None
        if need > self.pool.available_pages:
            return None
        if need:
            for lane in lanes:                        # a lane with its page already held reserves nothing
                if not self._reserve_pages(lane.request, lane.start + 1):
                    raise RuntimeError("page availability was checked before pipelining")
        if self._waiting and self.variants.has(cp.OPERATION_MIXED):
            decode_lanes = len(lanes)
            self._shape = (lanes, 0, 0, 0)
            self._pipelining = True          # no PREFILL fallback: these lanes' tokens are on the device
            try:
                self._admit_waiting(lanes, self.max_active)
            finally:
                self._pipelining = False
            if len(lanes) > decode_lanes:
                self.counters.pipelined += 1
                self._admission_round = False
                return self._plan(lanes, [])
        variant = self.variants.fit(cp.OPERATION_DECODE, len(lanes), len(lanes))
        if variant is None:
            return None
        nxt = RoundPlan(Submission(variant, lanes))
        self.counters.launches[variant.operation] = self.counters.launches.get(variant.operation, 0) + 1
        self.counters.pipelined += 1
        self._admission_round = False            # a decode round ran since the last round of prompts
        for lane in lanes:
            lane.request.inflight += 1
        return nxt

    def _prompt_round(self) -> RoundPlan | None:
        """A round of prompts only, as many rows as the widest PREFILL variant (step 1b of
        schedule(), or behind the round in flight from pipeline_next); None when none fits.
        The decoding requests sit it out and rejoin the round after it."""
        lanes: list[Lane] = []
        self._shape = (lanes, 0, 0, 0)
        self._admit_waiting(lanes, self.variants.max_rows(cp.OPERATION_PREFILL))
        if not lanes:
            return None
        self._admission_round = True
        return self._plan(lanes, [])

    # ---- completion ----------------------------------------------------------------
    def complete(self, plan: RoundPlan, rows: CompletionRows) -> None:
        """Apply a round whose main completion was validated (completion.py).
        Its token and terminal events are then read with take_events()."""
        for sub in (plan.restoration, plan.initialization):
            if sub is not None:
                for lane in sub.lanes:
                    lane.request.inflight -= 1
        main = plan.main
        constrained = sum(1 for lane in main.lanes if lane.request.spec.constrained)
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
        # once per lane per round: the row values as Python objects in one call each, and the
        # page publication only when the lane completed a page
        tokens = rows.tokens.tolist()
        logprobs = rows.logprobs.tolist() if rows.logprobs is not None else None
        top_ids, top_logprobs = rows.top_ids, rows.top_logprobs
        pt = self.config.page_tokens
        events = self._events
        generated = 0
        stamp = None
        for i, lane in enumerate(main.lanes):
            req = lane.request
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
            req.tokens.append(token)
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
            events.append(Emitted(
                req.serial, token, ts, logprobs[i] if logprobs is not None else 0.0,
                top_ids[i, :k] if k and top_ids is not None else None,
                top_logprobs[i, :k] if k and top_logprobs is not None else None))
            if req.grammar is not None:
                # a violating token leaves the matcher in error: its masks then allow only EOS
                req.grammar.consume(token)
            reason = self._finish_reason(req, token)
            if reason != ep.FINISH_REASON_UNSPECIFIED:
                self._finish_if_fenced(req, reason)
        self.counters.generated_tokens += generated

    def fail(self, plan: RoundPlan, message: str) -> None:
        """The round failed (execution or validation): its lanes end with a typed failure;
        nothing of the round is published (CACHE-25); other requests go on."""
        seen: set[int] = set()
        for sub in plan.submissions():
            for lane in sub.lanes:
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
        tokens = len(req.tokens)
        if tokens - len(req.spec.prompt) >= req.spec.max_tokens or tokens >= self.config.context_tokens:
            return ep.FINISH_REASON_LENGTH        # (output_len inline: once per lane per round)
        return ep.FINISH_REASON_UNSPECIFIED

    def _publish_pages(self, req: Request) -> None:
        """Publish complete pages whose every position was consumed (validated)."""
        pt = self.config.page_tokens
        complete = min(req.computed // pt, len(req.pages))
        key = req.chain_keys[-1] if req.chain_keys else self._seed
        for p in range(req.published_pages, complete):
            key = next_key(key, req.tokens[p * pt:(p + 1) * pt])
            self.pool.publish(req.pages[p], key)
            req.chain_keys.append(key)
        req.published_pages = max(req.published_pages, complete)

    def _unpin_restore(self, row: int) -> None:
        self.snapshots.unpin_row(row)

    def _enqueue(self, req: Request) -> None:
        bisect.insort(self._waiting, ((-req.spec.priority, req.arrival), req), key=lambda e: e[0])

    def _preempt(self, req: Request) -> None:
        """Recompute preemption: pages released (published ones stay matchable)."""
        self._running.remove(req)
        self._free_slot(req)
        self.pool.release(req.pages)
        req.pages, req.published_pages, req.chain_keys = [], 0, []
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

    def _finish(self, req: Request, reason: "ep.FinishReason.ValueType") -> None:
        admitted_ns = self._admitted_ns.get(req.serial, 0)
        self._release(req)
        self.counters.finished[reason] = self.counters.finished.get(reason, 0) + 1
        finished = ep.Finished(reason=reason, usage=ep.Usage(
            prompt_tokens=req.prompt_len, completion_tokens=req.output_len,
            reused_prompt_tokens=max(req.reused_prompt_tokens, 0)))
        if req.stop is not None:
            finished.stop.CopyFrom(req.stop)
        if req.spec.observe_timestamps:
            finished.performance.admitted_ns = admitted_ns - self.config.clock_origin_ns
            finished.performance.reused_prompt_tokens = max(req.reused_prompt_tokens, 0)
        self._events.append(Terminal(req.serial, ep.TerminalEvent(finished=finished)))

    def _release(self, req: Request) -> None:
        if req.state is RequestState.RUNNING:
            self._running.remove(req)
            self._free_slot(req)
        self.pool.release(req.pages)
        req.pages = []
        req.state = RequestState.FINISHED
        self._by_serial.pop(req.serial, None)
        self._stops.pop(req.serial, None)
        self._admitted_ns.pop(req.serial, None)

    def _free_slot(self, req: Request) -> None:
        self._free_slots.append(req.slot)
        req.slot = -1

