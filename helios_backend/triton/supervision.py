"""helios-serve's supervision of tritonserver and the gateway: fail loudly, restart, stop cleanly.

Why a supervisor: Triton 2.51 neither restarts a dead Python stub of a decoupled model nor
reports it (readiness stays green and in-flight streams never end, shared/notes/
triton-backend.md section 7), and with `--exit-on-error=false` a model that fails to load
leaves a model-less server running. So helios-serve watches three things itself:

* the model's load state (Triton's repository index): UNAVAILABLE exits non-zero at once,
  naming Triton's reason (tampered core, invalid contract, bad option);
* the stub process (a child of tritonserver): when it dies, tritonserver is killed (its
  streams then break, so every in-flight gateway request gets its terminal error) and
  started again after a backoff; its /dev/shm regions are removed first. The stub also ends
  itself when a thread of its engine dies (exit STUB_EXIT_ENGINE_FAILED, cause
  `engine_failed`), after answering every open request with its failure;
* the gateway: if it exits before it ever answered HTTP, startup failed (exit non-zero);
  later, it is restarted after a backoff;
* the local rank processes of a tensor-parallel core served with --rank-peers processes
  (helios-rank, ranks 1..N-1; rank 0 is the stub): one that exits before the model was ready
  fails startup (a refusal at rendezvous names the field that differs); later, a rank that
  exits gets RANK_LOSS_GRACE_S for rank 0 to fail its requests with the cause, then the
  server and every rank are restarted together (a rank's device state cannot outlive the
  others'). Rank 0 losing a rank (one that died or stopped answering) fails every request
  and its stub exits, which is the stub case above; the ranks restart with the server.

Every restart is counted in a small JSON state file the gateway exports on /metrics
(`helios_serve_restarts_total{process, cause}`). Each child runs in its own session, so a
signal to helios-serve's process group reaches only helios-serve, which then stops the
children in order: the gateway first (its open streams end with a `shutting_down` event),
then tritonserver, which is ended as soon as its model has unloaded (its stub exited) rather than
after its own one-second exit poll; whatever still runs at the deadline is killed with its whole
group.
"""
from __future__ import annotations

import enum
import json
import logging
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import IO
from dataclasses import dataclass, field
from pathlib import Path

from helios_backend.triton.parent_watch import parent_death_signal

log = logging.getLogger("helios.serve")

POLL_S = 0.1                    # one supervision pass: stub liveness, load state, exits
STUB_NAME = "triton_python_b"   # the stub's comm (the kernel keeps 15 characters)
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 10.0
STABLE_S = 30.0                 # a child that ran this long resets its backoff
MAX_FAILED_STARTS = 5           # consecutive restarts that never became ready: give up
GATEWAY_ANSWER_TIMEOUT_S = 60.0
STOP_DEADLINE_S = 9.0           # SIGTERM -> every process gone (the bound is 10 s)
GATEWAY_STOP_S = 6.0            # the gateway's 5 s drain (HTTP-15) and its exit
# The stub's exit status after its engine failed (a worker or response thread died, every open
# request already answered with its failure): EX_SOFTWARE. Any other end of the stub is "stub_died".
STUB_EXIT_ENGINE_FAILED = 70
RANK_LOSS_GRACE_S = 1.0         # a rank exited: rank 0 fails its requests with the cause first


class ExitCode(enum.IntEnum):
    OK = 0
    USAGE = 2
    MODEL_FAILED = 3            # the model did not load (Triton's reason is printed)
    GATEWAY_FAILED = 4          # the gateway exited before it answered HTTP
    TRITON_FAILED = 5           # tritonserver exited before the model was ready
    READY_TIMEOUT = 6           # --ready-timeout passed
    RANK_FAILED = 7             # a rank process exited before the model was ready


class SupervisionFailed(Exception):
    def __init__(self, code: ExitCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Child:
    """One supervised process with its own process group (its stub and helpers included)."""

    def __init__(self, name: str, argv: Callable[[], Sequence[str]], env: dict[str, str] | None = None,
                 output: Callable[[IO[bytes]], object] | None = None) -> None:
        self.name = name
        self._argv = argv
        self._env = env
        self._output = output      # reads the child's stdout and stderr (a pipe); None: inherited
        self.process: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0

    def start(self) -> None:
        # its own session (a signal to helios-serve's group is not theirs), and SIGKILL when
        # helios-serve dies: started from the main thread, which lives as long as the process
        piped = self._output is not None
        self.process = subprocess.Popen(list(self._argv()), env=self._env, start_new_session=True,
                                        preexec_fn=parent_death_signal(os.getpid()), stdout=subprocess.PIPE if piped else None,
                                        stderr=subprocess.STDOUT if piped else None)
        if self._output is not None:
            assert self.process.stdout is not None
            self._output(self.process.stdout)
        self.started_at = time.monotonic()

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def signal(self, signum: int) -> None:
        if self.running():
            self.process.send_signal(signum)  # type: ignore[union-attr]

    def kill_group(self) -> None:
        """SIGKILL the child's whole process group (tritonserver and its stub) and reap it."""
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            pass


@dataclass
class Backoff:
    """Restart delays 0.5, 1, 2 ... 10 s; a child that stayed up STABLE_S starts over."""
    failures: int = 0

    def next_delay(self, uptime_s: float) -> float:
        if uptime_s >= STABLE_S:
            self.failures = 0
        delay = min(BACKOFF_FIRST_S * 2 ** self.failures, BACKOFF_MAX_S)
        self.failures += 1
        return delay


def child_pids(parent: int, comm_prefix: str) -> set[int]:
    """The children of `parent` whose command name (comm) starts with `comm_prefix`."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        if ppid == parent and comm.startswith(comm_prefix):
            found.add(int(entry.name))
    return found


def stub_pids(parent: int) -> set[int]:
    """The python-backend stubs tritonserver started."""
    return child_pids(parent, STUB_NAME)


def process_alive(pid: int) -> bool:
    """False once the process is gone or a zombie (Triton does not reap its stubs)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def stub_exit_code(pid: int) -> int | None:
    """The exit code of a dead, unreaped process (its zombie's /proc stat keeps the wait
    status, field 52); None when it was killed by a signal or is gone already."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        status = int(fields[49])
    except (OSError, IndexError, ValueError):
        return None
    return None if status & 0x7F else (status >> 8) & 0xFF


def model_state(host: str, http_port: int, model: str) -> tuple[str, str]:
    """(state, reason) of `model` in Triton's repository index; ("", "") when unknown yet."""
    request = urllib.request.Request(f"http://{host}:{http_port}/v2/repository/index", data=b"{}",
                                     method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=2) as response:
            index = json.loads(response.read())
    except (OSError, ValueError):
        return "", ""
    for entry in index:
        if entry.get("name") == model:
            return str(entry.get("state", "")), str(entry.get("reason", ""))
    return "", ""


def http_answers(url: str) -> bool:
    """Any HTTP answer (a 503 included) means the server is up."""
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


@dataclass
class RestartLedger:
    """Restarts per (process, cause), rewritten atomically for the gateway's /metrics."""
    path: Path
    counts: dict[tuple[str, str], int] = field(default_factory=dict)
    backoff_s: float = 0.0

    def record(self, process: str, cause: str, delay_s: float) -> None:
        self.counts[(process, cause)] = self.counts.get((process, cause), 0) + 1
        self.backoff_s = delay_s
        self.write()

    def write(self) -> None:
        state = {"restarts": [{"process": p, "cause": c, "count": n} for (p, c), n in sorted(self.counts.items())],
                 "backoff_seconds": self.backoff_s}
        scratch = self.path.with_suffix(".tmp")
        scratch.write_text(json.dumps(state))
        scratch.replace(self.path)


@dataclass
class SupervisorConfig:
    http_port: int
    gateway_url: str | None              # the gateway's /health URL, None without a gateway
    ready_timeout_s: float
    model: str = "helios"
    host: str = "127.0.0.1"              # where this host reaches tritonserver's HTTP port


class Supervisor:
    """The supervision loop. `run` returns the process exit code; `request_stop` may be
    called from a signal handler."""

    def __init__(self, config: SupervisorConfig, triton: Child, gateway: Child | None, ledger: RestartLedger,
                 after_triton_stop: Callable[[], None], ranks: Sequence[Child] = ()) -> None:
        self.config = config
        self.triton = triton
        self.gateway = gateway
        self.ranks = tuple(ranks)               # local rank processes, started and restarted with the server
        self._rank_exit_seen: float | None = None
        self.ledger = ledger
        self._after_triton_stop = after_triton_stop   # removes the server's /dev/shm regions
        self._stop_requested = False
        self._backoff = {"tritonserver": Backoff(), "gateway": Backoff()}
        self._restart_at: dict[str, float] = {}
        self._model_ready = False
        self._ever_ready = False
        self._failed_starts = 0
        self._stubs: set[int] = set()
        self._gateway_answered = False
        self._gateway_started_at = 0.0

    def request_stop(self, _signum: int = 0, _frame: object = None) -> None:
        self._stop_requested = True

    # ---- the loop --------------------------------------------------------------------------
    def run(self) -> int:
        self.ledger.write()
        self._start_server()
        if self.gateway is not None:
            # at once, not when the model is ready: the gateway's liveness probe (/livez) answers
            # through a long load while its readiness (/readyz) says the model is not ready yet
            self._start_gateway()
        ready_deadline = time.monotonic() + self.config.ready_timeout_s
        try:
            while not self._stop_requested:
                now = time.monotonic()
                self._watch_ranks(now)
                self._watch_triton(now, ready_deadline)
                if self.gateway is not None:
                    self._watch_gateway(now)
                self._start_due(now)
                time.sleep(POLL_S)
        except SupervisionFailed as failure:
            log.error("helios-serve: %s", failure)
            self.stop()
            return int(failure.code)
        self.stop()
        return int(ExitCode.OK)

    def _watch_triton(self, now: float, ready_deadline: float) -> None:
        if "tritonserver" in self._restart_at:
            return
        if not self.triton.running():
            code = self.triton.exit_code()
            if not self._ever_ready:
                raise SupervisionFailed(ExitCode.TRITON_FAILED,
                                        f"tritonserver exited with code {code} before the model was ready")
            self._restart("tritonserver", f"exited_{'signal' if code is not None and code < 0 else 'code'}",
                          f"tritonserver exited with code {code}")
            return
        if not self._model_ready:
            state, reason = model_state(self.config.host, self.config.http_port, self.config.model)
            if state == "UNAVAILABLE":
                raise SupervisionFailed(ExitCode.MODEL_FAILED, f"the {self.config.model} model failed to load: "
                                                               f"{reason or 'see the tritonserver log above'}")
            if state == "READY":
                self._stubs = stub_pids(self.triton.pid)
                self._model_ready = self._ever_ready = True
                self._failed_starts = 0
                log.info("helios-serve: the model is ready (stub pids %s)", sorted(self._stubs))
                if self.gateway is not None and not self.gateway.running() and "gateway" not in self._restart_at:
                    self._start_gateway()
            elif now > ready_deadline and not self._ever_ready:
                raise SupervisionFailed(ExitCode.READY_TIMEOUT, f"the model was not ready within "
                                                                f"{self.config.ready_timeout_s:.0f}s")
            return
        dead = [pid for pid in self._stubs if not process_alive(pid)]
        if dead:
            if stub_exit_code(dead[0]) == STUB_EXIT_ENGINE_FAILED:
                self._restart("tritonserver", "engine_failed", f"the helios engine failed in the python "
                                                               f"backend stub (pid {dead[0]}), which exited")
            else:
                self._restart("tritonserver", "stub_died", f"the python backend stub (pid {dead[0]}) died")

    def _stubs_gone(self) -> bool:
        """The ready model's stubs have all exited (its unload finished)."""
        return bool(self._stubs) and not any(process_alive(pid) for pid in self._stubs)

    def _start_server(self) -> None:
        """The rank processes first (they wait for rank 0's store), then tritonserver."""
        for rank in self.ranks:
            rank.start()
        self._rank_exit_seen = None
        self.triton.start()

    def _watch_ranks(self, now: float) -> None:
        if "tritonserver" in self._restart_at:
            return
        exited = [rank for rank in self.ranks if not rank.running()]
        if not exited:
            return
        rank = exited[0]
        why = f"{rank.name} exited with code {rank.exit_code()}"
        if not self._ever_ready:
            raise SupervisionFailed(ExitCode.RANK_FAILED, f"{why} before the model was ready "
                                                          "(its log above says why)")
        if self._rank_exit_seen is None:
            self._rank_exit_seen = now
        elif now - self._rank_exit_seen >= RANK_LOSS_GRACE_S:
            self._restart("tritonserver", "rank_exited", why)

    def _watch_gateway(self, now: float) -> None:
        gateway = self.gateway
        assert gateway is not None and self.config.gateway_url is not None
        if gateway.process is None or "gateway" in self._restart_at:
            return
        if not gateway.running():
            code = gateway.exit_code()
            if not self._gateway_answered:
                raise SupervisionFailed(ExitCode.GATEWAY_FAILED,
                                        f"the gateway exited with code {code} before it answered HTTP")
            self._restart("gateway", "exited", f"the gateway exited with code {code}")
            return
        if not self._gateway_answered:
            if http_answers(self.config.gateway_url):
                self._gateway_answered = True
                log.info("helios-serve: the gateway answers at %s", self.config.gateway_url)
            elif now - self._gateway_started_at > GATEWAY_ANSWER_TIMEOUT_S:
                raise SupervisionFailed(ExitCode.GATEWAY_FAILED, "the gateway did not answer HTTP within "
                                                                 f"{GATEWAY_ANSWER_TIMEOUT_S:.0f}s")

    def _restart(self, name: str, cause: str, why: str) -> None:
        child = self.triton if name == "tritonserver" else self.gateway
        assert child is not None
        uptime = time.monotonic() - child.started_at
        if name == "tritonserver":
            child.kill_group()            # a dead stub's streams would never end otherwise
            for rank in self.ranks:       # every rank restarts with rank 0
                rank.kill_group()
            self._after_triton_stop()
            self._model_ready = False
            self._stubs = set()
            if uptime < STABLE_S:
                self._failed_starts += 1
            if self._failed_starts > MAX_FAILED_STARTS:
                raise SupervisionFailed(ExitCode.TRITON_FAILED, f"{why}; {MAX_FAILED_STARTS} restarts in a row "
                                                                "did not stay up, giving up")
        else:
            child.kill_group()
            self._gateway_answered = False
        delay = self._backoff[name].next_delay(uptime)
        self.ledger.record(name, cause, delay)
        log.error("helios-serve: %s; restarting %s in %.1fs", why, name, delay)
        self._restart_at[name] = time.monotonic() + delay

    def _start_due(self, now: float) -> None:
        for name, at in list(self._restart_at.items()):
            if now < at:
                continue
            del self._restart_at[name]
            if name == "tritonserver":
                self._start_server()
            else:
                self._start_gateway()

    def _start_gateway(self) -> None:
        assert self.gateway is not None
        self.gateway.start()
        self._gateway_started_at = time.monotonic()
        self._gateway_answered = False

    # ---- stopping --------------------------------------------------------------------------
    def stop(self) -> None:
        """Gateway first (its streams end with `shutting_down`), then tritonserver; all gone
        by STOP_DEADLINE_S, killed with their process groups if need be."""
        start = time.monotonic()
        deadline = start + STOP_DEADLINE_S
        if self.gateway is not None and self.gateway.running():
            log.info("helios-serve: stopping the gateway")
            self.gateway.signal(signal.SIGTERM)
            _wait(self.gateway, min(deadline, time.monotonic() + GATEWAY_STOP_S))
        log.info("helios-serve: stopping tritonserver (%.1fs)", time.monotonic() - start)
        self.triton.signal(signal.SIGINT)
        _wait(self.triton, deadline, done=self._stubs_gone)
        if self.triton.running() and self._stubs_gone():
            # the model unloaded and its stub exited: tritonserver has nothing left to do, yet it
            # only looks again after a one-second poll (server.cc's exit loop); end it now
            log.info("helios-serve: the model unloaded; ending tritonserver")
            self.triton.kill_group()
        for rank in self.ranks:            # rank 0's unload closed their links: they end by themselves
            _wait(rank, min(deadline, time.monotonic() + 1.0))
        for child in (self.gateway, self.triton, *self.ranks):
            if child is not None:
                if child.running():
                    log.error("helios-serve: %s did not stop in time; killing it", child.name)
                child.kill_group()     # also what a child left behind in its group (a stub)
        self._after_triton_stop()
        log.info("helios-serve: stopped (%.1fs)", time.monotonic() - start)


def _wait(child: Child, deadline: float, done: Callable[[], bool] = lambda: False) -> None:
    while child.running() and time.monotonic() < deadline and not done():
        time.sleep(0.05)
