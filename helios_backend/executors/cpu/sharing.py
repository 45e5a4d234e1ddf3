"""Work sharing for the CPU executor's kernels: the calling thread never waits for a helper to wake.

`WorkSharing(helpers).run(task, chunks)` calls `task(i)` once for every i < chunks. The calling
thread claims chunks itself from the start; helper threads (woken at the start of the call)
claim whatever is left when they get a core. The call returns when every chunk is done, waiting
only for chunks a helper has already claimed, never for a helper that has not woken yet.

Why not numba's parallel loops (fork-join): a parallel region ends at a barrier of all its
threads, so on a shared machine one worker that the OS has not scheduled stalls the step for a
time slice. Measured on the 2-core machine at load average 3-10: the b=1 decode step's 31
parallel products took 28-33 ms a step where the same products on one thread took 4-6 ms.
With work sharing a busy second core costs the step nothing beyond the chunk a helper is
working on; an idle one takes half the work.

Between calls a helper polls the job counter for `spin_s` (default 2 ms) without the GIL
(claiming.wait_for_change), and only then blocks on an event. A decode step is ~150 kernel calls,
of which the shared ones come every 50-200 us: a blocked helper woke 10-80 us after the call's
start on this 2-core VM (the halted vCPU must be scheduled again), so it took a chunk late or
not at all, and a call it took the last chunk of waited for it (measured: the [3072, 576] gate/up
product of one token took 176 us shared over two threads against 134-142 us on one). A helper
that is still polling takes its first chunk within a microsecond or two of the call's start.
The polling is bounded: when no call comes within `spin_s`, the core is free again.

Tasks must release the GIL for most of their time (the compiled primitives are nogil), so
threads overlap; a task's exception is re-raised by `run` on the calling thread.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional

import numpy as np

from helios_backend.executors.cpu.claiming import FAILED, wait_done, wait_for_change

__all__ = ["WorkSharing"]


# How long an idle helper polls for the next call before it blocks: longer than the calling thread's
# longest serial stretch within a decode step and between steps (~0.3 ms between the shared products of
# a layer at batch 1, ~0.5-1 ms of host work between steps), so a decoding helper never blocks
SPIN_S = 2e-3


def _spins_for(seconds: float) -> int:
    """Polls of wait_for_change that take about `seconds` on this machine (one PAUSE is 10-140
    cycles depending on the core), from the fastest of a few timings on a counter that never
    changes: a timing that other work disturbed would shorten the polling."""
    probe = np.zeros(1, dtype=np.int64)
    wait_for_change(probe, 0, 16)                    # compiled or loaded before it is timed
    fastest = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        wait_for_change(probe, 0, 4_000)
        fastest = min(fastest, time.perf_counter() - start)
    return max(1, int(seconds / max(fastest / 4_000, 1e-9)))


class _Job:
    __slots__ = ("task", "chunks", "claimed", "active", "finished", "error", "counters")

    def __init__(self, task: Callable[[int], None], chunks: int, counters: Optional[np.ndarray] = None) -> None:
        self.task = task
        self.chunks = chunks
        self.counters = counters               # run_claimed: the call's [next, done, failed]
        self.claimed = 0                       # chunks handed out
        self.active = 0                        # chunks claimed by helpers, not yet done
        self.finished = threading.Event()      # set when a helper finishes the last active chunk
        self.error: Optional[BaseException] = None


class WorkSharing:
    """`helpers` daemon threads sharing chunks of work with whichever thread calls `run`."""

    def __init__(self, helpers: int, spin_s: float = SPIN_S) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._job: Optional[_Job] = None
        self._closed = False
        # incremented by every shared call (after its job is in place), polled by idle helpers
        self._calls = np.zeros(1, dtype=np.int64)
        self._spins = _spins_for(spin_s) if helpers and spin_s > 0 else 0
        self._threads = [threading.Thread(target=self._help, name=f"helios-cpu-helper-{i}", daemon=True)
                         for i in range(helpers)]
        for thread in self._threads:
            thread.start()

    @property
    def helpers(self) -> int:
        return len(self._threads)

    def run(self, task: Callable[[int], None], chunks: int) -> None:
        """task(0) .. task(chunks - 1), on this thread and on helpers that wake in time."""
        if not self._threads or chunks <= 1:
            for i in range(chunks):
                task(i)
            return
        job = _Job(task, chunks)
        self._job = job
        self._calls[0] += 1            # a polling helper sees it at once; a blocked one is woken
        self._wake.set()
        try:
            while (index := self._claim(job, helper=False)) is not None:
                task(index)
        finally:
            with self._lock:
                job.claimed = job.chunks       # after an error: hand nothing more out
                self._job = None
                busy = job.active > 0
            if busy:
                job.finished.wait()
        if job.error is not None:
            raise job.error

    def run_claimed(self, task: Callable[[np.ndarray, np.ndarray, bool], None], chunks: int) -> None:
        """task(counters, calls, caller) on this thread (caller True) and on every helper that wakes in
        time (False): `task` calls a compiled primitive that claims the call's chunks itself
        (claiming.claim_chunks: a fetch-add on counters[NEXT], DONE after each), so no chunk waits for
        the GIL; the caller's primitive announces the call on `calls` once it has released the GIL and
        waits for the helpers' chunks before it returns. With `run`, a chunk cost each thread a GIL
        hand-over (10-80 us to wake the thread waiting for it on this
        VM): a [3072, 576] product of one token took 190-230 us shared over two threads, 116 us on one."""
        counters = np.zeros(3, dtype=np.int64)  # per call: a helper that comes late claims nothing of the next
        if not self._threads or chunks <= 1:
            task(counters, self._calls, False)
            return
        job = _Job(lambda _: task(counters, self._calls, False), 0, counters)
        self._job = job
        self._wake.set()                         # a blocked helper (the polling one sees the announcement)
        try:
            task(counters, self._calls, True)
        except BaseException:
            counters[FAILED] = 1
            raise
        finally:
            self._job = None
            wait_done(counters, chunks)          # after an error: the chunks a helper still holds
        if job.error is not None:
            raise job.error

    def _claim(self, job: _Job, helper: bool) -> Optional[int]:
        """The next chunk of `job`, None when all are handed out; a helper's counts as active."""
        with self._lock:
            if job.claimed >= job.chunks:
                return None
            job.claimed += 1
            job.active += int(helper)
            return job.claimed - 1

    def _help(self) -> None:
        seen = 0
        while True:
            calls = wait_for_change(self._calls, seen, self._spins)      # without the GIL
            if calls == seen:                    # nothing within spin_s: block until the next call
                self._wake.wait()
                self._wake.clear()
                calls = int(self._calls[0])
            seen = calls
            if self._closed:
                return
            job = self._job
            if job is None:
                continue
            if job.counters is not None:        # run_claimed: the compiled task claims its own chunks
                try:
                    job.task(0)
                except BaseException as error:  # noqa: BLE001 - re-raised by run_claimed() on the caller
                    job.error = error
                    job.counters[FAILED] = 1
                continue
            while (index := self._claim(job, helper=True)) is not None:
                try:
                    job.task(index)
                except BaseException as error:  # noqa: BLE001 - re-raised by run() on the caller
                    job.error = error
                with self._lock:
                    job.active -= 1
                    last = job.active == 0 and job.claimed >= job.chunks
                if last:
                    job.finished.set()

    def close(self) -> None:
        self._closed = True
        self._calls[0] += 1
        self._wake.set()
        for thread in self._threads:
            thread.join(timeout=1.0)
