"""Synchronous generation on a loaded model: whole requests through the serving Scheduler and
ProgramRunner (generator.py), hand-built lanes for the oracle tests (raw_lanes.py), speculative
rounds (speculative.py). The CLI, the benchmarks and the tests use it."""
