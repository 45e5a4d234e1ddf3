"""What q8 activations cost in accuracy: the CPU executor's logits and greedy tokens, q8 against f32.

Run:  python -m bench.cpu_q8_accuracy [--core var/cores/smollm2-135m-instruct.core] [--steps 64]

Loads the core twice in this process (executor "cpu", one thread each: block-weight products with
f32 activations, and with q8 ones, kernel_abi/activations.py), prefills the same `batch` prompts
(the bench's prompt text at different lengths, bench/cpu_peer.py) on both and decodes `steps`
greedy rounds in lockstep. Per round it reads both executors' logits: the largest |q8 - f32| over
the rows whose tokens so far agree (after a row's tokens differ its inputs differ too), relative
to that row's largest |logit| as well; and per row the first step whose greedy token differs.
Writes cpu_q8_accuracy.json to the CPU's folder (bench/harness.py).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from bench.harness import DEFAULT_CORE, add_output_arguments, output_dir

LOGITS_KERNEL = "logits.norm_head.v1"


def _logits_buffer(manifest: Any, program: str) -> str:
    nodes = next(p.nodes for p in manifest.programs if p.name == program and p.rank == 0)
    return next(n.args[0].pointer.buffer for n in nodes if n.kernel == LOGITS_KERNEL)


def compare(core: Path, batch: int, steps: int) -> dict[str, Any]:
    from bench.cpu_peer import bench_prompt_ids
    from helios_backend.engine.bootstrap import Bootstrap
    from helios_backend.engine.model import ModelOptions, NativeModel
    from helios_backend.lockstep.generator import GenerationRequest
    from helios_backend.lockstep.raw_lanes import RawLanes
    from helios_proto import contract_pb2 as C

    bootstrap = Bootstrap.load(core, "helios.local/smollm2")
    prompts = [bench_prompt_ids(24 + 16 * i) for i in range(batch)]
    pages = batch * (-(-(max(map(len, prompts)) + steps + 8) // 16)) + 16
    models = {a: NativeModel.load(bootstrap.contract, bootstrap.manifest, bootstrap.read_resource,
                                  ModelOptions(executor="cpu", threads=1, concurrency=batch, cache_pages=pages,
                                               activations=a))
              for a in ("f32", "q8")}
    vocab = bootstrap.contract.model.vocabulary.sampled_tokens
    try:
        drivers = {a: RawLanes(m) for a, m in models.items()}
        actives = {a: d.admit([GenerationRequest(p, steps + 1, eos_ids=(-1,)) for p in prompts], list(range(batch)))
                   for a, d in drivers.items()}
        for a, driver in drivers.items():
            for active in actives[a]:
                driver.prefill(active)
        program = models["f32"].program(C.OPERATION_DECODE, batch, batch)
        buffer = _logits_buffer(bootstrap.manifest, program)
        largest, relative, first_difference = 0.0, 0.0, [None] * batch
        for step in range(steps):
            logits = {}
            for a, driver in drivers.items():
                driver.decode_round(actives[a])
                raw = models[a].executor.read_buffer(buffer)
                logits[a] = raw.view(np.float32)[:batch * vocab].reshape(batch, vocab)
            for row in range(batch):
                tokens = {a: actives[a][row].result.tokens for a in actives}
                if first_difference[row] is None:        # the inputs of this step agreed
                    difference = float(np.abs(logits["q8"][row] - logits["f32"][row]).max())
                    largest = max(largest, difference)
                    relative = max(relative, difference / float(np.abs(logits["f32"][row]).max()))
                    if tokens["q8"] != tokens["f32"]:
                        first_difference[row] = step
        tokens = {a: [r.result.tokens for r in actives[a]] for a in actives}
    finally:
        for model in models.values():
            model.close()
        bootstrap.close()
    return {"batch": batch, "steps": steps, "prompt_tokens": [len(p) for p in prompts],
            "max_abs_logit_difference": largest, "max_relative_logit_difference": relative,
            "first_differing_step_per_row": first_difference,
            "rows_with_identical_tokens": sum(d is None for d in first_difference), "tokens": tokens}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--core", type=Path, default=DEFAULT_CORE)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=64)
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    from bench.cpu_executor import host_description, isa_figures

    figures = {str(b): compare(args.core, b, args.steps) for b in args.batches}
    summary = {"host": host_description(), **isa_figures(), "batches": figures,
               "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    for batch, f in figures.items():
        print(f"b={batch}: max |logit q8 - f32| {f['max_abs_logit_difference']:.4f} "
              f"({f['max_relative_logit_difference']:.2e} of the row's largest), greedy tokens identical for "
              f"{f['rows_with_identical_tokens']} of {batch} rows over {f['steps']} steps; first differing step per "
              f"row {f['first_differing_step_per_row']}")
    written = output_dir(args.out, args.results, "cpu") / "cpu_q8_accuracy.json"
    written.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {written}")


if __name__ == "__main__":
    main()
