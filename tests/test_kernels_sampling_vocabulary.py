"""The sampling kernels have no vocabulary ceiling: past BLOCK_V * MAX_CHUNKS tokens the
one-program kernels (sampling.draw.v1, sampling.logprobs.v1, and verify_commit through the same
draw) let each of their MAX_CHUNKS chunk maxima cover several chunks, and the finishing program
of the multi-program kernels (sampling.draw.v2, sampling.logprobs.v2) reads the chunk records
MAX_CHUNKS at a time, merging their candidate keys.

The geometry is checked with the table's tiles at the vocabularies of the real models (151,936
and 262,144 tokens). The arithmetic runs in Triton's interpreter with tiles shrunk so that a few
thousand tokens already need several maxima per entry and several record blocks (the same code
paths a 262,144-token row takes with the table's tiles, at a small fraction of the CPU time).
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("triton")

from helios_backend.kernel_abi import abi  # noqa: E402
from ignition.gpu_kernels.specs import KERNEL_SPECS  # noqa: E402
from tests.test_gpu_kernels_sampling import (BISECTION, DRAW_SETTINGS, GREEDY, PREFIX,  # noqa: E402
                                                _draw_case, _logprobs_case, check_draw)
from tests.test_gpu_kernels import _logprobs_case as _logprobs_v1_case  # noqa: E402
from tests.test_gpu_kernels import (InterpreterRunner, _sampling_rows,  # noqa: E402
                                       check_against_reference, interpreter, library)

RNG = np.random.default_rng(151936)

# 256-token chunks, 2 maxima / 2 records per block: vocab 1,280 = 5 chunks = 3 record blocks
# (draw.v2 keeps 2 x 32 candidate keys), and 3 chunks per maximum in the one-program kernels
SMALL_TILES = {
    "sampling.draw.v1": {"BLOCK_V": 256, "MAX_CHUNKS": 2},
    "sampling.logprobs.v1": {"BLOCK_V": 256, "MAX_CHUNKS": 2},
    "sampling.draw.v2": {"BLOCK_V": 256, "MAX_CHUNKS": 2},
    "sampling.logprobs.v2": {"BLOCK_V": 256, "MAX_CHUNKS": 2},
}
VOCAB = 1280 + 48                  # 6 chunks, the last one partial


@pytest.fixture(scope="module")
def runner(library, interpreter) -> InterpreterRunner:
    return InterpreterRunner(library, interpreter, SMALL_TILES)


def _immediates(vocab: int) -> dict[str, int]:
    return {"rows": 8, "tokens": 8, "vocab": vocab, "histogram_bins": vocab,
            "mask_words": -(-vocab // 32), "top_n": 20, "record_base": 0, "dim": 896,
            "eos_capacity": 8, "page_stride": 4096, "row_stride": 4096}


@pytest.mark.parametrize("vocab", [151_936, 262_144, 1 << 20])
def test_every_vocabulary_kernel_has_a_geometry_for_large_vocabularies(library, vocab):
    """The table's tiles accept the vocabularies of qwen2 and gemma3 (and beyond): no kernel
    that takes `vocab` refuses it."""
    values = _immediates(vocab)
    checked = []
    for spec in KERNEL_SPECS:
        params = abi.kernel(spec.kernel_id).params if spec.kernel_id in abi.KERNELS else ()
        if "vocab" not in {p.name for p in params}:
            continue
        args = [0 if p.is_pointer else values.get(p.name, 16) for p in params]
        grid, _, _ = library.geometry(spec.kernel_id, args)
        assert all(d >= 1 for d in grid)
        checked.append(spec.kernel_id)
    assert {"sampling.draw.v1", "sampling.draw.v2", "sampling.logprobs.v1", "sampling.logprobs.v2",
            "speculative.verify_commit.v1"} <= set(checked)


def _peaked(rows: int, vocab: int) -> np.ndarray:
    """Rows whose likely tokens sit in one chunk, spread over the row, or tie across entries."""
    logits = RNG.standard_normal((rows, vocab)).astype(np.float32)
    for r in range(rows):
        if r % 3 == 0:
            head = RNG.integers(0, vocab - 64)
            logits[r, head:head + 64] += 6 * RNG.random(64).astype(np.float32)
        elif r % 3 == 1:
            logits[r, RNG.integers(0, vocab, 40)] += 4 + 4 * RNG.random(40).astype(np.float32)
        else:
            logits[r, [5, 700, vocab - 3]] = logits[r].max() + 0.5       # first, third, last entry
    return logits


@pytest.mark.parametrize("temperature, top_p, top_k, min_p", [DRAW_SETTINGS[i] for i in (0, 2, 4)])
def test_draw_v1_with_several_chunks_per_maximum_matches_the_reference(runner, temperature, top_p,
                                                                      top_k, min_p):
    rows = 6
    out = check_against_reference(runner, "sampling.draw.v1", {
        "sampled": np.full(rows, -9, np.int32), "logits": _peaked(rows, VOCAB),
        "sampling": _sampling_rows([(temperature, top_p, top_k, min_p, 0, 0, 1)] * rows),
        "seeds": RNG.integers(0, 2**32, (rows, 2), dtype=np.uint64).astype(np.uint32),
        "generated": RNG.integers(0, 1000, rows).astype(np.int32),
        "row_slot": np.arange(rows, dtype=np.int32), "sample_flag": np.ones(rows, np.int32)},
        {"rows": rows, "vocab": VOCAB})
    assert (out["sampled"] >= 0).all()


def test_logprobs_v1_with_several_chunks_per_maximum_matches_the_reference(runner):
    """Top-20 over maxima covering 3 chunks each: ids exactly, logprobs to 1e-5 (ties inside one
    entry and across entries)."""
    rows, top_n = 5, 20
    logits = _peaked(rows, VOCAB)
    logits[4, [10, 300, 600, 900]] = 7.0                  # a 4-way tie, chunks 0..3 (entries 0, 1)
    _logprobs_v1_case(runner, logits, RNG.integers(0, VOCAB, rows).astype(np.int32),
                      np.ones(rows, np.int32), top_n)


@pytest.mark.parametrize("temperature, top_p, top_k, min_p", [DRAW_SETTINGS[i] for i in (0, 1, 3, 6)])
def test_draw_v2_over_several_record_blocks_matches_the_reference(runner, temperature, top_p, top_k,
                                                                   min_p):
    """6 chunk records read 2 at a time; greedy ties across blocks take the lowest id; the
    merged candidate prefix draws token for token with the reference, or bisects."""
    rows = 6
    buffers, immediates = _draw_case(_peaked(rows, VOCAB), [(temperature, top_p, top_k, min_p)] * rows)
    for tokens, paths in check_draw(runner, buffers, immediates, launches=1):
        assert (tokens >= 0).all()
        assert set(paths) <= ({GREEDY} if temperature == 0 else {PREFIX, BISECTION})


def test_draw_v2_resolves_peaked_rows_on_the_merged_prefix(runner):
    """Peaked rows (24 likely tokens spread over every block): the merged 64-key prefix holds
    them, so every draw resolves there, token for token with the reference."""
    rows = 6
    logits = RNG.standard_normal((rows, VOCAB)).astype(np.float32)
    for r in range(rows):
        logits[r, RNG.choice(VOCAB, 24, replace=False)] += 12 + RNG.random(24).astype(np.float32)
    buffers, immediates = _draw_case(logits, [(0.8, 1.0, 0, 0.0), (1.0, 0.9, 0, 0.0)] * (rows // 2),
                                     generated=np.arange(rows, dtype=np.int32) * 5)
    for tokens, paths in check_draw(runner, buffers, immediates):
        assert len(set(tokens.tolist())) > 3
        assert (paths == PREFIX).all()


def test_logprobs_v2_over_several_record_blocks_matches_the_reference(runner):
    rows, top_n = 4, 20
    logits = _peaked(rows, VOCAB) * 2
    _logprobs_case(runner, logits, RNG.integers(0, VOCAB, rows).astype(np.int32),
                   np.ones(rows, np.int32), top_n, np.zeros(rows, np.float32), launches=1)
