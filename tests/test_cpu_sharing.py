"""Work sharing of the CPU executor (executors/cpu/sharing.py): every chunk once, errors on the caller."""
from __future__ import annotations

import threading
import time

import pytest

from helios_backend.executors.cpu.sharing import WorkSharing


@pytest.mark.parametrize("helpers", [0, 1, 3])
def test_every_chunk_runs_exactly_once(helpers):
    sharing = WorkSharing(helpers)
    try:
        for chunks in (0, 1, 2, 7, 64):
            seen: list[int] = []
            lock = threading.Lock()

            def task(index: int) -> None:
                with lock:
                    seen.append(index)

            sharing.run(task, chunks)
            assert sorted(seen) == list(range(chunks))
    finally:
        sharing.close()


def test_helpers_take_chunks_when_the_caller_is_busy():
    """Chunks slow enough for a helper to wake: some run on a thread other than the caller's."""
    sharing = WorkSharing(1)
    threads: set[int] = set()
    try:
        for _ in range(20):
            def task(index: int) -> None:
                threads.add(threading.get_ident())
                time.sleep(0.002)              # releases the GIL, like the compiled primitives

            sharing.run(task, 8)
            if len(threads) > 1:
                break
    finally:
        sharing.close()
    assert len(threads) == 2


def test_a_failing_chunk_is_raised_on_the_calling_thread_and_sharing_goes_on():
    sharing = WorkSharing(1)
    try:
        def task(index: int) -> None:
            time.sleep(0.001)
            if index == 3:
                raise ValueError("chunk 3")

        with pytest.raises(ValueError, match="chunk 3"):
            sharing.run(task, 8)
        done: list[int] = []
        sharing.run(done.append, 4)
        assert sorted(done) == [0, 1, 2, 3]
    finally:
        sharing.close()
