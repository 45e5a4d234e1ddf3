"""CPU executor throughput and memory beside llama.cpp on the same GGUF, in the same run.

Run:  python -m bench.cpu_executor [--core var/cores/smollm2-135m-instruct.core] [--rounds 2] [--no-peer]
      python -m bench.cpu_executor --recipe qwen2.5-coder-1.5b-instruct --core q15.core ...   # another model

Each engine runs in its own child process, so each resident set is its own, alternately
(llama.cpp, helios, llama.cpp, helios, ... for `rounds`), both with 2 threads:
- helios: the prepared core loaded as serving loads it (Bootstrap + NativeModel, executor
  "cpu"); prefill = one PREFILL step of `prefill_tokens` prompt ids (program r1.t512) with one
  draw; decode at B = B lanes prefilled (untimed) with the same `decode_prompt_tokens` ids, the
  prompt's whole cache pages shared by the lanes (as llama.cpp's peer copies its prompt's cells to
  each sequence; bench/timed_lanes.py), then `new_tokens` greedy DECODE rounds of B rows (requests that asked for no logprobs, as
  llama.cpp's peer computes none); tokens/s = B * steps / seconds, the median of `repeats`.
- llama.cpp: bench/cpu_peer.py's measurement (llama-cpp-python, same prompt ids, the recipe's GGUF:
  by default SmolLM2's Q4_1 file; `--recipe NAME` the packaged GGUF of that recipe, reassembled
  and checked, whose tokenizer then makes the prompt ids too; the core must be that recipe's).
Memory: the child's resident set (VmRSS) after its last measurement with the engine still loaded
(llama.cpp's too: it frees its weights and cache when closed), its peak (VmHWM), and its
anonymous and file-backed parts (RssAnon, RssFile). The prompt ids are made once, here, and
handed to both children: made in a child they cost it a parse of the GGUF's vocabulary and
tokenizer (peak +150 MiB, ~45 MiB of freed heap left resident), which neither engine needs.

Ratios are helios / llama.cpp of the medians over rounds; every run's figure is kept; the batch-8
spread is helios's fastest over its slowest round. The host's CPU model and vector features
(AVX2, AVX-512 subsets, FMA, F16C, NEON: LLVM's view, as the kernels are compiled) and the ISA
path helios's kernels were compiled for (executors/cpu/isa.py; `--isa avx2` compiles the AVX2
path on an AVX-512 host: the code an AVX2-only CPU runs, measured on this core, with numpy's
OpenBLAS on its Haswell kernels for prefill's sgemm, OPENBLAS_CORETYPE) go in the JSON and the
text. The machine is shared: the load average before and after is recorded, and the text output
flags rounds whose runs differ by more than 1.5x. Writes cpu_ratios.json and .txt (with --recipe:
cpu_ratios_<recipe>.*) to the CPU's folder
(bench/harness.py: var/bench/<cpu>/, with --results bench/results/<cpu>/, or --out DIR).
`--no-peer` measures helios alone (no ratios): where llama-cpp-python (the `bench` extra) is not
installed, that is what `make bench` runs.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from bench.harness import DEFAULT_CORE, add_output_arguments, cpu_name, output_dir

GOALS = {"decode_b1": 0.8, "decode_b8": 1.5, "prefill": 1.5, "decode_b1_tokens_per_s": 60.0, "rss_ratio": 1.4,
         "decode_b8_spread": 1.2}


def _memory() -> dict[str, int]:
    """This process's resident set now and at its peak, and the anonymous and file-backed parts
    of it now, bytes (Linux /proc)."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) * 1024
    return {"rss_bytes": fields["VmRSS"], "peak_rss_bytes": fields["VmHWM"], "rss_anon_bytes": fields["RssAnon"],
            "rss_file_bytes": fields["RssFile"]}


def host_description() -> dict[str, Any]:
    """The CPU model, LLVM's name for it and the vector features a kernel path may use (present or not)."""
    from helios_backend.executors.cpu import isa

    llvm_name, features = isa.host_cpu()
    return {"cpu_model": cpu_name(), "llvm_cpu": llvm_name, "executable_isa_paths": list(isa.executable_paths(features)),
            "features": {name: features.get(name, False) for name in isa.REPORTED_FEATURES if name in features}}


def isa_figures() -> dict[str, Any]:
    """The ISA path this process's kernels were compiled for."""
    from helios_backend.executors.cpu import isa

    path = isa.active()
    return {"isa_path": path.name, "vector_bits": path.vector_bits, "llvm_cpu": path.cpu_name}


def _figures(prefill_runs: Sequence[float], prefill_tokens: int, decode: Mapping[int, Sequence[float]],
             steps: int) -> dict[str, Any]:
    return {"prefill_tokens": prefill_tokens, "prefill_runs_s": list(prefill_runs),
            "prefill_tokens_per_s": prefill_tokens / statistics.median(prefill_runs),
            "decode": {str(b): {"steps": steps, "runs_s": list(runs),
                                "tokens_per_s": b * steps / statistics.median(runs)} for b, runs in decode.items()}}


def measure_helios(core: Path, prefill_ids: Sequence[int], decode_ids: Sequence[int], batches: Sequence[int],
                   new_tokens: int, repeats: int, threads: int, activations: str | None = None) -> dict[str, Any]:
    """`activations`: the CPU executor's option (None: its default), recorded as it ran."""
    from helios_backend.engine.bootstrap import Bootstrap
    from helios_backend.engine.model import ModelOptions, NativeModel
    from bench.timed_lanes import timed_decode, timed_prefill

    bootstrap = Bootstrap.load(core, core_namespace(core))     # a benchmark accepts whoever signed it
    pages = max(batches) * (-(-(len(decode_ids) + new_tokens + 1) // 16)) + 64
    model = NativeModel.load(bootstrap.contract, bootstrap.manifest, bootstrap.read_resource,
                             ModelOptions(executor="cpu", threads=threads, concurrency=max(batches),
                                          cache_pages=max(pages, len(prefill_ids) // 16 + 8), activations=activations))
    ran = model.executor.cpu_options.activations             # type: ignore[attr-defined]
    loaded = _memory()
    try:
        timed_prefill(model, [prefill_ids])                                    # warm-up
        prefill_runs = [timed_prefill(model, [prefill_ids]) for _ in range(repeats)]
        timed_decode(model, decode_ids, 1, 4)                                  # warm-up
        decode = {b: [timed_decode(model, decode_ids, b, new_tokens) for _ in range(repeats)] for b in batches}
        measured = _memory()                                                    # the model still loaded
    finally:
        model.close()
        bootstrap.close()
    figures = _figures(prefill_runs, len(prefill_ids), decode, new_tokens)
    figures.update(engine="helios cpu executor", threads=threads, activations=ran, after_load=loaded, **measured,
                   **isa_figures())
    return figures


def core_namespace(core: Path) -> str:
    from helios_backend.core import open_core

    with open_core(core) as opened:
        return opened.namespace


def peer_gguf(recipe: str | None) -> Path | None:
    """The GGUF llama.cpp runs: the recipe's packaged source (reassembled and checked), or None
    (bench/cpu_peer.py's default, SmolLM2's file)."""
    if recipe is None:
        return None
    from ignition.cli import recipe_module

    return Path(recipe_module(recipe).SOURCE.assemble())


def measure_llama(prefill_ids: Sequence[int], decode_ids: Sequence[int], batches: Sequence[int],
                  new_tokens: int, repeats: int, threads: int, gguf: Path | None = None) -> dict[str, Any]:
    from bench.cpu_peer import measure_llama_cpp

    peer = measure_llama_cpp(prefill_ids=prefill_ids, decode_prompt_ids=decode_ids, gguf_path=gguf, batches=batches,
                             new_tokens=new_tokens, threads=threads, repeats=repeats, memory=_memory)
    figures = _figures(peer.prefill_runs, peer.prefill_tokens, {d.batch: d.runs for d in peer.decode}, new_tokens)
    assert peer.resident is not None
    figures.update(engine=peer.engine, threads=threads, **peer.resident)      # the model still loaded
    return figures


def _child(args: argparse.Namespace) -> None:
    ids = json.loads(args.ids.read_text())
    prefill_ids, decode_ids = ids["prefill"], ids["decode"]
    if args.engine == "helios":
        figures = measure_helios(args.core, prefill_ids, decode_ids, args.batches, args.new_tokens, args.repeats,
                                 args.threads, args.activations)
    else:
        figures = measure_llama(prefill_ids, decode_ids, args.batches, args.new_tokens, args.repeats, args.threads,
                                peer_gguf(args.recipe))
    print(json.dumps(figures))


def _run_child(engine: str, args: argparse.Namespace, ids: Path) -> dict[str, Any]:
    command = [sys.executable, "-m", "bench.cpu_executor", "--engine", engine, "--ids", str(ids), "--core", str(args.core),
               "--threads", str(args.threads), "--repeats", str(args.repeats), "--new-tokens", str(args.new_tokens),
               "--prefill-tokens", str(args.prefill_tokens), "--decode-prompt-tokens", str(args.decode_prompt_tokens),
               "--batches", *map(str, args.batches), *(["--recipe", args.recipe] if args.recipe else []),
               *(["--activations", args.activations] if args.activations else [])]
    environment = dict(os.environ, OPENBLAS_NUM_THREADS=str(args.threads))
    if engine == "helios" and args.isa:
        environment["HELIOS_CPU_ISA"] = args.isa
        if args.isa == "avx2":          # prefill's sgemm too: numpy's OpenBLAS picks its kernels by the CPU
            environment.setdefault("OPENBLAS_CORETYPE", "Haswell")
    done = subprocess.run(command, check=True, capture_output=True, text=True, env=environment)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _median_of(rounds: list[dict[str, Any]], *path: str) -> float:
    values = []
    for figures in rounds:
        value: Any = figures
        for key in path:
            value = value[key]
        values.append(float(value))
    return statistics.median(values)


def summarize(helios: list[dict[str, Any]], llama: list[dict[str, Any]], batches: Sequence[int],
              load: dict[str, Any], host: dict[str, Any]) -> dict[str, Any]:
    """Ratios, memory and goals over the rounds; without llama.cpp's rounds (--no-peer) only
    helios's own figures and the goal that needs no peer."""
    b1 = _median_of(helios, "decode", "1", "tokens_per_s") if 1 in batches else 0.0
    memory = {"helios_rss_bytes": _median_of(helios, "rss_bytes"),
              "helios_peak_rss_bytes": _median_of(helios, "peak_rss_bytes")}
    ratios: dict[str, float] = {}
    met = {"decode_b1_tokens_per_s": b1 >= GOALS["decode_b1_tokens_per_s"]}
    spread = None
    if 8 in batches and helios:
        b8 = [float(f["decode"]["8"]["tokens_per_s"]) for f in helios]
        spread = max(b8) / min(b8)
        met["decode_b8_spread"] = spread <= GOALS["decode_b8_spread"]
    if llama:
        ratios["prefill"] = _median_of(helios, "prefill_tokens_per_s") / _median_of(llama, "prefill_tokens_per_s")
        for b in batches:
            ratios[f"decode_b{b}"] = (_median_of(helios, "decode", str(b), "tokens_per_s")
                                      / _median_of(llama, "decode", str(b), "tokens_per_s"))
        memory |= {"llama_cpp_rss_bytes": _median_of(llama, "rss_bytes"),
                   "llama_cpp_peak_rss_bytes": _median_of(llama, "peak_rss_bytes")}
        memory["rss_ratio"] = memory["helios_rss_bytes"] / memory["llama_cpp_rss_bytes"]
        met = {"decode_b1": ratios.get("decode_b1", 0.0) >= GOALS["decode_b1"], **met,
               "decode_b8": ratios.get("decode_b8", 0.0) >= GOALS["decode_b8"],
               "prefill": ratios["prefill"] >= GOALS["prefill"],
               "rss": memory["rss_ratio"] <= GOALS["rss_ratio"]}
    paths = sorted({f.get("isa_path", "?") for f in helios})
    return {"ratios": ratios, "goals": GOALS, "goals_met": met, "memory": memory, "load_average": load,
            "host": host, "isa_path": paths[0] if len(paths) == 1 else paths, "decode_b8_spread": spread,
            "helios": helios, "llama_cpp": llama, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def isa_line(host: dict[str, Any], paths: Any) -> str:
    """The host's CPU and vector features, and the ISA path(s) helios's kernels ran, as one line; a
    path narrower than the widest the host runs is named as such (an AVX2 code path on an AVX-512
    core is not an AVX2-only machine: same caches, memory and clocks)."""
    present = [name for name, on in host["features"].items() if on]
    widest = host["executable_isa_paths"][0] if host["executable_isa_paths"] else "?"
    named = [paths] if isinstance(paths, str) else list(paths)
    notes = [f"the {p} code path on this {widest} CPU, not an {p}-only machine" for p in named if p != widest]
    return (f"host: {host['cpu_model']} (LLVM {host['llvm_cpu']}: {' '.join(present) or 'no vector extensions'}); "
            f"helios kernels: {', '.join(named)} path" + (f" ({'; '.join(notes)})" if notes else ""))


def format_text(summary: dict[str, Any], batches: Sequence[int]) -> str:
    threads = summary["helios"][0]["threads"] if summary["helios"] else "?"
    peer = " vs llama.cpp" if summary["llama_cpp"] else ""
    lines = [f"CPU executor{peer}, {summary.get('recipe', 'smollm2-135m-instruct')}, {summary['date']}, "
             f"{threads} thread(s) each, load average "
             f"{summary['load_average']['before']} -> {summary['load_average']['after']}",
             isa_line(summary["host"], summary["isa_path"])]
    for name, rounds in (("helios cpu", summary["helios"]), ("llama.cpp", summary["llama_cpp"])):
        for i, f in enumerate(rounds):
            cells = [f"prefill {f['prefill_tokens_per_s']:,.0f}"]
            cells += [f"b={b} {f['decode'][str(b)]['tokens_per_s']:,.1f}" for b in batches]
            runs = [f["prefill_runs_s"]] + [f["decode"][str(b)]["runs_s"] for b in batches]
            noisy = any(max(r) > 1.5 * min(r) for r in runs if r)
            lines.append(f"  {name:10s} round {i}: tok/s " + ", ".join(cells)
                         + f", rss {f['rss_bytes'] / 2**20:,.0f} MiB (peak {f['peak_rss_bytes'] / 2**20:,.0f}"
                         + (f", anon {f['rss_anon_bytes'] / 2**20:,.0f} file {f['rss_file_bytes'] / 2**20:,.0f})"
                            if "rss_anon_bytes" in f else ")")
                         + ("  [runs differ > 1.5x: busy machine]" if noisy else ""))
    if summary["decode_b8_spread"] is not None:
        lines.append(f"helios decode b=8, fastest / slowest round: x{summary['decode_b8_spread']:.2f}")
    if summary["llama_cpp"]:
        lines.append("ratios (helios / llama.cpp, medians over rounds): "
                     + ", ".join(f"{k} x{v:.2f}" for k, v in summary["ratios"].items())
                     + f", rss x{summary['memory']['rss_ratio']:.2f}")
    else:
        lines.append("no llama.cpp peer in this run (--no-peer): no ratios")
    lines.append("goals met: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in summary["goals_met"].items()))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--engine", choices=["helios", "llama"], help=argparse.SUPPRESS)   # child mode
    parser.add_argument("--ids", type=Path, help=argparse.SUPPRESS)                        # child: prompt ids
    parser.add_argument("--core", type=Path, default=DEFAULT_CORE)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--decode-prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-peer", action="store_true", help="measure helios alone (no llama.cpp, no ratios)")
    parser.add_argument("--recipe", default=None,
                        help="the recipe --core was prepared from, when not SmolLM2: llama.cpp runs its packaged GGUF "
                             "and its tokenizer makes the prompt ids (default: SmolLM2's GGUF)")
    parser.add_argument("--isa", choices=["auto", "avx512", "avx2", "host"],
                        help="the ISA path helios's kernels are compiled for (HELIOS_CPU_ISA; default: inherited, else auto)")
    parser.add_argument("--activations", choices=["f32", "q8"],
                        help="helios's block-weight products' activations (the CPU executor's option; default: its default)")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    if args.engine:
        _child(args)
        return
    from bench.cpu_peer import bench_prompt_ids
    from helios_backend.frontend.tokenizer import FrontendTokenizer
    from ignition.sources.gguf import GGUFModel, default_gguf_path
    from ignition.sources.tokenizer import tokenizer_json_from_gguf

    tokenizer = FrontendTokenizer.from_json(tokenizer_json_from_gguf(GGUFModel.open(
        peer_gguf(args.recipe) or default_gguf_path())))
    before = os.getloadavg()
    helios, llama = [], []
    with tempfile.TemporaryDirectory() as folder:
        ids = Path(folder) / "ids.json"
        ids.write_text(json.dumps({"prefill": bench_prompt_ids(args.prefill_tokens, tokenizer),
                                   "decode": bench_prompt_ids(args.decode_prompt_tokens, tokenizer)}))
        for _ in range(args.rounds):
            if not args.no_peer:
                llama.append(_run_child("llama", args, ids))
            helios.append(_run_child("helios", args, ids))
    load = {"before": [round(x, 2) for x in before], "after": [round(x, 2) for x in os.getloadavg()]}
    summary = summarize(helios, llama, args.batches, load, host_description())
    summary["recipe"] = args.recipe or "smollm2-135m-instruct"
    text = format_text(summary, args.batches)
    print(text)
    out = output_dir(args.out, args.results, "cpu")
    stem = "cpu_ratios" + (f"_{args.recipe}" if args.recipe else "") + (f"_{args.isa}" if args.isa else "") + \
        (f"_{args.activations}" if args.activations else "")
    (out / f"{stem}.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / f"{stem}.txt").write_text(text + "\n")
    print(f"wrote {out / stem}.json and {stem}.txt")


if __name__ == "__main__":
    main()
