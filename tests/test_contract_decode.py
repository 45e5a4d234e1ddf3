"""PreparedContract.decode on valid contracts: versions, views, defaults, ignored catalogs."""
from __future__ import annotations

import dataclasses

import pytest

from helios_backend.contract import ContractError, PreparedContract
from helios_proto import contract_pb2 as c
from tests.contract_samples import SAMPLE_RESOURCE_IDS, sample_contract, sample_manifest


def decode(version: int = 3, contract=None, manifest=None) -> PreparedContract:
    return PreparedContract.decode(
        contract if contract is not None else sample_contract(version),
        manifest if manifest is not None else sample_manifest(version),
        resource_ids=SAMPLE_RESOURCE_IDS,
    )


@pytest.mark.parametrize("version", [1, 2, 3])
def test_versions_1_2_3_decode(version):
    # spec: CON-1, CON-2, FMT-8, OWN-3
    prepared = decode(version)
    assert prepared.versions.contract == version
    assert prepared.served_id == "sample-model"
    assert prepared.model_ids == ("sample-model", "sample")


@pytest.mark.parametrize("version", [0, 4, 99])
def test_unsupported_versions_are_rejected(version):
    # spec: CON-1, CON-13
    contract = sample_contract(3)
    contract.model.version = version
    with pytest.raises(ContractError) as info:
        decode(contract=contract)
    assert info.value.field == "model.version"


def test_older_versions_fill_defaults():
    # spec: FMT-8: what later versions added reads as its default
    v1 = decode(1)
    assert v1.vision is None
    assert all(g.tuned_bindings == () and g.speculative is None for g in v1.graphs)
    assert all(g.cursor.expected_draft_cursor(10) == -1 for g in v1.graphs)  # CACHE-12
    assert c.OPERATION_SPECULATIVE not in v1.graphs_by_operation


def test_typed_views():
    # spec: SRV-1..6, CON-3..9
    p = decode(3)
    assert p.extents.context_tokens == 256 and p.extents.prefill_tokens == 64
    assert p.extents.prepared_pages == 32 and p.extents.prepared_snapshots == 4
    assert p.extents.concurrency == 4 and p.extents.speculative_widths == (4,)
    assert p.cache_identity.label == "sample-model/f16"
    assert p.vocabulary.is_sampled(99) and not p.vocabulary.is_sampled(100)
    assert p.vocabulary.is_input(100) and 100 in p.vocabulary.image_sentinels  # CON-5
    assert p.vision.patch_capacities == (64,)
    assert p.cache.page_tokens == 16 and p.cache.regions[0].kind == c.HISTORY_KIND_PAGED_KV
    assert p.frontend.tool_parser == c.TOOL_PARSER_QWEN_CODER_FUNCTION_TAGS
    assert p.frontend.tool_syntax.block_open == "<tool_call>"
    assert p.defaults.sampling.top_p == pytest.approx(0.9)
    assert p.defaults.eos_token_ids == (2,)
    assert p.defaults.max_output_tokens == 128 and p.defaults.queue_capacity is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.served_id = "other"  # type: ignore[misc]


def test_graphs_by_operation_and_capacity():
    # spec: BND-1, BND-2, OWN-21
    p = decode(3)
    assert [g.program for g in p.graphs_for(c.OPERATION_DECODE)] == ["decode_r4"]
    assert p.select(c.OPERATION_DECODE, rows=3).program == "decode_r4"
    assert p.select(c.OPERATION_DECODE, rows=5) is None  # outside prepared capacities
    assert p.select(c.OPERATION_PREFILL, rows=1, tokens=65) is None


def test_speculative_view():
    # spec: SPEC-6..13, SPEC-22, CACHE-11
    spec_graph = decode(3).graphs_for(c.OPERATION_SPECULATIVE)[0]
    spec = spec_graph.speculative
    assert (spec.batch_capacity, spec.draft_tokens, spec.token_capacity, spec.packed_token_capacity) == (4, 3, 4, 16)
    assert spec.lane_limit == 4  # min(D + 1, W)
    assert spec.lane_limit_for(output_tokens_left=2, context_tokens_left=10) == 2  # SPEC-14
    assert spec.lane_limit_for(output_tokens_left=10, context_tokens_left=3) == 3
    assert spec.lane_limit_for(output_tokens_left=10, context_tokens_left=10) == 4
    assert spec.device_allocates  # SPECULATIVE_PREFIX_LIMIT bound
    assert spec_graph.cursor.expected_draft_cursor(5) == 4
    assert spec_graph.cursor.expected_draft_cursor(0) == 0


def test_state_rows_per_request_is_the_maximum_of_selected_graphs():
    # spec: STA-9, STA-10
    p = decode(3)
    assert p.state_rows_per_request() == 2
    assert p.state_rows_per_request(p.graphs_for(c.OPERATION_DECODE)) == 1


def test_different_buffers_may_share_a_source():
    # spec: OWN-7: the sample prefill binds QUERY_LENGTH to two destinations
    prefill = decode(3).graphs_for(c.OPERATION_PREFILL)[0]
    sources = [b.source for b in prefill.bindings]
    assert sources.count(c.VALUE_SOURCE_QUERY_LENGTH) == 2


@pytest.mark.parametrize("abi", ["", "helios-abi6", "helios-abi999-from-the-future"])
def test_execution_abi_labels_do_not_gate_loading(abi):
    # spec: FMT-6, FMT-7
    manifest = sample_manifest(3)
    manifest.abi = abi
    assert decode(manifest=manifest).versions.execution_abi == abi


def test_rebuild_manifest_never_selects_or_rejects():
    # spec: SRV-18, SRV-19, SRV-20
    plain = decode(3)
    contract = sample_contract(3)
    rebuild = contract.rebuild
    rebuild.catalog_version = 987654  # unknown to this runtime
    rebuild.recipe = "sample"
    catalog = rebuild.weight_catalogs.add(rank=7)
    catalog.tensors.add(name="w", buffer="no-such-buffer", dtype=0)  # zero enum, unknown buffer: ignored
    rebuild.MergeFromString(b"\x98\x06\x01")  # field 99 from a newer catalog version
    with_rebuild = decode(contract=contract)
    assert with_rebuild == plain


def test_rebuild_manifest_missing_fields_leave_the_contract_unchanged():
    # spec: SRV-19
    contract = sample_contract(3)
    contract.rebuild.SetInParent()  # present but empty
    assert decode(contract=contract) == decode(3)


def _two_ranks(contract, manifest):
    """Duplicate every rank-0 program, buffer and graph onto rank 1."""
    manifest.world_size = 2
    for buffer in list(manifest.buffers):
        copy = manifest.buffers.add()
        copy.CopyFrom(buffer)
        copy.rank = 1
    for program in list(manifest.programs):
        copy = manifest.programs.add()
        copy.CopyFrom(program)
        copy.rank, copy.name = 1, program.name + ".rank1"
    for program in list(manifest.tuning):   # each rank's tuned buffers are filled by that rank's producer
        copy = manifest.tuning.add()
        copy.CopyFrom(program)
        copy.rank = 1
    for graph in list(contract.model.graphs):
        copy = contract.model.graphs.add()
        copy.CopyFrom(graph)
        copy.rank, copy.program = 1, graph.program + ".rank1"


def test_tensor_parallel_ranks_decode_per_rank():
    # spec: OWN-10, OWN-14: one program set per rank, buffers looked up on the graph's rank
    contract, manifest = sample_contract(3), sample_manifest(3)
    _two_ranks(contract, manifest)
    prepared = decode(contract=contract, manifest=manifest)
    assert [g.program for g in prepared.graphs_for(c.OPERATION_DECODE, rank=1)] == ["decode_r4.rank1"]
    assert prepared.select(c.OPERATION_DECODE, rows=1, rank=1).rank == 1


def test_a_rank_without_its_buffers_is_rejected():
    # spec: STA-1: a view names a buffer registered on its own rank
    contract, manifest = sample_contract(3), sample_manifest(3)
    _two_ranks(contract, manifest)
    kept = [b for b in manifest.buffers if not (b.rank == 1 and b.name == "pending")]
    del manifest.buffers[:]
    manifest.buffers.extend(kept)
    with pytest.raises(ContractError) as info:
        decode(contract=contract, manifest=manifest)
    assert info.value.field.endswith("state_accesses[0].view.buffer")
