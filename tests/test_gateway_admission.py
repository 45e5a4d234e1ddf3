"""Unit tests of HTTP admission: permits and frontend preparation slots."""

from __future__ import annotations

import asyncio
import threading

import pytest

from gateway.admission import AdmissionPermits, AdmissionSettings
from gateway.errors import IngressFullError


# spec: HTTP-1, HTTP-17
def test_permits_are_queue_capacity_plus_max_active() -> None:
    async def scenario() -> None:
        admission = AdmissionPermits(AdmissionSettings(queue_capacity=2, max_active=1, frontend_workers=1))
        permits = [admission.admit() for _ in range(3)]
        with pytest.raises(IngressFullError) as err:
            admission.admit()
        assert err.value.status == 429 and err.value.headers() == {"Retry-After": "1"}
        permits[0].release()
        permits[0].release()  # idempotent: error paths and the response may both release
        assert admission.in_use == 2
        admission.admit()
        with pytest.raises(IngressFullError):
            admission.admit()
        admission.close()

    asyncio.run(scenario())


# spec: HTTP-3
def test_preparation_waits_for_one_of_frontend_workers_slots() -> None:
    running = 0
    peak = 0
    lock = threading.Lock()
    release = threading.Event()

    def work() -> int:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        release.wait(10)
        with lock:
            running -= 1
        return 1

    async def scenario() -> int:
        admission = AdmissionPermits(AdmissionSettings(queue_capacity=8, max_active=8, frontend_workers=2))
        tasks = [asyncio.create_task(admission.prepare(work)) for _ in range(5)]
        # waiting preparations leave the event loop free: this coroutine keeps running
        for _ in range(2000):
            await asyncio.sleep(0.005)
            if peak == 2:
                break
        release.set()
        results = await asyncio.gather(*tasks)
        admission.close()
        return sum(results)

    assert asyncio.run(scenario()) == 5
    assert peak == 2  # never more than frontend_workers preparations at once


def test_settings_reject_nonsense() -> None:
    with pytest.raises(ValueError):
        AdmissionSettings(queue_capacity=0, max_active=0, frontend_workers=1)
    with pytest.raises(ValueError):
        AdmissionSettings(queue_capacity=1, max_active=1, frontend_workers=0)
    assert AdmissionSettings(queue_capacity=0, max_active=1, frontend_workers=1).permits == 1
