"""Speculative descriptor and completion cursor checks (SPEC-6..16, SPEC-34..39, CACHE-10..12)."""
from __future__ import annotations

from helios_proto import contract_pb2 as c
from helios_proto import manifest_pb2 as m

from .catalog import CheckContext
from .checks_graphs import graphs
from .errors import ContractError

LENGTH_SOURCES = (c.VALUE_SOURCE_QUERY_LENGTH, c.VALUE_SOURCE_SPECULATIVE_PREFIX_LIMIT)
F32_NBYTES = 4


def length_source(graph: c.GraphContract) -> int | None:
    """The one length source a speculative graph binds, or None when it binds none or both."""
    bound = {b.source for b in graph.bindings if b.source in LENGTH_SOURCES}
    return bound.pop() if len(bound) == 1 else None


def check_speculative(ctx: CheckContext) -> None:
    widths = set(ctx.contract.speculative_widths)
    seen_widths: set[int] = set()
    for path, graph in graphs(ctx):
        field = f"{path}.speculative"
        is_speculative = graph.operation == c.OPERATION_SPECULATIVE
        if not is_speculative:
            if graph.HasField("speculative"):
                raise ContractError(field, "only SPECULATIVE graphs carry a speculative descriptor")
            continue
        if not graph.HasField("speculative"):
            raise ContractError(field, "a SPECULATIVE graph declares its B, D, W and P")
        spec = graph.speculative
        _check_extents(spec, graph, field)
        bound = {b.source for b in graph.bindings if b.source in LENGTH_SOURCES}
        if len(bound) != 1:
            raise ContractError(
                f"{path}.bindings",
                "a speculative program binds exactly one length source (QUERY_LENGTH or SPECULATIVE_PREFIX_LIMIT), "
                f"found {len(bound)}",
            )
        _check_confidence(ctx, spec, graph, field)
        if spec.token_capacity not in widths:
            raise ContractError(f"{field}.token_capacity", f"width {spec.token_capacity} is not in speculative_widths")
        seen_widths.add(spec.token_capacity)
    missing = widths - seen_widths
    if missing:
        raise ContractError("speculative_widths", f"no SPECULATIVE graph captures width(s) {sorted(missing)}")


def _check_extents(spec: c.SpeculativeDescriptor, graph: c.GraphContract, field: str) -> None:
    b, d, w, p = spec.batch_capacity, spec.draft_tokens, spec.token_capacity, spec.packed_token_capacity
    if b != graph.capacity.rows:
        raise ContractError(f"{field}.batch_capacity", f"B={b} differs from the graph's captured rows {graph.capacity.rows}")
    if w == 0:
        raise ContractError(f"{field}.token_capacity", "W must be positive (it includes the pending token)")
    if p == 0:
        raise ContractError(f"{field}.packed_token_capacity", "P is explicit, even when P = B x W")
    if not b <= p <= b * w:
        raise ContractError(f"{field}.packed_token_capacity", f"P={p} must lie in [B, B x W] = [{b}, {b * w}]")
    if graph.capacity.tokens and graph.capacity.tokens != p:
        raise ContractError(f"{field}.packed_token_capacity", f"P={p} differs from the graph's packed tokens")
    # D is declared, never inferred from W: a width-one program draws nothing (SPEC-4),
    # a wider one must say how many proposals it draws.
    if w == 1 and d != 0:
        raise ContractError(f"{field}.draft_tokens", "a width-one program draws no proposals (D = 0)")
    if w > 1 and d == 0:
        raise ContractError(f"{field}.draft_tokens", "D must be declared for W > 1; it is never inferred from W")


def _check_confidence(ctx: CheckContext, spec: c.SpeculativeDescriptor, graph: c.GraphContract, field: str) -> None:
    produces = bool(spec.confidence_width or spec.confidence_buffer or spec.confidence_draft_capacity)
    if not produces:
        return
    if spec.confidence_width != spec.draft_tokens:
        raise ContractError(
            f"{field}.confidence_width", f"{spec.confidence_width} must equal the program's D={spec.draft_tokens}"
        )
    if not spec.confidence_buffer:
        raise ContractError(f"{field}.confidence_buffer", "a confidence program names its proposal_confidence buffer")
    buffer = ctx.buffer(spec.confidence_buffer, graph.rank, f"{field}.confidence_buffer")
    shape = list(buffer.shape)
    slots = ctx.manifest.request_slots
    capacity = spec.confidence_draft_capacity
    # [frame (2), request_slots, draft_capacity] fp32, contiguous; no unframed layout (SPEC-35..39)
    if len(shape) != 3 or shape[0] != 2:
        raise ContractError(f"{field}.confidence_buffer", f"shape {shape} is not framed [2, request_slots, draft_capacity]")
    if buffer.dtype != c.DTYPE_F32:
        raise ContractError(f"{field}.confidence_buffer", "proposal_confidence is FP32")
    if shape[1] != slots:
        raise ContractError(f"{field}.confidence_buffer", f"second dimension {shape[1]} is not request_slots={slots}")
    if shape[2] != capacity:
        raise ContractError(f"{field}.confidence_draft_capacity", f"{capacity} differs from the buffer's {shape[2]}")
    if buffer.nbytes != 2 * slots * capacity * F32_NBYTES:
        raise ContractError(f"{field}.confidence_buffer", "proposal_confidence is not contiguous FP32 storage")
    for other_path, other in graphs(ctx):
        other_spec = other.speculative
        if other.HasField("speculative") and other_spec.confidence_buffer == spec.confidence_buffer:
            if other_spec.confidence_width > capacity:
                raise ContractError(
                    f"{field}.confidence_draft_capacity",
                    f"{capacity} does not cover width {other_spec.confidence_width} of {other_path}",
                )
    if buffer.kind in (m.BUFFER_KIND_CACHE, m.BUFFER_KIND_STAGING, m.BUFFER_KIND_WEIGHT):
        raise ContractError(f"{field}.confidence_buffer", "proposal_confidence cannot live in cache, staging or weights")


def check_cursors(ctx: CheckContext) -> None:
    for path, graph in graphs(ctx):
        if not graph.HasField("cursor"):
            continue
        cursor = graph.cursor
        field = f"{path}.cursor"
        if not cursor.reports_draft_cursor:
            if cursor.lag_tokens or cursor.state_view:
                raise ContractError(field, "a graph without a draft cursor declares no lag or state")
            continue
        if not cursor.state_view:
            raise ContractError(f"{field}.state_view", "a draft cursor names the committed state it tracks")
        if not any(a.view.name == cursor.state_view for a in graph.state_accesses):
            raise ContractError(f"{field}.state_view", f"{cursor.state_view!r} is not a state view of this graph")


CHECKS = (check_speculative, check_cursors)
