"""Snapshots at exact token endpoints, with partial-page continuation.

A snapshot of a request's history at endpoint E (tokens [0, E) consumed):

    tokens  |<-- page 0 -->|<-- page 1 -->|<- E % page_tokens ->|
    owner   | immutable published pages   | continuation row r  |
            | (referenced by the snapshot)| (partial-page payload, copied there by
            |                             |  the step that binds SNAPSHOT_DESTINATION)

The checkpoint owns complete pages only (CACHE-20); the partial page's payload stays
in continuation storage (CACHE-21). A later request whose prompt continues exactly
through E shares the complete pages and *restores* the partial payload into a fresh
private writable page through the RESTORATION program (CACHE-22), then computes from
E on. A snapshot becomes matchable only after the completion of the step that wrote it
was validated (CACHE-25); until then its row is `pending`.

Rows are a fixed capacity (the physical snapshot capacity); when none is free the
least recently used published snapshot is evicted and its pages released.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from helios_backend.scheduler.pages import PagePool


@dataclass
class Snapshot:
    row: int
    chain_key: bytes                # key after the complete pages (the chain seed when none)
    pages: list[int]                # complete pages, referenced by the snapshot
    partial: tuple[int, ...]        # token ids of the partial page, 0 < len < page_tokens
    endpoint: int                   # E = len(pages) * page_tokens + len(partial)
    pins: int = 0                   # restorations in flight that read this row


@dataclass
class SnapshotCounters:
    published: int = 0
    evicted: int = 0
    restored: int = 0
    discarded: int = 0              # reserved rows whose step failed or was cancelled


@dataclass
class SnapshotStore:
    capacity: int
    pool: PagePool
    _free_rows: list[int] = field(default_factory=list)
    _by_key: dict[bytes, list[Snapshot]] = field(default_factory=dict)
    _lru: "OrderedDict[int, Snapshot]" = field(default_factory=OrderedDict)  # published, oldest first
    _pending: dict[int, Snapshot] = field(default_factory=dict)
    counters: SnapshotCounters = field(default_factory=SnapshotCounters)

    def __post_init__(self) -> None:
        self._free_rows = list(range(self.capacity - 1, -1, -1))

    @property
    def used_rows(self) -> int:
        return self.capacity - len(self._free_rows)

    @property
    def published(self) -> int:
        return len(self._lru)

    def reserve(self, chain_key: bytes, pages: Sequence[int], partial: Sequence[int],
                page_tokens: int) -> Snapshot | None:
        """A row for a snapshot the next step will write; None when all rows are busy."""
        if self.capacity == 0 or not partial:
            return None
        if not self._free_rows and not self._evict_one():
            return None
        row = self._free_rows.pop()
        snap = Snapshot(row, chain_key, list(pages), tuple(partial),
                        len(pages) * page_tokens + len(partial))
        self._pending[row] = snap
        return snap

    def publish(self, row: int) -> None:
        """The step that wrote `row` was validated: the snapshot becomes matchable."""
        snap = self._pending.pop(row)
        # referenced only now: until the step is validated its writer holds the pages privately
        self.pool.acquire(snap.pages, by_snapshot=True)
        self._by_key.setdefault(snap.chain_key, []).append(snap)
        self._lru[row] = snap
        self.counters.published += 1

    def discard(self, row: int) -> None:
        """The step failed or its lane was cancelled: nothing is published (CACHE-25)."""
        self._pending.pop(row)
        self._free_rows.append(row)
        self.counters.discarded += 1

    def match(self, chain_key: bytes, following: Sequence[int]) -> Snapshot | None:
        """The longest published snapshot after `chain_key` whose partial tokens
        are a prefix of `following` (the request's tokens after the matched pages)."""
        best: Snapshot | None = None
        for snap in self._by_key.get(chain_key, ()):
            n = len(snap.partial)
            if n <= len(following) and tuple(following[:n]) == snap.partial:
                if best is None or n > len(best.partial):
                    best = snap
        if best is not None:
            self._lru.move_to_end(best.row)
        return best

    def pin(self, snap: Snapshot) -> None:
        """Keep a snapshot (and its row) from eviction until unpin_row."""
        snap.pins += 1

    def record_restore(self) -> None:
        self.counters.restored += 1

    def unpin_row(self, row: int) -> None:
        """A restoration that read `row` completed (or failed)."""
        snap = self._lru.get(row)
        if snap is not None:
            snap.pins -= 1

    def evict_for_pages(self) -> bool:
        """Release the oldest unpinned snapshot's pages (page shortage); False if none."""
        return self._evict_one()

    def _evict_one(self) -> bool:
        for row, snap in self._lru.items():
            if snap.pins == 0:
                del self._lru[row]
                same = self._by_key[snap.chain_key]
                same.remove(snap)
                if not same:
                    del self._by_key[snap.chain_key]
                self.pool.release(snap.pages, by_snapshot=True)
                self._free_rows.append(row)
                self.counters.evicted += 1
                return True
        return False
