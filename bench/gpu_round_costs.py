"""Device time of the rounds the scheduler chooses between, on the H200 (CUDA executor).

    python -m bench.gpu_round_costs [--out DIR | --results] [--rows 64,128] [--prompt 32] [--mixed-prompts 1,2,4]

What admission costs the GPU: for R rows, a DECODE round of R decoding lanes; MIXED rounds
of R - k decoding lanes and k new `--prompt`-token prompts (k from `--mixed-prompts`, 1 by
default; a MIXED round of a served stack at 256 closed-loop clients carries one or two); rounds of prompts only (PREFILL)
of 1, 4 and 16 such prompts; INITIALIZATION of 1, 4 and 16 slots. Each figure is the device
time of one graph replay (events around back-to-back replays of the packed frame, as
bench/gpu_decode.py measures decode), with the smallest variant that holds the round, as
the scheduler picks it. Then the per-kernel GPU time of the MIXED and DECODE rounds at the
largest R (event nodes between nodes): where a MIXED round's extra time goes. The
scheduler's admission_burst weighs these (docs/scheduler.md). Writes gpu_round_costs.json to the
GPU's folder (bench/harness.py).
"""
from __future__ import annotations

import argparse
import json
import pathlib

from bench.gpu_decode import Bench
from bench.harness import add_output_arguments, output_dir
from helios_backend.executors.cuda.driver import load_driver
from helios_backend.engine.settings import StartupOptions
from helios_backend.engine.setup import derive_setup
from helios_backend.packing import PackedLane, SlotInitialization
from helios_backend.sampling_parameters import SamplingParameters
from helios_proto import contract_pb2 as C
from tests.gpu import timing
from tests.gpu.model_bundle import load_bundle


def initialization(bench: Bench, lane: PackedLane) -> PackedLane:
    """The INITIALIZATION lane of `lane`'s slot for its prompt (as Bench.admit initializes)."""
    assert lane.tokens is not None
    admission = SlotInitialization.for_prompt(lane.tokens.tolist(), bench.bins, lane.slot, SamplingParameters(logprobs=-1),
                                              1 << 20, (bench.vocab - 1,))
    return PackedLane(slot=lane.slot, generation=lane.generation, initialization=admission)


def fresh(bench: Bench, slot: int, prompt: int, extra: int) -> PackedLane:
    """An initialized slot with pages for its prompt: the host-fed lane of an admission."""
    bench.generation += 1
    tokens = bench.rng.integers(0, bench.vocab, prompt).astype("int32")
    lane = PackedLane(slot=slot, generation=bench.generation, start=0, tokens=tokens, sample=True)
    bench.driver.step(bench.model.program(C.OPERATION_INITIALIZATION, 1), [initialization(bench, lane)])
    pages = [bench.driver.pages.take() for _ in range(-(-(prompt + extra) // bench.driver.page_tokens))]
    lane.page_table = pages
    return lane


def replay_us(bench: Bench, program: str, lanes: list[PackedLane]) -> dict:
    bench.model.packer.pack(program, 0, lanes)
    return {"program": program, "gpu_us": timing.gpu_us(load_driver(), bench.model.executor, program, 30)}


def per_kernel(bench: Bench, program: str, lanes: list[PackedLane]) -> dict:
    bench.model.packer.pack(program, 0, lanes)
    nodes = bench.model.executor.profile_nodes(program, frame=0, repeats=10)
    totals: dict[str, list[float]] = {}
    for _label, kernel, us in nodes:
        totals.setdefault(kernel, []).append(us)
    return {"sum_us": sum(us for _, _, us in nodes),
            "per_kernel": {k: {"count": len(v), "total_us": round(sum(v), 1)}
                           for k, v in sorted(totals.items(), key=lambda kv: -sum(kv[1]))}}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_round_costs", description=__doc__.split("\n\n")[0])
    add_output_arguments(parser)
    parser.add_argument("--rows", default="64,128")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--mixed-prompts", default="1", help="prompts per MIXED round, comma-separated")
    args = parser.parse_args()
    out = output_dir(args.out, args.results, "gpu")
    contract, manifest, read = load_bundle()
    model = derive_setup(contract, manifest, read, StartupOptions(core_path=pathlib.Path("bundle"),
                                                                  executor="cuda")).model
    bench = Bench(model)
    report: dict = {"prompt": args.prompt, "rounds": {}, "profile": {}}
    rows_list = [int(r) for r in args.rows.split(",") if r]
    counts = [int(k) for k in args.mixed_prompts.split(",") if k]
    for rows in rows_list:
        decoding = bench.admit(list(range(rows)), args.prompt, 64)
        decode = model.program(C.OPERATION_DECODE, rows, rows)
        figures = {"decode": replay_us(bench, decode, decoding)}
        if rows == max(rows_list):
            report["profile"]["decode"] = per_kernel(bench, decode, decoding)
        line = f"{rows} rows: decode {figures['decode']['gpu_us']:.0f} us ({decode})"
        for k in sorted(counts):      # the k prompts take the last k slots (a full batch has no spare one)
            new = [fresh(bench, rows - k + i, args.prompt, 64) for i in range(k)]
            mixed = model.program(C.OPERATION_MIXED, rows, rows - k + k * args.prompt)
            name = "mixed" if k == 1 else f"mixed_{k}"
            figures[name] = replay_us(bench, mixed, decoding[:rows - k] + new)
            line += f", {k} prompt{'s' if k > 1 else ''}: mixed {figures[name]['gpu_us']:.0f} us ({mixed})"
            if rows == max(rows_list) and k == 1:
                report["profile"]["mixed"] = per_kernel(bench, mixed, decoding[:rows - 1] + new)
            bench.release(new)
        bench.release(decoding)
        report["rounds"][rows] = figures
        print(line, flush=True)
    for count in (1, 4, 16):
        lanes = [fresh(bench, 200 + i, args.prompt, 64) for i in range(count)]
        prefill = model.program(C.OPERATION_PREFILL, count, count * args.prompt)
        init = model.program(C.OPERATION_INITIALIZATION, count)
        figures = {"prefill": replay_us(bench, prefill, lanes)}
        bench.model.packer.pack(init, 0, [initialization(bench, lane) for lane in lanes])
        figures["initialization"] = {"program": init, "gpu_us": timing.gpu_us(load_driver(), model.executor, init, 30)}
        bench.release(lanes)
        report["rounds"][f"prompts_{count}"] = figures
        print(f"{count} prompts: prefill {figures['prefill']['gpu_us']:.0f} us ({prefill}), "
              f"initialization {figures['initialization']['gpu_us']:.0f} us ({init})", flush=True)
    for name, p in report["profile"].items():
        top = list(p["per_kernel"].items())[:8]
        print(f"profile {name}: serialized {p['sum_us']:.0f} us; " +
              "; ".join(f"{k} {v['count']}x {v['total_us']}us" for k, v in top), flush=True)
    (out / "gpu_round_costs.json").write_text(json.dumps(report, indent=1))
    model.executor.close()


if __name__ == "__main__":
    main()
