"""What of the CUDA executor can be checked without a GPU: imports, arena layout, launch
plans and parameter packing, staging runs, and the executor's startup and serving paths
over a fake driver (graphs captured per (program, frame); serving makes only graph
launches and event waits)."""
from __future__ import annotations

import numpy as np
import pytest

from helios_backend.executors.base import FrameStateError, MissingVariantError, UnknownProgramError
from helios_backend.executors.cuda import staging_copy as sc
from helios_backend.executors.cuda.driver import CountingDriver, check
from helios_backend.executors.cuda.errors import CudaCallError, ManifestError, ProgramError
from helios_backend.executors.cuda.plan import (MIN_ALIGNMENT, BufferAddresses, ParamPack, kernel_table,
                                                layout_arena, plan_program)
from helios_backend.executors.cuda_executor import CudaExecutor, CudaExecutorOptions
from helios_proto import manifest_pb2 as M
from tests.gpu import toy_manifest as toy
from tests.gpu.fake_driver import FakeDriver

N = 100


def _addresses(manifest: M.ExecutionManifest, base: int = 1 << 40) -> BufferAddresses:
    layout = layout_arena(manifest.buffers, 0)
    addresses = {name: base + offset for name, offset in layout.offsets.items()}
    nbytes = {name: int(layout.buffers[name].nbytes) for name in layout.offsets}
    for i, (name, page) in enumerate(layout.cache_page_nbytes.items()):
        addresses[name], nbytes[name] = base + (1 << 32) * (i + 1), page * 64
    return BufferAddresses(addresses, nbytes)


# spec: OWN-17
def test_imports_without_gpu_and_checked_calls_raise_typed_errors() -> None:
    assert check((0, 5)) == 5 and check((0,)) is None and check((0, 1, 2)) == (1, 2)
    with pytest.raises(CudaCallError) as error:
        check((2,), "cuMemAlloc")
    assert error.value.code == 2 and error.value.call == "cuMemAlloc"


def test_arena_layout_aligns_every_buffer_and_keeps_cache_apart() -> None:
    layout = layout_arena(toy.build(n=N).buffers, 0)
    assert set(layout.offsets) == {"weights", "tuned", "staging", "completion", "scratch"}
    assert all(offset % MIN_ALIGNMENT == 0 for offset in layout.offsets.values())
    order = sorted(layout.offsets, key=layout.offsets.get)
    assert order[0] == "weights" and order[-1] == "scratch"          # read-only first, temporaries last
    assert layout.cache_page_nbytes == {"cache": 4 * N}
    ends = sorted((o, o + layout.buffers[n].nbytes) for n, o in layout.offsets.items())
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ends, ends[1:]))   # no overlap


def test_arena_rejects_duplicate_names() -> None:
    manifest = toy.build(n=N)
    manifest.buffers.append(M.Buffer(name="weights", rank=0, kind=M.BUFFER_KIND_SCRATCH, nbytes=4))
    with pytest.raises(ManifestError):
        layout_arena(manifest.buffers, 0)


def test_param_pack_slots_hold_each_kind_at_the_start_of_8_bytes() -> None:
    pack = ParamPack([(M.PARAM_KIND_POINTER, 0x1234_5678_9ABC), (M.PARAM_KIND_I32, -7), (M.PARAM_KIND_F32, 0.5),
                      (M.PARAM_KIND_I64, -(1 << 40)), (M.PARAM_KIND_U64, (1 << 64) - 1)])
    raw = pack.values.view(np.uint8)
    assert pack.slot(0, M.PARAM_KIND_POINTER) == 0x1234_5678_9ABC
    assert raw[8:12].view(np.int32)[0] == -7 and raw[16:20].view(np.float32)[0] == 0.5
    assert pack.slot(3, M.PARAM_KIND_I64) == -(1 << 40) and pack.slot(4, M.PARAM_KIND_U64) == (1 << 64) - 1
    assert [int(a) - pack.values.ctypes.data for a in pack.argv] == [0, 8, 16, 24, 32]


def test_plan_resolves_pointers_and_immediates() -> None:
    manifest = toy.build(n=N, chains={"chain": 3})
    addresses = _addresses(manifest)
    launches = plan_program(manifest.programs[0], kernel_table(manifest.modules), addresses)
    assert [l.kernel_id for l in launches] == ["toy_begin", "toy_axpb", "toy_axpb", "toy_axpb",
                                                "toy_add_tuned", "toy_finish"]
    first = launches[1]
    assert first.params.slot(0, M.PARAM_KIND_POINTER) == addresses.base["staging"] + toy.X_OFFSET
    assert first.params.slot(1, M.PARAM_KIND_POINTER) == addresses.base["weights"]
    assert first.params.slot(3, M.PARAM_KIND_F32) == 2.0 and first.params.slot(5, M.PARAM_KIND_I32) == N
    assert first.block == (toy.THREADS, 1, 1) and first.grid == (1, 1, 1) and first.pdl
    assert launches[-1].params.slot(2, M.PARAM_KIND_I64) == toy.CACHE_PAGE


def test_plan_appends_trailing_null_pointers() -> None:
    manifest = toy.build(n=N)
    manifest.modules[0].kernels[0].trailing_null_pointers = 2       # toy_begin, as Triton kernels have
    launches = plan_program(manifest.programs[0], kernel_table(manifest.modules), _addresses(manifest))
    assert len(launches[0].params.argv) == 2 + 2
    assert launches[0].params.slot(2, M.PARAM_KIND_POINTER) == 0 == launches[0].params.slot(3, M.PARAM_KIND_POINTER)


@pytest.mark.parametrize("breakage", ["arity", "kind", "kernel", "offset", "block"])
def test_plan_rejects_programs_that_do_not_fit_the_abi(breakage: str) -> None:
    manifest = toy.build(n=N)
    node = manifest.programs[0].nodes[1]
    if breakage == "arity":
        del node.args[-1]
    elif breakage == "kind":
        node.args[3].i32 = 2
    elif breakage == "kernel":
        node.kernel = "no_such_kernel"
    elif breakage == "offset":
        node.args[0].pointer.byte_offset = 1 << 30
    else:
        node.block.x = 64
    with pytest.raises(ProgramError):
        plan_program(manifest.programs[0], kernel_table(manifest.modules), _addresses(manifest))


def test_staging_runs_cover_referenced_destinations_only() -> None:
    manifest = toy.build(n=N)
    runs = sc.staging_runs(manifest.programs[0], manifest.transport)
    assert runs == [(0, toy.X_OFFSET + 4 * N)]                   # header and x merge into one run
    transport = M.Transport(staging_buffer="staging", frame_nbytes=1 << 20, destinations=[
        M.Destination(name="transport.header", dtype=8, byte_offset=0, elements=2),
        M.Destination(name="a", dtype=8, byte_offset=64, elements=16),
        M.Destination(name="big", dtype=8, byte_offset=1024, elements=100_000),
        M.Destination(name="b", dtype=8, byte_offset=500_000, elements=16)])
    program = M.Program(nodes=[M.Node(kind=M.NODE_KIND_KERNEL, args=[
        M.Arg(pointer=M.BufferRef(buffer="staging", byte_offset=64)),
        M.Arg(pointer=M.BufferRef(buffer="staging", byte_offset=500_000))])])
    assert sc.staging_runs(program, transport) == [(0, 128), (500_000, 64)]   # "big" is never copied
    program.nodes[0].args.append(M.Arg(pointer=M.BufferRef(buffer="staging", byte_offset=900_000)))
    assert sc.staging_runs(program, transport) == [(0, 1 << 20)]             # undeclared window: all


def test_staging_runs_merge_to_at_most_four() -> None:
    destinations = [M.Destination(name=f"d{i}", dtype=8, byte_offset=i * 100_000, elements=4) for i in range(8)]
    transport = M.Transport(staging_buffer="staging", frame_nbytes=1 << 20, destinations=destinations)
    program = M.Program(nodes=[M.Node(kind=M.NODE_KIND_KERNEL, args=[
        M.Arg(pointer=M.BufferRef(buffer="staging", byte_offset=i * 100_000)) for i in range(8)])])
    runs = sc.staging_runs(program, transport)
    assert len(runs) <= sc.MAX_RUNS
    covered = [any(s <= i * 100_000 < s + n for s, n in runs) for i in range(8)]
    assert all(covered)


def _executor(driver, **options) -> CudaExecutor:
    manifest = toy.build(n=N, chains={"chain": 3}, nops={"nops": (4, 1)})
    return CudaExecutor(manifest, toy.resources(b"\0" * 64, N).__getitem__, CudaExecutorOptions(**options),
                        driver=driver)


@pytest.mark.parametrize("transport", ["kernel", "memcpy"])
def test_startup_captures_one_graph_per_program_and_frame(transport: str) -> None:
    fake = FakeDriver()
    executor = _executor(fake, transport=transport, cache_pages=4)
    assert set(executor.programs) == {"chain", "nops"} and executor.cache_pages == 4
    # tuning producer + 2 programs x 2 frames
    assert len(fake.graphs) == 1 + 2 * 2
    chain = fake.graphs[1]
    functions = [launch.function for launch in chain]
    if transport == "kernel":
        assert functions[0] == sc.STAGE_IN and functions[-1] == sc.COMPLETE_OUT
        assert functions[1:-1] == ["toy_begin", "toy_axpb", "toy_axpb", "toy_axpb", "toy_add_tuned", "toy_finish"]
    else:
        assert functions == ["toy_begin", "toy_axpb", "toy_axpb", "toy_axpb", "toy_add_tuned", "toy_finish"]
    weights = [data for _, data in fake.copies_to_device]
    assert toy.weights(N, 0).tobytes() in weights                    # weights copied in at startup
    executor.close()


def test_automatic_cache_pages_use_the_memory_left() -> None:
    fake = FakeDriver(total_memory=1 << 30)
    executor = _executor(fake)
    page = 4 * N
    assert executor.cache_pages == int((1 << 29) * 0.9 - (2 << 20)) // page
    executor.close()


# spec: OWN-18
def test_serving_makes_only_graph_launches_and_event_waits() -> None:
    counting = CountingDriver(FakeDriver())
    executor = _executor(counting, cache_pages=2)
    counting.counting = True
    for step in range(6):
        frame = step % 2
        if step >= 2:
            executor.wait(frame)
        toy.pack(executor.staging(frame), np.ones(N, np.float32))
        executor.launch("chain", frame)
    executor.wait(0)
    executor.wait(1)
    counting.counting = False
    assert counting.forbidden_calls() == {}
    assert dict(counting.calls) == {"cuGraphLaunch": 6, "cuEventSynchronize": 6}
    executor.close()


def test_launch_writes_sequence_and_frame_into_the_header() -> None:
    executor = _executor(FakeDriver(), cache_pages=2)
    for step in range(3):
        frame = step % 2
        if step >= 2:
            executor.wait(frame)
        executor.launch("chain", frame)
        assert executor.staging(frame)[:8].view(np.int32).tolist() == [step, frame]
    executor.close()


def test_frame_state_and_unknown_programs_are_typed_errors() -> None:
    executor = _executor(FakeDriver(), cache_pages=2)
    with pytest.raises(FrameStateError):
        executor.wait(0)
    executor.launch("chain", 0)
    with pytest.raises(FrameStateError):
        executor.launch("chain", 0)
    with pytest.raises(UnknownProgramError):
        executor.launch("absent", 1)
    executor.close()


def test_auxiliary_frame_holds_only_initialization_and_restoration_graphs() -> None:
    # spec: BND-20, OWN-18
    from helios_proto import contract_pb2 as C

    fake = FakeDriver()
    manifest = toy.build(n=N, chains={"chain": 3}, nops={"nops": (4, 1)})
    graphs = [C.GraphContract(program="nops", operation=C.OPERATION_INITIALIZATION),
              C.GraphContract(program="chain", operation=C.OPERATION_DECODE)]
    executor = CudaExecutor(manifest, toy.resources(b"\0" * 64, N).__getitem__, CudaExecutorOptions(cache_pages=2),
                            driver=fake, graphs=graphs)
    assert (executor.frames, executor.auxiliary_frames) == (2, 1)
    assert len(fake.graphs) == 1 + 2 + 3                 # tuning, chain on two frames, nops on three
    executor.launch("chain", 0)
    executor.launch("nops", 2)                           # while frame 0 is in flight
    assert executor.staging(2)[:8].view(np.int32).tolist() == [1, 2]
    with pytest.raises(FrameStateError):
        executor.launch("chain", 2)                      # a main step never takes the auxiliary frame
    executor.wait(2)
    executor.wait(0)
    executor.close()
    plain = _executor(FakeDriver(), cache_pages=2)
    assert plain.auxiliary_frames == 0                   # no graphs given: nothing is auxiliary
    plain.close()


# spec: OWN-19
def test_missing_variant_fails_startup() -> None:
    with pytest.raises(MissingVariantError):
        _executor(FakeDriver(), cache_pages=2, programs=["chain", "decode.r999"])


def test_recorded_model_programs_plan_against_the_abi() -> None:
    """Every program the engine records for the real model plans: arity, kinds, buffers, offsets."""
    pytest.importorskip("gguf")
    from helios_backend.kernel_abi import abi
    from tests.engine_fixtures import prepared_in_memory

    manifest = prepared_in_memory().manifest
    kernels = [M.Kernel(id=k, symbol=k, params=[p.kind for p in spec.params], num_warps=4)
               for k, spec in abi.KERNELS.items()]
    table = kernel_table([M.KernelModule(resource="abi", kernels=kernels)])
    addresses = _addresses(manifest)
    for program in manifest.programs:
        for node in program.nodes:
            node.block.x = 0                                   # unit geometry from a library-less recording
        launches = plan_program(program, table, addresses)
        assert len(launches) == len(program.nodes)
        runs = sc.staging_runs(program, manifest.transport)
        assert 1 <= len(runs) <= sc.MAX_RUNS and all(n % sc.RUN_ALIGNMENT == 0 for _, n in runs)


# spec: OWN-11
def test_geometry_reports_offsets_and_backed_bytes() -> None:
    executor = _executor(FakeDriver(), cache_pages=4)
    offsets = executor.buffer_offsets()
    assert offsets["weights"] == 0 and set(offsets) >= {"staging", "completion", "cache"}
    assert executor.arena_nbytes() >= offsets["scratch"] + 8 * N + 4 * (4 * N)
    executor.close()


def test_binding_extents_limit_row_destinations_to_the_program_rows() -> None:
    from helios_proto import contract_pb2 as C

    transport = M.Transport(staging_buffer="staging", frame_nbytes=1 << 16, destinations=[
        M.Destination(name="transport.header", dtype=C.DTYPE_I32, byte_offset=0, elements=2),
        M.Destination(name="mask", dtype=C.DTYPE_U32, byte_offset=64, elements=8 * 100),
        M.Destination(name="tokens", dtype=C.DTYPE_I32, byte_offset=8192, elements=512),
        M.Destination(name="pages", dtype=C.DTYPE_I32, byte_offset=16384, elements=8 * 64)])

    def graph(name: str, rows: int, tokens: int) -> C.GraphContract:
        return C.GraphContract(program=name, capacity=C.Capacity(rows=rows, tokens=tokens), bindings=[
            C.ValueBinding(destination="mask", index=C.INDEX_MODE_SUBMISSION_ROW),
            C.ValueBinding(destination="tokens", index=C.INDEX_MODE_PACKED_TOKEN),
            C.ValueBinding(destination="pages", index=C.INDEX_MODE_PHYSICAL_ROW)])

    extents = sc.binding_extents([graph("one", 1, 1), graph("eight", 8, 40)], transport)
    assert extents["one"] == {"mask": 4 * 100, "tokens": 4, "pages": 4 * 8 * 64}     # width = 800 / 8 rows
    assert extents["eight"] == {"mask": 4 * 800, "tokens": 4 * 40, "pages": 4 * 8 * 64}
    program = M.Program(name="one", nodes=[M.Node(kind=M.NODE_KIND_KERNEL, args=[
        M.Arg(pointer=M.BufferRef(buffer="staging", byte_offset=offset)) for offset in (64, 8192, 16384)])])
    runs = sc.staging_runs(program, transport, extents["one"])
    assert runs == [(0, 464), (8192, 16), (16384, 2048)]
    assert sum(n for _, n in sc.staging_runs(program, transport)) > sum(n for _, n in runs)


def test_block_weights_are_expanded_to_f16_at_load() -> None:
    # spec: OWN-10 (each rank's resources loaded into the declared storage)
    """A Q4_1 / Q8_0 WEIGHT buffer (kernel_abi/blocks.py) is backed as the F16 matrix it expands to and
    filled with that expansion: the kernels read the f16 layout they were compiled for."""
    import gguf
    import gguf.quants
    from helios_backend.kernel_abi import blocks
    from helios_proto import contract_pb2 as C

    manifest = toy.build(n=N, chains={"chain": 3}, nops={"nops": (4, 1)})
    resources = toy.resources(b"\0" * 64, N)
    rng = np.random.default_rng(3)
    expected = {}
    for name, kind, dtype in (("matrix.q4_1", gguf.GGMLQuantizationType.Q4_1, C.DTYPE_Q4_1),
                              ("matrix.q8_0", gguf.GGMLQuantizationType.Q8_0, C.DTYPE_Q8_0)):
        stored = gguf.quants.quantize(rng.standard_normal((6, 64)).astype(np.float32), kind).reshape(-1)
        resources[name] = stored.tobytes()
        manifest.buffers.append(M.Buffer(name=name, rank=0, kind=M.BUFFER_KIND_WEIGHT, dtype=dtype, shape=[6, 64],
                                         nbytes=stored.size, alignment=256,
                                         weight=M.WeightSource(resource=name, byte_offset=0)))
        expected[name] = gguf.quants.dequantize(stored.reshape(6, -1), kind).astype(np.float16)
    fake = FakeDriver()
    executor = CudaExecutor(manifest, resources.__getitem__, CudaExecutorOptions(cache_pages=2), driver=fake)
    copies = dict(fake.copies_to_device)
    base = executor._ranks[0].addresses.base
    for name, matrix in expected.items():
        assert copies[base[name]] == matrix.tobytes()                       # the f16 expansion, not the blocks
        assert executor._ranks[0].arena.buffer_nbytes(name) == 6 * 64 * 2
    assert blocks.block_nbytes(C.DTYPE_Q4_1, (6, 64)) == 6 * 2 * 20         # what the core stores
    executor.close()
