"""Triton-language kernel sources, one module per job.

Every module imports only `triton` and `triton.language` (plus the CUDA extras), so the
interpreter-based conformance tests can load a module a second time in interpreter mode.
Kernels are generic: shapes and strides arrive as immediates, tile sizes as constexprs fixed
by ignition.gpu_kernels.specs.
"""
