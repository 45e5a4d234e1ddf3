"""Spec rules of value bindings and shared packing, on the real recorded SmolLM2 transport,
the real Packer and the real numpy executor; tuned bindings on the contract decoder and on
the CUDA executor's startup over the fake driver."""
from __future__ import annotations

import numpy as np
import pytest
from helios_proto import contract_pb2 as C
from helios_proto import manifest_pb2 as M

from helios_backend.contract import ContractError, PreparedContract
from helios_backend.packing import SlotInitialization, CapacityError, PackedLane, Packer
from helios_backend.sampling_parameters import SamplingParameters
from tests.contract_samples import SAMPLE_RESOURCE_IDS, sample_contract, sample_manifest
from tests.engine_fixtures import prepared_in_memory

SENTINEL = 0x5A


@pytest.fixture(scope="module")
def prepared():
    return prepared_in_memory()


def _frames(manifest: M.ExecutionManifest) -> list[np.ndarray]:
    return [np.full(manifest.transport.frame_nbytes, SENTINEL, dtype=np.uint8) for _ in range(2)]


def _view(manifest: M.ExecutionManifest, frame: np.ndarray, name: str, dtype=np.int32) -> np.ndarray:
    d = next(d for d in manifest.transport.destinations if d.name == name)
    return frame[d.byte_offset:d.byte_offset + d.elements * np.dtype(dtype).itemsize].view(dtype)


def _graph(prepared, program: str) -> C.GraphContract:
    graph = C.GraphContract()
    graph.CopyFrom(next(g for g in prepared.contract.model.graphs if g.program == program))
    return graph


def _all_with(prepared, graph: C.GraphContract) -> list[C.GraphContract]:
    """Every recorded graph, with `graph` replacing the one of its program (row widths are
    derived from all graphs binding a destination)."""
    return [graph if g.program == graph.program else g for g in prepared.contract.model.graphs]


def _rebind(graph: C.GraphContract, destination: str, **fields: object) -> None:
    binding = next(b for b in graph.bindings if b.destination == destination)
    for key, value in fields.items():
        setattr(binding, key, value)


def _decode(contract: C.ServingContract, manifest: M.ExecutionManifest) -> PreparedContract:
    return PreparedContract.decode(contract, manifest, resource_ids=SAMPLE_RESOURCE_IDS)


# ---- BND-6, 7, 8, 10, 11: the source groups -------------------------------------------------

def test_lane_geometry_sources_are_packed_per_lane(prepared):
    # spec: BND-6
    manifest = prepared.manifest
    frames = _frames(manifest)
    # a MIXED program binding the mixed prefill row (cores before select_input.v2 bind it: one
    # host-fed row); this recipe's MIXED tells its host-fed rows by their prompt tokens instead
    mixed = _graph(prepared, "mixed.r2.t17")
    assert all(b.source != C.VALUE_SOURCE_MIXED_PREFILL_ROW for b in mixed.bindings)
    mixed.bindings.add(destination="prefill_row", source=C.VALUE_SOURCE_MIXED_PREFILL_ROW,
                       index=C.INDEX_MODE_SCALAR, padding=-1)
    packer = Packer(_all_with(prepared, mixed), manifest.transport, manifest.request_slots, frames)
    lanes = [PackedLane(slot=3, generation=9, start=12, page_table=[1]),                                  # decode lane
             PackedLane(slot=1, generation=4, start=16, tokens=np.array([7, 8, 9], np.int32), sample=False,
                        page_table=[2, 5])]
    packer.pack("mixed.r2.t17", 0, lanes)
    v = lambda name: _view(manifest, frames[0], name)  # noqa: E731
    assert v("row_slot")[:2].tolist() == [3, 1]                        # SLOT
    assert v("row_generation")[:2].tolist() == [9, 4]                  # GENERATION
    assert v("live_rows")[0] == 2                                      # LIVE_ROW_COUNT
    assert v("query_length")[:2].tolist() == [1, 3]                    # QUERY_LENGTH
    assert v("sample_flag")[:2].tolist() == [1, 0]                     # SAMPLING_DECISION
    assert v("prefill_row")[0] == 1                                    # MIXED_PREFILL_ROW
    packer.pack("mixed.r2.t17", 0, lanes[::-1])                         # the row follows the lane
    assert v("prefill_row")[0] == 0 and v("row_slot")[:2].tolist() == [1, 3]


def test_token_position_and_cache_sources_are_packed(prepared):
    # spec: BND-7, BND-8
    manifest = prepared.manifest
    frames = _frames(manifest)
    packer = Packer(list(prepared.contract.model.graphs), manifest.transport, manifest.request_slots, frames)
    width = manifest.max_pages_per_row
    lanes = [PackedLane(slot=2, generation=1, start=40, page_table=[6, 7, 8]),                    # pending token
             PackedLane(slot=0, generation=5, start=3, tokens=np.array([21, 22], np.int32), page_table=[9])]
    packer.pack("mixed.r2.t17", 1, lanes)
    v = lambda name: _view(manifest, frames[1], name)  # noqa: E731
    assert v("prompt_tokens")[:3].tolist() == [-1, 21, 22]             # PROMPT_TOKENS (-1: device pending)
    assert v("positions")[:3].tolist() == [40, 3, 4]                   # PROMPT_POSITIONS
    assert v("consumed")[:2].tolist() == [40, 3]                       # CONSUMED_TOKENS
    table = v("page_table")                                             # PAGE_TABLE at the physical slot
    assert table[2 * width:2 * width + 3].tolist() == [6, 7, 8]
    assert table[0:1].tolist() == [9]


def test_snapshot_and_restore_sources_are_packed():
    # spec: BND-8
    prepared = prepared_in_memory(snapshot_rows=2)
    manifest = prepared.manifest
    frames = _frames(manifest)
    packer = Packer(list(prepared.contract.model.graphs), manifest.transport, manifest.request_slots, frames)
    prefill = PackedLane(slot=1, generation=2, start=0, tokens=np.arange(5, dtype=np.int32), page_table=[3],
                         snapshot_row=1)
    packer.pack("prefill.r2.t64", 0, [prefill])
    assert _view(manifest, frames[0], "snapshot_row")[0] == 1                        # SNAPSHOT_DESTINATION
    restoration = next(g.program for g in prepared.contract.model.graphs if g.operation == C.OPERATION_RESTORATION)
    lanes = [PackedLane(slot=3, generation=7, start=18, page_table=[6, 7], restore_row=1)]
    packer.pack(restoration, 1, lanes)
    assert _view(manifest, frames[1], "restore_row")[0] == 1                         # RESTORE_SOURCE
    assert _view(manifest, frames[1], "consumed")[0] == 18


def test_row_destinations_use_their_declared_row_width(prepared):
    # spec: BND-8, BND-13, BND-15, SRV-7
    # row r of a row-indexed destination is element r * row_elements, even when no graph binding
    # it has as many rows as the destination (docs/spec-gaps.md bug 1)
    manifest = prepared.manifest
    graphs = list(prepared.contract.model.graphs)
    declared = {d.name: d.row_elements for d in manifest.transport.destinations}
    vocab = prepared.contract.model.vocabulary
    assert declared["restore_row"] == declared["snapshot_row"] == declared["row_slot"] == 1
    assert declared["grammar_mask"] == -(-vocab.sampled_tokens // 32) and declared["in_seeds"] == 2
    assert declared["page_table"] == manifest.max_pages_per_row and declared["prompt_tokens"] == 0
    frames = _frames(manifest)
    packer = Packer(graphs, manifest.transport, manifest.request_slots, frames)
    restoration = next(g.program for g in graphs if g.operation == C.OPERATION_RESTORATION and g.capacity.rows == 2)
    packer.pack(restoration, 1, [PackedLane(slot=3, generation=7, start=18, page_table=[6, 7], restore_row=1),
                                 PackedLane(slot=0, generation=2, start=20, page_table=[1, 2], restore_row=0)])
    assert _view(manifest, frames[1], "restore_row")[:2].tolist() == [1, 0]
    lanes = [PackedLane(slot=s, generation=1, tokens=np.arange(5, dtype=np.int32), page_table=[s], snapshot_row=r)
             for s, r in ((2, 3), (1, 2))]
    packer.pack("prefill.r2.t64", 0, lanes)
    assert _view(manifest, frames[0], "snapshot_row")[:2].tolist() == [3, 2]
    # a reduced selection (concurrency 2) packs the same rows
    selected = [g for g in graphs if g.capacity.rows <= 2]
    frames = _frames(manifest)
    Packer(selected, manifest.transport, manifest.request_slots, frames).pack(
        "decode.r2.t2", 0, [PackedLane(slot=3, generation=1, start=4, page_table=[0]),
                            PackedLane(slot=1, generation=1, start=9, page_table=[1])])
    assert _view(manifest, frames[0], "row_slot")[:2].tolist() == [3, 1]
    assert _view(manifest, frames[0], "consumed")[:2].tolist() == [4, 9]


def test_row_widths_of_cores_without_declared_widths_are_derived_from_every_graph(prepared):
    # spec: FMT-8, SRV-7
    # a core prepared before Destination.row_elements: widths come from the rows of every graph
    # of the contract binding the destination, also when the selection is reduced
    manifest = M.ExecutionManifest()
    manifest.CopyFrom(prepared.manifest)
    for d in manifest.transport.destinations:
        d.ClearField("row_elements")
    graphs = list(prepared.contract.model.graphs)
    selected = [g for g in graphs if g.capacity.rows <= 2]
    frames = _frames(manifest)
    packer = Packer(selected, manifest.transport, manifest.request_slots, frames, layout_graphs=graphs)
    packer.pack("decode.r2.t2", 0, [PackedLane(slot=3, generation=1, start=4, page_table=[0]),
                                    PackedLane(slot=1, generation=1, start=9, page_table=[1])])
    assert _view(manifest, frames[0], "row_slot")[:2].tolist() == [3, 1]
    width = manifest.max_pages_per_row
    assert _view(manifest, frames[0], "page_table")[3 * width:3 * width + 1].tolist() == [0]


def test_two_lane_snapshot_and_restoration_rounds_keep_both_lanes():
    # spec: BND-8, SRV-7
    # two prompts ending mid-page are snapshotted by one two-row PREFILL, and one two-row
    # RESTORATION copies both partial pages: each restored lane then computes what recomputing
    # its whole prompt computes (docs/spec-gaps.md bug 1: the second lane's rows were dropped)
    from helios_backend.engine.model import ModelOptions, NativeModel
    from helios_backend.lockstep.raw_lanes import RawLanes
    from tests.engine_fixtures import resource_reader
    from tests.test_numpy_executor import PROMPT, RESHAPE_TOLERANCE, VOCAB, prefill_logits

    # one kernel path for every step compared (the product path's f16 activations would add their
    # own rounding between the 64-token and the short steps: docs/kernels.md)
    prepared = prepared_in_memory(product_path_tokens=0)
    model = NativeModel.load(prepared.contract, prepared.manifest, resource_reader(prepared),
                             ModelOptions(cache_pages=24))
    try:
        page_tokens = prepared.contract.model.cache.page_tokens
        other = PROMPT[:8] + [504, 3575, 282, 4649, 314, 7042, 30, 2] + PROMPT[16:]
        assert len(PROMPT) == len(other) and len(PROMPT) % page_tokens == 8
        tails = [[504, 3575, 282, 4649], [1780, 314, 260]]
        expected = [prefill_logits(model, prompt + tail, chunk=64, slot=0)[len(prompt) + len(tail) - 1]
                    for prompt, tail in ((PROMPT, tails[0]), (other, tails[1]))]
        prefill = model.program(C.OPERATION_PREFILL, 2, 2 * len(PROMPT))
        restoration = model.program(C.OPERATION_RESTORATION, 2)
        pages = {0: [1, 2], 1: [3, 4]}                       # slot -> pages of the snapshotted prompts
        for slot in (0, 1, 2, 3):
            model.packer.forget_slot(slot)
        lanes = [PackedLane(slot=s, generation=100, tokens=np.asarray(p, np.int32), page_table=pages[s], snapshot_row=r)
                 for s, p, r in ((0, PROMPT, 2), (1, other, 1))]
        driver = RawLanes(model)
        driver.step(prefill, lanes)
        # slots 2 and 3 share the complete first pages and restore the partial ones into fresh pages
        restored = {2: [1, 10], 3: [3, 11]}
        lanes = [PackedLane(slot=2, generation=100, start=len(PROMPT), page_table=restored[2], restore_row=2),
                 PackedLane(slot=3, generation=100, start=len(other), page_table=restored[3], restore_row=1)]
        assert [int(record[3]) for record in driver.step(restoration, lanes)] == [len(PROMPT)] * 2
        for slot, tail, want in ((2, tails[0], expected[0]), (3, tails[1], expected[1])):
            tokens = np.asarray(tail, np.int32)
            program = model.program(C.OPERATION_PREFILL, 1, tokens.size)
            driver.step(program, [PackedLane(slot=slot, generation=100, start=len(PROMPT), tokens=tokens,
                                       page_table=restored[slot])])
            got = model.executor.buffer_view("scratch.logits", np.float32)[:VOCAB]
            np.testing.assert_allclose(got, want, atol=RESHAPE_TOLERANCE, err_msg=f"slot {slot}")
    finally:
        model.close()


def test_two_concurrent_requests_finish_with_reduced_concurrency(smollm2_core, smollm2_model):
    # spec: SRV-7
    # concurrency 2 selects graphs of at most 2 rows of a 4-slot core; two requests run together
    from helios_backend.lockstep.generator import LockstepGenerator, GenerationRequest
    from helios_backend.scheduler.request import RequestSpec, SamplingSettings
    from helios_backend.engine.responses import Stream
    from helios_backend.engine.engine import Engine
    from helios_backend.engine.settings import StartupOptions
    from tests.engine_fixtures import ACCEPTANCE
    from tests.test_rules_scheduler import Sender

    prompts = [(1, 9690, 253, 6), (1, 9690, 198, 2683, 359, 5356, 2)]
    expected = [LockstepGenerator(smollm2_model).generate([GenerationRequest(list(p), 5)])[0].tokens for p in prompts]
    runtime = Engine.start(StartupOptions(smollm2_core, ACCEPTANCE, concurrency=2))
    try:
        assert runtime.model.concurrency == 2 < runtime.model.execution_manifest.request_slots
        senders = [Sender(), Sender()]
        for serial, (sender, prompt) in enumerate(zip(senders, prompts), start=1):
            runtime.add_request(RequestSpec(prompt, 5, SamplingSettings()), Stream(serial, sender))
        for sender in senders:
            assert sender.done.wait(60)
    finally:
        runtime.stop(drain=True)
    for sender, tokens in zip(senders, expected):
        assert sender.finals[0].terminal.WhichOneof("outcome") == "finished", sender.finals[0]
        assert sender.tokens == tokens and tokens


@pytest.mark.parametrize("group, sources", [
    ("BND-6", [C.VALUE_SOURCE_SLOT, C.VALUE_SOURCE_GENERATION, C.VALUE_SOURCE_LIVE_ROW_COUNT,
               C.VALUE_SOURCE_QUERY_LENGTH, C.VALUE_SOURCE_SPECULATIVE_PREFIX_LIMIT,
               C.VALUE_SOURCE_SAMPLING_DECISION, C.VALUE_SOURCE_MIXED_PREFILL_ROW]),
    ("BND-7", [C.VALUE_SOURCE_PROMPT_TOKENS, C.VALUE_SOURCE_SCORED_TARGET_TOKENS, C.VALUE_SOURCE_PENDING_TOKEN,
               C.VALUE_SOURCE_PROMPT_POSITIONS, C.VALUE_SOURCE_IMAGE_FEATURE_INDICES,
               C.VALUE_SOURCE_IMAGE_CONTEXT_INDICES, C.VALUE_SOURCE_IMAGE_FEATURE_SLOT]),
    ("BND-8", [C.VALUE_SOURCE_PAGE_TABLE, C.VALUE_SOURCE_LIVE_STATE_ROWS, C.VALUE_SOURCE_RESTORE_SOURCE,
               C.VALUE_SOURCE_SNAPSHOT_DESTINATION, C.VALUE_SOURCE_CONSUMED_TOKENS]),
    ("BND-10", [C.VALUE_SOURCE_PROPOSAL_IDS, C.VALUE_SOURCE_PROPOSAL_COUNT, C.VALUE_SOURCE_PROPOSAL_GENERATION,
                C.VALUE_SOURCE_PROPOSAL_CONSUMED, C.VALUE_SOURCE_PROPOSAL_GRAMMAR_MASKS]),
    ("BND-11", [C.VALUE_SOURCE_CONSTANT, C.VALUE_SOURCE_INACTIVE_PADDING]),
])
def test_every_source_of_a_group_is_a_distinct_contract_source(group, sources):
    # spec: BND-6, BND-7, BND-8, BND-10, BND-11
    # each source of the spec's group is its own nonzero enum value, and the decoder accepts
    # a binding of it (to a registered destination; image sources with ModelContract.vision)
    assert len(set(sources)) == len(sources) and C.VALUE_SOURCE_UNSPECIFIED not in sources
    for source in sources:
        contract = sample_contract(3)
        graph = contract.model.graphs[0]
        graph.bindings.add(destination="host_pending", source=source, index=C.INDEX_MODE_SUBMISSION_ROW,
                           constant=5 if source == C.VALUE_SOURCE_CONSTANT else 0)
        if source == C.VALUE_SOURCE_PENDING_TOKEN:
            graph.ClearField("pending_token")
            graph.pending_token.host_destination = "host_pending"
        prepared = _decode(contract, sample_manifest(3))
        decoded = prepared.graphs[0]
        assert any(b.source == source for b in decoded.bindings), C.ValueSource.Name(source)
    contract = sample_contract(3)
    contract.model.graphs[0].bindings.add(destination="host_pending", source=C.VALUE_SOURCE_UNSPECIFIED,
                                          index=C.INDEX_MODE_SUBMISSION_ROW)
    with pytest.raises(ContractError):
        _decode(contract, sample_manifest(3))


def test_constant_sources_write_their_declared_value(prepared):
    # spec: BND-11
    manifest = prepared.manifest
    frames = _frames(manifest)
    graph = _graph(prepared, "decode.r2.t2")
    binding = next(b for b in graph.bindings if b.destination == "prefill_row")
    assert binding.source == C.VALUE_SOURCE_CONSTANT
    packer = Packer(_all_with(prepared, graph), manifest.transport, manifest.request_slots, frames)
    packer.pack("decode.r2.t2", 0, [PackedLane(slot=0, generation=1, start=4, page_table=[1])])
    assert _view(manifest, frames[0], "prefill_row")[0] == binding.constant == -1
    binding.constant = 77
    packer = Packer(_all_with(prepared, graph), manifest.transport, manifest.request_slots, frames)
    packer.pack("decode.r2.t2", 0, [PackedLane(slot=0, generation=1, start=4, page_table=[1])])
    assert _view(manifest, frames[0], "prefill_row")[0] == 77


# ---- BND-14, BND-17: index modes, offsets and padding ------------------------------------

def test_active_rows_leave_the_inactive_tail_untouched(prepared):
    # spec: BND-14
    manifest = prepared.manifest
    lane = [PackedLane(slot=2, generation=3, start=0, tokens=np.array([5], np.int32), page_table=[1])]
    graph = _graph(prepared, "prefill.r2.t64")
    frames = _frames(manifest)
    Packer(_all_with(prepared, graph), manifest.transport, manifest.request_slots, frames).pack("prefill.r2.t64", 0, lane)
    assert _view(manifest, frames[0], "row_slot")[:2].tolist() == [2, -1]         # SUBMISSION_ROW pads
    _rebind(graph, "row_slot", index=C.INDEX_MODE_ACTIVE_ROW)
    _rebind(graph, "query_length", index=C.INDEX_MODE_ACTIVE_ROW)
    frames = _frames(manifest)
    Packer(_all_with(prepared, graph), manifest.transport, manifest.request_slots, frames).pack("prefill.r2.t64", 0, lane)
    untouched = np.full(4, SENTINEL, np.uint8).view(np.int32)[0]
    assert _view(manifest, frames[0], "row_slot")[:2].tolist() == [2, untouched]
    assert _view(manifest, frames[0], "query_length")[:2].tolist() == [1, untouched]
    # the inactive tail keeps whatever an earlier, wider submission wrote there
    two = lane + [PackedLane(slot=0, generation=1, start=0, tokens=np.array([6], np.int32), page_table=[2])]
    packer = Packer(_all_with(prepared, graph), manifest.transport, manifest.request_slots, frames)
    packer.pack("prefill.r2.t64", 0, two)
    packer.pack("prefill.r2.t64", 0, lane)
    assert _view(manifest, frames[0], "row_slot")[:2].tolist() == [2, 0]


def test_offset_and_padding_are_declared_apart_from_the_index_mode(prepared):
    # spec: BND-17
    manifest = prepared.manifest
    lanes = [PackedLane(slot=1, generation=2, start=10, tokens=np.array([4, 5], np.int32), page_table=[3])]
    for offset, padding in ((0, -1), (100, -1), (0, -9), (7, 42)):
        graph = _graph(prepared, "prefill.r2.t64")
        _rebind(graph, "row_slot", offset=offset, padding=padding)            # SUBMISSION_ROW
        _rebind(graph, "positions", offset=offset)                           # PACKED_TOKEN
        _rebind(graph, "live_rows", offset=offset)                           # SCALAR
        frames = _frames(manifest)
        Packer(_all_with(prepared, graph), manifest.transport, manifest.request_slots, frames).pack("prefill.r2.t64", 0, lanes)
        v = lambda name: _view(manifest, frames[0], name)  # noqa: E731
        assert v("row_slot")[:2].tolist() == [1 + offset, padding]          # tail: padding as declared
        assert v("positions")[:2].tolist() == [10 + offset, 11 + offset]
        assert v("live_rows")[0] == 1 + offset
        assert {b.index for b in graph.bindings if b.destination == "row_slot"} == {C.INDEX_MODE_SUBMISSION_ROW}


def test_offsets_apply_to_values_never_to_padding_inside_a_row(prepared):
    # spec: BND-17
    # padding entries inside a row (the short tail of a lane's value, a missing value) carry the
    # bare declared padding, like padding rows (docs/spec-gaps.md bug 2)
    manifest = prepared.manifest
    width = next(d.row_elements for d in manifest.transport.destinations if d.name == "in_eos_ids")
    assert width >= 3
    admission = SlotInitialization.for_prompt([1, 2], prepared.contract.model.vocabulary.histogram_bins, seed=5,
                                     sampling=SamplingParameters(), output_limit=9, eos_ids=(2, 0))
    for offset, padding in ((100, -1), (7, 42), (0, -1)):
        init, mixed = _graph(prepared, "initialization.r2"), _graph(prepared, "mixed.r2.t17")
        _rebind(init, "in_eos_ids", offset=offset, padding=padding)
        _rebind(mixed, "prompt_tokens", offset=offset, padding=padding)
        graphs = [{init.program: init, mixed.program: mixed}.get(g.program, g) for g in prepared.contract.model.graphs]
        frames = _frames(manifest)
        packer = Packer(graphs, manifest.transport, manifest.request_slots, frames)
        packer.pack("initialization.r2", 0, [PackedLane(slot=1, generation=1, initialization=admission)])
        eos = _view(manifest, frames[0], "in_eos_ids")[:2 * width].tolist()
        assert eos == [2 + offset, 0 + offset] + [padding] * (width - 2) + [padding] * width
        packer.pack("mixed.r2.t17", 1, [PackedLane(slot=2, generation=1, start=40, page_table=[6]),     # pending token
                                        PackedLane(slot=0, generation=5, start=3, tokens=np.array([21, 22], np.int32),
                                             page_table=[9])])
        assert _view(manifest, frames[1], "prompt_tokens")[:3].tolist() == [padding, 21 + offset, 22 + offset]


# ---- BND-18, BND-19, BND-31: omitted transfers, scratch, bounded staging ------------------

def test_omitted_transfers_leave_destination_bytes_unchanged(prepared):
    # spec: BND-18
    manifest = prepared.manifest
    frames = _frames(manifest)
    packer = Packer(list(prepared.contract.model.graphs), manifest.transport, manifest.request_slots, frames)
    admission = SlotInitialization.for_prompt([1, 2, 3], prepared.contract.model.vocabulary.histogram_bins, seed=5,
                                     sampling=SamplingParameters(), output_limit=9, eos_ids=(2,))
    packer.pack("initialization.r1", 0, [PackedLane(slot=1, generation=1, initialization=admission)])
    before = frames[0].copy()
    packer.pack("decode.r1.t1", 0, [PackedLane(slot=1, generation=1, start=3, page_table=[4])])
    bound = {b.destination for g in prepared.contract.model.graphs if g.program == "decode.r1.t1" for b in g.bindings}
    assert "in_histogram" not in bound and "in_seeds" not in bound
    changed = np.flatnonzero(frames[0] != before)
    for d in manifest.transport.destinations:
        nbytes = d.elements * 4 if d.dtype != C.DTYPE_U8 else d.elements
        inside = changed[(changed >= d.byte_offset) & (changed < d.byte_offset + nbytes)]
        if d.name not in bound:
            assert inside.size == 0, d.name                   # e.g. INITIALIZATION's admission values
    outside = [i for i in changed if not any(d.byte_offset <= i < d.byte_offset + d.elements * 4
                                             for d in manifest.transport.destinations if d.name in bound)]
    assert outside == []


def test_scratch_buffers_have_no_host_source_and_their_bytes_do_not_matter(smollm2_model):
    # spec: BND-19
    from helios_backend.lockstep.generator import LockstepGenerator, GenerationRequest

    model = smollm2_model
    manifest = model.execution_manifest
    scratch = [b.name for b in manifest.buffers if b.kind == M.BUFFER_KIND_SCRATCH]
    destinations = {d.name for d in manifest.transport.destinations}
    assert scratch and not set(scratch) & destinations
    assert all(b.destination in destinations for g in model.graphs for b in g.bindings)
    prompt = [1, 9690, 253, 2, 28, 5, 17]
    [first] = LockstepGenerator(model).generate([GenerationRequest(prompt, 4, eos_ids=(49151,))])
    rng = np.random.default_rng(3)
    for name in scratch:                     # garbage in every scratch byte: no host value needed
        view = model.executor.buffer_view(name, np.uint8)
        view[:] = rng.integers(0, 256, view.size, dtype=np.uint8)
    [second] = LockstepGenerator(model).generate([GenerationRequest(prompt, 4, eos_ids=(49151,))])
    assert second.tokens == first.tokens and len(first.tokens) == 4


def test_host_staging_is_bounded_and_allocated_once(prepared):
    # spec: BND-31
    manifest = prepared.manifest
    frames = _frames(manifest)
    ids = [id(f) for f in frames]
    packer = Packer(list(prepared.contract.model.graphs), manifest.transport, manifest.request_slots, frames)
    assert manifest.transport.frames == 2
    # every destination of every graph lies inside the fixed frame
    for d in manifest.transport.destinations:
        assert d.byte_offset + d.elements * 4 <= manifest.transport.frame_nbytes
    for step in range(20):
        lanes = [PackedLane(slot=s, generation=step + 1, start=step, tokens=np.arange(1 + s, dtype=np.int32),
                      page_table=list(range(1 + step // 4))) for s in range(2)]
        packer.pack("prefill.r2.t64", step % 2, lanes)
    with pytest.raises(CapacityError):       # more than the largest variant is refused, never grown
        packer.pack("prefill.r2.t64", 0, [PackedLane(slot=0, generation=1, tokens=np.arange(65, dtype=np.int32))])
    assert [id(f) for f in frames] == ids
    assert all(f.nbytes == manifest.transport.frame_nbytes for f in frames)


# ---- BND-35: bound buffers live through execution drain -------------------------------

def test_bound_buffers_stay_alive_until_the_worker_drained(smollm2_core):
    # spec: BND-35
    from helios_backend.scheduler.request import RequestSpec, SamplingSettings
    from helios_backend.engine.engine import Engine
    from helios_backend.engine.settings import StartupOptions
    from tests.engine_fixtures import ACCEPTANCE
    from tests.test_rules_scheduler import Sender

    runtime = Engine.start(StartupOptions(smollm2_core, ACCEPTANCE))
    closed_while_worker_alive: list[bool] = []
    original_close = runtime.model.executor.close

    def close() -> None:
        closed_while_worker_alive.append(runtime.loop.alive)
        original_close()

    runtime.model.executor.close = close  # type: ignore[method-assign]
    from helios_backend.engine.responses import Stream
    senders = [Sender(), Sender()]
    for serial, sender in enumerate(senders, start=1):
        runtime.add_request(RequestSpec((1, 9690, 253, 5 + serial), 5, SamplingSettings()), Stream(serial, sender))
    runtime.stop(drain=True)
    assert closed_while_worker_alive == [False]          # released only after the drain
    for sender in senders:
        assert len(sender.finals) == 1 and len(sender.tokens) == 5
        assert sender.finals[0].terminal.WhichOneof("outcome") == "finished"


# ---- BND-22, BND-28, BND-29: tuned bindings ---------------------------------------------

def test_tuned_binding_declares_its_buffer_and_producer():
    # spec: BND-22
    prepared = _decode(sample_contract(2), sample_manifest(2))
    prefill = next(g for g in prepared.graphs if g.program == "prefill_r1")
    assert [(t.buffer, t.producer) for t in prefill.tuned_bindings] == [("gemm_config", "tune_gemm")]
    for field in ("buffer", "producer"):
        contract = sample_contract(2)
        tuned = contract.model.graphs[0].tuned_bindings[0]
        setattr(tuned, field, "")
        with pytest.raises(ContractError) as info:
            _decode(contract, sample_manifest(2))
        assert info.value.field.endswith(f"tuned_bindings[0].{field}")


def _toy_with_two_producers():
    from tests.gpu import toy_manifest as toy

    manifest = toy.build(n=100, chains={"chain": 3}, nops={"nops": (4, 1)})
    first = manifest.tuning[0]
    second = manifest.tuning.add()
    second.CopyFrom(first)
    second.name = "tune_again"
    return toy, manifest


class RecordingDriver:
    """The fake CUDA driver, recording graph launches and host<->device copies in order."""

    def __new__(cls):  # type: ignore[no-untyped-def]
        from tests.gpu.fake_driver import FakeDriver

        class _Recording(FakeDriver):
            def __init__(self) -> None:
                super().__init__()
                self.events: list[tuple[str, object]] = []

            def cuGraphLaunch(self, graph_exec, stream):  # type: ignore[no-untyped-def]
                self.events.append(("launch", graph_exec))
                return super().cuGraphLaunch(graph_exec, stream)

            def cuMemcpyDtoH(self, dst, src, nbytes):  # type: ignore[no-untyped-def]
                self.events.append(("read", src))
                return super().cuMemcpyDtoH(dst, src, nbytes)

        return _Recording()


def test_startup_runs_every_tuning_producer_before_serving_graphs_are_exposed():
    # spec: BND-28, BND-29
    from helios_backend.executors.cuda_executor import CudaExecutor, CudaExecutorOptions

    toy, manifest = _toy_with_two_producers()
    driver = RecordingDriver()
    executor = CudaExecutor(manifest, toy.resources(b"\0" * 64, 100).__getitem__,
                            CudaExecutorOptions(cache_pages=2), driver=driver)
    graphs = driver.graphs
    tuning_execs = [i for i, launches in enumerate(graphs) if [l.function for l in launches] == ["toy_fill"]]
    assert len(tuning_execs) == 2
    startup = list(driver.events)
    # each producer graph ran exactly once, unconditionally, before the constructor returned
    assert sorted(e for kind, e in startup if kind == "launch") == tuning_execs
    # the host made no choice: it read nothing back from the device to decide anything
    assert [e for e in startup if e[0] == "read"] == []
    executor.launch("chain", 0)
    executor.wait(0)
    serving = [e for kind, e in driver.events[len(startup):] if kind == "launch"]
    assert serving and not set(serving) & set(tuning_execs)   # serving never re-runs tuning
    executor.close()


# ---- CON-7 (re-checked): physical page ids do not change results -------------------------

def test_results_do_not_depend_on_page_ids_when_the_page_table_really_changes(smollm2_model):
    # spec: CON-7, BND-34
    # generations come from the model (NativeModel.generations), so each run re-uploads the
    # slot's page table (BND-34); forgetting the slot as well keeps the check independent of that.
    from helios_backend.lockstep.generator import GenerationRequest
    from helios_backend.lockstep.raw_lanes import RawLanes

    model = smollm2_model
    manifest = model.execution_manifest
    width = manifest.max_pages_per_row
    slot = 3
    prompt = [1, 9690, 198, 2683, 359, 5356, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198]
    runs = []
    for order in ([0, 1, 2, 3, 4, 5], [97, 3, 41, 12, 100, 7]):
        model.packer.forget_slot(slot)
        [result] = RawLanes(model, page_order=order).generate([GenerationRequest(prompt, 4, eos_ids=(49151,))],
                                                            slots=[slot])
        table = _view(manifest, model.executor.staging(0), "page_table")[slot * width:slot * width + 2].tolist()
        logits = model.executor.buffer_view("scratch.logits", np.float32)[:model.contract.model.vocabulary.sampled_tokens]
        runs.append((result.tokens, table, logits.copy()))
    (tokens_a, table_a, logits_a), (tokens_b, table_b, logits_b) = runs
    assert table_a == [0, 1] and table_b == [97, 3]           # the programs really read other pages
    assert tokens_a == tokens_b and len(tokens_a) == 4
    assert np.array_equal(logits_a, logits_b)
