"""llama.cpp beside the CUDA executor on the H200: the same model shapes, measured in the same run.

    here    python -m bench.gpu_llama_peer carry .carry_llama [--recipe NAME ...] [--layout NAME ...]
    device  python3 -m bench.gpu_llama_peer build --carry .carry_llama                  (~6 min)
            python3 -m bench.gpu_llama_peer run --carry .carry_llama --bundle DIR ... [--out DIR | --results]
            python3 -m bench.gpu_llama_peer run --carry .carry_llama --kernel-shapes --out DIR

`carry` fills a folder that travels in one device call (~10 MB): llama.cpp 0c1e5709 as vendored
by the llama-cpp-python 0.3.36 source package (trimmed of models, docs and the non-CUDA ggml
backends, xz) and one shape file per recipe (bench/gguf_shape.py: every metadata key and tensor
of the recipe's real GGUF, no weights; default: the three recipes) and per `--layout` (a
bench/layouts config.json alone: bench/gguf_shape.py `layout`; default none). The real GGUFs never travel.

`build` (device) builds llama-server, llama-bench and llama-batched-bench with CUDA for sm_90
(bench/llama_cpp_build.sh) into --work (default /tmp/lcb, kept while the machine stays warm) and
writes, with llama.cpp's own gguf-py, one random-weight F16 GGUF per shape file. Both steps are
skipped when their inputs have not changed, so `run` after `build` on the same warm machine
only measures; `run` alone builds first (then it needs ~10 min: two calls fit better).

`run` (device), for each shape file, and beside it ours where a bundle folder of that recipe is
given (tests/gpu/model_bundle.py's bundle.bin records its recipe): llama.cpp first, then ours,
never both on the GPU at once:
  - llama-bench -p 512 -n 128 -ngl 99 -fa 1 (JSON): prefill pp512 and decode tg128 (batch 1,
    context 0 -> 128);
  - llama-batched-bench -npp 128 -ntg 128 -npl 1,8,64 -ngl 99 -fa on (JSONL): decode of B
    sequences after a 128-token prompt each (S_TG, tokens/s over the batch);
  - python -m bench.gpu_decode with HELIOS_RANDOM_WEIGHTS=1 (random weights of the prepared layout)
    --batches 1,8,64 --prefills 512 --prompt 128 --steps 128: decode after the same 128-token
    prompt, and a 512-token prefill.
`run --kernel-shapes` measures llama.cpp alone, for every shape file, at the shapes of
bench/kernels.py (its CONTEXT, DECODE_BATCHES and PREFILL_TOKENS): llama-batched-bench decode of
B sequences whose steps attend over CONTEXT positions on average (a CONTEXT - KERNEL_STEPS / 2
token prompt, then KERNEL_STEPS steps), and llama-bench prefill of 512 and 4,096 tokens with
micro-batches of 512 and 2,048 (the faster one counts: what a user tuning llama.cpp gets).
It writes llama_cpp_layouts.json, which `bench.kernels run --llama-cpp` puts in its rows.
Ratios ours / llama.cpp: decode b1 against tg128 (and against batched-bench B=1, the same
context as ours), b8 and b64 against batched-bench, prefill 512 against pp512. Written to
<name>.json and .txt in the GPU's folder (bench/harness.py: var/bench/<gpu>/, with --results
bench/results/<gpu>/).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

from bench import gguf_shape
from bench.harness import ROOT, add_output_arguments, output_dir

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
LLAMA_CPP_COMMIT = "0c1e5709"
TREE = "llama.cpp.tar.xz"
SHAPE_SUFFIX = ".shape.gguf.xz"
RECIPES = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "gemma-3-270m")
# what the device build does not need (make_carry.sh trims the same): 7 MB of xz remain
TRIMMED = ("models", "docs", "benches", ".github", "media") + tuple(
    f"ggml/src/{b}" for b in ("ggml-cann", "ggml-hexagon", "ggml-hip", "ggml-metal", "ggml-musa", "ggml-opencl",
                              "ggml-openvino", "ggml-sycl", "ggml-vulkan", "ggml-webgpu", "ggml-zdnn", "ggml-zendnn",
                              "ggml-et", "ggml-virtgpu"))
BATCHES = (1, 8, 64)
PROMPT, STEPS, PREFILL = 128, 128, 512
TOOLS = ("llama-bench", "llama-batched-bench")
KERNEL_STEPS = 32                   # decode steps a batch runs at the kernel shapes
MICRO_BATCHES = (512, 2048)         # llama-bench -ub values tried for the prefill figures
LAYOUT_DIR = ROOT / "bench" / "layouts"


# ---- here: the carry folder -------------------------------------------------------------------

def llama_cpp_source(scratch: pathlib.Path) -> pathlib.Path:
    """llama-cpp-python's source package (pip download, from the cache when it holds it)."""
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                    "-d", str(scratch), LLAMA_CPP_PYTHON], check=True)
    [sdist] = scratch.glob("llama_cpp_python-*.tar.gz")
    return sdist


def pack_tree(sdist: pathlib.Path, out: pathlib.Path) -> None:
    """The sdist's vendor/llama.cpp, trimmed (TRIMMED), as llama.cpp/... in an xz tarball."""
    with tarfile.open(sdist, "r:gz") as src, tarfile.open(out, "w:xz", preset=6) as dst:
        for member in src:
            parts = member.name.split("/")
            if len(parts) < 3 or parts[1:3] != ["vendor", "llama.cpp"]:
                continue
            inner = "/".join(parts[3:])
            if any(inner == t or inner.startswith(t + "/") for t in TRIMMED):
                continue
            member.name = "/".join(["llama.cpp"] + parts[3:])
            # long names travel in pax headers, which would override the new name
            member.pax_headers = {k: v for k, v in member.pax_headers.items() if k not in ("path", "linkpath")}
            dst.addfile(member, src.extractfile(member) if member.isfile() else None)


def recipe_gguf(name: str) -> pathlib.Path:
    """The real GGUF a recipe prepares from (reassembled and checked by the recipe's source)."""
    from ignition.cli import recipe_module

    recipe = recipe_module(name)
    return pathlib.Path(recipe.open_source(recipe.RecipeOptions()).path)


def carry(folder: pathlib.Path, recipes: list[str], layouts: Sequence[str] = ()) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / TREE).exists():
        with tempfile.TemporaryDirectory() as scratch:
            pack_tree(llama_cpp_source(pathlib.Path(scratch)), folder / TREE)
    for name in recipes:
        gguf_shape.write_shape(recipe_gguf(name), folder / (name + SHAPE_SUFFIX))
    for name in layouts:
        gguf_shape.write_layout_shape(LAYOUT_DIR / f"{name}.json", folder / (name + SHAPE_SUFFIX))
    for path in sorted(folder.iterdir()):
        print(f"{path}: {path.stat().st_size / 1e6:.1f} MB")
    print(f"total {sum(p.stat().st_size for p in folder.iterdir()) / 2**20:.1f} MiB")


# ---- device: build llama.cpp and the random GGUFs -----------------------------------------------

def _digest(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _fresh(stamp: pathlib.Path, digest: str, *outputs: pathlib.Path) -> bool:
    return stamp.exists() and stamp.read_text() == digest and all(p.exists() for p in outputs)


def tool(work: pathlib.Path, name: str) -> pathlib.Path:
    return work / "build" / "bin" / name


def build(folder: pathlib.Path, work: pathlib.Path) -> None:
    started = time.time()
    tree = folder / TREE
    digest, stamp = _digest(tree), work / "tree.sha256"
    if not _fresh(stamp, digest, *(tool(work, t) for t in TOOLS)):
        subprocess.run(["bash", str(ROOT / "bench" / "llama_cpp_build.sh"), str(tree), str(work)], check=True)
        stamp.write_text(digest)
    else:
        print(f"llama.cpp already built in {work}")
    for shape in sorted(folder.glob("*" + SHAPE_SUFFIX)):
        model = work / (shape.name.removesuffix(SHAPE_SUFFIX) + ".f16.gguf")
        digest, stamp = _digest(shape), model.with_name(model.name + ".sha256")
        if not _fresh(stamp, digest, model):
            t0 = time.time()
            gguf_shape.write_random(shape, model, gguf_py=str(work / "llama.cpp" / "gguf-py"))
            stamp.write_text(digest)
            print(f"wrote {model} ({model.stat().st_size / 1e6:.0f} MB) in {time.time() - t0:.0f} s", flush=True)
    print(f"build step done in {time.time() - started:.0f} s", flush=True)


# ---- device: measure ----------------------------------------------------------------------------

@dataclass
class Command:
    argv: list[str]
    stdout: str
    stderr: str
    seconds: float


def execute(argv: list[str], env: dict[str, str], timeout: int, cwd: pathlib.Path | None = None) -> Command:
    t0 = time.time()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    command = Command(argv, done.stdout, done.stderr, time.time() - t0)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return command


def tool_env(work: pathlib.Path) -> dict[str, str]:
    env = dict(os.environ)
    ldx = work / "ldx"
    if ldx.exists():
        env["LD_LIBRARY_PATH"] = ldx.read_text().strip() + ":" + env.get("LD_LIBRARY_PATH", "")
    return env


def parse_llama_bench(stdout: str) -> dict[str, dict]:
    """llama-bench -o json: one record per test; keyed pp<n> / tg<n>."""
    records = json.loads(stdout[stdout.index("["):])
    out: dict[str, dict] = {}
    for r in records:
        key = f"pp{r['n_prompt']}" if r["n_gen"] == 0 else f"tg{r['n_gen']}"
        if key in out and out[key]["tokens_per_s"] >= r["avg_ts"]:
            continue                                   # several micro-batch sizes: the fastest counts
        out[key] = {"tokens_per_s": r["avg_ts"], "n_ubatch": r.get("n_ubatch"), "stddev": r["stddev_ts"], "samples_ts": r.get("samples_ts"),
                    "gpu_info": r.get("gpu_info"), "model_type": r.get("model_type"),
                    "model_size": r.get("model_size"), "n_params": r.get("model_n_params"),
                    "flash_attn": r.get("flash_attn"), "n_gpu_layers": r.get("n_gpu_layers"),
                    "build_commit": r.get("build_commit")}
    return out


def parse_batched_bench(text: str) -> dict[int, dict]:
    """llama-batched-bench --output-format jsonl: one line per (pp, tg, B); keyed by B."""
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            r = json.loads(line)
            out[int(r["pl"])] = {"decode_tokens_per_s": r["speed_tg"], "prefill_tokens_per_s": r["speed_pp"],
                                 "pp": r["pp"], "tg": r["tg"], "n_kv": r["n_kv"], "t_tg_s": r["t_tg"]}
    return out


def bench_argv(work: pathlib.Path, model: pathlib.Path, *options: str) -> list[str]:
    """llama-bench on every layer of the GPU with flash attention, JSON out."""
    return [str(tool(work, "llama-bench")), "-m", str(model), "-ngl", "99", "-fa", "1", *options, "-o", "json"]


def batched_argv(work: pathlib.Path, model: pathlib.Path, prompt: int, steps: int, batches: Sequence[int]) -> list[str]:
    """llama-batched-bench of each batch's sequences (a `prompt`-token prompt each, then `steps`
    steps), with room for every sequence in its non-unified cache; JSON lines out."""
    contexts = max(batches) * (prompt + steps) * 2
    return [str(tool(work, "llama-batched-bench")), "-m", str(model), "-ngl", "99", "-fa", "on",
            "-c", str(contexts), "-b", "2048", "-ub", "512", "-npp", str(prompt), "-ntg", str(steps),
            "-npl", ",".join(map(str, batches)), "--output-format", "jsonl"]


def measure_llama_cpp(work: pathlib.Path, model: pathlib.Path) -> dict:
    env = tool_env(work)
    bench = execute(bench_argv(work, model, "-p", str(PREFILL), "-n", str(STEPS), "-r", "5"), env, 180)
    batched = execute(batched_argv(work, model, PROMPT, STEPS, BATCHES), env, 180)
    return {"llama_bench": parse_llama_bench(bench.stdout),
            "batched_bench": parse_batched_bench(batched.stdout + "\n" + batched.stderr),
            "commands": [" ".join(bench.argv), " ".join(batched.argv)],
            "seconds": [round(bench.seconds, 1), round(batched.seconds, 1)]}


def measure_kernel_shapes(work: pathlib.Path, model: pathlib.Path) -> dict:
    """llama.cpp at bench/kernels.py's shapes: decode per batch around CONTEXT positions, prefill
    of each PREFILL_TOKENS length from position 0."""
    from bench.kernels import CONTEXT, DECODE_BATCHES, PREFILL_TOKENS

    env = tool_env(work)
    prompt = CONTEXT - KERNEL_STEPS // 2
    bench = execute(bench_argv(work, model, "-p", ",".join(map(str, PREFILL_TOKENS)), "-n", "0",
                               "-b", str(max(PREFILL_TOKENS)), "-ub", ",".join(map(str, MICRO_BATCHES)), "-r", "3"),
                    env, 300)
    # one llama-batched-bench per batch: a crash at one batch (this build's CUDA "illegal instruction"
    # at 256 sequences of the SmolLM2 layout, 2026-12-07) costs that figure, not the others
    decode: dict[int, float | None] = {}
    commands, seconds, failures = [" ".join(bench.argv)], [round(bench.seconds, 1)], {}
    for batch in DECODE_BATCHES:
        argv = batched_argv(work, model, prompt, KERNEL_STEPS, (batch,))
        commands.append(" ".join(argv))
        try:
            batched = execute(argv, env, 200)
        except (RuntimeError, subprocess.TimeoutExpired) as error:
            decode[batch], failures[batch] = None, str(error)[-600:]
            continue
        seconds.append(round(batched.seconds, 1))
        decode[batch] = parse_batched_bench(batched.stdout + "\n" + batched.stderr).get(batch, {}).get("decode_tokens_per_s")
    prefill = parse_llama_bench(bench.stdout)
    return {"decode": decode,
            "prefill": {t: prefill.get(f"pp{t}", {}).get("tokens_per_s") for t in PREFILL_TOKENS},
            "prefill_micro_batch": {t: prefill.get(f"pp{t}", {}).get("n_ubatch") for t in PREFILL_TOKENS},
            "decode_context": {"prompt": prompt, "steps": KERNEL_STEPS},
            "commands": commands, "seconds": seconds, "decode_failures": failures}


def run_kernel_shapes(folder: pathlib.Path, work: pathlib.Path, out: pathlib.Path) -> dict:
    """llama.cpp alone at the kernel benchmark's shapes, every shape file: llama_cpp_layouts.json."""
    build(folder, work)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"device": device_name(), "llama_cpp": {"commit": LLAMA_CPP_COMMIT, "source": LLAMA_CPP_PYTHON},
                    "settings": "-ngl 99, flash attention on, F16 random weights; decode: llama-batched-bench; "
                                "prefill: llama-bench, the faster of -ub " + "/".join(map(str, MICRO_BATCHES)),
                    "layouts": {}}
    for shape in sorted(folder.glob("*" + SHAPE_SUFFIX)):
        name = shape.name.removesuffix(SHAPE_SUFFIX)
        print(f"== {name}: llama.cpp at the kernel shapes", flush=True)
        wait_gpu_idle()
        try:
            report["layouts"][name] = measure_kernel_shapes(work, work / f"{name}.f16.gguf")
            print(json.dumps({k: report["layouts"][name][k] for k in ("decode", "prefill")}), flush=True)
        except (RuntimeError, subprocess.TimeoutExpired) as error:
            print(f"== {name} FAILED: {error}", flush=True)
            report["failed"] = report.get("failed", {}) | {name: str(error)[-3000:]}
        (out / "llama_cpp_layouts.json").write_text(json.dumps(report, indent=1))
    return report


def measure_ours(bundle: pathlib.Path, out: pathlib.Path) -> dict:
    env = dict(os.environ, HELIOS_BUNDLE_DIR=str(bundle.resolve()), HELIOS_RANDOM_WEIGHTS="1")
    argv = [sys.executable, "-m", "bench.gpu_decode", "--out", str(out),
            "--batches", ",".join(map(str, BATCHES)), "--prefills", str(PREFILL),
            "--prompt", str(PROMPT), "--steps", str(STEPS)]
    command = execute(argv, env, 300, cwd=ROOT)
    return read_ours(json.loads((out / "gpu_decode.json").read_text())) | {
        "command": "HELIOS_RANDOM_WEIGHTS=1 " + " ".join(argv), "seconds": round(command.seconds, 1),
        "log": command.stdout[-4000:]}


def read_ours(report: dict) -> dict:
    """The figures compared, from bench/gpu_decode.py's JSON (its batch and token keys are strings)."""
    return {"decode": {int(b): r["tokens_per_s"] for b, r in report["decode"].items()},
            "decode_gpu_us": {int(b): r["gpu_us"] for b, r in report["decode"].items()},
            "prefill": report["prefill"][str(PREFILL)]["tokens_per_s"],
            "prefill_device": report["prefill"][str(PREFILL)]["gpu_tokens_per_s"],
            "architecture": report["architecture"], "startup_s": report["startup_s"]}


def figures(entry: dict) -> list[tuple[str, str, float | None, float | None]]:
    """(ratio key, label, ours, llama.cpp) of every compared figure; None where a side is missing."""
    ours, peer = entry.get("ours", {}), entry.get("llama_cpp", {})
    decode, bench, batched = ours.get("decode", {}), peer.get("llama_bench", {}), peer.get("batched_bench", {})
    rows = [(f"decode_b1_vs_tg{STEPS}", f"decode b=1 (tg{STEPS})", decode.get(1),
             bench.get(f"tg{STEPS}", {}).get("tokens_per_s"))]
    rows += [(f"decode_b{b}_vs_batched", f"decode b={b} (batched)", decode.get(b),
              batched.get(b, {}).get("decode_tokens_per_s")) for b in BATCHES]
    rows.append((f"prefill_{PREFILL}_vs_pp{PREFILL}", f"prefill {PREFILL} (pp{PREFILL})", ours.get("prefill"),
                 bench.get(f"pp{PREFILL}", {}).get("tokens_per_s")))
    return rows


def ratios(ours: dict, peer: dict) -> dict[str, float | None]:
    """ours / llama.cpp per figure (None where either is missing, never a zero)."""
    return {key: round(a / b, 3) if a and b else None
            for key, _label, a, b in figures({"ours": ours, "llama_cpp": peer})}


def bundle_recipe(bundle: pathlib.Path) -> str:
    from tests.gpu.model_bundle import DEFAULT_RECIPE, read_payload

    return read_payload(bundle / "bundle.bin").get("recipe", DEFAULT_RECIPE)


def wait_gpu_idle(limit_s: float = 30.0) -> None:
    """Until no process holds the GPU (ours takes the free memory for cache pages; the next
    program must not start before the last one's memory is back)."""
    deadline = time.time() + limit_s
    while time.time() < deadline:
        try:
            apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                                  capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return
        if not apps:
            return
        time.sleep(1)


def device_name() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def format_report(report: dict) -> str:
    lines = [f"llama.cpp {LLAMA_CPP_COMMIT} (CUDA, -ngl 99, flash attention on) beside the CUDA executor, "
             f"same run on {report['device']}; F16 / f16 random weights of each recipe's real shape",
             f"decode: {PROMPT}-token prompt then {STEPS} steps (llama-bench tg{STEPS}: empty prompt); "
             f"tokens/s over the batch; ratio = ours / llama.cpp", ""]
    head = f"{'recipe':<28} {'figure':<22} {'ours':>10} {'llama.cpp':>10} {'ratio':>7}"
    lines += [head, "-" * len(head)]
    for name, entry in report["recipes"].items():
        for key, label, a, b in figures(entry):
            ratio = entry.get("ratios", {}).get(key)
            lines.append(f"{name:<28} {label:<22} {'%.0f' % a if a else '-':>10} {'%.0f' % b if b else '-':>10} "
                         f"{'x%.2f' % ratio if ratio else '-':>7}")
    lines += [f"{name:<28} FAILED: {error.splitlines()[0] if error else ''}"
              for name, error in report.get("failed", {}).items()]
    lines.append("")
    for name, entry in report["recipes"].items():
        commands = entry.get("llama_cpp", {}).get("commands", []) + [entry.get("ours", {}).get("command", "")]
        lines += [f"{name}: {command}" for command in commands if command]
    return "\n".join(lines)


def run(folder: pathlib.Path, work: pathlib.Path, bundles: list[pathlib.Path], out: pathlib.Path,
        name: str) -> None:
    build(folder, work)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"device": device_name(), "llama_cpp": {"commit": LLAMA_CPP_COMMIT, "source": LLAMA_CPP_PYTHON},
                    "prompt": PROMPT, "steps": STEPS, "prefill": PREFILL, "recipes": {}}
    by_recipe = {bundle_recipe(bundle): bundle for bundle in bundles}
    shapes = sorted(p.name.removesuffix(SHAPE_SUFFIX) for p in folder.glob("*" + SHAPE_SUFFIX))
    missing = sorted(set(by_recipe) - set(shapes))
    if missing:
        raise SystemExit(f"--bundle for {missing}: no shape file in {folder} "
                         f"(python -m bench.gpu_llama_peer carry {folder} --recipe NAME)")
    for recipe in shapes:                 # every shape file: llama.cpp; with a bundle, ours beside it
        model, bundle = work / f"{recipe}.f16.gguf", by_recipe.get(recipe)
        entry: dict = {}
        sides = [("llama_cpp", lambda: measure_llama_cpp(work, model))]
        if bundle is not None:
            sides.append(("ours", lambda: measure_ours(bundle, out / "gpu_decode" / recipe)))
        for side, measure in sides:
            print(f"== {recipe}: {side}", flush=True)
            wait_gpu_idle()
            try:
                entry[side] = measure()
            except (RuntimeError, subprocess.TimeoutExpired) as error:     # the other figures still run
                print(f"== {recipe} {side} FAILED: {error}", flush=True)
                report["failed"] = report.get("failed", {}) | {f"{recipe} {side}": str(error)[-3000:]}
        if len(entry) == 2:
            entry["ratios"] = ratios(entry["ours"], entry["llama_cpp"])
        report["recipes"][recipe] = entry
        (out / f"{name}.json").write_text(json.dumps(report, indent=1))     # kept if a later recipe fails
    (out / f"{name}.json").write_text(json.dumps(report, indent=1))
    text = format_report(report)
    (out / f"{name}.txt").write_text(text + "\n")
    print(text)
    if report.get("failed"):
        raise SystemExit(f"failed: {', '.join(report['failed'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("carry", help="here: the llama.cpp tree and the shape files, into FOLDER")
    c.add_argument("folder", type=pathlib.Path)
    c.add_argument("--recipe", action="append", default=None,
                   help=f"(repeatable; default {', '.join(RECIPES)} unless --layout is given)")
    c.add_argument("--layout", action="append", default=[], help="a bench/layouts name (repeatable)")
    b = sub.add_parser("build", help="device: build llama.cpp and the random GGUFs")
    r = sub.add_parser("run", help="device: measure llama.cpp and ours per bundle")
    for p in (b, r):
        p.add_argument("--carry", type=pathlib.Path, required=True, help="the folder `carry` filled")
        p.add_argument("--work", type=pathlib.Path, default=pathlib.Path("/tmp/lcb"))
    r.add_argument("--bundle", type=pathlib.Path, action="append", default=[],
                   help="a folder with a model bundle (tests/gpu/model_bundle.py), repeatable; a shape "
                        "file without a bundle gets llama.cpp's figures only")
    add_output_arguments(r)
    r.add_argument("--name", default="gpu_llama_peer")
    r.add_argument("--kernel-shapes", action="store_true",
                   help="llama.cpp alone at bench/kernels.py's shapes: llama_cpp_layouts.json")
    args = parser.parse_args()
    if args.command == "carry":
        carry(args.folder, args.recipe if args.recipe is not None else ([] if args.layout else list(RECIPES)),
              args.layout)
    elif args.command == "build":
        build(args.carry, args.work)
    elif args.kernel_shapes:
        run_kernel_shapes(args.carry, args.work, output_dir(args.out, args.results, "gpu"))
    else:
        run(args.carry, args.work, args.bundle, output_dir(args.out, args.results, "gpu"), args.name)


if __name__ == "__main__":
    main()
