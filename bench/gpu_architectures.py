"""The cost of the portable kernel path: the device's own modules against the compute_80 PTX.

    python -m bench.gpu_architectures [--out DIR | --results] [--native sm_90a] [--portable compute_80]
                                      [--parts conformance,decode] [--steps 64]

Runs on the device machine with a model bundle that carries both architectures
(`python tests/gpu/model_bundle.py build --arch sm_90a --arch compute_80` here). Each step
is its own process, so every executor starts on a clean device:

  1. tests/gpu/conformance.py --kernel-arch NATIVE     (every program, greedy --steps)
  2. tests/gpu/conformance.py --kernel-arch PORTABLE   (the PTX, JIT-compiled at startup)
  3. python -m bench.gpu_decode --kernel-arch NATIVE
  4. python -m bench.gpu_decode --kernel-arch PORTABLE

The driver's JIT cache is off (CUDA_CACHE_DISABLE=1), so the portable module load time is a
first start's. Then prints the two side by side, each portable figure as a ratio of the native one measured
in the same run (decode tokens/s and device time per batch, prefill, module load time: the
JIT), and writes architectures.json beside architectures.txt, with each step's own JSON, to the
GPU's folder (bench/harness.py).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

from bench.harness import ROOT, add_output_arguments, output_dir

# each part's command line (run from the repository root)
COMMANDS = {"conformance": [sys.executable, str(ROOT / "tests" / "gpu" / "conformance.py")],
            "decode": [sys.executable, "-m", "bench.gpu_decode"]}
RESULT = {"conformance": "conformance_{arch}.json", "decode": "gpu_decode_{arch}.json"}


def run(part: str, arch: str, out: pathlib.Path, extra: list[str]) -> dict:
    """One script for one architecture in its own process; its JSON (or the failure)."""
    command = COMMANDS[part] + ["--kernel-arch", arch, "--out", str(out)] + extra
    print(f"$ {' '.join(command)}", flush=True)
    started = time.time()
    # no driver JIT cache: the module load time is what a first start on the device costs
    finished = subprocess.run(command, cwd=ROOT, env=dict(os.environ, CUDA_CACHE_DISABLE="1"))
    path = out / RESULT[part].format(arch=arch)
    if finished.returncode or not path.exists():
        return {"failed": f"exit status {finished.returncode}", "seconds": time.time() - started}
    return json.loads(path.read_text())


def ratio(portable: float, native: float) -> float | None:
    return round(portable / native, 3) if native else None


def conformance_summary(result: dict) -> dict:
    if "failed" in result:
        return result
    rows = result["results"]
    return {"passed": sum(bool(r["pass"]) for r in rows), "cases": len(rows),
            "failed": [r["program"] for r in rows if not r["pass"]], "architecture": result["architecture"],
            "module_load_s": result["startup_seconds"].get("modules")}


def decode_comparison(native: dict, portable: dict) -> dict:
    if "failed" in native or "failed" in portable:
        return {"native": native, "portable": portable}
    decode = {}
    for batch, n in native["decode"].items():
        p = portable["decode"].get(batch)
        if p is None:
            continue
        decode[batch] = {"native_tokens_per_s": n["tokens_per_s"], "portable_tokens_per_s": p["tokens_per_s"],
                         "tokens_per_s_ratio": ratio(p["tokens_per_s"], n["tokens_per_s"]),
                         "native_gpu_us": n["gpu_us"], "portable_gpu_us": p["gpu_us"],
                         "gpu_us_ratio": ratio(p["gpu_us"], n["gpu_us"])}
    prefill = {tokens: {"native_tokens_per_s": n["tokens_per_s"], "portable_tokens_per_s": p["tokens_per_s"],
                        "tokens_per_s_ratio": ratio(p["tokens_per_s"], n["tokens_per_s"])}
               for tokens, n in native["prefill"].items() if (p := portable["prefill"].get(tokens))}
    kernels = {}
    for program, n in native["profile"].items():
        p = portable["profile"].get(program, {}).get("per_kernel", {})
        kernels[program] = {k: {"native_us": v["total_us"], "portable_us": p[k]["total_us"],
                                "ratio": ratio(p[k]["total_us"], v["total_us"])}
                            for k, v in n["per_kernel"].items() if k in p}
    return {"decode": decode, "prefill": prefill, "profile_per_kernel": kernels,
            "module_load_s": {"native": native["startup_detail"].get("modules"),
                              "portable": portable["startup_detail"].get("modules")},
            "architectures": {"native": native["architecture"], "portable": portable["architecture"]}}


def table(report: dict, native: str, portable: str) -> str:
    lines = [f"kernels: {native} (native) vs {portable} (PTX JIT-compiled at startup), same device, same run"]
    for arch, summary in report["conformance"].items():
        if "passed" in summary:
            lines.append(f"conformance {arch}: {summary['passed']}/{summary['cases']} pass"
                         f"{' FAILED ' + ', '.join(summary['failed']) if summary['failed'] else ''}; "
                         f"modules loaded in {summary['module_load_s']:.2f} s")
        else:
            lines.append(f"conformance {arch}: {summary}")
    decode = report.get("decode", {})
    if "decode" in decode:
        lines.append(f"module load: native {decode['module_load_s']['native']:.2f} s, "
                     f"portable {decode['module_load_s']['portable']:.2f} s (JIT)")
        lines.append(f"{'batch':>5} {native + ' tok/s':>14} {portable + ' tok/s':>18} {'ratio':>6} "
                     f"{'gpu us':>8} {'gpu us':>8} {'ratio':>6}")
        for batch, r in decode["decode"].items():
            lines.append(f"{batch:>5} {r['native_tokens_per_s']:>14.0f} {r['portable_tokens_per_s']:>18.0f} "
                         f"{r['tokens_per_s_ratio']:>6.3f} {r['native_gpu_us']:>8.1f} {r['portable_gpu_us']:>8.1f} "
                         f"{r['gpu_us_ratio']:>6.3f}")
        for tokens, r in decode["prefill"].items():
            lines.append(f"prefill {tokens}: {r['native_tokens_per_s']:.0f} vs {r['portable_tokens_per_s']:.0f} "
                         f"tok/s (ratio {r['tokens_per_s_ratio']})")
        for program, kernels in decode["profile_per_kernel"].items():
            top = sorted(kernels.items(), key=lambda kv: -kv[1]["native_us"])[:6]
            lines.append(f"profile {program}: " + "; ".join(f"{k} x{v['ratio']}" for k, v in top))
    elif decode:
        lines.append(f"decode: {decode}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_architectures", description=__doc__.split("\n\n")[0])
    add_output_arguments(parser)
    parser.add_argument("--native", default="sm_90a", help="the device's own architecture")
    parser.add_argument("--portable", default="compute_80", help="the PTX architecture to force")
    parser.add_argument("--parts", default="conformance,decode")
    parser.add_argument("--steps", type=int, default=64, help="greedy steps of the conformance runs")
    args = parser.parse_args()
    out = output_dir(args.out, args.results, "gpu")
    parts = set(filter(None, args.parts.split(",")))
    report: dict = {"native": args.native, "portable": args.portable, "conformance": {}}
    if "conformance" in parts:
        for arch in (args.native, args.portable):
            report["conformance"][arch] = conformance_summary(run("conformance", arch, out,
                                                                  ["--steps", str(args.steps)]))
    if "decode" in parts:
        native, portable = (run("decode", arch, out, []) for arch in (args.native, args.portable))
        report["decode"] = decode_comparison(native, portable)
    text = table(report, args.native, args.portable)
    (out / "architectures.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "architectures.txt").write_text(text + "\n")
    print("\n" + text)
    failed = [a for a, s in report["conformance"].items() if "passed" not in s or s["failed"]]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
