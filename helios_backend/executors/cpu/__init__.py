"""The CPU executor's compiled (numba) primitives and the Python that drives them.

Weights stay in their declared layout: F16 row-major [out, in] passed as uint16 bits and widened
in registers, block weights (Q8_0 / Q4_1) read in place. Nothing streams an f32 copy of a weight
per step: a decode step reads each weight byte once. Every primitive is serial and releases the
GIL; the products take a range of output rows and attention a range of (token, kv head) pairs, so
kernels.py shares one call's ranges over threads. Every function writes into arrays it is given,
so the hot path allocates nothing. The primitives mirror kernel_abi/ references (the conformance
oracle); only the summation order differs.

Importing this package fixes the instruction set the primitives are compiled for (isa.py:
HELIOS_CPU_ISA, else the widest the host runs), before anything compiles.

Layers, each module one job (lower ones first):
    isa.py                the compilation target (AVX-512, AVX2, the host's), chosen once per process
    codegen.py            LLVM IR building blocks (element addresses, FMA, splats, horizontal sums)
    elements.py           f16 <-> f32 element conversions, accumulate-or-store, a vectorizable exp
    claiming.py           atomics, GIL-free waiting, the chunk-claiming loop of a shared call
    block_codegen.py      vector code for 32-weight blocks (Q8_0 / Q4_1)
    attention_codegen.py  vector code for one head's dot products and weighted sums
    f16_products.py       products over F16 weights
    block_products.py     products, expansion and gather over block weights
    pointwise.py          RMS norm, embedding gather, SiLU gate, RoPE and the cache store, f16 <-> f32
    attention.py          paged attention per (token, kv head) pair
    warm_up.py            compile or load every primitive at load
    sharing.py            WorkSharing: helper threads that share a call's chunks
    kernels.py            CpuKernels: the ABI's kernel ids over the primitives and one workspace
    residency.py          what the load leaves resident (LLVM's code pages, the C heap)
"""
from helios_backend.executors.cpu import isa

isa.activate()
