"""Serving load generator in the manner of `vllm bench serve`, plus the gateway's added latency.

Run against a running stack:
    python -m bench.serve --gateway http://127.0.0.1:9000 --triton 127.0.0.1:8001 \\
        --num-prompts 32 --concurrency 4 --max-tokens 32
or let it start one (helios-serve on free ports, stopped afterwards):
    python -m bench.serve --core var/cores/smollm2-135m-instruct.core --num-prompts 16
Several loads in one run (`--concurrency 1,4,16`) also give the curves `vllm bench serve`
users plot: throughput and latency against concurrency. Every run writes its text, a JSON
document (per load: both phases' figures and their ratios) and a PNG of those curves to
`--result-dir` (default bench/results, stem `--result-name`). `--ignore-eos` fixes every
output at `--max-tokens` (vLLM's field, in both phases).

Two phases run the same greedy requests (same prompt ids, same output limit) under the same
load in the same process, in alternating rounds (the first phase of a round flips each round):
- gateway: POST /v1/chat/completions with stream=true over HTTP (SSE), as a client would;
- direct:  the same prepared prompt ids sent straight to Triton over gRPC (one stream per
           request, as the gateway does), bypassing HTTP, admission, rendering and presentation.
Greedy decoding makes both phases produce the same tokens, and every prompt is sent once before
either phase so both meet the same warm prefix cache: the difference is the gateway.

Figures (per phase), as vllm reports them:
- TTFT: request start to the first generated token;
- ITL: gap between consecutive token arrivals (tokens arriving together count as one gap
  spread over them, as vllm does for multi-token chunks);
- TPOT: (E2E - TTFT) / (output tokens - 1), per request;
- E2E: request start to the terminal event; output tokens/s over the phase's wall time;
- gateway CPU per output token, from the gateway's process_cpu_seconds_total: the figure that
  does not drift with other load on a shared machine.
p50 / p90 / p99 of each; "added" rows are gateway minus direct at each percentile.
The gateway phase asks for return_token_ids so each token arrives as its own SSE event and
counts exactly; that is the observation path a client would use to measure the same thing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx
import numpy as np

from gateway.preparation import prepare_chat
from gateway.schemas import ChatCompletionRequest
from gateway.served_model import ServedModel
from gateway.triton_client import StreamTerminal, TokenBatch, TritonBackend
from helios_proto import exchange_pb2 as ep

from bench.sse import RequestTiming, load_session, stream_completion, token_ids_count

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three fruits that are red.",
    "Why is the sky blue?",
    "Give me a short recipe for pancakes.",
    "What is 17 times 23?",
    "Describe a cat to someone who has never seen one.",
]


@dataclass
class PhaseResult:
    name: str
    timings: list[RequestTiming]
    wall_s: float

    def figures(self) -> dict[str, list[float]]:
        ok = [t for t in self.timings if t.ok]
        return {
            "ttft_ms": [t.ttft_s * 1e3 for t in ok],
            "itl_ms": [x * 1e3 for t in ok for x in t.itls_s],
            "tpot_ms": [t.tpot_s * 1e3 for t in ok if t.tpot_s is not None],
            "e2e_ms": [t.e2e_s * 1e3 for t in ok],
        }

    @property
    def output_tokens(self) -> int:
        return sum(t.output_tokens for t in self.timings if t.ok)


def percentiles(values: list[float]) -> tuple[float, float, float]:
    if not values:
        return (float("nan"),) * 3  # type: ignore[return-value]
    p50, p90, p99 = np.percentile(np.asarray(values), [50, 90, 99])
    return float(p50), float(p90), float(p99)


# ---- the two clients --------------------------------------------------------------------

async def gateway_request(client: aiohttp.ClientSession, model: str, prompt: str, max_tokens: int,
                          ignore_eos: bool = False) -> RequestTiming:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "return_token_ids": True, "ignore_eos": ignore_eos}
    return await stream_completion(client, "/v1/chat/completions", body, token_ids_count)


async def direct_request(backend: TritonBackend, prompt_ids: tuple[int, ...], max_tokens: int,
                         request_id: str, ignore_eos: bool = False) -> RequestTiming:
    timing = RequestTiming()
    request = ep.GenerateRequest(max_tokens=max_tokens, ignore_eos=ignore_eos)
    request.sampling.temperature = 0.0
    timing.start_s = start = time.perf_counter()
    generation = backend.generate(prompt_ids, request, request_id)
    async for event in generation.events():
        if isinstance(event, TokenBatch):
            now = time.perf_counter() - start
            timing.token_times_s += [now] * int(event.token_ids.size)
        elif isinstance(event, StreamTerminal):
            timing.ok = event.event.WhichOneof("outcome") == "finished"
            break
        else:
            break
    timing.e2e_s = time.perf_counter() - start
    if timing.token_times_s:
        timing.ttft_s = timing.token_times_s[0]
    return timing


# ---- load shapes ---------------------------------------------------------------------------

async def run_phase(name: str, make_request, count: int, concurrency: int | None,  # type: ignore[no-untyped-def]
                    request_rate: float | None, seed: int) -> PhaseResult:
    """Closed loop at `concurrency`, or open loop with Poisson arrivals at `request_rate`/s."""
    rng = random.Random(seed)
    limit = asyncio.Semaphore(concurrency or count)
    timings: list[RequestTiming] = [RequestTiming() for _ in range(count)]

    async def one(i: int) -> None:
        async with limit:
            timings[i] = await make_request(i)

    start = time.perf_counter()
    tasks = []
    for i in range(count):
        tasks.append(asyncio.create_task(one(i)))
        if request_rate:
            await asyncio.sleep(rng.expovariate(request_rate))
    await asyncio.gather(*tasks)
    return PhaseResult(name, timings, time.perf_counter() - start)


# ---- report -----------------------------------------------------------------------------------

def load_label(concurrency: int | None, request_rate: float | None) -> str:
    return f"concurrency {concurrency}" if not request_rate else f"request rate {request_rate}/s"


def report(gateway: PhaseResult, direct: PhaseResult, args: argparse.Namespace, concurrency: int | None) -> str:
    load = load_label(concurrency, args.request_rate)
    lines = [f"bench.serve: {args.num_prompts} requests, {load}, max_tokens {args.max_tokens}, greedy",
             f"{'':<22}{'gateway':>12}{'direct':>12}{'added':>12}"]
    for phase in (gateway, direct):
        failed = sum(not t.ok for t in phase.timings)
        if failed:
            lines.append(f"  {phase.name}: {failed} failed requests")
    lines.append(f"{'successful requests':<22}{sum(t.ok for t in gateway.timings):>12}"
                 f"{sum(t.ok for t in direct.timings):>12}")
    lines.append(f"{'output tokens':<22}{gateway.output_tokens:>12}{direct.output_tokens:>12}")
    g_tps, d_tps = gateway.output_tokens / gateway.wall_s, direct.output_tokens / direct.wall_s
    lines.append(f"{'output tokens/s':<22}{g_tps:>12.1f}{d_tps:>12.1f}{g_tps - d_tps:>12.1f}")
    g_fig, d_fig = gateway.figures(), direct.figures()
    for metric in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        for label, gp, dp in zip(("p50", "p90", "p99"), percentiles(g_fig[metric]), percentiles(d_fig[metric])):
            lines.append(f"{metric[:-3].upper() + ' ' + label + ' (ms)':<22}{gp:>12.2f}{dp:>12.2f}{gp - dp:>12.2f}")
    return "\n".join(lines)


def phase_summary(phase: PhaseResult) -> dict[str, object]:
    """One phase's figures for the JSON document (milliseconds; p50/p90/p99)."""
    figures = phase.figures()
    out: dict[str, object] = {
        "successful_requests": sum(t.ok for t in phase.timings), "failed_requests": sum(not t.ok for t in phase.timings),
        "output_tokens": phase.output_tokens, "wall_s": phase.wall_s,
        "output_tokens_per_s": phase.output_tokens / phase.wall_s if phase.wall_s else float("nan"),
        "requests_per_s": sum(t.ok for t in phase.timings) / phase.wall_s if phase.wall_s else float("nan")}
    for metric, values in figures.items():
        out[metric] = dict(zip(("p50", "p90", "p99"), percentiles(values)))
        out[metric]["mean"] = float(np.mean(values)) if values else float("nan")  # type: ignore[index]
    return out


def level_summary(gateway: PhaseResult, direct: PhaseResult, concurrency: int | None,
                  request_rate: float | None, gateway_cpu_s: float) -> dict[str, object]:
    """One load level: both phases and the gateway-over-direct ratios (the peer measured in
    the same run)."""
    g, d = phase_summary(gateway), phase_summary(direct)
    ratios = {"output_tokens_per_s": g["output_tokens_per_s"] / d["output_tokens_per_s"]  # type: ignore[operator]
              if d["output_tokens_per_s"] else float("nan")}
    for metric in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        ratios[f"{metric}_p50"] = g[metric]["p50"] / d[metric]["p50"] if d[metric]["p50"] else float("nan")  # type: ignore[index]
    return {"concurrency": concurrency, "request_rate": request_rate, "gateway": g, "direct": d,
            "gateway_over_direct": ratios,
            "gateway_cpu_us_per_output_token": gateway_cpu_s / gateway.output_tokens * 1e6
            if gateway.output_tokens and gateway_cpu_s == gateway_cpu_s else None}


def plot(levels: list[dict], path: Path, title: str) -> None:  # type: ignore[type-arg]
    """Throughput and latency against the load, gateway and direct (vllm bench serve's view)."""
    import matplotlib
    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    x = [lv["concurrency"] if lv["request_rate"] is None else lv["request_rate"] for lv in levels]
    xlabel = "concurrency (requests in flight)" if levels[0]["request_rate"] is None else "request rate (1/s)"
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = (("output tokens/s", lambda p: p["output_tokens_per_s"]),
              ("TTFT p50 / p99 (ms)", lambda p: (p["ttft_ms"]["p50"], p["ttft_ms"]["p99"])),
              ("ITL p50 / p99 (ms)", lambda p: (p["itl_ms"]["p50"], p["itl_ms"]["p99"])))
    for ax, (label, pick) in zip(axes, panels):
        for phase, style in (("gateway", "-o"), ("direct", "--s")):
            values = [pick(lv[phase]) for lv in levels]
            if isinstance(values[0], tuple):
                ax.plot(x, [v[0] for v in values], style, label=f"{phase} p50")
                ax.plot(x, [v[1] for v in values], style, alpha=0.5, label=f"{phase} p99")
            else:
                ax.plot(x, values, style, label=phase)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(label)
        if len(x) > 1 and min(x) > 0 and max(x) / min(x) >= 8:
            ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_results(text: str, levels: list[dict], args: argparse.Namespace) -> list[Path]:  # type: ignore[type-arg]
    """<result-dir>/<result-name>.{txt,json,png}; the paths written."""
    directory = Path(args.result_dir)
    directory.mkdir(parents=True, exist_ok=True)
    stem = directory / (args.result_name or time.strftime("serve-%Y%m%d-%H%M%S"))
    document = {"benchmark": "bench.serve", "num_prompts": args.num_prompts, "max_tokens": args.max_tokens,
                "ignore_eos": args.ignore_eos, "rounds": args.rounds, "seed": args.seed, "levels": levels}
    paths = [stem.with_suffix(".txt"), stem.with_suffix(".json"), stem.with_suffix(".png")]
    paths[0].write_text(text + "\n")
    paths[1].write_text(json.dumps(document, indent=2) + "\n")
    plot(levels, paths[2], f"bench.serve: {args.num_prompts} requests, max_tokens {args.max_tokens}"
         + (", ignore_eos" if args.ignore_eos else ""))
    return paths


# ---- a self-started stack -----------------------------------------------------------------------

def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@contextlib.contextmanager
def started_stack(core: Path, timeout_s: float = 600, executor: str = "numpy") -> Iterator[tuple[str, str]]:
    http, grpc_port, metrics, gateway = _free_ports(4)
    serve = Path(sys.executable).with_name("helios-serve")
    process = subprocess.Popen([str(serve), "--core", str(core), "--executor", executor, "--http-port", str(http),
                                "--grpc-port", str(grpc_port), "--metrics-port", str(metrics),
                                "--gateway-port", str(gateway)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{gateway}"
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"helios-serve exited with {process.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            time.sleep(0.5)
        else:
            raise TimeoutError("the stack did not become healthy")
        yield url, f"127.0.0.1:{grpc_port}"
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()


async def gateway_cpu_seconds(client: httpx.AsyncClient) -> float:
    """The gateway process's CPU seconds so far (its /metrics process collector), NaN if absent."""
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith("process_cpu_seconds_total "):
            return float(line.split()[1])
    return float("nan")


def _rounds(count: int, rounds: int) -> list[list[int]]:
    rounds = max(1, min(rounds, count))
    return [list(range(count))[r::rounds] for r in range(rounds)]


async def measure(gateway_url: str, triton_url: str, args: argparse.Namespace) -> tuple[str, list[dict]]:  # type: ignore[type-arg]
    """The text report and one summary per load level (each --concurrency value, or the rate)."""
    backend = TritonBackend(triton_url)
    try:
        served = ServedModel.from_assets(await backend.fetch_assets(timeout_s=60))
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.num_prompts)]
        # the same preparation code the gateway runs, so both phases send identical ids
        prompt_ids = [prepare_chat(ChatCompletionRequest.model_validate(
            {"model": served.served_id, "messages": [{"role": "user", "content": p}]}), served, 0).prompts[0]
            for p in prompts]
        # warm-up: every prompt once, so both phases meet the same (warm) prefix cache
        for i, ids in enumerate(dict.fromkeys(prompt_ids)):
            await direct_request(backend, ids, 1, f"bench-warm-{i}")
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        async with httpx.AsyncClient(base_url=gateway_url, timeout=60, headers=headers) as client, \
                load_session(gateway_url, args.num_prompts, headers) as session:
            await gateway_request(session, served.served_id, prompts[0], 2)  # warm-up: the HTTP connection

            def through_gateway(i: int):  # type: ignore[no-untyped-def]
                return gateway_request(session, served.served_id, prompts[i], args.max_tokens, args.ignore_eos)

            def straight_to_triton(i: int):  # type: ignore[no-untyped-def]
                return direct_request(backend, prompt_ids[i], args.max_tokens, f"bench-{i}", args.ignore_eos)

            texts, levels = [], []
            for concurrency in args.concurrency_levels:
                cpu_before = await gateway_cpu_seconds(client)
                # rounds alternate which phase goes first, so drifting background load on a shared
                # machine falls on both phases alike
                gateway, direct = PhaseResult("gateway", [], 0.0), PhaseResult("direct", [], 0.0)
                for r, batch in enumerate(_rounds(args.num_prompts, args.rounds)):
                    order = [(gateway, through_gateway), (direct, straight_to_triton)]
                    for phase, make in (order if r % 2 == 0 else order[::-1]):
                        part = await run_phase(phase.name, lambda k, b=batch, m=make: m(b[k]), len(batch),
                                               concurrency, args.request_rate, args.seed + r)
                        phase.timings += part.timings
                        phase.wall_s += part.wall_s
                gateway_cpu = await gateway_cpu_seconds(client) - cpu_before
                text = report(gateway, direct, args, concurrency)
                if gateway.output_tokens and gateway_cpu == gateway_cpu:  # NaN when the gateway has no such metric
                    # counts the gateway's CPU during both phases; the direct phase never touches it
                    text += (f"\ngateway CPU: {gateway_cpu:.2f} s for {gateway.output_tokens} tokens "
                             f"= {gateway_cpu / gateway.output_tokens * 1e6:.0f} us per output token")
                texts.append(text)
                levels.append(level_summary(gateway, direct, concurrency, args.request_rate, gateway_cpu))
        return "\n\n".join(texts), levels
    finally:
        await backend.close()


def _levels(text: str | None) -> list[int | None]:
    if text is None:
        return [None]
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"--concurrency takes positive integers, e.g. 1,4,16 (got {text!r})")
    return values  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gateway", help="gateway base URL, e.g. http://127.0.0.1:9000")
    parser.add_argument("--triton", help="Triton gRPC HOST:PORT of the same stack")
    parser.add_argument("--core", type=Path, help="start helios-serve on this core instead")
    parser.add_argument("--executor", default="numpy", help="with --core: helios-serve's executor (numpy, cuda)")
    parser.add_argument("--num-prompts", type=int, default=16)
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", default=None,
                      help="closed loop: requests in flight; a comma list (1,4,16) runs each level")
    load.add_argument("--request-rate", type=float, default=None, help="open loop: Poisson arrivals per second")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=4,
                        help="alternate gateway/direct in this many rounds (order flips each round)")
    parser.add_argument("--ignore-eos", action="store_true", help="every output runs to --max-tokens")
    parser.add_argument("--api-key", default=os.environ.get("HELIOS_API_KEY") or os.environ.get("OPENAI_API_KEY"),
                        help="the gateway's API key (default $HELIOS_API_KEY, then $OPENAI_API_KEY)")
    parser.add_argument("--result-dir", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--result-name", default=None, help="file stem (default serve-<date>-<time>)")
    args = parser.parse_args(argv)
    try:
        args.concurrency_levels = _levels(args.concurrency if args.concurrency or args.request_rate else "1")
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    if args.core is not None:
        with started_stack(args.core, executor=args.executor) as (gateway_url, triton_url):
            text, levels = asyncio.run(measure(gateway_url, triton_url, args))
    elif args.gateway and args.triton:
        text, levels = asyncio.run(measure(args.gateway, args.triton, args))
    else:
        parser.error("give --gateway and --triton, or --core")
    print(text)
    for path in write_results(text, levels, args):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
