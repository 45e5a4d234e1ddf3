"""The page pool: one owner for every physical page id and the prefix map.

A page holds `page_tokens` consecutive token positions of one request's history
(every layer's K/V for those positions: one page id covers the whole model).

Page states (refcount = number of requests whose page table holds the page):

    free --allocate--> private (ref 1) --publish(key)--> published (ref >= 1)
      ^                    |                                 |        ^
      |               release to 0                     release to 0   | lookup hit
      |                    v                                 v        |
      +------------------ free       evict (LRU oldest) <-- cached (ref 0, matchable)

Only complete pages whose tokens were consumed by a validated completion are
published (CACHE-20, CACHE-25); a published page is immutable: no request writes it
again. Cached pages stay matchable until evicted; eviction takes the least recently
released cached page first, and a released chain enters the LRU tail-first, so a
chain is evicted from its end and its shared head survives longest.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


class PagesExhausted(Exception):
    """No free page and no cached page to evict: the caller waits or preempts."""


@dataclass
class PoolCounters:
    """Monotonic counters since startup (metrics take deltas)."""
    evictions: int = 0
    published: int = 0
    hit_pages: int = 0


class PagePool:
    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"page pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() gives 0, 1, 2, ...
        self._ref = [0] * num_pages
        self._snapshot_ref = [0] * num_pages   # references held by published snapshots
        self._request_held = 0                 # pages some request (not only a snapshot) holds
        self._snapshot_held = 0                # pages with a snapshot reference (0: release's fast path)
        self._key_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached pages, oldest first
        self.counters = PoolCounters()

    # ---- sizes -----------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def cached_pages(self) -> int:
        """Unreferenced published pages: matchable and evictable."""
        return len(self._lru)

    @property
    def available_pages(self) -> int:
        """Pages an allocation can obtain without preempting anyone."""
        return len(self._free) + len(self._lru)

    @property
    def used_pages(self) -> int:
        """Pages referenced by at least one request or snapshot."""
        return self.num_pages - self.available_pages

    @property
    def request_pages(self) -> int:
        """Pages referenced by at least one request (0 when no request holds any)."""
        return self._request_held

    def refcount(self, page: int) -> int:
        return self._ref[page]

    def is_published(self, page: int) -> bool:
        return page in self._key_of

    def lru_order(self) -> list[int]:
        """Cached pages, next eviction first (for tests and docs)."""
        return list(self._lru)

    # ---- allocation ------------------------------------------------------------
    def allocate(self) -> int:
        """A private writable page (ref 1). Evicts the LRU cached page if none is free."""
        if not self._free:
            if not self._lru:
                raise PagesExhausted()
            page, _ = self._lru.popitem(last=False)
            del self._page_of[self._key_of.pop(page)]
            self.counters.evictions += 1
            self._free.append(page)
        page = self._free.pop()
        self._ref[page] = 1
        self._request_held += 1
        return page

    def allocate_many(self, count: int) -> list[int]:
        """`count` private pages in the order `count` calls of allocate() give them (raises
        PagesExhausted, having allocated none, where fewer are available): a decode round's
        opening lanes take their pages in one call."""
        if count > self.available_pages:
            raise PagesExhausted()
        free = self._free
        take = min(count, len(free))
        pages = free[len(free) - take:]
        del free[len(free) - take:]
        pages.reverse()                          # pop() order
        evict = count - take
        if evict:                                # the rest from the LRU, oldest first, as allocate() evicts
            lru, key_of, page_of = self._lru, self._key_of, self._page_of
            for _ in range(evict):
                page, _ = lru.popitem(last=False)
                del page_of[key_of.pop(page)]
                pages.append(page)
            self.counters.evictions += evict
        ref = self._ref
        for page in pages:
            ref[page] = 1
        self._request_held += count
        return pages

    def release(self, pages: Sequence[int], by_snapshot: bool = False) -> None:
        """Drop one reference from each page of a page table (head first in `pages`).

        Released in reverse, so the chain's tail is evicted before its head.
        """
        refs, snapshot_refs, key_of = self._ref, self._snapshot_ref, self._key_of   # once per call:
        lru, free = self._lru, self._free            # a finished request releases all its pages
        if not by_snapshot and not self._snapshot_held:
            # no page has a snapshot reference: a page stays request-held until its last reference
            held = self._request_held
            for page in reversed(pages):
                ref = refs[page] - 1
                if ref < 0:
                    self._request_held = held
                    raise RuntimeError(f"page {page} released more often than referenced")
                refs[page] = ref
                if ref == 0:
                    held -= 1
                    if page in key_of:
                        lru[page] = None
                    else:
                        free.append(page)
            self._request_held = held
            return
        for page in reversed(pages):
            old, snapshot_ref = refs[page], snapshot_refs[page]
            ref = old - 1
            if ref < 0 or (by_snapshot and snapshot_ref <= 0):
                raise RuntimeError(f"page {page} released more often than referenced")
            refs[page] = ref
            before = old > snapshot_ref
            if by_snapshot:
                snapshot_ref -= 1
                snapshot_refs[page] = snapshot_ref
                self._snapshot_held -= snapshot_ref == 0
            self._request_held += (ref > snapshot_ref) - before
            if ref == 0:
                if page in key_of:
                    lru[page] = None
                else:
                    free.append(page)

    # ---- prefix map ------------------------------------------------------------
    def publish(self, page: int, key: bytes) -> bool:
        """Make a complete, consumed page matchable under its chain key.

        Returns False (the page stays private) when an equal page is already
        published: the first copy wins and the duplicate is freed on release.
        """
        return self.publish_many((page,), (key,)) == 1

    def publish_many(self, pages: Sequence[int], keys: Sequence[bytes]) -> int:
        """publish() of each page under its key, in order (a round's completed pages in one
        call); returns how many became matchable."""
        refs, key_of, page_of = self._ref, self._key_of, self._page_of
        published = 0
        try:
            for page, key in zip(pages, keys):
                if refs[page] <= 0:
                    raise RuntimeError(f"publishing unreferenced page {page}")
                if page in key_of or key in page_of:
                    continue
                key_of[page] = key
                page_of[key] = page
                published += 1
        finally:
            self.counters.published += published
        return published

    def match(self, keys: Iterable[bytes]) -> list[int]:
        """The longest run of published pages for a chain of keys (not yet referenced)."""
        pages: list[int] = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def acquire(self, pages: Sequence[int], by_snapshot: bool = False) -> None:
        """Reference matched pages (removing cached ones from the LRU)."""
        for page in pages:
            if self._ref[page] == 0:
                self._lru.pop(page, None)
            before = self._ref[page] > self._snapshot_ref[page]
            self._ref[page] += 1
            if by_snapshot:
                self._snapshot_held += self._snapshot_ref[page] == 0
                self._snapshot_ref[page] += 1
            self._request_held += (self._ref[page] > self._snapshot_ref[page]) - before
        if not by_snapshot:
            self.counters.hit_pages += len(pages)
