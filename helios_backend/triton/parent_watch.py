"""Every process helios-serve starts ends with its parent, whatever ends the parent.

helios-serve -> tritonserver -> the python-backend stub -> the engine process (and the gateway,
the rank processes). A parent that is SIGKILLed (an OOM kill, a supervisor's stop timeout)
runs none of its cleanup, so each child watches its parent itself:

* `parent_death_signal(parent)`: a `preexec_fn` for the children helios-serve starts itself
  (tritonserver, the gateway, rank processes): between fork and exec it asks the kernel for
  SIGKILL when the parent dies (prctl PR_SET_PDEATHSIG). The kernel sends it when the parent
  *thread* that forked the child exits, so only a process that forks from a thread living as
  long as the process (helios-serve's main thread) may use it.
* `watch_parent()`: a daemon thread that ends the calling process within WATCH_INTERVAL_S of
  its parent's death (the process was reparented: getppid() changed). For processes that
  another program starts (the stub, forked by tritonserver from a thread of its own) or that
  are forked from a thread that may end earlier (the engine process, forked from the thread
  that ran the stub's initialize), where PDEATHSIG would fire on that thread's exit.

The watch ends the process with os._exit: an orphan has nobody to answer, and a Python
shutdown (finalizers, a drain) is what hung the orphans this replaces.
"""
from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from collections.abc import Callable

WATCH_INTERVAL_S = 0.2      # the bound is 1 s from the parent's death to the child's exit
ORPHAN_EXIT_CODE = 75       # EX_TEMPFAIL: ended because the parent is gone, not by a failure of ours
_PR_SET_PDEATHSIG = 1


def parent_death_signal(parent: int, signum: int = signal.SIGKILL) -> Callable[[], None]:
    """A preexec_fn: the child gets `signum` when `parent` (the process calling Popen, its
    forking thread) dies. A parent already dead by then (the prctl came too late) ends the
    child at once."""

    # libc is opened here, before the fork: between fork and exec a multi-threaded parent's
    # child may only make async-signal-safe calls, and dlopen takes the loader's lock, which
    # another thread of the parent may have held at the fork
    try:
        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except OSError:
        prctl = None                     # not Linux: the children's own watches remain

    def preexec() -> None:
        if prctl is None:
            return
        prctl(_PR_SET_PDEATHSIG, signum)
        if os.getppid() != parent:
            os._exit(ORPHAN_EXIT_CODE)

    return preexec


def _exit_orphan(parent: int) -> None:
    # straight to fd 2, never through a logging handler (it may need a lock another thread
    # holds); and nothing may stop the exit: the parent that read our output (helios-serve's
    # log copy) is often the one that died, so the write can fail with a broken pipe
    try:
        os.write(2, f"helios: parent process {parent} is gone; pid {os.getpid()} exits\n".encode())
    except OSError:
        pass
    finally:
        os._exit(ORPHAN_EXIT_CODE)


def watch_parent(on_orphan: Callable[[int], None] = _exit_orphan, interval_s: float = WATCH_INTERVAL_S,
                 parent: int | None = None) -> threading.Thread:
    """Start a daemon thread that calls `on_orphan(parent)` (default: exit now) once this
    process's parent is no longer `parent` (default: the current parent)."""
    expected = os.getppid() if parent is None else parent

    def watch() -> None:
        while os.getppid() == expected:
            time.sleep(interval_s)
        on_orphan(expected)

    thread = threading.Thread(target=watch, name="helios-parent-watch", daemon=True)
    thread.start()
    return thread
