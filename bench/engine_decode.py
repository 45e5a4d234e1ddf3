"""Engine decode throughput against batch size, and host time per step per token.

Run:  OPENBLAS_NUM_THREADS=1 python -m bench.engine_decode [--core PATH] [--steps 8]

The serving path without Triton: the real scheduler (token-budget loop, pages, completion
validation) and the program runner (shared packing, executor, completion parsing) on the
numpy executor, driving B concurrent requests. After every lane reached decode, `steps`
rounds are timed. Columns:

  tok/s          B * steps / wall seconds of the timed rounds (executor included)
  step ms        wall time of one decode round (median)

The per-token columns are the median round's host time divided by B (the machine is
shared, so medians, not sums).
  pack us/tok    host time packing the staging frame, per generated token
  compl us/tok   host time parsing + validating completion records, per token
  sched us/tok   host time in scheduler.schedule + scheduler.complete, per token
  host us/tok    the three together: the per-step host cost that is not the executor
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

from helios_proto import contract_pb2 as cp

from helios_backend.engine.bootstrap import Bootstrap
from helios_backend.engine.settings import StartupOptions
from helios_backend.engine.setup import EngineSetup, derive_setup
from helios_backend.scheduler.request import RequestSpec, SamplingSettings
from helios_backend.scheduler.scheduler import Scheduler
from helios_backend.scheduler.variants import VariantTable
from helios_backend.engine.runner import ProgramRunner

from bench.harness import DEFAULT_CORE


def build(setup: EngineSetup, bootstrap: Bootstrap) -> tuple[Scheduler, ProgramRunner]:
    """One scheduler and runner per loaded model: slot generations and the executor's
    submission sequence continue across batches (packing remembers page tables by them).
    The server's configuration, less EOS, so every lane runs its full length."""
    contract, manifest, model = bootstrap.contract, bootstrap.manifest, setup.model
    vocab = contract.model.vocabulary
    config = dataclasses.replace(setup.scheduler, eos_ids=())
    scheduler = Scheduler(config, VariantTable.from_graphs(model.graphs))
    runner = ProgramRunner(model.executor, model.packer, manifest.completion, vocab.sampled_tokens,
                           vocab.histogram_bins or vocab.sampled_tokens, ())
    return scheduler, runner


def measure(scheduler: Scheduler, runner: ProgramRunner, batch: int, steps: int, prompt_tokens: int,
            first_serial: int) -> dict[str, float]:
    vocab = scheduler.config.vocab_size
    for i in range(batch):   # distinct prompts: no prefix sharing; no EOS so every lane runs
        prompt = tuple((1000 + 97 * (first_serial + i) + 13 * j) % vocab for j in range(prompt_tokens))
        # long enough that every lane is decoding together for `steps` rounds (admission
        # staggers lanes by the prefill variants' rows)
        scheduler.add(first_serial + i, RequestSpec(prompt, steps + batch + 4, SamplingSettings()))
    decode_rounds = wall = 0
    step_ms: list[float] = []
    sched_ns: list[int] = []
    pack_ns: list[int] = []
    compl_ns: list[int] = []
    while scheduler.has_work():
        t0 = time.perf_counter_ns()
        plan = scheduler.schedule()
        t1 = time.perf_counter_ns()
        assert plan is not None
        rows = runner.run(plan)
        t2 = time.perf_counter_ns()
        scheduler.complete(plan, rows)
        scheduler.take_events()
        t3 = time.perf_counter_ns()
        if plan.main.operation == cp.OPERATION_DECODE and len(plan.main.lanes) == batch and decode_rounds < steps:
            decode_rounds += 1
            wall += t3 - t0
            step_ms.append((t3 - t0) / 1e6)
            sched_ns.append((t1 - t0) + (t3 - t2))
            pack_ns.append(runner.timings.packing_ns)
            compl_ns.append(runner.timings.completion_ns)
    tokens = batch * decode_rounds
    per_token = lambda ns: statistics.median(ns) / batch / 1e3  # noqa: E731 - µs per token, median round
    host = [a + b + c for a, b, c in zip(sched_ns, pack_ns, compl_ns)]
    return {"batch": batch, "tok/s": tokens / (wall / 1e9), "step ms": statistics.median(step_ms),
            "pack us/tok": per_token(pack_ns), "compl us/tok": per_token(compl_ns),
            "sched us/tok": per_token(sched_ns), "host us/tok": per_token(host)}


def format_table(rows: list[dict[str, float]]) -> str:
    columns = list(rows[0])
    lines = [" | ".join(f"{c:>12}" for c in columns), " | ".join("-" * 12 for _ in columns)]
    for row in rows:
        lines.append(" | ".join(f"{row[c]:>12.0f}" if c == "batch" else f"{row[c]:>12.2f}" for c in columns))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--core", type=Path, default=DEFAULT_CORE)
    parser.add_argument("--acceptance", default="helios.local/smollm2")
    parser.add_argument("--batches", default="1,2,4,8,16,32")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    args = parser.parse_args()
    bootstrap = Bootstrap.load(args.core, args.acceptance)
    slots = bootstrap.manifest.request_slots
    setup = derive_setup(bootstrap.contract, bootstrap.manifest, bootstrap.read_resource,
                         StartupOptions(core_path=args.core, acceptance=args.acceptance,
                                        max_active=slots, queue_capacity=slots))
    model = setup.model
    try:
        scheduler, runner = build(setup, bootstrap)
        rows = []
        for i, b in enumerate(int(b) for b in args.batches.split(",")):
            rows.append(measure(scheduler, runner, b, args.steps, args.prompt_tokens, first_serial=1000 * i))
    finally:
        model.close()
        bootstrap.close()
    print(f"engine decode on the numpy executor ({args.core.name}, {args.steps} timed decode rounds per batch)")
    print(format_table(rows))


if __name__ == "__main__":
    main()
