"""The read-ahead helper used by verification: order, errors, early close."""
from __future__ import annotations

import threading

import pytest

from helios_backend.core.prefetch import prefetched


def test_items_arrive_in_order():
    assert list(prefetched(iter(range(100)), depth=2)) == list(range(100))


def test_producer_errors_reach_the_consumer_after_earlier_items():
    def produce():
        yield 1
        yield 2
        raise KeyError("boom")

    seen = []
    with pytest.raises(KeyError):
        for item in prefetched(produce()):
            seen.append(item)
    assert seen == [1, 2]


def test_closing_early_stops_the_helper_thread():
    before = threading.active_count()
    consumer = prefetched(iter(range(10**9)), depth=2)
    assert next(consumer) == 0
    consumer.close()
    assert threading.active_count() == before
