"""Serving load generator in the manner of `vllm bench serve`, plus the gateway's added latency.

Run against a running stack:
    python -m bench.serve --gateway http://127.0.0.1:9000 --triton 127.0.0.1:8001 \\
        --num-prompts 32 --concurrency 4 --max-tokens 32
or let it start one (helios-serve on free ports, stopped afterwards):
    python -m bench.serve --core var/cores/smollm2-135m-instruct.core --num-prompts 16

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
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from gateway.preparation import prepare_chat
from gateway.schemas import ChatCompletionRequest
from gateway.served_model import ServedModel
from gateway.triton_client import StreamTerminal, TokenBatch, TritonBackend
from helios_proto import transport_pb2 as tp

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
class RequestTiming:
    ttft_s: float = float("nan")
    e2e_s: float = float("nan")
    token_times_s: list[float] = field(default_factory=list)  # arrival of each token, from start
    output_tokens: int = 0
    ok: bool = False

    @property
    def itls_s(self) -> list[float]:
        times = self.token_times_s
        return [b - a for a, b in zip(times, times[1:])]

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


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

async def gateway_request(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> RequestTiming:
    timing = RequestTiming()
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "return_token_ids": True}
    start = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            return timing
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                timing.ok = True
                break
            event = json.loads(line[6:])
            if "error" in event:
                return timing
            for choice in event.get("choices", []):
                ids = choice.get("token_ids")
                if ids:
                    now = time.perf_counter() - start
                    timing.token_times_s += [now] * len(ids)
    timing.e2e_s = time.perf_counter() - start
    timing.output_tokens = len(timing.token_times_s)
    if timing.token_times_s:
        timing.ttft_s = timing.token_times_s[0]
    return timing


async def direct_request(backend: TritonBackend, prompt_ids: tuple[int, ...], max_tokens: int,
                         request_id: str) -> RequestTiming:
    timing = RequestTiming()
    request = tp.GenerateRequest(max_tokens=max_tokens)
    request.sampling.temperature = 0.0
    start = time.perf_counter()
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
    timing.output_tokens = len(timing.token_times_s)
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

def report(gateway: PhaseResult, direct: PhaseResult, args: argparse.Namespace) -> str:
    load = f"concurrency {args.concurrency}" if not args.request_rate else f"request rate {args.request_rate}/s"
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
def started_stack(core: Path, timeout_s: float = 600) -> Iterator[tuple[str, str]]:
    http, grpc_port, metrics, gateway = _free_ports(4)
    serve = Path(sys.executable).with_name("helios-serve")
    process = subprocess.Popen([str(serve), "--core", str(core), "--http-port", str(http), "--grpc-port",
                                str(grpc_port), "--metrics-port", str(metrics), "--gateway-port", str(gateway)],
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


async def measure(gateway_url: str, triton_url: str, args: argparse.Namespace) -> str:
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
        async with httpx.AsyncClient(base_url=gateway_url, timeout=600,
                                     limits=httpx.Limits(max_connections=args.num_prompts)) as client:
            await gateway_request(client, served.served_id, prompts[0], 2)  # warm-up: the HTTP connection

            def through_gateway(i: int):  # type: ignore[no-untyped-def]
                return gateway_request(client, served.served_id, prompts[i], args.max_tokens)

            def straight_to_triton(i: int):  # type: ignore[no-untyped-def]
                return direct_request(backend, prompt_ids[i], args.max_tokens, f"bench-{i}")

            cpu_before = await gateway_cpu_seconds(client)
            # rounds alternate which phase goes first, so drifting background load on a shared
            # machine falls on both phases alike
            gateway, direct = PhaseResult("gateway", [], 0.0), PhaseResult("direct", [], 0.0)
            for r, batch in enumerate(_rounds(args.num_prompts, args.rounds)):
                order = [(gateway, through_gateway), (direct, straight_to_triton)]
                for phase, make in (order if r % 2 == 0 else order[::-1]):
                    part = await run_phase(phase.name, lambda k: make(batch[k]), len(batch), args.concurrency,
                                           args.request_rate, args.seed + r)
                    phase.timings += part.timings
                    phase.wall_s += part.wall_s
            gateway_cpu = await gateway_cpu_seconds(client) - cpu_before
        text = report(gateway, direct, args)
        if gateway.output_tokens and gateway_cpu == gateway_cpu:  # NaN when the gateway has no such metric
            # counts the gateway's CPU during both phases; the direct phase never touches it
            text += (f"\ngateway CPU: {gateway_cpu:.2f} s for {gateway.output_tokens} tokens "
                     f"= {gateway_cpu / gateway.output_tokens * 1e6:.0f} us per output token")
        return text
    finally:
        await backend.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gateway", help="gateway base URL, e.g. http://127.0.0.1:9000")
    parser.add_argument("--triton", help="Triton gRPC HOST:PORT of the same stack")
    parser.add_argument("--core", type=Path, help="start helios-serve on this core instead")
    parser.add_argument("--num-prompts", type=int, default=16)
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, default=None, help="closed loop: requests in flight")
    load.add_argument("--request-rate", type=float, default=None, help="open loop: Poisson arrivals per second")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=4,
                        help="alternate gateway/direct in this many rounds (order flips each round)")
    args = parser.parse_args(argv)
    if args.concurrency is None and args.request_rate is None:
        args.concurrency = 1
    if args.core is not None:
        with started_stack(args.core) as (gateway_url, triton_url):
            print(asyncio.run(measure(gateway_url, triton_url, args)))
    elif args.gateway and args.triton:
        print(asyncio.run(measure(args.gateway, args.triton, args)))
    else:
        parser.error("give --gateway and --triton, or --core")


if __name__ == "__main__":
    main()
