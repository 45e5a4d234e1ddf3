"""Vendor products: the product path's ids served through cuBLASLt (nvmath-python's bindings).

The product path (helios_backend/kernel_abi/products.py) records a large step's layer projections
as plain f16 products. cuBLASLt computes exactly that at its best on every NVIDIA architecture,
so where it loads the executor records these nodes as cuBLASLt calls instead of the prepared
cubins; the cubins stay the portable path (`CudaExecutorOptions.vendor_products = False`, or no
nvmath-python / libcublasLt on the machine).

Startup only, per rank: one cuBLASLt handle and one workspace; per distinct product shape a
matmul descriptor, four matrix layouts and the first algorithm of cuBLASLt's heuristic for that
exact shape, chosen outside capture and pinned (the host scalars alpha and beta live as long as
the executor). Graph capture then records each call like a kernel launch; serving replays it.

Row-major out [M, N] = x [M, K] @ W [N, K]^T is cuBLASLt's column-major D = op(A) B with A = W
seen as a K x N matrix (ld K) and op = transpose, B = x seen as K x M (ld K) and D = out seen as
N x M (ld N): the "TN" product every library tunes first. A library
product runs over the whole token capacity M; rows past the live count are zero activations
(products.py), so they yield zero products and add zero to the residual.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping, Optional

import numpy as np

from .driver import check

WORKSPACE_NBYTES = 32 << 20      # cuBLASLt's recommended workspace on Hopper and Blackwell
CUDA_R_32F, CUDA_R_16F = 0, 2    # cudaDataType_t
CUBLAS_COMPUTE_32F = 68          # cublasComputeType_t
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1  # cublasOperation_t


@dataclasses.dataclass(frozen=True)
class ProductKind:
    out_f16: bool        # D (and C) f16, else f32
    accumulate: bool     # D = C + product with C = D (the residual), else D = product


# the product path's ids a library serves; every other id (and these without a library) runs its cubin
VENDOR_PRODUCTS: Mapping[str, ProductKind] = {
    "linear.product_f16.v1": ProductKind(out_f16=True, accumulate=False),
    "linear.product_f32.v1": ProductKind(out_f16=False, accumulate=False),
    "linear.residual_f16.v1": ProductKind(out_f16=False, accumulate=True),
}


@dataclasses.dataclass(frozen=True)
class ProductLaunch:
    """One recorded product node resolved to device addresses (ABI order: out, x, weight, geometry,
    tokens, in_dim, out_dim); the executor records it through `VendorProducts.record`."""
    kernel_id: str
    label: str
    out: int
    x: int
    weight: int
    tokens: int          # M: the step's token capacity
    in_dim: int          # K
    out_dim: int         # N

    @property
    def kind(self) -> ProductKind:
        return VENDOR_PRODUCTS[self.kernel_id]


@dataclasses.dataclass
class _Plan:
    """Everything one product shape needs at capture: descriptors, layouts, the pinned algorithm."""
    desc: int
    layouts: tuple[int, int, int]    # A (weight), B (x), C = D (out)
    heuristic: Any                   # MatmulHeuristicResult: its first field is the algorithm
    alpha: np.ndarray
    beta: np.ndarray


class VendorProducts:
    """cuBLASLt for one rank (its context current when created and when recording)."""

    def __init__(self, lt: Any, driver: Any) -> None:
        self._lt, self._d = lt, driver
        self._handle = int(lt.create())
        self.workspace = int(check(driver.cuMemAlloc(WORKSPACE_NBYTES), "cuMemAlloc cuBLASLt workspace"))
        self._plans: dict[tuple[str, int, int, int], _Plan] = {}
        self._preference = int(lt.matmul_preference_create())
        size = np.array([WORKSPACE_NBYTES], dtype=np.uint64)
        lt.matmul_preference_set_attribute(self._preference, lt.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES,
                                           size.ctypes.data, size.nbytes)

    @classmethod
    def load(cls, driver: Any) -> Optional["VendorProducts"]:
        """The library for the current context, or None where nvmath-python or libcublasLt is missing
        (the product ids then run their cubins)."""
        try:
            from nvmath.bindings import cublasLt as lt
            return cls(lt, driver)
        except Exception as error:  # ImportError, or the loader's own error when libcublasLt is absent
            # the portable path still serves; say why the library did not, once, at startup
            logging.getLogger(__name__).warning("product path on its cubins: cuBLASLt unavailable (%s)", error)
            return None

    def version(self) -> int:
        return int(self._lt.get_version())

    def plan(self, launch: ProductLaunch) -> _Plan:
        """Descriptors and the heuristic's algorithm for this shape (startup: outside capture)."""
        key = (launch.kernel_id, launch.tokens, launch.in_dim, launch.out_dim)
        found = self._plans.get(key)
        if found is not None:
            return found
        lt = self._lt
        kind = launch.kind
        out_type = CUDA_R_16F if kind.out_f16 else CUDA_R_32F
        desc = int(lt.matmul_desc_create(CUBLAS_COMPUTE_32F, CUDA_R_32F))
        for attribute, value in ((lt.MatmulDescAttribute.TRANSA, CUBLAS_OP_T),
                                 (lt.MatmulDescAttribute.TRANSB, CUBLAS_OP_N)):
            word = np.array([value], dtype=np.int32)
            lt.matmul_desc_set_attribute(desc, attribute, word.ctypes.data, word.nbytes)
        m, k, n = launch.tokens, launch.in_dim, launch.out_dim
        layouts = (int(lt.matrix_layout_create(CUDA_R_16F, k, n, k)),
                   int(lt.matrix_layout_create(CUDA_R_16F, k, m, k)),
                   int(lt.matrix_layout_create(out_type, n, m, n)))
        heuristic = lt.MatmulHeuristicResult(1)
        found_count = np.zeros(1, dtype=np.int32)
        lt.matmul_algo_get_heuristic(self._handle, desc, layouts[0], layouts[1], layouts[2], layouts[2],
                                     self._preference, 1, heuristic.ptr, found_count.ctypes.data)
        if int(found_count[0]) < 1:
            raise RuntimeError(f"cuBLASLt has no algorithm for {launch.label} ({m} x {k} x {n})")
        plan = _Plan(desc, layouts, heuristic, np.array([1.0], dtype=np.float32),
                     np.array([1.0 if kind.accumulate else 0.0], dtype=np.float32))
        self._plans[key] = plan
        return plan

    def record(self, launch: ProductLaunch, stream: Any) -> None:
        """Issue the product on `stream` (capturing: it becomes the graph's node)."""
        plan = self.plan(launch)
        a, b, c = plan.layouts
        self._lt.matmul(self._handle, plan.desc, plan.alpha.ctypes.data, launch.weight, a, launch.x, b,
                        plan.beta.ctypes.data, launch.out, c, launch.out, c, plan.heuristic.ptr,
                        self.workspace, WORKSPACE_NBYTES, int(stream))

    def close(self) -> None:
        lt = self._lt
        for plan in self._plans.values():
            for layout in plan.layouts:
                lt.matrix_layout_destroy(layout)
            lt.matmul_desc_destroy(plan.desc)
        self._plans.clear()
        if self._preference:
            lt.matmul_preference_destroy(self._preference)
            self._preference = 0
        if self._handle:
            lt.destroy(self._handle)
            self._handle = 0
        if self.workspace:
            self._d.cuMemFree(self.workspace)
            self.workspace = 0
