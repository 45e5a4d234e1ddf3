"""Nothing outlives a killed parent, and a start removes the state a dead instance left.

* a process under `watch_parent` ends once its parent is SIGKILLed (the stub, the engine
  process, the gateway's workers), and so does one started with `parent_death_signal` as its
  preexec_fn (tritonserver, the gateway, rank processes under helios-serve), and so do the
  servers the tests themselves start (a killed pytest leaves none behind);
* `reap_dead` removes the /dev/shm regions and the workdir of a registered instance whose
  owner died, and nothing of one whose owner lives.
The full stack's version (helios-serve SIGKILLed under load) is in test_serve_supervision.py.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from helios_backend.triton.instances import Claim, reap_dead
from helios_backend.triton.supervision import process_alive as alive
from tests.gateway_harness import wait_until

# A middle process starts a grandchild (which prints its pid), prints that pid and waits to be killed.
_MIDDLE = """
import os, subprocess, sys, time
from helios_backend.triton.parent_watch import parent_death_signal
mode = sys.argv[1]
if mode == "watch":
    child = subprocess.Popen([sys.executable, "-c",
        "import time; from helios_backend.triton.parent_watch import watch_parent; watch_parent(); time.sleep(120)"])
elif mode == "harness":        # the preexec_fn of the servers the tests start (tests/triton_server.py)
    from tests.triton_server import ends_with_this_process
    child = subprocess.Popen(["sleep", "120"], preexec_fn=ends_with_this_process())
else:
    child = subprocess.Popen(["sleep", "120"], preexec_fn=parent_death_signal(os.getpid()))
print(child.pid, flush=True)
time.sleep(120)
"""


@contextlib.contextmanager
def _middle(mode: str) -> Iterator[tuple[subprocess.Popen[str], int]]:
    middle = subprocess.Popen([sys.executable, "-c", _MIDDLE, mode], stdout=subprocess.PIPE, text=True)
    grandchild = int(middle.stdout.readline())  # type: ignore[union-attr]
    try:
        yield middle, grandchild
    finally:
        for pid in (middle.pid, grandchild):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        middle.wait(10)


@pytest.mark.parametrize("mode", ["watch", "pdeathsig", "harness"])
def test_a_child_ends_when_its_parent_is_killed(mode: str) -> None:
    with _middle(mode) as (middle, grandchild):
        assert wait_until(lambda: alive(grandchild), timeout_s=10)
        # alive while its parent lives (the watch does not fire by itself)
        assert not wait_until(lambda: not alive(grandchild), timeout_s=1.0)
        middle.kill()
        middle.wait(10)
        assert wait_until(lambda: not alive(grandchild), timeout_s=5), f"{mode}: pid {grandchild} outlived its parent"


_OWNER = """
import sys, time
from pathlib import Path
from helios_backend.triton.instances import Claim
Claim.take(sys.argv[1], Path(sys.argv[2]), registry=Path(sys.argv[3]))
print("claimed", flush=True)
time.sleep(120)
"""


def test_a_start_removes_the_state_of_a_dead_instance_only(tmp_path: Path) -> None:
    registry = tmp_path / "registry"
    owners, states = [], []
    try:
        for _ in range(2):
            prefix = f"helios-serve-{uuid.uuid4().hex[:8]}-"
            workdir = Path(tempfile.mkdtemp(prefix="helios-serve-", dir=tmp_path))
            region = Path("/dev/shm") / f"{prefix}region"
            region.write_bytes(b"x")
            owner = subprocess.Popen([sys.executable, "-c", _OWNER, prefix, str(workdir), str(registry)],
                                     stdout=subprocess.PIPE, text=True)
            assert owner.stdout.readline().strip() == "claimed"  # type: ignore[union-attr]
            owners.append(owner)
            states.append((prefix, workdir, region))
        assert reap_dead(registry) == []                       # both owners live
        owners[0].kill()
        owners[0].wait(10)
        [dead] = reap_dead(registry)
        assert (dead.pid, dead.shm_prefix, dead.workdir) == (owners[0].pid, states[0][0], str(states[0][1]))
        assert not states[0][1].exists() and not states[0][2].exists()
        assert states[1][1].is_dir() and states[1][2].exists()  # the living instance keeps its state
        assert [p.name for p in registry.iterdir()] == [f"{states[1][0].rstrip('-')}.lock"]
    finally:
        for owner in owners:
            owner.kill()
            owner.wait(10)
        for _, _, region in states:
            region.unlink(missing_ok=True)


def test_a_released_claim_leaves_no_lock(tmp_path: Path) -> None:
    claim = Claim.take("helios-serve-0000abcd-", None, registry=tmp_path)
    assert claim.path.exists()
    claim.release()
    assert list(tmp_path.iterdir()) == [] and reap_dead(tmp_path) == []


# The watch's own report goes to fd 2, which under helios-serve is a pipe that the dead parent
# read (its log copy): the write fails with a broken pipe, and the exit must happen all the same.
_BROKEN_STDERR = """
import os, sys
from helios_backend.triton.parent_watch import _exit_orphan
read_end, write_end = os.pipe()
os.close(read_end)                        # nobody reads: a write raises EPIPE (SIGPIPE is ignored)
os.dup2(write_end, 2)
_exit_orphan(12345)
os._exit(0)                               # reached only if the exit did not happen
"""


def test_an_orphan_exits_even_when_its_stderr_has_no_reader() -> None:
    from helios_backend.triton.parent_watch import ORPHAN_EXIT_CODE
    done = subprocess.run([sys.executable, "-c", _BROKEN_STDERR], timeout=60)
    assert done.returncode == ORPHAN_EXIT_CODE


def test_a_start_ends_the_leftover_processes_of_a_dead_instance(tmp_path: Path) -> None:
    """An orphan that its parent watch did not end (a stub whose argv names the instance's
    regions) is ended before its regions and workdir are removed; other processes are not."""
    registry = tmp_path / "registry"
    prefix = f"helios-serve-{uuid.uuid4().hex[:8]}-"
    workdir = Path(tempfile.mkdtemp(prefix="helios-serve-", dir=tmp_path))
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    leftover = subprocess.Popen(sleeper + [f"{prefix}stub-region"])
    bystander = subprocess.Popen(sleeper + ["helios-serve-ffffffff-other"])
    owner = subprocess.Popen([sys.executable, "-c", _OWNER, prefix, str(workdir), str(registry)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "claimed"  # type: ignore[union-attr]
        owner.kill()
        owner.wait(10)
        [dead] = reap_dead(registry)
        assert dead.killed == (leftover.pid,)
        assert leftover.wait(10) == -signal.SIGKILL
        assert bystander.poll() is None and not workdir.exists()
    finally:
        for process in (leftover, bystander, owner):
            process.kill()
            process.wait(10)
