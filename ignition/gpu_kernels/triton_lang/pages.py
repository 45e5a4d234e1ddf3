"""Page payload copies between the paged cache and continuation rows (snapshots at exact token
endpoints; drawn in helios_backend/kernel_abi/cache.py).

    continuation plane = row[0] | row[1] | ...      row_stride elements per row
    row                = one whole cache page of that plane (every layer), page_stride elements
Cache pointers are plane starts (layer offset 0). Both kernels run on the grid
(cdiv(page_stride, BLOCK), rows): program (b, r) copies chunk b of row r's k and v pages.
"""
import triton
import triton.language as tl

from ignition.gpu_kernels.triton_lang.common import live_lane, wait_for_predecessors
from ignition.gpu_kernels.triton_lang.records import write_header, write_records


@triton.jit
def _copy_chunk(dst_k, dst_v, src_k, src_v, dst_start, src_start, page_stride,
                BLOCK: tl.constexpr):
    """Chunk program_id(0) of one page_stride-element page, in both planes."""
    e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = e < page_stride
    tl.store(dst_k + dst_start + e, tl.load(src_k + src_start + e, mask=mask), mask=mask)
    tl.store(dst_v + dst_start + e, tl.load(src_v + src_start + e, mask=mask), mask=mask)


@triton.jit
def snapshot_partial_pages(k_continuation, v_continuation, k_cache, v_cache, page_table, row_slot,
                           snapshot_row, consumed, query_length, live_rows, rows, page_tokens,
                           pages_per_row, page_stride, row_stride,
                           BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Rows with snapshot_row >= 0 whose endpoint (consumed + query_length) falls inside a page:
    that page -> continuation row snapshot_row."""
    wait_for_predecessors(PDL)
    r = tl.program_id(1)
    live, slot = live_lane(row_slot, live_rows, rows, r)
    row = tl.load(snapshot_row + r, mask=r < live, other=-1)
    endpoint = (tl.load(consumed + r, mask=r < live, other=0)
                + tl.load(query_length + r, mask=r < live, other=0))
    if (row >= 0) & (slot >= 0) & (endpoint % page_tokens != 0):
        page = tl.load(page_table + slot * pages_per_row + endpoint // page_tokens)
        _copy_chunk(k_continuation, v_continuation, k_cache, v_cache, row * row_stride,
                    page.to(tl.int64) * page_stride, page_stride, BLOCK)


@triton.jit
def restore_partial_pages(k_cache, v_cache, completion, k_continuation, v_continuation,
                          page_table, row_slot, row_generation, restore_row, consumed,
                          transport_header, live_rows, rows, page_tokens, pages_per_row,
                          page_stride, row_stride, operation,
                          BLOCK: tl.constexpr, PDL: tl.constexpr):
    """RESTORATION: continuation row restore_row -> the page holding the row's endpoint
    (consumed); one completion record per row (slot, generation, consumed), header by (0, 0)."""
    wait_for_predecessors(PDL)
    r = tl.program_id(1)
    live, slot = live_lane(row_slot, live_rows, rows, r)
    row = tl.load(restore_row + r, mask=r < live, other=-1)
    endpoint = tl.load(consumed + r, mask=r < live, other=0)
    if (slot >= 0) & (row >= 0):
        page = tl.load(page_table + slot * pages_per_row + endpoint // page_tokens)
        _copy_chunk(k_cache, v_cache, k_continuation, v_continuation,
                    page.to(tl.int64) * page_stride, row * row_stride, page_stride, BLOCK)
    if tl.program_id(0) == 0:
        lane = tl.arange(0, 1) + r
        one = tl.zeros((1,), tl.int32)
        write_records(completion, lane, lane < rows, one + slot,
                      one + tl.load(row_generation + r, mask=r < live, other=-1), one - 1,
                      one + endpoint, one, one, (r < live) & (slot >= 0))
        if r == 0:
            write_header(completion, tl.load(transport_header), live, operation, rows)
