"""The CPU executor's compilation targets (executors/cpu/isa.py) and its products on each of them.

The products run here against numpy on the weights' f32 values (kernel_abi/blocks.expand, the
f16 widened): every token count a call splits into groups of 8, 4 and 1, odd output rows, both
block layouts and f16, on this process's ISA path; with q8 activations against the integer
reference (kernel_abi/activations.py), with every integer dot product flavour the path executes. `test_every_path_the_host_runs_agrees_with_the_oracle`
reruns this file and the executor's conformance tests (test_cpu_executor.py: every program and
greedy generation against the numpy executor) in a child process per other path this host can
execute (HELIOS_CPU_ISA), so a loop only the AVX2 path compiles is checked on an AVX-512 host too.
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from helios_backend.executors.cpu import isa
from helios_backend.executors.cpu.block_products import block_linear_rows, quantize_rows
from helios_backend.executors.cpu.f16_products import linear_rows
from helios_backend.kernel_abi import activations, blocks

ROOT = pathlib.Path(__file__).resolve().parent.parent
FEATURES = {"avx2": True, "fma": True, "f16c": True, "avx512f": True, "avx512bw": True, "avx512dq": True,
            "avx512vl": True, "avx512vnni": True, "avxvnni": True, "sse4.2": True}


def test_auto_picks_the_widest_path_the_host_executes():
    assert isa.choose("auto", "znver4", FEATURES).name == "avx512"
    avx2_only = {name: on and not name.startswith(("avx512", "avxvnni")) for name, on in FEATURES.items()}
    assert isa.choose("auto", "znver3", avx2_only).name == "avx2"
    assert isa.choose("auto", "apple-m1", {"neon": True}).name == "host"
    assert isa.executable_paths(FEATURES) == ("avx512", "avx2")
    assert isa.executable_paths({"neon": True}) == ("host",)


def test_the_avx2_path_switches_off_every_wider_vector_feature():
    path = isa.choose("avx2", "znver5", FEATURES)
    flags = dict((f[1:], f[0]) for f in path.features.split(","))
    assert path.vector_bits == 256 and path.cpu_name == "znver5"
    assert flags["avx2"] == flags["fma"] == flags["f16c"] == "+"
    assert all(flags[name] == "-" for name in flags if name.startswith(("avx512", "avxvnni")))


@pytest.mark.parametrize("requested", ["avx1024", "avx512"])
def test_a_path_the_host_cannot_run_is_a_clear_error(requested):
    with pytest.raises(isa.IsaUnavailable, match=isa.ISA_VARIABLE):
        isa.choose(requested, "znver3", {"avx2": True, "fma": True, "f16c": True})


def test_numba_compiles_for_the_active_path():
    from numba.core import registry

    path = isa.active()
    assert path.name in isa.executable_paths()
    assert registry.cpu_target.target_context.codegen().magic_tuple()[1:] == (path.cpu_name, path.features)


def _quantized(layout: blocks.BlockLayout, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    data = rng.integers(0, 256, rows * k // 32 * layout.block_bytes, dtype=np.uint8).reshape(-1, layout.block_bytes)
    data[:, 0:2] = rng.uniform(0.005, 0.02, (len(data), 1)).astype(np.float16).view(np.uint8)
    if layout is blocks.Q4_1:
        data[:, 2:4] = rng.uniform(-0.1, 0.0, (len(data), 1)).astype(np.float16).view(np.uint8)
    return data.reshape(-1)


@pytest.mark.parametrize("layout", ["Q8_0", "Q4_1", "F16"])
def test_products_agree_with_numpy_for_every_token_grouping(layout):
    rng = np.random.default_rng(7)
    m, k = 13, 96               # an odd last row; 3 blocks a row
    if layout == "F16":
        weight = rng.standard_normal((m, k)).astype(np.float16)
        dense = weight.astype(np.float32)
    else:
        block_layout = blocks.BY_NAME[layout]
        data = _quantized(block_layout, m, k, rng)
        dense = blocks.expand(block_layout.dtype, data, (m, k))
    for n in (1, 3, 4, 5, 8, 9, 13, 17):   # groups of 8, 4 and 1 and their mixtures
        x = rng.standard_normal(n * k).astype(np.float32)
        out = np.full(n * m, 0.5, dtype=np.float32)
        first, last = 1, m                   # a row range not starting at 0
        if layout == "F16":
            linear_rows(out, x, weight.view(np.uint16).reshape(-1), n, k, m, True, first, last, 0)
        else:
            block_linear_rows(out, x, data, block_layout.code, n, k, m, True, first, last,
                              np.zeros(16, dtype=np.float32))
        expected = np.full((n, m), 0.5, dtype=np.float32)
        expected[:, first:last] += x.reshape(n, k) @ dense[first:last].T
        np.testing.assert_allclose(out.reshape(n, m), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max(),
                                   err_msg=f"{layout} n={n} on {isa.active().name}")


@pytest.mark.parametrize("layout", ["Q8_0", "Q4_1"])
def test_q8_products_agree_with_the_integer_reference_for_every_token_grouping(layout):
    """Activations quantized to q8 blocks (the compiled quantizer bit for bit the reference's), then
    the integer block products (vpmaddubsw / vpdpbusd / generic IR, as the path has them) against
    kernel_abi/activations.block_product bit for bit: exact integer dot products, then one order
    of f32 steps per (row, token) on every path."""
    # spec: OWN-1
    rng = np.random.default_rng(11)
    m, k = 13, 96
    block_layout = blocks.BY_NAME[layout]
    data = _quantized(block_layout, m, k, rng)
    dense = blocks.expand(block_layout.dtype, data, (m, k))
    for n in (1, 3, 4, 5, 8, 9, 13, 17):
        x = rng.standard_normal((n, k)).astype(np.float32)
        x[0, :32] = 0.0                       # a block of zeros: scale 0, quants 0
        quantized = np.zeros(n * k // 32 * activations.Q8_BLOCK_BYTES + 5, dtype=np.int8)
        quantize_rows(quantized, x.reshape(-1), n, k)
        np.testing.assert_array_equal(quantized[:-5], activations.quantize(x).reshape(-1))
        # q8 products of fewer than 4 tokens take 4 rows a pass: 3 passes and a last row, 2 passes and
        # a pair, 3 passes
        for first, last in ((0, m), (1, m - 2), (1, m)):
            out = np.full(n * m, 0.5, dtype=np.float32)
            block_linear_rows(out, quantized, data, block_layout.code, n, k, m, True, first, last,
                              np.zeros(16, dtype=np.float32))
            expected = np.full((n, m), 0.5, dtype=np.float32)
            expected[:, first:last] += activations.block_product(x, block_layout, data, m, k)[:, first:last]
            np.testing.assert_array_equal(out.reshape(n, m), expected,
                                          err_msg=f"q8 {layout} n={n} rows {first}:{last} on {isa.active().name}")
        # the q8 products are the weights times the activations' round trip, not the f32 product
        round_trip = activations.round_trip(x) @ dense[first:last].T
        np.testing.assert_allclose(out.reshape(n, m)[:, first:last] - 0.5, round_trip, rtol=1e-5,
                                   atol=1e-5 * np.abs(round_trip).max())
        assert np.abs(round_trip - x @ dense[first:last].T).max() > 1e-4 * np.abs(round_trip).max()


@pytest.mark.parametrize("flavour", ["generic", "avx2", "vnni"])
@pytest.mark.parametrize("layout", ["Q8_0", "Q4_1"])
def test_every_integer_dot_product_flavour_agrees_with_the_reference(layout, flavour):
    """The integer dot products of every flavour this host executes, compiled into a 2 x 8 pass and
    a 4 x 1 pass (one token: the rows' block sums reduced together) on this process's path (the
    generic IR is the host path's, which an x86 host never picks)."""
    # spec: OWN-1
    from numba import njit
    from numba.extending import intrinsic

    from helios_backend.executors.cpu import block_codegen

    needs = {"generic": (), "avx2": ("avx2",), "vnni": ("avx512vnni", "avx512vl")}[flavour]
    if not all(isa.active().has(feature) for feature in needs):
        pytest.skip(f"the {isa.active().name} path has no {flavour} integer dot products")
    dots = intrinsic(block_codegen._block_row_dots_intrinsic(2, 8, flavour))

    @njit
    def two_rows(data, code, row_bytes, x, stride, blocks, sums):
        dots(data, code, 0, row_bytes, x, 0, stride, blocks, sums)

    rng = np.random.default_rng(5)
    m, k, n = 2, 128, 8
    block_layout = blocks.BY_NAME[layout]
    data = _quantized(block_layout, m, k, rng)
    x = rng.standard_normal((n, k)).astype(np.float32)
    sums = np.zeros(16, dtype=np.float32)
    two_rows(data, block_layout.code, k // 32 * block_layout.block_bytes, activations.quantize(x).reshape(-1),
             k // 32 * activations.Q8_BLOCK_BYTES, k // 32, sums)
    expected = activations.block_product(x, block_layout, data, m, k)         # [n, m]
    np.testing.assert_array_equal(sums.reshape(m, n), expected.T)

    dots4 = intrinsic(block_codegen._block_row_dots_intrinsic(4, 1, flavour))

    @njit
    def four_rows(data, code, row_bytes, x, stride, blocks, sums):
        dots4(data, code, 0, row_bytes, x, 0, stride, blocks, sums)

    m = 4
    data = _quantized(block_layout, m, k, rng)
    sums[:] = 0.0
    four_rows(data, block_layout.code, k // 32 * block_layout.block_bytes, activations.quantize(x[:1]).reshape(-1),
              k // 32 * activations.Q8_BLOCK_BYTES, k // 32, sums)
    np.testing.assert_array_equal(sums[:m], activations.block_product(x[:1], block_layout, data, m, k)[0])


@pytest.mark.parametrize("layout", ["Q8_0", "Q4_1"])
def test_a_tokens_q8_product_is_the_same_bits_alone_and_in_groups_of_4_and_8(layout):
    """A (row, token) product with q8 activations does not depend on the tokens beside it: each token
    alone (a group of 1), the first 4 (a group of 4), all 8 (a group of 8), and 13 (8 + 4 + 1) give
    the same bits, so a batch, a verification step of drafted tokens or a prefill chunk computes
    a token's product as one-token decode does; the activations' blocks of a token are the same
    bits in every grouping too."""
    # spec: OWN-1
    rng = np.random.default_rng(17)
    m, k = 7, 160
    block_layout = blocks.BY_NAME[layout]
    data = _quantized(block_layout, m, k, rng)
    x = rng.standard_normal((13, k)).astype(np.float32) * rng.uniform(0.1, 10.0, (13, 1)).astype(np.float32)
    scratch = np.zeros(16, dtype=np.float32)

    def products(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n = len(rows)
        quantized = np.zeros(n * k // 32 * activations.Q8_BLOCK_BYTES, dtype=np.int8)
        quantize_rows(quantized, np.ascontiguousarray(rows).reshape(-1), n, k)
        out = np.zeros(n * m, dtype=np.float32)
        block_linear_rows(out, quantized, data, block_layout.code, n, k, m, False, 0, m, scratch)
        return out.reshape(n, m), activations.fields(quantized, n, k)[2]

    alone = [products(x[t:t + 1]) for t in range(13)]
    for n in (4, 8, 13):
        grouped, quants = products(x[:n])
        for t in range(n):
            np.testing.assert_array_equal(quants[t], alone[t][1][0])
            np.testing.assert_array_equal(grouped[t], alone[t][0][0],
                                          err_msg=f"{layout} token {t} of {n} on {isa.active().name}")
    assert len({alone[t][0].tobytes() for t in range(13)}) == 13          # the tokens' products differ


def _other_paths() -> list[str]:
    return [name for name in isa.executable_paths() if name != isa.active().name]


@pytest.mark.slow
@pytest.mark.parametrize("path", _other_paths() or [pytest.param("none", marks=pytest.mark.skip(
    reason="this host executes one ISA path only"))])
def test_every_path_the_host_runs_agrees_with_the_oracle(path):
    """This file's products and the conformance tests of the block and f16 llama stand-ins, compiled
    for `path` in a child process (numba compiles for one target a process)."""
    # spec: OWN-1
    selection = "products or flavour or (llama and (every_program or greedy))"
    done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-k", selection,
                           "tests/test_cpu_isa.py", "tests/test_cpu_executor.py"],
                          cwd=ROOT, env=dict(os.environ, **{isa.ISA_VARIABLE: path}), capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout, done.stdout[-2000:]


def test_the_cpu_benchmark_names_the_host_features_and_the_path_it_measured():
    from bench.cpu_executor import format_text, summarize

    host = {"cpu_model": "AMD EPYC", "llvm_cpu": "znver5", "executable_isa_paths": ["avx512", "avx2"],
            "features": {"avx2": True, "fma": True, "f16c": True, "avx512f": True, "neon": False}}
    rounds = [{"prefill_tokens": 512, "prefill_runs_s": [1.0], "prefill_tokens_per_s": 512.0, "threads": 2,
               "decode": {"1": {"tokens_per_s": 90.0, "runs_s": [1.0]}, "8": {"tokens_per_s": b8, "runs_s": [1.0]}},
               "rss_bytes": 2**28, "peak_rss_bytes": 2**28, "isa_path": "avx2"} for b8 in (300.0, 240.0)]
    summary = summarize(rounds, [], [1, 8], {"before": [0.1], "after": [0.2]}, host)
    assert summary["isa_path"] == "avx2" and summary["host"]["cpu_model"] == "AMD EPYC"
    assert summary["decode_b8_spread"] == pytest.approx(1.25) and summary["goals_met"]["decode_b8_spread"] is False
    text = format_text(summary, [1, 8])
    assert "AMD EPYC (LLVM znver5: avx2 fma f16c avx512f)" in text          # neon absent: not listed
    assert "the avx2 code path on this avx512 CPU, not an avx2-only machine" in text


def test_a_tokens_q8_product_in_a_prefill_is_the_one_decode_gives_it():
    """Products of more tokens than SMALL_PRODUCT_TOKENS (a prefill chunk, a mixed step) take the
    integer products too, the gate/up product tile by tile included, shared over 2 threads: each
    token's outputs are the bits that token alone (a decode step's product) gets."""
    # spec: OWN-1
    from helios_backend.executors.cpu import pointwise
    from helios_backend.executors.cpu.kernels import SMALL_PRODUCT_TOKENS, Capacity, CpuKernels

    rng = np.random.default_rng(23)
    n, k, ffn = SMALL_PRODUCT_TOKENS + 13, 96, 80
    gate_up = blocks.BlockWeight(blocks.Q4_1, _quantized(blocks.Q4_1, 2 * ffn, k, rng), 2 * ffn, k)
    square = blocks.BlockWeight(blocks.Q8_0, _quantized(blocks.Q8_0, k, k, rng), k, k)
    x = rng.standard_normal((n, k)).astype(np.float32)
    kernels = CpuKernels(Capacity(tokens=n, rows=1, width=2 * ffn, heads=1, context=16), threads=2, share_above=1,
                         activations="q8")
    try:
        many = np.zeros(n * k, dtype=np.float32)
        kernels._product(many, x.reshape(-1), square, n, k, k, False)
        gated = np.zeros(n * ffn, dtype=np.float32)
        kernels._gate_up_tiles(gated, x.reshape(-1), gate_up, n, k, ffn)
        for t in range(n):
            alone = np.zeros(k, dtype=np.float32)
            kernels._product(alone, x[t], square, 1, k, k, False)
            np.testing.assert_array_equal(many[t * k:(t + 1) * k], alone, err_msg=f"token {t} on {isa.active().name}")
            projected = np.zeros(2 * ffn, dtype=np.float32)
            kernels._product(projected, x[t], gate_up, 1, k, 2 * ffn, False)
            decoded = np.zeros(ffn, dtype=np.float32)
            pointwise.silu_gate(decoded, projected, 1, ffn, ffn, 0)
            np.testing.assert_array_equal(gated[t * ffn:(t + 1) * ffn], decoded, err_msg=f"gate of token {t}")
    finally:
        kernels.close()
