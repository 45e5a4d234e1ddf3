"""Ahead-of-time Triton kernel library: sm_90a cubins, ABI parameter counts, and numerical
agreement with the numpy references through Triton's CPU interpreter (no GPU needed)."""
from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

triton = pytest.importorskip("triton")

from helios_backend.kernel_abi import abi  # noqa: E402
from helios_proto import manifest_pb2  # noqa: E402
from ignition.gpu_kernels.interpret import Interpreter  # noqa: E402
from ignition.gpu_kernels.library import KernelLibrary  # noqa: E402
from ignition.gpu_kernels.specs import SPECS_BY_ID  # noqa: E402

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> KernelLibrary:
    return KernelLibrary(cache_dir=tmp_path_factory.mktemp("cubins"))


@pytest.fixture(scope="module")
def modules(library: KernelLibrary):
    return library.build_modules(["sm_90a"])


# ---------------------------------------------------------------------------------------------
# compilation

def _elf_arch(cubin: bytes, tmp_path: Path) -> str:
    path = tmp_path / "k.cubin"
    path.write_bytes(cubin)
    header = subprocess.run([str(CUOBJDUMP), "-elf", str(path)], capture_output=True,
                            text=True, check=True).stdout
    return header.split("sm=")[1].split(",")[0]


def test_every_kernel_compiles_to_an_sm90a_cubin(library, modules, tmp_path):
    assert sorted(m.kernels[0].id for _, m in modules) == sorted(library.kernel_ids())
    for cubin, module in modules:
        assert cubin[:4] == b"\x7fELF"
        assert int.from_bytes(cubin[18:20], "little") == 190          # EM_CUDA
        assert module.arch == "sm_90a" and module.toolchain.startswith("triton ")
        assert not module.portable and module.capability == 90
        if CUOBJDUMP.exists():
            assert _elf_arch(cubin, tmp_path) == "90a"
        kernel = module.kernels[0]
        assert kernel.symbol.encode() + b"\x00" in cubin
        assert kernel.num_warps in (1, 2, 4, 8, 16)
        # within an H200 SM's 227 KiB opt-in limit (the executor opts in above 48 KiB), and
        # small enough that two programs share an SM
        assert kernel.shared_bytes <= 113 * 1024
        assert kernel.trailing_null_pointers == 2
        assert kernel.programmatic_dependent_launch and kernel.num_stages >= 1


WEIGHT_STREAMING = ("attention.qkv_rope_store.v1", "attention.qkv_norm_rope_store.v1",
                    "linear.residual.v1", "linear.norm_residual.v1", "mlp.norm_gate_up_silu.v1",
                    "mlp.norm_gate_up_activation.v1", "logits.norm_head.v1")


def _sass(cubin: bytes, tmp_path: Path) -> str:
    path = tmp_path / "s.cubin"
    path.write_bytes(cubin)
    return subprocess.run([str(CUOBJDUMP), "-sass", str(path)], capture_output=True, text=True,
                          check=True).stdout


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="cuobjdump not bundled with triton")
def test_sass_has_pdl_wait_tensor_cores_and_pipelined_vector_loads(modules, tmp_path):
    """What the performance design relies on, read back from the machine code: every kernel
    waits on its PDL predecessor (ACQBULK = griddepcontrol.wait); weight-streaming kernels
    start their weight traffic before that wait, run HMMA, and load through 16-byte cp.async."""
    for cubin, module in modules:
        kernel_id = module.kernels[0].id
        sass = _sass(cubin, tmp_path)
        assert "ACQBULK" in sass, kernel_id
        if kernel_id in WEIGHT_STREAMING + ("attention.paged.v1", "attention.paged_window.v1"):
            assert "HMMA" in sass or "HGMMA" in sass, kernel_id      # HGMMA: wgmma, M >= 64
            assert "LDGSTS.E.BYPASS.128" in sass, kernel_id
        if kernel_id in WEIGHT_STREAMING:
            # weight traffic starts before the first wait: the decode path's weight loads
            # (LDG) and the tile path's L2 prefetch (CCTL.E.PF2) both precede their ACQBULK
            before_wait = sass[:sass.find("ACQBULK")]
            assert "LDG" in before_wait or "CCTL.E.PF2" in before_wait, kernel_id
            assert "CCTL.E.PF2" in sass, kernel_id


def test_parameter_lists_match_the_abi_plus_two_scratch_pointers(library, modules):
    compiled = library.compile("sm_90a")
    for _, module in modules:
        kernel = module.kernels[0]
        assert len(kernel.params) == len(library.signature(kernel.id))
        assert compiled[kernel.id].ptx_params == len(kernel.params) + 2


def test_geometry_block_matches_the_cubin_and_leaves_shared_memory_to_the_module(library, modules):
    for _, module in modules:
        kernel = module.kernels[0]
        args = [16] * len(library.signature(kernel.id))   # valid for every grid rule
        grid, block, shared = library.geometry(kernel.id, args)
        assert block == (32 * kernel.num_warps, 1, 1)
        assert shared == 0            # each architecture's module declares its own (Kernel.shared_bytes)
        assert all(d >= 1 for d in grid)


def test_geometry_reads_recorded_immediates_and_rejects_oversized_variants(library, modules):
    from helios_proto import manifest_pb2
    from ignition.gpu_kernels.specs import GeometryError
    pointer = manifest_pb2.Arg(pointer=manifest_pb2.BufferRef(buffer="x"))
    values = {"rows": 64, "tokens": 64, "q_heads": 9, "kv_heads": 3, "head_dim": 64,
              "page_tokens": 16, "pages_per_row": 128, "page_stride": 1 << 20, "scale": 0.125}
    args = [pointer if p.is_pointer else
            manifest_pb2.Arg(f32=values[p.name]) if p.kind == abi.F32 else
            manifest_pb2.Arg(i64=values[p.name]) if p.kind == abi.I64 else
            manifest_pb2.Arg(i32=values[p.name]) for p in abi.kernel("attention.paged.v1").params]
    grid, _, _ = library.geometry("attention.paged.v1", args)
    assert grid == (-(-64 // (16 // 3)) + 64, 3, 1)
    names = [p.name for p in abi.kernel("attention.paged.v1").params]
    for name, bad in (("rows", manifest_pb2.Arg(i32=1000)),           # > MAX_ROWS
                      ("head_dim", manifest_pb2.Arg(i32=72)),         # not a multiple of 16
                      ("q", manifest_pb2.Arg(pointer=manifest_pb2.BufferRef(buffer="x",
                                                                            byte_offset=8)))):
        broken = list(args)
        broken[names.index(name)] = bad
        with pytest.raises(GeometryError):
            library.geometry("attention.paged.v1", broken)


def test_head_tiles_put_the_row_tiles_of_a_head_slice_side_by_side(library):
    """The LM head's tile grid is (row tiles, column blocks): the row tiles that read one head
    slice are consecutive programs (docs/kernels.md); the GEMV grid is unchanged, and a
    vocabulary needing more column blocks than grid y allows is refused."""
    from ignition.gpu_kernels.specs import GeometryError
    spec = abi.kernel("logits.norm_head.v1")
    immediates = {"tokens": 64, "dim": 640, "eps": 1e-6}

    def grid(rows: int, vocab: int):
        values = {**immediates, "rows": rows, "vocab": vocab}
        return library.geometry(spec.id, [0 if p.is_pointer else values[p.name] for p in spec.params])[0]

    assert grid(64, 262_144) == (2, 2048, 1)            # BLOCK_M 32, BLOCK_N 128
    assert grid(1, 262_144) == (262_144 // 8, 1, 1)      # GEMV: 8 columns per program
    with pytest.raises(GeometryError):
        grid(64, 128 * 65_536)


WIDE_IDS = ("attention.paged.v1", "attention.paged_split.v1", "attention.paged_window.v1")


@pytest.mark.parametrize("head_dim", [128, 256])
def test_wide_heads_compile_a_second_instantiation_only_where_a_core_launches_one(library, modules, head_dim):
    """128- and 256-dim heads widen the attention kernels' tiles for that core only: the narrow
    cubins (64-dim heads) are not the widened ones, each level fits the H200's and the PTX
    target's shared memory, and only a launch wider than BLOCK_D asks for the widening."""
    from ignition.gpu_kernels.targets import target
    narrow = {m.kernels[0].id: cubin for cubin, m in modules}
    widened = {kernel_id: head_dim for kernel_id in WIDE_IDS}
    for arch in ("sm_90a", "compute_80"):
        for image, module in library.build_modules([arch], widened=widened):
            kernel = module.kernels[0]
            assert kernel.shared_bytes <= target(arch).shared_limit
            if arch == "sm_90a":
                assert (image != narrow[kernel.id]) == (kernel.id in WIDE_IDS), kernel.id


def _node(kernel_id: str, label: str, buffers: dict[str, str]):
    """A recorded node of `kernel_id` whose pointer params point at the named buffers (others: a scratch)."""
    from helios_proto import manifest_pb2 as M
    args = [M.Arg(pointer=M.BufferRef(buffer=buffers.get(p.name, f"scratch.{p.name}"))) if p.is_pointer else M.Arg(i32=1)
            for p in abi.kernel(kernel_id).params]
    return M.Node(kind=M.NODE_KIND_KERNEL, kernel=kernel_id, label=label, args=args)


def test_reads_before_the_pdl_wait_must_not_race_the_node_before(library):
    """Split-KV attention reads the step geometry, positions and row slots before its PDL wait:
    after the q/k/v node (which writes q and the cache) that is safe; right after the node that
    writes the geometry it is not, and preparation is told which node and buffer."""
    state = {"geometry": "state.geometry", "positions": "state.positions", "row_slot": "state.row_slot"}
    attention = _node("attention.paged_split.v1", "layer0.attention", state)
    qkv = _node("attention.qkv_rope_store.v1", "layer0.qkv", {**state, "q_out": "scratch.q"})
    geometry = _node("step.geometry.v1", "geometry", state)
    assert library.spec("attention.paged_split.v1").early_reads
    assert library.early_read_conflicts([geometry, qkv, attention]) == []
    problems = library.early_read_conflicts([qkv, geometry, attention])
    assert len(problems) == 1 and "layer0.attention" in problems[0] and "state.geometry" in problems[0]


def test_a_launch_takes_the_narrowest_widening_level_that_serves_it(library):
    """64-dim heads: the base tiles; 65-128: [32 keys, 128 dims]; 129-256: [16 keys, 256 dims]
    (not the 256-wide tiles half masked); wider: a geometry error at preparation."""
    from ignition.gpu_kernels.specs import GeometryError
    buffers, immediates = _paged_case(*PAGED_CASES[0])
    spec = abi.kernel("attention.paged.v1")
    for head_dim, width, tiles in ((64, None, (64, 64)), (96, 96, (32, 128)), (128, 128, (32, 128)),
                                   (192, 192, (16, 256)), (256, 256, (16, 256)), (320, None, None)):
        args = [0 if p.is_pointer else {**immediates, "head_dim": head_dim}[p.name] for p in spec.params]
        if tiles is None:                                  # wider than every instantiation
            with pytest.raises(GeometryError):
                library.geometry(spec.id, args)
            continue
        assert library.widening_of(spec.id, args) == width
        chosen = library.tiles(spec.id, args)
        assert (chosen["WIDE_N"], chosen["WIDE_D"]) == tiles


def test_cached_cubins_are_reused_without_recompiling(library, modules, tmp_path_factory):
    files = sorted(library.cache_dir.iterdir())
    stamps = {f: f.stat().st_mtime_ns for f in files}
    again = KernelLibrary(cache_dir=library.cache_dir).build_modules(["sm_90a"])
    assert [c for c, _ in again] == [c for c, _ in modules]
    assert {f: f.stat().st_mtime_ns for f in files} == stamps


# ---------------------------------------------------------------------------------------------
# interpreter conformance

Array = np.ndarray | tuple[np.ndarray, int]     # a buffer, or (buffer, byte offset into it)


def check_against_reference(runner: "Runner", kernel_id: str,
                            buffers: dict[str, Array], immediates: dict[str, int | float],
                            atol: float = 0.0, rtol: float = 0.0,
                            spec: abi.KernelSpec | None = None) -> dict[str, np.ndarray]:
    """Run `kernel_id` (interpreter or GPU) and its numpy reference on the same inputs; compare
    every buffer the ABI says the kernel writes. Returns the kernel's buffers by name.

    Each pointer param gets its own buffer in one uint8 arena (the numpy executor's layout);
    the reference receives flat views from the pointer to the end of its buffer, as abi.py
    prescribes.
    """
    spec = spec or abi.kernel(kernel_id)
    regions, size = {}, 0
    for param in spec.params:
        if param.is_pointer:
            array, offset = buffers[param.name] if isinstance(buffers[param.name], tuple) \
                else (buffers[param.name], 0)
            start = -(-size // 256) * 256
            regions[param.name] = (start, np.ascontiguousarray(array), offset)
            size = start + array.nbytes
    arena = np.zeros(size + 256, np.uint8)
    for start, array, _ in regions.values():
        arena[start:start + array.nbytes] = array.reshape(-1).view(np.uint8)
    args = [regions[p.name][0] + regions[p.name][2] if p.is_pointer else immediates[p.name]
            for p in spec.params]
    runner.run(kernel_id, arena, args)

    expected = {name: array.reshape(-1).copy() for name, (_, array, _) in regions.items()}
    reference_args = [expected[p.name][regions[p.name][2] // expected[p.name].itemsize:]
                      if p.is_pointer else immediates[p.name] for p in spec.params]
    spec.reference(*reference_args)

    produced = {}
    for name, (start, array, _) in regions.items():
        produced[name] = arena[start:start + array.nbytes].view(array.dtype).reshape(array.shape)
    for param in spec.params:
        if param.is_pointer and param.access is not abi.Access.READ:
            got = produced[param.name].reshape(-1)
            np.testing.assert_allclose(got, expected[param.name], atol=atol, rtol=rtol,
                                       err_msg=f"{kernel_id}: {param.name}")
    return produced


@pytest.fixture(scope="module")
def interpreter():
    with Interpreter() as worker:
        yield worker


def launch_geometry(library: KernelLibrary, kernel_id: str, args: list):
    """The recorded grid (library.geometry: every kernel id is an ABI id)."""
    return library.geometry(kernel_id, args)[0]


class InterpreterRunner:
    """One launch exactly as recorded (library grid, ABI argument order), in the interpreter."""

    def __init__(self, library: KernelLibrary, interpreter: Interpreter,
                 tiles: dict[str, dict[str, int]] | None = None) -> None:
        """tiles: kernel id -> constexprs replacing some of the table's (smaller tiles reach a
        kernel's many-chunk paths on small inputs)."""
        self.library, self.interpreter = library, interpreter
        self.tiles = tiles or {}

    def run(self, kernel_id: str, arena: np.ndarray, args: list) -> None:
        spec = SPECS_BY_ID[kernel_id]
        constexprs = {**self.library.tiles(kernel_id, args), **self.tiles.get(kernel_id, {})}
        self.interpreter.run(spec.module, spec.function, self.library.signature(kernel_id),
                             self.library.geometry(kernel_id, args, constexprs)[0], arena, args,
                             constexprs)


class GpuRunner:
    """The same launch from the sm_90a cubin on a GPU (cuda-bindings driver API): the arena is
    copied to a 256-byte aligned device allocation and back; params are the ABI args, then
    the trailing null pointers. Runs where conftest finds a GPU (marker `gpu`)."""

    def __init__(self, library: KernelLibrary) -> None:
        from cuda.bindings import driver
        self.library, self.driver = library, driver
        self._check(driver.cuInit(0))
        device = self._check(driver.cuDeviceGet(0))
        self._check(driver.cuCtxSetCurrent(self._check(driver.cuDevicePrimaryCtxRetain(device))))
        self._functions = {}
        self._modules = []

    @staticmethod
    def _check(result):
        if int(result[0]) != 0:
            raise RuntimeError(f"CUDA driver error {result[0]}")
        return result[1] if len(result) == 2 else result[1:]

    def run(self, kernel_id: str, arena: np.ndarray, args: list) -> None:
        d, library = self.driver, self.library
        width = library.widening_of(kernel_id, args)
        kernel = library.compile(widened={kernel_id: width} if width is not None else None)[kernel_id]
        key = (kernel_id, width)
        if key not in self._functions:
            module = self._check(d.cuModuleLoadData(kernel.cubin))
            self._modules.append(module)
            self._functions[key] = self._check(d.cuModuleGetFunction(module, kernel.symbol.encode()))
        allocation = int(self._check(d.cuMemAlloc(arena.nbytes + 256)))
        base = (allocation + 255) // 256 * 256
        try:
            self._check(d.cuMemcpyHtoD(base, arena, arena.nbytes))
            # one 8-byte slot per param, value at the slot start (the driver reads 4 or 8 bytes)
            slots = np.zeros(len(args) + kernel.trailing_null_pointers, np.uint64)
            for index, ((_, kind), value) in enumerate(zip(library.signature(kernel_id), args)):
                slot = slots[index:index + 1].view(np.uint8)
                if kind.startswith("*"):
                    slot.view(np.uint64)[0] = base + int(value)
                else:
                    dtype = {"i32": np.int32, "i64": np.int64, "fp32": np.float32}[kind]
                    slot[:np.dtype(dtype).itemsize].view(dtype)[0] = value
            argv = np.array([slots.ctypes.data + 8 * i for i in range(len(slots))], np.uint64)
            grid = launch_geometry(library, kernel_id, args)
            self._check(d.cuLaunchKernel(self._functions[key], *grid, 32 * kernel.num_warps,
                                         1, 1, kernel.shared_bytes, 0, argv.ctypes.data, 0))
            self._check(d.cuCtxSynchronize())
            self._check(d.cuMemcpyDtoH(arena, base, arena.nbytes))
        finally:
            self._check(d.cuMemFree(allocation))


Runner = InterpreterRunner | GpuRunner


@pytest.fixture(scope="module", params=["interpreter", pytest.param("gpu", marks=pytest.mark.gpu)])
def runner(request, library: KernelLibrary, interpreter: Interpreter) -> Runner:
    if request.param == "gpu":
        pytest.importorskip("cuda.bindings")
        return GpuRunner(library)
    return InterpreterRunner(library, interpreter)


# ---------------------------------------------------------------------------------------------
# step bookkeeping

RNG = np.random.default_rng(1234)


def step_geometry(query_length: list[int], tokens: int) -> np.ndarray:
    from helios_backend.kernel_abi.state import geometry_words
    from helios_backend.kernel_abi.state import step_geometry as reference
    rows = len(query_length)
    geometry = np.zeros(geometry_words(rows, tokens), np.int32)
    reference(geometry, np.array(query_length, np.int32), rows, tokens)
    return geometry


@pytest.mark.parametrize("query_length, tokens", [([3, 0, -1, 5, 1], 12), ([1] * 7, 8),
                                                   ([0, 0], 4), ([130, 2], 140)])
def test_step_geometry(runner, query_length, tokens):
    from helios_backend.kernel_abi.state import geometry_words
    rows = len(query_length)
    check_against_reference(runner, "step.geometry.v1", {
        "geometry": np.full(geometry_words(rows, tokens), 77, np.int32),
        "query_length": np.array(query_length, np.int32)}, {"rows": rows, "tokens": tokens})


@pytest.mark.parametrize("prefill_row", [1, -1])
def test_select_input_takes_prompt_tokens_for_the_prefill_row_only(runner,
                                                                    prefill_row):
    query_length, tokens = [1, 4, 1], 8
    out = check_against_reference(runner, "tokens.select_input.v1", {
        "ids": np.full(tokens, -5, np.int32),
        "prompt_tokens": np.arange(100, 100 + tokens, dtype=np.int32),
        "pending": np.array([7, 8, 9, 10], np.int32),
        "row_slot": np.array([3, 0, 2], np.int32),
        "prefill_row": np.array([prefill_row], np.int32),
        "geometry": step_geometry(query_length, tokens)}, {"rows": 3, "tokens": tokens})
    assert (out["ids"][6:] == -5).all()                  # past the live tokens: untouched


def test_select_input_by_token_takes_every_host_fed_row(runner):  # spec: BND-6, STA-4
    # rows 1 and 3 are prompts (host tokens), rows 0 and 2 read their slot's pending token (-1)
    query_length, tokens = [1, 3, 1, 2], 10
    prompt = np.full(tokens, -1, np.int32)
    prompt[1:4] = [101, 102, 103]
    prompt[5:7] = [105, 106]
    out = check_against_reference(runner, "tokens.select_input.v2", {
        "ids": np.full(tokens, -5, np.int32), "prompt_tokens": prompt,
        "pending": np.array([7, 8, 9, 10], np.int32),
        "row_slot": np.array([3, 0, 2, 1], np.int32),
        "geometry": step_geometry(query_length, tokens)}, {"rows": 4, "tokens": tokens})
    assert out["ids"][:7].tolist() == [10, 101, 102, 103, 9, 105, 106]
    assert (out["ids"][7:] == -5).all()                  # past the live tokens: untouched


@pytest.mark.parametrize("dim", [208, 576])       # one and three 256-wide dim tiles
def test_embedding_gather(runner, dim):
    vocab, tokens = 50, 20
    ids = RNG.integers(0, vocab, tokens).astype(np.int32)
    ids[17:] = -1                                    # padding past the 17 live tokens
    out = check_against_reference(runner, "embedding.gather.v1", {
        "hidden": np.full((tokens, dim), 3.0, np.float32),
        "table": RNG.standard_normal((vocab, dim)).astype(np.float16),
        "ids": ids, "geometry": step_geometry([5, 12], tokens)}, {"tokens": tokens, "dim": dim})
    assert (out["hidden"][17:] == 3.0).all()


# ---------------------------------------------------------------------------------------------
# dense layers

def _normed_inputs(tokens: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    hidden = RNG.standard_normal((tokens, dim)).astype(np.float32) * 3
    norm_weight = (1 + 0.2 * RNG.standard_normal(dim)).astype(np.float16)
    return hidden, norm_weight


def _weight(out_dim: int, in_dim: int) -> np.ndarray:
    return (RNG.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float16)


# Token capacities on both sides of GEMV_TOKENS (specs.py): up to it the dense kernels take
# the decode (GEMV) path, above it the tensor-core tiles, from LARGE_TOKENS the large-M tiles
# (whole K per program); live counts below capacity too.
DENSE_SHAPES = [(520, [300, 200]), (40, [32, 1]), (7, [5, 1]), (4, [2, 1]), (1, [1])]


@pytest.mark.parametrize("tokens, query_length", DENSE_SHAPES)
@pytest.mark.parametrize("in_dim", [96, 640])          # one K slice; three (split-K, atomics)
def test_linear_residual(runner, in_dim, tokens, query_length):
    out_dim = 80
    check_against_reference(runner, "linear.residual.v1", {
        "hidden": RNG.standard_normal((tokens, out_dim)).astype(np.float32),
        "x": RNG.standard_normal((tokens, in_dim)).astype(np.float32),
        "weight": _weight(out_dim, in_dim),
        "geometry": step_geometry(query_length, tokens)},
        {"tokens": tokens, "in_dim": in_dim, "out_dim": out_dim}, atol=2e-2, rtol=1e-2)


# the 1-row GEMV program's own K slices (GEMV_SPLIT, here twice K_SPLIT's 256: 640 = one full
# 512-wide slice and a partial one; a 96-wide K is one slice); 2-4 rows keep K_SPLIT's
@pytest.mark.parametrize("tokens, query_length", [(4, [2, 1]), (1, [1])])
@pytest.mark.parametrize("in_dim", [96, 640])
def test_linear_residual_gemv_slices_of_their_own(library, interpreter, in_dim, tokens, query_length):
    wide = InterpreterRunner(library, interpreter, {"linear.residual.v1": {"GEMV_SPLIT": 512}})
    spec = library.spec("linear.residual.v1")
    immediates = {"tokens": tokens, "in_dim": in_dim, "out_dim": 80}
    width = 512 if tokens == 1 else spec.constexprs["K_SPLIT"]
    assert spec.grid(immediates, {**spec.constexprs, "GEMV_SPLIT": 512})[2] == -(-in_dim // width)
    check_against_reference(wide, "linear.residual.v1", {
        "hidden": RNG.standard_normal((tokens, 80)).astype(np.float32),
        "x": RNG.standard_normal((tokens, in_dim)).astype(np.float32),
        "weight": _weight(80, in_dim),
        "geometry": step_geometry(query_length, tokens)},
        immediates, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("tokens, query_length", DENSE_SHAPES)
def test_norm_gate_up_silu(runner, tokens, query_length):
    dim, ffn = 96, 48
    hidden, norm_weight = _normed_inputs(tokens, dim)
    check_against_reference(runner, "mlp.norm_gate_up_silu.v1", {
        "out": np.full((tokens, ffn), 9.0, np.float32), "hidden": hidden,
        "norm_weight": norm_weight, "gate_up": _weight(2 * ffn, dim),
        "geometry": step_geometry(query_length, tokens)},
        {"tokens": tokens, "dim": dim, "ffn_dim": ffn, "eps": 1e-5}, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("tokens, query_length", DENSE_SHAPES)
@pytest.mark.parametrize("activation", [0, 1])          # linear.ACTIVATION_SILU, ACTIVATION_GELU_TANH
def test_norm_gate_up_activation(runner, activation, tokens, query_length):
    # spec: OWN-4 (the activation is an immediate of the recorded node, not a model switch)
    dim, ffn = 96, 48
    hidden, norm_weight = _normed_inputs(tokens, dim)
    buffers = {"out": np.full((tokens, ffn), 9.0, np.float32), "hidden": hidden,
               "norm_weight": norm_weight, "gate_up": _weight(2 * ffn, dim),
               "geometry": step_geometry(query_length, tokens)}
    immediates = {"tokens": tokens, "dim": dim, "ffn_dim": ffn, "eps": 1e-5}
    out = check_against_reference(runner, "mlp.norm_gate_up_activation.v1", buffers,
                                  {**immediates, "activation": activation}, atol=2e-2, rtol=1e-2)
    silu = check_against_reference(runner, "mlp.norm_gate_up_silu.v1", buffers, immediates,
                                   atol=2e-2, rtol=1e-2)
    live = sum(query_length)
    # SiLU through the activation kernel is the SiLU kernel; GELU differs from it
    assert np.allclose(out["out"][:live], silu["out"][:live], atol=1e-5) == (activation == 0)
    assert (out["out"][live:] == 9.0).all()


@pytest.mark.parametrize("tokens, query_length", DENSE_SHAPES)
# 2 column tiles; 10 K tiles; a Gemma-3-270M o-projection (4 heads x 256 -> 640)
@pytest.mark.parametrize("in_dim, out_dim", [(96, 80), (640, 48), (1024, 640)])
def test_linear_norm_residual(runner, in_dim, out_dim, tokens, query_length):
    hidden = RNG.standard_normal((tokens, out_dim)).astype(np.float32)
    out = check_against_reference(runner, "linear.norm_residual.v1", {
        "hidden": hidden, "x": RNG.standard_normal((tokens, in_dim)).astype(np.float32) * 2,
        "weight": _weight(out_dim, in_dim),
        "norm_weight": (1 + 0.2 * RNG.standard_normal(out_dim)).astype(np.float16),
        "geometry": step_geometry(query_length, tokens)},
        {"tokens": tokens, "in_dim": in_dim, "out_dim": out_dim, "eps": 1e-6},
        atol=2e-2, rtol=1e-2)
    live = sum(query_length)
    assert (out["hidden"][live:] == hidden[live:]).all()      # rows past the live count untouched
    added = out["hidden"][:live] - hidden[:live]
    # the added rows are normed: their rms over out_dim is about the norm weight's scale (~1)
    assert np.allclose(np.sqrt((added ** 2).mean(axis=1)), 1.0, atol=0.3)


@pytest.mark.parametrize("tokens, query_length", DENSE_SHAPES)
# one partial column tile; Gemma 3 270M's 640; three tiles (the two passes loop)
@pytest.mark.parametrize("dim", [80, 640, 2064])
def test_norm_residual_norms_rows_into_the_residual_and_zeroes_them(runner, dim, tokens, query_length):
    # spec: BND-19 (the accumulator is scratch: zero at allocation, kept zero by this kernel, no host source)
    hidden = RNG.standard_normal((tokens, dim)).astype(np.float32)
    accumulator = RNG.standard_normal((tokens, dim)).astype(np.float32) * 7
    out = check_against_reference(runner, "norm.residual.v1", {
        "hidden": hidden, "accumulator": accumulator,
        "norm_weight": (1 + 0.2 * RNG.standard_normal(dim)).astype(np.float16),
        "geometry": step_geometry(query_length, tokens)},
        {"tokens": tokens, "dim": dim, "eps": 1e-6}, atol=1e-4, rtol=1e-4)
    live = sum(query_length)
    assert (out["hidden"][live:] == hidden[live:]).all()      # rows past the live count untouched
    assert (out["accumulator"][live:] == accumulator[live:]).all()
    assert (out["accumulator"][:live] == 0).all()             # zero again for the next product
    added = out["hidden"][:live] - hidden[:live]
    assert np.allclose(np.sqrt((added ** 2).mean(axis=1)), 1.0, atol=0.3)


@pytest.mark.parametrize("tokens, query_length", DENSE_SHAPES)
@pytest.mark.parametrize("in_dim", [1024, 2048])       # Gemma 3 270M's o and down projections
def test_linear_residual_then_norm_residual_is_the_post_normed_projection(runner, in_dim, tokens, query_length):
    """The recipe's two nodes (the product into the zero accumulator, then the row norm) compute
    linear.norm_residual.v1's hidden += rms_norm(x W^T) * w, and leave the accumulator zero."""
    # spec: OWN-4 (a post norm is a contract-declared pair of generic kernels, not a model's own code)
    out_dim = 640
    hidden = RNG.standard_normal((tokens, out_dim)).astype(np.float32)
    x = RNG.standard_normal((tokens, in_dim)).astype(np.float32) * 2
    weight, geometry = _weight(out_dim, in_dim), step_geometry(query_length, tokens)
    norm_weight = (1 + 0.2 * RNG.standard_normal(out_dim)).astype(np.float16)
    product = check_against_reference(runner, "linear.residual.v1", {
        "hidden": np.zeros((tokens, out_dim), np.float32), "x": x, "weight": weight, "geometry": geometry},
        {"tokens": tokens, "in_dim": in_dim, "out_dim": out_dim}, atol=2e-2, rtol=1e-2)["hidden"]
    normed = check_against_reference(runner, "norm.residual.v1", {
        "hidden": hidden, "accumulator": product, "norm_weight": norm_weight, "geometry": geometry},
        {"tokens": tokens, "dim": out_dim, "eps": 1e-6}, atol=1e-4, rtol=1e-4)
    want = hidden.reshape(-1).copy()
    abi.kernel("linear.norm_residual.v1").reference(want, x.reshape(-1), weight.reshape(-1), norm_weight,
                                                    geometry, tokens, in_dim, out_dim, 1e-6)
    np.testing.assert_allclose(normed["hidden"].reshape(-1), want, atol=2e-2, rtol=1e-2)
    assert (normed["accumulator"] == 0).all()


# the product path (kernel_abi/products.py): f16 activations with zero rows past the live count,
# plain f16 products; capacities on both sides of a 64-row tile, live counts below them
PRODUCT_SHAPES = [(70, [40, 25]), (7, [5, 1]), (1, [1])]


def _f16_rows(tokens: int, width: int, live: int) -> np.ndarray:
    x = RNG.standard_normal((tokens, width)).astype(np.float16)
    x[live:] = 0
    return x


@pytest.mark.parametrize("tokens, query_length", PRODUCT_SHAPES)
@pytest.mark.parametrize("in_dim, out_dim", [(96, 80), (160, 144)])    # K and N tails of the 64 x 128 tiles
def test_f16_products(runner, in_dim, out_dim, tokens, query_length):
    live = sum(query_length)
    common = {"x": _f16_rows(tokens, in_dim, live), "weight": _weight(out_dim, in_dim),
              "geometry": step_geometry(query_length, tokens)}
    immediates = {"tokens": tokens, "in_dim": in_dim, "out_dim": out_dim}
    stored = check_against_reference(runner, "linear.product_f16.v1",
                                     {"out": np.full((tokens, out_dim), 7, np.float16), **common}, immediates,
                                     atol=2e-2, rtol=1e-2)
    assert (stored["out"][live:] == 0).all()      # zeros past the live count, as a library's product
    check_against_reference(runner, "linear.product_f32.v1",
                            {"out": np.full((tokens, out_dim), 7, np.float32), **common}, immediates,
                            atol=2e-2, rtol=1e-2)
    hidden = RNG.standard_normal((tokens, out_dim)).astype(np.float32)
    added = check_against_reference(runner, "linear.residual_f16.v1", {"hidden": hidden, **common}, immediates,
                                    atol=2e-2, rtol=1e-2)
    assert (added["hidden"][live:] == hidden[live:]).all()


@pytest.mark.parametrize("tokens, query_length", PRODUCT_SHAPES)
def test_f16_activations_zero_the_rows_past_the_live_count(runner, tokens, query_length):
    dim, ffn = 96, 48
    live = sum(query_length)
    geometry = step_geometry(query_length, tokens)
    hidden, norm_weight = _normed_inputs(tokens, dim)
    normed = check_against_reference(runner, "norm.rms_f16.v1", {
        "out": np.full((tokens, dim), 7, np.float16), "hidden": hidden, "norm_weight": norm_weight,
        "geometry": geometry}, {"tokens": tokens, "dim": dim, "eps": 1e-5}, atol=2e-3, rtol=2e-3)
    converted = check_against_reference(runner, "activation.to_f16.v1", {
        "out": np.full((tokens, dim), 7, np.float16), "x": hidden, "geometry": geometry},
        {"tokens": tokens, "dim": dim}, atol=0, rtol=1e-3)
    for activation in (0, 1):
        gated = check_against_reference(runner, "mlp.gate_activation_f16.v1", {
            "out": np.full((tokens, ffn), 7, np.float16), "projected": _f16_rows(tokens, 2 * ffn, tokens),
            "geometry": geometry}, {"tokens": tokens, "ffn_dim": ffn, "activation": activation},
            atol=2e-3, rtol=2e-3)
        assert (gated["out"][live:] == 0).all()
    assert (normed["out"][live:] == 0).all() and (converted["out"][live:] == 0).all()


# The decode GEMV programs that cover all of K (norm + gate/up, norm + head, norm + qkv + RoPE)
# walk it a span of GEMV_STEPS x GEMV_K at a time in their 1-row instantiation (common.gemv_span):
# spans of 32 here, so a 96-wide K takes the preloaded span and two more; 2-4 rows with K past
# one span take the tensor-core tiles.
SPAN_TILES = {"GEMV_K": 16, "GEMV_STEPS": 2}
SPAN_IDS = ("mlp.norm_gate_up_silu.v1", "logits.norm_head.v1", "attention.qkv_rope_store.v1",
            "attention.qkv_bias_rope_store.v1")


@pytest.mark.parametrize("tokens, query_length", [(1, [1]), (2, [1, 1]), (4, [1, 1, 1, 0])])
def test_gemv_programs_walk_k_wider_than_one_span(library, interpreter, tokens, query_length):
    spans = InterpreterRunner(library, interpreter, {kernel_id: SPAN_TILES for kernel_id in SPAN_IDS})
    dim, ffn, vocab = 96, 48, 48
    hidden, norm_weight = _normed_inputs(tokens, dim)
    geometry = step_geometry(query_length, tokens)
    gate_up = {"tokens": tokens, "dim": dim, "ffn_dim": ffn, "eps": 1e-5}
    head = {"rows": len(query_length), "tokens": tokens, "dim": dim, "vocab": vocab, "eps": 1e-5}
    for kernel_id, immediates in (("mlp.norm_gate_up_silu.v1", gate_up), ("logits.norm_head.v1", head)):
        spec = library.spec(kernel_id)
        tiles = {**spec.constexprs, **SPAN_TILES}
        count = immediates.get("rows", tokens)
        # one row: the GEMV grid (GEMV_N columns a program, no row tiles), not the tensor-core tiles'
        assert (spec.grid(immediates, tiles)[0] == -(-immediates.get("ffn_dim", vocab) // tiles["GEMV_N"])) \
            == (count <= 1), kernel_id
    check_against_reference(spans, "mlp.norm_gate_up_silu.v1", {
        "out": np.full((tokens, ffn), 9.0, np.float32), "hidden": hidden,
        "norm_weight": norm_weight, "gate_up": _weight(2 * ffn, dim), "geometry": geometry},
        gate_up, atol=2e-2, rtol=1e-2)
    check_against_reference(spans, "logits.norm_head.v1", {
        "logits": np.full((len(query_length), vocab), 5.0, np.float32), "hidden": hidden,
        "norm_weight": norm_weight, "head": _weight(vocab, dim), "geometry": geometry},
        head, atol=2e-2, rtol=1e-2)
    for rope_pairing in (0, 1):
        buffers, immediates = _qkv_case(rope_pairing, 64, tuple(query_length[:3]), tokens)
        check_against_reference(spans, "attention.qkv_rope_store.v1", buffers, immediates,
                                atol=2e-2, rtol=1e-2)
        buffers["qkv_bias"] = (RNG.standard_normal(buffers["qkv_weight"].shape[0]) * 40).astype(np.float32)
        check_against_reference(spans, "attention.qkv_bias_rope_store.v1", buffers, immediates,
                                atol=5e-2, rtol=1e-2)


# the last: 40 rows, two M tiles of the tile path (BLOCK_M 32) for each of the 3 column blocks
@pytest.mark.parametrize("query_length", [[3], [3, 0], [3, 0, 5, 1], [1, 0, 2, 1, 1, 1, 0, 1, 1, 1, 2],
                                          [1] * 20 + [0, 2] + [1] * 18])
def test_norm_head_reads_each_rows_last_token(runner, query_length):
    rows, tokens, dim, vocab = len(query_length), max(14, sum(query_length)), 64, 304
    hidden, norm_weight = _normed_inputs(tokens, dim)
    out = check_against_reference(runner, "logits.norm_head.v1", {
        "logits": np.full((rows, vocab), 5.0, np.float32), "hidden": hidden,
        "norm_weight": norm_weight, "head": _weight(vocab, dim),
        "geometry": step_geometry(query_length, tokens)},
        {"rows": rows, "tokens": tokens, "dim": dim, "vocab": vocab, "eps": 1e-5},
        atol=2e-2, rtol=1e-2)
    for row, length in enumerate(query_length):      # a row without tokens gets zero logits
        assert (out["logits"][row] == 0).all() == (length == 0)


# ---------------------------------------------------------------------------------------------
# attention

def _paged_cache(slots: int, pages_per_row: int, page_tokens: int, kv_heads: int, head_dim: int,
                 layers: int = 2):
    """Random f16 k and v planes page-major over `layers`, a shuffled page table, and the
    byte offset of layer 1 inside a page (the pointer a layer-1 node receives)."""
    pages = slots * pages_per_row
    page_stride = layers * page_tokens * kv_heads * head_dim
    planes = [RNG.standard_normal(pages * page_stride).astype(np.float16) for _ in range(2)]
    page_table = RNG.permutation(pages).astype(np.int32)
    layer_offset = page_tokens * kv_heads * head_dim * 2          # bytes of one f16 layer slab
    return planes, page_table, page_stride, layer_offset


def _qkv_case(rope_pairing: int, head_dim: int = 64, query_length=(1, 6, 2), tokens: int = 10):
    from helios_backend.kernel_abi.rope import rope_table
    dim, q_heads, kv_heads = 96, 3, 1
    slots, pages_per_row, page_tokens = 4, 4, 4
    (k_cache, v_cache), page_table, page_stride, layer = _paged_cache(
        slots, pages_per_row, page_tokens, kv_heads, head_dim)
    hidden, norm_weight = _normed_inputs(tokens, dim)
    positions = np.array([5, 0, 1, 2, 3, 4, 5, 9, 10, 0], np.int32)[:tokens]
    buffers = {
        "q_out": np.zeros((tokens, q_heads * head_dim), np.float32),
        "k_cache": (k_cache, layer), "v_cache": (v_cache, layer),
        "hidden": hidden, "norm_weight": norm_weight,
        "qkv_weight": _weight((q_heads + 2 * kv_heads) * head_dim, dim),
        "rope_table": rope_table(32, head_dim, 10000.0), "positions": positions,
        "page_table": page_table, "row_slot": np.array([2, 0, 3], np.int32),
        "geometry": step_geometry(list(query_length), tokens)}
    immediates = {"tokens": tokens, "dim": dim, "q_heads": q_heads, "kv_heads": kv_heads,
                  "head_dim": head_dim, "page_tokens": page_tokens,
                  "pages_per_row": pages_per_row, "page_stride": page_stride, "eps": 1e-5,
                  "rope_pairing": rope_pairing}
    return buffers, immediates


@pytest.mark.parametrize("query_length, tokens", [((1, 6, 2), 10), ((1, 1, 1), 4)])
@pytest.mark.parametrize("rope_pairing", [0, 1])
@pytest.mark.parametrize("head_dim", [64, 96])
def test_qkv_rope_store(runner, rope_pairing, head_dim, query_length, tokens):
    buffers, immediates = _qkv_case(rope_pairing, head_dim, query_length, tokens)
    check_against_reference(runner, "attention.qkv_rope_store.v1", buffers,
                            immediates, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("query_length, tokens", [((1, 6, 2), 10), ((1, 1, 1), 4)])
@pytest.mark.parametrize("rope_pairing", [0, 1])
def test_qkv_bias_rope_store(runner, rope_pairing, query_length, tokens):
    """The bias variant (q/k/v biases, f32, added before RoPE): large key biases as in Qwen2."""
    buffers, immediates = _qkv_case(rope_pairing, 64, query_length, tokens)
    width = buffers["qkv_weight"].shape[0]
    buffers["qkv_bias"] = (RNG.standard_normal(width) * 40).astype(np.float32)
    result = check_against_reference(runner, "attention.qkv_bias_rope_store.v1", buffers,
                                     immediates, atol=5e-2, rtol=1e-2)
    unbiased = {name: value for name, value in buffers.items() if name != "qkv_bias"}
    plain = check_against_reference(runner, "attention.qkv_rope_store.v1", unbiased, immediates,
                                    atol=2e-2, rtol=1e-2)
    assert not np.allclose(result["q_out"], plain["q_out"], atol=1.0)   # the bias is applied


@pytest.mark.parametrize("query_length, tokens", [((1, 6, 2), 10), ((1, 1, 1), 4)])
@pytest.mark.parametrize("rope_pairing", [0, 1])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_store_of_a_projection_is_the_fused_qkv_rope_store(runner, rope_pairing, head_dim, query_length, tokens):
    """The product path's q/k/v (an f32 projection, then attention.rope_store / bias_rope_store)
    against the references, and their q and cache entries against the fused kernel's reference."""
    from helios_backend.kernel_abi.linear import rms_norm
    buffers, immediates = _qkv_case(rope_pairing, head_dim, query_length, tokens)
    live = sum(query_length)
    normed = rms_norm(buffers["hidden"], buffers["norm_weight"], 1e-5)
    projected = (normed @ buffers["qkv_weight"].astype(np.float32).T).astype(np.float32)
    projected[live:] = 99.0                       # rows past the live count are never read
    split = {name: value for name, value in buffers.items() if name not in ("hidden", "norm_weight", "qkv_weight")}
    plain = {k: v for k, v in immediates.items() if k not in ("dim", "eps")}
    stored = check_against_reference(runner, "attention.rope_store.v1", {**split, "projected": projected}, plain,
                                     atol=1e-4, rtol=1e-4)
    fused = check_against_reference(runner, "attention.qkv_rope_store.v1", buffers, immediates, atol=2e-2, rtol=1e-2)
    for name in ("q_out", "k_cache", "v_cache"):
        np.testing.assert_allclose(stored[name].astype(np.float32), fused[name].astype(np.float32), atol=2e-2)
    bias = (RNG.standard_normal(projected.shape[1]) * 40).astype(np.float32)
    biased = check_against_reference(runner, "attention.bias_rope_store.v1",
                                     {**split, "projected": projected, "qkv_bias": bias}, plain, atol=5e-2, rtol=1e-3)
    assert not np.allclose(biased["q_out"][:live], stored["q_out"][:live], atol=1.0)   # the bias is applied


@pytest.mark.parametrize("query_length, tokens", [((1, 6, 2), 10), ((1, 1, 1), 4), ((1,), 1)])
@pytest.mark.parametrize("rope_pairing", [0, 1])
@pytest.mark.parametrize("head_dim", [64, 256])
def test_qkv_norm_rope_store(runner, rope_pairing, head_dim, query_length, tokens):
    """q/k norm (an RMSNorm of every q and k head before RoPE): whole heads per program, up to
    256 dims (Gemma-style heads), decode and prefill shapes."""
    buffers, immediates = _qkv_case(rope_pairing, head_dim, query_length, tokens)
    buffers["q_norm"] = (1 + 0.3 * RNG.standard_normal(head_dim)).astype(np.float16)
    buffers["k_norm"] = (1 + 0.3 * RNG.standard_normal(head_dim)).astype(np.float16)
    normed = check_against_reference(runner, "attention.qkv_norm_rope_store.v1", buffers,
                                     immediates, atol=2e-2, rtol=1e-2)
    live = sum(query_length)
    q = normed["q_out"][:live].reshape(live, 3, head_dim)
    # RoPE preserves each head's norm: after the q norm a head's rms is the gains' (~1), which
    # the plain kernel's heads are not
    gains_rms = np.sqrt((buffers["q_norm"].astype(np.float32) ** 2).mean())
    assert np.allclose(np.sqrt((q ** 2).mean(axis=-1)), gains_rms, rtol=0.35)
    assert (normed["q_out"][live:] == 0).all()


def test_a_wrong_rope_pairing_changes_q_and_k(runner):
    """The pairing immediate is honoured: adjacent and half-split pairings disagree, so a
    core recorded with the wrong pairing cannot pass the reference comparison above."""
    results = []
    for rope_pairing in (0, 1):
        buffers, immediates = _qkv_case(rope_pairing)
        results.append(check_against_reference(runner,
                                               "attention.qkv_rope_store.v1", buffers,
                                               immediates, atol=2e-2, rtol=1e-2))
    assert not np.allclose(results[0]["q_out"], results[1]["q_out"], atol=0.1)
    assert not np.allclose(results[0]["k_cache"].astype(np.float32),
                           results[1]["k_cache"].astype(np.float32), atol=0.1)


PAGED_CASES = [
    ([1, 5, 0, 3], [13, 0, 1, 2, 3, 4, 20, 21, 22, 0], 4, 6, 2),  # mixed decode + prefill
    ([1] * 6, [0, 3, 4, 7, 8, 23], 4, 6, 2),                       # decode at page edges
    ([2, 1], [63, 64, 100, 0], 16, 6, 2),                          # longer contexts
    ([1, 23], [9] + list(range(40, 63)) + [0], 8, 8, 2),           # chunk continuing a prompt
    ([3, 2], [5, 6, 7, 30, 31, 0], 16, 2, 2),                      # no grouping (MHA)
    ([1] * 17 + [2], list(range(3, 22)) + [0], 4, 6, 2),           # more than 16 rows
]


def _paged_case(query_length, positions, page_tokens, q_heads, kv_heads, head_dim: int = 64):
    rows, tokens = len(query_length), len(positions)
    slots = rows
    pages_per_row = -(-128 // page_tokens)
    (k_cache, v_cache), page_table, page_stride, layer = _paged_cache(
        slots, pages_per_row, page_tokens, kv_heads, head_dim)
    buffers = {
        "out": np.full((tokens, q_heads * head_dim), 7.0, np.float32),
        "q": RNG.standard_normal((tokens, q_heads * head_dim)).astype(np.float32),
        "k_cache": (k_cache, layer), "v_cache": (v_cache, layer),
        "positions": np.array(positions, np.int32), "page_table": page_table,
        "row_slot": RNG.permutation(slots).astype(np.int32)[:rows],
        "geometry": step_geometry(query_length, tokens)}
    immediates = {"rows": rows, "tokens": tokens, "q_heads": q_heads, "kv_heads": kv_heads,
                  "head_dim": head_dim, "page_tokens": page_tokens,
                  "pages_per_row": pages_per_row, "page_stride": page_stride,
                  "scale": head_dim ** -0.5}
    return buffers, immediates


@pytest.mark.parametrize("query_length, positions, page_tokens, q_heads, kv_heads", PAGED_CASES)
def test_paged_attention(runner, query_length, positions, page_tokens, q_heads,
                         kv_heads):
    buffers, immediates = _paged_case(query_length, positions, page_tokens, q_heads, kv_heads)
    out = check_against_reference(runner, "attention.paged.v1", buffers,
                                  immediates, atol=1e-2, rtol=1e-2)
    live = sum(max(n, 0) for n in query_length)
    assert (out["out"][live:] == 7.0).all()                  # padding tokens untouched


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("query_length, positions, page_tokens, q_heads, kv_heads",
                         [PAGED_CASES[0], PAGED_CASES[3], PAGED_CASES[5]])
def test_paged_attention_large_query_blocks(current_library, interpreter, head_dim, query_length, positions,
                                            page_tokens, q_heads, kv_heads):
    """The "current" tiles' large-step blocks (from LARGE_TOKENS tokens; its threshold and blocks
    made small here so a few tokens reach it, in the interpreter): heads up to BLOCK_D and up to
    LARGE_D. (The default flash tiles: test_flash_attention_tiles.)"""
    small = InterpreterRunner(current_library, interpreter,
                              {"attention.paged.v1": {"LARGE_TOKENS": 8, "LARGE_M": 32, "LARGE_N": 16}})
    buffers, immediates = _paged_case(query_length, positions, page_tokens, q_heads, kv_heads, head_dim=head_dim)
    spec = current_library.spec("attention.paged.v1")
    assert spec.constexprs["LARGE_FLASH"] == 0
    large = {**spec.tiles(immediates), "LARGE_TOKENS": 8, "LARGE_M": 32, "LARGE_N": 16}
    assert spec.grid(immediates, large) != spec.grid(immediates, spec.tiles(immediates))   # the other blocks
    out = check_against_reference(small, "attention.paged.v1", buffers, immediates, atol=1e-2, rtol=1e-2)
    live = sum(max(n, 0) for n in query_length)
    assert (out["out"][live:] == 7.0).all()


# The flash-class large blocks (specs.ATTENTION_TILES["flash"]), their threshold and tiles made
# small so a few tokens reach them in the interpreter: 32 query rows against 16-key tiles, so the
# blocks with a cached prefix run unmasked key blocks before their masked diagonal. Cases: mixed
# decode + prefill rows with an empty row and a padding token; a chunk continuing a prompt (24
# cached keys); page-edge decode of 18 rows; 16-token pages (one page a tile, several whole
# tiles); MHA; GQA group 7 (4 tokens fill 28 of a block's 32 rows).
FLASH_CASES = [PAGED_CASES[0], PAGED_CASES[3], PAGED_CASES[5], PAGED_CASES[2], PAGED_CASES[4],
               ([2, 6], [30, 31, 0, 1, 2, 3, 4, 5, 0], 4, 7, 1)]
FLASH_TILES = {"LARGE_TOKENS": 4, "LARGE_M": 32, "LARGE_N": 16}


@pytest.fixture(scope="module")
def flash_library(tmp_path_factory: pytest.TempPathFactory) -> KernelLibrary:
    return KernelLibrary(cache_dir=tmp_path_factory.mktemp("flash"), attention_tiles="flash")


@pytest.fixture(scope="module")
def current_library(tmp_path_factory: pytest.TempPathFactory) -> KernelLibrary:
    return KernelLibrary(cache_dir=tmp_path_factory.mktemp("current"), attention_tiles="current")


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("query_length, positions, page_tokens, q_heads, kv_heads", FLASH_CASES)
def test_flash_attention_tiles(flash_library, interpreter, head_dim, query_length, positions, page_tokens,
                               q_heads, kv_heads):
    """attention.paged.v1's flash instantiation against the numpy reference, with its page-wise
    table reads (PAGE_TOKENS = the launch's page_tokens) and per-key lookups (any other)."""
    buffers, immediates = _paged_case(query_length, positions, page_tokens, q_heads, kv_heads, head_dim=head_dim)
    spec = flash_library.spec("attention.paged.v1")
    assert spec.constexprs["LARGE_FLASH"] == 1 and spec.num_warps == 8
    per_block = FLASH_TILES["LARGE_M"] // (q_heads // kv_heads)       # the large blocks' grid
    assert spec.grid(immediates, {**spec.constexprs, **FLASH_TILES})[:2] == (
        -(-len(positions) // per_block) + len(query_length), kv_heads)
    live = sum(max(n, 0) for n in query_length)
    for page_lookup in (page_tokens, 2):              # whole pages; per key (2 is no case's page size)
        tiles = {**FLASH_TILES, "PAGE_TOKENS": page_lookup}
        runner = InterpreterRunner(flash_library, interpreter, {"attention.paged.v1": tiles})
        out = check_against_reference(runner, "attention.paged.v1", buffers, immediates, atol=1e-2, rtol=1e-2)
        assert (out["out"][live:] == 7.0).all()       # padding tokens untouched


def test_attention_tiles_default_to_the_flash_instantiation(library, current_library):
    """The flash tiles are the default (measured faster at prefill, equal at decode); the earlier
    tiles stay selectable, and they differ in attention.paged.v1 alone."""
    assert library.attention_tiles == "flash"
    assert library.spec("attention.paged.v1").constexprs["LARGE_FLASH"] == 1
    assert library.spec("attention.paged.v1") == SPECS_BY_ID["attention.paged.v1"]
    assert current_library.spec("attention.paged.v1").constexprs["LARGE_FLASH"] == 0
    # every other id is the same build in both libraries
    assert [library.spec(i) == current_library.spec(i) for i in library.kernel_ids()].count(False) == 1
    with pytest.raises(ValueError, match="attention_tiles"):
        KernelLibrary(attention_tiles="fastest")


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="cuobjdump not bundled with triton")
def test_flash_attention_tiles_compile_for_sm90a(flash_library, tmp_path):
    """The flash build compiles to an sm_90a cubin that fits two programs' shared memory per SM
    and issues warpgroup MMAs (HGMMA) with 16-byte cp.async key/value loads."""
    [(cubin, module)] = [(c, m) for c, m in flash_library.build_modules(["sm_90a"])
                         if m.kernels[0].id == "attention.paged.v1"]
    kernel = module.kernels[0]
    assert kernel.num_warps == 8 and kernel.shared_bytes <= 113 * 1024
    sass = _sass(cubin, tmp_path)
    assert "ACQBULK" in sass and "HGMMA" in sass and "LDGSTS.E.BYPASS.128" in sass


# heads of 128 and 256 dims (the kernels' two widening levels) on a decode and a prefill-chunk case
WIDE_CASES = [PAGED_CASES[0], PAGED_CASES[3]]


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("query_length, positions, page_tokens, q_heads, kv_heads", WIDE_CASES)
def test_paged_attention_over_wide_heads(runner, head_dim, query_length, positions, page_tokens,
                                         q_heads, kv_heads):
    buffers, immediates = _paged_case(query_length, positions, page_tokens, q_heads, kv_heads,
                                      head_dim=head_dim)
    check_against_reference(runner, "attention.paged.v1", buffers, immediates, atol=1e-2,
                            rtol=1e-2)


@pytest.mark.parametrize("window", [1, 5, 16])
@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("query_length, positions, page_tokens, q_heads, kv_heads",
                         [PAGED_CASES[0], PAGED_CASES[2], PAGED_CASES[3], PAGED_CASES[5]])
def test_sliding_window_attention(runner, window, head_dim, query_length, positions,
                                  page_tokens, q_heads, kv_heads):
    # spec: CACHE-2 (a sliding-window history region: each query sees its last `window` keys)
    buffers, immediates = _paged_case(query_length, positions, page_tokens, q_heads, kv_heads,
                                      head_dim)
    windowed = check_against_reference(runner, "attention.paged_window.v1", buffers,
                                       {**immediates, "window": window}, atol=1e-2, rtol=1e-2)
    full = check_against_reference(runner, "attention.paged.v1", buffers, immediates,
                                   atol=1e-2, rtol=1e-2)
    live = sum(max(n, 0) for n in query_length)
    seen_all = np.array(positions[:live]) < window            # the window holds every key
    assert np.allclose(windowed["out"][:live][seen_all], full["out"][:live][seen_all], atol=1e-5)
    assert not np.allclose(windowed["out"][:live][~seen_all], full["out"][:live][~seen_all],
                           atol=1e-3)


def _split_spec() -> abi.KernelSpec:
    """attention.paged_split.v1 for the comparison: v1's reference (the scratch params do not
    change the result) over the split kernel's parameters, scratch declared READ so the
    comparison skips it (the reference never writes it)."""
    from helios_backend.kernel_abi.attention import paged_attention
    from ignition.gpu_kernels.signature import triton_signature
    kinds = {"i32": abi.I32, "i64": abi.I64, "fp32": abi.F32}
    dtypes = {"*fp32": abi.F32_T, "*fp16": abi.F16_T, "*i32": abi.I32_T}
    params = tuple(abi.Param(name, abi.POINTER, dtypes[t],
                             abi.Access.WRITE if name == "out" else abi.Access.READ)
                   if t.startswith("*") else abi.Param(name, kinds[t])
                   for name, t in triton_signature("attention.paged_split.v1"))

    def reference(out, q, k_cache, v_cache, positions, page_table, row_slot, geometry,
                  partials, arrivals, *immediates):
        paged_attention(out, q, k_cache, v_cache, positions, page_table, row_slot, geometry,
                        *immediates[:-1])
    return abi.KernelSpec("attention.paged_split.v1", params, reference, "split-KV")


@pytest.mark.parametrize("splits, head_dim", [(1, 64), (3, 64), (8, 64), (3, 128), (3, 256)])
@pytest.mark.parametrize("query_length, positions, page_tokens, q_heads, kv_heads",
                         [PAGED_CASES[0], PAGED_CASES[2], PAGED_CASES[3], PAGED_CASES[5]])
def test_split_kv_attention_matches_unsplit_and_resets_its_counters(
        runner, splits, head_dim, query_length, positions, page_tokens, q_heads, kv_heads):
    buffers, immediates = _paged_case(query_length, positions, page_tokens, q_heads, kv_heads,
                                      head_dim)
    tokens = immediates["tokens"]
    buffers["partials"] = np.zeros((splits, tokens, q_heads, head_dim + 2), np.float32)
    buffers["arrivals"] = np.zeros((tokens, kv_heads), np.int32)
    immediates["splits"] = splits
    out = check_against_reference(runner, "attention.paged_split.v1", buffers,
                                  immediates, atol=1e-2, rtol=1e-2, spec=_split_spec())
    assert (out["arrivals"] == 0).all()          # self-resetting for the next launch


# ---------------------------------------------------------------------------------------------
# sampling

def test_philox_words_match_the_reference_bit_exactly(interpreter):
    from helios_backend.kernel_abi.sampling import philox4x32
    counters = np.array([0, 1, 2, 7, 1000, 2**31 - 1, 2**31, 2**32 - 1], np.uint32)
    seed = np.array([0xDEADBEEF, 0x12345678], np.uint32)
    arena = np.zeros(256, np.uint8)
    arena[64:64 + counters.nbytes] = counters.view(np.uint8)
    arena[128:136] = seed.view(np.uint8)
    interpreter.run("sampling", "philox_words", (("words", "*u32"), ("counters", "*u32"),
                    ("seed", "*u32"), ("count", "i32")), (1, 1, 1), arena,
                    (0, 64, 128, len(counters)), {"BLOCK": 8})
    expected = philox4x32(np.stack([counters] + [np.zeros_like(counters)] * 3, axis=-1),
                          np.broadcast_to(seed, (len(counters), 2)))[:, 0]
    np.testing.assert_array_equal(arena[:counters.nbytes].view(np.uint32), expected)


def _sampling_rows(rows: list[tuple]) -> np.ndarray:
    """f32 [slots, 8]: (temperature, top_p, top_k, min_p, presence, frequency, repetition)."""
    table = np.zeros((len(rows), 8), np.float32)
    table[:, :7] = rows
    return table


def test_adjust_logits_applies_penalties_and_the_grammar_mask(runner):
    rows, vocab, bins, mask_words, slots = 4, 112, 128, 4, 4
    mask = np.full((rows, mask_words), 0xFFFFFFFF, np.uint32)
    mask[1] = RNG.integers(0, 2**32, mask_words, dtype=np.uint64).astype(np.uint32)
    mask[3, 0] = 0
    check_against_reference(runner, "sampling.adjust.v1", {
        "logits": RNG.standard_normal((rows, vocab)).astype(np.float32) * 3,
        "sampling": _sampling_rows([(1, 1, 0, 0, 0.5, 0.25, 1.3), (1, 1, 0, 0, 0, 0, 1),
                                    (1, 1, 0, 0, 0.1, 0, 0.8), (1, 1, 0, 0, 0, 1.5, 1)]),
        "prompt_histogram": RNG.integers(0, 2, (slots, bins)).astype(np.int32),
        "output_histogram": (RNG.integers(0, 4, (slots, bins)) * RNG.integers(0, 2, (slots, bins))
                             ).astype(np.int32),
        "grammar_mask": mask, "row_slot": np.array([2, 0, 1, 3], np.int32),
        "sample_flag": np.array([1, 1, 0, 1], np.int32)},
        {"rows": rows, "vocab": vocab, "histogram_bins": bins, "mask_words": mask_words},
        rtol=1e-6)


DRAW_SETTINGS = [
    (0.0, 1.0, 0, 0.0),          # greedy
    (1.0, 1.0, 0, 0.0),          # plain temperature
    (0.7, 0.9, 0, 0.0),          # top-p
    (1.3, 1.0, 5, 0.0),          # top-k
    (1.0, 0.8, 20, 0.05),        # all three
    (2.0, 1.0, 0, 0.2),          # min-p
]


@pytest.mark.parametrize("temperature, top_p, top_k, min_p", DRAW_SETTINGS)
def test_draw_tokens_matches_the_reference(runner, temperature, top_p, top_k,
                                           min_p):
    rows, vocab = 12, 304
    logits = RNG.standard_normal((rows, vocab)).astype(np.float32) * 2
    logits[0, [3, 77]] = logits[0].max() + 1           # a tie for the best token
    out = check_against_reference(runner, "sampling.draw.v1", {
        "sampled": np.full(rows, -9, np.int32), "logits": logits,
        "sampling": _sampling_rows([(temperature, top_p, top_k, min_p, 0, 0, 1)] * rows),
        "seeds": RNG.integers(0, 2**32, (rows, 2), dtype=np.uint64).astype(np.uint32),
        "generated": RNG.integers(0, 1000, rows).astype(np.int32),
        "row_slot": np.arange(rows, dtype=np.int32)[::-1].copy(),
        "sample_flag": np.array([1] * (rows - 1) + [0], np.int32)},
        {"rows": rows, "vocab": vocab})
    assert out["sampled"][-1] == -1


@pytest.mark.parametrize("temperature, top_p, top_k, min_p", DRAW_SETTINGS[1:3] + DRAW_SETTINGS[4:5])
def test_draw_over_several_chunks_matches_the_reference(runner, temperature, top_p, top_k,
                                                       min_p):
    """A vocabulary of 4 chunks whose head sits in one chunk: the passes skip chunks whose
    maximum is below the threshold, which must not change the token."""
    rows, vocab = 6, 8192
    logits = RNG.standard_normal((rows, vocab)).astype(np.float32)
    for r in range(rows):
        head = RNG.integers(0, vocab - 64)
        logits[r, head:head + 64] += 6 * RNG.random(64).astype(np.float32)
    check_against_reference(runner, "sampling.draw.v1", {
        "sampled": np.full(rows, -9, np.int32), "logits": logits,
        "sampling": _sampling_rows([(temperature, top_p, top_k, min_p, 0, 0, 1)] * rows),
        "seeds": RNG.integers(0, 2**32, (rows, 2), dtype=np.uint64).astype(np.uint32),
        "generated": RNG.integers(0, 1000, rows).astype(np.int32),
        "row_slot": np.arange(rows, dtype=np.int32), "sample_flag": np.ones(rows, np.int32)},
        {"rows": rows, "vocab": vocab})


def test_draw_walks_tied_logits_in_id_order(runner):
    """Equal logits: the inverse CDF must step through the tie group by token id, so the
    draw covers the whole vocabulary (not just the lowest id)."""
    rows, vocab = 16, 4096
    out = check_against_reference(runner, "sampling.draw.v1", {
        "sampled": np.full(rows, -9, np.int32), "logits": np.zeros((rows, vocab), np.float32),
        "sampling": _sampling_rows([(1.0, 1.0, 0, 0.0, 0, 0, 1)] * rows),
        "seeds": np.tile(np.array([[5, 6]], np.uint32), (rows, 1)),
        "generated": np.arange(rows, dtype=np.int32),
        "row_slot": np.arange(rows, dtype=np.int32), "sample_flag": np.ones(rows, np.int32)},
        {"rows": rows, "vocab": vocab})
    assert len(set(out["sampled"].tolist())) > rows // 2


def _completion_kept_apart(kernel_id: str) -> tuple[abi.KernelSpec, dict]:
    """The kernel's spec with every param READ (the generic comparison skips them) and a
    reference that leaves its completion words in the returned dict: the caller compares the
    words itself (ids exactly, floats within a tolerance)."""
    spec = abi.kernel(kernel_id)
    reference_out: dict = {}

    def reference(completion, *rest):
        spec.reference(completion, *rest)
        reference_out["completion"] = completion.copy()
    compared = abi.KernelSpec(spec.id, tuple(abi.Param(p.name, p.kind, p.dtype, abi.Access.READ)
                                             for p in spec.params), reference, spec.summary)
    return compared, reference_out


def _logprobs_case(runner: "Runner", logits: np.ndarray, sampled: np.ndarray, sample_flag: np.ndarray, top_n: int):
    """Run sampling.logprobs.v1 and its reference; compare ids exactly, logprobs to 1e-5."""
    from helios_backend.kernel_abi.logprobs import logprob_record_words
    rows, vocab = logits.shape
    base = 12                                       # a header + records in front of the extension
    completion = np.full(base + rows * logprob_record_words(top_n), 0x7EADBEEF, np.int32)
    compared, reference_out = _completion_kept_apart("sampling.logprobs.v1")
    produced = check_against_reference(runner, "sampling.logprobs.v1", {
        "completion": completion, "logits": logits, "sampled": sampled,
        "row_slot": np.arange(rows, dtype=np.int32)[::-1].copy(), "sample_flag": sample_flag,
        "live_rows": np.array([rows], np.int32)},
        {"rows": rows, "vocab": vocab, "top_n": top_n, "record_base": base}, spec=compared)
    got, want = produced["completion"], reference_out["completion"]
    np.testing.assert_array_equal(got[:base], want[:base])
    width = logprob_record_words(top_n)
    got_r = got[base:].reshape(rows, width)
    want_r = want[base:].reshape(rows, width)
    np.testing.assert_array_equal(got_r[:, 1:1 + top_n], want_r[:, 1:1 + top_n])       # ids
    for cols in (slice(0, 1), slice(1 + top_n, width)):                                  # logprobs
        np.testing.assert_allclose(got_r[:, cols].view(np.float32), want_r[:, cols].view(np.float32),
                                   atol=1e-5, rtol=0)
    return got_r


def test_keep_logits_copies_the_sampling_rows(runner):
    rows, vocab = 4, 2048 + 64
    raw = np.full((rows, vocab), 9.0, np.float32)
    out = check_against_reference(runner, "sampling.keep_logits.v1", {
        "raw_logits": raw, "logits": RNG.standard_normal((rows, vocab)).astype(np.float32),
        "row_slot": np.array([3, -1, 0, 1], np.int32), "sample_flag": np.array([1, 1, 0, 1], np.int32),
        "live_rows": np.array([4], np.int32)}, {"rows": rows, "vocab": vocab})
    assert (out["raw_logits"][1:3] == 9.0).all() and not (out["raw_logits"][[0, 3]] == 9.0).any()


@pytest.mark.parametrize("vocab", [304, 8192])
def test_logprobs_match_the_reference(runner, vocab):
    rows, top_n = 5, 20
    logits = RNG.standard_normal((rows, vocab)).astype(np.float32) * 3
    logits[0, [7, 200, 301]] = logits[0].max() + 1      # tied best: id order
    logits[1, :] = 0.5                                  # all tied: ids 0..top_n-1
    logits[2, ::2] = -np.inf                            # a grammar-masked row
    sampled = np.array([7, 3, 1, 9, 11], np.int32)
    flag = np.array([1, 1, 1, 1, 0], np.int32)          # the last row sampled nothing
    records = _logprobs_case(runner, logits, sampled, flag, top_n)
    assert list(records[0, 1:4]) == [7, 200, 301]
    assert list(records[1, 1:1 + top_n]) == list(range(top_n))
    assert (records[4, 1:1 + top_n] == -1).all() and records[4, 0] == 0


def test_score_targets_matches_the_reference(runner):
    # SCORED_PREFILL: log_softmax(norm + head of every live packed token)[target]; others read 0
    tokens, dim, vocab, base = 9, 64, 304, 12
    hidden, norm_weight = _normed_inputs(tokens, dim)
    targets = RNG.integers(0, vocab, tokens).astype(np.int32)
    targets[2], targets[4] = -1, vocab                   # padding and out-of-range targets
    completion = np.full(base + tokens, 0x7EADBEEF, np.int32)
    compared, reference_out = _completion_kept_apart("logits.score_targets.v1")
    produced = check_against_reference(runner, "logits.score_targets.v1", {
        "completion": completion, "hidden": hidden, "norm_weight": norm_weight, "head": _weight(vocab, dim),
        "targets": targets, "geometry": step_geometry([7], tokens)},                  # 7 live tokens of 9
        {"tokens": tokens, "dim": dim, "vocab": vocab, "eps": 1e-5, "record_base": base}, spec=compared)
    got, want = produced["completion"], reference_out["completion"]
    np.testing.assert_array_equal(got[:base], want[:base])
    scores = got[base:].view(np.float32)
    np.testing.assert_allclose(scores, want[base:].view(np.float32), atol=1e-4, rtol=0)
    assert (scores[[2, 4, 7, 8]] == 0).all() and (scores[[0, 1, 3, 5, 6]] < 0).all()


# ---------------------------------------------------------------------------------------------
# slot state and completion records

def test_commit_publishes_tokens_and_writes_every_record(runner):
    from helios_backend.kernel_abi.state import COMPLETION_HEADER_WORDS, COMPLETION_ROW_WORDS
    rows, slots, vocab, bins, eos_capacity = 6, 8, 50, 64, 3
    eos = np.full((slots, eos_capacity), -1, np.int32)
    eos[:, 0] = 2
    eos[3, 1] = 17
    out = check_against_reference(runner, "state.commit.v1", {
        "completion": np.full(COMPLETION_HEADER_WORDS + rows * COMPLETION_ROW_WORDS, 99,
                              np.int32),
        "pending": np.full(slots, 5, np.int32),
        "generated": np.array([0, 3, 9, 1, 4, 0, 0, 2], np.int32),
        "output_histogram": RNG.integers(0, 3, (slots, bins)).astype(np.int32),
        "sampled": np.array([17, 2, 40, 8, 11, 12], np.int32),
        "eos_ids": eos, "output_limit": np.array([10] * 4 + [5] + [10] * 3, np.int32),
        "row_slot": np.array([3, 6, 1, 4, -1, 0], np.int32),
        "row_generation": np.arange(11, 11 + rows, dtype=np.int32),
        "query_length": np.array([1, 1, 4, 1, 1, 1], np.int32),
        "consumed": np.array([30, 8, 0, 12, 3, 3], np.int32),
        "sample_flag": np.array([1, 1, 0, 1, 1, 1], np.int32),
        "transport_header": np.array([123456, 1], np.int32), "live_rows": np.array([5], np.int32)},
        {"rows": rows, "eos_capacity": eos_capacity, "histogram_bins": bins, "operation": 4})
    finish = out["completion"][COMPLETION_HEADER_WORDS:].reshape(rows, -1)[:, 5]
    assert finish.tolist() == [1, 1, 0, 2, 0, 0]                 # eos, eos, -, length, -, -


def test_admit_copies_the_rows_sampling_state_into_its_slot(runner):
    from helios_backend.kernel_abi.state import COMPLETION_HEADER_WORDS, COMPLETION_ROW_WORDS
    rows, slots, bins, eos_capacity = 3, 5, 2512, 4
    check_against_reference(runner, "state.admit.v1", {
        "seeds": np.zeros((slots, 2), np.uint32),
        "sampling": np.full((slots, 8), -1.0, np.float32),
        "output_limit": np.zeros(slots, np.int32),
        "eos_ids": np.zeros((slots, eos_capacity), np.int32),
        "prompt_histogram": np.full((slots, bins), 7, np.int32),
        "output_histogram": np.full((slots, bins), 7, np.int32),
        "generated": np.full(slots, 7, np.int32), "pending": np.full(slots, 7, np.int32),
        "completion": np.full(COMPLETION_HEADER_WORDS + rows * COMPLETION_ROW_WORDS, 99,
                              np.int32),
        "in_seeds": RNG.integers(0, 2**32, (rows, 2), dtype=np.uint64).astype(np.uint32),
        "in_sampling": RNG.random((rows, 8)).astype(np.float32),
        "in_output_limit": np.array([16, 32, 64], np.int32),
        "in_eos_ids": RNG.integers(0, 100, (rows, eos_capacity)).astype(np.int32),
        "in_histogram": RNG.integers(0, 5, (rows, bins)).astype(np.int32),
        "row_slot": np.array([4, -1, 1], np.int32), "row_generation": np.array([7, 8, 9], np.int32),
        "transport_header": np.array([42, 0], np.int32), "live_rows": np.array([3], np.int32)},
        {"rows": rows, "eos_capacity": eos_capacity, "histogram_bins": bins, "operation": 1})


def test_the_library_implements_every_abi_kernel_id(library):
    # spec: OWN-4 (every id any recipe may record runs on every executor)
    assert sorted(library.kernel_ids()) == sorted(abi.KERNELS)
    assert len(library.kernel_ids()) == len(set(library.kernel_ids()))


# ---------------------------------------------------------------------------------------------
# page payload copies (snapshots at exact token endpoints)

def _continuation_case(rows: int):
    slots, pages_per_row, page_tokens, layers, kv_width = 4, 4, 4, 2, 16
    page_stride = layers * page_tokens * kv_width
    row_stride = page_stride + 32
    planes = [RNG.standard_normal(slots * pages_per_row * page_stride).astype(np.float16)
              for _ in range(4)]
    return planes, RNG.permutation(slots * pages_per_row).astype(np.int32), {
        "rows": rows, "page_tokens": page_tokens, "pages_per_row": pages_per_row,
        "page_stride": page_stride, "row_stride": row_stride}


def test_snapshot_copies_the_partial_page_at_each_endpoint(runner):
    (k_cache, v_cache, k_cont, v_cont), page_table, immediates = _continuation_case(rows=5)
    check_against_reference(runner, "cache.snapshot_partial.v1", {
        "k_continuation": k_cont, "v_continuation": v_cont, "k_cache": k_cache, "v_cache": v_cache,
        "page_table": page_table, "row_slot": np.array([2, 0, 3, 1, 1], np.int32),
        "snapshot_row": np.array([1, -1, 0, 2, 3], np.int32),
        "consumed": np.array([5, 3, 8, 2, 1], np.int32),
        "query_length": np.array([2, 1, 4, 1, 1], np.int32),     # endpoint 12: no partial page
        "live_rows": np.array([4], np.int32)}, immediates)


def test_restore_copies_continuation_rows_into_private_pages(runner):
    from helios_backend.kernel_abi.state import COMPLETION_HEADER_WORDS, COMPLETION_ROW_WORDS
    (k_cache, v_cache, k_cont, v_cont), page_table, immediates = _continuation_case(rows=4)
    immediates["operation"] = 7
    check_against_reference(runner, "cache.restore_partial.v1", {
        "k_cache": k_cache, "v_cache": v_cache,
        "completion": np.full(COMPLETION_HEADER_WORDS + 4 * COMPLETION_ROW_WORDS, 99, np.int32),
        "k_continuation": k_cont, "v_continuation": v_cont, "page_table": page_table,
        "row_slot": np.array([1, 3, -1, 2], np.int32),
        "row_generation": np.array([5, 6, 7, 8], np.int32),
        "restore_row": np.array([2, -1, 0, 1], np.int32),
        "consumed": np.array([6, 9, 4, 13], np.int32),
        "transport_header": np.array([77, 0], np.int32), "live_rows": np.array([3], np.int32)},
        immediates)


# ---------------------------------------------------------------------------------------------
# speculative rounds

def test_copy_confidence_marks_usable_copies(runner):
    rows, request_slots, draft_capacity = 5, 6, 4
    check_against_reference(runner, "speculative.copy_confidence.v1", {
        "confidence": np.full((2, request_slots, draft_capacity), 0.5, np.float32),
        "proposal_count": np.array([2, 9, 3, 1, 4], np.int32),
        "proposal_generation": np.array([7, 1, 5, 3, 3], np.int32),
        "proposal_consumed": np.array([10, 0, 20, 30, 40], np.int32),
        "row_generation": np.array([7, 1, 6, 3, 3], np.int32),       # row 2's copy is stale
        "consumed": np.array([10, 0, 20, 30, 40], np.int32),
        "row_slot": np.array([1, 0, 2, -1, 3], np.int32),
        "transport_header": np.array([11, 1], np.int32), "live_rows": np.array([4], np.int32)},
        {"rows": rows, "request_slots": request_slots, "draft_capacity": draft_capacity,
         "draft_tokens": 3})


@pytest.mark.parametrize("packed_capacity", [4, 9, 40])
def test_allocate_prefixes_by_survival(runner, packed_capacity):
    rows, request_slots, draft_capacity = 5, 6, 4
    confidence = RNG.random((2, request_slots, draft_capacity)).astype(np.float32)
    confidence[1, 3, 0] = confidence[1, 0, 0]                 # a survival tie between lanes
    check_against_reference(runner, "speculative.allocate.v1", {
        "lengths": np.full(rows + 1, 9, np.int32), "confidence": confidence,
        "prefix_limit": np.array([4, 1, 3, 4, 2], np.int32),
        "row_slot": np.array([0, 2, -1, 1, 3], np.int32),
        "transport_header": np.array([11, 1], np.int32), "live_rows": np.array([5], np.int32)},
        {"rows": rows, "request_slots": request_slots, "draft_capacity": draft_capacity,
         "confidence_width": 3, "packed_capacity": packed_capacity})


@pytest.mark.parametrize("tokens", [12, 7])
def test_expand_lays_lanes_out_as_one_token_rows(runner, tokens):
    rows, draft_stride = 5, 4
    check_against_reference(runner, "speculative.expand.v1", {
        "ids": np.full(tokens, 5, np.int32), "positions": np.full(tokens, 5, np.int32),
        "token_slot": np.full(tokens, 5, np.int32), "token_length": np.full(tokens, 5, np.int32),
        "lengths": np.full(rows, 5, np.int32), "requested": np.array([3, 4, 2, 9, 4], np.int32),
        "pending": np.array([100, 101, 102, 103], np.int32),
        "proposal_ids": np.arange(200, 200 + rows * draft_stride, dtype=np.int32),
        "proposal_count": np.array([2, 3, 3, 4, 1], np.int32),
        "proposal_generation": np.array([7, 1, 5, 3, 3], np.int32),
        "proposal_consumed": np.array([10, 0, 20, 30, 40], np.int32),
        "row_slot": np.array([1, -1, 0, 2, 3], np.int32),
        "row_generation": np.array([7, 1, 6, 3, 3], np.int32),       # lane 2's copy is stale
        "consumed": np.array([10, 0, 20, 30, 40], np.int32), "live_rows": np.array([5], np.int32)},
        {"rows": rows, "tokens": tokens, "draft_stride": draft_stride, "draft_tokens": 3,
         "width": 4})


def test_verify_commit_accepts_the_matching_prefix(runner):
    from helios_backend.kernel_abi.state import COMPLETION_HEADER_WORDS, COMPLETION_ROW_WORDS
    rows, slots, vocab, bins, mask_words, eos_capacity, ext_width = 4, 4, 304, 304, 10, 2, 6
    lengths = np.array([3, 0, 2, 3], np.int32)
    tokens = int(lengths.sum()) + 1
    logits = RNG.standard_normal((tokens, vocab)).astype(np.float32)
    winners = np.array([40, 41, 42, 43, 44, 45, 46, 47, 48])[:tokens]
    logits[np.arange(tokens), winners] += 8.0                 # clear greedy choices
    ids = np.zeros(tokens, np.int32)
    ids[1:3] = [40, 7]          # lane 0: accepts 40, rejects at position 1 (target 41 != 7)
    ids[4] = 43                 # lane 2: accepts 43
    ids[6:8] = [45, 46]         # lane 3: EOS at 46 ends it
    eos = np.full((slots, eos_capacity), -1, np.int32)
    eos[3] = [46, 3]
    mask = np.full((rows, mask_words), 0xFFFFFFFF, np.uint32)
    mask[2, 1] = 0              # lane 2, first position: tokens 32..63 disallowed (42 too)
    sampling = _sampling_rows([(0, 1, 0, 0, 0, 0, 1), (0, 1, 0, 0, 0, 0, 1),
                               (0, 1, 0, 0, 0.5, 0.5, 1.2), (0, 1, 0, 0, 0, 0, 1)])
    out = check_against_reference(runner, "speculative.verify_commit.v1", {
        "completion": np.full(COMPLETION_HEADER_WORDS + rows * (COMPLETION_ROW_WORDS + ext_width),
                              99, np.int32),
        "pending": np.full(slots, -1, np.int32), "generated": np.array([3, 0, 5, 1], np.int32),
        "output_histogram": RNG.integers(0, 2, (slots, bins)).astype(np.int32),
        "draft_cursor": np.full(slots, 9, np.int32), "logits": logits, "sampling": sampling,
        "seeds": RNG.integers(0, 2**32, (slots, 2), dtype=np.uint64).astype(np.uint32),
        "prompt_histogram": RNG.integers(0, 2, (slots, bins)).astype(np.int32),
        "grammar_mask": mask, "eos_ids": eos, "output_limit": np.array([10, 10, 6, 10], np.int32),
        "ids": ids, "lengths": lengths, "row_slot": np.array([0, -1, 2, 3], np.int32),
        "row_generation": np.array([5, 6, 7, 8], np.int32),
        "consumed": np.array([20, 0, 30, 40], np.int32),
        "transport_header": np.array([321, 0], np.int32), "live_rows": np.array([4], np.int32)},
        {"rows": rows, "tokens": tokens, "vocab": vocab, "histogram_bins": bins,
         "mask_words": mask_words, "eos_capacity": eos_capacity, "lag_tokens": 2,
         "completion_rows": rows, "ext_width": ext_width, "operation": 5}, rtol=1e-6)
    ext = out["completion"][COMPLETION_HEADER_WORDS + rows * COMPLETION_ROW_WORDS:].reshape(rows, -1)
    assert ext[0, :2].tolist() == [3, 1] and ext[3, :2].tolist() == [3, 1]
