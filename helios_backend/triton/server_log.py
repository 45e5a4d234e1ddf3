"""tritonserver's output as helios-serve passes it on: GPU-probe lines explained, not alarming.

A tritonserver built with GPU support probes for CUDA, NVML and DCGM at start, and on a machine
without a GPU each probe prints an error- or warning-level line (`E... CudaDriverHelper has not
been initialized.`) that reads as a failure although nothing failed: the CPU and numpy
executors need no GPU. helios-serve starts tritonserver with its output on a pipe and copies
every line through ServerLog: with an executor that needs no GPU, those probe lines are
replaced by one info line that says what they were; with the cuda executor they are real
errors and pass unchanged. Everything else passes unchanged, in order.
"""
from __future__ import annotations

import re
import sys
import threading
from typing import IO

# the lines a GPU build of tritonserver 2.51 prints on a host without a usable GPU
GPU_PROBE_LINES = (
    re.compile(r"CudaDriverHelper has not been initialized"),
    re.compile(r"Unable to allocate pinned system memory.*CUDA driver"),
    re.compile(r"Failed to initialize NVML"),
    re.compile(r"DCGM unable to start"),
)
EXPLANATION = ("helios-serve: tritonserver found no usable GPU (expected with the {executor} executor); "
               "its GPU-probe lines (CudaDriverHelper, pinned memory, NVML, DCGM) are left out\n")


class ServerLog:
    """Copies a child's output lines to `sink`, filtering GPU-probe lines unless a GPU is expected."""

    def __init__(self, executor: str, sink: IO[str] | None = None) -> None:
        self._executor = executor
        self._sink = sink
        self._explained = False

    def line(self, text: str) -> str | None:
        """What to print for one line of output (None: nothing)."""
        if self._executor == "cuda" or not any(p.search(text) for p in GPU_PROBE_LINES):
            return text
        if self._explained:
            return None
        self._explained = True
        return EXPLANATION.format(executor=self._executor)

    def copy(self, stream: IO[bytes]) -> threading.Thread:
        """Start a daemon thread copying `stream` until it closes (the child exited)."""
        def run() -> None:
            sink = self._sink or sys.stderr
            for raw in iter(stream.readline, b""):
                out = self.line(raw.decode("utf-8", "replace"))
                if out is not None:
                    sink.write(out)
                    sink.flush()
            stream.close()

        thread = threading.Thread(target=run, name="tritonserver-log", daemon=True)
        thread.start()
        return thread
