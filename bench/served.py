"""Served throughput on the device: what a client measures through the gateway and tritonserver,
beside the engine and llama-server measured in the same run.

    python -m bench.served [--out DIR | --results] [--llama-server BIN --llama-gguf F16.gguf]
                           [--concurrency 1,8,16,32,64,128,256] [--prompt-tokens 32,1024] [--output-tokens 128]
                           [--client-processes auto|N] [--client-scale 0.5|2] [--layout NAME]
    python -m bench.served [--out DIR | --results] --from-json RUN1/served.json [RUN2/served.json ...]
    python -m bench.served --skip-engine --executor cpu --core var/cores/smollm2-135m-instruct.core \
                           --concurrency 2 --prompt-tokens 40 --output-tokens 8 --requests-per-client 2 --out DIR
                           (a smoke run of the plumbing on a CPU host)

Runs on the GPU machine with the model bundle (tests/gpu/model_bundle.py; HELIOS_RANDOM_WEIGHTS=1
gives seeded random weights of the real layout: decode speed does not depend on the values). In
order, each phase owning the GPU alone:

1. engine: the CUDA executor through the server's own setup (engine/setup.py), B lanes decoding
   together for each concurrency B (capped at the captured rows), per prompt length: the
   ceiling the served figures are compared with (the same measurement as bench/gpu_decode.py),
   and the prefill cost per prompt token of each prompt length (one prompt of that length);
2. served: `helios-serve --executor cuda` (tritonserver from the wheel, the Helios model, the
   gateway), driven by closed-loop streaming /v1/chat/completions clients, greedy, `ignore_eos` with `max_tokens`
   so every request yields the same number of tokens. The clients stream as an OpenAI SDK user
   does (`stream_options.include_usage`: a content chunk a token, the count from the closing
   usage); `--client token-ids` adds `return_token_ids`, whose metadata chunk a token (OBS-5)
   doubles the gateway's sends (every figure before 2026-12-07 was measured so). Per level: output tokens/s over the
   level's wall time, TTFT p50/p99, ITL p50/p99, TPOT p50, and the CPU seconds per output token
   of the gateway processes and of the backend (the stub and its engine process, each also
   on its own), from /proc; and from the stack's own
   metrics (Triton's and the gateway's /metrics, deltas over the level): rounds per operation,
   the share planned on the second frame, tokens per round, the mean round time (a round is its
   main step: the initialization launched before it is not counted as one), requests per
   channel message, and the mean TTFT split into the scheduler's queue, the backend's receipt to
   first token and the gateway's ingress to first token. The worker's host time per round by
   phase (flare_worker_seconds_total: schedule / launch / collect / complete / deliver) and its
   host work (all but collect, the wait for the device) are in every row.
   Client processes: enough that the busiest stays under half a core (`--client-processes auto`:
   one per 8 streams, at most half the host's cores, doubled and the level measured again while
   the busiest reaches 50 %); each row reports the count and the busiest one's CPU share
   (`client_cpu_max`). `--client-scale 0.5` / `2` runs every level with half / twice the first
   count (no doubling), so that the served figure can be shown not to depend on the clients.
   Long prompts: each row also carries the bound the prompt work sets, `prompt_bound_tok_s`
   = n / (n / engine_tok_s + r x c), where per round n output tokens, r prompt tokens computed
   (the stack's prefix lookup minus reuse counters) and c the engine's prefill cost per prompt
   token, and the served figure over it;
3. llama-server (llama.cpp built on the device, same shape, F16, the same load and prompts).

Prints one table per prompt length and writes served.jsonl, one object per (prompt length,
concurrency), and served.json (everything) to the GPU's folder (bench/harness.py: var/bench/<gpu>/,
with --results bench/results/<gpu>/, or --out DIR).
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import multiprocessing
import os
import pathlib
import random
import shutil
import subprocess
import tempfile
import time

import numpy as np

from bench.harness import (BUNDLE_NAMESPACE, add_output_arguments, cpu_name, cpu_seconds, free_ports, gpu_name, metric,
                           output_dir, serving, stack_pids, stop_group, wait_http, write_bundle_core)
from bench.sse import DIALECTS, RequestTiming, load_session, stream_completion

REPORT, TABLE = "served.json", "served.jsonl"    # the run's figures; one row per (prompt length, concurrency)
WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact water story night money river ocean city music paper").split()


# ---- the load generator ------------------------------------------------------------------

def prompt_text(index: int, words: int) -> str:
    """A distinct prompt per request (no prefix reuse beyond the template)."""
    rng = random.Random(index)
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def _client_loop(base: str, model: str, prompts: list[str], concurrency: int, max_tokens: int,
                       dialect: str) -> list[RequestTiming]:
    queue = list(enumerate(prompts))
    results: list[RequestTiming] = []
    way = DIALECTS[dialect]
    async with load_session(base, concurrency + 4, keep_alive=way.keep_alive) as client:
        async def worker() -> None:
            while queue:
                _, text = queue.pop()
                body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                        "temperature": 0, "stream": True, "ignore_eos": True, **way.extra}
                results.append(await stream_completion(client, "/v1/chat/completions", body, way.count))
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


def _client_process(args: tuple) -> tuple[list[RequestTiming], float]:  # type: ignore[type-arg]
    """One client process's timings and the CPU seconds it spent (is the load generator the limit?)."""
    cpu = time.process_time()
    timings = asyncio.run(_client_loop(*args))
    return timings, time.process_time() - cpu


def _ready(_: int) -> bool:
    import aiohttp  # noqa: F401  (imported before the clock starts)
    return True


def client_processes(concurrency: int, scale: float = 1.0) -> int:
    """The first number of client processes at a concurrency: one per 8 streams, at most half the
    host's cores (the stack needs the rest), times `scale`; never more than the streams."""
    cap = max(1, (os.cpu_count() or 2) // 2)
    return max(1, min(concurrency, round(min(cap, -(-concurrency // 8)) * scale)))


def drive(base: str, model: str, prompt_words: int, concurrency: int, requests: int, max_tokens: int,
          dialect: str, seed: int, processes: int | None = None) -> tuple[list[RequestTiming], float, float]:
    """Closed loop at `concurrency` over `requests` requests, spread over `processes` client
    processes (default: client_processes). The wall time runs from the first request's start to
    the last one's end on the machine's one monotonic clock (bench/sse.py), so process start-up is
    not counted as serving time. Also returns the busiest client process's CPU share of that wall
    time (near 1: the load generator limits the figures)."""
    processes = min(concurrency, processes or client_processes(concurrency))
    prompts = [prompt_text(seed + i, prompt_words) for i in range(requests)]
    shares = [prompts[i::processes] for i in range(processes)]
    per = [concurrency // processes + (1 if i < concurrency % processes else 0) for i in range(processes)]
    context = multiprocessing.get_context("spawn")
    with context.Pool(processes) as pool:
        pool.map(_ready, range(processes))
        parts = pool.map(_client_process, [(base, model, s, c, max_tokens, dialect) for s, c in zip(shares, per)])
    timings = [t for part, _ in parts for t in part]
    done = [t for t in timings if t.ok]
    wall = max(t.end_s for t in done) - min(t.start_s for t in timings) if done else 0.0
    busiest = max(cpu for _, cpu in parts) / wall if wall else float("nan")
    return timings, wall, busiest


def figures(timings: list[RequestTiming], wall_s: float) -> dict:
    ok = [t for t in timings if t.ok and t.token_times_s]
    tokens = [t.output_tokens for t in ok]
    itl = [gap for t in ok for gap in t.itls_s]
    tpot = [t.tpot_s for t in ok if t.tpot_s is not None]

    def pct(values: list[float], q: float) -> float:
        return float(np.percentile(values, q)) * 1e3 if values else float("nan")

    return {"requests": len(timings), "ok": len(ok), "output_tokens": int(sum(tokens)),
            "tokens_per_request_min": min(tokens, default=0), "tokens_per_request_max": max(tokens, default=0),
            "tok_s": sum(tokens) / wall_s if wall_s else 0.0, "wall_s": wall_s,
            "ttft_p50_ms": pct([t.ttft_s for t in ok], 50), "ttft_p99_ms": pct([t.ttft_s for t in ok], 99),
            "itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99), "tpot_p50_ms": pct(tpot, 50)}


# ---- the stack's own counters -----------------------------------------------------------

# Prometheus families read before and after each level (sums over their label sets, except
# the per-operation launch counter, kept per operation)
STACK_FAMILIES = ("flare_graph_launches_total", "flare_worker_seconds_total", "flare_second_frame_rounds_total", "flare_generated_tokens_total",
                  "flare_channel_responses_total", "flare_channel_outputs_total",
                  "flare_prefix_lookup_tokens_total", "flare_prefix_reused_tokens_total",
                  "flare_time_to_first_token_seconds_sum", "flare_time_to_first_token_seconds_count",
                  "flare_request_queue_time_seconds_sum", "flare_request_queue_time_seconds_count",
                  "helios_gateway_time_to_first_token_seconds_sum", "helios_gateway_time_to_first_token_seconds_count",
                  "helios_gateway_request_queue_time_seconds_sum", "helios_gateway_request_queue_time_seconds_count",
                  "flare_e2e_request_latency_seconds_sum", "flare_e2e_request_latency_seconds_count",
                  "helios_gateway_e2e_request_latency_seconds_sum", "helios_gateway_e2e_request_latency_seconds_count",
                  # Triton's own: a request's wait for the model instance, and execute()'s time
                  "nv_inference_request_success", "nv_inference_queue_duration_us", "nv_inference_exec_count",
                  "nv_inference_compute_infer_duration_us", "nv_inference_request_duration_us")


def scrape(url: str) -> dict[str, float]:
    """The families above from one Prometheus text page (bench/harness.py's reader); launches keyed
    by operation."""
    import httpx

    from helios_backend.engine.metrics import OPERATION_LABEL
    from helios_backend.engine.worker_clock import PHASE_LABEL

    try:
        text = httpx.get(url, timeout=10).text
    except Exception:                      # a figure missing is better than a level lost
        return {}
    # only the families this page has: the gateway's page and Triton's are merged, and a
    # family absent here must not hide the other page's figure
    labelled = {"flare_graph_launches_total": ("operation", OPERATION_LABEL.values()),
                "flare_worker_seconds_total": ("phase", PHASE_LABEL.values())}
    out = {name: metric(text, name) for name in STACK_FAMILIES if name not in labelled and name in text}
    for name, (label, values) in labelled.items():
        if name in text:
            for value in values:
                out[f"{name}:{value}"] = metric(text, name, **{label: value})
    return out


def stack_figures(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict:
    """Per-level deltas of the stack's counters as the figures a round and a request show."""
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    launches = {k.split(":", 1)[1]: v for k, v in delta.items() if k.startswith("flare_graph_launches_total:") and v}
    # a round is its main step: the initialization and restoration launched before it are not
    # rounds of their own (they run on the auxiliary frame, ~25-80 us each)
    rounds = sum(v for k, v in launches.items() if k not in ("initialization", "restoration"))
    tokens = delta.get("flare_generated_tokens_total", 0.0)
    # the worker's milliseconds per round by phase: their sum against round_ms is its idle share
    worker = {k.split(":", 1)[1]: v / rounds * 1e3 for k, v in delta.items()
              if k.startswith("flare_worker_seconds_total:") and rounds}

    def mean_ms(family: str) -> float:
        count = delta.get(f"{family}_count", 0.0)
        return delta.get(f"{family}_sum", 0.0) / count * 1e3 if count else float("nan")

    def per(total: str, count: str) -> float:
        return delta.get(total, 0.0) / delta[count] if delta.get(count) else float("nan")

    responses = delta.get("flare_channel_responses_total", 0.0)
    # prompt tokens computed: looked up at admission less those served from the prefix cache
    prompt = delta.get("flare_prefix_lookup_tokens_total", 0.0) - delta.get("flare_prefix_reused_tokens_total", 0.0)
    return {"rounds": launches, "prompt_tokens_per_round": prompt / rounds if rounds else float("nan"),
            "host_work_ms_per_round": sum(ms for phase, ms in worker.items() if phase != "collect")
            if worker else float("nan"), "second_frame_share": delta.get("flare_second_frame_rounds_total", 0.0) / rounds
            if rounds else float("nan"), "tokens_per_round": tokens / rounds if rounds else float("nan"),
            "round_ms": wall_s / rounds * 1e3 if rounds else float("nan"), "worker_ms_per_round": worker,
            "outputs_per_response": delta.get("flare_channel_outputs_total", 0.0) / responses if responses
            else float("nan"),
            # tokens a request's output carried per message: the stream interval at work
            "tokens_per_output": per("flare_generated_tokens_total", "flare_channel_outputs_total"),
            "triton_queue_mean_ms": per("nv_inference_queue_duration_us", "nv_inference_request_success") / 1e3,
            "triton_request_mean_ms": per("nv_inference_request_duration_us", "nv_inference_request_success") / 1e3,
            "triton_execute_mean_ms": per("nv_inference_compute_infer_duration_us", "nv_inference_exec_count") / 1e3,
            "queue_mean_ms": mean_ms("flare_request_queue_time_seconds"),
            "backend_ttft_mean_ms": mean_ms("flare_time_to_first_token_seconds"),
            "backend_e2e_mean_ms": mean_ms("flare_e2e_request_latency_seconds"),
            "gateway_e2e_mean_ms": mean_ms("helios_gateway_e2e_request_latency_seconds"),
            "gateway_queue_mean_ms": mean_ms("helios_gateway_request_queue_time_seconds"),
            "gateway_ttft_mean_ms": mean_ms("helios_gateway_time_to_first_token_seconds")}


# ---- phases --------------------------------------------------------------------------------

def engine_phase(batches: list[int], prompts: list[int], steps: int, queue) -> None:  # type: ignore[no-untyped-def]
    """In a child process, so the GPU is free afterwards."""
    from bench.gpu_decode import Bench
    from tests.gpu.model_bundle import load_bundle
    from helios_backend.engine.settings import StartupOptions
    from helios_backend.engine.setup import derive_setup

    contract, manifest, read = load_bundle()
    model = derive_setup(contract, manifest, read, StartupOptions(core_path=pathlib.Path("bundle"),
                                                                  executor="cuda")).model
    bench = Bench(model)
    rows = max(g.capacity.rows for g in model.graphs)
    out: dict = {}
    for prompt in prompts:
        for batch in batches:
            result = bench.decode(min(batch, rows), prompt, steps)
            out[f"{prompt}:{batch}"] = result["tokens_per_s"]
            print(f"engine prompt {prompt} batch {min(batch, rows)}: {result['tokens_per_s']:.0f} tok/s "
                  f"(step {result['step_us']:.0f} us)", flush=True)
        try:                                  # the prefill cost per prompt token (the long-prompt bound)
            prefill = bench.prefill(prompt)
            out[f"prefill:{prompt}"] = prefill["step_us"] / prompt
            print(f"engine prefill {prompt} tokens: {prefill['step_us']:.0f} us ({out[f'prefill:{prompt}']:.2f} "
                  f"us/token)", flush=True)
        except Exception as exc:             # no PREFILL program of that length: no bound
            print(f"engine prefill {prompt} tokens: not measured ({exc})", flush=True)
    model.close()
    queue.put(out)


def served_phase(args: argparse.Namespace, core: pathlib.Path, levels: list[int], prompts: list[int]) -> dict:
    top = max(levels)
    extra = (["--acceptance", args.acceptance] if args.acceptance else []) + [
        "--concurrency", str(min(top, args.rows)), "--max-active", str(min(top, args.rows)),
        "--queue-capacity", str(2 * top)] + args.serve_args
    out: dict = {}
    with serving(core, args.executor, extra, args.out / "served_stack.log") as stack:
        base = stack.url
        model = json_get(f"{base}/v1/models")["data"][0]["id"]
        layout = args.layout or model
        drive(base, model, 16, 8, 16, 16, args.client, 10_000)    # warm-up
        gateway, stub, engine = stack_pids(stack.proc.pid)
        print(f"gateway processes {gateway}, backend stub {stub}, engine process {engine}", flush=True)
        for words in prompts:
            for c in levels:
                pages = (stack.metrics, f"{base}/metrics")
                counted = [scrape(url) for url in pages]
                fixed = args.client_processes != "auto" or args.client_scale != 1.0
                processes = int(args.client_processes) if args.client_processes != "auto" \
                    else client_processes(c, args.client_scale)
                tries = []
                while True:                   # auto: more client processes while the busiest reaches 50 %
                    before = (cpu_seconds(gateway), cpu_seconds(stub), cpu_seconds(engine))
                    each_before = [cpu_seconds([pid]) for pid in gateway]
                    timings, wall, client_share = drive(base, model, words, c, requests_at(c, args.requests_per_client),
                                                        args.output_tokens, args.client, 1000 * c, processes)
                    after = (cpu_seconds(gateway), cpu_seconds(stub), cpu_seconds(engine))
                    each_after = [cpu_seconds([pid]) for pid in gateway]
                    tries.append({"client_processes": processes, "client_cpu_max": client_share})
                    more = min(c, 2 * processes, max(1, os.cpu_count() or 2))
                    if fixed or not client_share >= 0.5 or more == processes:
                        break
                    print(f"  busiest of {processes} client processes at {client_share:.0%} CPU: again with {more}",
                          flush=True)
                    processes = more
                    counted = [scrape(url) for url in pages]
                f = figures(timings, wall) | {"client_cpu_share": client_share, "client_cpu_max": client_share,
                                              "client_processes": processes, "client_tries": tries,
                                              "layout": layout}
                f["stack"] = stack_figures({**counted[0], **counted[1]},
                                           {**scrape(pages[0]), **scrape(pages[1])}, wall)
                tokens = max(f["output_tokens"], 1)
                f["gateway_cpu_us_per_token"] = (after[0] - before[0]) / tokens * 1e6
                # each gateway process's share of one core over the level: a busy one among idle
                # ones is connections spread unevenly, all near 1 a gateway that bounds the level
                f["gateway_cpu_shares"] = [round((a - b) / wall, 3) if wall else float("nan")
                                           for a, b in zip(each_after, each_before)]
                f["gateway_cpu_max"] = max(f["gateway_cpu_shares"], default=float("nan"))
                # the backend is the stub plus its engine process, each also on its own
                f["stub_cpu_us_per_token"] = (after[1] - before[1]) / tokens * 1e6
                f["engine_cpu_us_per_token"] = (after[2] - before[2]) / tokens * 1e6
                f["backend_cpu_us_per_token"] = f["stub_cpu_us_per_token"] + f["engine_cpu_us_per_token"]
                out[f"{words}:{c}"] = f
                print(f"served {prompt_label(words)} c={c}: {f['tok_s']:.0f} tok/s, TTFT p50 {f['ttft_p50_ms']:.1f} ms, "
                      f"TPOT p50 {f['tpot_p50_ms']:.2f} ms, gateway {f['gateway_cpu_us_per_token']:.0f} us/tok, "
                      f"backend {f['backend_cpu_us_per_token']:.0f} us/tok (stub {f['stub_cpu_us_per_token']:.0f}, engine "
                      f"{f['engine_cpu_us_per_token']:.0f}), ok {f['ok']}/{f['requests']}, "
                      f"tokens/request {f['tokens_per_request_min']}-{f['tokens_per_request_max']}, busiest of {processes} "
                      f"client processes {client_share:.0%} CPU, busiest gateway process {f['gateway_cpu_max']:.0%} "
                      f"(all {', '.join(f'{x:.0%}' for x in f['gateway_cpu_shares'])})", flush=True)
                k = f["stack"]
                print(f"  stack: rounds {k['rounds']}, second frame {k['second_frame_share']:.0%}, "
                      f"{k['tokens_per_round']:.1f} tokens/round, {k['prompt_tokens_per_round']:.1f} prompt tokens/round, "
                      f"{k['round_ms']:.2f} ms/round (worker: "
                      f"{', '.join(f'{p} {ms:.2f}' for p, ms in k['worker_ms_per_round'].items())}; host work "
                      f"{k['host_work_ms_per_round']:.3f}), "
                      f"{k['outputs_per_response']:.1f} outputs/message; Triton per request: queue "
                      f"{k['triton_queue_mean_ms']:.2f} ms, in Triton {k['triton_request_mean_ms']:.2f} ms, execute() "
                      f"{k['triton_execute_mean_ms']:.2f} ms; mean TTFT: backend queue {k['queue_mean_ms']:.1f} ms, "
                      f"backend {k['backend_ttft_mean_ms']:.1f} ms, gateway {k['gateway_ttft_mean_ms']:.1f} ms (its own queue "
                      f"{k['gateway_queue_mean_ms']:.1f} ms); mean e2e: backend {k['backend_e2e_mean_ms']:.1f} ms, "
                      f"gateway {k['gateway_e2e_mean_ms']:.1f} ms", flush=True)
                if args.profile and c == args.profile and words == min(prompts):
                    # the stub, its engine process and one gateway worker (the busiest)
                    busiest = max(gateway, key=lambda pid: cpu_seconds([pid]))
                    profile(args, {"stub": stub[0], "gateway": busiest} | ({"engine": engine[0]} if engine else {}),
                            base, model, words, c)
                checkpoint(args, "served", out)
    return out


def profile(args: argparse.Namespace, pids: dict[str, int], base: str, model: str, words: int, c: int) -> None:
    """py-spy of the stub, the engine process and a gateway worker under the same load: 4 s of raw
    stacks of the thread holding the GIL (--gil), the work that serializes a process; the load
    outlasts it."""
    if shutil.which("py-spy") is None:
        print("profile skipped: py-spy is not installed", flush=True)
        return
    # and the engine process once more with waiting threads included (--idle): its worker's
    # whole wall time, the executor wait and the wire writes too (flare_worker_seconds_total's split)
    runs = [(name, pid, "--gil") for name, pid in pids.items()] + [
        (f"{name}_idle", pid, "--idle") for name, pid in pids.items() if name == "engine"]
    procs = [subprocess.Popen(["py-spy", "record", "-p", str(pid), "-d", "4", "-r", "250", mode, "-f", "raw",
                               "-o", str(args.out / f"pyspy_{name}.txt"), "--nonblocking"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for name, pid, mode in runs]
    drive(base, model, words, c, 24 * c, args.output_tokens, args.client, 77_000)
    for p in procs:
        p.wait()


def llama_phase(args: argparse.Namespace, levels: list[int], prompts: list[int]) -> dict:
    [port] = free_ports(1)
    # -np 256 of this build died with "an illegal instruction was encountered" under the 256-client
    # load (2026-12-01); with 128 slots the 256th client queues in the server, as an operator runs it
    slots = min(max(levels), 128)
    ctx = slots * (max(prompts) * 2 + args.output_tokens + 128)
    cmd = [args.llama_server, "-m", args.llama_gguf, "-ngl", "99", "-fa", "on", "-np", str(slots), "-c", str(ctx),
           "--port", str(port), "--host", "127.0.0.1"]
    log = open(args.out / "llama_server.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    out: dict = {}
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 300, proc)
        base = f"http://127.0.0.1:{port}"
        drive(base, "peer", 16, 4, 8, 16, "llama-server", 10_000)
        for words in prompts:
            for c in levels:
                if time.monotonic() > args.deadline:
                    print(f"llama-server {prompt_label(words)} c={c}: skipped (the run's deadline)", flush=True)
                    continue
                timings, wall, client_share = drive(base, "peer", words, c,
                                                    requests_at(c, args.peer_requests_per_client),
                                                    args.output_tokens, "llama-server", 1000 * c)
                out[f"{words}:{c}"] = figures(timings, wall) | {"client_cpu_share": client_share}
                checkpoint(args, "llama_server", out)
                print(f"llama-server {prompt_label(words)} c={c}: {out[f'{words}:{c}']['tok_s']:.0f} tok/s", flush=True)
    finally:
        stop_group(proc)
        log.close()
    return out


def requests_at(concurrency: int, per_client: int = 16) -> int:
    """Requests per level: sixteen per client stream, at least 256. The level's wall time runs
    from its first request's start to its last one's end, so the first wave (every client at
    once) and the drain (the last clients alone) weigh on it; with four per client a level of
    16 clients lasted 0.59 s on the H200 and those edges were a sixth of it (2026-12-03).
    The peer, ~30x slower, may run fewer (`--peer-requests-per-client`): at least 16 then."""
    return max(per_client * concurrency, 256 if per_client >= 16 else 16)


def checkpoint(args: argparse.Namespace, phase: str, figures_so_far: dict) -> None:
    """Partial results after every level: a run cut short still leaves its figures."""
    path = args.out / REPORT
    report = json.loads(path.read_text()) if path.exists() else {}
    report[phase] = figures_so_far
    path.write_text(json.dumps(report, indent=1))


def json_get(url: str) -> dict:
    import httpx

    return httpx.get(url, timeout=10).json()


TEMPLATE_TOKENS = 30     # what the chat template adds to a prompt (SmolLM2's system turn)


def prompt_words(prompt_tokens: int) -> int:
    """Words of the generated prompts for about `prompt_tokens` prompt tokens: each vocabulary
    word is one token with its space, the chat template adds the rest."""
    return max(1, prompt_tokens - TEMPLATE_TOKENS)


def prompt_label(words: int) -> str:
    return f"prompt ~{words + TEMPLATE_TOKENS} tokens"


def gateway_runtime() -> dict[str, str]:
    """What uvicorn's automatic choices take in this environment, which the gateway's worker
    processes share: uvloop's event loop and httptools' parser where installed (`make install`
    installs both), else asyncio's loop and h11. The gateway's per-token sends run on them, so a
    served figure names them."""
    found = importlib.util.find_spec
    return {"event_loop": "uvloop" if found("uvloop") else "asyncio",
            "http_parser": "httptools" if found("httptools") else "h11"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.served", description=__doc__.split("\n\n")[0],
                                     epilog="Rows of served.jsonl: device, layout, prompt_tokens, concurrency, "
                                            "served_tok_s, engine_tok_s, ttft_p50_ms, client_cpu_max, client_processes, "
                                            "host_ms_per_round (the worker's phases), host_work_ms_per_round, "
                                            "prompt_tokens_per_round, prompt_bound_tok_s, ... (see the module's doc).")
    add_output_arguments(parser)
    parser.add_argument("--concurrency", default="1,8,16,32,64,128,256", help="client streams per level (default: %(default)s)")
    parser.add_argument("--prompt-tokens", "--prompts", dest="prompts", default="32,1024",
                        help="prompt lengths in tokens, approximate: the chat template included (default: %(default)s); "
                             "1024 reports each level beside the bound its prompt work sets (prompt_bound_tok_s)")
    parser.add_argument("--output-tokens", type=int, default=128, help="max_tokens with ignore_eos (default: %(default)s)")
    parser.add_argument("--client", choices=["openai", "token-ids"], default="openai",
                        help="how the clients stream: as an OpenAI SDK user does (one content chunk a token, "
                             "usage at the end), or with return_token_ids (a metadata chunk a token beside "
                             "each text chunk: the figures before 2026-12-07) (default: %(default)s)")
    parser.add_argument("--requests-per-client", type=int, default=16,
                        help="requests per client stream and level, at least 256 a level from 16 up (default: %(default)s)")
    parser.add_argument("--client-processes", default="auto",
                        help="client processes per level: auto (one per 8 streams, at most half the cores, doubled while "
                             "the busiest reaches 50 %% CPU) or a fixed number (default: %(default)s)")
    parser.add_argument("--client-scale", type=float, default=1.0,
                        help="run every level with this multiple of auto's first client-process count, no doubling: "
                             "0.5 and 2 check that served tok/s does not depend on the clients (default: %(default)s)")
    parser.add_argument("--layout", default=None,
                        help="the layout name written into every row (default: the served model's id)")
    parser.add_argument("--steps", type=int, default=128, help="engine decode steps per batch")
    parser.add_argument("--llama-server", default=None, help="llama-server binary: measure it too (with --llama-gguf)")
    parser.add_argument("--llama-gguf", default=None, help="the F16 GGUF llama-server serves")
    parser.add_argument("--skip-engine", action="store_true",
                        help="no engine phase (no GPU needed; engine_tok_s and the prompt bound are then absent)")
    parser.add_argument("--core", type=pathlib.Path, default=None, help="serve this core (default: the bundle's)")
    parser.add_argument("--acceptance", default=None,
                        help=f"the core's acceptance namespace (default: {BUNDLE_NAMESPACE} for the bundle's core, "
                             "helios-serve's own with --core)")
    parser.add_argument("--executor", default="cuda", help="helios-serve's executor (cpu / numpy: a CPU smoke run "
                        "with --skip-engine; default: %(default)s)")
    parser.add_argument("--rows", type=int, default=256, help="request rows the served core captured")
    parser.add_argument("--profile", type=int, default=0, help="py-spy the stack at this concurrency")
    parser.add_argument("--budget-s", type=float, default=1e9, help="skip peer levels past this many seconds")
    parser.add_argument("--peer-requests-per-client", type=int, default=16,
                        help="requests per client stream of the llama-server levels (below 16: at least 16 a level)")
    parser.add_argument("--from-json", type=pathlib.Path, nargs="+", default=None,
                        help=f"measure nothing: the table and {TABLE} from these runs' {REPORT} (the folder of "
                             "the device they name)")
    parser.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[])
    args = parser.parse_args(argv)
    if args.from_json:
        merged = merged_reports(args.from_json)
        write_table(merged, output_dir(args.out, args.results, "gpu", merged.get("device")))
        return
    args.deadline = time.monotonic() + args.budget_s
    if args.client_processes != "auto" and not args.client_processes.isdigit():
        parser.error(f"--client-processes: auto or a number, not {args.client_processes!r}")
    if args.client_scale <= 0:
        parser.error("--client-scale must be positive")
    on_cpu = args.executor in ("cpu", "numpy")
    if on_cpu and not args.skip_engine:
        parser.error(f"--executor {args.executor}: the engine phase needs the GPU; add --skip-engine")
    if args.core is None and args.acceptance is None:
        args.acceptance = BUNDLE_NAMESPACE
    device = cpu_name() if on_cpu else gpu_name()
    out = args.out = output_dir(args.out, args.results, "cpu" if on_cpu else "gpu", device)
    levels = [int(c) for c in args.concurrency.split(",") if c]
    prompt_tokens = [int(p) for p in args.prompts.split(",") if p]
    words = [prompt_words(p) for p in prompt_tokens]
    report: dict = {"levels": levels, "prompt_tokens": prompt_tokens, "output_tokens": args.output_tokens,
                    "device": device, "gateway_runtime": gateway_runtime(), "client": args.client}
    if not args.skip_engine:
        context = multiprocessing.get_context("spawn")
        queue = context.Queue()
        child = context.Process(target=engine_phase, args=(levels, prompt_tokens, args.steps, queue))
        child.start()
        report["engine"] = queue.get()
        child.join()
        checkpoint(args, "engine", report["engine"])
    with tempfile.TemporaryDirectory() as tmp:
        core = args.core or pathlib.Path(tmp) / "served.core"
        if args.core is None:
            write_bundle_core(core)
        try:
            report["served"] = served_phase(args, core, levels, words)
        except Exception as exc:             # the peer still runs; the table shows what was measured
            print(f"served phase failed: {exc!r}", flush=True)
            report["served"] = json.loads((out / REPORT).read_text()).get("served", {}) \
                if (out / REPORT).exists() else {}
    if args.llama_server and args.llama_gguf:
        try:
            report["llama_server"] = llama_phase(args, levels, words)
        except Exception as exc:
            print(f"llama-server phase failed: {exc!r}", flush=True)
    (out / REPORT).write_text(json.dumps(report, indent=1))
    write_table(report, out)


def merged_reports(paths: list[pathlib.Path]) -> dict:
    """One report from the served.json of several runs (e.g. one call per prompt length, or
    a run cut short: its checkpoints): later files add levels, phase by phase."""
    report: dict = {"levels": [], "prompt_tokens": [], "output_tokens": None}
    for path in paths:
        part = json.loads(path.read_text())
        for key in ("levels", "prompt_tokens"):
            report[key] = sorted(set(report[key]) | set(part.get(key, [])))
        report["output_tokens"] = report["output_tokens"] or part.get("output_tokens")
        for key in ("device", "gateway_runtime", "client"):
            report[key] = report.get(key) or part.get(key)
        for phase in ("engine", "served", "llama_server"):
            report.setdefault(phase, {}).update(part.get(phase, {}))
    return report


def prompt_bound(stack: dict, engine_tok_s: float | None, prefill_us_per_token: float | None) -> float | None:
    """Output tokens/s the GPU could give when every round of n output tokens also computes its
    r prompt tokens at the measured prefill cost c: n / (n / engine_tok_s + r x c); None where a
    figure is missing (no engine phase, no prefill of that length, no rounds)."""
    n, r = stack.get("tokens_per_round"), stack.get("prompt_tokens_per_round")
    if not (engine_tok_s and prefill_us_per_token and n and r is not None) or n != n or r != r:
        return None
    return n / (n / engine_tok_s + r * prefill_us_per_token * 1e-6)


def _num(value: float | None) -> float:
    return float("nan") if value is None else value


def write_table(report: dict, out: pathlib.Path) -> None:
    """Print one table per prompt length; write served.jsonl (one object per measured level)."""
    levels, prompt_tokens, output_tokens = report["levels"], report["prompt_tokens"], report["output_tokens"]
    words = [prompt_words(p) for p in prompt_tokens]
    lines = []
    for p, w in zip(prompt_tokens, words):
        print(f"\nprompt ~{p} tokens, {output_tokens} output tokens, greedy, streaming chat through the gateway"
              f" ({report.get('device') or 'device not recorded'}; gateway on "
              f"{', '.join((report.get('gateway_runtime') or {}).values()) or 'a runtime not recorded'}; "
              f"{report.get('client', 'token-ids')} clients)")
        print(f"{'conc':>5} {'served tok/s':>12} {'engine':>9} {'ratio':>6} {'llama-srv':>9} {'x llama':>7} "
              f"{'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'TPOT p50':>9} {'gw us/tok':>9} "
              f"{'be us/tok':>9} {'host ms':>8} {'clients':>7} {'busiest':>7} {'bound':>9} {'/bound':>6}")
        for c in levels:
            s = report.get("served", {}).get(f"{w}:{c}")
            if s is None:
                continue
            e = report.get("engine", {}).get(f"{p}:{c}")
            l_ = report.get("llama_server", {}).get(f"{w}:{c}", {}).get("tok_s")
            stack = s.get("stack", {})
            bound = prompt_bound(stack, e, report.get("engine", {}).get(f"prefill:{p}"))
            row = {"device": report.get("device"), "layout": s.get("layout"), "prompt_tokens": p, "concurrency": c,
                   "gateway_runtime": report.get("gateway_runtime"), "client": report.get("client", "token-ids"),
                   "output_tokens": output_tokens, "served_tok_s": s["tok_s"], "engine_tok_s": e,
                   "ttft_p50_ms": s["ttft_p50_ms"], "client_cpu_max": s.get("client_cpu_max", s.get("client_cpu_share")),
                   "client_processes": s.get("client_processes"),
                   "host_ms_per_round": stack.get("worker_ms_per_round"),
                   "host_work_ms_per_round": stack.get("host_work_ms_per_round"),
                   "prompt_tokens_per_round": stack.get("prompt_tokens_per_round"),
                   "prompt_bound_tok_s": bound, "served_over_prompt_bound": s["tok_s"] / bound if bound else None,
                   "llama_server_tok_s": l_, "served_over_engine": s["tok_s"] / e if e else None,
                   "served_over_llama_server": s["tok_s"] / l_ if l_ else None,
                   **{k: s[k] for k in ("ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tpot_p50_ms",
                                        "gateway_cpu_us_per_token", "backend_cpu_us_per_token", "ok", "requests",
                                        "tokens_per_request_min", "tokens_per_request_max", "stack")}}
            lines.append(json.dumps(row))
            print(f"{c:>5} {s['tok_s']:>12.0f} {e or float('nan'):>9.0f} {row['served_over_engine'] or float('nan'):>6.2f} "
                  f"{l_ or float('nan'):>9.0f} {row['served_over_llama_server'] or float('nan'):>7.1f} "
                  f"{s['ttft_p50_ms']:>9.1f} {s['ttft_p99_ms']:>9.1f} {s['itl_p50_ms']:>8.2f} {s['itl_p99_ms']:>8.2f} "
                  f"{s['tpot_p50_ms']:>9.2f} {s['gateway_cpu_us_per_token']:>9.0f} {s['backend_cpu_us_per_token']:>9.0f} "
                  f"{_num(row['host_work_ms_per_round']):>8.3f} {row['client_processes'] or 0:>7} "
                  f"{_num(row['client_cpu_max']):>7.0%} {bound or float('nan'):>9.0f} "
                  f"{_num(row['served_over_prompt_bound']):>6.2f}")
    (out / TABLE).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
