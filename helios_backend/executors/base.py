"""The Executor protocol both executors implement, and the load errors they share.

A step, from the host's side (frame f is 0 or 1; two frames let the host pack one while
the other runs):

    frame = executor.staging(f)          # np.ndarray[uint8] [transport.frame_nbytes], host memory
    packer.pack(program, f, lanes)       # writes the bound values into `frame`
    executor.launch(program, f)          # copy frame -> staging buffer, run the program's nodes,
                                         # copy the completion buffer back
    words = executor.wait(f)             # np.ndarray[int32]: header + one record per row

The executor owns the frame index and the submission sequence (BND-20): it writes
[sequence, frame] into the `transport.header` destination at launch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, Optional, Protocol, Union

import numpy as np

from helios_proto import contract_pb2 as cp

# the submissions a round may launch before its main step (runner.py)
AUXILIARY_OPERATIONS = frozenset({cp.OPERATION_INITIALIZATION, cp.OPERATION_RESTORATION})

ResourceReader = Callable[[str], Union[bytes, bytearray, memoryview]]


class Executor(Protocol):
    """What serving needs of an executor. Everything here is required; diagnostics that only
    one executor offers (CUDA node profiles, staging sizes) are methods of that class, used
    by the benchmarks and tests that construct it, never probed for by serving code."""

    @property
    def frames(self) -> int:
        """Staging frames (two let the host pack one while the other runs)."""

    @property
    def auxiliary_frames(self) -> int:
        """Host frames after the `frames` ones (indices frames, frames + 1, ...) that take only
        the AUXILIARY_OPERATIONS programs: a round's initialization is launched there without
        waiting for the frame its main step takes. Zero where launch runs the step at once."""

    @property
    def cache_pages(self) -> int:
        """Physical pages backed per cache plane (chosen at load)."""

    @property
    def programs(self) -> Collection[str]:
        """The loaded programs, by name."""

    def staging(self, frame: int) -> np.ndarray:
        """The host staging frame `frame` (uint8), written in place by packing."""

    def launch(self, program: str, frame: int) -> None:
        """Submit `program` with staging frame `frame`."""

    def wait(self, frame: int) -> np.ndarray:
        """Block until frame's submission finished; its completion words (int32, a copy)."""

    def node_count(self, program: str) -> int:
        """Nodes of rank 0's copy of `program` (kernels and collectives)."""

    def buffer_offsets(self, rank: int = 0) -> dict[str, int]:
        """Byte offset of every buffer in the rank's arena (OWN-11: the geometry loading produced)."""

    def arena_nbytes(self, rank: int = 0) -> int:
        """Bytes the rank's arena backs: fixed buffers plus the chosen cache pages."""

    def read_buffer(self, name: str, rank: int = 0) -> np.ndarray:
        """A copy of a buffer's bytes (uint8), for tests and diagnostics."""

    def bind_thread(self) -> None:
        """Make the executor usable from the calling thread (CUDA: its context current there);
        a rank process waits for its frames on a thread of its own."""

    def abort(self) -> None:
        """Another rank's process is gone: end whatever waits for it (NCCL: abort the
        communicators), so that close() cannot hang; the executor is unusable afterwards."""

    def close(self) -> None:
        """Release everything; the executor is unusable afterwards."""


class ExecutorLoadError(Exception):
    """The manifest cannot be executed by this executor; raised at load, never per step."""


class UnknownKernelIdError(ExecutorLoadError):
    """A program names a kernel id without an implementation (numpy: no reference)."""


class MissingVariantError(ExecutorLoadError):
    """A program the contract selects is absent from the execution catalog."""


class KernelArgumentError(ExecutorLoadError):
    """A node's arguments do not match its kernel's declared ABI."""


class UnknownProgramError(KeyError):
    """launch() named a program that was not loaded."""


class FrameStateError(RuntimeError):
    """wait() on a frame with nothing submitted, or launch() on a frame still in flight."""


class ExecutorLostError(RuntimeError):
    """The executor can run no further step: a rank process died, failed or stopped answering.
    Every request fails, the model turns unhealthy and must be started again (its ranks too)."""


@dataclass(frozen=True)
class RankPlacement:
    """This process's rank among rank processes (RankPeers::Processes, helios_backend/ranks/):
    the executor binds only `rank` and reaches the others through what is given here."""

    rank: int
    reduce: Optional[Callable[[int, np.ndarray], None]] = None   # numpy/cpu: the all-reduce between processes
    nccl_unique_id: Optional[bytes] = None                       # cuda: rank 0's NCCL unique id
    agree_pages: Optional[Callable[[int], int]] = None           # cuda: pages that fit -> pages every rank backs
    device: Optional[int] = None                                 # cuda: the device ordinal (default: the rank)
