"""The engine worker's host time per round by phase, without a GPU, under closed-loop load.

    python -m bench.engine_loop [--clients 64,128] [--seconds 5] [--return-rounds 8] [--profile launch]
                                [--completions paged|direct] [--per-lane] [--staggered] [--json PATH]
    python -m bench.engine_loop --speculative [--no-drafting] --clients 1,8,32,64 [--period 16]

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
(ignore_eos), each client back `--return-rounds` (+-50 %) rounds after its answer. All clients
start together, so their answers end together and most prompts come in bursts (rounds of
prompts); `--staggered` spreads the clients' first requests over one answer's rounds and
`--prompt-tokens 32` shortens the prompts, the served loop's steady state: about C / 128 requests
end and arrive each round, most rounds MIXED (an admission beside the decode lanes). The figures
then count only the rounds after the first two answers' worth (the start-up ramp left out), and
the phases are also split by the operation of the round completed (as with `--speculative`).

`--speculative`: a speculative round's host work against a plain decode round's. History
drafting on (SpeculativeScheduler, its width policy on the fixed cost prior as
`speculative_row_cost` sets it, so no round's choice depends on this machine's speed; the
SpeculativeProgramRunner packing the proposals) and direct completions of a model that repeats
each request's own last `--period` tokens: every copy a lookup finds is accepted, so the
requests draft from their first rounds of repetition on. The completions write each round's
completion words as a device would and a phase of its own times their validation (`validate`:
parse_and_validate, or a speculative round's validate_completion and its SpeculativeRows, what
the runners' collect() runs after the wait). `--no-drafting`: the same requests and tokens through
the plain Scheduler, the baseline. A period longer than the requests (`--period 1000000`) is a
workload with nothing to copy: drafting then falls back to pipelined DECODE rounds, and their
host work against `--no-drafting` is what the adaptive width costs there. The phases are then also split by the operation of the round
each loop iteration completes (an iteration: planning behind or after it, its launch, the
validation of its completion, its completion and delivery), as `by_operation` in --json.

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
from helios_backend.kernel_abi.speculative import extension_words
from helios_backend.scheduler.completion import CompletionFormat, CompletionRows, parse_and_validate
from helios_backend.scheduler.events import Terminal
from helios_backend.scheduler.speculative import SpeculativeOptions, SpeculativeTable, validate_completion
from helios_backend.scheduler.speculative_scheduler import SpeculativeRows, SpeculativeScheduler
from helios_backend.scheduler.speculative_width import WidthPolicy
from helios_backend.engine.speculative_runner import SpeculativeProgramRunner
try:
    from helios_backend.scheduler.events import TokenBlock
except ImportError:                             # a checkout before the columnar decode lanes
    TokenBlock = None
from helios_backend.scheduler.request import RequestSpec, SamplingSettings
from helios_backend.scheduler.scheduler import Scheduler, SchedulerConfig
from helios_backend.scheduler.variants import VariantTable
from tests.scheduler_sim import SimulatedEngine, completion_layout

PHASES = ("schedule", "launch", "complete", "deliver")
SPECULATIVE_PHASES = ("schedule", "launch", "validate", "complete", "deliver")    # --speculative
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


class RepeatingCompletions(DirectCompletions):
    """Direct completions of a model that repeats: the token at history position e of request s
    is a function of (s, e % period) (never an EOS id of the bench), so from its second period of
    output on a request's copies are right. A SPECULATIVE round's lane accepts its proposals up to
    the first that differs from that token and emits the next one. collect() writes the main
    submission's completion words as a device would (header, rows, a speculative round's
    extension records) and returns the validation the runner's collect() runs on them
    (parse_and_validate, or validate_completion and the SpeculativeRows made of its outcomes),
    for the loop to time."""

    def __init__(self, vocab: int, period: int, fmt: CompletionFormat, max_width: int) -> None:
        super().__init__(vocab)
        self.period, self.fmt, self.max_width = period, fmt, max_width

    def token(self, serial, position):
        return (serial * 104729 + (position % self.period) * 7919) % (self.vocab - 3) + 3

    def collect(self, plan):
        del self._rounds[id(plan)]
        main = plan.main
        lanes = main.lanes
        fmt, vocab = self.fmt, self.vocab
        if main.operation == cp.OPERATION_SPECULATIVE:
            words = self._words(main, self._speculative(lanes))
            round_ = lanes[0].round
            round_.sequence, round_.frame = main.sequence, main.frame

            def validate() -> CompletionRows:        # SpeculativeProgramRunner.collect after its wait
                return SpeculativeRows.of(validate_completion(fmt, words, round_, vocab, self.max_width))
            return validate
        from helios_backend.scheduler.decode_block import lane_columns, lane_requests
        _, _, ends, sampled = lane_columns(lanes)
        serials = np.array([req.serial for req in lane_requests(lanes)], np.int64)
        tokens = np.where(sampled == 1, self.token(serials, ends), -1)
        rows = [(int(t), int(e), int(s), 0, -1, ()) for t, e, s in zip(tokens, ends, sampled)]
        words = self._words(main, rows)
        return lambda: parse_and_validate(fmt, words, main, vocab_size=vocab)   # ProgramRunner.collect's

    def _speculative(self, lanes) -> list:
        """(token, consumed, emitted, finish, draft cursor, extension record) of each lane."""
        rows = []
        for lane in lanes:
            serial, program = lane.request.serial, lane.round.program
            accepted = 0
            for i, proposal in enumerate(lane.proposals):
                if proposal != self.token(serial, lane.start + 1 + i):
                    break
                accepted += 1
            tokens = list(lane.proposals[:accepted]) + [self.token(serial, lane.start + 1 + accepted)]
            consumed = lane.start + accepted + 1
            rows.append((tokens[-1], consumed, len(tokens), 2 if len(tokens) >= lane.output_limit else 0,
                         max(consumed - program.lag, 0) if program.reports_cursor else -1,
                         (1 + len(lane.proposals), accepted, *tokens)))
        return rows

    def _words(self, main, rows: list) -> np.ndarray:
        fmt = self.fmt
        stride = extension_words(self.max_width)
        base = fmt.header_words + fmt.capacity * fmt.row_words
        words = np.zeros(max(base + fmt.capacity * stride, fmt.extension_base + fmt.capacity * fmt.extension_words),
                         np.int32)                # (the logprob records: zeros)
        header = {"sequence": main.sequence, "live_rows": len(rows), "frame": main.frame, "status": 0,
                  "operation": main.operation}
        for role, word in fmt.header.items():
            if role in header:
                words[word] = header[role]
        r = fmt.row
        for i, (lane, (token, consumed, emitted, finish, cursor, extension)) in enumerate(zip(main.lanes, rows)):
            row = words[fmt.header_words + i * fmt.row_words:]
            row[r["slot"]], row[r["generation"]], row[r["token"]] = lane.slot, lane.generation, token
            row[r["consumed"]], row[r["emitted"]], row[r["finish"]] = consumed, emitted, finish
            row[r["draft_cursor"]], row[r["reserved_model"]] = cursor, -1
            if extension:
                words[base + i * stride:base + i * stride + len(extension)] = extension
        return words


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
                 completions: str = "paged", speculative: str = "", period: int = 16,
                 staggered: bool = False, prompt_tokens: int = 50) -> None:
        graphs = [g for g in prepared.contract.model.graphs if g.rank == 0]
        transport, manifest = prepared.manifest.transport, prepared.manifest
        vocab = prepared.contract.model.vocabulary
        frames = [np.zeros(transport.frame_nbytes, dtype=np.uint8) for _ in range(3)]   # two + auxiliary
        packer = Packer(graphs, transport, manifest.request_slots, frames)
        drafting = speculative == "drafting"
        runner = SpeculativeProgramRunner if drafting else ProgramRunner
        self.runner = runner(_NoExecutor(), packer, manifest.completion, vocab.sampled_tokens,
                             vocab.histogram_bins, (2, 0), mask_words=-(-vocab.sampled_tokens // 32),
                             auxiliary_frame=2)
        config = SchedulerConfig(page_tokens=prepared.contract.model.cache.page_tokens, num_pages=16384,
                                 request_slots=manifest.request_slots, max_active=min(clients, manifest.request_slots),
                                 queue_capacity=1024, context_tokens=2048, max_pages_per_row=128,
                                 vocab_size=vocab.sampled_tokens, input_vocab_size=vocab.sampled_tokens, eos_ids=(2, 0),
                                 **({} if columnar else {"columnar_decode": False}))
        table = [sp.Variant(g.operation, g.program, g.capacity.rows, g.capacity.tokens) for g in graphs]
        if drafting:
            spec = SpeculativeTable.select(graphs, SpeculativeOptions(enabled=True, history_drafting=True))
            self.runner.max_width = spec.max_width
            policy = WidthPolicy(max(p.lane_limit for p in spec.programs) - 1, row_cost=0.05, measured=False)
            self.scheduler = SpeculativeScheduler(config, VariantTable(table), spec, policy=policy)
        else:
            self.scheduler = Scheduler(config, VariantTable(table))
        if speculative:
            self.engine = RepeatingCompletions(vocab.sampled_tokens, period, self.runner.fmt,
                                               spec.max_width if drafting else 1)
        elif completions == "direct":
            self.engine = DirectCompletions(vocab.sampled_tokens)
        else:
            self.engine = SimulatedEngine(self.scheduler)
            self.engine.fmt = CompletionFormat.from_layout(completion_layout(512))
        self.return_rounds, self.profile = return_rounds, profile
        self.profiler = cProfile.Profile()
        self.phases = SPECULATIVE_PHASES if speculative else PHASES
        self.ns = dict.fromkeys(self.phases, 0)
        self.by_operation: dict[str, dict[str, int]] = {}   # operation -> phase ns, rounds, tokens
        self._iteration = dict.fromkeys(self.phases, 0)
        self.rounds = self.tokens = self.submitted = 0
        self.returning: list[int] = []
        self.frame = 0
        self.prompt_tokens = prompt_tokens
        self.warmup = 2 * OUTPUT_TOKENS if staggered else 0     # rounds not counted
        for i in range(clients):
            if staggered and i:
                self.returning.append(i * OUTPUT_TOKENS // clients)
            else:
                self._arrive()

    def _arrive(self) -> None:
        n = self.submitted
        prompt = tuple((7919 * n + 104729 * j) % 49000 + 3 for j in range(self.prompt_tokens))
        self.scheduler.add(n, RequestSpec(prompt, OUTPUT_TOKENS, SamplingSettings(), ignore_eos=True))
        self.submitted += 1

    def _timed(self, phase: str, call, *args):
        if self.profile == phase:
            self.profiler.enable()
        t0 = time.thread_time_ns()
        result = call(*args)
        spent = time.thread_time_ns() - t0
        self.ns[phase] += spent
        self._iteration[phase] += spent
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
            if callable(rows):                         # the completion's validation, timed
                rows = self._timed("validate", rows)
            self._timed("complete", self.scheduler.complete, plan, rows)
            take = getattr(self.scheduler, "take_worker_events", self.scheduler.take_events)
            events = take()
            self._timed("deliver", _wire_message, events)
            terminals = sum(1 for event in events if type(event) is Terminal)
            tokens = sum(len(event.serials) if type(event) is TokenBlock else 1
                         for event in events if type(event) is not Terminal)
            self.tokens += tokens
            self._account(plan, tokens)
            for _ in range(terminals):
                self.returning.append(self.rounds + random.randint(self.return_rounds // 2,
                                                                   self.return_rounds + self.return_rounds // 2))
            self.returning.sort()
            while self.returning and self.returning[0] <= self.rounds:
                self.returning.pop(0)
                self._arrive()
            self.rounds += 1
            if self.rounds == self.warmup:             # the start-up ramp left out
                self.rounds = self.tokens = 0
                self.ns = dict.fromkeys(self.phases, 0)
                self.by_operation.clear()
                self.returning = [r - self.warmup for r in self.returning]
                self.warmup = 0

    def _account(self, plan, tokens: int) -> None:
        """The iteration's phases to the operation of the round it completed."""
        name = cp.Operation.Name(plan.main.operation).removeprefix("OPERATION_").lower()
        into = self.by_operation.setdefault(name, dict.fromkeys((*self.phases, "rounds", "tokens", "lanes"), 0))
        for phase in self.phases:
            into[phase] += self._iteration[phase]
            self._iteration[phase] = 0
        into["rounds"] += 1
        into["tokens"] += tokens
        into["lanes"] += len(plan.main.lanes)

    def report(self) -> dict:
        launches = {cp.Operation.Name(k).removeprefix("OPERATION_").lower(): v
                    for k, v in self.scheduler.counters.launches.items()}
        per_round = {p: self.ns[p] / self.rounds / 1e3 for p in self.phases}
        by_operation = {}
        for name, into in self.by_operation.items():
            us = {p: into[p] / into["rounds"] / 1e3 for p in self.phases}
            by_operation[name] = {"rounds": into["rounds"], "lanes_per_round": into["lanes"] / into["rounds"],
                                  "tokens_per_round": into["tokens"] / into["rounds"], "us_per_round": us,
                                  "host_us_per_round": sum(us.values())}
        report = {"rounds": self.rounds, "tokens_per_round": self.tokens / self.rounds, "launches": launches,
                  "us_per_round": per_round, "host_us_per_round": sum(per_round.values()),
                  "by_operation": by_operation}
        drafting = getattr(self.scheduler, "drafting", None)
        if drafting is not None:
            report["drafting"] = dict(vars(drafting))
        return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", default="32,64,128,256")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--return-rounds", type=int, default=8,
                        help="rounds between an answer and its client's next request (~10 ms on the H200)")
    parser.add_argument("--profile", choices=SPECULATIVE_PHASES, default=None, help="cProfile this phase (last level)")
    parser.add_argument("--completions", choices=("paged", "direct"), default="paged",
                        help="the simulated engine's paged history, or rows straight from the lanes (see above)")
    parser.add_argument("--per-lane", action="store_true", help="no columnar decode lanes (the per-lane path)")
    parser.add_argument("--speculative", action="store_true",
                        help="history drafting on a repeating model's direct completions (see above)")
    parser.add_argument("--no-drafting", action="store_true",
                        help="with --speculative: the same requests and tokens through the plain scheduler")
    parser.add_argument("--period", type=int, default=16, help="with --speculative: the tokens each request repeats")
    parser.add_argument("--staggered", action="store_true",
                        help="first requests spread over one answer's rounds: admissions every round (see above)")
    parser.add_argument("--prompt-tokens", type=int, default=50, help="each prompt's tokens")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    random.seed(0)
    prepared = _contract()
    results = {}
    phases = SPECULATIVE_PHASES if args.speculative else PHASES
    print(f"{'clients':>8} {'rounds':>7} {'tok/round':>9} " + " ".join(f"{p:>9}" for p in phases)
          + f" {'host us':>8}  launches")
    for clients in [int(c) for c in args.clients.split(",") if c]:
        speculative = "" if not args.speculative else "plain" if args.no_drafting else "drafting"
        loop = Loop(prepared, clients, args.return_rounds, args.profile or "", columnar=not args.per_lane,
                    completions=args.completions, speculative=speculative, period=args.period,
                    staggered=args.staggered, prompt_tokens=args.prompt_tokens)
        loop.run(args.seconds)
        r = results[clients] = loop.report()
        print(f"{clients:>8} {r['rounds']:>7} {r['tokens_per_round']:>9.1f} "
              + " ".join(f"{r['us_per_round'][p]:>9.1f}" for p in phases)
              + f" {r['host_us_per_round']:>8.1f}  {r['launches']}", flush=True)
        if speculative or args.staggered:
            for name, o in sorted(r["by_operation"].items()):
                print(f"{'':>8} {o['rounds']:>7} {o['tokens_per_round']:>9.1f} "
                      + " ".join(f"{o['us_per_round'][p]:>9.1f}" for p in phases)
                      + f" {o['host_us_per_round']:>8.1f}  {name} rounds, {o['lanes_per_round']:.1f} lanes",
                      flush=True)
    if args.profile:
        text = io.StringIO()
        pstats.Stats(loop.profiler, stream=text).sort_stats("tottime").print_stats(20)
        print(text.getvalue())
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
