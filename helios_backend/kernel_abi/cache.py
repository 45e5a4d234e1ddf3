"""Reference kernels for snapshots at exact token endpoints: partial pages to and from continuation rows.

A snapshot at endpoint E owns the complete pages [0, E // page_tokens) through the page table;
the partial page (positions E - E % page_tokens .. E - 1) lives in a continuation row:

    continuation plane = row[0] | row[1] | ...      row_stride elements per row
    row                = one whole cache page of that plane (every layer), page_stride elements

Both kernels copy whole pages: positions >= E in a restored page are written by the next
prefill step before any query reads them (qkv_rope_store runs before attention in every layer).
Cache pointers here are plane starts (layer offset 0).
"""
from __future__ import annotations

import numpy as np

from helios_backend.kernel_abi.state import _inactive_records, _write_row_records


def _page(plane: np.ndarray, page: int, page_stride: int) -> np.ndarray:
    return plane[page * page_stride:(page + 1) * page_stride]


def snapshot_partial_pages(k_continuation: np.ndarray, v_continuation: np.ndarray, k_cache: np.ndarray,
                           v_cache: np.ndarray, page_table: np.ndarray, row_slot: np.ndarray,
                           snapshot_row: np.ndarray, consumed: np.ndarray, query_length: np.ndarray,
                           live_rows: np.ndarray, rows: int, page_tokens: int, pages_per_row: int,
                           page_stride: int, row_stride: int) -> None:
    """For rows with snapshot_row >= 0 and a partial page at their endpoint: page -> continuation row."""
    for r in range(min(int(live_rows[0]), rows)):
        row = int(snapshot_row[r])
        endpoint = int(consumed[r]) + int(query_length[r])
        if row < 0 or int(row_slot[r]) < 0 or endpoint % page_tokens == 0:
            continue
        page = int(page_table[int(row_slot[r]) * pages_per_row + endpoint // page_tokens])
        k_continuation[row * row_stride:row * row_stride + page_stride] = _page(k_cache, page, page_stride)
        v_continuation[row * row_stride:row * row_stride + page_stride] = _page(v_cache, page, page_stride)


def restore_partial_pages(k_cache: np.ndarray, v_cache: np.ndarray, completion: np.ndarray,
                          k_continuation: np.ndarray, v_continuation: np.ndarray, page_table: np.ndarray,
                          row_slot: np.ndarray, row_generation: np.ndarray, restore_row: np.ndarray,
                          consumed: np.ndarray, transport_header: np.ndarray, live_rows: np.ndarray,
                          rows: int, page_tokens: int, pages_per_row: int, page_stride: int, row_stride: int,
                          operation: int) -> None:
    """RESTORATION: continuation row -> the lane's private page at its endpoint; one record per row."""
    records = _inactive_records(rows)
    live = min(int(live_rows[0]), rows)
    for r in range(live):
        slot, row, endpoint = int(row_slot[r]), int(restore_row[r]), int(consumed[r])
        if slot < 0:
            continue
        records[r, 0], records[r, 1], records[r, 3] = slot, row_generation[r], endpoint
        if row < 0:
            continue
        page = int(page_table[slot * pages_per_row + endpoint // page_tokens])
        _page(k_cache, page, page_stride)[:] = k_continuation[row * row_stride:row * row_stride + page_stride]
        _page(v_cache, page, page_stride)[:] = v_continuation[row * row_stride:row * row_stride + page_stride]
    _write_row_records(completion, (int(transport_header[0]), live, operation, rows), records)
