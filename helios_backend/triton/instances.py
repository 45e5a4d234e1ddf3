"""Each helios-serve instance's claim on its temporary state; a start removes dead ones' state.

An instance owns a temporary workdir (model repository, backend directory, supervision state)
and the python backend's /dev/shm regions of its prefix. A SIGKILLed helios-serve cleans up
neither, so each instance holds an exclusive flock on a lock file naming both for its whole
life; the kernel drops the lock when the process dies, however it dies. A start takes every
lock it can get: an unheld lock is a dead owner, whose regions and workdir it removes.

    reaped = reap_dead()                      # before this instance creates anything
    claim = Claim.take(shm_prefix, workdir)   # workdir: None when the operator gave one (theirs)
    ...
    claim.release()                           # at a clean exit, after its own cleanup

The registry lives in /dev/shm, beside the regions (a tmpfs emptied at boot), so every start
finds it whatever TMPDIR says. A lock is taken on a scratch name and then renamed into place:
a lock file is never visible unheld while its owner lives.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from helios_backend.triton.launcher import cleanup_shm

REGISTRY = Path("/dev/shm") / f"helios-instances-{os.getuid()}"
WORKDIR_PREFIX = "helios-serve-"        # helios-serve's own temporary workdirs (tempfile.mkdtemp)


LEFTOVER_WAIT_S = 2.0                   # how long a killed leftover may take to be gone


@dataclass(frozen=True)
class DeadInstance:
    pid: int
    shm_prefix: str
    workdir: str | None
    killed: tuple[int, ...] = ()        # its processes that were still running (ended here)


def _leftovers(record: DeadInstance) -> list[int]:
    """This user's processes that still name the dead instance's regions or workdir in their
    argv (the python-backend stub does): an orphan whose own parent watch did not end it must
    not keep the regions, and the GPU memory, that this start is about to reuse."""
    marks = [record.shm_prefix.encode()] + ([record.workdir.encode()] if record.workdir else [])
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if entry.stat().st_uid != os.getuid():
                continue
            argv = (entry / "cmdline").read_bytes()
        except OSError:
            continue                                   # gone meanwhile, or not ours to read
        if any(mark in argv for mark in marks):
            found.append(int(entry.name))
    return found


def _end(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + LEFTOVER_WAIT_S
    while pids and time.monotonic() < deadline:
        pids = [pid for pid in pids if Path(f"/proc/{pid}").exists()]
        time.sleep(0.05)


def _remove_state(record: DeadInstance) -> None:
    if record.shm_prefix.startswith(WORKDIR_PREFIX):    # never a glob wider than one instance's
        cleanup_shm(record.shm_prefix)
    if record.workdir and Path(record.workdir).name.startswith(WORKDIR_PREFIX):
        shutil.rmtree(record.workdir, ignore_errors=True)


def reap_dead(registry: Path = REGISTRY) -> list[DeadInstance]:
    """Remove the state of every registered instance whose owner is dead; returns them."""
    reaped = []
    for lock in sorted(registry.glob("*.lock")):
        try:
            fd = os.open(lock, os.O_RDWR)
        except FileNotFoundError:
            continue                                   # another start reaped it first
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue                               # its owner lives
            if not lock.exists():
                continue                               # reaped between our open and our lock
            try:
                data = json.loads(os.read(fd, 1 << 16) or b"{}")
                record = DeadInstance(int(data["pid"]), str(data["shm_prefix"]), data.get("workdir"))
            except (ValueError, KeyError, TypeError):
                lock.unlink(missing_ok=True)           # unreadable: nothing to clean by it
                continue
            leftovers = _leftovers(record)
            _end(leftovers)
            record = DeadInstance(record.pid, record.shm_prefix, record.workdir, tuple(leftovers))
            _remove_state(record)
            lock.unlink(missing_ok=True)
            reaped.append(record)
        finally:
            os.close(fd)
    return reaped


class Claim:
    """This instance's held lock; released at a clean exit (a death releases it too)."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd, self.path = fd, path

    @classmethod
    def take(cls, shm_prefix: str, workdir: Path | None, registry: Path = REGISTRY) -> "Claim":
        registry.mkdir(mode=0o700, parents=True, exist_ok=True)
        name = shm_prefix.rstrip("-")
        scratch = registry / f"{name}.claiming"
        fd = os.open(scratch, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)   # not inherited (O_CLOEXEC)
        fcntl.flock(fd, fcntl.LOCK_EX)
        record = {"pid": os.getpid(), "shm_prefix": shm_prefix, "workdir": None if workdir is None else str(workdir)}
        os.write(fd, json.dumps(record).encode())
        path = registry / f"{name}.lock"
        scratch.replace(path)
        return cls(fd, path)

    def release(self) -> None:
        self.path.unlink(missing_ok=True)
        os.close(self._fd)
