"""Progress bars for preparation: one tqdm bar per long phase, fed (stage, done, total).

    bars = ProgressBars()
    prepare(recipe, options, progress=bars)     # checking source, reading weights, recording programs, compiling kernels
    write_payload_core(..., progress=lambda done, total: bars(WRITING, done, total))
    bars.close()

The stages are named here so every producer and the bars agree; a stage measured in bytes
shows byte units. Bars go to stderr (tqdm's default), so a served log shows them too.
"""
from __future__ import annotations

from collections.abc import Callable

from tqdm import tqdm

SOURCE = "checking source"             # a packaged source reassembled or its sha256 checked (ignition/sources/packaged.py)
READING = "reading weights"            # tensors converted and packed (ignition/preparation/prepare.py)
RECORDING = "recording programs"       # programs recorded, every rank's
COMPILING = "compiling kernels"        # kernel compilations done or found in the kernel cache
WRITING = "writing and signing core"   # decoded bytes written into the core
HASHING = "hashing weights"            # weight bytes hashed for the core cache key (ignition/core_cache.py)

Progress = Callable[[str, int, int], None]   # (stage, done, total)

UNITS = {SOURCE: "B", READING: "tensor", RECORDING: "program", COMPILING: "kernel", WRITING: "B", HASHING: "B"}


class ProgressBars:
    """Callable (stage, done, total): opens a bar on a stage's first report, closes it when done."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._bars: dict[str, tqdm] = {}

    def __call__(self, stage: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        bar = self._bars.get(stage)
        if bar is None:
            unit = UNITS.get(stage, "step")
            bar = self._bars[stage] = tqdm(total=total, desc=stage, unit=unit, unit_scale=unit == "B", leave=True)
        bar.total = total
        bar.update(done - bar.n)
        if done >= total:           # finished: the next report of this stage opens a new bar
            self._bars.pop(stage).close()

    def close(self) -> None:
        for bar in self._bars.values():
            bar.close()   # idempotent
