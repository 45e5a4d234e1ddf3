"""The benchmark to run first on this machine (`make bench`).

    python -m bench [--device auto|gpu|cpu] [--core CORE] [--out DIR | --results] [--no-peer]
                    [--dry-run] [-- ARGUMENTS OF THE BENCHMARK]
    python -m bench --list          # every benchmark of the package, one line each

Where the CUDA executor can run (cuda-bindings sees a device; `EXECUTOR=cuda make bench`
installs them), the GPU decode benchmark on the prepared core (bench.gpu_decode --core: decode
tokens/s per batch, prefill, the HBM roofline); elsewhere the CPU executor benchmark
(bench.cpu_executor: decode and prefill tokens/s and the resident set, beside llama.cpp on the
same GGUF when llama-cpp-python, the `bench` extra, is installed, alone otherwise). Either writes
to var/bench/<device>/ (untracked) unless `--results` (bench/results/<device>/, the figures the
README quotes) or `--out` says otherwise; bench/harness.py names the device.
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import pathlib
import subprocess
import sys
from collections.abc import Callable, Sequence

from bench.harness import DEFAULT_CORE, Processor

PACKAGE = pathlib.Path(__file__).resolve().parent
# the benchmark each processor runs first
FIRST: dict[Processor, str] = {"gpu": "bench.gpu_decode", "cpu": "bench.cpu_executor"}
HELPERS = {"__init__", "__main__", "harness", "sse"}     # modules of the package that measure nothing


def gpu_usable() -> bool:
    """The CUDA executor's own test: cuda-bindings imports and the driver reports a device."""
    try:
        from helios_backend.executors.cuda.driver import gpu_available
    except ImportError:
        return False
    return gpu_available()


def peer_installed() -> bool:
    """llama-cpp-python (the `bench` extra), the CPU benchmark's peer."""
    return importlib.util.find_spec("llama_cpp") is not None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0],
                                epilog="Arguments after `--` go to the chosen benchmark unchanged.")
    p.add_argument("--device", choices=("auto", "gpu", "cpu"), default="auto",
                   help="auto (default): gpu where the CUDA executor can run, else cpu")
    p.add_argument("--core", type=pathlib.Path, default=DEFAULT_CORE,
                   help=f"the prepared core to measure (default {DEFAULT_CORE}: `make core` prepares it)")
    p.add_argument("--out", type=pathlib.Path, default=None,
                   help="write the results here (default var/bench/<device>/)")
    p.add_argument("--results", action="store_true", help="write them into bench/results/<device>/ (tracked)")
    p.add_argument("--no-peer", action="store_true", help="cpu: measure without llama.cpp even where it is installed")
    p.add_argument("--dry-run", action="store_true", help="print the command and run nothing")
    p.add_argument("--list", action="store_true", help="list the package's benchmarks and exit")
    p.add_argument("extra", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return p


def choose(device: str, usable: Callable[[], bool]) -> Processor:
    """The processor to measure: `device` unless auto, then the GPU where `usable()` says so."""
    if device == "gpu":
        return "gpu"
    if device == "cpu":
        return "cpu"
    return "gpu" if usable() else "cpu"


def command(processor: Processor, args: argparse.Namespace, peer: bool) -> list[str]:
    """The chosen benchmark's command line."""
    argv = [sys.executable, "-m", FIRST[processor], "--core", str(args.core)]
    if processor == "cpu" and (args.no_peer or not peer):
        argv.append("--no-peer")
    if args.out is not None:
        argv += ["--out", str(args.out)]
    elif args.results:
        argv.append("--results")
    extra = list(args.extra)
    return argv + (extra[1:] if extra[:1] == ["--"] else extra)


def listing(package: pathlib.Path = PACKAGE) -> list[tuple[str, str]]:
    """(module, the first paragraph of its docstring) of every benchmark of the package, read
    without importing them (the GPU ones need cuda-bindings)."""
    out = []
    for path in sorted(package.glob("*.py")):
        if path.stem not in HELPERS:
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            out.append((f"bench.{path.stem}", " ".join(doc.split("\n\n")[0].split())))
    return out


def main(argv: Sequence[str] | None = None, usable: Callable[[], bool] = gpu_usable,
         peer: Callable[[], bool] = peer_installed) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.list:
        for module, line in listing():
            print(f"python -m {module:28s} {line}")
        return 0
    if args.out is not None and args.results:
        p.error("--out and --results: give one (--results writes into bench/results/<device>/)")
    processor = choose(args.device, usable)
    if args.device == "gpu" and not usable():
        p.error("--device gpu: the CUDA executor cannot run here (no device, or cuda-bindings missing: "
                "EXECUTOR=cuda make install adds them)")
    if not args.core.exists():
        p.error(f"--core {args.core}: no such core (`make core` prepares the default one)")
    cpu_peer = processor == "cpu" and peer()
    argv_ = command(processor, args, cpu_peer)
    print("$ " + " ".join(argv_), flush=True)
    if processor == "cpu" and not cpu_peer and not args.no_peer:
        print("llama-cpp-python is not installed, so no llama.cpp peer in this run (the `bench` extra: "
              "pip install --no-binary llama-cpp-python 'llama-cpp-python==0.3.36')", flush=True)
    if args.dry_run:
        return 0
    return subprocess.run(argv_).returncode


if __name__ == "__main__":
    sys.exit(main())
