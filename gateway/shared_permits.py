"""One HTTP admission budget shared by every gateway worker process (HTTP-1 stays exact).

With ``helios-gateway --workers N`` each worker process admits requests, but the spec's bound
(queue_capacity + max_active requests at once) is one number for the whole gateway. The
parent creates a small file of per-process slots (pid, permits held); a worker takes and
returns permits under an exclusive ``fcntl`` lock on that file, counting the permits of every
live process. A slot whose process died is reclaimed (its permits die with it), so a crashed
worker never leaks budget.

Why not multiprocessing primitives: uvicorn starts the workers, so nothing can be inherited
from the parent but the environment; a path and a file lock are enough, and each admission
costs two lock system calls (a few microseconds), not an IPC round trip.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import struct
from pathlib import Path

SLOTS = 256
_SLOT = struct.Struct("<qq")                 # pid, permits held
_TABLE = struct.Struct(f"<{2 * SLOTS}q")     # every slot, read in one call (each admission reads them all)


class SharedPermits:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDWR)
        self._map = mmap.mmap(self._fd, SLOTS * _SLOT.size)
        self._pid = os.getpid()
        self._slot = -1

    @classmethod
    def create(cls, path: Path) -> "SharedPermits":
        """The parent's file, all slots free."""
        with open(path, "wb") as f:
            f.write(b"\0" * (SLOTS * _SLOT.size))
        return cls(path)

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)

    def _locked_rows(self) -> list[tuple[int, int]]:
        flat = _TABLE.unpack_from(self._map, 0)
        return list(zip(flat[0::2], flat[1::2]))

    def _own_slot(self, rows: list[tuple[int, int]]) -> int:
        if self._slot >= 0:
            return self._slot
        for i, (pid, _) in enumerate(rows):
            if pid == 0 or not _alive(pid):
                _SLOT.pack_into(self._map, i * _SLOT.size, self._pid, 0)
                self._slot = i
                return i
        raise RuntimeError(f"more than {SLOTS} gateway processes share {self.path}")

    def try_take(self, limit: int) -> bool:
        """Take one permit if fewer than `limit` are held by live processes."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            rows = self._locked_rows()
            slot = self._own_slot(rows)
            held = sum(n for pid, n in rows if pid and (pid == self._pid or _alive(pid)))
            if held >= limit:
                return False
            _SLOT.pack_into(self._map, slot * _SLOT.size, self._pid, rows[slot][1] + 1)
            return True
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def give_back(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            rows = self._locked_rows()
            slot = self._own_slot(rows)
            _SLOT.pack_into(self._map, slot * _SLOT.size, self._pid, max(rows[slot][1] - 1, 0))
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def held(self) -> int:
        """Permits held by every live process."""
        fcntl.flock(self._fd, fcntl.LOCK_SH)
        try:
            return sum(n for pid, n in self._locked_rows() if pid and (pid == self._pid or _alive(pid)))
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
