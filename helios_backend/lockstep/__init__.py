"""The lockstep generator: admit, prefill, decode all lanes together (CLI, benchmarks, tests)."""
