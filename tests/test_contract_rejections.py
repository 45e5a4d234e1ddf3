"""One test per contract rejection: each breaks one thing in a valid sample and
expects ContractError naming the field. Rule ids are on each case."""
from __future__ import annotations

from typing import Callable

import pytest

from helios_backend.contract import ContractError, PreparedContract
from helios_proto import contract_pb2 as c
from helios_proto import manifest_pb2 as m
from tests.contract_samples import SAMPLE_RESOURCE_IDS, sample_contract, sample_manifest

Mutation = Callable[[c.ServingContract, m.ExecutionManifest], None]


def _graph(contract: c.ServingContract, operation: int) -> c.GraphContract:
    return next(g for g in contract.model.graphs if g.operation == operation)


def _prefill(ct):
    return _graph(ct, c.OPERATION_PREFILL)


def _decode(ct):
    return _graph(ct, c.OPERATION_DECODE)


def _spec(ct):
    return _graph(ct, c.OPERATION_SPECULATIVE)


def _program(mf, name):
    return next(p for p in list(mf.programs) + list(mf.tuning) if p.name == name)


def _buffer(mf, name):
    return next(b for b in mf.buffers if b.name == name)


def _remove_bindings(graph, source):
    keep = [b for b in graph.bindings if b.source != source]
    del graph.bindings[:]
    graph.bindings.extend(keep)


def _add_producer_output(mf, output):
    _program(mf, "tune_gemm").outputs.append(output)


def _tune_into(ct, mf, output):
    _add_producer_output(mf, output)
    _prefill(ct).tuned_bindings.add(buffer=output, producer="tune_gemm")


CASES: list = [
    # --- zero enums / unknown identifiers / versions (CON-10..13) ---
    pytest.param(lambda ct, mf: setattr(_prefill(ct), "operation", 0), "model.graphs[0].operation", id="CON-11 zero operation"),
    pytest.param(lambda ct, mf: setattr(ct.model.frontend, "tool_parser", 0), "model.frontend.tool_parser", id="CON-11 zero tool parser"),
    pytest.param(lambda ct, mf: setattr(ct.model.frontend, "image_layout", 0), "model.frontend.image_layout", id="CON-11 zero image layout"),
    pytest.param(lambda ct, mf: setattr(_prefill(ct).bindings[0], "index", 0), "model.graphs[0].bindings[0].index", id="CON-11 zero index mode"),
    pytest.param(lambda ct, mf: setattr(_prefill(ct).bindings[0], "source", 0), "model.graphs[0].bindings[0].source", id="CON-11 zero source"),
    pytest.param(lambda ct, mf: setattr(_prefill(ct).state_accesses[0], "access", 0), "model.graphs[0].state_accesses[0].access", id="CON-11 zero access"),
    pytest.param(lambda ct, mf: setattr(ct.model.cache.regions[0], "kind", 0), "model.cache.regions[0].kind", id="CON-11 zero history kind"),
    pytest.param(lambda ct, mf: setattr(_buffer(mf, "kv"), "dtype", 0), "manifest.buffers[3].dtype", id="CON-11 zero manifest dtype"),
    pytest.param(lambda ct, mf: setattr(_prefill(ct).bindings[0], "source", 9999), "model.graphs[0].bindings[0].source", id="CON-12 unknown source number"),
    pytest.param(lambda ct, mf: setattr(ct.model.frontend, "reasoning_parser", 77), "model.frontend.reasoning_parser", id="CON-12 unknown reasoning parser"),
    pytest.param(lambda ct, mf: ct.model.cache.MergeFromString(b"\x98\x06\x01"), "model.cache.<field 99>", id="CON-12 unknown field"),
    # --- serving metadata (SRV) ---
    pytest.param(lambda ct, mf: setattr(ct, "served_id", ""), "served_id", id="SRV-1 empty served id"),
    pytest.param(lambda ct, mf: ct.aliases.append("sample-model"), "aliases[1]", id="SRV-1 alias repeats the id"),
    pytest.param(lambda ct, mf: setattr(ct, "context_tokens", 0), "context_tokens", id="SRV-3 zero context extent"),
    pytest.param(lambda ct, mf: setattr(ct, "concurrency", 5), "concurrency", id="SRV-5 concurrency over slots"),
    pytest.param(lambda ct, mf: ct.speculative_widths.append(8), "speculative_widths", id="SRV-5 width without a graph"),
    pytest.param(lambda ct, mf: ct.defaults.ClearField("sampling"), "defaults.sampling", id="SRV-6 sampling defaults missing"),
    pytest.param(lambda ct, mf: setattr(ct.defaults.sampling, "top_p", 0), "defaults.sampling.top_p", id="SRV-6 top_p zero"),
    pytest.param(lambda ct, mf: ct.defaults.ClearField("eos_token_ids"), "defaults.eos_token_ids", id="FE-44 no EOS ids"),
    pytest.param(lambda ct, mf: ct.defaults.eos_token_ids.append(100), "defaults.eos_token_ids[1]", id="CACHE-13 EOS outside vocabulary"),
    # --- vocabulary (CON-3..5) ---
    pytest.param(lambda ct, mf: setattr(ct.model.vocabulary, "mask_words", 3), "model.vocabulary.mask_words", id="CON-3 mask geometry"),
    pytest.param(lambda ct, mf: setattr(ct.model.vocabulary, "histogram_bins", 10), "model.vocabulary.histogram_bins", id="CON-3 histogram geometry"),
    pytest.param(lambda ct, mf: ct.model.input_vocabulary.image_sentinels.append(5), "model.input_vocabulary.image_sentinels[1]", id="CON-5 sentinel inside sampled range"),
    pytest.param(lambda ct, mf: setattr(ct.model.vision, "feature_slots", 0), "model.vision.feature_slots", id="CON-6 vision capacity"),
    # --- catalog agreement (BND-1..3) ---
    pytest.param(lambda ct, mf: setattr(_program(mf, "decode_r4"), "operation", c.OPERATION_PREFILL), "model.graphs[1].operation", id="BND-3 operation disagrees"),
    pytest.param(lambda ct, mf: setattr(_decode(ct).capacity, "rows", 2), "model.graphs[1].capacity", id="BND-3 capacity disagrees"),
    pytest.param(lambda ct, mf: setattr(_decode(ct), "rank", 1), "model.graphs[1].rank", id="BND-3 rank disagrees"),
    pytest.param(lambda ct, mf: setattr(_decode(ct), "program", "missing"), "model.graphs[1].program", id="BND-3 program missing"),
    pytest.param(lambda ct, mf: setattr(_decode(ct), "program", "tune_gemm"), "model.graphs[1].program", id="BND-24 tuning program as serving graph"),
    pytest.param(lambda ct, mf: setattr(_decode(ct), "program", "prefill_r1"), "model.graphs[1].program", id="BND-1 two graphs one program"),
    pytest.param(lambda ct, mf: ct.model.ClearField("graphs"), "model.graphs", id="OWN-19 no graphs"),
    # --- bindings (BND-4, BND-12) ---
    pytest.param(lambda ct, mf: setattr(_prefill(ct).bindings[0], "destination", "nowhere"), "model.graphs[0].bindings[0].destination", id="BND-4 unregistered destination"),
    pytest.param(lambda ct, mf: setattr(_prefill(ct).bindings[1], "destination", "slot"), "model.graphs[0].bindings[1].destination", id="BND-4 destination bound twice"),
    pytest.param(lambda ct, mf: setattr(_prefill(ct).bindings[-1], "image_output", ""), "image_output", id="BND-12 image tensor without output"),
    # --- state views and pending tokens (STA) ---
    pytest.param(lambda ct, mf: setattr(_prefill(ct).state_accesses[0].view, "buffer", "nope"), "model.graphs[0].state_accesses[0].view.buffer", id="STA-1 unregistered buffer"),
    pytest.param(lambda ct, mf: setattr(_prefill(ct).state_accesses[0].view, "buffer", "scratch"), "model.graphs[0].state_accesses[0].view.buffer", id="STA-1 not persistent"),
    pytest.param(lambda ct, mf: setattr(_prefill(ct).state_accesses[0].view, "byte_offset", 30), "model.graphs[0].state_accesses[0].view", id="STA-2 view beyond its buffer"),
    pytest.param(lambda ct, mf: setattr(_prefill(ct).state_accesses[0].view, "row_stride", 2), "model.graphs[0].state_accesses[0].view.row_stride", id="STA-1 overlapping rows"),
    pytest.param(lambda ct, mf: setattr(_decode(ct).pending_token, "device_state_view", "other"), "model.graphs[1].pending_token.device_state_view", id="STA-4 pending names no view"),
    pytest.param(lambda ct, mf: setattr(_decode(ct).state_accesses[0], "access", c.ACCESS_WRITE), "model.graphs[1].pending_token.device_state_view", id="STA-4 pending view not readable"),
    pytest.param(lambda ct, mf: setattr(_prefill(ct).state_accesses[0], "access", c.ACCESS_READ), "model.graphs[0].pending_token.device_state_view", id="STA-5 producer declares no write"),
    pytest.param(lambda ct, mf: setattr(_decode(ct).pending_token, "host_destination", "host_pending"), "model.graphs[1].pending_token.host_destination", id="STA-6 host pending without binding"),
    # --- tuned bindings (BND-21..27) ---
    pytest.param(lambda ct, mf: setattr(_prefill(ct).tuned_bindings[0], "producer", "missing"), "model.graphs[0].tuned_bindings[0].producer", id="BND-24 producer not in tuning catalog"),
    pytest.param(lambda ct, mf: setattr(_prefill(ct).tuned_bindings[0], "producer", "decode_r4"), "model.graphs[0].tuned_bindings[0].producer", id="BND-24 serving program as producer"),
    pytest.param(lambda ct, mf: setattr(_prefill(ct).tuned_bindings[0], "buffer", "pending"), "model.graphs[0].tuned_bindings[0].buffer", id="BND-23 buffer not the producer's output"),
    pytest.param(lambda ct, mf: _tune_into(ct, mf, "staging"), "model.graphs[0].tuned_bindings[0].producer", id="BND-25 output overlaps request inputs"),
    pytest.param(lambda ct, mf: _tune_into(ct, mf, "pending"), "model.graphs[0].tuned_bindings[0].producer", id="BND-26 output overlaps writable state"),
    pytest.param(lambda ct, mf: _tune_into(ct, mf, "kv"), "model.graphs[0].tuned_bindings[0].producer", id="BND-27 output overlaps cache storage"),
    # --- speculative (SPEC) ---
    pytest.param(lambda ct, mf: _remove_bindings(_spec(ct), c.VALUE_SOURCE_SPECULATIVE_PREFIX_LIMIT), "model.graphs[2].bindings", id="SPEC-16 no length source"),
    pytest.param(lambda ct, mf: _spec(ct).bindings.add(destination="query_length", source=c.VALUE_SOURCE_QUERY_LENGTH, index=c.INDEX_MODE_SUBMISSION_ROW), "model.graphs[2].bindings", id="SPEC-16 both length sources"),
    pytest.param(lambda ct, mf: setattr(_spec(ct).speculative, "confidence_width", 4), "model.graphs[2].speculative.confidence_width", id="SPEC-34 confidence width differs from D"),
    pytest.param(lambda ct, mf: setattr(_spec(ct).speculative, "packed_token_capacity", 0), "model.graphs[2].speculative.packed_token_capacity", id="SPEC-10 implicit P"),
    pytest.param(lambda ct, mf: setattr(_spec(ct).speculative, "packed_token_capacity", 17), "model.graphs[2].speculative.packed_token_capacity", id="SPEC-10 P beyond B x W"),
    pytest.param(lambda ct, mf: setattr(_spec(ct).speculative, "batch_capacity", 2), "model.graphs[2].speculative.batch_capacity", id="SPEC-7 B differs from rows"),
    pytest.param(lambda ct, mf: (setattr(_spec(ct).speculative, "draft_tokens", 0), setattr(_spec(ct).speculative, "confidence_width", 0)), "model.graphs[2].speculative.draft_tokens", id="SPEC-11 D not inferred from W"),
    pytest.param(lambda ct, mf: _spec(ct).ClearField("speculative"), "model.graphs[2].speculative", id="SPEC-6 descriptor missing"),
    pytest.param(lambda ct, mf: _decode(ct).speculative.SetInParent(), "model.graphs[1].speculative", id="SPEC-3 decode carries a descriptor"),
    pytest.param(lambda ct, mf: (_buffer(mf, "proposal_confidence").ClearField("shape"), _buffer(mf, "proposal_confidence").shape.extend([4, 4])), "model.graphs[2].speculative.confidence_buffer", id="SPEC-39 unframed confidence layout"),
    pytest.param(lambda ct, mf: setattr(_buffer(mf, "proposal_confidence"), "dtype", c.DTYPE_F16), "model.graphs[2].speculative.confidence_buffer", id="SPEC-35 confidence not fp32"),
    pytest.param(lambda ct, mf: setattr(_spec(ct).speculative, "confidence_draft_capacity", 5), "model.graphs[2].speculative.confidence_draft_capacity", id="SPEC-36 capacity disagrees with layout"),
    pytest.param(lambda ct, mf: setattr(_buffer(mf, "proposal_confidence"), "nbytes", 64), "model.graphs[2].speculative.confidence_buffer", id="SPEC-35 not contiguous"),
    # --- cursors (CACHE-10..12) ---
    pytest.param(lambda ct, mf: setattr(_spec(ct).cursor, "state_view", "nope"), "model.graphs[2].cursor.state_view", id="CACHE-10 cursor names no state"),
    pytest.param(lambda ct, mf: (setattr(_spec(ct).cursor, "reports_draft_cursor", False)), "model.graphs[2].cursor", id="CACHE-12 lag without cursor"),
    # --- cache (CACHE-1..7) ---
    pytest.param(lambda ct, mf: setattr(ct.model.cache, "page_tokens", 0), "model.cache.page_tokens", id="CACHE-1 zero page tokens"),
    pytest.param(lambda ct, mf: ct.model.cache.regions[0].ClearField("planes"), "model.cache.regions[0].planes", id="CACHE-3 paged region without planes"),
    pytest.param(lambda ct, mf: setattr(ct.model.cache.regions[0], "tokens_per_record", 0), "model.cache.regions[0].tokens_per_record", id="CACHE-4 no compression ratio"),
    pytest.param(lambda ct, mf: setattr(ct.model.cache.regions[0], "tokens_per_record", 3), "model.cache.regions[0].tokens_per_record", id="CACHE-4 ratio does not divide a page"),
    pytest.param(lambda ct, mf: setattr(ct.model.cache.regions[0], "kind", c.HISTORY_KIND_SLIDING_WINDOW), "model.cache.regions[0].window_tokens", id="CACHE-5 sliding window without extent"),
    pytest.param(lambda ct, mf: setattr(ct.model.cache.regions[0], "window_tokens", 64), "model.cache.regions[0].window_tokens", id="CACHE-5 extent on a paged region"),
    pytest.param(lambda ct, mf: setattr(ct.model.cache.regions[0].planes[0], "buffer", "pending"), "model.cache.regions[0].planes[0].buffer", id="CACHE-3 plane is not cache storage"),
    pytest.param(lambda ct, mf: setattr(ct.model.cache.page_table_views[0], "destination", "nope"), "model.cache.page_table_views[0].destination", id="CACHE-7 view without destination"),
    pytest.param(lambda ct, mf: setattr(ct.model.cache.page_table_views[0], "pages_per_row", 9), "model.cache.page_table_views[0].pages_per_row", id="CACHE-7 view wider than page table"),
    pytest.param(lambda ct, mf: ct.model.ClearField("cache"), "model.cache", id="CON-7 cache missing"),
    # --- frontend (FE) ---
    pytest.param(lambda ct, mf: setattr(ct.model.frontend, "reasoning_parser", c.REASONING_PARSER_XTML_THINK), "model.frontend.tool_parser", id="FE-6 XTML think without XTML tools"),
    pytest.param(lambda ct, mf: setattr(ct.model.frontend, "reasoning_parser", c.REASONING_PARSER_RECIPIENT_HEADER), "model.frontend.tool_parser", id="FE-26 recipient header without ATEM"),
    pytest.param(lambda ct, mf: setattr(ct.model.frontend, "tool_parser", c.TOOL_PARSER_ATEM), "model.frontend.reasoning_parser", id="FE-26 ATEM without recipient header"),
    pytest.param(lambda ct, mf: setattr(ct.model.frontend.reasoning_syntax, "terminal_marker", "<tool>"), "model.frontend.reasoning_syntax.terminal_marker", id="FE-8 terminal marker is not the opener"),
    pytest.param(lambda ct, mf: setattr(ct.model.frontend.tool_syntax, "block_open", ""), "model.frontend.tool_syntax.block_open", id="FE-7 tool syntax data missing"),
    pytest.param(lambda ct, mf: ct.model.frontend.ClearField("reasoning_syntax"), "model.frontend.reasoning_syntax", id="FE-7 reasoning syntax missing"),
    pytest.param(lambda ct, mf: setattr(ct.model.frontend, "tokenizer_resource", "missing"), "model.frontend.tokenizer_resource", id="FE-43 tokenizer not in the core"),
    pytest.param(lambda ct, mf: ct.model.frontend.image_layout_data.ClearField("feature_ids"), "model.frontend.image_layout_data.feature_ids", id="FE-18 layout without feature ids"),
    pytest.param(lambda ct, mf: ct.model.frontend.image_layout_data.feature_ids.append(7), "model.frontend.image_layout_data.feature_ids[1]", id="FE-18 feature id is not a sentinel"),
    pytest.param(lambda ct, mf: ct.model.frontend.image_layout_data.atomic_spans.add(token_ids=[5, 500]), "model.frontend.image_layout_data.atomic_spans[0].token_ids[1]", id="FE-18 atomic span outside the input vocabulary"),
    pytest.param(lambda ct, mf: _decode(ct).resources.append("gone"), "model.graphs[1].resources[2]", id="CON-8 resource dependency missing"),
]


@pytest.mark.parametrize("mutate, field", CASES)
def test_rejection_names_the_field(mutate: Mutation, field: str):
    # spec: BND-1, BND-3, BND-4, BND-12, BND-23, BND-24, BND-25, BND-26, BND-27, CACHE-1, CACHE-3, CACHE-4, CACHE-5, CACHE-7, CACHE-10, CACHE-12, CACHE-13, CON-3, CON-5, CON-6, CON-7, CON-8, CON-11, CON-12, FE-6, FE-7, FE-8, FE-18, FE-26, FE-43, FE-44, OWN-19, SPEC-3, SPEC-6, SPEC-7, SPEC-10, SPEC-11, SPEC-16, SPEC-34, SPEC-35, SPEC-36, SPEC-39, SRV-1, SRV-3, SRV-5, SRV-6, STA-1, STA-2, STA-4, STA-5, STA-6
    # (each case's id names the rule it checks)
    contract, manifest = sample_contract(3), sample_manifest(3)
    PreparedContract.decode(contract, manifest, resource_ids=SAMPLE_RESOURCE_IDS)  # valid before the change
    mutate(contract, manifest)
    with pytest.raises(ContractError) as info:
        PreparedContract.decode(contract, manifest, resource_ids=SAMPLE_RESOURCE_IDS)
    assert field in info.value.field, str(info.value)
    assert str(info.value).startswith(info.value.field)


VERSION_CASES = [
    # a field or enum value newer than the contract's version is an unknown identifier (CON-12)
    pytest.param(1, lambda ct: ct.model.vision.SetInParent(), "model.vision", id="CON-12 vision in v1"),
    pytest.param(1, lambda ct: ct.model.graphs[0].tuned_bindings.add(buffer="gemm_config", producer="tune_gemm"), "model.graphs[0].tuned_bindings", id="CON-12 tuned bindings in v1"),
    pytest.param(2, lambda ct: ct.model.graphs[0].cursor.SetInParent(), "model.graphs[0].cursor", id="CON-12 cursor in v2"),
    pytest.param(2, lambda ct: ct.model.graphs[1].speculative.SetInParent(), "model.graphs[1].speculative", id="CON-12 descriptor in v2"),
    pytest.param(2, lambda ct: setattr(ct.model.graphs[1], "operation", c.OPERATION_SPECULATIVE), "model.graphs[1].operation", id="CON-12 SPECULATIVE in v2"),
    pytest.param(2, lambda ct: setattr(ct.model.graphs[0].bindings[0], "source", c.VALUE_SOURCE_PROPOSAL_IDS), "model.graphs[0].bindings[0].source", id="CON-12 proposal source in v2"),
    pytest.param(1, lambda ct: setattr(ct.model.frontend, "image_layout", c.IMAGE_LAYOUT_FIXED_SPAN), "model.frontend.image_layout", id="CON-12 image layout in v1"),
]


@pytest.mark.parametrize("version, mutate, field", VERSION_CASES)
def test_later_version_fields_are_unknown_identifiers(version, mutate, field):
    # spec: CON-12, CON-13
    contract, manifest = sample_contract(version), sample_manifest(version)
    mutate(contract)
    with pytest.raises(ContractError) as info:
        PreparedContract.decode(contract, manifest, resource_ids=SAMPLE_RESOURCE_IDS)
    assert info.value.field == field


def test_contract_error_is_a_value_error_naming_the_field():
    # spec: CON-12
    error = ContractError("model.graphs[0].operation", "bad")
    assert isinstance(error, ValueError)
    assert str(error) == "model.graphs[0].operation: bad"
