"""Verification throughput of `helios-core verify` on a multi-GiB core, beside
`sha256sum` and `zstd -d` on the same stored bytes, in the same run.

    .venv/bin/python -m bench.verify_throughput [--gib 2] [--workdir DIR] [--keep]

It writes one weight-like resource (fp16 values of a normal distribution, which zstd
level 3 barely compresses, as with real weights) into a payload core, warms the page
cache, then times three commands over the same bytes:
    helios-core verify CORE          chunk digests + strict frame decode + signature + contract
    sha256sum CORE                   one digest over the file (a lower bound for hashing)
    zstd -d -c FRAME > /dev/null     decoding the resource's stored frame alone
and prints MB/s (1 MB = 10^6 bytes of stored data) and the ratios verify/sha256sum and
verify/zstd. Needs the zstd command line tool: `apt-get install -y zstd` (Debian/Ubuntu)
or `brew install zstd`; without it the zstd column says so.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from helios_backend.core import ResourceInput, ResourceKind, open_core, write_payload_core
from tests.contract_samples import sample_contract, sample_manifest
from tests.core_helpers import NAMESPACE, SIGNING_KEY

BLOCK_NBYTES = 64 << 20


def write_weights(path: pathlib.Path, nbytes: int, seed: int = 0) -> None:
    """nbytes of fp16 normal(0, 0.02) values, written in 64 MiB blocks."""
    rng = np.random.default_rng(seed)
    with open(path, "wb") as out:
        remaining = nbytes
        while remaining:
            count = min(BLOCK_NBYTES, remaining) // 2
            out.write((rng.standard_normal(count, dtype=np.float32) * 0.02).astype(np.float16).tobytes())
            remaining -= count * 2


def timed(command: list[str], stdout=subprocess.DEVNULL) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=stdout)
    return time.perf_counter() - start


def extract_frame(core_path: pathlib.Path, resource_id: str, frame_path: pathlib.Path) -> int:
    """Copy one resource's stored frame out of the core (for the zstd baseline)."""
    with open_core(core_path) as core:
        entry = core._entry(resource_id)  # the bench needs the stored offset
        offset, nbytes = entry.offset, entry.info.stored_nbytes
    with open(core_path, "rb") as source, open(frame_path, "wb") as out:
        source.seek(offset)
        remaining = nbytes
        while remaining:
            piece = source.read(min(BLOCK_NBYTES, remaining))
            out.write(piece)
            remaining -= len(piece)
    return nbytes


def warm(path: pathlib.Path) -> None:
    with open(path, "rb") as source:
        while source.read(BLOCK_NBYTES):
            pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=2.0, help="decoded size of the resource in GiB")
    parser.add_argument("--workdir", type=pathlib.Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the generated files")
    parser.add_argument("--repeat", type=int, default=2, help="runs per command; the best is reported")
    args = parser.parse_args()
    workdir = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="helios-verify-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    weights, core_path, frame_path = workdir / "weights.bin", workdir / "bench.core", workdir / "weights.zst"
    script = shutil.which("helios-core", path=str(pathlib.Path(sys.executable).parent)) or shutil.which("helios-core")
    helios_core = [script] if script else [sys.executable, "-m", "helios_backend.cli.core"]
    try:
        decoded = int(args.gib * (1 << 30)) // 2 * 2
        print(f"writing {decoded / 2**30:.2f} GiB of fp16 weights and a payload core in {workdir} ...", flush=True)
        write_weights(weights, decoded)
        start = time.perf_counter()
        write_payload_core(
            core_path, contract=sample_contract(), manifest=sample_manifest(),
            resources=[ResourceInput("weights", ResourceKind.RESOURCE_KIND_WEIGHTS, weights),
                       ResourceInput("kernels", ResourceKind.RESOURCE_KIND_KERNEL_MODULE, b"k" * 4096),
                       ResourceInput("tokenizer", ResourceKind.RESOURCE_KIND_TOKENIZER, b"{}"),
                       ResourceInput("chat_template", ResourceKind.RESOURCE_KIND_CHAT_TEMPLATE, b"{{ x }}")],
            namespace=NAMESPACE, signing_key=SIGNING_KEY,
        )
        write_seconds = time.perf_counter() - start
        weights.unlink()
        stored = extract_frame(core_path, "weights", frame_path)
        core_nbytes = core_path.stat().st_size
        print(f"core {core_nbytes / 1e6:.0f} MB (weights frame {stored / 1e6:.0f} MB stored, "
              f"{decoded / 1e6:.0f} MB decoded); written in {write_seconds:.1f} s "
              f"({decoded / 1e6 / write_seconds:.0f} MB/s decoded)")
        warm(core_path)
        warm(frame_path)

        def best(command: list[str]) -> float:
            return min(timed(command) for _ in range(args.repeat))

        verify_s = best([*helios_core, "verify", str(core_path), "--accept", NAMESPACE])
        sha_s = best(["sha256sum", str(core_path)])
        rows = [("helios-core verify", core_nbytes, verify_s), ("sha256sum", core_nbytes, sha_s)]
        zstd = shutil.which("zstd")
        if zstd:
            rows.append(("zstd -d", stored, best([zstd, "-q", "-d", "-c", str(frame_path)])))
        print(f"\n{'command':<22}{'MB':>10}{'seconds':>10}{'MB/s':>10}")
        for name, nbytes, seconds in rows:
            print(f"{name:<22}{nbytes / 1e6:>10.0f}{seconds:>10.2f}{nbytes / 1e6 / seconds:>10.0f}")
        verify_rate = core_nbytes / verify_s
        print(f"\nverify / sha256sum = {verify_rate / (core_nbytes / sha_s):.2f}")
        if zstd:
            print(f"verify / zstd -d   = {verify_rate / (stored / rows[2][2]):.2f}")
        else:
            print("verify / zstd -d   = n/a: the zstd CLI is missing (apt-get install -y zstd)")
        print(f"({os.cpu_count()} CPUs; verify hashes every 4 MiB chunk and decodes the frame in one pass)")
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
