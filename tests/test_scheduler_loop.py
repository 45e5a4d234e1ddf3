"""The token-budget loop driven by a simulated executor: exact outputs, pages, order."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pytest

from helios_proto import contract_pb2 as cp
from helios_proto import exchange_pb2 as ep

from helios_backend.scheduler.errors import AdmissionRejected, InvalidSpecError
from helios_backend.scheduler.host_stops import HostStopCheck
from helios_backend.scheduler.prefix_hash import chain_keys
from helios_backend.scheduler.request import RequestSpec, SamplingSettings, StopSettings
from helios_backend.scheduler.scheduler import Emitted, Scheduler, SchedulerConfig, Terminal
from helios_backend.scheduler.variants import VariantTable
from tests.scheduler_sim import SimulatedEngine, reference_tokens, variants

VOCAB = 1000


def make(num_pages: int = 64, page_tokens: int = 4, slots: int = 8, snapshots: int = 0,
         context: int = 256, queue: int = 64, eos: tuple[int, ...] = (), burst: int = 2,
         **variant_kw: object) -> tuple[Scheduler, SimulatedEngine]:
    # burst: a few waiting requests make a round of prompts at these small loads
    cfg = SchedulerConfig(page_tokens=page_tokens, num_pages=num_pages, request_slots=slots,
                          max_active=slots, queue_capacity=queue, context_tokens=context,
                          max_pages_per_row=context // page_tokens, vocab_size=VOCAB,
                          input_vocab_size=VOCAB, eos_ids=eos, snapshot_capacity=snapshots,
                          admission_burst=burst)
    table = VariantTable(variants(**variant_kw))  # type: ignore[arg-type]
    sched = Scheduler(cfg, table, stop_factory=lambda spec: HostStopCheck(spec.stops, None))
    return sched, SimulatedEngine(sched)


def spec(prompt: list[int], max_tokens: int = 8, **kw: object) -> RequestSpec:
    return RequestSpec(tuple(prompt), max_tokens, SamplingSettings(), **kw)  # type: ignore[arg-type]


def run_all(sched: Scheduler, engine: SimulatedEngine, limit: int = 10_000) -> dict[int, list[object]]:
    events: dict[int, list[object]] = {}
    for _ in range(limit):
        busy = engine.step()
        for ev in sched.take_events():
            events.setdefault(ev.serial, []).append(ev)
        if not busy and not sched.has_work():
            return events
    raise AssertionError("scheduler did not go idle")


def tokens_of(evs: list[object]) -> list[int]:
    return [e.token for e in evs if isinstance(e, Emitted)]


def terminal(evs: list[object]) -> ep.TerminalEvent:
    ts = [e for e in evs if isinstance(e, Terminal)]
    assert len(ts) == 1, "exactly one terminal event per request"
    return ts[0].event


def prompt_of(i: int, n: int = 10) -> list[int]:
    return [(i * 37 + j * 11) % VOCAB for j in range(n)]


def test_concurrent_requests_match_one_at_a_time() -> None:
    sched, engine = make()
    for i in range(12):
        sched.add(i, spec(prompt_of(i, 5 + i), max_tokens=6))
    events = run_all(sched, engine)
    for i in range(12):
        assert tokens_of(events[i]) == reference_tokens(prompt_of(i, 5 + i), 6, VOCAB)
        fin = terminal(events[i]).finished
        assert fin.reason == ep.FINISH_REASON_LENGTH
        assert (fin.usage.prompt_tokens, fin.usage.completion_tokens) == (5 + i, 6)
    assert engine.writes_to_shared == []
    assert sched.pool.used_pages == 0 and sched.running == 0


def test_chunked_prefill_respects_the_largest_variant() -> None:
    sched, engine = make(context=512, num_pages=128)
    prompt = prompt_of(3, 150)                      # > 64 tokens: three chunks
    sched.add(0, spec(prompt, max_tokens=3))
    events = run_all(sched, engine)
    assert tokens_of(events[0]) == reference_tokens(prompt, 3, VOCAB)
    assert engine.launched[:3] == ["prefill_b1_t64", "prefill_b1_t64", "prefill_b1_t64"]
    assert engine.launched[3:] == ["decode_b1", "decode_b1"]


def test_prefill_chunk_tokens_limits_every_prompt_chunk() -> None:
    # the lockstep generator's prefill_chunk: chunks of at most 10 tokens, the same tokens
    sched, _ = make(context=512, num_pages=128)
    limited = Scheduler(dataclasses.replace(sched.config, prefill_chunk_tokens=10), sched.variants)
    engine = SimulatedEngine(limited)
    prompt = prompt_of(3, 25)
    limited.add(0, spec(prompt, max_tokens=3))
    chunks = []
    while limited.has_work():
        plan = limited.schedule()
        assert plan is not None
        chunks.append(len(plan.main.lanes[0].tokens))
        limited.complete(plan, engine.run(plan))
    assert chunks == [10, 10, 5, 1, 1]
    assert tokens_of(limited.take_events()) == reference_tokens(prompt, 3, VOCAB)


def test_mixed_round_decodes_while_a_prompt_is_prefilled() -> None:
    sched, engine = make()
    sched.add(0, spec(prompt_of(0, 4), max_tokens=4))
    engine.step()                                   # request 0 prefilled, sampled once
    sched.add(1, spec(prompt_of(1, 30), max_tokens=2))
    engine.step()
    assert engine.launched[-1] == "mixed_b2_t64"    # one decode lane + one prefill chunk
    events = run_all(sched, engine)
    assert tokens_of(events[1]) == reference_tokens(prompt_of(1, 30), 2, VOCAB)


def test_without_mixed_programs_decode_lanes_ride_in_prefill() -> None:
    sched, engine = make(mixed=False)
    sched.add(0, spec(prompt_of(0, 4), max_tokens=4))
    engine.step()
    sched.add(1, spec(prompt_of(1, 30), max_tokens=2))
    engine.step()
    assert engine.launched[-1] == "prefill_b2_t64"
    events = run_all(sched, engine)
    assert tokens_of(events[0]) == reference_tokens(prompt_of(0, 4), 4, VOCAB)


def test_shared_prefix_reuses_exact_pages() -> None:  # spec: CACHE-9, CACHE-20
    sched, engine = make(page_tokens=4)
    shared = prompt_of(7, 12)                       # three complete pages
    sched.add(0, spec(shared + [1, 2], max_tokens=2))
    run_all(sched, engine)
    # 14 prompt + 2 sampled = 16 tokens, 15 consumed: pages 0-2 complete and published,
    # page 3 partial (private, freed); released tail first
    assert sched.pool.lru_order() == [2, 1, 0]
    sched.add(1, spec(shared + [5, 6, 7], max_tokens=2))
    req = sched.request(1)
    plan = sched.schedule()
    assert plan is not None and req is not None
    assert req.pages[:3] == [0, 1, 2]               # the three shared pages, by id
    assert plan.main.lanes[0].start == 12           # computation starts after the hit
    rows = engine.run(plan)
    sched.complete(plan, rows)
    events = run_all(sched, engine)
    assert tokens_of(events[1]) == reference_tokens(shared + [5, 6, 7], 2, VOCAB)
    assert terminal(events[1]).finished.usage.reused_prompt_tokens == 12
    assert sched.counters.reused_tokens == 12


def test_full_prompt_hit_still_computes_the_last_token() -> None:
    sched, engine = make(page_tokens=4)
    prompt = prompt_of(2, 8)
    sched.add(0, spec(prompt, max_tokens=1))
    run_all(sched, engine)
    sched.add(1, spec(prompt, max_tokens=3))
    events = run_all(sched, engine)
    assert terminal(events[1]).finished.usage.reused_prompt_tokens == 4
    assert tokens_of(events[1]) == reference_tokens(prompt, 3, VOCAB)


def test_page_shortage_preempts_newest_and_everything_completes() -> None:  # spec: HTTP-20, CACHE-24
    sched, engine = make(num_pages=10, page_tokens=4, slots=4)
    prompts = [prompt_of(i, 6) for i in range(4)]
    for i, p in enumerate(prompts):
        sched.add(i, spec(p, max_tokens=12))         # 18 tokens = 5 pages each; 20 needed, 10 exist
    events = run_all(sched, engine)
    assert sched.counters.preemptions > 0
    for i, p in enumerate(prompts):
        assert tokens_of(events[i]) == reference_tokens(p, 12, VOCAB)
        assert terminal(events[i]).finished.reason == ep.FINISH_REASON_LENGTH
    assert engine.writes_to_shared == []
    assert sched.pool.used_pages == 0


def test_published_keys_are_the_hash_chain_of_the_tokens_published() -> None:  # spec: CACHE-20
    """Publication takes the keys the prefix lookup hashed at admission: every published page's
    key must still be the chain over the request's own tokens, through shared prefixes, output
    pages, preemption and readmission (a key kept across a preemption or from another request's
    tokens would differ)."""
    sched, engine = make(num_pages=12, page_tokens=4, slots=4)
    shared = prompt_of(90, 9)
    prompts = [shared + prompt_of(i, 3 + i) for i in range(4)] + [prompt_of(7, 10)]
    for i, p in enumerate(prompts):
        sched.add(i, spec(p, max_tokens=10))
    seen = 0
    for _ in range(10_000):
        busy = engine.step()
        for req in sched._running:                  # every page it published, key by key
            keys = chain_keys(sched._seed, req.tokens, 4, req.published_pages)
            assert req.chain_keys == keys
            seen += len(keys)
        sched.take_events()
        if not busy and not sched.has_work():
            break
    assert sched.counters.preemptions > 0 and seen > 0
    assert sched.pool.counters.hit_pages > 0          # the shared prefix was matched


def test_preemption_takes_the_newest_lowest_priority_request() -> None:
    sched, engine = make(num_pages=6, page_tokens=4, slots=3)
    sched.add(0, spec(prompt_of(0, 7), max_tokens=8))
    sched.add(1, spec(prompt_of(1, 7), max_tokens=8))
    # both prefilled together (2 pages each); the 3rd page of each fills the pool; the
    # 4th page (position 12) of request 0 takes request 1's pages
    steps = 0
    while sched.counters.preemptions == 0 and steps < 20:
        engine.step()
        steps += 1
    assert steps == 7 and sched.counters.preemptions == 1
    assert sched.request(1).state.value == "waiting" and sched.request(0).state.value == "running"


def test_cancel_frees_pages_and_ends_with_cancelled() -> None:  # spec: CACHE-23, HTTP-6
    sched, engine = make()
    sched.add(0, spec(prompt_of(0, 9), max_tokens=50))
    sched.add(1, spec(prompt_of(1, 9), max_tokens=5))
    for _ in range(3):
        engine.step()
    assert sched.pool.used_pages > 0
    sched.cancel(0)
    events = run_all(sched, engine)
    assert terminal(events[0]).finished.reason == ep.FINISH_REASON_CANCELLED
    assert tokens_of(events[1]) == reference_tokens(prompt_of(1, 9), 5, VOCAB)
    assert sched.pool.used_pages == 0 and sched.running == 0


def test_prompt_beyond_capacity_is_rejected_and_others_go_on() -> None:  # spec: OWN-21, HTTP-21
    sched, engine = make(context=32)
    sched.add(0, spec(prompt_of(0, 5), max_tokens=4))
    with pytest.raises(AdmissionRejected) as info:
        sched.add(1, spec(prompt_of(1, 40)))
    assert info.value.reason == ep.REJECTION_REASON_PROMPT_BEYOND_CAPACITY
    assert info.value.limit == 31 and info.value.requested == 40
    events = run_all(sched, engine)
    assert tokens_of(events[0]) == reference_tokens(prompt_of(0, 5), 4, VOCAB)


def test_logprobs_need_recorded_logprobs() -> None:  # spec: OWN-21
    sched, _ = make()
    with pytest.raises(AdmissionRejected) as info:
        sched.add(0, spec([1, 2], logprobs=True))
    assert info.value.reason == ep.REJECTION_REASON_UNSUPPORTED_FEATURE
    with pytest.raises(AdmissionRejected):
        sched.add(1, spec([1, 2], top_logprobs=2))


def test_output_limit_is_clipped_to_the_context() -> None:
    sched, engine = make(context=16)
    sched.add(0, spec(prompt_of(0, 12), max_tokens=100))
    events = run_all(sched, engine)
    assert len(tokens_of(events[0])) == 4
    assert terminal(events[0]).finished.reason == ep.FINISH_REASON_LENGTH


def test_queue_capacity_and_invalid_ids() -> None:  # spec: HTTP-5
    sched, _ = make(queue=1, slots=2)
    for serial in range(3):             # two for the free active places, one queued
        sched.add(serial, spec([1, 2]))
    with pytest.raises(AdmissionRejected) as info:
        sched.add(3, spec([1, 2]))
    assert info.value.reason == ep.REJECTION_REASON_QUEUE_FULL
    sched.cancel(0)                     # HTTP released its permit: its place is free again
    sched.add(3, spec([1, 2]))
    with pytest.raises(AdmissionRejected):
        sched.add(4, spec([1, 2]))
    with pytest.raises(InvalidSpecError):
        make()[0].add(2, spec([VOCAB + 5]))


def test_token_stop_ends_the_request_with_its_match() -> None:  # spec: STOP-19, STOP-31
    prompt = prompt_of(4, 6)
    ref = reference_tokens(prompt, 10, VOCAB)
    sched, engine = make()
    sched.add(0, spec(prompt, max_tokens=10, stops=StopSettings(token_ids=(ref[3],))))
    assert sched.host_stop_barrier
    events = run_all(sched, engine)
    fin = terminal(events[0]).finished
    assert tokens_of(events[0]) == ref[:4]             # the crossing token is observed and counted
    assert fin.reason == ep.FINISH_REASON_STOP_TOKEN and fin.usage.completion_tokens == 4
    assert (fin.stop.kind, fin.stop.index, fin.stop.presented_tokens) == (ep.STOP_KIND_TOKEN_ID, 0, 3)
    assert not sched.host_stop_barrier


def test_token_sequence_stop() -> None:
    prompt = prompt_of(5, 6)
    ref = reference_tokens(prompt, 10, VOCAB)
    sched, engine = make()
    sched.add(0, spec(prompt, max_tokens=10,
                      stops=StopSettings(token_sequences=((1, 2), (ref[2], ref[3])))))
    events = run_all(sched, engine)
    fin = terminal(events[0]).finished
    assert (fin.stop.kind, fin.stop.index, fin.stop.presented_tokens) == (ep.STOP_KIND_TOKEN_SEQUENCE, 1, 2)


def test_bad_completion_fails_its_lanes_only() -> None:  # spec: CACHE-13, CACHE-14, CACHE-15, CACHE-25
    for field, value in (("token", VOCAB + 3), ("reserved_model", 0), ("generation", 99),
                         ("consumed", 1), ("emitted", 0), ("accepted", 2), ("draft_cursor", 5)):
        sched, engine = make()
        sched.add(0, spec(prompt_of(0, 5), max_tokens=4))
        engine.step()
        sched.add(1, spec(prompt_of(1, 5), max_tokens=4))
        engine.corrupt = {field: value}
        published = sched.pool.counters.published
        engine.step()                                  # request 0 decode + request 1 prefill fail
        assert sched.pool.counters.published == published, field   # nothing of it published
        sched.add(2, spec(prompt_of(2, 5), max_tokens=4))
        events = run_all(sched, engine)
        assert terminal(events[0]).WhichOneof("outcome") == "failed", field
        assert terminal(events[1]).WhichOneof("outcome") == "failed", field
        assert tokens_of(events[2]) == reference_tokens(prompt_of(2, 5), 4, VOCAB)
        assert sched.pool.used_pages == 0


def test_snapshot_restores_a_partial_page_at_the_exact_endpoint() -> None:  # spec: CACHE-19, CACHE-21, CACHE-22
    sched, engine = make(page_tokens=4, snapshots=2)
    turn1 = prompt_of(9, 10)                          # 2 complete pages + 2 partial tokens
    sched.add(0, spec(turn1, max_tokens=3))
    events = run_all(sched, engine)
    assert sched.snapshots.published == 1
    # the next turn continues turn 1's prompt but not its reply (e.g. a template that
    # drops old reasoning): pages 0-1 match, the partial page comes from the snapshot
    turn2 = turn1 + [11, 12, 13]
    sched.add(1, spec(turn2, max_tokens=3))
    plan = sched.schedule()
    assert plan is not None and plan.restoration is not None
    lane = plan.main.lanes[0]
    assert lane.start == 10                           # pages 0-1 shared + 2 restored tokens
    assert lane.restore is not None and lane.restore.tokens == 2
    assert lane.request.pages[2] == lane.restore.page and not sched.pool.is_published(lane.restore.page)
    sched.complete(plan, engine.run(plan))
    events = run_all(sched, engine)
    assert [e for e in engine.launched if e.startswith("restore")] == ["restore_b1"]
    assert tokens_of(events[1]) == reference_tokens(turn2, 3, VOCAB)
    assert terminal(events[1]).finished.usage.reused_prompt_tokens == 10
    assert engine.writes_to_shared == []


def test_snapshots_need_a_restoration_program() -> None:
    sched, engine = make(page_tokens=4, snapshots=2, restoration=False)
    sched.add(0, spec(prompt_of(9, 10), max_tokens=2))
    run_all(sched, engine)
    assert sched.snapshots.capacity == 0 and sched.snapshots.published == 0


def test_initialization_program_runs_for_fresh_lanes() -> None:
    sched, engine = make(initialization=True)
    sched.add(0, spec(prompt_of(0, 5), max_tokens=3))
    run_all(sched, engine)
    assert engine.launched[:2] == ["init_b1", "prefill_b1_t16"]
    assert "init_b1" not in engine.launched[2:]


def test_priority_orders_admission() -> None:
    sched, engine = make(slots=1)
    sched.add(0, spec(prompt_of(0, 5), max_tokens=1))
    sched.add(1, spec(prompt_of(1, 5), max_tokens=1, priority=5))
    plan = sched.schedule()
    assert plan is not None and plan.main.lanes[0].request.serial == 1


def test_constrained_mix_is_counted_on_decode_steps() -> None:  # spec: MET-6, MET-7
    sched, engine = make()
    sched.add(0, spec(prompt_of(0, 5), max_tokens=4, constrained=True))
    sched.add(1, spec(prompt_of(1, 5), max_tokens=4))
    run_all(sched, engine)
    assert sched.counters.mixed_grammar_decode_steps == 3   # 3 decode rounds after the prefill
    assert sched.counters.launches[cp.OPERATION_DECODE] == 3


def run_two_frames(sched: Scheduler, engine: SimulatedEngine,
                   on_terminal: "Callable[[], None] | None" = None,
                   followed: "list[int] | None" = None,
                   at_round: "Callable[[int], None] | None" = None,
                   behind: "list[tuple[int, int, int]] | None" = None) -> dict[int, list[object]]:
    """The worker's two-frame loop, inline: round N+1 is submitted before N completes.
    `on_terminal` runs after each terminal event (a closed-loop client's next request);
    `followed` collects the operation of every round the second frame followed; `at_round`
    runs before each pass with its number (arrivals while rounds are in flight); `behind`
    collects (operation followed, operation behind it, its lanes) of every second frame."""
    events: dict[int, list[object]] = {}
    inflight: list = []
    for step in range(20_000):
        if at_round is not None:
            at_round(step)
        if not inflight:
            plan = sched.schedule()
            if plan is None:
                break
            engine.launch(plan, 0)
            inflight.append(plan)
        if len(inflight) == 1:
            nxt = sched.pipeline_next(inflight[0])
            if nxt is not None:
                if followed is not None:
                    followed.append(inflight[0].main.operation)
                if behind is not None:
                    behind.append((inflight[0].main.operation, nxt.main.operation, len(nxt.main.lanes)))
                engine.launch(nxt, 1)
                inflight.append(nxt)
        plan = inflight.pop(0)
        sched.complete(plan, engine.collect(plan))
        for ev in sched.take_events():
            events.setdefault(ev.serial, []).append(ev)
            if on_terminal is not None and isinstance(ev, Terminal):
                on_terminal()
    assert not sched.has_work()
    return events


def test_two_frames_decode_matches_feedback_and_respects_limits() -> None:  # spec: SPEC-43, CACHE-23
    prompts = [prompt_of(i, 6) for i in range(3)]
    sched, engine = make()
    for i, p in enumerate(prompts):
        sched.add(i, spec(p, max_tokens=9 + i))
    events = run_two_frames(sched, engine)
    assert sched.counters.pipelined > 0
    for i, p in enumerate(prompts):
        assert tokens_of(events[i]) == reference_tokens(p, 9 + i, VOCAB)   # never past max_tokens
    assert sched.pool.used_pages == 0 and engine.writes_to_shared == []


def test_two_frames_discard_the_token_after_eos() -> None:  # spec: SPEC-50, FE-42
    prompt = prompt_of(3, 6)
    ref = reference_tokens(prompt, 12, VOCAB)
    sched, engine = make(eos=(ref[5],))
    sched.add(0, spec(prompt, max_tokens=12))
    events = run_two_frames(sched, engine)
    assert tokens_of(events[0]) == ref[:ref.index(ref[5]) + 1]          # the pipelined extra is suppressed
    assert terminal(events[0]).finished.reason == ep.FINISH_REASON_EOS
    assert sched.counters.pipelined > 0 and sched.pool.used_pages == 0


class AllowAll:
    """A grammar that allows every token: the outputs equal the unconstrained reference."""
    def fill_mask(self, out_words: np.ndarray) -> None:
        out_words[:] = -1

    def consume(self, token: int) -> bool:
        return True


def test_no_second_frame_with_host_stops_or_grammar() -> None:  # spec: STOP-17, SPEC-45, SPEC-46
    prompt = prompt_of(4, 6)
    sched, engine = make()
    sched.add(0, spec(prompt, max_tokens=8, stops=StopSettings(token_ids=(VOCAB - 1,))))
    run_two_frames(sched, engine)
    assert sched.counters.pipelined == 0

    sched, engine = make()
    sched.add(0, spec(prompt, max_tokens=8, constrained=True), grammar=AllowAll())
    run_two_frames(sched, engine)
    assert sched.counters.pipelined == 0 and sched.counters.constrained_max_inflight == 1


def _burst_behind_decoding(burst: int, seed: int, arrivals: int, long_limit: int,
                           short_limit: int, mixed_host_fed: int = -1,
                           prompt_tokens: int = 6, **variant_kw: object) -> list[tuple[int, int, int]]:
    """Two requests decode on two frames; `arrivals` more arrive together at the fifth pass.
    Every output must equal completion feedback's; returns the second frames (`behind`)."""
    sched, engine = make(slots=8, initialization=True, burst=burst, mixed_host_fed=mixed_host_fed, **variant_kw)
    prompts = {i: prompt_of(seed + i, prompt_tokens + i % 3) for i in range(2 + arrivals)}
    limits = {i: long_limit if i < 2 else short_limit for i in prompts}
    for i in range(2):
        sched.add(i, spec(prompts[i], max_tokens=limits[i]))

    def arrive(step: int) -> None:
        if step == 4:
            for i in range(2, 2 + arrivals):
                sched.add(i, spec(prompts[i], max_tokens=limits[i]))

    behind: list[tuple[int, int, int]] = []
    events = run_two_frames(sched, engine, at_round=arrive, behind=behind)
    for i, p in prompts.items():
        assert tokens_of(events[i]) == reference_tokens(p, limits[i], VOCAB)
    assert sched.pool.used_pages == 0 and engine.writes_to_shared == []
    return behind


def test_a_burst_behind_a_decode_round_is_a_prompt_round_on_the_second_frame() -> None:  # spec: SPEC-43, SPEC-44, HTTP-20
    # four requests arrive while two decode with the second frame: their round of prompts
    # goes behind the decode round in flight (its prompts need nothing from it) instead of
    # waiting for that round's completion
    behind = _burst_behind_decoding(burst=2, seed=60, arrivals=4, long_limit=20, short_limit=7)
    assert any(after == cp.OPERATION_DECODE and op == cp.OPERATION_PREFILL and lanes >= 2
               for after, op, lanes in behind)


def test_arrivals_below_the_admission_burst_are_admitted_one_a_round_beside_the_decode_lanes() -> None:  # spec: SPEC-43, HTTP-20
    # three requests arrive while two decode; with a burst of four they never make a round of
    # prompts only: MIXED rounds admit one each and the decoding requests advance every round
    below = _burst_behind_decoding(burst=4, seed=90, arrivals=3, long_limit=16, short_limit=5)
    assert cp.OPERATION_PREFILL not in {op for _, op, _ in below}
    assert sum(op == cp.OPERATION_MIXED for _, op, _ in below) >= 3
    at = _burst_behind_decoding(burst=3, seed=90, arrivals=3, long_limit=16, short_limit=5)
    assert cp.OPERATION_PREFILL in {op for _, op, _ in at}
    with pytest.raises(ValueError, match="admission_burst"):
        make(burst=1)


def test_a_mixed_program_of_several_prefill_rows_admits_a_burst_beside_the_decode_lanes() -> None:  # spec: SPEC-43, SPEC-44, HTTP-20
    # a MIXED program that takes several host-fed lanes (no mixed prefill row bound) admits a
    # burst of short prompts in rounds behind the decode round in flight: no round of prompts
    # only, the decoding requests advance every round, every output equals feedback's
    behind = _burst_behind_decoding(burst=2, seed=60, arrivals=5, long_limit=20, short_limit=7, mixed_host_fed=8)
    assert cp.OPERATION_PREFILL not in {op for _, op, _ in behind}
    assert any(op == cp.OPERATION_MIXED and lanes >= 4 for _, op, lanes in behind)   # 2 decoding + several prompts
    # prompts longer than any MIXED round's spare tokens still get rounds of prompts only
    long = _burst_behind_decoding(burst=2, seed=60, arrivals=4, long_limit=20, short_limit=7, mixed_host_fed=8,
                                  prompt_tokens=70)
    assert cp.OPERATION_PREFILL in {op for _, op, _ in long}


def test_a_mixed_round_admits_no_more_prompts_than_an_initialization_variant_holds() -> None:  # spec: SPEC-43, HTTP-20
    # tiny prompts: a MIXED round's spare tokens would take six of them, but each admitted lane
    # is initialized before the round by one INITIALIZATION submission of at most two rows
    sched, engine = make(slots=8, initialization=True, mixed_host_fed=8, initialization_rows=(1, 2))
    prompts = {i: prompt_of(70 + i, 2) for i in range(8)}
    for i in range(2):
        sched.add(i, spec(prompts[i], max_tokens=12))
    engine.step()
    for i in range(2, 8):
        sched.add(i, spec(prompts[i], max_tokens=6))
    events = run_all(sched, engine)
    for i, prompt in prompts.items():
        assert tokens_of(events[i]) == reference_tokens(prompt, 12 if i < 2 else 6, VOCAB)
    inits = [p for p in engine.launched if p.startswith("init_b")]
    assert "init_b2" in inits and set(inits) <= {"init_b1", "init_b2"}
    assert any(p.startswith("mixed_") for p in engine.launched)


def test_a_second_prompt_behind_a_round_in_flight_is_never_split() -> None:  # spec: SPEC-44, SPEC-49
    # the round behind the one in flight takes its first prompt in part if need be, any other
    # whole: a part would need its next chunk by completion feedback and stop the second frame
    sched, engine = make(slots=8, initialization=True, mixed_host_fed=8, tokens=(16,))
    sched.add(0, spec(prompt_of(1, 6), max_tokens=30))
    plan = sched.schedule()
    engine.launch(plan, 0)
    sched.complete(plan, engine.collect(plan))
    sched.take_events()
    plan = sched.schedule()                                      # decode round in flight
    assert plan.main.operation == cp.OPERATION_DECODE
    engine.launch(plan, 0)
    for i in range(1, 4):
        sched.add(i, spec(prompt_of(i + 1, 6), max_tokens=4))      # 6 + 6 + 6 tokens: 15 fit beside the decode lane
    nxt = sched.pipeline_next(plan)
    assert nxt is not None and nxt.main.operation == cp.OPERATION_MIXED
    host_fed = [lane for lane in nxt.main.lanes if lane.tokens != [-1]]
    assert [len(lane.tokens) for lane in host_fed] == [6, 6]         # two whole prompts, the third waits
    assert sched.waiting == 1


def test_a_constrained_arrival_waits_for_feedback_behind_a_second_frame() -> None:  # spec: MET-8, SPEC-46
    # a constrained request arrives while plain requests decode on two frames: it is admitted
    # by completion feedback (one frame in flight), never as a lane behind a round in flight,
    # alone or in a burst
    for burst in (1, 3):
        sched, engine = make(slots=8, initialization=True)
        prompts = {i: prompt_of(80 + i, 6) for i in range(1 + burst)}
        sched.add(0, spec(prompts[0], max_tokens=24))

        def arrive(step: int) -> None:
            if step == 5:
                for i in range(1, 1 + burst):
                    sched.add(i, spec(prompts[i], max_tokens=6, constrained=True), grammar=AllowAll())

        events = run_two_frames(sched, engine, at_round=arrive)
        for i, p in prompts.items():
            assert tokens_of(events[i]) == reference_tokens(p, 24 if i == 0 else 6, VOCAB)
        assert sched.counters.pipelined > 0 and sched.counters.constrained_max_inflight == 1


def test_admission_waits_instead_of_evicting_the_snapshot_it_matched() -> None:  # spec: HTTP-20, CACHE-22
    sched, engine = make(num_pages=9, page_tokens=4, snapshots=1)
    turn1 = prompt_of(6, 10)
    sched.add(0, spec(turn1, max_tokens=1))
    run_all(sched, engine)
    assert sched.snapshots.published == 1 and sched.pool.used_pages == 2    # the snapshot's pages
    sched.add(1, spec(prompt_of(7, 20), max_tokens=7))
    engine.step()
    engine.step()                                       # request 1 holds 6 pages: 1 free
    turn2 = turn1 + [3, 4, 5]                            # needs a restore page and one more
    sched.add(2, spec(turn2, max_tokens=2))
    engine.step()
    assert sched.request(2).state.value == "waiting"    # a temporary shortage waits ...
    assert sched.snapshots.counters.evicted == 0        # ... and keeps the snapshot it matched
    events = run_all(sched, engine)
    assert sched.snapshots.counters.restored == 1
    assert terminal(events[2]).finished.usage.reused_prompt_tokens == 10
    assert tokens_of(events[2]) == reference_tokens(turn2, 2, VOCAB)


@pytest.mark.parametrize("initialization", [False, True])
def test_arrivals_join_the_second_frame_and_every_output_matches_feedback(initialization: bool) -> None:  # spec: SPEC-43, CACHE-23
    # requests arrive while others decode: each may join the round behind the one in flight as
    # its one host-fed lane (MIXED, with its INITIALIZATION first when the core has one); the
    # outputs equal completion feedback's, no page leaks
    prompts = [prompt_of(10 + i, 6 + i) for i in range(5)]
    sched, engine = make(initialization=initialization)
    sched.add(0, spec(prompts[0], max_tokens=14))
    events: dict[int, list[object]] = {}
    inflight: list = []
    arrived, joined = 1, 0
    for step in range(10_000):
        if arrived < len(prompts) and step % 3 == 2:
            sched.add(arrived, spec(prompts[arrived], max_tokens=10 + arrived))
            arrived += 1
        if not inflight:
            plan = sched.schedule()
            if plan is None:
                if arrived == len(prompts):
                    break
                continue
            engine.launch(plan, 0)
            inflight.append(plan)
        if len(inflight) == 1:
            nxt = sched.pipeline_next(inflight[0])
            if nxt is not None:
                joined += nxt.main.operation == cp.OPERATION_MIXED
                engine.launch(nxt, 1)
                inflight.append(nxt)
        plan = inflight.pop(0)
        sched.complete(plan, engine.collect(plan))
        for ev in sched.take_events():
            events.setdefault(ev.serial, []).append(ev)
    assert not sched.has_work() and joined > 0
    for i, p in enumerate(prompts):
        assert tokens_of(events[i]) == reference_tokens(p, (14 if i == 0 else 10 + i), VOCAB)
    assert sched.pool.used_pages == 0 and engine.writes_to_shared == []


def test_a_burst_of_arrivals_is_admitted_by_prompt_rounds_between_decode_rounds() -> None:  # spec: HTTP-20
    # six requests arrive while two decode: a MIXED round admits one of them beside the decode
    # lanes; a round of prompts only (PREFILL, several rows) takes several at once, and never
    # two such rounds in a row, so the decoding requests keep advancing
    sched, engine = make(slots=8, initialization=True)
    for i in range(2):
        sched.add(i, spec(prompt_of(i, 6), max_tokens=30))
    for _ in range(4):
        engine.step()
    for i in range(2, 8):
        sched.add(i, spec(prompt_of(i, 6), max_tokens=6))
    kinds = []
    events: dict[int, list[object]] = {}
    for ev in sched.take_events():
        events.setdefault(ev.serial, []).append(ev)
    while sched.has_work():
        plan = sched.schedule()
        if plan is None:
            break
        kinds.append((plan.main.operation, len(plan.main.lanes)))
        sched.complete(plan, engine.run(plan))
        for ev in sched.take_events():
            events.setdefault(ev.serial, []).append(ev)
    for i in range(2, 8):
        assert tokens_of(events[i]) == reference_tokens(prompt_of(i, 6), 6, VOCAB)
    prompt_rounds = [n for op, n in kinds if op == cp.OPERATION_PREFILL]
    assert prompt_rounds and max(prompt_rounds) >= 2
    assert all(not (a[0] == b[0] == cp.OPERATION_PREFILL) for a, b in zip(kinds, kinds[1:]))
    assert sched.pool.used_pages == 0 and engine.writes_to_shared == []


def test_ignore_eos_runs_to_the_output_limit_pipelined() -> None:
    prompt = prompt_of(3, 6)
    ref = reference_tokens(prompt, 12, VOCAB)
    sched, engine = make(eos=(ref[5],))
    sched.add(0, spec(prompt, max_tokens=12, ignore_eos=True))
    events = run_two_frames(sched, engine)
    assert tokens_of(events[0]) == ref                                   # the EOS id did not end it
    assert terminal(events[0]).finished.reason == ep.FINISH_REASON_LENGTH
    assert sched.counters.pipelined > 0                                  # no host feedback needed


def test_min_tokens_needs_feedback_only_until_reached() -> None:
    prompt = prompt_of(4, 6)
    sched, engine = make()
    sched.add(0, spec(prompt, max_tokens=12, min_tokens=12, stops=StopSettings(token_ids=(VOCAB - 1,))))
    run_two_frames(sched, engine)
    assert sched.counters.pipelined == 0                                 # a mask every round
    sched, engine = make(eos=(VOCAB - 2,))
    sched.add(0, spec(prompt, max_tokens=12, min_tokens=2))
    run_two_frames(sched, engine)
    assert sched.counters.pipelined > 0                                  # plain decode after the minimum


def test_sampling_mask_withholds_eos_and_stop_ids_until_min_tokens() -> None:
    from helios_backend.engine.runner import sampling_mask
    from helios_backend.scheduler.request import Request

    def withheld(words: np.ndarray) -> set[int]:
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")
        return {int(i) for i in np.flatnonzero(bits == 0)}

    eos = (2, 40)
    request = Request(0, spec([1, 2, 3], max_tokens=8, min_tokens=2, stops=StopSettings(token_ids=(7,))), 0)
    words = sampling_mask(request, eos, 2)
    assert words is not None and withheld(words) == {2, 40, 7}
    ignoring = Request(1, spec([1, 2, 3], max_tokens=8, min_tokens=2, ignore_eos=True,
                               stops=StopSettings(token_ids=(7,))), 0)
    assert withheld(sampling_mask(ignoring, eos, 2)) == {7}             # type: ignore[arg-type]
    request.tokens += [5, 6]                                            # two outputs: the minimum is met
    assert sampling_mask(request, eos, 2) is None
    assert sampling_mask(Request(2, spec([1], max_tokens=8), 0), eos, 2) is None


def test_the_second_frame_survives_endings_and_rounds_of_prompts() -> None:  # spec: SPEC-43, SPEC-44, SPEC-49, CACHE-23
    # closed loop at 6 clients with staggered lengths: a lane the in-flight round ends by its
    # limit drops out of the next round instead of stopping the second frame; a round of
    # prompts (PREFILL) or a MIXED admission leaves its new requests out of the round behind it
    # (phase change: completion feedback), and they rejoin the round after with their pending
    # token; the others keep the second frame. Every output equals completion feedback's.
    sched, engine = make(num_pages=256, slots=8, initialization=True)
    total, clients = 24, 6
    prompts = [prompt_of(40 + i, 5 + i % 4) for i in range(total)]
    limits = [3 + (7 * i) % 11 for i in range(total)]
    submitted = 0
    kinds_behind: list[int] = []              # operations the second frame followed

    def arrive() -> None:
        nonlocal submitted
        if submitted < total:
            sched.add(submitted, spec(prompts[submitted], max_tokens=limits[submitted]))
            submitted += 1

    for _ in range(clients):
        arrive()
    events = run_two_frames(sched, engine, on_terminal=arrive, followed=kinds_behind)
    assert not sched.has_work() and submitted == total
    for i in range(total):
        assert tokens_of(events[i]) == reference_tokens(prompts[i], limits[i], VOCAB)
        assert terminal(events[i]).finished.reason == ep.FINISH_REASON_LENGTH
    assert sched.pool.used_pages == 0 and engine.writes_to_shared == []
    # the second frame followed decode rounds that ended requests, and rounds that admitted some
    assert cp.OPERATION_DECODE in kinds_behind
    assert {cp.OPERATION_MIXED, cp.OPERATION_PREFILL} & set(kinds_behind)
    assert sched.counters.pipelined > sched.counters.launches.get(cp.OPERATION_DECODE, 0) // 2
