"""Timed steps of a loaded model through hand-built lanes (lockstep/raw_lanes.py), for the benches.

`timed_prefill`: one multi-row PREFILL step; `timed_decode`: B lanes prefilled (untimed) with one
prompt, then greedy DECODE rounds. Only serving code is imported here: a bench child that loads a
core as serving does (bench/cpu_executor.py) then holds what serving holds, not the preparation
pipeline bench/numpy_executor.py imports (~8 MiB of modules: ignition, gguf, yaml, tqdm).
"""
from __future__ import annotations

import time
from typing import Sequence

import numpy as np
from helios_proto import contract_pb2 as C

from helios_backend.engine.model import NativeModel
from helios_backend.lockstep.generator import GenerationRequest
from helios_backend.lockstep.raw_lanes import RawLanes
from helios_backend.packing import PackedLane
from helios_backend.sampling_parameters import SamplingParameters


def timed_prefill(model: NativeModel, prompts: Sequence[Sequence[int]]) -> float:
    """Seconds of one multi-row PREFILL step over `prompts` (admission and page setup untimed)."""
    driver = RawLanes(model)
    actives = driver.admit([GenerationRequest(p, 1) for p in prompts], list(range(len(prompts))))
    lanes = []
    for active, prompt in zip(actives, prompts):
        driver.ensure_pages(active, len(prompt))
        lanes.append(PackedLane(slot=active.slot, generation=active.generation,
                          tokens=np.asarray(prompt, dtype=np.int32), page_table=list(active.pages)))
    program = model.program(C.OPERATION_PREFILL, len(prompts), sum(len(p) for p in prompts))
    start = time.perf_counter()
    driver.step(program, lanes)
    seconds = time.perf_counter() - start
    driver.pages.give_back(page for active in actives for page in active.pages)
    return seconds


def timed_decode(model: NativeModel, prompt: Sequence[int], batch: int, steps: int) -> float:
    driver = RawLanes(model)
    # requests that asked for no logprobs (llama.cpp's peer computes none either)
    actives = driver.admit([GenerationRequest(prompt, steps + 1, SamplingParameters(logprobs=-1), eos_ids=(-1,))
                            for _ in range(batch)], list(range(batch)))
    # the prompt's whole pages are held once and every lane's page table starts with them, as
    # llama.cpp's peer copies its prompt's cells to each sequence (llama_memory_seq_cp): each lane's
    # prefill writes the same keys and values there (same ids, positions and program), decode only
    # reads them, and each lane writes its own pages from the first position past them
    shared = [driver.pages.take() for _ in range(len(prompt) // driver.page_tokens)]
    for active in actives:
        active.pages.extend(shared)
        driver.prefill(active)
    start = time.perf_counter()
    for _ in range(steps):
        driver.decode_round(actives)
    seconds = time.perf_counter() - start
    driver.pages.give_back(shared + [page for active in actives for page in active.pages[len(shared):]])
    return seconds
