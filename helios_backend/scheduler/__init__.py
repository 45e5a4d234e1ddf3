"""The scheduler: request slots, pages, prefix reuse, snapshots and the token-budget loop.

Plain Python, executor-agnostic: it produces RoundPlans and consumes validated
completion rows. Invariants and drawings: docs/scheduler.md.
"""
