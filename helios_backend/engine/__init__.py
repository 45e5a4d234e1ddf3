"""The serving engine: bootstrap and model loading, the per-step loop, the program runner,
response delivery and backend metrics (docs/architecture.md). Nothing here knows Triton."""
