"""Resources stream: neither writing nor verifying holds a whole resource in memory."""
from __future__ import annotations

import tracemalloc

from helios_backend.core import ResourceInput, ResourceKind, open_core
from helios_backend.core.constants import MiB
from tests.core_helpers import random_bytes, sample_resources, write_sample_core

RESOURCE_NBYTES = 48 * MiB   # incompressible: stored ~48 MiB in 12 chunks
PEAK_LIMIT = 28 * MiB        # a few 4 MiB chunks in flight + 1 MiB decoded pieces, far below the resource


def _peak(run) -> int:
    tracemalloc.start()
    try:
        run()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_writer_and_verify_stream_in_bounded_memory(tmp_path):
    # spec: FMT-5 (issue: a core larger than memory can be verified)
    source = tmp_path / "weights.bin"
    with open(source, "wb") as out:
        for index in range(RESOURCE_NBYTES // MiB):
            out.write(random_bytes(MiB, seed=index))
    resources = [ResourceInput("weights", ResourceKind.RESOURCE_KIND_WEIGHTS, source)] + sample_resources()[1:]
    path = tmp_path / "big.core"
    write_peak = _peak(lambda: write_sample_core(path, resources))
    assert write_peak < PEAK_LIMIT, write_peak

    def verify():
        with open_core(path) as core:
            core.verify()

    verify_peak = _peak(verify)
    assert verify_peak < PEAK_LIMIT, verify_peak

    def iterate():
        with open_core(path) as core:
            total = sum(len(piece) for piece in core.iter_resource("weights"))
            assert total == RESOURCE_NBYTES

    assert _peak(iterate) < PEAK_LIMIT
