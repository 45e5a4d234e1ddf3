"""The product path's launch plans: product nodes become cuBLASLt calls of the right shape (CPU, no driver).

The calls themselves run on the GPU (tests/gpu/conformance.py compares every program, product
nodes served by cuBLASLt included, with the numpy executor); here the plan is checked: which
nodes become library products, their M / K / N and addresses, and the column-major descriptors
VendorProducts derives from them (recorded through a stand-in of the bindings' call surface).
"""
from __future__ import annotations

import ctypes
import types

import numpy as np
import pytest
from helios_proto import manifest_pb2 as M

from helios_backend.executors.cuda.graphs import RankResources, record_launches
from helios_backend.executors.cuda.plan import BufferAddresses, KernelLaunch, kernel_table, layout_arena, plan_program
from helios_backend.executors.cuda.vendor_products import (CUBLAS_OP_N, CUBLAS_OP_T, CUDA_R_16F, CUDA_R_32F,
                                                           VENDOR_PRODUCTS, ProductLaunch, VendorProducts)
from helios_backend.kernel_abi import abi
from ignition.preparation.prepare import prepare
from ignition.recipes.hf_layout import recipe_for_layout
from tests.test_hf_layout import tiny_config, tiny_layout_options


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    import json
    path = tmp_path_factory.mktemp("layout") / "tiny-llama.json"
    path.write_text(json.dumps(tiny_config("llama")))
    recipe = recipe_for_layout(path)
    return prepare(recipe, tiny_layout_options(recipe, product_path_tokens=9))


def _plans(prepared, vendor: bool):
    kernels = [M.Kernel(id=k, symbol=k, params=[p.kind for p in spec.params], num_warps=4)
               for k, spec in abi.KERNELS.items()]
    table = kernel_table([M.KernelModule(resource="abi", kernels=kernels)])
    layout = layout_arena(prepared.manifest.buffers, 0)
    addresses = {name: (1 << 40) + offset for name, offset in layout.offsets.items()}
    nbytes = {name: int(layout.buffers[name].nbytes) for name in layout.offsets}
    for i, (name, page) in enumerate(layout.cache_page_nbytes.items()):
        addresses[name], nbytes[name] = (1 << 40) + (1 << 32) * (i + 1), page * 64
    plans = {}
    for program in prepared.manifest.programs:
        for node in program.nodes:
            node.block.x = 0
        plans[program.name] = plan_program(program, table, BufferAddresses(addresses, nbytes), vendor)
    return plans, addresses


def test_product_nodes_become_library_products_only_when_asked(prepared):
    with_library, addresses = _plans(prepared, True)
    cubins, _ = _plans(prepared, False)
    products = [l for launches in with_library.values() for l in launches if isinstance(l, ProductLaunch)]
    assert {p.kernel_id for p in products} == {"linear.product_f16.v1", "linear.product_f32.v1", "linear.residual_f16.v1"}
    assert not any(isinstance(l, ProductLaunch) for launches in cubins.values() for l in launches)
    for name, launches in with_library.items():
        assert len(launches) == len(cubins[name])
        for library, cubin in zip(launches, cubins[name]):
            assert isinstance(cubin, KernelLaunch)
            assert isinstance(library, ProductLaunch) == (cubin.kernel_id in VENDOR_PRODUCTS)
    shape = tiny_config("llama")
    down = next(p for p in products if p.label.endswith(".down"))
    assert (down.in_dim, down.out_dim) == (shape["intermediate_size"], shape["hidden_size"])
    assert down.tokens >= 9 and down.out == addresses["scratch.hidden"]
    assert down.x == addresses["scratch.activations_f16"] and down.weight == addresses["weights.layers.0.ffn_down"]


class _Bindings:
    """The nvmath cublasLt call surface VendorProducts uses, recording what it is given."""

    def __init__(self) -> None:
        self.layouts: dict[int, tuple[int, int, int, int]] = {}
        self.attributes: dict[tuple[int, int], int] = {}
        self.calls: list[tuple] = []
        self.MatmulDescAttribute = types.SimpleNamespace(TRANSA=3, TRANSB=4)
        self.MatmulPreferenceAttribute = types.SimpleNamespace(MAX_WORKSPACE_BYTES=1)

    def create(self): return 11
    def matmul_preference_create(self): return 12
    def matmul_preference_set_attribute(self, *args): pass
    def matmul_desc_create(self, compute, scale): return 100 + len(self.attributes)
    def get_version(self): return 130000
    def matrix_layout_destroy(self, layout): self.layouts.pop(layout)
    def matmul_desc_destroy(self, desc): pass
    def matmul_preference_destroy(self, preference): pass
    def destroy(self, handle): pass

    def matmul_desc_set_attribute(self, desc, attribute, pointer, size):
        self.attributes[(desc, attribute)] = (ctypes.c_int32 * 1).from_address(pointer)[0]

    def matrix_layout_create(self, dtype, rows, cols, ld):
        handle = 1000 + len(self.layouts)
        self.layouts[handle] = (dtype, rows, cols, ld)
        return handle

    def MatmulHeuristicResult(self, size):
        return types.SimpleNamespace(ptr=77)

    def matmul_algo_get_heuristic(self, *args):
        found = args[-1]
        (ctypes.c_int32 * 1).from_address(found)[0] = 1

    def matmul(self, *args):
        alpha = (ctypes.c_float * 1).from_address(args[2])[0]
        beta = (ctypes.c_float * 1).from_address(args[7])[0]
        self.calls.append(args + (alpha, beta))


class _Driver:
    CUevent_record_flags = types.SimpleNamespace(CU_EVENT_RECORD_EXTERNAL=1)

    def cuMemAlloc(self, nbytes): return (0, 1 << 30)
    def cuMemFree(self, pointer): return (0,)


def test_vendor_products_describe_the_row_major_product_column_major(prepared):
    launches, _ = _plans(prepared, True)
    bindings = _Bindings()
    products = VendorProducts(bindings, _Driver())
    program = next(l for l in launches.values() if any(isinstance(x, ProductLaunch) for x in l))
    record_launches(_Driver(), RankResources(stream=5, functions={}, products=products),
                    [l for l in program if isinstance(l, ProductLaunch)])
    assert bindings.calls
    for call in bindings.calls:
        desc, weight, a, x, b, out_c, c, out_d, d, stream = (call[1], call[3], call[4], call[5], call[6], call[8],
                                                            call[9], call[10], call[11], call[15])
        alpha, beta = call[-2:]
        launch = next(l for l in program if isinstance(l, ProductLaunch) and l.weight == weight and l.x == x)
        m, k, n = launch.tokens, launch.in_dim, launch.out_dim
        out_type = CUDA_R_16F if launch.kernel_id == "linear.product_f16.v1" else CUDA_R_32F
        assert bindings.layouts[a] == (CUDA_R_16F, k, n, k)          # W [N, K] row-major = K x N, transposed
        assert bindings.layouts[b] == (CUDA_R_16F, k, m, k)          # x [M, K] row-major = K x M
        assert bindings.layouts[c] == (out_type, n, m, n) and c == d
        assert out_c == out_d == launch.out and stream == 5
        assert bindings.attributes[(desc, 3)] == CUBLAS_OP_T and bindings.attributes[(desc, 4)] == CUBLAS_OP_N
        assert (alpha, beta) == (1.0, 1.0 if launch.kernel_id == "linear.residual_f16.v1" else 0.0)
    assert products.version() == 130000
    products.close()
    assert bindings.layouts == {}         # every layout destroyed


@pytest.mark.gpu
@pytest.mark.parametrize("kernel_id", sorted(VENDOR_PRODUCTS))
def test_cublaslt_products_equal_the_numpy_references_on_the_gpu(kernel_id):
    """The real library on a real device (skipped elsewhere): each product id through
    VendorProducts against its numpy reference, 70 tokens of which 45 live (zero rows past them)."""
    pytest.importorskip("cuda.bindings")
    pytest.importorskip("nvmath.bindings.cublasLt")
    from helios_backend.executors.cuda.driver import check, load_driver
    from helios_backend.kernel_abi.state import geometry_words, step_geometry

    d = load_driver()
    check(d.cuInit(0), "cuInit")
    check(d.cuCtxSetCurrent(check(d.cuDevicePrimaryCtxRetain(check(d.cuDeviceGet(0), "cuDeviceGet")),
                                  "retain")), "cuCtxSetCurrent")
    products = VendorProducts.load(d)
    assert products is not None
    rng = np.random.default_rng(3)
    tokens, live, k, n = 70, 45, 192, 320
    x = rng.standard_normal((tokens, k)).astype(np.float16)
    x[live:] = 0
    weight = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float16)
    out_dtype = np.float16 if kernel_id == "linear.product_f16.v1" else np.float32
    out = rng.standard_normal((tokens, n)).astype(out_dtype)
    geometry = np.zeros(geometry_words(1, tokens), np.int32)
    step_geometry(geometry, np.array([live], np.int32), 1, tokens)
    arrays = {"out": out, "x": x, "weight": weight}
    device = {name: check(d.cuMemAlloc(a.nbytes), "cuMemAlloc") for name, a in arrays.items()}
    stream = check(d.cuStreamCreate(0), "cuStreamCreate")
    try:
        for name, a in arrays.items():
            check(d.cuMemcpyHtoD(device[name], a.ctypes.data, a.nbytes), "cuMemcpyHtoD")
        launch = ProductLaunch(kernel_id, "test", int(device["out"]), int(device["x"]), int(device["weight"]),
                               tokens, k, n)
        products.record(launch, stream)
        check(d.cuStreamSynchronize(stream), "cuStreamSynchronize")
        got = np.empty_like(out)
        check(d.cuMemcpyDtoH(got.ctypes.data, device["out"], got.nbytes), "cuMemcpyDtoH")
    finally:
        for pointer in device.values():
            d.cuMemFree(pointer)
        d.cuStreamDestroy(stream)
        products.close()
    expected = out.copy().reshape(-1)
    abi.kernel(kernel_id).reference(expected, x.reshape(-1), weight.reshape(-1), geometry, tokens, k, n)
    np.testing.assert_allclose(got.reshape(-1).astype(np.float32), expected.astype(np.float32), atol=2e-2, rtol=1e-2)
