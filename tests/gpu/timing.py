"""Timing helpers shared by the device scripts (tests/gpu, bench/): medians, no asserts."""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import numpy as np

from helios_backend.executors.cuda.driver import check


def round_trip_us(executor: Any, program: str, steps: int, pack: Callable[[int, int], None]) -> float:
    """Median µs of one synchronous step: pack, launch, wait (one frame in flight)."""
    samples = []
    for i in range(steps):
        frame = i % executor.frames
        start = time.perf_counter_ns()
        pack(frame, i)
        executor.launch(program, frame)
        executor.wait(frame)
        samples.append((time.perf_counter_ns() - start) / 1e3)
    return statistics.median(samples[steps // 10:])


def pipelined_us(executor: Any, program: str, steps: int, pack: Callable[[int, int], None]) -> tuple[float, float]:
    """(µs per step with both frames in flight, median host µs of pack + launch)."""
    frames = executor.frames
    host = []
    for f in range(frames):          # warm
        executor.launch(program, f)
    start = time.perf_counter_ns()
    for i in range(steps):
        frame = i % frames
        executor.wait(frame)         # frame's previous step done: its host frame is free
        t0 = time.perf_counter_ns()
        pack(frame, i)
        executor.launch(program, frame)
        host.append((time.perf_counter_ns() - t0) / 1e3)
    for f in range(frames):
        executor.wait(f)
    total = (time.perf_counter_ns() - start) / 1e3
    return total / steps, statistics.median(host)


def gpu_us(driver: Any, executor: Any, program: str, steps: int) -> float:
    """Device µs per graph launch, events around `steps` back-to-back launches."""
    # replays frame 0's graph exec back to back (bypassing the frame bookkeeping of launch(),
    # which forbids a second launch before wait): the device time alone, no host gaps
    _, stream = executor.context()
    graph_exec, _ = executor._launch_plan[program][0][0]
    start = check(driver.cuEventCreate(0))
    end = check(driver.cuEventCreate(0))
    for _ in range(3):
        check(driver.cuGraphLaunch(graph_exec, stream))
    check(driver.cuEventRecord(start, stream))
    for _ in range(steps):
        check(driver.cuGraphLaunch(graph_exec, stream))
    check(driver.cuEventRecord(end, stream))
    check(driver.cuEventSynchronize(end))
    ms = check(driver.cuEventElapsedTime(start, end))
    driver.cuEventDestroy(start)
    driver.cuEventDestroy(end)
    return ms * 1e3 / steps


def copy_bandwidth_gbs(driver: Any, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Device-to-device copy GB/s counting bytes read plus written (the roofline's ceiling)."""
    src = int(check(driver.cuMemAlloc(nbytes)))
    dst = int(check(driver.cuMemAlloc(nbytes)))
    stream = check(driver.cuStreamCreate(1))
    start = check(driver.cuEventCreate(0))
    end = check(driver.cuEventCreate(0))
    check(driver.cuMemsetD8Async(src, 1, nbytes, stream))
    samples = []
    for _ in range(repeats + 2):
        check(driver.cuEventRecord(start, stream))
        check(driver.cuMemcpyDtoDAsync(dst, src, nbytes, stream))
        check(driver.cuEventRecord(end, stream))
        check(driver.cuEventSynchronize(end))
        samples.append(check(driver.cuEventElapsedTime(start, end)))
    for handle in (src, dst):
        driver.cuMemFree(handle)
    driver.cuEventDestroy(start)
    driver.cuEventDestroy(end)
    driver.cuStreamDestroy(stream)
    ms = float(np.median(samples[2:]))
    return 2 * nbytes / (ms * 1e-3) / 1e9
