"""Shared packing over the recorded transport: index modes, padding, page-table uploads."""
from __future__ import annotations

import numpy as np
import pytest
from helios_proto import contract_pb2 as C

from helios_backend.packing import SlotInitialization, CapacityError, PackedLane, Packer, PackingError
from helios_backend.sampling_parameters import SamplingParameters
from tests.engine_fixtures import prepared_in_memory

SENTINEL = 0x5A


@pytest.fixture(scope="module")
def setup():
    prepared = prepared_in_memory()
    manifest = prepared.manifest
    frames = [np.full(manifest.transport.frame_nbytes, SENTINEL, dtype=np.uint8) for _ in range(2)]
    packer = Packer(list(prepared.contract.model.graphs), manifest.transport, manifest.request_slots, frames)
    destinations = {d.name: d for d in manifest.transport.destinations}

    def view(frame: int, name: str, dtype=np.int32) -> np.ndarray:
        d = destinations[name]
        return frames[frame][d.byte_offset:d.byte_offset + d.elements * np.dtype(dtype).itemsize].view(dtype)

    return prepared, packer, frames, view


def test_submission_rows_pad_the_whole_capacity(setup):
    # spec: BND-15, BND-16, BND-13
    _, packer, _, view = setup
    lanes = [PackedLane(slot=2, generation=7, start=5, tokens=np.array([11, 12, 13], np.int32), page_table=[4])]
    packer.pack("prefill.r2.t64", 0, lanes)
    assert view(0, "row_slot")[:2].tolist() == [2, -1]
    assert view(0, "query_length")[:2].tolist() == [3, 0]
    assert view(0, "live_rows")[0] == 1
    assert view(0, "prompt_tokens")[:3].tolist() == [11, 12, 13]
    assert view(0, "positions")[:3].tolist() == [5, 6, 7]
    assert view(0, "grammar_mask", np.uint32)[:2].tolist() == [0xFFFFFFFF, 0xFFFFFFFF]   # padding -1: all allowed


def test_packed_tokens_follow_each_lanes_actual_count(setup):
    # spec: BND-16
    _, packer, _, view = setup
    lanes = [PackedLane(slot=0, generation=1, start=9, page_table=[1]),                       # device pending token
             PackedLane(slot=1, generation=1, start=0, tokens=np.array([5, 6, 7, 8], np.int32), page_table=[2])]
    packer.pack("mixed.r2.t17", 1, lanes)
    # the pending lane's token is the padding (-1): what tokens.select_input.v2 tells host-fed rows by
    assert view(1, "prompt_tokens")[:5].tolist() == [-1, 5, 6, 7, 8]
    assert view(1, "positions")[:5].tolist() == [9, 0, 1, 2, 3]
    packer.pack("decode.r2.t2", 1, lanes[:1])
    assert view(1, "prefill_row")[0] == -1                                            # CONSTANT binding


def test_page_tables_upload_only_new_entries_and_generation_resets(setup):
    # spec: BND-33, BND-34
    prepared, packer, frames, view = setup
    width = prepared.manifest.max_pages_per_row
    slot = 3
    row = lambda: view(0, "page_table")[slot * width:(slot + 1) * width]  # noqa: E731
    packer.pack("decode.r1.t1", 0, [PackedLane(slot=slot, generation=1, start=0, page_table=[10, 11])])
    assert row()[:2].tolist() == [10, 11]
    row()[:2] = -7                                   # pretend the host bytes were reused: only new entries move
    packer.pack("decode.r1.t1", 0, [PackedLane(slot=slot, generation=1, start=20, page_table=[10, 11, 12])])
    assert row()[:3].tolist() == [-7, -7, 12]
    packer.pack("decode.r1.t1", 0, [PackedLane(slot=slot, generation=2, start=0, page_table=[30])])
    assert row()[:3].tolist() == [30, -7, 12]        # new generation: rewritten from entry 0
    # the other frame remembers separately
    packer.pack("decode.r1.t1", 1, [PackedLane(slot=slot, generation=2, start=0, page_table=[30])])
    assert view(1, "page_table")[slot * width] == 30


def test_admission_values_for_initialization(setup):
    # spec: BND-9, BND-32
    prepared, packer, _, view = setup
    bins = prepared.contract.model.vocabulary.histogram_bins
    admission = SlotInitialization.for_prompt([5, 5, 9], bins, seed=(7 << 32) | 3, sampling=SamplingParameters(0.5, 0.9),
                                     output_limit=17, eos_ids=(2, 0))
    packer.pack("initialization.r2", 0, [PackedLane(slot=1, generation=4, initialization=admission)])
    assert view(0, "in_seeds", np.uint32)[:2].tolist() == [3, 7]
    assert view(0, "in_output_limit")[0] == 17
    assert view(0, "in_eos_ids")[:4].tolist() == [2, 0, -1, -1]
    histogram = view(0, "in_histogram")[:bins]
    assert histogram[5] == 2 and histogram[9] == 1 and histogram.sum() == 3
    assert view(0, "in_sampling", np.float32)[:2].tolist() == pytest.approx([0.5, 0.9])


def test_capacity_is_checked(setup):
    _, packer, _, _ = setup
    with pytest.raises(CapacityError):
        packer.pack("decode.r1.t1", 0, [PackedLane(slot=0, generation=1), PackedLane(slot=1, generation=1)])
    with pytest.raises(CapacityError):
        packer.pack("prefill.r1.t16", 0, [PackedLane(slot=0, generation=1, tokens=np.arange(17, dtype=np.int32))])


def test_unregistered_destination_and_unpackable_pairs_fail_at_startup(setup):
    # spec: BND-4, BND-30
    prepared, _, frames, _ = setup
    graph = C.GraphContract()
    graph.CopyFrom(prepared.contract.model.graphs[0])
    graph.bindings.add(destination="no_such_destination", source=C.VALUE_SOURCE_SLOT,
                       index=C.INDEX_MODE_SUBMISSION_ROW)
    with pytest.raises(PackingError, match="not registered"):
        Packer([graph], prepared.manifest.transport, prepared.manifest.request_slots, frames)
    graph.CopyFrom(prepared.contract.model.graphs[0])
    graph.bindings.add(destination="live_rows", source=C.VALUE_SOURCE_SLOT, index=C.INDEX_MODE_SCALAR)
    with pytest.raises(PackingError, match="no scalar value"):
        Packer([graph], prepared.manifest.transport, prepared.manifest.request_slots, frames)


def test_prompt_histogram_counts_each_id_below_the_bins():
    """BND-32: the INITIALIZATION histogram counts every prompt id below histogram_bins (ids
    past them are not counted), as a bincount of the prompt would."""
    # spec: BND-32
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 700, 300).tolist() + [5, 5, 5]
    admission = SlotInitialization.for_prompt(prompt, 512, seed=1, sampling=SamplingParameters(), output_limit=4,
                                              eos_ids=(2,))
    expected = np.bincount([t for t in prompt if t < 512], minlength=512)
    assert admission.prompt_histogram.dtype == np.int32
    assert np.array_equal(admission.prompt_histogram, expected)
    with pytest.raises(ValueError):
        SlotInitialization.for_prompt([3, -1], 512, seed=1, sampling=SamplingParameters(), output_limit=4, eos_ids=())
