"""Page pool, prefix hash chain and snapshot store: exact page ids and eviction order."""
from __future__ import annotations

import pytest

from helios_backend.scheduler.pages import PagePool, PagesExhausted
from helios_backend.scheduler.prefix_hash import chain_keys, chain_seed
from helios_backend.scheduler.snapshots import SnapshotStore


def test_allocation_order_and_free_on_release() -> None:
    pool = PagePool(4)
    assert [pool.allocate() for _ in range(4)] == [0, 1, 2, 3]
    with pytest.raises(PagesExhausted):
        pool.allocate()
    pool.release([1, 2])
    assert pool.free_pages == 2
    # unpublished pages go straight back to the free list; the tail (2) was released first
    assert pool.allocate() == 1
    assert pool.allocate() == 2


def _pool_state(pool: PagePool) -> tuple:
    return (pool.free_pages, pool.cached_pages, pool.request_pages, pool.lru_order(),
            [pool.refcount(p) for p in range(pool.num_pages)], pool.counters)


@pytest.mark.parametrize("count", [0, 1, 2, 3, 5])
def test_allocate_many_gives_the_pages_of_as_many_allocate_calls(count: int) -> None:  # spec: CACHE-9
    """Free pages first, then cached ones evicted oldest first; the same state after."""
    def pool_with_cache() -> PagePool:
        pool = PagePool(6)
        keys = chain_keys(chain_seed(b""), list(range(8)), 2, 4)
        pages = [pool.allocate() for _ in range(4)]
        for p, k in zip(pages[:3], keys):
            pool.publish(p, k)
        pool.release(pages[:3])                      # 3 cached pages; 1 private; 2 free
        return pool
    one_by_one, at_once = pool_with_cache(), pool_with_cache()
    assert at_once.allocate_many(count) == [one_by_one.allocate() for _ in range(count)]
    assert _pool_state(at_once) == _pool_state(one_by_one)
    with pytest.raises(PagesExhausted):
        at_once.allocate_many(at_once.available_pages + 1)
    assert _pool_state(at_once) == _pool_state(one_by_one)   # nothing taken


def test_hash_chain_depends_on_whole_prefix_and_seed() -> None:  # spec: CACHE-20
    seed = chain_seed(b"core-a")
    a = chain_keys(seed, [1, 2, 3, 4, 5, 6], 2, 3)
    b = chain_keys(seed, [9, 2, 3, 4, 5, 6], 2, 3)
    assert len(a) == 3
    assert all(x != y for x, y in zip(a, b))        # a change in page 0 changes every later key
    assert chain_keys(chain_seed(b"core-b"), [1, 2, 3, 4, 5, 6], 2, 3)[0] != a[0]
    assert chain_keys(seed, [1, 2, 3, 4, 7, 7], 2, 3)[:2] == a[:2]


def test_published_pages_are_matched_then_evicted_lru_tail_first() -> None:  # spec: CACHE-9
    pool = PagePool(5)
    seed = chain_seed(b"")
    keys = chain_keys(seed, list(range(6)), 2, 3)
    pages = [pool.allocate() for _ in range(3)]      # [0, 1, 2]
    for p, k in zip(pages, keys):
        assert pool.publish(p, k)
    other = pool.allocate()                          # 3, private
    pool.release(pages)
    pool.release([other])
    assert pool.cached_pages == 3 and pool.free_pages == 2
    assert pool.lru_order() == [2, 1, 0]             # the chain's tail is evicted first
    assert pool.match(keys) == [0, 1, 2]
    pool.acquire([0])                                # a hit leaves the LRU
    assert pool.lru_order() == [2, 1]
    assert [pool.allocate(), pool.allocate()] == [3, 4]   # free pages before evicting
    assert pool.allocate() == 2                      # then the LRU oldest
    assert pool.counters.evictions == 1
    assert pool.match(keys) == [0, 1]                # the chain is cut where the page went
    assert pool.lru_order() == [1]


def test_duplicate_publication_keeps_first_copy() -> None:
    pool = PagePool(2)
    key = chain_keys(chain_seed(b""), [5, 5], 2, 1)[0]
    a, b = pool.allocate(), pool.allocate()
    assert pool.publish(a, key)
    assert not pool.publish(b, key)
    pool.release([b])
    assert pool.free_pages == 1 and pool.match([key]) == [a]


def test_release_below_zero_is_an_error() -> None:
    pool = PagePool(1)
    p = pool.allocate()
    pool.release([p])
    with pytest.raises(RuntimeError):
        pool.release([p])


def test_snapshot_owns_complete_pages_and_publishes_after_validation() -> None:  # spec: CACHE-19, CACHE-20, CACHE-21, CACHE-25
    pool = PagePool(4)
    store = SnapshotStore(1, pool)
    seed = chain_seed(b"")
    key = chain_keys(seed, [1, 2], 2, 1)[0]
    page = pool.allocate()
    pool.publish(page, key)
    snap = store.reserve(key, [page], [3], page_tokens=2)
    assert snap is not None and snap.endpoint == 3 and snap.row == 0
    assert pool.refcount(page) == 1                  # pending: its writer alone holds the page
    assert store.match(key, [3, 4]) is None          # pending: not matchable before validation
    store.publish(snap.row)
    assert pool.refcount(page) == 2                  # the checkpoint owns the complete page
    assert pool.request_pages == 1                   # ... and the writer still holds it
    assert store.match(key, [3, 4]) is snap
    assert store.match(key, [4]) is None             # partial tokens must match exactly
    pool.release([page])
    assert pool.refcount(page) == 1                  # still owned by the snapshot
    assert pool.request_pages == 0 and pool.used_pages == 1   # no request holds pages: idle
    # the only row is taken: a new reservation evicts the old snapshot and its page reference
    snap2 = store.reserve(seed, [], [7], page_tokens=2)
    assert snap2 is not None and store.counters.evicted == 1 and pool.refcount(page) == 0
    store.discard(snap2.row)                          # a failed step publishes nothing
    assert store.match(seed, [7]) is None and store.used_rows == 0


def test_pinned_snapshot_is_not_evicted() -> None:
    pool = PagePool(2)
    store = SnapshotStore(1, pool)
    seed = chain_seed(b"")
    snap = store.reserve(seed, [], [1], page_tokens=2)
    store.publish(snap.row)
    store.pin(snap)
    assert store.reserve(seed, [], [2], page_tokens=2) is None
    store.unpin_row(snap.row)
    assert store.reserve(seed, [], [2], page_tokens=2) is not None
