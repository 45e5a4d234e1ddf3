"""SPECULATIVE programs on the real SmolLM2 core with the numpy executor: history drafting,
verification against the target, commit, completion validation, descriptors and startup options."""
from __future__ import annotations

import copy

import numpy as np
import pytest
from helios_proto import contract_pb2 as C

from helios_backend.contract import ContractError, PreparedContract, contract_to_json
from helios_backend.engine.model import ModelOptions, NativeModel
from helios_backend.packing import PackedLane
from helios_backend.sampling_parameters import SamplingParameters
from helios_backend.lockstep.generator import GenerationRequest
from helios_backend.lockstep.raw_lanes import RawLanes
from helios_backend.lockstep.speculative import SpeculativeLockstepGenerator
from helios_backend.scheduler.events import Emitted, Terminal
from helios_backend.scheduler.request import RequestSpec, SamplingSettings
from helios_backend.scheduler.scheduler import Scheduler
from helios_backend.scheduler.speculative_scheduler import SpeculativeScheduler, Weighing
from helios_backend.scheduler.speculative_width import QUIET_ROUNDS, WidthPolicy
from helios_backend.scheduler.errors import CompletionMismatch
from helios_backend.kernel_abi.speculative import extension_words
from helios_backend.scheduler.speculative import (
    SpeculativeLane,
    SpeculativeOptions,
    SpeculativeStartupError,
    SpeculativeTable,
    publishable,
    validate_completion,
    validate_on_ranks,
)
from tests.engine_fixtures import prepared_in_memory, resource_reader

VARIANTS = ((2, 1, 0, 2), (2, 4, 3, 8), (2, 4, 3, 5, 1))   # (B, W, D, P[, device allocation])
HISTORY = SpeculativeOptions(enabled=True, history_drafting=True)
REPEATING = list(range(100, 110)) * 3          # the model continues the cycle: drafts get accepted


@pytest.fixture(scope="module")
def prepared():
    return prepared_in_memory(speculative_variants=VARIANTS)


@pytest.fixture(scope="module")
def model(prepared):
    loaded = NativeModel.load(prepared.contract, prepared.manifest, resource_reader(prepared),
                              ModelOptions(cache_pages=64))
    yield loaded
    loaded.close()


def _plain(model, request: GenerationRequest) -> list[int]:
    driver = RawLanes(model)
    model.packer.forget_slot(0)
    [active] = driver.admit([request], [0])
    driver.prefill(active)
    while not active.result.finish:
        driver.decode_round([active])
    return active.result.tokens


def _graph(prepared, program: str) -> C.GraphContract:
    return next(g for g in prepared.contract.model.graphs if g.program == program)


def test_programs_are_recorded_with_explicit_descriptors(prepared):
    # spec: SPEC-6
    # spec: SPEC-10
    # spec: SPEC-11
    # spec: SPEC-16
    # spec: SRV-5
    assert list(prepared.contract.speculative_widths) == [1, 4]
    for b, w, d, p in (v for v in VARIANTS if len(v) == 4):
        graph = _graph(prepared, f"speculative.r{b}.w{w}.t{p}")
        assert graph.operation == C.OPERATION_SPECULATIVE
        spec = graph.speculative
        assert (spec.batch_capacity, spec.token_capacity, spec.draft_tokens, spec.packed_token_capacity) == (b, w, d, p)
        sources = [x.source for x in graph.bindings]
        assert sources.count(C.VALUE_SOURCE_QUERY_LENGTH) == 1
        assert C.VALUE_SOURCE_SPECULATIVE_PREFIX_LIMIT not in sources
        assert graph.cursor.reports_draft_cursor and graph.cursor.state_view == "state.draft_cursor"


def test_one_complete_program_and_decode_stays_one_token(prepared):
    # spec: SPEC-1
    # spec: SPEC-2
    # spec: SPEC-3
    programs = {p.name: p for p in prepared.manifest.programs}
    kernels = [n.kernel for n in programs["speculative.r2.w4.t8"].nodes]
    assert kernels[0] == "speculative.expand.v1" and kernels[-1] == "speculative.verify_commit.v1"
    operations = {g.operation for g in prepared.contract.model.graphs}
    assert operations <= {C.OPERATION_INITIALIZATION, C.OPERATION_PREFILL, C.OPERATION_DECODE, C.OPERATION_MIXED,
                          C.OPERATION_RESTORATION, C.OPERATION_SPECULATIVE,
                          C.OPERATION_RESUME, C.OPERATION_SCORED_PREFILL}     # no proposal/verify-only programs
    for name, program in programs.items():
        if name.startswith("decode."):
            assert "speculative.verify_commit.v1" not in {n.kernel for n in program.nodes}
            assert program.capacity.rows == program.capacity.tokens


def test_a_speculative_core_keeps_logprobs_and_scored_prefill(prepared):
    # spec: SPEC-40
    # the speculative extension records come right after the standard records (the kernels fix
    # that offset); the logprob records and the scores follow them, declared by the layout
    layout = prepared.manifest.completion
    header = {f.name: f for f in layout.header}
    widest = max(g.speculative.token_capacity for g in prepared.contract.model.graphs
                 if g.operation == C.OPERATION_SPECULATIVE)
    extension_end = layout.header_words + layout.rows * (layout.row_words + extension_words(widest))
    assert header["logprob_records"].word == extension_end
    assert header["scores"].word == extension_end + header["logprob_records"].words
    assert "logprob" in {f.name for f in layout.row}
    assert any(g.operation == C.OPERATION_SCORED_PREFILL for g in prepared.contract.model.graphs)
    assert prepared.manifest.transport.completion_nbytes >= 4 * (header["scores"].word + header["scores"].words)


def test_width_one_binds_no_proposals(prepared):
    # spec: SPEC-4
    graph = _graph(prepared, "speculative.r2.w1.t2")
    assert graph.speculative.draft_tokens == 0
    assert not {b.source for b in graph.bindings} & {C.VALUE_SOURCE_PROPOSAL_IDS, C.VALUE_SOURCE_PROPOSAL_COUNT}
    wide = _graph(prepared, "speculative.r2.w4.t8")
    assert {C.VALUE_SOURCE_PROPOSAL_IDS, C.VALUE_SOURCE_PROPOSAL_COUNT, C.VALUE_SOURCE_PROPOSAL_GENERATION,
            C.VALUE_SOURCE_PROPOSAL_CONSUMED} <= {b.source for b in wide.bindings}


def test_greedy_speculative_output_equals_plain_decode_with_accepted_drafts(model):
    # spec: SPEC-40
    # spec: SPEC-33
    request = GenerationRequest(REPEATING, max_tokens=14)
    plain = _plain(model, request)
    run = SpeculativeLockstepGenerator(model, HISTORY).generate([request])
    assert run.results[0].tokens == plain
    assert run.accepted > 0
    assert len(run.rounds) < len(plain)           # fewer target passes than tokens


def test_seeded_sampling_matches_plain_decode(model):
    # spec: SPEC-33
    request = GenerationRequest(REPEATING, max_tokens=10, seed=1234,
                                sampling=SamplingParameters(temperature=0.7, top_p=0.95))
    plain = _plain(model, request)
    run = SpeculativeLockstepGenerator(model, HISTORY).generate([request])
    assert run.results[0].tokens == plain


def test_two_lanes_and_width_one_rounds(model):
    # spec: CACHE-10
    # spec: SPEC-5
    # spec: SPEC-13
    # spec: SPEC-14
    requests = [GenerationRequest(REPEATING, max_tokens=9), GenerationRequest([1, 9690, 28, 2], max_tokens=3)]
    expected = [_plain(model, r) for r in requests]
    driver = SpeculativeLockstepGenerator(model, HISTORY)
    run = driver.generate(requests)
    assert [r.tokens for r in run.results] == expected
    assert all(len(r.tokens) == q.max_tokens for r, q in zip(run.results, requests))  # limits never exceeded
    # without history matches the host picks the width-one program: no proposals, same output
    alone = SpeculativeLockstepGenerator(model, HISTORY).generate([requests[1]])
    assert alone.results[0].tokens == expected[1]
    assert {r.program for r in alone.rounds} == {"speculative.r2.w1.t2"}
    # the committed draft cursor of each slot follows its consumed endpoint (lag 0), also at width one
    cursor = model.executor.buffer_view("state.draft_cursor", np.int32)
    assert cursor[0] == len(requests[1].prompt) + len(alone.results[0].tokens) - 1
    assert cursor[1] == len(requests[1].prompt) + len(run.results[1].tokens) - 1


def _one_round(model, prompt, max_tokens=8):
    """Admit + prefill one request, plan one history-drafted round, return (driver, actives, round, words)."""
    driver = SpeculativeLockstepGenerator(model, HISTORY)
    driver.table = SpeculativeTable([p for p in driver.table.programs
                                     if p.length_source == C.VALUE_SOURCE_QUERY_LENGTH], HISTORY)
    actives = driver.plain.admit([GenerationRequest(prompt, max_tokens=max_tokens)], [0])
    driver.plain.prefill(actives[0])
    round_ = driver.table.plan(driver.candidates(actives))
    lane = round_.lanes[0]
    active = actives[0]
    driver.plain.ensure_pages(active, lane.reserve_end)
    packed = PackedLane(slot=active.slot, generation=active.generation, start=active.consumed,
                        page_table=list(active.pages), proposals=np.asarray(lane.proposals, np.int32),
                        proposal_generation=active.generation, proposal_consumed=active.consumed)
    runner = driver.plain.runner
    submission = runner.launch_lanes(round_.program.program, round_.program.variant.operation, [packed])
    round_.sequence = submission.sequence
    return driver, actives, round_, runner.wait_lanes(submission)


def test_completion_is_validated_before_request_state(model):
    # spec: SPEC-41
    # spec: SPEC-42
    # spec: CACHE-11
    # spec: CACHE-15
    # spec: CACHE-16
    # spec: CACHE-17
    # spec: CACHE-18
    driver, actives, round_, words = _one_round(model, REPEATING)
    fmt, vocab = driver.format, driver.vocab
    [outcome] = validate_completion(fmt, words, round_, vocab, driver.table.max_width)
    assert outcome.offers == 4 and outcome.accepted == 3 and outcome.tokens == [101, 102, 103, 104]
    assert outcome.draft_cursor == outcome.consumed == len(REPEATING) + 4
    header, row_words = fmt.header_words, fmt.row_words
    ext = header + fmt.capacity * row_words
    row = {name: header + word for name, word in fmt.row.items()}

    def broken(edit):
        bad = words.copy()
        edit(bad)
        with pytest.raises(CompletionMismatch):
            validate_completion(fmt, bad, round_, vocab, driver.table.max_width)

    broken(lambda w: w.__setitem__(ext, 5))                    # offers above the lane's ceiling (SPEC-41)
    broken(lambda w: w.__setitem__(ext + 1, 4))                # accepted > offers - 1
    broken(lambda w: w.__setitem__(ext + 2, 7))                # an accepted id that was not proposed
    broken(lambda w: w.__setitem__(row["draft_cursor"], outcome.consumed - 1))
    broken(lambda w: w.__setitem__(row["consumed"], outcome.consumed + 1))
    broken(lambda w: w.__setitem__(row["generation"], 99))
    broken(lambda w: w.__setitem__(fmt.header["sequence"], round_.sequence + 1))
    broken(lambda w: w.__setitem__(row["reserved_model"], 0))
    # the total of offers against P: a program with a smaller P than this lane's offers
    round_.program = type(round_.program)(**{**round_.program.__dict__, "packed": 3})
    with pytest.raises(CompletionMismatch):
        validate_completion(fmt, words, round_, vocab, driver.table.max_width)


def test_cancelled_lane_publishes_nothing(model):
    # spec: SPEC-50
    # spec: SPEC-51
    driver, actives, round_, words = _one_round(model, REPEATING)
    outcomes = validate_completion(driver.format, words, round_, driver.vocab, driver.table.max_width)
    pages = list(actives[0].pages)
    round_.cancelled.add(round_.lanes[0].candidate.key)
    before = list(actives[0].result.tokens)
    driver.apply(actives, round_, outcomes)
    assert publishable(round_, outcomes) == []
    assert actives[0].result.tokens == before
    assert actives[0].pages == pages                     # pages stay held through the fence


def test_stale_copies_are_not_offered(model):
    # spec: SPEC-15
    driver, actives, round_, _ = _one_round(model, REPEATING)
    active = actives[0]
    lane = round_.lanes[0]
    stale = PackedLane(slot=active.slot, generation=active.generation, start=active.consumed,
                       page_table=list(active.pages), proposals=np.asarray(lane.proposals, np.int32),
                       proposal_generation=active.generation, proposal_consumed=active.consumed - 1)
    runner = driver.plain.runner
    words = runner.wait_lanes(runner.launch_lanes(round_.program.program, round_.program.variant.operation, [stale]))
    ext = driver.format.header_words + driver.format.capacity * driver.format.row_words
    assert int(words[ext]) == 1 and int(words[ext + 1]) == 0       # pending only: no stale proposal verified


# ---- descriptor validation ---------------------------------------------------------------------

def _decode_with(prepared, program, edit):
    contract = copy.deepcopy(prepared.contract)
    graph = next(g for g in contract.model.graphs if g.program == program)
    edit(graph)
    return PreparedContract.decode(contract, prepared.manifest)


def test_descriptor_rejections(prepared):
    # spec: SPEC-7
    # spec: SPEC-11
    # spec: SPEC-16
    # spec: SPEC-10
    wide = "speculative.r2.w4.t8"
    PreparedContract.decode(prepared.contract, prepared.manifest)
    with pytest.raises(ContractError):            # B is the graph's captured rows
        _decode_with(prepared, wide, lambda g: setattr(g.speculative, "batch_capacity", 1))
    with pytest.raises(ContractError):            # D is never inferred from W
        _decode_with(prepared, wide, lambda g: setattr(g.speculative, "draft_tokens", 0))
    with pytest.raises(ContractError):            # P is explicit
        _decode_with(prepared, wide, lambda g: setattr(g.speculative, "packed_token_capacity", 0))
    with pytest.raises(ContractError):            # both length sources
        _decode_with(prepared, wide, lambda g: g.bindings.append(C.ValueBinding(
            destination="query_length", source=C.VALUE_SOURCE_SPECULATIVE_PREFIX_LIMIT,
            index=C.INDEX_MODE_SUBMISSION_ROW)))
    with pytest.raises(ContractError):            # no length source
        _decode_with(prepared, wide, lambda g: [g.bindings.remove(b) for b in list(g.bindings)
                                                 if b.source == C.VALUE_SOURCE_QUERY_LENGTH])


def test_d_other_than_w_minus_one_is_valid(prepared):
    # spec: SPEC-12
    _decode_with(prepared, "speculative.r2.w4.t8", lambda g: setattr(g.speculative, "draft_tokens", 2))


# ---- startup options ----------------------------------------------------------------------------

def test_history_drafting_is_a_startup_option(prepared, model):
    # spec: SRV-11
    # spec: SRV-12
    # spec: SRV-14
    assert "drafting" not in contract_to_json(prepared.contract).lower()
    # no message of the contract schema has a field that could record a drafting preference
    pending = list(C.DESCRIPTOR.message_types_by_name.values())
    while pending:
        message = pending.pop()
        pending.extend(message.nested_types)
        assert not [f.name for f in message.fields if "drafting" in f.name or "history_draft" in f.name]
    with pytest.raises(SpeculativeStartupError):
        SpeculativeTable.select(model.graphs, SpeculativeOptions(enabled=False, history_drafting=True))
    assert not SpeculativeTable.select(model.graphs, SpeculativeOptions()).active


def test_history_drafting_needs_copied_inputs_in_every_wider_graph(prepared):
    # spec: SRV-13
    graphs = [copy.deepcopy(g) for g in prepared.contract.model.graphs]
    SpeculativeTable.select(graphs, HISTORY)
    wide = next(g for g in graphs if g.program == "speculative.r2.w4.t8")
    for b in [b for b in wide.bindings if b.source == C.VALUE_SOURCE_PROPOSAL_IDS]:
        wide.bindings.remove(b)
    with pytest.raises(SpeculativeStartupError):
        SpeculativeTable.select(graphs, HISTORY)
    # selecting width one only leaves no wider graph to check (SRV-8: load may reduce widths)
    assert SpeculativeTable.select(graphs, SpeculativeOptions(True, True, widths=(1,))).max_width == 1
    with pytest.raises(SpeculativeStartupError):
        SpeculativeTable.select(graphs, SpeculativeOptions(True, True, widths=(8,)))


def test_enabled_speculation_without_programs_fails_startup(prepared):
    # spec: SRV-12
    plain = [g for g in prepared.contract.model.graphs if g.operation != C.OPERATION_SPECULATIVE]
    with pytest.raises(SpeculativeStartupError):
        SpeculativeTable.select(plain, HISTORY)


# ---- device allocation (SPECULATIVE_PREFIX_LIMIT) ------------------------------------------------

ALLOCATING = "speculative.r2.w4.t5.alloc"


def test_allocating_program_binds_the_prefix_limit(prepared):
    # spec: SPEC-18
    # spec: SPEC-22
    # spec: SPEC-23
    # spec: SPEC-34
    graph = _graph(prepared, ALLOCATING)
    sources = [b.source for b in graph.bindings]
    assert sources.count(C.VALUE_SOURCE_SPECULATIVE_PREFIX_LIMIT) == 1 and C.VALUE_SOURCE_QUERY_LENGTH not in sources
    assert graph.speculative.confidence_width == graph.speculative.draft_tokens == 3
    kernels = [n.kernel for n in next(p for p in prepared.manifest.programs if p.name == ALLOCATING).nodes]
    # confidence is produced and consumed inside the same complete graph, before the target pass
    assert kernels[:3] == ["speculative.copy_confidence.v1", "speculative.allocate.v1", "speculative.expand.v1"]


def test_device_allocation_fits_P_with_ceilings_above_it(model):
    # spec: SPEC-19
    # spec: SPEC-20
    # spec: SPEC-21
    # spec: SPEC-41
    # spec: SPEC-42
    requests = [GenerationRequest(REPEATING, max_tokens=10), GenerationRequest(list(range(200, 207)) * 3, max_tokens=6)]
    expected = [_plain(model, r) for r in requests]
    driver = SpeculativeLockstepGenerator(model, HISTORY)
    driver.table = SpeculativeTable([p for p in driver.table.programs
                                     if p.program == ALLOCATING or p.width == 1], HISTORY)
    planned: list[list[SpeculativeLane]] = []
    plan = driver.table.plan
    driver.table.plan = lambda candidates: _record(planned, plan(candidates))
    run = driver.generate(requests)
    assert [r.tokens for r in run.results] == expected
    allocated = [(r, lanes) for r, lanes in zip(run.rounds, planned) if r.program == ALLOCATING]
    assert allocated and run.accepted > 0
    for stats, lanes in allocated:
        assert sum(stats.offers) <= 5
        assert all(o <= lane.ceiling for o, lane in zip(stats.offers, lanes))
    # at least one round asked for more rows than P: the ceilings, not the lengths, were reserved
    assert any(sum(lane.ceiling for lane in lanes) > 5 for _, lanes in allocated)


def _record(planned, round_):
    planned.append(list(round_.lanes))
    return round_


def test_one_rank_rejecting_suppresses_commit_on_all(model):
    # spec: SPEC-31
    driver, actives, round_, words = _one_round(model, REPEATING)
    args = (driver.format, round_, driver.vocab, driver.table.max_width)
    [outcome] = validate_on_ranks(args[0], [words, words.copy()], *args[1:])
    assert outcome.accepted == 3
    tampered = words.copy()
    tampered[driver.format.header_words + driver.format.row["draft_cursor"]] += 1
    with pytest.raises(CompletionMismatch, match="ranks \\[1\\]"):
        validate_on_ranks(args[0], [words, tampered], *args[1:])


# ---- the token-budget scheduler with speculative rounds ------------------------------------------

def _serve(model, scheduler_factory, specs):
    sched, runner = _scheduler(model, scheduler_factory)
    for serial, spec in enumerate(specs):
        sched.add(serial, spec)
    tokens: dict[int, list[int]] = {serial: [] for serial in range(len(specs))}
    finished = {}
    while sched.has_work():
        plan = sched.schedule()
        sched.complete(plan, runner.run(plan))
        for ev in sched.take_events():
            if isinstance(ev, Emitted):
                tokens[ev.serial].append(ev.token)
            elif isinstance(ev, Terminal):
                outcome = ev.event.WhichOneof("outcome")
                finished[ev.serial] = ev.event.finished.reason if outcome == "finished" else outcome
    return tokens, finished, sched.counters


def _scheduler(model, scheduler_factory):
    import time

    from helios_backend.scheduler.config import SchedulerConfig
    from helios_backend.scheduler.variants import VariantTable
    from helios_backend.engine.speculative_runner import SpeculativeProgramRunner

    contract, manifest = model.contract, model.execution_manifest
    vocab = contract.model.vocabulary
    table = SpeculativeTable.select(model.graphs, HISTORY)
    runner = SpeculativeProgramRunner.for_model(model)   # numbered by the model: earlier submissions counted
    runner.max_width = table.max_width
    for slot in range(manifest.request_slots):
        model.packer.forget_slot(slot)              # generations restart at 1 in a new scheduler
    config = SchedulerConfig(page_tokens=contract.model.cache.page_tokens, num_pages=model.manifests[0].cache_pages,
                             request_slots=manifest.request_slots, max_active=2, queue_capacity=8,
                             context_tokens=contract.context_tokens, max_pages_per_row=manifest.max_pages_per_row,
                             vocab_size=vocab.sampled_tokens, input_vocab_size=vocab.sampled_tokens,
                             eos_ids=tuple(contract.defaults.eos_token_ids), clock_origin_ns=time.monotonic_ns())
    return scheduler_factory(config, VariantTable.from_graphs(model.graphs), table), runner


def test_scheduler_with_speculative_rounds_matches_plain_scheduling(model):
    # spec: SPEC-15
    # spec: SPEC-21
    # spec: SPEC-40
    # drafting starts once a shadow lookup saw the copies emitted (speculative_width.py): long
    # enough an output for the speculative rounds to save launches
    specs = [RequestSpec(tuple(REPEATING), 24, SamplingSettings()),
             RequestSpec((1, 9690, 28, 2), 5, SamplingSettings(temperature=0.7, seed=5)),
             RequestSpec(tuple(range(300, 306)) * 3, 7, SamplingSettings())]
    plain, plain_done, plain_counters = _serve(model, lambda c, v, t: Scheduler(c, v), specs)
    spec, spec_done, counters = _serve(model, SpeculativeScheduler, specs)
    assert spec == plain and spec_done == plain_done
    assert counters.launches.get(C.OPERATION_SPECULATIVE, 0) > 0
    assert counters.generated_tokens == plain_counters.generated_tokens
    assert sum(counters.launches.values()) < sum(plain_counters.launches.values())


@pytest.mark.parametrize("cap", [1, 8])
def test_a_weighing_starts_at_most_its_cap_of_shadow_lookups(model, cap):
    # spec: SPEC-47
    # host work per round stays bounded at any batch: the first weighing of two fresh requests
    # looks up as many as the policy allows; the other gets its turn at a later weighing, and
    # both still draft with the tokens of plain scheduling
    specs = [RequestSpec(tuple(REPEATING), 24, SamplingSettings()),
             RequestSpec(tuple(range(300, 306)) * 3, 24, SamplingSettings())]

    def capped(config, variants, table):  # type: ignore[no-untyped-def]
        return SpeculativeScheduler(config, variants, table, policy=WidthPolicy(7, shadow_lookups=cap))
    sched, runner = _scheduler(model, capped)
    for serial, spec in enumerate(specs):
        sched.add(serial, spec)
    plan = sched.schedule()
    while plan.main.operation != C.OPERATION_DECODE or len(plan.main.lanes) < 2:
        sched.complete(plan, runner.run(plan))
        plan = sched.schedule()
    assert sched.drafting.shadows == min(cap, 2)
    plain, _, _ = _serve(model, lambda c, v, t: Scheduler(c, v), specs)
    drafted, _, counters = _serve(model, capped, specs)
    assert drafted == plain and counters.launches.get(C.OPERATION_SPECULATIVE, 0) > 0


def test_round_costs_sample_only_rounds_that_time_their_own_program(model):
    # spec: SPEC-47
    # without a second frame every round is planned from completion feedback: no DECODE round is
    # a steady pipelined sample (on an executor that runs a round inside its launch, the first
    # DECODE round after a wait would time two steps), while each SPECULATIVE round, with nothing
    # planned behind it, times its own program
    sched, runner = _scheduler(model, SpeculativeScheduler)
    sched.add(0, RequestSpec(tuple(REPEATING), 24, SamplingSettings()))
    while sched.has_work():
        plan = sched.schedule()
        sched.complete(plan, runner.run(plan))
    assert sched.drafting.rounds > 0
    assert sched.costs.seconds and all(p.startswith("speculative.") for p in sched.costs.seconds)


def test_cancelled_speculative_round_publishes_nothing_and_retires_at_its_fence(model):
    # spec: SPEC-50
    # spec: SPEC-51
    from helios_proto import exchange_pb2 as ep

    sched, runner = _scheduler(model, SpeculativeScheduler)
    sched.add(0, RequestSpec(tuple(REPEATING), 24, SamplingSettings()))
    plan = sched.schedule()                                  # prefill + initialization
    for _ in range(QUIET_ROUNDS):                            # decode until a shadow lookup settled
        sched.complete(plan, runner.run(plan))
        sched.take_events()
        plan = sched.schedule()
        if plan.main.operation != C.OPERATION_DECODE:
            break
    assert plan.main.operation == C.OPERATION_SPECULATIVE
    request = sched.request(0)
    pages = list(request.pages)
    runner.launch(plan, 0)
    sched.cancel(0)                                          # while the round is in flight
    assert sched.request(0) is request and request.pages == pages     # nothing released before the fence
    assert sched.pool.refcount(pages[-1]) == 1
    sched.complete(plan, runner.collect(plan))
    events = sched.take_events()
    assert not [e for e in events if isinstance(e, Emitted)]
    [terminal] = [e for e in events if isinstance(e, Terminal)]
    assert terminal.event.finished.reason == ep.FINISH_REASON_CANCELLED
    assert sched.request(0) is None and not sched.has_work()


def test_a_graph_without_draft_cursor_must_report_minus_one(model):
    # spec: CACHE-12
    driver, actives, round_, words = _one_round(model, REPEATING)
    fmt = driver.format
    round_.program = type(round_.program)(**{**round_.program.__dict__, "reports_cursor": False})
    with pytest.raises(CompletionMismatch, match="draft cursor"):
        validate_completion(fmt, words, round_, driver.vocab, driver.table.max_width)
    words = words.copy()
    words[fmt.header_words + fmt.row["draft_cursor"]] = -1
    [outcome] = validate_completion(fmt, words, round_, driver.vocab, driver.table.max_width)
    assert outcome.draft_cursor == -1


def test_weighing_promises_no_more_per_lane_than_the_program_verifies(model):
    # spec: SPEC-47
    # limits earned at fewer rows (7 drafts) can exceed what the program serving this many lanes
    # verifies per lane (width 4 here): the weighing counts at most that, or a DECODE round would
    # wait for completion feedback that the round it hopes for cannot use
    import dataclasses

    from helios_backend.scheduler.speculative_width import DraftAcceptance, WidthPolicy

    @dataclasses.dataclass(frozen=True)
    class Recording(WidthPolicy):
        promised: list = dataclasses.field(default_factory=list)

        def worth(self, expected, lanes, width, ratio):  # type: ignore[no-untyped-def]
            self.promised.append(expected)
            return super().worth(expected, lanes, width, ratio)

    policy = Recording(7)
    sched, _ = _scheduler(model, lambda c, v, t: SpeculativeScheduler(c, v, t, policy=policy))
    program = sched._program_for(2, 8)
    assert program is not None and program.lane_limit == 4
    sure = DraftAcceptance()
    for _ in range(20):
        sure.observe(policy, 7, 7)                       # every copy accepted: rate near 1
    assert sure.draft_limit(policy) == 7
    sched._may_pay(Weighing([sure, sure], [7, 7], [sure.rate, sure.rate]))
    assert policy.promised and 2 * 3 < policy.promised[0] <= 2 * program.lane_limit


@pytest.fixture(scope="module")
def two_widths():
    wide = prepared_in_memory(speculative_variants=((2, 1, 0, 2), (2, 4, 3, 8), (2, 8, 7, 16)))
    loaded = NativeModel.load(wide.contract, wide.manifest, resource_reader(wide), ModelOptions(cache_pages=64))
    yield loaded
    loaded.close()


@pytest.mark.parametrize("wide_ratio, chosen", [(3.0, 4), (1.3, 8)])
def test_the_width_with_the_most_tokens_per_measured_cost_caps_the_drafts(two_widths, wide_ratio, chosen):
    # spec: SPEC-47
    # at acceptance 7/12 a lane of width 4 emits 2.12 tokens, of width 8 2.37: at 1.2 DECODE steps
    # for width 4, width 8 pays only if it costs less than 2.37 / 2.12 x 1.2 = 1.34 steps
    from helios_backend.scheduler.speculative_width import DraftAcceptance, WidthPolicy

    sched, _ = _scheduler(two_widths, lambda c, v, t: SpeculativeScheduler(c, v, t, policy=WidthPolicy(7)))
    decode = sched.variants.fit(C.OPERATION_DECODE, 2, 2)
    by_width = {p.lane_limit: p for p in sched.speculative.programs if p.rows >= 2}
    sched.costs.observe(decode.program, 1.0, 2)
    sched.costs.observe(by_width[4].program, 1.2, by_width[4].packed)
    sched.costs.observe(by_width[8].program, wide_ratio, by_width[8].packed)
    lane = DraftAcceptance(successes=6.0, failures=4.0)
    assert abs(lane.rate - 7 / 12) < 1e-9
    limits = sched._cheapest_width(Weighing([lane, lane], [7, 7], [lane.rate, lane.rate]))
    assert limits == [chosen - 1] * 2
