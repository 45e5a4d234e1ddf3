"""The numpy executor replaying the recorded SmolLM2 programs: correctness and invariances.

Tolerance against the independent oracle (tests/reference/llama_numpy.py, f32 weights
dequantized from the GGUF): |logit difference| <= 0.1 on logits of magnitude ~25, and the
same argmax. The executor stores weights and the KV cache in fp16 (the core's storage),
which accounts for the measured ~0.03.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
from helios_proto import contract_pb2 as C

from helios_backend.executors.base import MissingVariantError, UnknownKernelIdError
from helios_backend.executors.numpy_executor import NumpyExecutor, NumpyExecutorOptions
from helios_backend.kernel_abi.rope import ROPE_HALF_PAIRS
from helios_backend.engine.model import ModelLoadError, ModelOptions, NativeModel
from helios_backend.packing import PackedLane
from helios_backend.sampling_parameters import SamplingParameters
from helios_backend.lockstep.generator import LockstepGenerator, GenerationRequest
from helios_backend.lockstep.raw_lanes import RawLanes
from tests.engine_fixtures import prepared_in_memory, resource_reader

# "What is the capital of France?" through the SmolLM2 chat template (notes: model-tokenizer-grammar.md)
PROMPT = [1, 9690, 198, 2683, 359, 5356, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198,
          1, 520, 9531, 198]
PARIS_REPLY = [504, 3575, 282, 4649, 314, 7042, 30, 2]     # "The capital of France is Paris." <|im_end|>
LOGIT_TOLERANCE = 0.1
# Same computation, different GEMM shapes (chunking): f32 summation order differs, and a last-bit
# difference can flip an fp16 rounding of a cached key/value; measured <= 0.008.
# across the fused kernels and the product path, which rounds activations to f16 between nodes
PATH_TOLERANCE = 0.06
RESHAPE_TOLERANCE = 0.02
VOCAB = 49152


def prefill_logits(model: NativeModel, prompt, chunk: int, slot: int = 0, page_order=None,
                   vocab: int = VOCAB) -> dict[int, np.ndarray]:
    """Prefill `prompt` in chunks; logits of the last token of every chunk, by position."""
    driver = RawLanes(model, page_order=page_order, prefill_chunk=chunk)
    [active] = driver.admit([GenerationRequest(prompt, 8)], [slot])
    logits = model.executor.buffer_view("scratch.logits", np.float32)
    out = {}
    while active.consumed < len(prompt):
        tokens = np.asarray(prompt[active.consumed:active.consumed + chunk], dtype=np.int32)
        driver.ensure_pages(active, active.consumed + tokens.size)
        lane = PackedLane(slot=slot, generation=active.generation, start=active.consumed, tokens=tokens,
                    page_table=list(active.pages))
        driver.step(model.program(C.OPERATION_PREFILL, 1, tokens.size), [lane])
        active.consumed += tokens.size
        out[active.consumed - 1] = logits[:vocab].copy()
    return out


def greedy(model: NativeModel, prompt=PROMPT, max_tokens=8, **driver_args) -> list[int]:
    [result] = LockstepGenerator(model, **driver_args).generate([GenerationRequest(prompt, max_tokens)])
    return result.tokens


# ---- against the oracle -------------------------------------------------------------------------

def test_logits_match_the_independent_oracle_at_several_positions(smollm2_model, reference_llama):
    expected = reference_llama.forward(PROMPT, 0)            # [T, V]
    got = prefill_logits(smollm2_model, PROMPT, chunk=6)      # positions 5, 11, 17, 23
    assert sorted(got) == [5, 11, 17, 23]
    for position, logits in got.items():
        assert np.abs(logits - expected[position]).max() <= LOGIT_TOLERANCE, position
        assert int(np.argmax(logits)) == int(np.argmax(expected[position]))


def test_greedy_reply_matches_the_oracle_and_says_paris(smollm2_model, reference_llama):
    tokens = greedy(smollm2_model)
    assert tokens == PARIS_REPLY
    assert reference_llama.greedy(PROMPT, 8, stop_ids=(2,)) == PARIS_REPLY


def test_wrong_rope_pairing_is_caught(reference_llama):
    # The GGUF's q/k rows are permuted for adjacent-pair rotation; a recipe that rotates halves
    # records programs whose logits leave the oracle's tolerance and whose reply loses "Paris".
    prepared = prepared_in_memory(rope_pairing=ROPE_HALF_PAIRS)
    model = NativeModel.load(prepared.contract, prepared.manifest, resource_reader(prepared),
                             ModelOptions(cache_pages=16, concurrency=1))
    try:
        logits = prefill_logits(model, PROMPT, chunk=64)[23]
        assert np.abs(logits - reference_llama.forward(PROMPT, 0)[23]).max() > 1.0
        assert greedy(model) != PARIS_REPLY
    finally:
        model.close()


# ---- invariances -----------------------------------------------------------------------------

def test_chunked_prefill_then_decode_equals_one_shot_prefill(smollm2_model):
    # the one-shot step runs in a variant of 64+ tokens, which takes the product path (f16
    # activations between its nodes: docs/kernels.md), the 5-token chunks the fused kernels
    one_shot = prefill_logits(smollm2_model, PROMPT, chunk=64)[23]
    chunked = prefill_logits(smollm2_model, PROMPT, chunk=5)[23]
    np.testing.assert_allclose(chunked, one_shot, atol=PATH_TOLERANCE)
    assert greedy(smollm2_model, prefill_chunk=5) == greedy(smollm2_model, prefill_chunk=64) == PARIS_REPLY


def test_results_do_not_depend_on_physical_page_ids(smollm2_model):
    # spec: CON-7, BND-34
    # chunks of 6: every later step reads the keys of earlier steps through the page table
    model = smollm2_model
    pages = model.manifests[0].cache_pages
    ordered = prefill_logits(model, PROMPT, chunk=6)
    first = [97, 3, 41, 12, 100]
    order = first + [p for p in range(pages) if p not in first]
    scattered = prefill_logits(model, PROMPT, chunk=6, page_order=order)
    assert sorted(ordered) == sorted(scattered) == [5, 11, 17, 23]
    assert all(np.array_equal(ordered[p], scattered[p]) for p in ordered)
    # the step really ran on the scattered pages: slot 0's page-table row in the frame
    table = next(d for d in model.execution_manifest.transport.destinations if d.name == "page_table")
    frame = model.executor.staging(0)
    row = frame[table.byte_offset:table.byte_offset + 8].view(np.int32)
    assert row.tolist() == [97, 3]
    # and the comparison catches a page-table bug: the last chunk again, its first table entry
    # naming a page that holds other keys (the ordered run's second page) instead of page 97
    wrong = PackedLane(slot=0, generation=model.generations.next(0), start=18, tokens=np.asarray(PROMPT[18:], np.int32),
                 page_table=[1, 3])
    RawLanes(model).step(model.program(C.OPERATION_PREFILL, 1, 6), [wrong])
    assert frame[table.byte_offset:table.byte_offset + 8].view(np.int32).tolist() == [1, 3]
    broken = model.executor.buffer_view("scratch.logits", np.float32)[:VOCAB]
    assert np.abs(broken - scattered[23]).max() > 1.0


def test_results_do_not_depend_on_page_size(smollm2_model):
    prepared = prepared_in_memory(page_tokens=32)
    assert prepared.contract.model.cache.page_tokens == 32
    model = NativeModel.load(prepared.contract, prepared.manifest, resource_reader(prepared),
                             ModelOptions(cache_pages=16, concurrency=1))
    try:
        np.testing.assert_allclose(prefill_logits(model, PROMPT, chunk=7)[23],
                                   prefill_logits(smollm2_model, PROMPT, chunk=7)[23], atol=RESHAPE_TOLERANCE)
        assert greedy(model) == PARIS_REPLY
    finally:
        model.close()


SECOND_PROMPT = [1, 4093, 198, 19556, 17, 2, 198, 1, 520, 9531, 198]   # a short second conversation


def test_results_do_not_depend_on_row_slot_or_variant(smollm2_model):
    driver = RawLanes(smollm2_model)
    requests = [GenerationRequest(PROMPT, 6), GenerationRequest(SECOND_PROMPT, 6)]
    alone = [LockstepGenerator(smollm2_model).generate([r])[0].tokens for r in requests]           # decode.r1
    together = [r.tokens for r in driver.generate(requests, slots=[2, 0])]               # decode.r2, rows 0/1
    swapped = [r.tokens for r in driver.generate(requests, slots=[1, 3], row_order=[1, 0])]
    assert together == alone and swapped == alone
    # the scheduled rounds (a round of both prompts, then decode rounds) give the same tokens
    assert [r.tokens for r in LockstepGenerator(smollm2_model).generate(requests)] == alone
    # three lanes run in the r4 variant (one padding row)
    three = [r.tokens for r in driver.generate(requests + [GenerationRequest(PROMPT, 6)], slots=[0, 1, 2])]
    assert three == alone + [alone[0]]


def test_same_seed_same_tokens_different_seed_different_tokens(smollm2_model):
    sampling = SamplingParameters(temperature=1.0, top_p=0.95)
    run = lambda seed, slot: RawLanes(smollm2_model).generate(  # noqa: E731
        [GenerationRequest(PROMPT, 12, sampling, seed=seed, eos_ids=(-1,))], slots=[slot])[0].tokens
    first = run(1234, 0)
    assert run(1234, 3) == first            # another slot, same draws
    assert len(first) == 12
    assert any(run(seed, 0) != first for seed in (1, 2, 3))


def test_mixed_step_equals_separate_prefill_and_decode(smollm2_model):
    # one decode row and one prefill row in a MIXED program give the tokens of separate steps
    separate_driver = RawLanes(smollm2_model)
    a, b = separate_driver.admit([GenerationRequest(PROMPT, 4), GenerationRequest(SECOND_PROMPT[:9], 4)], [0, 1])
    separate_driver.prefill(a)
    separate_driver.decode_round([a])
    separate_driver.prefill(b)
    expected = (a.result.tokens[-1], b.result.tokens[-1])

    driver = RawLanes(smollm2_model)
    a2, b2 = driver.admit([GenerationRequest(PROMPT, 4), GenerationRequest(SECOND_PROMPT[:9], 4)], [0, 1])
    driver.prefill(a2)
    driver.ensure_pages(a2, a2.consumed + 1)
    driver.ensure_pages(b2, 9)
    lanes = [PackedLane(slot=0, generation=a2.generation, start=a2.consumed, page_table=list(a2.pages)),
             PackedLane(slot=1, generation=b2.generation, start=0, tokens=np.asarray(SECOND_PROMPT[:9], np.int32),
                  page_table=list(b2.pages))]
    rows = driver.step(smollm2_model.program(C.OPERATION_MIXED, 2, 10), lanes)
    assert (int(rows[0][2]), int(rows[1][2])) == expected
    assert int(rows[0][3]) == len(PROMPT) + 1 and int(rows[1][3]) == 9          # consumed endpoints


def test_mixed_step_takes_several_prompts_beside_a_decode_lane(smollm2_model):  # spec: BND-6, STA-4
    # a MIXED program without a mixed prefill row feeds every row whose prompt tokens are given:
    # one decode row and two prefill rows give the tokens of separate steps
    third = SECOND_PROMPT[:6]
    separate = RawLanes(smollm2_model)
    a, b, c = separate.admit([GenerationRequest(PROMPT, 4), GenerationRequest(SECOND_PROMPT[:9], 4),
                              GenerationRequest(third, 4)], [0, 1, 2])
    separate.prefill(a)
    separate.decode_round([a])
    separate.prefill(b)
    separate.prefill(c)
    expected = (a.result.tokens[-1], b.result.tokens[-1], c.result.tokens[-1])

    prepared = prepared_in_memory(mixed_variants=((4, 24),))
    mixed = [g for g in prepared.contract.model.graphs if g.operation == C.OPERATION_MIXED]
    assert mixed and all(b.source != C.VALUE_SOURCE_MIXED_PREFILL_ROW for g in mixed for b in g.bindings)
    model = NativeModel.load(prepared.contract, prepared.manifest, resource_reader(prepared),
                             ModelOptions(cache_pages=32, concurrency=4))
    try:
        driver = RawLanes(model)
        a2, b2, c2 = driver.admit([GenerationRequest(PROMPT, 4), GenerationRequest(SECOND_PROMPT[:9], 4),
                                   GenerationRequest(third, 4)], [0, 1, 2])
        driver.prefill(a2)
        driver.ensure_pages(a2, a2.consumed + 1)
        driver.ensure_pages(b2, 9)
        driver.ensure_pages(c2, len(third))
        lanes = [PackedLane(slot=1, generation=b2.generation, start=0,
                            tokens=np.asarray(SECOND_PROMPT[:9], np.int32), page_table=list(b2.pages)),
                 PackedLane(slot=0, generation=a2.generation, start=a2.consumed, page_table=list(a2.pages)),
                 PackedLane(slot=2, generation=c2.generation, start=0, tokens=np.asarray(third, np.int32),
                            page_table=list(c2.pages))]
        rows = driver.step(model.program(C.OPERATION_MIXED, 4, 24), lanes)
        assert (int(rows[1][2]), int(rows[0][2]), int(rows[2][2])) == expected
        assert [int(rows[i][3]) for i in range(3)] == [9, len(PROMPT) + 1, len(third)]   # consumed endpoints
    finally:
        model.close()


def test_completion_records_follow_the_spec(smollm2_model):
    # spec: STA-4, BND-20 (sampled ids in the vocabulary, reserved model field -1, no draft cursor)
    driver = RawLanes(smollm2_model)
    [active] = driver.admit([GenerationRequest(PROMPT, 1)], [0])
    driver.ensure_pages(active, len(PROMPT))
    lane = PackedLane(slot=0, generation=active.generation, tokens=np.asarray(PROMPT, np.int32),
                      page_table=list(active.pages))
    program = smollm2_model.program(C.OPERATION_PREFILL, 1, len(PROMPT))
    driver.step(program, [lane], frame=1)
    words = driver.last_words
    header, row = words[:4], words[4:12]
    assert header[1] == 1 and header[2] == C.OPERATION_PREFILL               # live rows, operation
    assert 0 <= row[2] < VOCAB and row[4] == 1
    assert row[5] == 2                                                       # output limit 1 reached
    assert row[6] == -1 and row[7] == -1                                     # draft cursor, reserved model field


@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_completion_records_carry_the_log_softmax_of_the_raw_step_logits(smollm2_model, penalty):
    # issue 5 item 6: sampling.logprobs.v2 after the draw, over the raw logits (vLLM's default):
    # sampling.draw.v2 applies the penalties on the fly, so scratch.logits keeps the raw logits
    from helios_backend.kernel_abi.sampling import adjust_logits
    from helios_backend.scheduler.completion import CompletionFormat
    fmt = CompletionFormat.from_layout(smollm2_model.execution_manifest.completion)
    top = fmt.top_k
    assert top == 20 and fmt.extension_words == 1 + 2 * top
    driver = RawLanes(smollm2_model)
    sampling = SamplingParameters(repetition_penalty=penalty)
    [active] = driver.admit([GenerationRequest(PROMPT, 4, sampling=sampling)], [1])
    driver.ensure_pages(active, len(PROMPT) + 1)
    lanes = [PackedLane(slot=1, generation=active.generation, tokens=np.asarray(PROMPT, np.int32),
                        page_table=list(active.pages))]
    slot_bins = slice(VOCAB, 2 * VOCAB)                                       # slot 1's histogram row
    for program in (smollm2_model.program(C.OPERATION_PREFILL, 1, len(PROMPT)), smollm2_model.program(C.OPERATION_DECODE, 1, 1)):
        state = {name: smollm2_model.executor.read_buffer(f"state.{name}_histogram").view(np.int32)[slot_bins].copy()
                 for name in ("prompt", "output")}
        driver.step(program, lanes)
        words = driver.last_words
        raw = smollm2_model.executor.read_buffer("scratch.logits").view(np.float32)[:VOCAB].copy()
        logits = raw.astype(np.float64)
        adjusted = raw.copy()                                                 # what the draw sampled from
        adjust_logits(adjusted, sampling.vector(), state["prompt"], state["output"], np.full(VOCAB // 32, 0xFFFFFFFF, np.uint32),
                      np.array([0], np.int32), np.array([1], np.int32), 1, VOCAB, VOCAB, VOCAB // 32)
        assert np.array_equal(adjusted, raw) == (penalty == 1.0)
        expected = logits - (logits.max() + np.log(np.exp(logits - logits.max()).sum()))
        row = fmt.row_words_of(words, 1)[0]
        token = int(row[fmt.row["token"]])
        logprob = row[fmt.row["logprob"]:fmt.row["logprob"] + 1].view(np.float32)[0]
        top_ids = row[fmt.row["top_ids"]:fmt.row["top_ids"] + top]
        top_lps = row[fmt.row["top_logprobs"]:fmt.row["top_logprobs"] + top].view(np.float32)
        assert logprob <= 0 and abs(logprob - expected[token]) <= 1e-4
        assert top_ids.tolist() == sorted(range(VOCAB), key=lambda i: (-logits[i], i))[:top]
        np.testing.assert_allclose(top_lps, expected[top_ids], atol=1e-4)
        if penalty == 1.0:
            assert token == top_ids[0] and logprob == top_lps[0]              # greedy: the best alternative
        else:                                                                 # greedy over the penalized logits
            assert token == int(np.argmax(adjusted))
        lanes = [PackedLane(slot=1, generation=active.generation, start=len(PROMPT), tokens=None,
                            page_table=list(active.pages))]


# ---- load-time failures -------------------------------------------------------------------------

def test_unknown_kernel_id_is_reported_at_load():
    prepared = prepared_in_memory()
    manifest = copy.deepcopy(prepared.manifest)
    decode = next(p for p in manifest.programs if p.operation == C.OPERATION_DECODE)
    decode.nodes[4].kernel = "attention.imaginary.v7"
    with pytest.raises(UnknownKernelIdError, match="attention.imaginary.v7"):
        NumpyExecutor(manifest, resource_reader(prepared), NumpyExecutorOptions(cache_pages=4))


def test_missing_variant_is_reported_at_load():
    # spec: OWN-19
    prepared = prepared_in_memory()
    manifest = copy.deepcopy(prepared.manifest)
    del manifest.programs[-1]
    with pytest.raises(MissingVariantError):
        NativeModel.load(prepared.contract, manifest, resource_reader(prepared), ModelOptions(cache_pages=4))
    with pytest.raises(MissingVariantError):
        NumpyExecutor(manifest, resource_reader(prepared),
                      NumpyExecutorOptions(cache_pages=4, programs=frozenset({prepared.manifest.programs[-1].name})))


def test_declared_fp16_cache_also_matches_the_oracle(smollm2_bootstrap, reference_llama):
    # the executor can keep every buffer in its declared dtype (fp16 cache planes), as a device does
    model = NativeModel.load(smollm2_bootstrap.contract, smollm2_bootstrap.manifest, smollm2_bootstrap.read_resource,
                             ModelOptions(concurrency=1, cache_pages=8, widen_f16_cache=False))
    try:
        page_nbytes = next(b.nbytes for b in model.execution_manifest.buffers if b.name == "cache.k")
        assert model.executor.read_buffer("cache.k").size == 8 * page_nbytes
        logits = prefill_logits(model, PROMPT, chunk=64)[23]
        assert np.abs(logits - reference_llama.forward(PROMPT, 0)[23]).max() <= LOGIT_TOLERANCE
        assert greedy(model) == PARIS_REPLY
    finally:
        model.close()


def test_a_step_reads_no_staging_byte_outside_the_runs_it_copies(smollm2_model):
    # a step copies only its program's runs of the frame (the bytes a rank process's LAUNCH
    # carries): garbage left in the rest of a rank's staging buffer changes no token
    expected = greedy(smollm2_model)
    executor = smollm2_model.executor
    launch = executor.launch
    copied: dict[str, int] = {}

    def launch_over_garbage(program: str, frame: int) -> None:
        staging = executor.ranks[0].staging
        outside = np.ones(staging.size, dtype=bool)
        for start, nbytes in executor.staging_runs(program):
            outside[start:start + nbytes] = False
        staging[outside] = 0x7F
        copied[program] = int(staging.size - outside.sum())
        launch(program, frame)

    executor.launch = launch_over_garbage
    try:
        assert greedy(smollm2_model) == expected
    finally:
        del executor.launch
    assert "decode.r1.t1" in copied and copied["decode.r1.t1"] < executor.ranks[0].staging.size // 4


def test_concurrency_may_be_reduced_never_raised(smollm2_bootstrap):
    # spec: SRV-7, OWN-10, OWN-11, SRV-9, SRV-10
    contract, manifest = smollm2_bootstrap.contract, smollm2_bootstrap.manifest
    with pytest.raises(ModelLoadError):
        NativeModel.load(contract, manifest, smollm2_bootstrap.read_resource,
                         ModelOptions(concurrency=contract.concurrency + 1))
    with pytest.raises(ModelLoadError, match="unknown executor"):
        NativeModel.load(contract, manifest, smollm2_bootstrap.read_resource, ModelOptions(executor="abacus"))
    model = NativeModel.load(contract, manifest, smollm2_bootstrap.read_resource,
                             ModelOptions(concurrency=1, cache_pages=8))
    try:
        [geometry] = model.manifests
        assert geometry.concurrency == 1 and geometry.cache_pages == 8
        assert all(g.capacity.rows == 1 for g in model.graphs)
        assert "decode.r2.t2" not in geometry.programs and "decode.r1.t1" in geometry.programs
        assert contract.prepared_pages != 8
    finally:
        model.close()


# ---- exact-endpoint snapshots ---------------------------------------------------------------------

def test_snapshot_then_restoration_equals_recomputing_the_prefix():
    # A request's prompt ends mid-page (24 tokens, 16 per page): its step copies the partial page to a
    # continuation row. A second request sharing that prompt reuses the complete page, RESTORATION copies
    # the partial payload into its own fresh page, and it computes only its new tokens.
    # one kernel path for every step compared (docs/kernels.md, the product path)
    prepared = prepared_in_memory(product_path_tokens=0)
    model = NativeModel.load(prepared.contract, prepared.manifest, resource_reader(prepared),
                             ModelOptions(cache_pages=16, concurrency=2))
    try:
        page_tokens = prepared.contract.model.cache.page_tokens
        assert len(PROMPT) % page_tokens == 8
        longer = PROMPT + [504, 3575, 282, 4649]
        expected = prefill_logits(model, longer, chunk=64, slot=1)[len(longer) - 1]

        driver = RawLanes(model, page_order=[5, 6, 9, 10, 11, 12])
        first, second = driver.admit([GenerationRequest(PROMPT, 4), GenerationRequest(longer, 4)], [0, 1])
        driver.ensure_pages(first, len(PROMPT))                                   # pages 5, 6
        driver.step(model.program(C.OPERATION_PREFILL, 1, len(PROMPT)),
                    [PackedLane(slot=0, generation=first.generation, tokens=np.asarray(PROMPT, np.int32),
                          page_table=list(first.pages), snapshot_row=1)])
        shared_page, private_page = first.pages[0], 9
        restore = PackedLane(slot=1, generation=second.generation, start=len(PROMPT),
                       page_table=[shared_page, private_page], restore_row=1)
        [record] = driver.step(model.program(C.OPERATION_RESTORATION, 1), [restore])
        assert record[3] == len(PROMPT)                                              # consumed endpoint
        tail = np.asarray(longer[len(PROMPT):], np.int32)
        driver.step(model.program(C.OPERATION_PREFILL, 1, tail.size),
                    [PackedLane(slot=1, generation=second.generation, start=len(PROMPT), tokens=tail,
                          page_table=[shared_page, private_page])])
        restored = model.executor.buffer_view("scratch.logits", np.float32)[:VOCAB].copy()
        np.testing.assert_allclose(restored, expected, atol=RESHAPE_TOLERANCE)

        # without the restoration copy the private page lacks positions 16..23: results change
        model.packer.forget_slot(2)
        driver.step(model.program(C.OPERATION_PREFILL, 1, tail.size),
                    [PackedLane(slot=2, generation=99, start=len(PROMPT), tokens=tail, page_table=[shared_page, 10])])
        unrestored = model.executor.buffer_view("scratch.logits", np.float32)[:VOCAB]
        assert np.abs(unrestored - expected).max() > 1.0
    finally:
        model.close()


# ---- declared accesses are truthful --------------------------------------------------------------

def test_nodes_write_only_through_pointers_their_abi_declares_writable(smollm2_bootstrap):
    # spec: STA-3, STA-7 (state accesses are derived from the ABI's access marks, so the marks must hold)
    from helios_backend.kernel_abi import abi

    model = NativeModel.load(smollm2_bootstrap.contract, smollm2_bootstrap.manifest, smollm2_bootstrap.read_resource,
                             ModelOptions(concurrency=2, cache_pages=8))
    executor = model.executor
    nodes_of = {p.name: p.nodes for p in model.execution_manifest.programs}

    def run_checked(program: str, lanes) -> None:
        model.packer.pack(program, 0, lanes)
        rank = executor.ranks[0]
        rank.staging[:] = executor.staging(0)
        for (function, args), node in zip(rank.programs[program].kernel_nodes, nodes_of[program]):
            params = abi.KERNELS[node.kernel].params
            writable = [a for p, a in zip(params, args) if p.is_pointer and p.access != abi.Access.READ]
            watched = [(p.name, a, a.copy()) for p, a in zip(params, args)
                       if p.is_pointer and p.access == abi.Access.READ and a.nbytes < 64 * 2**20
                       and not any(np.shares_memory(a, w) for w in writable)]
            function(*args)
            for name, after, before in watched:
                assert np.array_equal(after, before, equal_nan=True), f"{node.kernel} wrote its READ param {name}"

    driver = RawLanes(model)
    first, second = driver.admit([GenerationRequest(PROMPT, 4), GenerationRequest(SECOND_PROMPT, 4)], [0, 1])
    from helios_backend.packing import SlotInitialization
    run_checked(model.program(C.OPERATION_INITIALIZATION, 1),
                [PackedLane(slot=0, generation=first.generation, initialization=SlotInitialization.for_prompt(
                    PROMPT, VOCAB, seed=5, sampling=SamplingParameters(0.5), output_limit=4, eos_ids=(2,)))])
    for active, prompt, row in ((first, PROMPT, 0), (second, SECOND_PROMPT, -1)):
        driver.ensure_pages(active, len(prompt) + 1)
        run_checked(model.program(C.OPERATION_PREFILL, 1, len(prompt)),
                    [PackedLane(slot=active.slot, generation=active.generation, tokens=np.asarray(prompt, np.int32),
                          page_table=list(active.pages), snapshot_row=row)])
    decode = [PackedLane(slot=a.slot, generation=a.generation, start=len(p), page_table=list(a.pages))
              for a, p in ((first, PROMPT), (second, SECOND_PROMPT))]
    run_checked(model.program(C.OPERATION_DECODE, 2, 2), decode)
    run_checked(model.program(C.OPERATION_MIXED, 2, 3),
                [PackedLane(slot=0, generation=first.generation, start=len(PROMPT) + 1, page_table=list(first.pages)),
                 PackedLane(slot=1, generation=second.generation, start=len(SECOND_PROMPT) + 1,
                      tokens=np.asarray([17, 18], np.int32), page_table=list(second.pages))])
    run_checked(model.program(C.OPERATION_RESTORATION, 1),
                [PackedLane(slot=1, generation=second.generation, start=len(PROMPT), page_table=list(second.pages),
                      restore_row=0)])
    model.close()
