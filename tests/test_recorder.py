"""Recorder and recorded programs: ABI checks at record time, node counts, declarations."""
from __future__ import annotations

import numpy as np
import pytest
from helios_proto import contract_pb2 as C
from helios_proto import manifest_pb2 as M

from helios_backend.contract import PreparedContract
from helios_backend.kernel_abi import abi
from ignition.preparation import contract as shared
from ignition.recipes.llama_decoder import DecoderOptions
from ignition.recorder import Recorder, RecordingError, Ref
from tests.engine_fixtures import prepared_in_memory


def _recorder() -> Recorder:
    rec = Recorder()
    rec.declare(shared.buffer("a", M.BUFFER_KIND_SCRATCH, C.DTYPE_F32, [4, 8]))
    rec.declare(shared.buffer("w", M.BUFFER_KIND_WEIGHT, C.DTYPE_F16, [8, 8]))
    rec.declare(shared.buffer("g", M.BUFFER_KIND_SCRATCH, C.DTYPE_I32, [16]))
    rec.declare(shared.buffer("ints", M.BUFFER_KIND_SCRATCH, C.DTYPE_I32, [32]))
    rec.begin("p", C.OPERATION_DECODE, C.Capacity(rows=1, tokens=4))
    return rec


def _linear_args(**overrides):
    args = dict(hidden="a", x="a", weight="w", geometry="g", tokens=4, in_dim=8, out_dim=8)
    args.update(overrides)
    return args


def test_launch_records_ordered_args_and_geometry_indirection():
    calls = []

    def geometry(kernel_id, args):
        calls.append((kernel_id, list(args)))
        return (3, 2, 1), (128, 1, 1), 512

    rec = Recorder(geometry=geometry)
    rec.declare(shared.buffer("a", M.BUFFER_KIND_SCRATCH, C.DTYPE_F32, [4, 8]))
    rec.declare(shared.buffer("w", M.BUFFER_KIND_WEIGHT, C.DTYPE_F16, [8, 8]))
    rec.declare(shared.buffer("g", M.BUFFER_KIND_SCRATCH, C.DTYPE_I32, [16]))
    rec.begin("p", C.OPERATION_DECODE, C.Capacity(rows=1, tokens=4))
    rec.launch("linear.residual.v1", "l0", **_linear_args(x=Ref("a", 32)))
    program = rec.end()
    [node] = program.nodes
    assert node.kernel == "linear.residual.v1" and node.label == "l0"
    assert [a.WhichOneof("value") for a in node.args] == ["pointer"] * 4 + ["i32"] * 3
    assert node.args[1].pointer.byte_offset == 32
    assert (node.grid.x, node.grid.y, node.block.x, node.shared_bytes) == (3, 2, 128, 512)
    assert calls[0][0] == "linear.residual.v1" and calls[0][1][-3:] == [4, 8, 8]


@pytest.mark.parametrize("bad,message", [
    (dict(tokens=None), "expected an int"),
    (dict(weight="ints"), "holds DTYPE_I32"),
    (dict(x="nope"), "no buffer"),
    (dict(x=Ref("a", 4096)), "outside"),
    (dict(extra=1), "unexpected"),
])
def test_launch_rejects_args_that_do_not_fit_the_abi(bad, message):
    rec = _recorder()
    with pytest.raises(RecordingError, match=message):
        rec.launch("linear.residual.v1", **_linear_args(**bad))


def test_unknown_kernel_id_is_rejected_at_record_time():
    with pytest.raises(abi.UnknownKernelError):
        _recorder().launch("linear.fancy.v9", **_linear_args())


@pytest.fixture(scope="module")
def prepared():
    return prepared_in_memory()


def test_node_count_per_step_is_five_per_layer_plus_shared(prepared):
    # recorded per (operation, capacity variant, rank); the recorder prints this count (helios-prepare)
    layers = 30
    for program in prepared.manifest.programs:
        count = len(program.nodes)
        snapshot = 1 if program.operation in (C.OPERATION_PREFILL, C.OPERATION_MIXED) else 0  # may end a prompt
        if program.capacity.tokens >= DecoderOptions().product_path_tokens:
            # the product path: ten nodes a layer (docs/kernels.md); a decode step's logits two
            count -= 5 * layers + (1 if program.operation == C.OPERATION_DECODE else 0)
        if program.operation in (C.OPERATION_INITIALIZATION, C.OPERATION_RESTORATION):
            assert count == 1
        elif program.operation in (C.OPERATION_PREFILL, C.OPERATION_RESUME):   # host input ids: no selection
            # model, geometry, logit bias + draw + commit + logprobs
            assert count == 5 * layers + 2 + 1 + 4 + snapshot
        elif program.operation == C.OPERATION_SCORED_PREFILL:                 # prefill + logits.score_targets
            assert count == 5 * layers + 2 + 1 + 4 + 1
        else:
            assert count == 5 * layers + 2 + 2 + 4 + snapshot   # plus the input-id selection
        assert prepared.node_counts[program.name] == len(program.nodes)


def test_one_program_per_operation_variant_and_rank(prepared):
    names = [p.name for p in prepared.manifest.programs]
    assert len(set(names)) == len(names)
    keys = {(p.operation, p.capacity.rows, p.capacity.tokens, p.rank) for p in prepared.manifest.programs}
    assert len(keys) == len(names)
    graphs = {g.program: g for g in prepared.contract.model.graphs}
    assert set(graphs) == set(names)
    for program in prepared.manifest.programs:
        assert graphs[program.name].operation == program.operation          # spec: BND-2, BND-3
        assert graphs[program.name].capacity == program.capacity


def test_bindings_and_state_accesses_are_declared_per_graph(prepared):
    # spec: BND-5, BND-13, STA-3, STA-5, STA-7, STA-8
    graphs = {g.operation: g for g in prepared.contract.model.graphs}
    decode, prefill, init = graphs[C.OPERATION_DECODE], graphs[C.OPERATION_PREFILL], graphs[C.OPERATION_INITIALIZATION]
    registered = {d.name for d in prepared.manifest.transport.destinations}
    for graph in prepared.contract.model.graphs:
        for b in graph.bindings:
            assert b.destination in registered                               # spec: BND-4
            assert b.source != C.VALUE_SOURCE_UNSPECIFIED and b.index != C.INDEX_MODE_UNSPECIFIED
    sources = lambda g: {b.source for b in g.bindings}  # noqa: E731
    assert C.VALUE_SOURCE_PROMPT_TOKENS in sources(prefill) and C.VALUE_SOURCE_PROMPT_TOKENS not in sources(decode)
    assert C.VALUE_SOURCE_PROMPT_HISTOGRAM in sources(init) and C.VALUE_SOURCE_PROMPT_HISTOGRAM not in sources(decode)
    accesses = lambda g: {a.view.name: a.access for a in g.state_accesses}  # noqa: E731
    assert accesses(decode)["state.pending"] == C.ACCESS_READ_WRITE       # reads the pending token, writes the next
    assert accesses(prefill)["state.pending"] == C.ACCESS_READ_WRITE     # commit reads+writes the slot's row
    assert accesses(init)["state.prompt_histogram"] == C.ACCESS_WRITE
    assert "state.prompt_histogram" not in {n for n, a in accesses(decode).items() if a != C.ACCESS_READ}
    assert decode.pending_token.device_state_view == "state.pending"       # spec: STA-4


def test_prepared_contract_decodes_and_declares_metadata(prepared):
    # spec: OWN-2, CON-2, FE-44, FE-45
    decoded = PreparedContract.decode(prepared.contract, prepared.manifest,
                                      resource_ids=frozenset(r.id for r in prepared.resources))
    assert prepared.contract.model.version == 3
    assert decoded.defaults.eos_token_ids == (2, 0)
    assert decoded.defaults.sampling.temperature == pytest.approx(0.2)
    assert decoded.defaults.sampling.top_p == pytest.approx(0.9)
    assert prepared.contract.model.frontend.tool_parser == C.TOOL_PARSER_JSON_CALL_TAGS
    assert prepared.contract.model.cache.page_tokens == 16
    assert prepared.manifest.completion.row[6].name == "draft_cursor"
    assert prepared.manifest.completion.row[7].name == "reserved_model"


def test_matrices_keep_the_gguf_blocks_norms_are_fp16_with_sources_in_the_catalog(prepared):
    # spec: OWN-2, FE-52 (the storage is declared by type: Q8_0 / Q4_1 blocks, F16, F32)
    from ignition.sources.gguf import GGUFModel, default_gguf_path

    weights = {b.name: b for b in prepared.manifest.buffers if b.kind == M.BUFFER_KIND_WEIGHT}
    matrices = {name for name in weights if name.rsplit(".", 1)[-1] in ("qkv", "attn_output", "gate_up", "ffn_down")}
    assert {weights[name].dtype for name in matrices} == {C.DTYPE_Q4_1}        # the GGUF's own types
    assert weights["weights.token_embedding"].dtype == C.DTYPE_Q8_0
    rest = set(weights) - matrices - {"weights.token_embedding", "weights.rope_table"}
    assert {weights[name].dtype for name in rest} == {C.DTYPE_F16}
    # lossless: the stored bytes are the source's blocks (q, k, v stacked by rows)
    source = GGUFModel.open(default_gguf_path())
    qkv = weights["weights.layers.0.qkv"]
    data = {r.id: r.data for r in prepared.resources}[qkv.weight.resource]
    stored = np.frombuffer(data, np.uint8, qkv.nbytes, qkv.weight.byte_offset)
    expected = np.concatenate([np.asarray(source.blocks(f"blk.0.attn_{x}.weight").data).reshape(-1) for x in "qkv"])
    assert np.array_equal(stored, expected)
    assert qkv.nbytes == 960 * 576 // 32 * 20
    catalog = prepared.contract.rebuild.weight_catalogs[0]
    assert {t.name for t in catalog.tensors} >= {"blk.0.attn_q.weight", "token_embd.weight", "output_norm.weight"}


def test_a_recipe_forward_pass_cannot_write_slot_state_or_completion():
    # spec: OWN-8 (recipes cannot install state-update code; only shared declarations write state)
    rec = Recorder()
    rec.declare(shared.buffer("state.pending", M.BUFFER_KIND_STATE, C.DTYPE_I32, [4]))
    rec.declare(shared.buffer("scratch.ids", M.BUFFER_KIND_SCRATCH, C.DTYPE_I32, [8]))
    rec.declare(shared.buffer("g", M.BUFFER_KIND_SCRATCH, C.DTYPE_I32, [16]))
    rec.begin("p", C.OPERATION_DECODE, C.Capacity(rows=1, tokens=1))
    forward = rec.forward_view()
    args = dict(ids="scratch.ids", prompt_tokens="scratch.ids", pending="state.pending", row_slot="scratch.ids",
                prefill_row="scratch.ids", geometry="g", rows=1, tokens=1)
    forward.launch("tokens.select_input.v1", **args)           # reads state: allowed
    with pytest.raises(RecordingError, match="may not write BUFFER_KIND_STATE"):
        forward.launch("tokens.select_input.v1", **{**args, "ids": "state.pending"})
    assert len(rec.end().nodes) == 1


def test_snapshot_option_records_restoration_and_continuation_storage():
    # spec: CON-7, STA-1, STA-2 (continuation rows are a declared history region; views lie inside buffers)
    prepared = prepared_in_memory()
    PreparedContract.decode(prepared.contract, prepared.manifest,
                            resource_ids=frozenset(r.id for r in prepared.resources))
    kinds = {r.kind for r in prepared.contract.model.cache.regions}
    assert kinds == {C.HISTORY_KIND_PAGED_KV, C.HISTORY_KIND_CONTINUATION}
    assert prepared.contract.prepared_snapshots == 4
    programs = {p.name: p for p in prepared.manifest.programs}
    assert [n.kernel for n in programs["restoration.r1"].nodes] == ["cache.restore_partial.v1"]
    assert "cache.snapshot_partial.v1" in [n.kernel for n in programs["prefill.r1.t64"].nodes]
    assert "cache.snapshot_partial.v1" not in [n.kernel for n in programs["decode.r1.t1"].nodes]
    graphs = {g.program: g for g in prepared.contract.model.graphs}
    restoration = graphs["restoration.r1"]
    assert {b.source for b in restoration.bindings} >= {C.VALUE_SOURCE_RESTORE_SOURCE, C.VALUE_SOURCE_PAGE_TABLE}
    assert C.VALUE_SOURCE_SNAPSHOT_DESTINATION in {b.source for b in graphs["prefill.r1.t64"].bindings}
    assert all(p.operation != C.OPERATION_RESTORATION for p in prepared_in_memory(snapshot_rows=0).manifest.programs)
