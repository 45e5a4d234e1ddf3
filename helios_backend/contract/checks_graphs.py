"""Graph checks: catalog agreement, bindings, state views, pending tokens, tuned
bindings (BND-1..4, BND-21..27, OWN-7, STA-1..6)."""
from __future__ import annotations

from typing import Iterator

from helios_proto import contract_pb2 as c
from helios_proto import manifest_pb2 as m

from .catalog import CheckContext
from .errors import ContractError

PERSISTENT_KINDS = frozenset({m.BUFFER_KIND_STATE, m.BUFFER_KIND_TUNED, m.BUFFER_KIND_CACHE})
# operations whose programs consume a device-owned pending token (read it) (STA-4)
CONSUMES_PENDING = frozenset({c.OPERATION_DECODE, c.OPERATION_SPECULATIVE, c.OPERATION_MIXED})
# operations that declare writes when they produce pending-token state (STA-5): all of them
PRODUCES_PENDING = frozenset(c.Operation.values()) - {c.OPERATION_UNSPECIFIED}
IMAGE_SOURCES = frozenset({
    c.VALUE_SOURCE_IMAGE_FEATURE_INDICES, c.VALUE_SOURCE_IMAGE_CONTEXT_INDICES,
    c.VALUE_SOURCE_IMAGE_FEATURE_SLOT, c.VALUE_SOURCE_IMAGE_TENSOR,
})


def graphs(ctx: CheckContext) -> Iterator[tuple[str, c.GraphContract]]:
    for index, graph in enumerate(ctx.model.graphs):
        yield f"model.graphs[{index}]", graph


def check_catalog(ctx: CheckContext) -> None:
    """Each graph names one serving program of its own rank whose operation and capacity agree
    (BND-1..3). Program names are unique within a rank; tensor-parallel ranks may record the same
    step under the same name (Program.rank tells them apart)."""
    if not ctx.model.graphs:
        raise ContractError("model.graphs", "a contract declares at least one graph")
    claimed: dict[tuple[str, int], str] = {}
    world = ctx.world_size
    tuning_names = {name for name, _ in ctx.tuning}
    for path, graph in graphs(ctx):
        key = (graph.program, graph.rank)
        if key in claimed:
            raise ContractError(f"{path}.program", f"{graph.program!r} is already described by {claimed[key]}")
        claimed[key] = path
        if graph.rank >= world:
            raise ContractError(f"{path}.rank", f"rank {graph.rank} outside the manifest's world of {world}")
        program = ctx.programs.get(key)
        if program is None:
            ranks = sorted(rank for name, rank in ctx.programs if name == graph.program)
            if ranks:
                raise ContractError(f"{path}.rank", f"rank {graph.rank} disagrees with the catalog's {ranks}")
            where = "the tuning catalog, not the serving catalog" if graph.program in tuning_names else "no catalog"
            raise ContractError(f"{path}.program", f"{graph.program!r} is in {where}")
        if program.operation != graph.operation:
            raise ContractError(
                f"{path}.operation",
                f"{c.Operation.Name(graph.operation)} disagrees with the catalog's "
                f"{c.Operation.Name(program.operation) if program.operation in c.Operation.values() else program.operation}",
            )
        if (program.capacity.rows, program.capacity.tokens) != (graph.capacity.rows, graph.capacity.tokens):
            raise ContractError(f"{path}.capacity", "capacity disagrees with the catalog's program")
        if graph.capacity.rows == 0:
            raise ContractError(f"{path}.capacity.rows", "must be positive")
        slots = ctx.manifest.request_slots
        if slots and graph.capacity.rows > slots:
            raise ContractError(f"{path}.capacity.rows", f"exceeds the manifest's {slots} request slots")


def check_bindings(ctx: CheckContext) -> None:
    """Destinations are registered and bound once per graph; different destinations may
    share a source (OWN-7); source-specific fields are present (BND-4, BND-12)."""
    has_vision = ctx.model.HasField("vision")
    for path, graph in graphs(ctx):
        bound: set[str] = set()
        for index, binding in enumerate(graph.bindings):
            field = f"{path}.bindings[{index}]"
            if binding.destination not in ctx.destinations:
                raise ContractError(f"{field}.destination", f"{binding.destination!r} is not a registered transport destination")
            if binding.destination in bound:
                raise ContractError(f"{field}.destination", f"{binding.destination!r} is bound twice in this graph")
            bound.add(binding.destination)
            if binding.source == c.VALUE_SOURCE_IMAGE_TENSOR and not binding.image_output:
                raise ContractError(f"{field}.image_output", "an image tensor binding names its layout output")
            if binding.source != c.VALUE_SOURCE_IMAGE_TENSOR and binding.image_output:
                raise ContractError(f"{field}.image_output", "only image tensor bindings name a layout output")
            if binding.source != c.VALUE_SOURCE_CONSTANT and binding.constant:
                raise ContractError(f"{field}.constant", "only constant bindings declare a constant")
            if binding.source in IMAGE_SOURCES and not has_vision:
                raise ContractError(f"{field}.source", "image sources need ModelContract.vision")


def _view_end(view: c.StateView, rows: int) -> int:
    """One past the last byte a view touches over `rows` request rows."""
    return view.byte_offset + (max(rows, 1) - 1) * view.row_stride + view.byte_extent


def check_state_views(ctx: CheckContext) -> None:
    """Views lie inside a registered persistent buffer of the graph's rank (STA-1/2)."""
    for path, graph in graphs(ctx):
        names: set[str] = set()
        for index, access in enumerate(graph.state_accesses):
            field = f"{path}.state_accesses[{index}].view"
            view = access.view
            if not view.name or view.name in names:
                raise ContractError(f"{field}.name", f"empty or repeated view name {view.name!r}")
            names.add(view.name)
            buffer = ctx.buffer(view.buffer, graph.rank, f"{field}.buffer")
            if buffer.kind not in PERSISTENT_KINDS:
                raise ContractError(f"{field}.buffer", f"{view.buffer!r} is not a persistent buffer")
            if view.byte_extent == 0:
                raise ContractError(f"{field}.byte_extent", "must be positive")
            if view.row_stride and view.row_stride < view.byte_extent:
                raise ContractError(f"{field}.row_stride", "rows overlap: stride is smaller than the extent")
            rows = ctx.manifest.request_slots * max(graph.state_rows_per_request, 1) if view.row_stride else 1
            if buffer.kind != m.BUFFER_KIND_CACHE and _view_end(view, rows) > buffer.nbytes:
                raise ContractError(
                    field, f"ends at byte {_view_end(view, rows)} beyond buffer {view.buffer!r} ({buffer.nbytes} bytes)"
                )


def check_pending_tokens(ctx: CheckContext) -> None:
    """Device pending tokens name a readable (and, when produced, written) view of the
    graph; host pending tokens name a PENDING_TOKEN binding (STA-4..6)."""
    for path, graph in graphs(ctx):
        if not graph.HasField("pending_token"):
            continue
        owner = graph.pending_token.WhichOneof("owner")
        field = f"{path}.pending_token"
        if owner is None:
            raise ContractError(field, "names neither a device state view nor a host destination")
        if owner == "device_state_view":
            name = graph.pending_token.device_state_view
            access = next((a for a in graph.state_accesses if a.view.name == name), None)
            if access is None:
                raise ContractError(f"{field}.device_state_view", f"{name!r} is not a state view of this graph")
            reads = access.access in (c.ACCESS_READ, c.ACCESS_READ_WRITE)
            writes = access.access in (c.ACCESS_WRITE, c.ACCESS_READ_WRITE)
            if graph.operation in CONSUMES_PENDING and not reads:
                raise ContractError(f"{field}.device_state_view", f"{name!r} must be readable by this operation")
            if graph.operation in PRODUCES_PENDING and not writes:
                raise ContractError(f"{field}.device_state_view", f"{name!r} must be declared written: the graph produces it")
        else:
            name = graph.pending_token.host_destination
            if not any(b.destination == name and b.source == c.VALUE_SOURCE_PENDING_TOKEN for b in graph.bindings):
                raise ContractError(f"{field}.host_destination", f"{name!r} is not a PENDING_TOKEN binding of this graph")


def _written_buffers(ctx: CheckContext) -> dict[str, str]:
    """buffer name -> the first field that declares a write to it."""
    out: dict[str, str] = {}
    for path, graph in graphs(ctx):
        for index, access in enumerate(graph.state_accesses):
            if access.access in (c.ACCESS_WRITE, c.ACCESS_READ_WRITE):
                out.setdefault(access.view.buffer, f"{path}.state_accesses[{index}]")
    return out


def _cache_buffers(ctx: CheckContext) -> set[str]:
    names = {name for (name, _), buffer in ctx.buffers.items() if buffer.kind == m.BUFFER_KIND_CACHE}
    for region in ctx.model.cache.regions:
        names.update(plane.buffer for plane in region.planes)
    return names


def check_tuned_bindings(ctx: CheckContext) -> None:
    """Tuned buffers match a tuning-catalog producer's outputs exactly, and no producer
    output overlaps request inputs, writable graph state or cache storage (BND-21..27)."""
    written = _written_buffers(ctx)
    cache = _cache_buffers(ctx)
    staging = ctx.manifest.transport.staging_buffer
    for path, graph in graphs(ctx):
        for index, tuned in enumerate(graph.tuned_bindings):
            field = f"{path}.tuned_bindings[{index}]"
            producer = ctx.tuning.get((tuned.producer, graph.rank))
            if producer is None:
                where = " (it is a serving program)" if (tuned.producer, graph.rank) in ctx.programs else ""
                raise ContractError(f"{field}.producer", f"{tuned.producer!r} is not in the tuning catalog{where}")
            if tuned.buffer not in producer.outputs:
                raise ContractError(f"{field}.buffer", f"{tuned.buffer!r} is not an output of producer {tuned.producer!r}")
            ctx.buffer(tuned.buffer, graph.rank, f"{field}.buffer")
            for output in producer.outputs:
                if output == staging:
                    raise ContractError(f"{field}.producer", f"output {output!r} overlaps request inputs (staging)")
                if output in written:
                    raise ContractError(f"{field}.producer", f"output {output!r} overlaps writable graph state ({written[output]})")
                if output in cache:
                    raise ContractError(f"{field}.producer", f"output {output!r} overlaps cache storage")
                kind = next((b.kind for (name, _), b in ctx.buffers.items() if name == output), None)
                if kind in (m.BUFFER_KIND_STAGING, m.BUFFER_KIND_COMPLETION, m.BUFFER_KIND_WEIGHT):
                    raise ContractError(f"{field}.producer", f"output {output!r} is a {m.BufferKind.Name(kind)} buffer")


def check_resources(ctx: CheckContext) -> None:
    """Graph resource dependencies name resources of the core (when the core is known)."""
    if ctx.resource_ids is None:
        return
    for path, graph in graphs(ctx):
        for index, resource in enumerate(graph.resources):
            if resource not in ctx.resource_ids:
                raise ContractError(f"{path}.resources[{index}]", f"no resource {resource!r} in the core")


CHECKS = (check_catalog, check_bindings, check_state_views, check_pending_tokens, check_tuned_bindings, check_resources)
