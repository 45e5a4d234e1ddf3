"""The vectorized Packer writes exactly the bytes of the straightforward per-row writer.

Random sequences of submissions (every recorded program of the test core and of a core with
speculative variants; random lanes; bindings re-tuned with offsets, paddings and ACTIVE_ROW)
go through both packers over frames that start with the same random bytes; after every pack
both frames must be equal byte for byte, page-table memory, remembered padding and
forget_slot included.
"""
from __future__ import annotations

import numpy as np
import pytest
from helios_proto import contract_pb2 as C
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helios_backend.packing import SlotInitialization, PackedLane, Packer, PackingError
from helios_backend.sampling_parameters import SamplingParameters
from tests.engine_fixtures import prepared_in_memory
from tests.packing_reference import ReferencePacker

SPECULATIVE = ((2, 1, 0, 2), (2, 4, 3, 8), (2, 4, 3, 5, 1))     # as tests/test_speculative_host.py


@pytest.fixture(scope="module", params=["plain", "speculative"])
def prepared(request):
    return prepared_in_memory() if request.param == "plain" else prepared_in_memory(speculative_variants=SPECULATIVE)


def _tuned(graphs, rng: np.random.Generator) -> list[C.GraphContract]:
    """Copies of the graphs with random offsets and paddings, some row bindings ACTIVE_ROW."""
    out = []
    for graph in graphs:
        g = C.GraphContract()
        g.CopyFrom(graph)
        for b in g.bindings:
            if rng.random() < 0.5:
                b.offset = int(rng.choice([0, 7, -3, 100, 1 << 20]))
                b.padding = int(rng.choice([0, -1, 42, -9]))
            if b.index == C.INDEX_MODE_SUBMISSION_ROW and rng.random() < 0.3:
                b.index = C.INDEX_MODE_ACTIVE_ROW
        out.append(g)
    return out


def _maybe(rng: np.random.Generator, p: float, make):
    return make() if rng.random() < p else None


def _logit_bias(rng: np.random.Generator, vocab: int) -> dict[str, np.ndarray]:
    if rng.random() < 0.6:
        return {}
    ids = rng.choice(vocab, int(rng.integers(0, 301)), replace=False).astype(np.int32)
    return {"logit_bias_ids": ids, "logit_bias_values": rng.uniform(-100, 100, ids.size).astype(np.float32)}


def _lanes(rng: np.random.Generator, graph: C.GraphContract, prepared) -> list[PackedLane]:
    manifest, vocab = prepared.manifest, prepared.contract.model.vocabulary
    slots, width = manifest.request_slots, manifest.max_pages_per_row
    mask_words = -(-vocab.sampled_tokens // 32)
    rows, tokens = graph.capacity.rows, graph.capacity.tokens
    count = int(rng.integers(0, rows + 1))
    # a round where no lane has a mask or a bias: the packer may skip padding it remembers
    plain = rng.random() < 0.4
    slot_ids = rng.choice(slots, count, replace=rng.random() < 0.15)       # sometimes one slot twice
    lanes = []
    for slot in slot_ids.tolist():
        token_lane = graph.operation not in (C.OPERATION_DECODE, C.OPERATION_RESUME) and rng.random() < 0.6
        lane = PackedLane(slot=slot, generation=int(rng.integers(1, 4)), start=int(rng.integers(0, 400)),
                    tokens=rng.integers(0, vocab.sampled_tokens, int(rng.integers(1, 20))).astype(np.int32)
                    if token_lane else None,
                    sample=bool(rng.random() < 0.7),
                    page_table=[int(p) for p in
                                rng.integers(0, 96, int(rng.integers(0, width + 1 + (rng.random() < 0.02))))],
                    grammar_mask=_maybe(rng, 0 if plain else 0.3, lambda: rng.integers(0, 1 << 32, int(rng.choice(
                        [mask_words, mask_words - 5])), dtype=np.uint64).astype(np.uint32)),
                    snapshot_row=int(rng.integers(-1, 4)), restore_row=int(rng.integers(-1, 4)),
                    **({} if plain else _logit_bias(rng, vocab.sampled_tokens)),
                    pending_token=int(rng.integers(-1, vocab.sampled_tokens)),
                    scored_targets=_maybe(rng, 0.5, lambda: rng.integers(-1, 100, int(rng.integers(0, 25)))),
                    proposals=_maybe(rng, 0.5, lambda: rng.integers(0, 100, int(rng.integers(0, 4))).astype(np.int32)),
                    proposal_generation=int(rng.integers(-1, 4)), proposal_consumed=int(rng.integers(-1, 400)),
                    prefix_limit=int(rng.choice([0, 0, 2, 5])))
        if graph.operation == C.OPERATION_INITIALIZATION:
            prompt = rng.integers(0, vocab.sampled_tokens, int(rng.integers(1, 30)))
            lane.initialization = SlotInitialization.for_prompt(
                prompt, vocab.histogram_bins, int(rng.integers(0, 1 << 62)),
                SamplingParameters(float(rng.random()), float(rng.random()), int(rng.integers(0, 50))),
                int(rng.integers(1, 500)), tuple(int(e) for e in rng.integers(0, 100, int(rng.integers(1, 5)))))
        lanes.append(lane)
    if graph.operation == C.OPERATION_MIXED:            # one prefill row at most
        for lane in [lane for lane in lanes if lane.tokens is not None][1:]:
            lane.tokens = None
    if tokens:
        while lanes and sum(lane.query_len for lane in lanes) > tokens:
            lanes.pop()
    return lanes


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_packer_writes_the_bytes_of_the_per_row_writer(prepared, seed):
    rng = np.random.default_rng(seed)
    graphs = _tuned(prepared.contract.model.graphs, rng) if rng.random() < 0.7 else list(prepared.contract.model.graphs)
    _packs_equal(prepared, graphs, graphs, rng)


@pytest.fixture(scope="module")
def wide():
    return prepared_in_memory(admission_rows=(1, 2, 4, 8), decode_rows=(1, 2, 4, 8))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_packer_writes_the_bytes_of_the_per_row_writer_while_the_largest_programs_never_run(wide, seed):
    """The destinations' rows past the programs that run are never known to hold the padding
    (the remembered tail stays at the largest program's end): what the smaller programs leave
    padded after their lanes (the window) must still be exact, lane counts up and down."""
    rng = np.random.default_rng(seed)
    graphs = _tuned(wide.contract.model.graphs, rng) if rng.random() < 0.3 else list(wide.contract.model.graphs)
    largest = max(g.capacity.rows for g in graphs)
    _packs_equal(wide, graphs, [g for g in graphs if g.capacity.rows < largest], rng, steps=24)


def _packs_equal(prepared, graphs, run, rng: np.random.Generator, steps: int = 12) -> None:
    """Packer and ReferencePacker over `graphs`, `steps` packs of programs drawn from `run`."""
    manifest = prepared.manifest
    start = rng.integers(0, 256, manifest.transport.frame_nbytes, dtype=np.uint8)
    frames = [start.copy() for _ in range(2)]
    expected = [start.copy() for _ in range(2)]
    packer = Packer(graphs, manifest.transport, manifest.request_slots, frames)
    reference = ReferencePacker(graphs, manifest.transport, manifest.request_slots, expected)
    destinations = list(manifest.transport.destinations)
    for _ in range(steps):
        graph = run[int(rng.integers(len(run)))]
        frame = int(rng.integers(2))
        lanes = _lanes(rng, graph, prepared)
        if rng.random() < 0.1:
            slot = int(rng.integers(manifest.request_slots))
            packer.forget_slot(slot)
            reference.forget_slot(slot)
        try:
            reference.pack(graph.program, frame, lanes)
        except ValueError as error:                     # both refuse it (the frames are then unspecified)
            with pytest.raises(type(error) if isinstance(error, PackingError) else ValueError):
                packer.pack(graph.program, frame, lanes)
            return
        packer.pack(graph.program, frame, lanes)
        for f in range(2):
            if not np.array_equal(frames[f], expected[f]):
                differ = [d.name for d in destinations
                          if not np.array_equal(frames[f][d.byte_offset:d.byte_offset + d.elements * 4],
                                                expected[f][d.byte_offset:d.byte_offset + d.elements * 4])]
                pytest.fail(f"{graph.program} frame {f}: destinations differ: {differ}")



def _runners(prepared, rng: np.random.Generator, count: int, eos: tuple[int, ...]):
    """`count` ProgramRunners over packers of the same graphs (re-tuned 7 times in 10), each with
    two frames that start with the same random bytes; no executor: nothing is launched."""
    from helios_backend.engine.runner import ProgramRunner

    manifest, vocab = prepared.manifest, prepared.contract.model.vocabulary
    graphs = _tuned(prepared.contract.model.graphs, rng) if rng.random() < 0.7 else list(prepared.contract.model.graphs)
    start = rng.integers(0, 256, manifest.transport.frame_nbytes, dtype=np.uint8)
    frames = [[start.copy() for _ in range(2)] for _ in range(count)]
    runners = [ProgramRunner(None, Packer(graphs, manifest.transport, manifest.request_slots, f),  # type: ignore
                             manifest.completion, vocab.sampled_tokens, vocab.histogram_bins, eos) for f in frames]
    return graphs, frames, runners


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_runner_columns_write_the_bytes_of_its_packed_lanes(prepared, seed):
    """A DECODE / MIXED / PREFILL step whose lanes carry no host values is packed as columns
    (ProgramRunner._pack_columns, no PackedLane per lane): the frames equal those of the same
    lanes packed one PackedLane each, round after round (page-table memory included), and so do
    they as a DecodeBlock (its leading plain decode lanes as columns, the rest explicit)."""
    from helios_backend.scheduler.decode_block import DecodeBlock
    from helios_backend.scheduler.plan import PENDING_TOKEN, Lane, Submission, Variant
    from helios_backend.scheduler.request import Request, RequestSpec, SamplingSettings

    rng = np.random.default_rng(seed)
    manifest, vocab = prepared.manifest, prepared.contract.model.vocabulary
    graphs, (frames, expected, blocked), runners = _runners(prepared, rng, 3, (2,))
    steps = [g for g in graphs if g.operation in (C.OPERATION_DECODE, C.OPERATION_MIXED, C.OPERATION_PREFILL)]
    width = manifest.max_pages_per_row
    for _ in range(10):
        graph = steps[int(rng.integers(len(steps)))]
        rows, capacity = graph.capacity.rows, graph.capacity.tokens
        lanes: list[Lane] = []
        for slot in rng.choice(manifest.request_slots, int(rng.integers(0, rows + 1)), replace=False).tolist():
            req = Request(slot, RequestSpec(tuple(range(3, 9)), 8, SamplingSettings()), slot)
            req.pages = [int(p) for p in rng.integers(0, 96, int(rng.integers(1, width + 1)))]
            req.slot, req.generation = slot, int(rng.integers(1, 4))
            host_fed = graph.operation != C.OPERATION_DECODE and rng.random() < 0.4
            tokens = rng.integers(0, vocab.sampled_tokens, int(rng.integers(1, 9))).tolist() if host_fed \
                else [PENDING_TOKEN]
            lanes.append(Lane(req, slot, req.generation, int(rng.integers(0, 400)), tokens,
                              bool(rng.random() < 0.8), 8, snapshot_row=int(rng.integers(-1, 4))))
        if graph.operation == C.OPERATION_MIXED:                    # one host-fed row at most
            for lane in [lane for lane in lanes if lane.tokens != [PENDING_TOKEN]][1:]:
                lane.tokens = [PENDING_TOKEN]
        while capacity and lanes and sum(len(lane.tokens) for lane in lanes) > capacity:
            lanes.pop()
        sub = Submission(Variant(graph.operation, graph.program, rows, capacity), lanes)
        frame = int(rng.integers(2))
        runners[0]._pack_columns(sub, frame)
        runners[1].packer.pack(graph.program, frame, [runners[1]._packed(lane, graph.operation) for lane in lanes])
        plain = 0                                  # the leading lanes a block holds as columns
        while plain < len(lanes) and lanes[plain].tokens == [PENDING_TOKEN] and lanes[plain].sample \
                and lanes[plain].snapshot_row == -1:
            plain += 1
        block = DecodeBlock.of([lane.request for lane in lanes[:plain]], [lane.start for lane in lanes[:plain]],
                               [lane.output_limit for lane in lanes[:plain]])
        for lane in lanes[plain:]:
            block.append(lane)
        runners[2]._pack_columns(Submission(sub.variant, block), frame)
        for f in range(2):
            assert np.array_equal(frames[f], expected[f]), f"{graph.program} frame {f}"
            assert np.array_equal(blocked[f], expected[f]), f"{graph.program} frame {f} from a block"


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_runner_initialization_columns_write_the_bytes_of_its_packed_lanes(prepared, seed):
    """INITIALIZATION lanes packed as columns (ProgramRunner._pack_initialization: seed words,
    sampling vectors and EOS ids as [lanes, k] arrays, every lane's prompt counted in one call)
    equal the same lanes packed one PackedLane each, round after round over the same rows: a row
    whose request, seed, sampling, EOS choice or prompt differs from the round before gets the
    new values, and the rows earlier counts left are cleared (the remembered padding)."""
    from helios_backend.scheduler.plan import Lane, Submission, Variant
    from helios_backend.scheduler.request import Request, RequestSpec, SamplingSettings

    rng = np.random.default_rng(seed)
    manifest, vocab = prepared.manifest, prepared.contract.model.vocabulary
    eos = tuple(int(e) for e in rng.integers(0, 100, int(rng.integers(1, 4))))
    graphs, (frames, expected), runners = _runners(prepared, rng, 2, eos)
    steps = [g for g in graphs if g.operation == C.OPERATION_INITIALIZATION]
    assert all(runners[0]._initializes_columns(g.program) for g in steps)   # the columns are what is tested
    for _ in range(8):
        graph = steps[int(rng.integers(len(steps)))]
        lanes: list[Lane] = []
        for slot in rng.choice(manifest.request_slots, int(rng.integers(1, graph.capacity.rows + 1)),
                               replace=False).tolist():
            prompt = tuple(int(t) for t in rng.integers(0, vocab.histogram_bins + 50, int(rng.integers(1, 40))))
            sampling = SamplingSettings(float(rng.random()), float(rng.random()), int(rng.integers(0, 50)),
                                        seed=int(rng.integers(0, 1 << 63)))
            req = Request(slot, RequestSpec(prompt, 64, sampling, ignore_eos=bool(rng.random() < 0.3)), slot)
            if rng.random() < 0.3:                  # readmitted: its output counts too
                req.tokens.extend(int(t) for t in rng.integers(0, vocab.sampled_tokens, int(rng.integers(1, 9))))
            begin = int(rng.integers(0, len(req.tokens)))
            lanes.append(Lane(req, slot, int(rng.integers(1, 4)), begin, list(req.tokens[begin:]), True,
                              int(rng.integers(1, 500)), initialize=True))
        sub = Submission(Variant(graph.operation, graph.program, graph.capacity.rows, 0), lanes)
        frame = int(rng.integers(2))
        runners[0]._pack(sub, frame)
        runners[1].packer.pack(graph.program, frame, [runners[1]._packed(lane, graph.operation) for lane in lanes])
        for f in range(2):
            assert np.array_equal(frames[f], expected[f]), f"{graph.program} frame {f}"


def test_counts_of_prompts_are_each_prompts_own_counts_past_the_bins_left_out() -> None:
    prompts = [[5, 9, 5, 1], [], [3, 70, 64, 2, 3], [63]]
    counts = SlotInitialization.counts_of_prompts(prompts, 64)
    for prompt, got in zip(prompts, counts):
        want = SlotInitialization.for_prompt(prompt, 64, 0, SamplingParameters(), 1, ()).prompt_counts
        assert got.ids.tolist() == want.ids.tolist() == [i for i in prompt if i < 64]
        assert np.array_equal(got.dense(), want.dense())
    assert [c.ids.tolist() for c in SlotInitialization.counts_of_prompts([[1, 2], [3]], 64)] == [[1, 2], [3]]
    with pytest.raises(ValueError, match="prompt token id -4 is negative"):
        SlotInitialization.counts_of_prompts([[1, 2], [3, -4]], 64)
