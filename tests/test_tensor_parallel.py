"""Tensor parallelism of the model (issue #7 point 5), on the CPU oracle.

A TP=2 core of the real SmolLM2-135M weights (3 KV heads -> 2 + 1 per rank, ffn 1536 -> 768 + 768)
prepares, verifies, validates and loads; the numpy executor runs its two ranks in lockstep and its
logits and greedy tokens equal the TP=1 core's (`tp1_model`, same capacity variants and kernels).
The TP=2 core is cached under var/test-cores/ like the TP=1 one (named by the preparation sources).
"""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Iterator

import numpy as np
import pytest
from helios_proto import contract_pb2 as C
from helios_proto import manifest_pb2 as M

from helios_backend.executors.base import KernelArgumentError
from helios_backend.executors.numpy_executor import NumpyExecutor, NumpyExecutorOptions
from helios_backend.engine.model import ModelOptions, NativeModel
from ignition.preparation import contract as shared
from ignition.preparation.tensor_parallel import Partition, PartitionedDimension, Split, TensorParallelError
from ignition.recorder import Recorder, RecordingError
from tests.engine_fixtures import ACCEPTANCE, cached_core, engine_test_options
from tests.gpu.tensor_parallel import RANK_STATE, greedy_with_logits, rank_disagreements   # the device script's
from tests.test_numpy_executor import PROMPT, VOCAB, prefill_logits

DEGREE = 2
LAYERS = 30
HIDDEN = 576
# TP=2 sums each projection as two partials in another order than TP=1's one GEMM: f32 rounding
# only (measured ~2e-5 on logits of magnitude ~20)
LOGIT_TOLERANCE = 1e-3
STEPS = 64
PROMPTS = [PROMPT, [1, 9690, 198, 504, 3575, 282], [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198],
           [1, 520, 9531, 198, 1780]]
PROJECTION_KERNELS = ("linear.residual.v1", "linear.project.v1")


def tp_options():
    return engine_test_options(tensor_parallel=DEGREE)


@pytest.fixture(scope="module")
def tp_core(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return cached_core(f"smollm2-tp{DEGREE}-test", tp_options(), tmp_path_factory)


@pytest.fixture(scope="module")
def tp1_model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NativeModel]:
    """The TP=1 core of the same variants on the same kernels: tensor-parallel ranks keep the fused
    kernels at every size, so the reference records no product path (docs/kernels.md)."""
    from helios_backend.engine.bootstrap import Bootstrap

    core = cached_core("smollm2-fused-test", engine_test_options(product_path_tokens=0), tmp_path_factory)
    bootstrap = Bootstrap.load(core, ACCEPTANCE)
    model = NativeModel.load(bootstrap.contract, bootstrap.manifest, bootstrap.read_resource,
                             ModelOptions(cache_pages=128))
    yield model
    model.close()
    bootstrap.close()


@pytest.fixture(scope="module")
def tp_bootstrap(tp_core: pathlib.Path) -> Iterator[object]:
    from helios_backend.engine.bootstrap import Bootstrap

    bootstrap = Bootstrap.load(tp_core, ACCEPTANCE)      # verify, authorize, decode + validate the contract
    yield bootstrap
    bootstrap.close()


@pytest.fixture(scope="module")
def tp_model(tp_bootstrap) -> Iterator[NativeModel]:
    model = NativeModel.load(tp_bootstrap.contract, tp_bootstrap.manifest, tp_bootstrap.read_resource,
                             ModelOptions(cache_pages=128))
    yield model
    model.close()


def _programs(manifest: M.ExecutionManifest, rank: int) -> dict[str, M.Program]:
    return {p.name: p for p in manifest.programs if p.rank == rank}


def _immediates(node: M.Node, *names: str) -> tuple:
    from helios_backend.kernel_abi import abi

    params = [p.name for p in abi.kernel(node.kernel).params]
    return tuple(getattr(node.args[params.index(n)], node.args[params.index(n)].WhichOneof("value")) for n in names)


# ---- the prepared core ----------------------------------------------------------------------------

def test_a_tp2_core_prepares_validates_and_loads(tp_bootstrap, tp_model):
    # spec: OWN-10, OWN-11, OWN-12, SRV-18
    manifest, contract = tp_bootstrap.manifest, tp_bootstrap.contract
    assert manifest.world_size == DEGREE
    resources = {r.id for r in tp_bootstrap.core.resources}
    assert {"weights.rank0", "weights.rank1"} <= resources
    assert _programs(manifest, 0).keys() == _programs(manifest, 1).keys()       # same names on every rank
    assert {(g.program, g.rank) for g in contract.model.graphs} == {(p.name, p.rank) for p in manifest.programs}
    for graph in contract.model.graphs:                                         # each rank reads its own weights
        assert list(graph.resources) == [f"weights.rank{graph.rank}"]
    catalogs = contract.rebuild.weight_catalogs
    assert [c.rank for c in catalogs] == [0, 1]
    qkv = {c.rank: next(t for t in c.tensors if t.name == "blk.0.attn_q.weight") for c in catalogs}
    assert [list(qkv[r].shape) for r in (0, 1)] == [[(6 + 2 * 2) * 64, HIDDEN], [(3 + 2) * 64, HIDDEN]]
    assert contract.cache_identity.label.endswith(f"/tp{DEGREE}")
    # loading backed both ranks: two geometries, each rank's arena laid out from its own buffers
    assert [g.rank for g in tp_model.manifests] == [0, 1]
    assert tp_model.manifests[0].arena_nbytes > tp_model.manifests[1].arena_nbytes   # rank 0 holds 2 of 3 KV heads
    assert tp_model.executor.world_size == DEGREE


def test_ranks_divide_kv_heads_unevenly_and_ffn_evenly(tp_bootstrap):
    manifest = tp_bootstrap.manifest
    shapes = {(b.rank, b.name): list(b.shape) for b in manifest.buffers}
    assert shapes[(0, "cache.k")] == [LAYERS, 16, 2, 64] and shapes[(1, "cache.k")] == [LAYERS, 16, 1, 64]
    assert shapes[(0, "weights.layers.0.gate_up")] == shapes[(1, "weights.layers.0.gate_up")] == [2 * 768, HIDDEN]
    assert shapes[(0, "weights.layers.0.attn_output")] == [HIDDEN, 384]
    assert shapes[(1, "weights.layers.0.attn_output")] == [HIDDEN, 192]
    # replicated: the residual stream, the embedding / LM head, the logits
    for name in ("weights.token_embedding", "scratch.hidden", "scratch.logits", "state.pending"):
        assert shapes[(0, name)] == shapes[(1, name)], name
    for rank, heads in ((0, (6, 2)), (1, (3, 1))):       # kernel immediates are per launch, so per rank
        decode = _programs(manifest, rank)["decode.r1.t1"]
        for node in decode.nodes:
            if node.kernel.startswith("attention."):
                assert _immediates(node, "q_heads", "kv_heads") == heads


def test_each_projection_is_summed_by_one_all_reduce_per_rank(tp_bootstrap):
    # the residual is counted once: rank 0 adds its partial, the other ranks store theirs, then one sum
    manifest = tp_bootstrap.manifest
    for rank in range(DEGREE):
        for name, program in _programs(manifest, rank).items():
            nodes = list(program.nodes)
            reduces = [i for i, n in enumerate(nodes) if n.kind == M.NODE_KIND_ALL_REDUCE]
            if program.operation in (C.OPERATION_INITIALIZATION, C.OPERATION_RESTORATION):
                assert not reduces, name
                continue
            assert len(reduces) == 2 * LAYERS, name                              # attention output + down
            for i in reduces:
                projection, reduce = nodes[i - 1], nodes[i]
                assert projection.kernel == PROJECTION_KERNELS[min(rank, 1)], (name, i)
                assert projection.label.rsplit(".", 1)[1] in ("attn_output", "down")
                assert reduce.label == projection.label + ".all_reduce"
                target = projection.args[0].pointer
                assert (reduce.args[0].pointer.buffer, reduce.args[0].pointer.byte_offset) == ("scratch.hidden", 0)
                assert target.buffer == "scratch.hidden"
                assert reduce.args[1].i64 == program.capacity.tokens * HIDDEN
                assert reduce.args[2].i32 == C.DTYPE_F32
    assert sum(1 for n in _programs(manifest, 1)["decode.r1.t1"].nodes if n.kernel == "linear.residual.v1") == 0


# ---- the CPU oracle: TP=2 equals TP=1 -------------------------------------------------------------

def test_tp2_prefill_logits_equal_tp1(tp_model, tp1_model):
    tp1 = prefill_logits(tp1_model, PROMPT, chunk=6)
    tp2 = prefill_logits(tp_model, PROMPT, chunk=6)
    assert sorted(tp1) == sorted(tp2) == [5, 11, 17, 23]
    for position in tp1:
        assert np.abs(tp2[position] - tp1[position]).max() <= LOGIT_TOLERANCE, position


def _assert_ranks_agree(model: NativeModel) -> None:
    """Every rank drew the same tokens: sampling state, logits and completion records are identical."""
    assert rank_disagreements(model, RANK_STATE + ("scratch.logits",)) == []


@pytest.mark.parametrize("batch", [1, 4])
def test_tp2_greedy_tokens_equal_tp1_for_64_steps(tp_model, tp1_model, batch):
    # spec: OWN-14
    prompts = PROMPTS[:batch]
    tp1_tokens, tp1_logits = greedy_with_logits(tp1_model, prompts, STEPS)
    tp2_tokens, tp2_logits = greedy_with_logits(tp_model, prompts, STEPS)
    assert all(len(t) == STEPS for t in tp1_tokens)
    assert tp2_tokens == tp1_tokens
    assert np.abs(tp2_logits - tp1_logits).max() <= LOGIT_TOLERANCE
    _assert_ranks_agree(tp_model)


# ---- unsupported degrees and malformed rank programs ---------------------------------------------

def test_more_ranks_than_kv_heads_is_a_typed_error_naming_the_option():
    from ignition.preparation.prepare import prepare
    from ignition.recipes import smollm2_135m_instruct

    with pytest.raises(TensorParallelError) as error:
        prepare(smollm2_135m_instruct, engine_test_options(tensor_parallel=4))   # 3 KV heads
    assert error.value.option == "tensor_parallel" and error.value.degree == 4
    assert "tensor_parallel=4" in str(error.value) and "kv_groups" in str(error.value)


@pytest.mark.parametrize("degree,reason", [(5, "does not divide the 1536 units of 'ffn'"),
                                           (0, "positive"), (9, "more ranks than the 8 units of 'kv_groups'")])
def test_degrees_the_dimensions_do_not_allow_are_refused(degree, reason):
    dimensions = (PartitionedDimension("kv_groups", 8, uneven=True), PartitionedDimension("ffn", 1536, uneven=False))
    with pytest.raises(TensorParallelError, match=reason) as error:
        Partition.plan(dimensions, degree)
    assert str(error.value).startswith(f"tensor_parallel={degree}:")


def test_helios_prepare_reports_an_unsupported_degree(tmp_path, capsys):
    from ignition.cli import prepare_main

    assert prepare_main(["smollm2-135m-instruct", "--out", str(tmp_path / "x.core"), "--no-kernels",
                         "--key", str(tmp_path / "k.pem"), "--tensor-parallel", "4"]) == 2
    assert "tensor_parallel=4" in capsys.readouterr().err
    assert not (tmp_path / "x.core").exists()


def test_shards_of_every_part_reassemble_the_fused_tensor():
    # a fused [q; k; v] weight of 3 KV groups (q: 2 heads per group), head width 2, over 2 ranks
    partition = Partition.plan([PartitionedDimension("kv_groups", 3, uneven=True)], 2)
    assert partition.ranges["kv_groups"] == ((0, 2), (2, 3))
    q, k, v = (np.arange(n * 4).reshape(n, 4) + base for n, base in ((12, 0), (6, 100), (6, 200)))
    fused = np.concatenate([q, k, v])
    split = Split(0, "kv_groups", (4, 2, 2))
    shards = [partition.shard(fused, split, rank) for rank in range(2)]
    assert shards[0].tolist() == np.concatenate([q[:8], k[:4], v[:4]]).tolist()
    assert shards[1].tolist() == np.concatenate([q[8:], k[4:], v[4:]]).tolist()
    assert partition.shard(fused, None, 1) is fused                       # replicated tensors are shared
    with pytest.raises(TensorParallelError, match="do not cover"):
        partition.shard(fused[:-1], split, 0)


def test_block_matrices_are_cut_between_blocks_as_their_expansion_is():
    # spec: OWN-2 (a rank's shard keeps the declared block storage where the cut allows)
    import gguf
    import gguf.quants
    from helios_backend.kernel_abi.blocks import BlockMatrix
    from helios_proto import contract_pb2 as C

    partition = Partition.plan([PartitionedDimension("ffn", 4, uneven=False)], 2)
    matrix = np.random.default_rng(5).standard_normal((8, 128)).astype(np.float32)
    stored = BlockMatrix(C.DTYPE_Q4_1, gguf.quants.quantize(matrix, gguf.GGMLQuantizationType.Q4_1))
    expanded = stored.expand()
    for split in (Split(0, "ffn", (1, 1)), Split(1, "ffn", (32,))):     # rows: gate/up; columns: down
        for rank in range(2):
            shard = partition.shard(stored, split, rank)
            assert isinstance(shard, BlockMatrix)
            assert np.array_equal(shard.expand(), partition.shard(expanded, split, rank))
    narrow = Split(1, "ffn", (8,))                  # 8-column units: rank 1 starts inside a block -> f16
    shard = partition.shard(BlockMatrix(stored.dtype, stored.data[:, :20]), narrow, 1)
    assert isinstance(shard, np.ndarray) and shard.dtype == np.float16
    assert np.array_equal(shard, partition.shard(expanded[:, :32], narrow, 1).astype(np.float16))


def test_all_reduce_nodes_are_recorded_only_between_ranks_and_only_over_scratch():
    single = Recorder()
    single.declare(shared.buffer("h", M.BUFFER_KIND_SCRATCH, C.DTYPE_F32, [4, 8]))
    single.begin("p", C.OPERATION_DECODE, C.Capacity(rows=1, tokens=4))
    with pytest.raises(RecordingError, match="more than one rank"):
        single.all_reduce("x", single.ref("h"), 32)
    rec = Recorder(rank=1, world_size=2)
    rec.declare(shared.buffer("h", M.BUFFER_KIND_SCRATCH, C.DTYPE_F32, [4, 8]))
    rec.declare(shared.buffer("s", M.BUFFER_KIND_STATE, C.DTYPE_F32, [4]))
    rec.begin("p", C.OPERATION_DECODE, C.Capacity(rows=1, tokens=4))
    with pytest.raises(RecordingError, match="do not fit"):
        rec.all_reduce("x", rec.ref("h"), 33)
    with pytest.raises(RecordingError, match="may not write"):
        rec.forward_view().all_reduce("x", rec.ref("s"), 4)
    rec.forward_view().all_reduce("x", rec.ref("h", 32), 24)
    [node] = rec.end().nodes
    assert node.kind == M.NODE_KIND_ALL_REDUCE and (node.args[1].i64, node.args[2].i32) == (24, C.DTYPE_F32)
    with pytest.raises(RecordingError, match="outside a world"):
        Recorder(rank=2, world_size=2)


def test_ranks_with_different_all_reduces_fail_the_numpy_load(tp_bootstrap):
    # spec: OWN-20
    manifest = M.ExecutionManifest()
    manifest.CopyFrom(tp_bootstrap.manifest)
    program = next(p for p in manifest.programs if p.rank == 1 and p.name == "decode.r1.t1")
    last = max(i for i, n in enumerate(program.nodes) if n.kind == M.NODE_KIND_ALL_REDUCE)
    del program.nodes[last]
    with pytest.raises(KernelArgumentError, match="different all-reduce"):
        NumpyExecutor(manifest, tp_bootstrap.read_resource,
                      NumpyExecutorOptions(cache_pages=4, programs=frozenset({"decode.r1.t1"})))


def test_a_program_missing_on_one_rank_fails_the_numpy_load(tp_bootstrap):
    # spec: OWN-19
    from helios_backend.executors.base import MissingVariantError

    manifest = M.ExecutionManifest()
    manifest.CopyFrom(tp_bootstrap.manifest)
    kept = [p for p in manifest.programs if not (p.rank == 1 and p.name == "decode.r2.t2")]
    del manifest.programs[:]
    manifest.programs.extend(kept)
    with pytest.raises(MissingVariantError, match="rank 1"):
        NumpyExecutor(manifest, tp_bootstrap.read_resource,
                      NumpyExecutorOptions(cache_pages=4, programs=frozenset({"decode.r2.t2"})))


def test_every_rank_program_plans_for_the_cuda_executor(tp_bootstrap):
    """Per-rank programs resolve against each rank's own arena, all-reduces included (CPU, no driver)."""
    from helios_backend.executors.cuda.plan import (AllReduceLaunch, BufferAddresses, kernel_table, layout_arena,
                                                    plan_program)
    from helios_backend.kernel_abi import abi

    manifest = tp_bootstrap.manifest
    kernels = [M.Kernel(id=k, symbol=k, params=[p.kind for p in spec.params], num_warps=4)
               for k, spec in abi.KERNELS.items()]
    table = kernel_table([M.KernelModule(resource="abi", kernels=kernels)])
    for rank in range(DEGREE):
        layout = layout_arena(manifest.buffers, rank)
        base = (rank + 1) << 40
        addresses = {name: base + offset for name, offset in layout.offsets.items()}
        nbytes = {name: int(layout.buffers[name].nbytes) for name in layout.offsets}
        for i, (name, page) in enumerate(layout.cache_page_nbytes.items()):
            addresses[name], nbytes[name] = base + (1 << 32) * (i + 1), page * 64
        for program in _programs(manifest, rank).values():
            for node in program.nodes:
                node.block.x = 0                   # unit geometry from a library-less recording
            launches = plan_program(program, table, BufferAddresses(addresses, nbytes))
            reduces = [launch for launch in launches if isinstance(launch, AllReduceLaunch)]
            assert len(launches) == len(program.nodes)
            assert all(r.address == addresses["scratch.hidden"] for r in reduces)


def test_the_triton_partial_projection_matches_its_reference():
    pytest.importorskip("triton")
    from helios_backend.kernel_abi import abi
    from helios_backend.kernel_abi.state import geometry_words, step_geometry
    from ignition.gpu_kernels.interpret import Interpreter
    from ignition.gpu_kernels.signature import triton_signature
    from ignition.gpu_kernels.specs import SPECS_BY_ID

    rng = np.random.default_rng(7)
    tokens, in_dim, out_dim, live = 20, 96, 48, 17
    geometry = np.zeros(geometry_words(1, tokens), np.int32)
    step_geometry(geometry, np.array([live], np.int32), 1, tokens)
    buffers = {"out": np.full((tokens, out_dim), 5.0, np.float32),              # stale rows must become 0
               "x": rng.standard_normal((tokens, in_dim)).astype(np.float32),
               "weight": (rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float16),
               "geometry": geometry}
    immediates = {"tokens": tokens, "in_dim": in_dim, "out_dim": out_dim}
    spec, kernel = abi.kernel("linear.project.v1"), SPECS_BY_ID["linear.project.v1"]
    offsets, size = {}, 0
    for param in spec.params[:4]:
        offsets[param.name] = size
        size = -(-(size + buffers[param.name].nbytes) // 256) * 256
    arena = np.zeros(size, np.uint8)
    for name, offset in offsets.items():
        arena[offset:offset + buffers[name].nbytes] = buffers[name].reshape(-1).view(np.uint8)
    args = [offsets[p.name] if p.is_pointer else immediates[p.name] for p in spec.params]
    with Interpreter() as interpreter:
        interpreter.run(kernel.module, kernel.function, triton_signature(spec.id),
                        kernel.grid(immediates, kernel.constexprs), arena, args, kernel.constexprs)
    got = arena[offsets["out"]:offsets["out"] + buffers["out"].nbytes].view(np.float32).reshape(tokens, out_dim)
    expected = buffers["out"].copy()
    spec.reference(expected.reshape(-1), buffers["x"].reshape(-1), buffers["weight"].astype(np.float32).reshape(-1),
                   geometry, tokens, in_dim, out_dim)
    assert np.all(expected[live:] == 0) and np.all(got[live:] == 0)
    np.testing.assert_allclose(got, expected, atol=2e-2, rtol=1e-2)


def test_preparing_without_tensor_parallelism_keeps_one_rank():
    from ignition.preparation.prepare import prepare
    from ignition.recipes import smollm2_135m_instruct

    options = dataclasses.replace(engine_test_options(), decode_rows=(1,), prefill_variants=((1, 16),),
                                  mixed_variants=(), admission_rows=(1,), restoration_rows=(1,), resume_rows=(),
                                  scored_prefill_variants=())
    prepared = prepare(smollm2_135m_instruct, options)
    assert prepared.manifest.world_size == 1 and {p.rank for p in prepared.manifest.programs} == {0}
    assert not any(n.kind == M.NODE_KIND_ALL_REDUCE for p in prepared.manifest.programs for n in p.nodes)
    assert [r.id for r in prepared.resources if r.id.startswith("weights.")] == ["weights.rank0"]


@pytest.mark.parametrize("name", ["decode.r4.t4", "mixed.r2.t17", "restoration.r2"])
def test_the_device_scripts_program_comparison_passes_on_the_cpu_oracle(tp_model, tp1_model, name):
    """tests/gpu/tensor_parallel.py compares per program exactly so on the GPU (there: the CUDA executor)."""
    from tests.gpu.tensor_parallel import compare_program

    program = next(p for p in tp_model.execution_manifest.programs if p.name == name and p.rank == 0)
    result = compare_program({1: tp1_model, 2: tp_model}, program, index=7)
    assert result["pass"], result
    assert result["logit_rel_err"] <= LOGIT_TOLERANCE / 10


# ---- the CUDA executor's two-rank startup and serving, over a fake driver and a fake NCCL ----------

class _StreamCaptureDriver:
    """FakeDriver whose captures are kept per stream: the ranks capture at once on their own threads.
    Weight copies are counted, not kept. NCCL calls made while a stream captures become its nodes."""

    def __new__(cls):
        import threading

        from tests.gpu.fake_driver import OK, FakeDriver, Launch

        class LockstepGenerator(FakeDriver):
            def __init__(self) -> None:
                super().__init__()
                self.lock = threading.Lock()
                self.open: dict[object, list] = {}
                self.graph_streams: list[object] = []
                self.copied_bytes = 0

            def cuMemcpyHtoD(self, dst, src, nbytes):
                self.copied_bytes += nbytes
                return OK

            def cuStreamBeginCapture(self, stream, mode):
                with self.lock:
                    self.open[stream] = []
                return OK

            def cuLaunchKernelEx(self, config, function, argv, extra):
                with self.lock:
                    self.open[config.hStream].append(Launch(config, function, int(argv)))
                return OK

            def cuStreamEndCapture(self, stream):
                with self.lock:
                    self.graphs.append(self.open.pop(stream))
                    self.graph_streams.append(stream)
                    return (0, len(self.graphs) - 1)

        return LockstepGenerator()


class _FakeNccl:
    def __init__(self, driver) -> None:
        self.driver = driver
        self.eager: list[tuple] = []

    def unique_id(self) -> bytes:
        return b"uid"

    def init_rank(self, world_size: int, uid: bytes, rank: int) -> int:
        return 100 + rank

    def all_reduce(self, address: int, count: int, dtype: int, comm: int, stream) -> None:
        with self.driver.lock:
            captured = self.driver.open.get(stream)
            (captured if captured is not None else self.eager).append(("all_reduce", address, count, dtype, comm))

    def destroy(self, comm: int) -> None:
        pass


def with_stand_in_module(source: M.ExecutionManifest) -> M.ExecutionManifest:
    """A copy of a test core's manifest for the fake driver: the test core has no cubins, so one
    stand-in module whose symbols are the kernel ids, and unit geometry (a library-less recording)."""
    from helios_backend.kernel_abi import abi

    manifest = M.ExecutionManifest()
    manifest.CopyFrom(source)
    manifest.modules.add(resource="fake.cubin", arch="sm_90a", kernels=[
        M.Kernel(id=k, symbol=k, params=[p.kind for p in spec.params], num_warps=4, trailing_null_pointers=2)
        for k, spec in abi.KERNELS.items()])
    for program in manifest.programs:
        for node in program.nodes:
            node.block.x = 0
    return manifest


def test_the_cuda_executor_starts_both_ranks_and_captures_their_all_reduces(tp_bootstrap, monkeypatch):
    # spec: OWN-10, OWN-14, OWN-18
    from helios_backend.executors import cuda_executor
    from helios_backend.executors.cuda.driver import CountingDriver

    manifest = with_stand_in_module(tp_bootstrap.manifest)
    fake = _StreamCaptureDriver()
    nccl = _FakeNccl(fake)
    monkeypatch.setattr(cuda_executor, "Nccl", lambda: nccl)

    def read(resource: str) -> bytes:
        return b"\0" * 64 if resource == "fake.cubin" else tp_bootstrap.read_resource(resource)

    programs = frozenset({"decode.r1.t1", "prefill.r1.t16"})
    counting = CountingDriver(fake)
    executor = cuda_executor.CudaExecutor(manifest, read, cuda_executor.CudaExecutorOptions(
        cache_pages=4, programs=programs), driver=counting)
    try:
        assert executor.world_size == DEGREE and set(executor.programs) == programs
        weights = sum(b.nbytes for b in manifest.buffers if b.kind == M.BUFFER_KIND_WEIGHT)
        assert fake.copied_bytes >= weights                          # both ranks' weight resources
        assert sorted(e[4] for e in nccl.eager) == [100, 101]      # each rank connected once, eagerly
        graphs = list(zip(fake.graph_streams, fake.graphs))
        assert len(graphs) == DEGREE * len(programs) * manifest.transport.frames
        streams = [r.stream for r in executor._ranks]
        for rank, stream in enumerate(streams):
            decode = [g for s, g in graphs if s == stream and any(
                getattr(x, "function", None) == "attention.paged_split.v1" for x in g)]
            assert len(decode) == manifest.transport.frames
            nodes = decode[0]
            reduces = [i for i, x in enumerate(nodes) if isinstance(x, tuple)]
            assert len(reduces) == 2 * LAYERS
            for i in reduces:
                _, address, count, dtype, comm = nodes[i]
                assert nodes[i - 1].function == PROJECTION_KERNELS[min(rank, 1)]
                assert (count, dtype, comm) == (HIDDEN, C.DTYPE_F32, 100 + rank)
                assert address == executor._ranks[rank].addresses.base["scratch.hidden"]
        counting.counting = True
        executor.staging(0)[:] = 0
        executor.launch("decode.r1.t1", 0)
        executor.wait(0)
        counting.counting = False
        assert dict(counting.calls) == {"cuGraphLaunch": DEGREE, "cuEventSynchronize": DEGREE}
    finally:
        executor.close()


def test_speculative_programs_run_on_both_ranks():
    # SPECULATIVE programs record per rank through the same forward pass: history-drafted rounds on
    # the TP=2 numpy oracle give the plain greedy tokens (the model continues the repeated cycle)
    from helios_backend.lockstep.generator import LockstepGenerator, GenerationRequest
    from helios_backend.lockstep.speculative import SpeculativeLockstepGenerator
    from helios_backend.scheduler.speculative import SpeculativeOptions
    from ignition.preparation.prepare import prepare
    from ignition.recipes import smollm2_135m_instruct
    from tests.engine_fixtures import resource_reader

    options = engine_test_options(tensor_parallel=DEGREE, decode_rows=(1, 2), prefill_variants=((1, 64),),
                                  mixed_variants=(), admission_rows=(1, 2), snapshot_rows=0, resume_rows=(),
                                  speculative_variants=((2, 1, 0, 2), (2, 4, 3, 8)))
    prepared = prepare(smollm2_135m_instruct, options)
    assert {p.rank for p in prepared.manifest.programs if p.operation == C.OPERATION_SPECULATIVE} == {0, 1}
    model = NativeModel.load(prepared.contract, prepared.manifest, resource_reader(prepared),
                             ModelOptions(cache_pages=32))
    try:
        repeating = list(range(100, 110)) * 3
        request = GenerationRequest(repeating, max_tokens=14)
        [plain] = LockstepGenerator(model).generate([request])
        run = SpeculativeLockstepGenerator(model, SpeculativeOptions(enabled=True, history_drafting=True)).generate([request])
        assert plain.tokens == run.results[0].tokens == list(range(100, 110)) + list(range(100, 104))
        assert run.accepted > 0
        assert rank_disagreements(model, RANK_STATE + ("state.draft_cursor",)) == []
    finally:
        model.close()


def _served_tokens(core: pathlib.Path, activations: str | None = None) -> list[int]:
    from helios_backend.scheduler.request import RequestSpec, SamplingSettings
    from helios_backend.engine.responses import Stream
    from helios_backend.engine.engine import Engine
    from helios_backend.engine.settings import StartupOptions
    from tests.test_rules_scheduler import Sender

    runtime = Engine.start(StartupOptions(core, ACCEPTANCE, activations=activations))
    sender = Sender()
    try:
        assert runtime.model.execution_manifest.world_size == (DEGREE if core.name.startswith("smollm2-tp") else 1)
        assert runtime.model.executor.cpu_options.activations == (activations or "f32")
        runtime.add_request(RequestSpec(tuple(PROMPT), 12, SamplingSettings(temperature=0.7, seed=5)), Stream(1, sender))
        assert sender.done.wait(120)
    finally:
        runtime.stop(drain=True)
    assert sender.finals[0].terminal.WhichOneof("outcome") == "finished", sender.finals[0]
    return sender.tokens


def test_the_serving_runtime_serves_a_tp2_core_like_the_tp1_core(tp_core, smollm2_core):
    # spec: OWN-13, OWN-14: startup, scheduler and worker unchanged; completion words from rank 0
    # the CPU executor's default activations of a tensor-parallel core are f32 (cpu_executor.
    # default_activations: the ranks' split of K rounds otherwise, which q8 would amplify), so its
    # answer is the one-rank core's with f32 activations (that core's own default is q8)
    tp2 = _served_tokens(tp_core)
    assert tp2 == _served_tokens(smollm2_core, "f32") and len(tp2) == 12
