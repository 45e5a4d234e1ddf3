"""Device script: tensor parallelism of the model, TP=2 against TP=1 (issue #7 point 5).

Two cores of the same SmolLM2-135M weights, one prepared with `tensor_parallel=2` (per-rank
programs: 3 KV heads -> 2 + 1, ffn 1536 -> 768 + 768, an NCCL all-reduce after each attention
output and down projection) and one with a single rank, are written on the device from bundles
built here, loaded through Bootstrap (verify, validate) and NativeModel.load with the chosen
executor (cuda: world size 2 on devices 0 and 1, world size 1 on device 0). Compared:

  * every program both cores record (prefill, decode, mixed, ...): the same submissions on
    both; rank 0's logits (relative error), the sampled tokens (near ties explained), and on
    the TP=2 core rank 1's logits and slot state bit-identical to rank 0's (every rank draws
    the same token);
  * greedy generation for --steps steps at each --batches size: identical tokens, the logits
    of every round within tolerance, ranks in agreement at the end.

Prints a pass/fail table and writes tensor_parallel.json under --out.

    here:   python tests/gpu/tensor_parallel.py build [--no-kernels]   # .carry_model/tp1.bin, tp2.bin (xz)
    there:  python tests/gpu/tensor_parallel.py run --bundles DIR --out $OUT [--steps 64] [--batches 1,8]
                                                    [--rank-peers processes]   # rank 1 as a helios-rank process
    CPU dry run of all but the CUDA executor (both cores on the numpy executor, ranks in lockstep):
            python tests/gpu/tensor_parallel.py run --executor numpy --steps 8 --batches 1,2 --out /tmp/tp

The GGUF the weights are rebuilt from is model_bundle.joined_gguf() (HELIOS_GGUF_PARTS).

On the nvidia-h200-x2 machine (64 MiB per call: the GGUF halves travel in two calls, back to back
while the machine is warm; NCCL_NVLS_ENABLE=0 is set by the executor):

    call 1, carry [.carry_gguf1, .carry_model]:
        mkdir -p /tmp/tp && cp .carry_gguf1/part_a .carry_model/tp1.bin .carry_model/tp2.bin /tmp/tp/
    call 2, carry [.carry_gguf2, .carry_cuda, helios_proto]:
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site
        .carry_cuda/*.whl && export PYTHONPATH=/tmp/site && HELIOS_GGUF_PARTS=/tmp/tp/part_a:.carry_gguf2/part_b
        PYTHONUNBUFFERED=1 python3 tests/gpu/tensor_parallel.py run --bundles /tmp/tp --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sys
import tempfile
import time
import traceback
import zlib
from typing import Any, Sequence

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "gpu"))

DEGREES = (1, 2)
NAMESPACE = "helios.local/tensor-parallel-check"
CACHE_PAGES = 1024            # explicit: two models share device 0, neither may take the free memory
# max |TP2 - TP1| / max |TP1| per row. The tensor-core tiles round activations to f16 (measured
# against the f32 numpy oracle: up to ~5e-3 of a row's largest logit at 8 rows), and the two
# ranks round different partial sums, so TP2 and TP1 differ by that order; the GEMV paths
# (up to 4 rows) stay near 1e-3. Same order as tests/gpu/conformance.py's fp16 tolerance.
LOGIT_TOLERANCE = 1e-2
TIE_TOLERANCE = 5e-3          # |logit gap| / max |logit| under which two tokens tie
TOKEN_WORD = 2                # completion row word holding the sampled token
RANK_STATE = ("state.pending", "state.generated", "state.output_histogram", "state.seeds", "completion")
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,",
           "The three primary colors are", "Water boils at a temperature of", "import numpy as np\n",
           "The largest planet in the solar system is", "To make a cup of tea, first"]


def bundle_name(degree: int) -> str:
    return f"tp{degree}.bin"


def bundle_options(recipe: Any, degree: int, gguf_path: str | None = None) -> Any:
    """Variants the comparison needs: decode up to 8 rows (and 64, for bench/rank_processes.py), chunked
    prefill, mixed, restoration (the
    operations conformance.Case submits; no RESUME or SCORED_PREFILL programs)."""
    return recipe.RecipeOptions(decode_rows=(1, 2, 4, 8, 64), prefill_variants=((1, 32), (1, 128), (4, 128)),
                                mixed_variants=((8, 135),), admission_rows=(1, 4), restoration_rows=(1, 4),
                                resume_rows=(), scored_prefill_variants=(), context_tokens=2048,
                                prepared_pages=CACHE_PAGES, tensor_parallel=degree, gguf_path=gguf_path,
                                speculative_widths=())


# ---- here: the bundles ----------------------------------------------------------------------------

def build(out: pathlib.Path, kernels: bool) -> None:
    from model_bundle import GGUF_HALVES, split_gguf, write_bundle

    from ignition.preparation.prepare import prepare
    from ignition.recipes import smollm2_135m_instruct as recipe

    library = None
    if kernels:
        from ignition.gpu_kernels.library import KernelLibrary
        library = KernelLibrary()
    for degree in DEGREES:
        started = time.time()
        options = bundle_options(recipe, degree)
        prepared = prepare(recipe, options, kernel_library=library)
        path = out / bundle_name(degree)
        write_bundle(prepared, options, path, compress=True)
        print(f"{path}: {path.stat().st_size / 2**20:.1f} MiB, {len(prepared.manifest.programs)} programs over "
              f"{prepared.manifest.world_size} rank(s), {len(prepared.manifest.modules)} kernel modules, "
              f"{time.time() - started:.0f} s", flush=True)
    if not all(p.exists() for p in GGUF_HALVES):
        split_gguf()


# ---- there: load, run, compare --------------------------------------------------------------------

RANK_PROCESSES: list[Any] = []      # helios-rank processes started by load_model (stopped by stop_rank_processes)


def start_rank_processes(core: pathlib.Path, world_size: int, executor: str, port: int) -> None:
    """helios-rank for ranks 1..world_size-1 of `core` (rank r on device r), joining 127.0.0.1:port."""
    import subprocess

    for rank in range(1, world_size):
        RANK_PROCESSES.append(subprocess.Popen([
            sys.executable, "-m", "helios_backend.cli.rank", "--core", str(core), "--rank", str(rank),
            "--store", f"127.0.0.1:{port}", "--executor", executor, "--acceptance", NAMESPACE],
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}))


def stop_rank_processes() -> list[int]:
    """Exit codes of the rank processes (0: closed by rank 0); any still running is killed."""
    codes = []
    while RANK_PROCESSES:
        process = RANK_PROCESSES.pop()
        try:
            codes.append(process.wait(30))
        except Exception:   # noqa: BLE001 - a rank that did not stop is killed, its code reported
            process.kill()
            codes.append(process.wait())
    return codes


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def load_model(bundle: pathlib.Path, executor: str, via_core: bool, workdir: pathlib.Path,
               rank_peers: str = "threads") -> tuple[Any, list]:
    """The bundle's model through the serving path (a signed core, Bootstrap.load, NativeModel.load)
    and PROMPTS tokenized with the core's own tokenizer.json. rank_peers="processes": ranks
    1.. of a tensor-parallel core run as helios-rank processes on the written core."""
    from tokenizers import Tokenizer

    from model_bundle import materialize, read_payload, write_core

    from helios_backend.contract import PreparedContract
    from helios_backend.engine.model import ModelOptions, NativeModel

    contract, manifest, read = materialize(read_payload(bundle))
    ranks: dict[str, Any] = {}
    if via_core or rank_peers == "processes":
        from helios_backend.engine.bootstrap import Bootstrap

        core = workdir / (bundle.stem + ".core")
        if not core.exists():
            write_core(core, contract, manifest, read.__self__, NAMESPACE)
        bootstrap = Bootstrap.load(core, NAMESPACE)          # verify, authorize, validate the contract
        contract, manifest, read = bootstrap.contract, bootstrap.manifest, bootstrap.read_resource
        if rank_peers == "processes" and manifest.world_size > 1:
            port = free_port()
            start_rank_processes(core, manifest.world_size, executor, port)
            ranks = {"rank_peers": "processes", "rank_store": f"127.0.0.1:{port}",
                     "core_digest": bootstrap.core.content_digest()}
    else:
        PreparedContract.decode(contract, manifest, resource_ids=frozenset(read.__self__))
    tokenizer = Tokenizer.from_str(bytes(read(contract.model.frontend.tokenizer_resource)).decode())
    # every captured row on any executor (the numpy dry run serves bench/rank_processes.py's 64 rows too)
    model = NativeModel.load(contract, manifest, read, ModelOptions(cache_pages=CACHE_PAGES, executor=executor,
                                                                    concurrency=contract.concurrency, **ranks))
    return model, [tokenizer.encode(text).ids for text in PROMPTS]


def greedy_with_logits(model: Any, prompts: Sequence[Sequence[int]], steps: int) -> tuple[list[list[int]], np.ndarray]:
    """Greedy tokens of every prompt for `steps` steps (no EOS stop) and rank 0's logits
    [rounds, rows, vocab] after every decode round."""
    from helios_backend.lockstep.generator import GenerationRequest
    from helios_backend.lockstep.raw_lanes import RawLanes

    vocab = model.contract.model.vocabulary.sampled_tokens
    driver = RawLanes(model)
    requests = [GenerationRequest(list(p), steps, eos_ids=(vocab - 1,)) for p in prompts]
    actives = driver.admit(requests, list(range(len(prompts))))
    for active in actives:
        driver.prefill(active)
    logits = []
    while not actives[0].result.finish:
        driver.decode_round(actives)
        logits.append(model.executor.read_buffer("scratch.logits").view(np.float32)[:len(prompts) * vocab]
                      .reshape(len(prompts), vocab).copy())
    driver.pages.give_back(p for a in actives for p in a.pages)
    return [a.result.tokens for a in actives], np.stack(logits) if logits else np.zeros((0, len(prompts), vocab))


def rank_disagreements(model: Any, buffers: Sequence[str]) -> list[str]:
    """Buffers whose bytes differ between rank 0 and any other rank (empty: the ranks agree)."""
    world = max(1, model.execution_manifest.world_size)
    names = {b.name for b in model.execution_manifest.buffers}
    executor = model.executor
    return [name for name in buffers if name in names
            for rank in range(1, world)
            if not np.array_equal(executor.read_buffer(name, rank=0), executor.read_buffer(name, rank=rank))][:16]


def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    """max over rows of max |a - b| / max |b| (b the TP=1 reference)."""
    scale = np.maximum(np.abs(b).max(axis=-1), 1e-6)
    return float(np.max(np.abs(a - b).max(axis=-1) / scale)) if b.size else 0.0


def tokens_tie(tokens: tuple[int, int], logits: np.ndarray) -> bool:
    a, b = tokens
    return 0 <= a < logits.size and 0 <= b < logits.size and \
        abs(float(logits[a] - logits[b])) <= TIE_TOLERANCE * float(np.abs(logits).max())


def compare_program(models: dict[int, Any], program: Any, index: int) -> dict:
    """One program's submission sequence (conformance.Case) on both cores."""
    from conformance import Case, logits_buffer

    vocab = models[1].contract.model.vocabulary.sampled_tokens
    outputs = {}
    for degree, model in models.items():
        case = Case(model, seed=zlib.crc32(program.name.encode()), first_generation=1_000_000 * (index + 1))
        rows = case.run(program).copy()
        name = logits_buffer(model.execution_manifest, case.logits_program or program.name)
        logits = None
        if name is not None:
            raw = model.executor.read_buffer(name).view(np.float32)
            logits = raw[:model.execution_manifest.request_slots * vocab].reshape(-1, vocab)[:program.capacity.rows].copy()
        outputs[degree] = (rows, logits)
    (rows2, logits2), (rows1, logits1) = outputs[2], outputs[1]
    result: dict = {"case": program.name}
    differing = [r for r in range(len(rows1)) if not np.array_equal(rows1[r], rows2[r])]
    ties = [r for r in differing if logits1 is not None and r < len(logits1)
            and tokens_tie((int(rows2[r][TOKEN_WORD]), int(rows1[r][TOKEN_WORD])), logits1[r])]
    result["tokens_equal"] = len(ties) == len(differing)
    if ties:
        result["near_ties"] = len(ties)
    if logits1 is not None:
        result["logit_rel_err"] = relative_error(logits2, logits1)
        result["logits_close"] = bool(result["logit_rel_err"] <= LOGIT_TOLERANCE and np.isfinite(logits2).all())
    result["rank_disagreements"] = rank_disagreements(models[2], RANK_STATE + ((name,) if name else ()))
    result["pass"] = (result["tokens_equal"] and result.get("logits_close", True)
                      and not result["rank_disagreements"])
    return result


def compare_greedy(models: dict[int, Any], prompts: list[list[int]], steps: int) -> dict:
    runs = {degree: greedy_with_logits(model, prompts, steps) for degree, model in models.items()}
    (tokens2, logits2), (tokens1, logits1) = runs[2], runs[1]
    result: dict = {"case": f"greedy.batch{len(prompts)}.steps{steps}", "steps": min(len(t) for t in tokens2),
                    "tokens_equal": tokens2 == tokens1}
    first = next(((row, step) for row, (a, b) in enumerate(zip(tokens2, tokens1))
                  for step, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if first is not None:
        row, step = first
        result["first_difference"] = {"row": row, "step": step, "tp2": tokens2[row][step], "tp1": tokens1[row][step]}
        if step >= 1:       # step 0 comes from the prefill; round `step - 1` produced token `step`
            result["first_difference"]["near_tie"] = tokens_tie((tokens2[row][step], tokens1[row][step]),
                                                                logits1[step - 1][row])
    # rounds before the first differing token saw identical inputs on both cores (round r makes token r + 1)
    rounds = min(len(logits1), len(logits2)) if first is None else first[1]
    result["logit_rel_err"] = relative_error(logits2[:rounds], logits1[:rounds])
    result["rank_disagreements"] = rank_disagreements(models[2], RANK_STATE + ("scratch.logits",))
    # a first difference at a near tie is two valid continuations (every round before it had
    # identical tokens and logits within tolerance); anything else is a disagreement
    tied = first is not None and result["first_difference"].get("near_tie", False)
    result["pass"] = ((result["tokens_equal"] or tied) and result["logit_rel_err"] <= LOGIT_TOLERANCE
                      and not result["rank_disagreements"] and result["steps"] == steps)
    return result


def run(args: argparse.Namespace) -> int:
    from model_bundle import BUNDLE_DIR

    started = time.time()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bundles = pathlib.Path(args.bundles or BUNDLE_DIR)
    results: list[dict] = []
    models: dict[int, Any] = {}
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="helios-tp-"))     # the cores, outside $OUT
    try:
        for degree in DEGREES:
            models[degree], prompts = load_model(bundles / bundle_name(degree), args.executor, not args.no_core,
                                                 workdir, args.rank_peers)
            print(f"TP={degree} ({args.executor}) loaded at {time.time() - started:.1f} s: "
                  f"{len(models[degree].executor.programs)} programs, world size "
                  f"{models[degree].execution_manifest.world_size}", flush=True)
        names = {p.name for p in models[1].execution_manifest.programs}
        programs = [p for p in models[2].execution_manifest.programs if p.rank == 0 and p.name in names
                    and (not args.only or p.name in args.only.split(","))]
        for index, program in enumerate([] if args.greedy_only else programs):
            results.append(_guarded(program.name, lambda: compare_program(models, program, index)))
        for batch in ([] if args.only else [int(b) for b in args.batches.split(",")]):
            results.append(_guarded(f"greedy.batch{batch}",
                                    lambda: compare_greedy(models, prompts[:batch], args.steps)))
    finally:
        for model in models.values():
            model.close()
        rank_exits = stop_rank_processes()
        shutil.rmtree(workdir, ignore_errors=True)
    if args.rank_peers == "processes":
        results.append({"case": "rank processes closed", "exit_codes": rank_exits,
                        "pass": rank_exits == [0] * (DEGREES[-1] - 1)})
    report = {"executor": args.executor, "rank_peers": args.rank_peers, "steps": args.steps, "results": results,
              "seconds": round(time.time() - started, 1)}
    (out / "tensor_parallel.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"\n{'case':34s} {'result':6s} detail")
    for r in results:
        detail = {k: r[k] for k in ("logit_rel_err", "steps", "first_difference", "near_ties", "rank_disagreements",
                                    "error") if k in r and r[k] not in ([], None)}
        print(f"{r['case']:34s} {'PASS' if r['pass'] else 'FAIL':6s} {detail}")
    failed = sum(not r["pass"] for r in results)
    print(f"{len(results) - failed}/{len(results)} passed in {report['seconds']} s")
    return 1 if failed else 0


def _guarded(case: str, work: Any) -> dict:
    """A failing case is a FAIL row with its error; the others still run."""
    try:
        result = work()
    except Exception as error:   # noqa: BLE001 - reported, never swallowed
        result = {"case": case, "pass": False, "error": repr(error), "trace": traceback.format_exc()[-1200:]}
    print(json.dumps({k: v for k, v in result.items() if k != "trace"}, default=str), flush=True)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("build", help="prepare the TP=1 and TP=2 bundles here")
    make.add_argument("--out", default=None, help="bundle folder (default .carry_model)")
    make.add_argument("--no-kernels", action="store_true", help="no AOT kernel modules (numpy dry runs only)")
    go = sub.add_parser("run", help="load both cores and compare")
    go.add_argument("--bundles", default=None, help="folder holding tp1.bin and tp2.bin (default .carry_model)")
    go.add_argument("--out", default=os.environ.get("OUT", "out"))
    go.add_argument("--executor", default="cuda", choices=["cuda", "numpy"])
    go.add_argument("--steps", type=int, default=64)
    go.add_argument("--batches", default="1,8")
    go.add_argument("--only", default="", help="comma-separated program names (no greedy runs)")
    go.add_argument("--greedy-only", action="store_true")
    go.add_argument("--no-core", action="store_true", help="load from the bundles without writing cores")
    go.add_argument("--rank-peers", default="threads", choices=["threads", "processes"],
                    help="processes: the TP=2 core's rank 1 runs as a helios-rank process (device 1)")
    args = parser.parse_args(argv)
    if args.command == "build":
        from model_bundle import BUNDLE_DIR
        build(pathlib.Path(args.out or BUNDLE_DIR), kernels=not args.no_kernels)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
