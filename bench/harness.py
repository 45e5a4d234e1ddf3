"""What the benchmarks share: where results go, which device they name, and the served stack
they start, watch and read.

Results. Every benchmark that writes files writes them to one folder per device, named by
`device_slug` from the detected GPU (`nvidia-smi`'s name: "NVIDIA H100 80GB HBM3" ->
`h100-80gb-hbm3`, "NVIDIA H200" -> `h200`) or, for a CPU benchmark, from the CPU's model name
("AMD EPYC 7B13 64-Core Processor" -> `amd-epyc-7b13`). By default that folder is
var/bench/<device>/ (untracked); `--results` puts it under bench/results/<device>/, where the
figures the README quotes are kept; `--out DIR` names any folder. `folder_for` is that rule,
`output_dir` creates its folder, `add_output_arguments` adds the two flags.

The stack. `free_ports`, `wait_http` and `ServeProcess` start helios-serve on free loopback
ports and wait for it; `metric` reads one Prometheus family from a /metrics page; the /proc
readers (`cpu_seconds`, `descendants`, `stack_pids`) give the CPU each process of the stack
spent. `write_bundle_core` writes the device's model bundle (tests/gpu/model_bundle.py) as a
core the served benchmarks can start helios-serve on.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Literal

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
UNTRACKED = ROOT / "var" / "bench"
DEFAULT_CORE = pathlib.Path("var/cores/smollm2-135m-instruct.core")
BUNDLE_NAMESPACE = "helios.local/served-bench"     # the acceptance namespace of write_bundle_core's cores

Processor = Literal["gpu", "cpu"]


# ---- the device a result names -------------------------------------------------------------

# words of a device name that say nothing about the device's speed
_NOISE = re.compile(r"\(r\)|\(tm\)|\bcpu\b|\bprocessor\b|\b\d+-core\b|@.*$|^nvidia\b")


def device_slug(name: str) -> str:
    """A folder name for a device name: lower case, vendor marks, "CPU", "Processor", the core
    count, the clock and a leading "NVIDIA" dropped, every other run of non-alphanumerics one
    hyphen ("NVIDIA H100 80GB HBM3" -> "h100-80gb-hbm3", "Intel(R) Xeon(R) CPU @ 2.20GHz" ->
    "intel-xeon")."""
    slug = re.sub(r"[^a-z0-9]+", "-", _NOISE.sub(" ", name.strip().lower())).strip("-")
    if not slug:
        raise ValueError(f"no device name to make a folder of: {name!r}")
    return slug


def gpu_name() -> str | None:
    """The first GPU's name as nvidia-smi reports it, or None where there is none."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30, check=True).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        return None
    return out[0].strip() if out and out[0].strip() else None


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else the platform's processor or machine name."""
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    import platform

    return platform.processor() or platform.machine() or "cpu"


def device_name(processor: Processor) -> str:
    """The name of the device a benchmark of `processor` measures (a GPU benchmark on a machine
    where nvidia-smi answers nothing is named "unknown-gpu")."""
    if processor == "gpu":
        return gpu_name() or "unknown-gpu"
    return cpu_name()


# ---- where results go -------------------------------------------------------------------------

def commit() -> str | None:
    """The commit a figure was measured at: $HELIOS_COMMIT where set (a device machine's copy of
    the working tree has no git history), else the checkout's short HEAD, with "+" when tracked
    files changed; None when neither says."""
    named = os.environ.get("HELIOS_COMMIT")
    if named:
        return named
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+" if dirty else "")


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """--out and --results, resolved by output_dir."""
    parser.add_argument("--out", type=pathlib.Path, default=None,
                        help="write the result files here (default var/bench/<device>/)")
    parser.add_argument("--results", action="store_true",
                        help="write them into bench/results/<device>/, the tracked results the README quotes")


def output_dir(out: pathlib.Path | str | None, results: bool, processor: Processor,
               device: str | None = None) -> pathlib.Path:
    """The folder a benchmark writes to (folder_for), created."""
    folder = folder_for(out, results, processor, device)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def folder_for(out: pathlib.Path | str | None, results: bool, processor: Processor,
               device: str | None = None) -> pathlib.Path:
    """`out` when given, else bench/results/<device>/ with `results`, else var/bench/<device>/;
    <device> is device_slug of `device` (default: the detected device of `processor`)."""
    if out is not None:
        return pathlib.Path(out)
    return (RESULTS if results else UNTRACKED) / device_slug(device or device_name(processor))


# ---- the stack: ports, health, processes -------------------------------------------------------

def free_ports(count: int) -> list[int]:
    """`count` distinct loopback ports free now (held together while chosen, so none repeats)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Until `url` answers 200; fails early when `proc` exits first."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            program = proc.args[0] if isinstance(proc.args, list) else proc.args
            raise RuntimeError(f"{program!s} exited with {proc.returncode} before {url} answered")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=5).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {timeout_s:.0f} s")


def stop_group(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout_s: float = 60) -> None:
    """Stop a process started with start_new_session=True and everything in its group."""
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class ServeProcess:
    """helios-serve on free loopback ports: the gateway's URL, Triton's gRPC address and the
    backend's metrics page."""

    def __init__(self, proc: subprocess.Popen[bytes], gateway: int, grpc: int, metrics: int) -> None:
        self.proc = proc
        self.url = f"http://127.0.0.1:{gateway}"
        self.grpc = f"127.0.0.1:{grpc}"
        self.metrics = f"http://127.0.0.1:{metrics}/metrics"


@contextlib.contextmanager
def serving(core: pathlib.Path, executor: str, extra: Sequence[str] = (), log: pathlib.Path | None = None,
            timeout_s: float = 600) -> Iterator[ServeProcess]:
    """helios-serve on `core` until the block ends (its whole process group stopped then); its
    output goes to `log` (default: nowhere)."""
    http, grpc, metrics, gateway = free_ports(4)
    command = [str(pathlib.Path(sys.executable).with_name("helios-serve")), "--core", str(core),
               "--executor", executor, "--http-port", str(http), "--grpc-port", str(grpc),
               "--metrics-port", str(metrics), "--gateway-port", str(gateway), *extra]
    with contextlib.ExitStack() as stack:
        sink = stack.enter_context(open(log, "wb")) if log is not None else subprocess.DEVNULL
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        served = ServeProcess(proc, gateway, grpc, metrics)
        try:
            wait_http(served.url + "/health", timeout_s, proc)
            yield served
        finally:
            stop_group(proc)


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of one family's samples on a Prometheus text page whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            head, _, value = line.rpartition(" ")
            metric_name, _, label_text = head.partition("{")
            if metric_name == name and all(f'{k}="{v}"' in label_text for k, v in labels.items()):
                total += float(value)
    return total


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds the processes spent so far (/proc; a vanished one counts 0)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return total


def cmdline(pid: int) -> str:
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def descendants(root: int) -> list[int]:
    """`root` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def stack_pids(serve: int) -> tuple[list[int], list[int], list[int]]:
    """(gateway processes, backend stubs, engine processes) of one helios-serve: its gateway
    parent and workers, the stub, and the stub's engine process (none with --no-engine-process)."""
    tree = descendants(serve)
    gateways = [pid for pid in tree if "gateway.cli" in cmdline(pid)]
    return ([pid for g in gateways for pid in descendants(g)],
            [pid for pid in tree if "triton_python_backend_stub" in cmdline(pid)],
            [pid for pid in tree if "helios_backend.engine.process_child" in cmdline(pid)])


# ---- the device's model bundle as a core ----------------------------------------------------------

def write_bundle_core(path: pathlib.Path) -> None:
    """The model bundle (tests/gpu/model_bundle.py; HELIOS_RANDOM_WEIGHTS=1: random weights of the
    real layout) written as a core signed for BUNDLE_NAMESPACE."""
    from tests.gpu.model_bundle import bundle_dir, load_bundle, read_payload, write_core

    contract, manifest, read = load_bundle()
    payload = read_payload(bundle_dir() / "bundle.bin")
    resources = {rid: read(rid) for rid in list(payload["resources"]) + list(payload["weights_sha256"])}
    write_core(path, contract, manifest, resources, BUNDLE_NAMESPACE)
