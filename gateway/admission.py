"""HTTP admission: permits for whole requests and slots for CPU preparation.

* ``queue_capacity + max_active`` permits (HTTP-1): a permit is taken before anything else
  (rendering, tokenization) and is held through preparation, queued generation and the
  delivery of the response (HTTP-2, HTTP-12); when none is free the request gets 429 with
  Retry-After at once (HTTP-17), before any CPU work is spent on it.
* ``frontend_workers`` preparation slots (HTTP-3): admitted requests wait asynchronously
  for one, then render and tokenize on a thread pool of that size, so the event loop
  never blocks on CPU work.

Settings come from the served model's effective limits and may be overridden on the CLI.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from gateway.errors import IngressFullError
from gateway.shared_permits import SharedPermits

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class AdmissionSettings:
    queue_capacity: int
    max_active: int
    frontend_workers: int
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        if self.queue_capacity < 0 or self.max_active < 1 or self.frontend_workers < 1:
            raise ValueError(f"invalid admission settings {self}")

    @property
    def permits(self) -> int:
        return self.queue_capacity + self.max_active


class Permit:
    """One admitted HTTP request. ``release`` is idempotent: the response wrapper, error
    paths and disconnect handling may all call it."""

    __slots__ = ("_admission", "_released")

    def __init__(self, admission: "AdmissionPermits") -> None:
        self._admission = admission
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._admission._return_permit()


class AdmissionPermits:
    """The permits of this gateway: counted here, or in a budget shared with the other worker
    processes of one gateway (gateway/shared_permits.py)."""

    def __init__(self, settings: AdmissionSettings, shared: SharedPermits | None = None) -> None:
        self.settings = settings
        self._shared = shared
        self._in_use = 0
        self._slots = asyncio.Semaphore(settings.frontend_workers)
        self._pool = ThreadPoolExecutor(settings.frontend_workers, thread_name_prefix="frontend")

    @property
    def in_use(self) -> int:
        return self._shared.held() if self._shared is not None else self._in_use

    def admit(self) -> Permit:
        """Take a permit now or raise IngressFullError (never waits)."""
        limit = self.settings.permits
        full = not self._shared.try_take(limit) if self._shared is not None else self._in_use >= limit
        if full:
            raise IngressFullError(
                f"the gateway holds {limit} requests (queue_capacity "
                f"{self.settings.queue_capacity} + max_active {self.settings.max_active}); retry later",
                retry_after_s=self.settings.retry_after_s)
        self._in_use += 1
        return Permit(self)

    async def prepare(self, work: Callable[[], T]) -> T:
        """Run CPU preparation (template rendering, tokenization) in a frontend slot."""
        async with self._slots:
            return await asyncio.get_running_loop().run_in_executor(self._pool, work)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _return_permit(self) -> None:
        self._in_use -= 1
        if self._shared is not None:
            self._shared.give_back()
