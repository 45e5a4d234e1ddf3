"""Host time of the serving loop's scheduling per round, on the CPU, under closed-loop load.

    python -m bench.scheduler_round [--concurrency 16,64,128,256] [--requests-per-slot 3] [--json PATH]

What the GPU step has to hide besides packing (bench/packing.py): the engine loop's
Scheduler.schedule / pipeline_next / complete for every round, exactly as EngineLoop calls
them (two frames: round N+1 is planned while round N runs). The device is the simulated
engine of tests/scheduler_sim.py (a real paged history, completions through the real
parse_and_validate), whose own time is not counted. Load: C clients, each request a
distinct ~30-token prompt and 128 output tokens, a new request the moment one ends.
The variant table is the device bundle's (tests/gpu/model_bundle.bench_options): decode to
256 rows, MIXED to 256 rows with chunks to 1,024 tokens, prefill 32/128/512.

Columns: rounds and how many were planned on the second frame; host us per round and per
generated token; tokens per round (the batch the loop keeps). For a before/after figure, run the
same command from the root of another checkout (a `git worktree` of the older commit): the
package imports the scheduler of the checkout it runs in.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import time

import numpy as np

from helios_proto import contract_pb2 as cp

from helios_backend.scheduler.completion import CompletionFormat
from helios_backend.scheduler.plan import Variant
from helios_backend.scheduler.request import RequestSpec, SamplingSettings
from helios_backend.scheduler.scheduler import Scheduler, SchedulerConfig
from helios_backend.scheduler.variants import VariantTable
from tests.scheduler_sim import SimulatedEngine, completion_layout


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", default="16,64,128,256")
    parser.add_argument("--requests-per-slot", type=int, default=3)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--json", default="")
    parser.add_argument("--return-rounds", type=int, default=0,
                        help="rounds between a request's end and its client's next request (the gateway, Triton "
                             "and the client: ~10 ms is 6-8 rounds at 64-128 clients on the H200)")
    parser.add_argument("--admission-burst", type=int, default=0,
                        help="waiting requests that make a round of prompts (SchedulerConfig.admission_burst; "
                             "0: its default)")
    parser.add_argument("--wide-admission", action="store_true",
                        help="add PREFILL variants of 16 and 64 rows and initialization of 16 and 64 slots")
    args = parser.parse_args()

    rows = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    table = [Variant(cp.OPERATION_DECODE, f"decode.r{r}", r, r) for r in rows]
    table += [Variant(cp.OPERATION_PREFILL, f"prefill.r{r}.t{t}", r, t) for r, t in ((1, 32), (1, 128), (1, 512), (4, 512))]
    table += [Variant(cp.OPERATION_MIXED, f"mixed.r{r}.t{t}", r, t)
              for r, t in ((8, 135), (32, 159), (64, 191), (128, 255), (256, 383), (64, 1088), (128, 1152), (256, 1280))]
    table += [Variant(cp.OPERATION_INITIALIZATION, f"initialization.r{r}", r, 0) for r in (1, 4)]
    if args.wide_admission:
        table += [Variant(cp.OPERATION_PREFILL, f"prefill.r{r}.t{t}", r, t) for r, t in ((16, 1024), (64, 4096))]
        table += [Variant(cp.OPERATION_INITIALIZATION, f"initialization.r{r}", r, 0) for r in (16, 64)]
    report = {}
    print(f"{'conc':>5} {'rounds':>7} {'2nd frame':>9} {'us/round':>9} {'us/token':>9} {'tokens/round':>12} "
          f"{'TTFT rounds p50':>15} {'mean':>6} {'max':>5}")
    for concurrency in [int(c) for c in args.concurrency.split(",") if c]:
        config = SchedulerConfig(page_tokens=16, num_pages=16384, request_slots=256, max_active=256,
                                 queue_capacity=1024, context_tokens=2048, max_pages_per_row=128, vocab_size=49152,
                                 input_vocab_size=49152, eos_ids=(),
                                 **({"admission_burst": args.admission_burst} if args.admission_burst else {}))
        sched = Scheduler(config, VariantTable(table))
        engine = SimulatedEngine(sched)
        engine.fmt = CompletionFormat.from_layout(completion_layout(256))
        total = concurrency * args.requests_per_slot
        submitted = 0

        tokens = rounds = 0
        arrived: dict[int, int] = {}        # serial -> the round count at its arrival
        ttft_rounds: list[int] = []          # rounds from arrival to its first token

        def arrive() -> None:
            nonlocal submitted
            arrived[submitted] = rounds
            prompt = tuple((7919 * submitted + 104729 * j) % 49000 + 3 for j in range(30))
            sched.add(submitted, RequestSpec(prompt, args.output_tokens, SamplingSettings()))
            submitted += 1

        for _ in range(concurrency):
            arrive()
        inflight: list = []
        host_ns: list[int] = []
        tokens = rounds = 0
        returning: list[int] = []            # the rounds at which clients send their next request
        while True:
            while returning and returning[0] <= rounds:
                returning.pop(0)
                arrive()
            t0 = time.perf_counter_ns()
            if not inflight:
                plan = sched.schedule()
                if plan is None:
                    if returning:            # idle until the next client returns
                        rounds += 1
                        continue
                    break
                host_ns.append(time.perf_counter_ns() - t0)
                engine.launch(plan, 0)
                inflight.append(plan)
                t0 = time.perf_counter_ns()
            if len(inflight) == 1:
                nxt = sched.pipeline_next(inflight[0])
                spent = time.perf_counter_ns() - t0
                if nxt is not None:
                    engine.launch(nxt, 1)
                    inflight.append(nxt)
                host_ns[-1] += spent
            plan = inflight.pop(0)
            rows_ = engine.collect(plan)
            t0 = time.perf_counter_ns()
            sched.complete(plan, rows_)
            finished = 0
            for event in sched.take_events():
                if hasattr(event, "token"):
                    tokens += 1
                    start = arrived.pop(event.serial, None)
                    if start is not None:
                        ttft_rounds.append(rounds + 1 - start)
                else:
                    finished += 1
            host_ns[-1] += time.perf_counter_ns() - t0
            rounds += 1
            for _ in range(finished):
                if submitted + len(returning) < total:
                    returning.append(rounds + args.return_rounds)
        per_round = sum(host_ns) / 1e3 / max(rounds, 1)
        report[concurrency] = {"rounds": rounds, "pipelined": sched.counters.pipelined,
                               "host_us_per_round": per_round, "host_us_per_token": sum(host_ns) / 1e3 / max(tokens, 1),
                               "tokens_per_round": tokens / max(rounds, 1),
                               "ttft_rounds_p50": float(np.percentile(ttft_rounds, 50)),
                               "ttft_rounds_mean": float(np.mean(ttft_rounds)), "ttft_rounds_max": max(ttft_rounds)}
        r = report[concurrency]
        launches = {cp.Operation.Name(op).removeprefix("OPERATION_").lower(): n
                    for op, n in sorted(sched.counters.launches.items())}
        r["launches"] = launches
        print(f"{concurrency:>5} {rounds:>7} {r['pipelined']:>9} {per_round:>9.0f} {r['host_us_per_token']:>9.1f} "
              f"{r['tokens_per_round']:>12.1f} {r['ttft_rounds_p50']:>15.0f} {r['ttft_rounds_mean']:>6.1f} "
              f"{r['ttft_rounds_max']:>5}  {launches}", flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
