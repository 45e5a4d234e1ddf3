"""Host packing time per step, on the CPU: what the GPU step has to hide.

    python -m bench.packing [--calls 1000] [--json PATH]

Prepares the benchmark contract in memory (tests/gpu/model_bundle.bench_options: the
SmolLM2 recipe with decode variants to 128 rows, the contract bench/gpu_decode.py runs;
~5 s, no core written) and times one `pack()` call per step, median over `--calls`
steps after warm-up, for decode at batch 1, 8, 32, 64, 128 and a 512-token prefill chunk:

  pack us      Packer.pack (helios_backend/packing.py) with prepared packing Lanes, as
               bench/gpu_decode.py times it on the GPU host
  per-row us   the same lanes through tests/packing_reference.ReferencePacker: the
               straightforward writer (one Python pass per lane and destination), i.e. the
               algorithm Packer used before it was vectorized; the same bytes
  engine us    the serving path: ProgramRunner.launch of one round of scheduler Lanes
               (conversion to packing Lanes + pack; the executor's launch is a no-op)

Decode lanes are realistic: distinct slots, prompts of 100-163 tokens so pages fill at
different steps (about B/16 lanes add a page-table entry per step), consumed advancing by
one per step, both staging frames alternating. The prefill chunk is a fresh request per
call (new generation: its 32 page-table entries are written every time).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time
from typing import Callable, Sequence

import numpy as np

from helios_backend.packing import PackedLane, Packer
from helios_backend.scheduler import plan as sp
from helios_backend.scheduler.request import Request, RequestSpec, SamplingSettings
from helios_backend.engine.runner import ProgramRunner
from helios_proto import contract_pb2 as C
from tests.gpu.model_bundle import bench_options
from tests.packing_reference import ReferencePacker

BATCHES = (1, 8, 32, 64, 128)
PREFILL = 512
WARMUP = 20


class _NoExecutor:
    """ProgramRunner's executor side, doing nothing: only the host packing is timed."""

    def launch(self, program: str, frame: int) -> None:
        pass

    def wait(self, frame: int) -> np.ndarray:
        raise AssertionError("the benchmark never waits")


def _program(graphs, operation: int, rows: int, tokens: int = 0) -> C.GraphContract:
    fitting = [g for g in graphs if g.operation == operation and g.capacity.rows >= rows and g.capacity.tokens >= tokens]
    return min(fitting, key=lambda g: (g.capacity.rows, g.capacity.tokens))


class Bench:
    def __init__(self, prepared, calls: int) -> None:
        self.contract, self.manifest = prepared.contract, prepared.manifest
        self.graphs = [g for g in self.contract.model.graphs if g.rank == 0]
        self.page_tokens = self.contract.model.cache.page_tokens
        self.calls = calls
        self.rng = np.random.default_rng(0)

    def packer(self, kind: type = Packer):
        transport = self.manifest.transport
        frames = [np.zeros(transport.frame_nbytes, dtype=np.uint8) for _ in range(max(1, transport.frames))]
        return kind(self.graphs, transport, self.manifest.request_slots, frames), len(frames)

    def _time(self, pack: Callable[[int, int], None], frames: int) -> float:
        samples = []
        for k in range(WARMUP + self.calls):
            t0 = time.perf_counter_ns()
            pack(k, k % frames)
            if k >= WARMUP:
                samples.append((time.perf_counter_ns() - t0) / 1e3)
        return statistics.median(samples)

    # ---- decode -----------------------------------------------------------------------------
    def _decode_state(self, batch: int):
        prompts = [100 + (37 * s) % 64 for s in range(batch)]
        pages = [[int(p) for p in self.rng.permutation(4096)[:(prompts[s] + WARMUP + self.calls) // self.page_tokens + 1]]
                 for s in range(batch)]
        return prompts, pages

    def decode_lanes(self, batch: int) -> list[list[PackedLane]]:
        prompts, pages = self._decode_state(batch)
        pt = self.page_tokens
        return [[PackedLane(slot=s, generation=1, start=prompts[s] + k,
                            page_table=pages[s][:(prompts[s] + k) // pt + 1])
                 for s in range(batch)] for k in range(WARMUP + self.calls)]

    def decode(self, batch: int) -> dict:
        program = _program(self.graphs, C.OPERATION_DECODE, batch, batch).program
        per_step = self.decode_lanes(batch)
        out = {"program": program}
        for name, kind in (("pack_us", Packer), ("per_row_us", ReferencePacker)):
            packer, frames = self.packer(kind)
            out[name] = self._time(lambda k, f: packer.pack(program, f, per_step[k]), frames)
        out["engine_us"] = self.engine_decode(batch, _program(self.graphs, C.OPERATION_DECODE, batch, batch))
        return out

    def engine_decode(self, batch: int, graph: C.GraphContract) -> float:
        """Scheduler lanes of one decode round through ProgramRunner.launch (conversion + pack)."""
        packer, frames = self.packer()
        vocab = self.contract.model.vocabulary
        runner = ProgramRunner(_NoExecutor(), packer, self.manifest.completion, vocab.sampled_tokens,
                               vocab.histogram_bins, ())
        prompts, pages = self._decode_state(batch)
        variant = sp.Variant(graph.operation, graph.program, graph.capacity.rows, graph.capacity.tokens)
        requests = [Request(s, RequestSpec(tuple(range(prompts[s])), 1 << 20, SamplingSettings()), s, slot=s,
                            generation=1) for s in range(batch)]
        samples = []
        for k in range(WARMUP + self.calls):
            lanes = []
            for s, req in enumerate(requests):       # the scheduler's bookkeeping: not timed
                consumed = prompts[s] + k
                req.pages[:] = pages[s][:consumed // self.page_tokens + 1]
                lanes.append(sp.Lane(req, s, 1, consumed, [sp.PENDING_TOKEN], True, 1 << 19))
            plan = sp.RoundPlan(sp.Submission(variant, lanes))
            t0 = time.perf_counter_ns()
            runner.launch(plan, k % frames)
            if k >= WARMUP:
                samples.append((time.perf_counter_ns() - t0) / 1e3)
        return statistics.median(samples)

    # ---- prefill ----------------------------------------------------------------------------
    def prefill(self, tokens: int) -> dict:
        graph = _program(self.graphs, C.OPERATION_PREFILL, 1, tokens)
        prompt = self.rng.integers(0, self.contract.model.vocabulary.sampled_tokens, tokens).astype(np.int32)
        pages = [int(p) for p in self.rng.permutation(4096)[:-(-tokens // self.page_tokens)]]
        out = {"program": graph.program}
        for name, kind in (("pack_us", Packer), ("per_row_us", ReferencePacker)):
            packer, frames = self.packer(kind)
            lanes = [[PackedLane(slot=0, generation=k + 1, start=0, tokens=prompt, sample=True, page_table=pages)]
                     for k in range(WARMUP + self.calls)]
            out[name] = self._time(lambda k, f: packer.pack(graph.program, f, lanes[k]), frames)
        packer, frames = self.packer()
        vocab = self.contract.model.vocabulary
        runner = ProgramRunner(_NoExecutor(), packer, self.manifest.completion, vocab.sampled_tokens,
                               vocab.histogram_bins, ())
        variant = sp.Variant(graph.operation, graph.program, graph.capacity.rows, graph.capacity.tokens)
        samples = []
        ids = prompt.tolist()
        for k in range(WARMUP + self.calls):
            req = Request(k, RequestSpec(tuple(ids), 16, SamplingSettings()), k, slot=0, generation=k + 1,
                          pages=list(pages))
            lane = sp.Lane(req, 0, k + 1, 0, ids[:tokens], True, 16)
            plan = sp.RoundPlan(sp.Submission(variant, [lane]))
            t0 = time.perf_counter_ns()
            runner.launch(plan, k % frames)
            if k >= WARMUP:
                samples.append((time.perf_counter_ns() - t0) / 1e3)
        out["engine_us"] = statistics.median(samples)
        return out


def prepare_contract():
    from ignition.preparation.prepare import prepare
    from ignition.recipes import smollm2_135m_instruct as recipe

    return prepare(recipe, bench_options(recipe, None))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    bench = Bench(prepare_contract(), args.calls)
    print(f"contract prepared in {time.perf_counter() - started:.1f} s; median of {args.calls} calls each", flush=True)
    report = {"decode": {}, "prefill": {}}
    print(f"{'step':>14} {'program':>18} {'pack us':>9} {'per-row us':>11} {'engine us':>10}")
    for batch in [int(b) for b in args.batches.split(",") if b]:
        r = report["decode"][batch] = bench.decode(batch)
        print(f"{'decode B=' + str(batch):>14} {r['program']:>18} {r['pack_us']:>9.1f} {r['per_row_us']:>11.1f} "
              f"{r['engine_us']:>10.1f}", flush=True)
    r = report["prefill"][PREFILL] = bench.prefill(PREFILL)
    print(f"{'prefill ' + str(PREFILL):>14} {r['program']:>18} {r['pack_us']:>9.1f} {r['per_row_us']:>11.1f} "
          f"{r['engine_us']:>10.1f}", flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
