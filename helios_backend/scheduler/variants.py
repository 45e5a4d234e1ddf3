"""The prepared capacity variants, resolved once at startup, and the choice per round.

Per operation, variants are sorted by (tokens, rows); a round takes the smallest one
that holds its lanes. Which operation runs a round follows from the lanes' shape only.
A lane is "pending" when it is a one-token decode whose input is the slot's
device-owned pending token (the token its previous round sampled, STA-4):

    every lane pending                          -> DECODE
    pending lanes + host-fed lanes              -> MIXED   (when prepared and it takes that
                                                            many host-fed lanes: one where the
                                                            program binds a mixed prefill row,
                                                            any where its prompt tokens' padding
                                                            marks the pending lanes)
    otherwise                                   -> PREFILL (every token host-fed: decode
                                                            lanes feed their last token)
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
                Variant(v.operation, v.program, v.rows, tokens, _host_fed_rows(v)))
        for vs in self._by_op.values():
            vs.sort(key=lambda v: (v.tokens, v.rows))
        if cp.OPERATION_PREFILL not in self._by_op:
            raise ConfigurationError("no PREFILL program: prompts cannot be consumed")
        self.main_variants = tuple(v for op in MAIN_OPERATIONS for v in self._by_op.get(op, ()))

    @classmethod
    def from_graphs(cls, graphs: Iterable[cp.GraphContract], rank: int = 0) -> "VariantTable":
        """Rank 0's graphs: every rank replays the same variant set."""
        return cls(Variant(g.operation, g.program, g.capacity.rows, g.capacity.tokens, _graph_host_fed_rows(g))
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

    def mixed_host_fed_rows(self) -> int:
        """The most host-fed lanes one MIXED round takes (0: no MIXED program)."""
        return max((v.host_fed_rows for v in self._by_op.get(cp.OPERATION_MIXED, ())), default=0)

    def fit(self, operation: "cp.Operation.ValueType", rows: int, tokens: int,
            host_fed: int = 0) -> Variant | None:
        for v in self._by_op.get(operation, ()):
            if v.rows >= rows and v.tokens >= tokens and v.host_fed_rows >= host_fed:
                return v
        return None

    def choose_shape(self, rows: int, tokens: int, host_fed: int) -> Variant | None:
        """The smallest variant of the right operation holding a round of these aggregates
        (rows, packed tokens, host-fed lanes), or None (falling back to PREFILL, where every
        lane is host-fed)."""
        if host_fed == 0 and self.has(cp.OPERATION_DECODE):
            op = cp.OPERATION_DECODE
        elif 0 < host_fed < rows and self.has(cp.OPERATION_MIXED):
            op = cp.OPERATION_MIXED
        else:
            op = cp.OPERATION_PREFILL
        fit = self.fit(op, rows, tokens, host_fed)
        if fit is None and op != cp.OPERATION_PREFILL:
            fit = self.fit(cp.OPERATION_PREFILL, rows, tokens)
        return fit


def _host_fed_rows(v: Variant) -> int:
    """The host-fed lanes `v` takes: declared, or what its operation implies (MIXED: one)."""
    if v.operation == cp.OPERATION_PREFILL:
        return v.rows
    if v.operation == cp.OPERATION_MIXED:
        return v.host_fed_rows if v.host_fed_rows >= 0 else 1
    return 0


def _graph_host_fed_rows(graph: cp.GraphContract) -> int:
    """A MIXED program that binds the mixed prefill row (a scalar) feeds one row from the host;
    one without tells its host-fed lanes by their prompt tokens, so every row may be one."""
    if graph.operation != cp.OPERATION_MIXED:
        return -1
    if any(b.source == cp.VALUE_SOURCE_MIXED_PREFILL_ROW for b in graph.bindings):
        return 1
    return graph.capacity.rows
