"""Cache contract checks (CACHE-1..7): pages, history regions, page-table views.

Which fields each history kind declares is one table; a field a kind does not use
must stay zero, so a region cannot smuggle meaning into an unused field.
"""
from __future__ import annotations

from helios_proto import contract_pb2 as c
from helios_proto import manifest_pb2 as m

from .catalog import CheckContext
from .errors import ContractError

PAGED = ("planes", "tokens_per_record")
# kind -> the fields it must declare (nonzero / nonempty)
REGION_FIELDS: dict[int, tuple[str, ...]] = {
    c.HISTORY_KIND_PAGED_KV: PAGED,
    c.HISTORY_KIND_PAGED_LATENT: PAGED,
    c.HISTORY_KIND_SLIDING_WINDOW: ("planes", "tokens_per_record", "window_tokens"),
    c.HISTORY_KIND_RECURRENT: ("bytes_per_row",),
    c.HISTORY_KIND_CONTINUATION: ("bytes_per_row",),
}
ALL_REGION_FIELDS = ("planes", "tokens_per_record", "window_tokens", "bytes_per_row")


def _declared(region: c.HistoryRegion, name: str) -> bool:
    value = getattr(region, name)
    return bool(len(value)) if name == "planes" else bool(value)


def check_cache(ctx: CheckContext) -> None:
    model = ctx.model
    if not model.HasField("cache"):
        raise ContractError("model.cache", "missing CacheContract")
    cache = model.cache
    if cache.page_tokens == 0:
        raise ContractError("model.cache.page_tokens", "must be positive")
    names: set[str] = set()
    for index, region in enumerate(cache.regions):
        field = f"model.cache.regions[{index}]"
        if not region.name or region.name in names:
            raise ContractError(f"{field}.name", f"empty or repeated region name {region.name!r}")
        names.add(region.name)
        required = REGION_FIELDS[region.kind]
        for name in ALL_REGION_FIELDS:
            declared = _declared(region, name)
            if name in required and not declared:
                raise ContractError(f"{field}.{name}", f"a {c.HistoryKind.Name(region.kind)} region declares it")
            if name not in required and declared:
                raise ContractError(f"{field}.{name}", f"not used by a {c.HistoryKind.Name(region.kind)} region")
        if region.tokens_per_record and cache.page_tokens % region.tokens_per_record:
            raise ContractError(f"{field}.tokens_per_record", "must divide page_tokens")
        for plane_index, plane in enumerate(region.planes):
            plane_field = f"{field}.planes[{plane_index}]"
            kinds = {b.kind for (name, _), b in ctx.buffers.items() if name == plane.buffer}
            if not kinds:
                raise ContractError(f"{plane_field}.buffer", f"no buffer {plane.buffer!r} in the execution manifest")
            if kinds != {m.BUFFER_KIND_CACHE}:
                raise ContractError(f"{plane_field}.buffer", f"{plane.buffer!r} is not a CACHE buffer")
            if plane.bytes_per_page == 0:
                raise ContractError(f"{plane_field}.bytes_per_page", "must be positive")
    max_pages = ctx.manifest.max_pages_per_row
    for index, view in enumerate(cache.page_table_views):
        field = f"model.cache.page_table_views[{index}]"
        if view.destination not in ctx.destinations and view.destination not in ctx.buffer_names():
            raise ContractError(f"{field}.destination", f"{view.destination!r} is neither a transport destination nor a buffer")
        if view.pages_per_row == 0:
            raise ContractError(f"{field}.pages_per_row", "must be positive")
        if max_pages and view.pages_per_row > max_pages:
            raise ContractError(f"{field}.pages_per_row", f"exceeds the manifest's max_pages_per_row {max_pages}")
        if view.page_offset < 0:
            raise ContractError(f"{field}.page_offset", "a view references pages at or after the row's first page")


CHECKS = (check_cache,)
