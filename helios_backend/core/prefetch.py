"""Run an iterator one step ahead on a helper thread.

Verification reads and hashes the next 4 MiB chunk while the decoder works on the
current one; pread, sha256 and zstd all release the GIL, so the two overlap on two
cores. At most `depth` items wait in the queue (bounded memory), exceptions are
re-raised in the consumer, and closing the consumer stops the helper.
"""
from __future__ import annotations

import queue
import threading
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")
_DONE = object()
_POLL_SECONDS = 0.1


def prefetched(items: Iterable[T], depth: int = 2) -> Iterator[T]:
    """Yield what `items` yields, produced ahead on a daemon thread."""
    pipe: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: object) -> bool:
        while not stop.is_set():
            try:
                pipe.put(item, timeout=_POLL_SECONDS)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put((True, item)):
                    return
            put((True, _DONE))
        except BaseException as exc:  # handed to the consumer, which re-raises it
            put((False, exc))

    worker = threading.Thread(target=produce, name="helios-core-prefetch", daemon=True)
    worker.start()
    try:
        while True:
            ok, item = pipe.get()
            if not ok:
                raise item
            if item is _DONE:
                return
            yield item
    finally:
        stop.set()
        worker.join()
