"""The engine worker's host time per round by phase, without a GPU, under closed-loop load.

    python -m bench.engine_loop [--clients 64,128] [--seconds 5] [--return-rounds 8] [--profile launch]
                                [--completions paged|direct] [--per-lane] [--json PATH]

What bench/packing.py (one pack) and bench/scheduler_round.py (the scheduler alone) leave out:
the worker's whole round as EngineLoop runs it on two frames, with the real Packer and
ProgramRunner on the core's contract (auxiliary frame included) and an executor that does
nothing, so every microsecond is host work. Phases as flare_worker_seconds_total names them:
schedule (schedule / pipeline_next), launch (ProgramRunner.launch: lanes, packing, launches),
complete (Scheduler.complete) and deliver (the events pickled as the engine process sends
them). The completions come from the simulated engine of tests/scheduler_sim.py (`paged`: a real
paged history read back per lane, every round), whose own time is not counted, or (`direct`) are
written straight from the round's lanes (a token per sampling lane, no history): the simulator's
reads of every lane's history evict the worker's data from the caches between its phases, which
the worker serving a GPU does not see (it waits for the device), so `direct` is the closer
measure of the worker's own host work and `paged` the one the earlier figures used. `--per-lane`
runs the scheduler without its columnar decode lanes (SchedulerConfig.columnar_decode). Load: C clients, distinct 50-token prompts, 128 output tokens
(ignore_eos), each client back `--return-rounds` (+-50 %) rounds after its answer.

The contract: the device bundle's when HELIOS_BUNDLE_DIR names one (HELIOS_RANDOM_WEIGHTS=1: no
GGUF needed), else the bench contract of bench/packing.py. Run it here and on the GPU host to
compare their Python speed on the serving loop itself.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pickle
import pathlib
import pstats
import random
import time
import types

import numpy as np

from helios_proto import contract_pb2 as cp
from helios_backend.engine.process_wire import pack_events
from helios_backend.engine.runner import ProgramRunner
from helios_backend.packing import Packer
from helios_backend.scheduler import plan as sp
from helios_backend.scheduler.completion import CompletionFormat, CompletionRows
from helios_backend.scheduler.events import Terminal
try:
    from helios_backend.scheduler.events import TokenBlock
except ImportError:                             # a checkout before the columnar decode lanes
    TokenBlock = None
from helios_backend.scheduler.request import RequestSpec, SamplingSettings
from helios_backend.scheduler.scheduler import Scheduler, SchedulerConfig
from helios_backend.scheduler.variants import VariantTable
from tests.scheduler_sim import SimulatedEngine, completion_layout

PHASES = ("schedule", "launch", "complete", "deliver")
OUTPUT_TOKENS = 128


class _NoExecutor:
    def launch(self, program: str, frame: int) -> None:
        pass

    def wait(self, frame: int) -> np.ndarray:
        return np.zeros(16, np.int32)


def _wire_message(events: list) -> bytes:
    """What the engine process's WireSink sends per delivery (a pickled EVENTS message)."""
    return pickle.dumps(("events", pack_events(events)))


class DirectCompletions:
    """Completion rows written straight from a round's lanes: each sampling lane gets a token
    that depends on its request and position (never an EOS id of the bench, 0 or 2), nothing is
    read back; what the scheduler would have validated, without a simulator between the phases."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self._rounds: dict[int, object] = {}

    def launch(self, plan, frame: int) -> None:
        self._rounds[id(plan)] = plan

    def collect(self, plan) -> CompletionRows:
        del self._rounds[id(plan)]
        lanes = plan.main.lanes
        try:                                     # the columns where the checkout has them
            from helios_backend.scheduler.decode_block import lane_columns
            _, _, ends, sampled = lane_columns(lanes)
        except ImportError:
            ends = np.array([lane.end for lane in lanes], np.int64)
            sampled = np.array([lane.sample for lane in lanes], np.int64)
        tokens = np.where(sampled == 1, (ends * 7919) % (self.vocab - 3) + 3, -1).astype(np.int32)
        return CompletionRows(tokens, ends.astype(np.int32), np.zeros(len(ends), np.int32), None, None, None)


def _contract():
    if os.environ.get("HELIOS_BUNDLE_DIR"):
        from tests.gpu.model_bundle import load_bundle
        contract, manifest, _ = load_bundle()
        return types.SimpleNamespace(contract=contract, manifest=manifest)
    from bench.packing import prepare_contract
    return prepare_contract()


class Loop:
    """One closed-loop run: the worker's phases timed per round, the simulated engine's not."""

    def __init__(self, prepared, clients: int, return_rounds: int, profile: str, columnar: bool = True,
                 completions: str = "paged") -> None:
        graphs = [g for g in prepared.contract.model.graphs if g.rank == 0]
        transport, manifest = prepared.manifest.transport, prepared.manifest
        vocab = prepared.contract.model.vocabulary
        frames = [np.zeros(transport.frame_nbytes, dtype=np.uint8) for _ in range(3)]   # two + auxiliary
        packer = Packer(graphs, transport, manifest.request_slots, frames)
        self.runner = ProgramRunner(_NoExecutor(), packer, manifest.completion, vocab.sampled_tokens,
                                    vocab.histogram_bins, (2, 0), mask_words=-(-vocab.sampled_tokens // 32),
                                    auxiliary_frame=2)
        config = SchedulerConfig(page_tokens=prepared.contract.model.cache.page_tokens, num_pages=16384,
                                 request_slots=manifest.request_slots, max_active=min(clients, manifest.request_slots),
                                 queue_capacity=1024, context_tokens=2048, max_pages_per_row=128,
                                 vocab_size=vocab.sampled_tokens, input_vocab_size=vocab.sampled_tokens, eos_ids=(2, 0),
                                 **({} if columnar else {"columnar_decode": False}))
        table = [sp.Variant(g.operation, g.program, g.capacity.rows, g.capacity.tokens) for g in graphs]
        self.scheduler = Scheduler(config, VariantTable(table))
        if completions == "direct":
            self.engine = DirectCompletions(vocab.sampled_tokens)
        else:
            self.engine = SimulatedEngine(self.scheduler)
            self.engine.fmt = CompletionFormat.from_layout(completion_layout(512))
        self.return_rounds, self.profile = return_rounds, profile
        self.profiler = cProfile.Profile()
        self.ns = dict.fromkeys(PHASES, 0)
        self.rounds = self.tokens = self.submitted = 0
        self.returning: list[int] = []
        self.frame = 0
        for _ in range(clients):
            self._arrive()

    def _arrive(self) -> None:
        n = self.submitted
        prompt = tuple((7919 * n + 104729 * j) % 49000 + 3 for j in range(50))
        self.scheduler.add(n, RequestSpec(prompt, OUTPUT_TOKENS, SamplingSettings(), ignore_eos=True))
        self.submitted += 1

    def _timed(self, phase: str, call, *args):
        if self.profile == phase:
            self.profiler.enable()
        t0 = time.thread_time_ns()
        result = call(*args)
        self.ns[phase] += time.thread_time_ns() - t0
        if self.profile == phase:
            self.profiler.disable()
        return result

    def _launch(self, plan) -> None:
        self._timed("launch", self.runner.launch, plan, self.frame)
        self.frame ^= 1
        self.engine.launch(plan, self.frame)

    def run(self, seconds: float) -> None:
        inflight: list = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if not inflight:
                plan = self._timed("schedule", self.scheduler.schedule)
                if plan is None:                       # everybody between requests: the next one back
                    self.returning.sort()
                    self.returning.pop(0)
                    self._arrive()
                    continue
                self._launch(plan)
                inflight.append(plan)
            following = self._timed("schedule", self.scheduler.pipeline_next, inflight[0])
            if following is not None:
                self._launch(following)
                inflight.append(following)
            plan = inflight.pop(0)
            rows = self.engine.collect(plan)
            self._timed("complete", self.scheduler.complete, plan, rows)
            take = getattr(self.scheduler, "take_worker_events", self.scheduler.take_events)
            events = take()
            self._timed("deliver", _wire_message, events)
            terminals = sum(1 for event in events if type(event) is Terminal)
            self.tokens += sum(len(event.serials) if type(event) is TokenBlock else 1
                               for event in events if type(event) is not Terminal)
            for _ in range(terminals):
                self.returning.append(self.rounds + random.randint(self.return_rounds // 2,
                                                                   self.return_rounds + self.return_rounds // 2))
            self.returning.sort()
            while self.returning and self.returning[0] <= self.rounds:
                self.returning.pop(0)
                self._arrive()
            self.rounds += 1

    def report(self) -> dict:
        launches = {cp.Operation.Name(k).removeprefix("OPERATION_").lower(): v
                    for k, v in self.scheduler.counters.launches.items()}
        per_round = {p: self.ns[p] / self.rounds / 1e3 for p in PHASES}
        return {"rounds": self.rounds, "tokens_per_round": self.tokens / self.rounds, "launches": launches,
                "us_per_round": per_round, "host_us_per_round": sum(per_round.values())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", default="32,64,128,256")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--return-rounds", type=int, default=8,
                        help="rounds between an answer and its client's next request (~10 ms on the H200)")
    parser.add_argument("--profile", choices=PHASES, default=None, help="cProfile this phase (last level)")
    parser.add_argument("--completions", choices=("paged", "direct"), default="paged",
                        help="the simulated engine's paged history, or rows straight from the lanes (see above)")
    parser.add_argument("--per-lane", action="store_true", help="no columnar decode lanes (the per-lane path)")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    random.seed(0)
    prepared = _contract()
    results = {}
    print(f"{'clients':>8} {'rounds':>7} {'tok/round':>9} " + " ".join(f"{p:>9}" for p in PHASES)
          + f" {'host us':>8}  launches")
    for clients in [int(c) for c in args.clients.split(",") if c]:
        loop = Loop(prepared, clients, args.return_rounds, args.profile or "", columnar=not args.per_lane,
                    completions=args.completions)
        loop.run(args.seconds)
        r = results[clients] = loop.report()
        print(f"{clients:>8} {r['rounds']:>7} {r['tokens_per_round']:>9.1f} "
              + " ".join(f"{r['us_per_round'][p]:>9.1f}" for p in PHASES)
              + f" {r['host_us_per_round']:>8.1f}  {r['launches']}", flush=True)
    if args.profile:
        text = io.StringIO()
        pstats.Stats(loop.profiler, stream=text).sort_stats("tottime").print_stats(20)
        print(text.getvalue())
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
