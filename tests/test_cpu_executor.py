"""The CPU executor (compiled kernels) against the numpy executor, its conformance oracle.

On small random-weight stand-ins (tests/tiny_checkpoints.py: 2 layers, 64 wide, a tiny byte-level
vocabulary) of both families the recipes prepare (llama through the SmolLM2 recipe; qwen2, with
q/k/v biases and a separate head, through its recipe), prepared with every operation the
recipe records, the same harness
as the CUDA conformance script (tests/gpu/conformance.py) runs each program on both
executors from fresh slots and compares completion records (tokens exactly), logits and
float state within CPU_LOGIT_TOLERANCE of each row's largest magnitude, integer state
exactly. Both executors read the same weights and hold the cache planes in their declared
f16 (the oracle with widen_f16_cache=False), so only the f32 summation order differs, and
through it the rounding of a cached key or value that lies near the midpoint of two halves:
one step of f16 (2^-11 relative) on a few cached values. Measured on the logits of every
program and stand-in: <= 4.1e-7 with the planes widened to f32, <= 9.8e-5 with f16 planes
(gemma3's decode of 8 rows), hence CPU_LOGIT_TOLERANCE = 5e-4 (five times that, one f16 step)
and far below what a wrong kernel gives (O(1)). Logprob records carry the logits' absolute
error and are compared on the logits' scale (conformance.compare). Then greedy
generation must give identical tokens for 64 steps at batch 1 and 8.
"""
from __future__ import annotations

import dataclasses
import pathlib
import sys
import zlib
from typing import Iterator

import numpy as np
import pytest
from helios_proto import contract_pb2 as C
from helios_proto import manifest_pb2 as M

from helios_backend.executors.cpu_executor import CpuExecutor, CpuExecutorOptions, program_capacity
from helios_backend.executors.numpy_executor import NumpyExecutor, NumpyExecutorOptions
from helios_backend.engine.model import ModelOptions, NativeModel
from helios_backend.lockstep.generator import GenerationRequest, LockstepGenerator
from tests.tiny_checkpoints import TinyGemmaShape, TinyShape, tiny_vocabulary, tiny_weights, write_tiny_gemma_gguf, write_tiny_gguf

sys.path.insert(0, str(pathlib.Path(__file__).parent / "gpu"))
import conformance  # noqa: E402  (the executor-agnostic harness of the CUDA conformance script)
from executor_model import ExecutorModel  # noqa: E402

CPU_LOGIT_TOLERANCE = 5e-4        # max |cpu - numpy| / max |numpy| per row, logits and float state
# With q8 activations (kernel_abi/activations.py) an activation within the f32 summation-order
# difference (~1e-7) of the midpoint between two quantization steps may round to either: one step
# is 1/127 of its block's largest magnitude, so one such activation moves the logits by ~1e-2 of
# their largest (measured max 1.3e-2 on the block stand-in's programs); a wrong kernel gives O(1).
Q8_LOGIT_TOLERANCE = 5e-2
CACHE_PAGES = 256
STEPS = 64


@pytest.fixture(scope="module", params=["llama", "llama-blocks", "qwen2", "gemma3"])
def tiny_prepared(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    from ignition.preparation.prepare import prepare
    from ignition.recipes import gemma_3_270m, smollm2_135m_instruct
    from ignition.recipes.qwen2_5_coder_instruct import CODER_0_5B

    directory = tmp_path_factory.mktemp(f"tiny-{request.param}")
    if request.param.startswith("llama"):   # SmolLM2's conventions: no biases, the head tied to the embedding
        recipe = smollm2_135m_instruct      # llama-blocks: its GGUF's Q8_0 / Q4_1 blocks, kept in the core
        weights = tiny_weights(TinyShape(), len(tiny_vocabulary()[0]), biases=False, tied=True)
        gguf = write_tiny_gguf(directory / f"tiny-{request.param}.gguf", arch="llama", weights=weights,
                               chat_template=recipe.CHECKPOINT_TEMPLATE, quantized=request.param == "llama-blocks")
    elif request.param == "qwen2":
        recipe = CODER_0_5B
        gguf = write_tiny_gguf(directory / "tiny-qwen2.gguf")
    else:                            # q/k and post norms, sliding windows, GeGLU: the reference kernels
        recipe = gemma_3_270m
        gguf = write_tiny_gemma_gguf(directory / "tiny-gemma3.gguf")
    options = dataclasses.replace(
        recipe.RecipeOptions(), gguf_path=str(gguf), context_tokens=512, prepared_pages=CACHE_PAGES,
        decode_rows=(1, 2, 8), prefill_variants=((1, 16), (1, 64), (2, 64)), mixed_variants=((2, 17),),
        admission_rows=(1, 2), resume_rows=(1,), restoration_rows=(1,), snapshot_rows=4, top_logprobs=4,
        speculative_widths=())
    return prepare(recipe, options)


def _executor_pair(prepared, activations: str) -> Iterator[dict[str, NativeModel]]:
    """The oracle and the CPU executor over `prepared`, both with block-weight products' `activations`."""
    data = {r.id: r.data for r in prepared.resources}
    contract, manifest = prepared.contract, prepared.manifest
    oracle = NumpyExecutor(manifest, data.__getitem__, NumpyExecutorOptions(cache_pages=CACHE_PAGES, widen_f16_cache=False,
                                                                            activations=activations))
    # share_above=1: every product and attention call is split into chunks shared with a helper thread
    # (the tiny shapes would otherwise run on one thread), so chunk boundaries are compared too
    cpu = CpuExecutor(manifest, data.__getitem__, CpuExecutorOptions(cache_pages=CACHE_PAGES, share_above=1,
                                                                     activations=activations))
    # a 64-token prefill chunk's attention in blocks of 24, 24 and 16 queries (the default block of 128
    # would take the tiny chunks whole), so the blocks' boundaries are compared too
    cpu.kernels.query_block = 24
    models = {"numpy": ExecutorModel(contract, manifest, oracle), "cpu": ExecutorModel(contract, manifest, cpu)}
    yield models
    oracle.close()
    cpu.close()


@pytest.fixture(scope="module")
def executors(tiny_prepared) -> Iterator[dict[str, NativeModel]]:
    """Both executors with f32 activations (the oracle's default; q8: q8_executors)."""
    yield from _executor_pair(tiny_prepared, "f32")


@pytest.fixture(scope="module")
def q8_executors(tiny_prepared) -> Iterator[dict[str, NativeModel]]:
    """Both executors with q8 activations (kernel_abi/activations.py), on the cores with block weights."""
    if not any(b.kind == M.BUFFER_KIND_WEIGHT and b.dtype in (C.DTYPE_Q8_0, C.DTYPE_Q4_1)
               for b in tiny_prepared.manifest.buffers):
        pytest.skip("q8 activations change only block-weight products")
    yield from _executor_pair(tiny_prepared, "q8")


def _programs(prepared) -> list[M.Program]:
    return [p for p in prepared.manifest.programs if p.rank == 0]


def test_every_program_agrees_with_the_numpy_oracle(tiny_prepared, executors):
    # spec: OWN-1, CON-8 (the same recorded programs and kernel ABI, replayed by a second executor)
    _assert_every_program_agrees(tiny_prepared, executors, CPU_LOGIT_TOLERANCE)


def test_every_program_with_q8_activations_agrees_with_the_q8_numpy_oracle(tiny_prepared, q8_executors, executors):
    # spec: OWN-1, CON-8
    """The integer products against the oracle's references over the activations' q8 round trip; and
    q8 is not f32 (the decode logits of the two oracles differ by far more than the tolerance)."""
    _assert_every_program_agrees(tiny_prepared, q8_executors, Q8_LOGIT_TOLERANCE)
    vocab = tiny_prepared.contract.model.vocabulary.sampled_tokens
    program = next(p for p in _programs(tiny_prepared) if p.operation == C.OPERATION_DECODE)
    logits = {}
    for kind, models in (("f32", executors), ("q8", q8_executors)):
        case = conformance.Case(models["numpy"], seed=5, first_generation=9_000_000)
        case.run(program)
        logits[kind] = conformance.snapshot(models["numpy"].executor, tiny_prepared.manifest,
                                            case.logits_program or program.name,
                                            (tiny_prepared.manifest.request_slots, vocab))[0]
    assert np.abs(logits["q8"] - logits["f32"]).max() > 10 * CPU_LOGIT_TOLERANCE * np.abs(logits["f32"]).max()


def _assert_every_program_agrees(tiny_prepared, executors: dict[str, NativeModel], tolerance: float) -> None:
    manifest = tiny_prepared.manifest
    vocab = tiny_prepared.contract.model.vocabulary.sampled_tokens
    failures, operations = [], set()
    for index, program in enumerate(_programs(tiny_prepared)):
        outputs, prepared = {}, {}
        for kind, model in executors.items():
            case = conformance.Case(model, seed=zlib.crc32(program.name.encode()),
                                    first_generation=1_000_000 * (index + 1))
            rows = case.run(program)
            logits, state = conformance.snapshot(model.executor, manifest, case.logits_program or program.name,
                                                 (manifest.request_slots, vocab))
            if case.scores is not None:
                state["completion:scores"] = case.scores
            state.update(conformance.logprob_records(manifest, case.driver, len(rows)))
            outputs[kind] = (rows.copy(), logits, state)
            prepared[kind] = case.prepared_tokens
        result = conformance.compare(program.name, program, outputs, manifest, prepared, case.slots,
                                     candidate="cpu", tolerance=tolerance)
        operations.add(program.operation)
        if not result["pass"] or result.get("near_ties") or result.get("diverged_inputs"):
            failures.append(result)
    assert not failures, repr([{k: v for k, v in f.items() if k != "scratch_rel_err"} for f in failures])
    assert len(operations) >= 7          # initialization, prefill, scored prefill, decode, mixed, resume, restoration


@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_generation_is_identical_for_64_steps(tiny_prepared, executors, batch):
    # spec: OWN-1
    _assert_greedy_identical(tiny_prepared, executors, batch)


@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_generation_with_q8_activations_agrees_for_64_steps_up_to_near_ties(tiny_prepared, q8_executors,
                                                                                  batch):
    # spec: OWN-1
    """Greedy generation with q8 activations on both executors, 64 steps: each row's tokens agree up
    to their first difference, the logits of every step up to it within Q8_LOGIT_TOLERANCE, and
    there the two tokens are a near-tie (within twice the tolerance of each other in both runs'
    logits): a quantization step that rounds the other way on one executor may pick the other of
    two near-equal tokens (on the AVX2 path 64 steps of batch 1 part so), and nothing after it is
    compared. A wrong kernel moves the logits by O(1)."""
    vocab = tiny_prepared.contract.model.vocabulary.sampled_tokens
    rng = np.random.default_rng(batch)
    prompts = [rng.integers(0, vocab, 5 + 3 * i).tolist() for i in range(batch)]
    runs = {kind: _greedy_with_logits(model, prompts, STEPS, vocab) for kind, model in q8_executors.items()}
    agreed = 0
    for row in range(batch):
        (expected, expected_logits), (tokens, logits) = runs["numpy"][row], runs["cpu"][row]
        assert len(tokens) == len(expected) == STEPS
        step = next((i for i, (a, b) in enumerate(zip(expected, tokens)) if a != b), STEPS)
        for i in range(min(step + 1, STEPS)):        # the same inputs up to the first difference
            scale = np.abs(expected_logits[i]).max()
            assert np.abs(logits[i] - expected_logits[i]).max() <= Q8_LOGIT_TOLERANCE * scale, (row, i)
        if step == STEPS:
            agreed += 1
            continue
        for run in (expected_logits[step], logits[step]):
            gap = abs(float(run[expected[step]]) - float(run[tokens[step]]))
            assert gap <= 2 * Q8_LOGIT_TOLERANCE * np.abs(run).max(), (row, step, gap)
    assert agreed >= batch // 2, f"{agreed} of {batch} rows agree for {STEPS} steps"


def _greedy_with_logits(model, prompts: list, steps: int, vocab: int) -> list[tuple[list[int], list[np.ndarray]]]:
    """Per prompt (row in this order) its `steps` greedy tokens and the logits each was picked from."""
    from helios_backend.lockstep.raw_lanes import RawLanes

    driver = RawLanes(model)
    actives = driver.admit([GenerationRequest(p, max_tokens=steps, eos_ids=(-1,)) for p in prompts],
                           list(range(len(prompts))))
    logits: list[list[np.ndarray]] = [[] for _ in prompts]

    def read(rows: int) -> np.ndarray:
        return model.executor.read_buffer("scratch.logits").view(np.float32)[:rows * vocab].reshape(rows, vocab)

    for row, active in enumerate(actives):
        driver.prefill(active)
        logits[row].append(read(1)[0].copy())
    for _ in range(steps - 1):
        driver.decode_round(actives)
        for row, values in enumerate(read(len(actives))):
            logits[row].append(values.copy())
    driver.pages.give_back(page for active in actives for page in active.pages)
    return [(active.result.tokens, rows) for active, rows in zip(actives, logits)]


def _assert_greedy_identical(tiny_prepared, executors: dict[str, NativeModel], batch: int) -> None:
    vocab = tiny_prepared.contract.model.vocabulary.sampled_tokens
    rng = np.random.default_rng(batch)
    prompts = [rng.integers(0, vocab, 5 + 3 * i).tolist() for i in range(batch)]
    tokens = {}
    for kind, model in executors.items():
        requests = [GenerationRequest(p, max_tokens=STEPS, eos_ids=(-1,)) for p in prompts]   # no EOS: 64 steps
        tokens[kind] = [r.tokens for r in LockstepGenerator(model).generate(requests)]
    assert all(len(t) == STEPS for t in tokens["numpy"]), [len(t) for t in tokens["numpy"]]
    assert tokens["cpu"] == tokens["numpy"]
    assert len({tuple(t) for t in tokens["cpu"]}) == batch    # distinct prompts, distinct outputs


def test_weights_stay_in_their_declared_f16_layout(tiny_prepared, executors):
    """No f32 shadow: the resident weight bytes are the manifest's declared bytes."""
    cpu = executors["cpu"].executor
    declared = sum(b.nbytes for b in tiny_prepared.manifest.buffers
                   if b.rank == 0 and b.kind == M.BUFFER_KIND_WEIGHT)
    assert cpu.resident_weight_bytes() == declared
    assert not cpu.ranks[0].shadows
    assert executors["numpy"].executor.ranks[0].shadows      # the oracle keeps its f32 copies


def test_workspace_is_sized_from_the_largest_program(tiny_prepared):
    from ignition.recipes import gemma_3_270m
    shape = TinyGemmaShape() if tiny_prepared.contract.served_id == gemma_3_270m.SERVED_ID else TinyShape()
    capacity = program_capacity(_programs(tiny_prepared))
    assert capacity.tokens == 64 and capacity.heads == shape.heads
    assert capacity.width == 2 * shape.ffn                   # the fused gate/up product
    assert capacity.context == 512


def test_activations_name_a_known_representation():
    # spec: OWN-1
    from helios_backend.engine.settings import SettingsError, StartupOptions

    for options in (CpuExecutorOptions, NumpyExecutorOptions):
        with pytest.raises(ValueError, match="activations must be one of f32, q8"):
            options(activations="q4")
    with pytest.raises(SettingsError, match="startup option activations"):
        StartupOptions.from_parameters({"activations": "int8"}, pathlib.Path("."))
    assert StartupOptions.from_parameters({"activations": "q8"}, pathlib.Path(".")).activations == "q8"


def test_model_load_selects_the_cpu_executor(tiny_prepared):
    data = {r.id: r.data for r in tiny_prepared.resources}
    model = NativeModel.load(tiny_prepared.contract, tiny_prepared.manifest, data.__getitem__,
                             ModelOptions(executor="cpu", cache_pages=64))
    try:
        assert isinstance(model.executor, CpuExecutor)
        assert model.manifests[0].cache_pages == 64
        assert model.executor.cpu_options.activations == "q8"          # the CPU executor's default
    finally:
        model.close()
    model = NativeModel.load(tiny_prepared.contract, tiny_prepared.manifest, data.__getitem__,
                             ModelOptions(executor="cpu", cache_pages=64, activations="f32"))
    try:                                # the option reaches the kernels and the references they leave
        assert model.executor.kernels.activations == "f32" and model.executor.ranks[0].activations == "f32"
    finally:
        model.close()


def test_serving_defaults_to_the_cpu_executor_without_a_gpu(tmp_path: pathlib.Path):
    from helios_backend.cli.serve import parser, resolve_executor
    from helios_backend.executors.cuda.driver import gpu_available
    from helios_backend.engine.settings import StartupOptions

    assert parser().parse_args(["--core", "x.core"]).executor == "auto"
    assert resolve_executor("auto") == ("cuda" if gpu_available() else "cpu")
    assert resolve_executor("numpy") == "numpy"
    assert StartupOptions(tmp_path / "x.core").executor == "cpu"     # a config without the parameter
    assert StartupOptions.from_parameters({"executor": "cpu"}, tmp_path).executor == "cpu"


@pytest.mark.slow
def test_real_block_core_greedy_is_identical_for_64_steps():
    # spec: OWN-1
    """The SmolLM2 core as the default preparation stores it (its GGUF's Q4_1 / Q8_0 blocks): the CPU
    executor's greedy tokens equal the numpy oracle's for 64 steps at batch 1 and 8, with f32
    activations. (With q8 ones no two executors agree this far on this core: an f32 difference of
    one rounding flips a quantized activation, and the flips compound over its 30 layers to ~1
    logit; docs/cpu-executor.md.)"""
    from tests.engine_fixtures import prepared_in_memory

    prepared = prepared_in_memory(decode_rows=(1, 8), prefill_variants=((1, 16),), mixed_variants=(),
                                  snapshot_rows=0, restoration_rows=(), scored_prefill_variants=())
    assert {b.dtype for b in prepared.manifest.buffers if b.name == "weights.layers.0.gate_up"} == {C.DTYPE_Q4_1}
    data = {r.id: r.data for r in prepared.resources}
    executors = {"numpy": NumpyExecutor(prepared.manifest, data.__getitem__, NumpyExecutorOptions(cache_pages=96, widen_f16_cache=False)),
                 "cpu": CpuExecutor(prepared.manifest, data.__getitem__, CpuExecutorOptions(cache_pages=96,
                                                                                            activations="f32"))}
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 49152, 4 + i).tolist() for i in range(8)]
    # one model per executor: the model mirrors its executor's submission numbers (NativeModel.submissions)
    models = {kind: ExecutorModel(prepared.contract, prepared.manifest, executor) for kind, executor in executors.items()}
    try:
        for batch in (1, 8):
            tokens = {}
            for kind, model in models.items():
                requests = [GenerationRequest(p, max_tokens=STEPS, eos_ids=(-1,)) for p in prompts[:batch]]
                tokens[kind] = [r.tokens for r in LockstepGenerator(model).generate(requests)]
            assert all(len(t) == STEPS for t in tokens["numpy"])
            assert tokens["cpu"] == tokens["numpy"], batch
    finally:
        for executor in executors.values():
            executor.close()


def test_compiler_pages_are_released_and_compiled_code_still_runs():
    # spec: OWN-1
    """After warm-up LLVM's clean read-only pages leave the resident set (residency.py); the
    compiled primitives keep working, and a later compilation faults the pages back."""
    from helios_backend.executors.cpu.f16_products import widen
    from helios_backend.executors.cpu.residency import _clean_read_only_mappings, release_library_pages
    from helios_backend.executors.cpu.warm_up import warm_up

    warm_up()
    mappings = _clean_read_only_mappings("libllvmlite")
    assert mappings, "numba's LLVM library is mapped"
    maps = pathlib.Path("/proc/self/maps").read_text().splitlines()
    writable = {int(line.split("-")[0], 16) for line in maps if "libllvmlite" in line and "w" in line.split()[1]}
    assert writable and not writable & {start for start, _ in mappings}     # relocated data is never released
    assert release_library_pages("libllvmlite") >= sum(length for _, length in mappings) > 0
    bits = np.arange(64, dtype=np.float16)
    out = np.zeros(64, dtype=np.float32)
    widen(out, bits.view(np.uint16), 64)
    assert np.array_equal(out, bits.astype(np.float32))


def test_shared_calls_run_every_chunk_once_and_raise_the_callers_error():
    # spec: OWN-1
    """WorkSharing.run_claimed: the chunks claimed in compiled code (claiming.claim_chunks, the
    caller and a polling or woken helper) cover every index exactly once, call after call, and a failing task's error
    reaches the caller without leaving the helper stuck."""
    from numba import njit

    from helios_backend.executors.cpu.claiming import claim_chunks
    from helios_backend.executors.cpu.sharing import WorkSharing

    @njit(nogil=True)
    def mark_chunk(index, chunks, args):
        (seen,) = args
        total = 0.0
        for i in range(2000):                    # a little work, so both threads get chunks
            total += i * 0.5
        seen[index] += 1 if total > 0 else 2

    @njit(nogil=True)
    def mark(seen, chunks, counters, calls, caller):
        claim_chunks(mark_chunk, (seen,), chunks, counters, calls, caller)

    sharing = WorkSharing(1)
    try:
        for chunks in (2, 7, 64) * 20:
            seen = np.zeros(chunks, dtype=np.int64)
            sharing.run_claimed(lambda counters, calls, caller: mark(seen, chunks, counters, calls, caller), chunks)
            assert seen.tolist() == [1] * chunks

        def failing(counters, calls, caller):
            if caller:
                raise RuntimeError("task failed")
            mark(np.zeros(8, dtype=np.int64), 8, counters, calls, caller)

        with pytest.raises(RuntimeError, match="task failed"):
            sharing.run_claimed(failing, 8)
        seen = np.zeros(16, dtype=np.int64)
        sharing.run_claimed(lambda counters, calls, caller: mark(seen, 16, counters, calls, caller), 16)
        assert seen.tolist() == [1] * 16
    finally:
        sharing.close()
