"""The prepared capacity variants, resolved once at startup, and the choice per round.

Per operation, variants are sorted by (tokens, rows); a round takes the smallest one
that holds its lanes. Which operation runs a round follows from the lanes' shape only:

    every lane a one-token decode            -> DECODE
    decode lanes + exactly one longer chunk  -> MIXED   (when prepared)
    otherwise                                -> PREFILL (decode lanes feed their token)
"""
from __future__ import annotations

from collections.abc import Iterable

from helios_proto import contract_pb2 as cp

from helios_backend.scheduler.errors import ConfigurationError
from helios_backend.scheduler.plan import Variant

MAIN_OPERATIONS = (cp.OPERATION_DECODE, cp.OPERATION_PREFILL, cp.OPERATION_MIXED)


class VariantTable:
    def __init__(self, variants: Iterable[Variant]) -> None:
        self._by_op: dict[int, list[Variant]] = {}
        for v in variants:
            tokens = v.tokens or v.rows  # a decode variant may leave tokens implicit: one per row
            if v.rows <= 0:
                raise ConfigurationError(f"program {v.program!r} has no request rows")
            self._by_op.setdefault(v.operation, []).append(
                Variant(v.operation, v.program, v.rows, tokens))
        for vs in self._by_op.values():
            vs.sort(key=lambda v: (v.tokens, v.rows))
        if cp.OPERATION_PREFILL not in self._by_op:
            raise ConfigurationError("no PREFILL program: prompts cannot be consumed")

    @classmethod
    def from_graphs(cls, graphs: Iterable[cp.GraphContract], rank: int = 0) -> "VariantTable":
        """Rank 0's graphs: every rank replays the same variant set."""
        return cls(Variant(g.operation, g.program, g.capacity.rows, g.capacity.tokens)
                   for g in graphs if g.rank == rank)

    def has(self, operation: "cp.Operation.ValueType") -> bool:
        return operation in self._by_op

    def variants(self, operation: "cp.Operation.ValueType") -> list[Variant]:
        return list(self._by_op.get(operation, ()))

    def max_rows(self, operation: "cp.Operation.ValueType") -> int:
        return max((v.rows for v in self._by_op.get(operation, ())), default=0)

    def max_tokens(self, operation: "cp.Operation.ValueType") -> int:
        return max((v.tokens for v in self._by_op.get(operation, ())), default=0)

    @property
    def main_rows(self) -> int:
        return max(self.max_rows(op) for op in MAIN_OPERATIONS)

    @property
    def main_tokens(self) -> int:
        return max(self.max_tokens(op) for op in MAIN_OPERATIONS)

    def fit(self, operation: "cp.Operation.ValueType", rows: int, tokens: int) -> Variant | None:
        for v in self._by_op.get(operation, ()):
            if v.rows >= rows and v.tokens >= tokens:
                return v
        return None

    def operation_for(self, query_lens: list[int]) -> "cp.Operation.ValueType":
        """The operation a round of lanes with these query lengths runs."""
        longer = sum(1 for q in query_lens if q > 1)
        if longer == 0 and self.has(cp.OPERATION_DECODE):
            return cp.OPERATION_DECODE
        if longer == 1 and len(query_lens) > 1 and self.has(cp.OPERATION_MIXED):
            return cp.OPERATION_MIXED
        return cp.OPERATION_PREFILL

    def choose(self, query_lens: list[int]) -> Variant | None:
        """The smallest variant of the right operation holding these lanes, or None."""
        op = self.operation_for(query_lens)
        fit = self.fit(op, len(query_lens), sum(query_lens))
        if fit is None and op != cp.OPERATION_PREFILL:
            fit = self.fit(cp.OPERATION_PREFILL, len(query_lens), sum(query_lens))
        return fit
