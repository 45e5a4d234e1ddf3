"""Kernel ABI table (abi.py) and the numpy reference kernels, one module per concern."""
