"""Pieces of the CUDA executor: driver access, launch plans, the device arena, graphs, NCCL.

Only `plan` is importable without cuda-bindings; the others import the driver lazily
through `driver.load_driver()` so that CPU machines can import this package.
"""
