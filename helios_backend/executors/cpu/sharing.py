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

Tasks must release the GIL for most of their time (the compiled primitives are nogil), so
threads overlap; a task's exception is re-raised by `run` on the calling thread.
"""
from __future__ import annotations

import threading
from typing import Callable, Optional

__all__ = ["WorkSharing"]


class _Job:
    __slots__ = ("task", "chunks", "claimed", "active", "finished", "error")

    def __init__(self, task: Callable[[int], None], chunks: int) -> None:
        self.task = task
        self.chunks = chunks
        self.claimed = 0                       # chunks handed out
        self.active = 0                        # chunks claimed by helpers, not yet done
        self.finished = threading.Event()      # set when a helper finishes the last active chunk
        self.error: Optional[BaseException] = None


class WorkSharing:
    """`helpers` daemon threads sharing chunks of work with whichever thread calls `run`."""

    def __init__(self, helpers: int) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._job: Optional[_Job] = None
        self._closed = False
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

    def _claim(self, job: _Job, helper: bool) -> Optional[int]:
        """The next chunk of `job`, None when all are handed out; a helper's counts as active."""
        with self._lock:
            if job.claimed >= job.chunks:
                return None
            job.claimed += 1
            job.active += int(helper)
            return job.claimed - 1

    def _help(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._closed:
                return
            job = self._job
            if job is None:
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
        self._wake.set()
        for thread in self._threads:
            thread.join(timeout=1.0)
