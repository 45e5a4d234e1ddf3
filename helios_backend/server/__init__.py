"""Serving through Triton: the launcher, the backend model adapter, the worker,
the response and metrics threads, and the transport tensors (docs/triton-backend.md)."""
