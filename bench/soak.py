"""Soak at saturation: every request answered exactly once with the right status, nothing leaks.

    python -m bench.soak --core var/cores/smollm2-135m-instruct.core --minutes 10
    python -m bench.soak --core CORE --executor cuda --minutes 10 --concurrency 96   # on a GPU host
    HELIOS_RANDOM_WEIGHTS=1 python -m bench.soak --from-bundle --executor cuda ...   # the device's bundle

It starts helios-serve on free ports (stopped afterwards) and keeps `--concurrency` clients
busy (more than the gateway's permits, so the ingress stays full) with a mix of:
streams, non-streamed requests, streams cancelled after their first token, string stops,
tool calls, invalid requests (400), oversized bodies (413) and clients that disconnect
before an answer. Each request's outcome is checked against its kind:

- exactly one answer: a status; a 200 stream ends with exactly one terminal ([DONE], or one
  error event and no [DONE]) and nothing after it;
- the right status: the kind's own (200 / 400 / 413), or 429 with Retry-After (ingress full);
  a 5xx or 503 is a failure;

and at the end, once the stack is idle, that nothing leaked (gateway permits and backend
streams, backend slots, waiting requests and request pages back to zero), that the backend
answered each admitted request once (admitted = finished + failed), and that nothing was
restarted or ended as lost (helios-serve's restarts, the gateway's backend watch).

The peer is the run itself: throughput and latency of the last window as ratios of the
first (a leak or a slowdown shows as a ratio below one). Text and JSON (soak.txt, soak.json) go
to var/bench/<device>/ (`--results`: bench/results/<device>/; bench/harness.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from bench.harness import BUNDLE_NAMESPACE, add_output_arguments, metric, output_dir, serving, write_bundle_core
from gateway.served_model import ServedModel
from gateway.triton_client import TritonBackend

SERVED = "smollm2-135m-instruct"
PROMPTS = ["Write a long story about a lighthouse keeper.", "List ten animals, separated by commas.",
           "Explain how a bicycle works.", "Count from one to fifty in words.", "What is the capital of France?"]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
KINDS = {"stream": 4, "non_stream": 2, "cancel": 2, "stop_string": 2, "tools": 1, "invalid": 1, "oversized": 1,
         "disconnect": 1}
EXPECTED = {"stream": {200}, "non_stream": {200}, "cancel": {200}, "stop_string": {200}, "tools": {200},
            "invalid": {400}, "oversized": {413}, "disconnect": {200, 0}}


@dataclass
class Outcome:
    kind: str
    status: int               # 0: the client left before any answer (disconnect)
    started: float
    ended: float
    tokens: int = 0
    problem: str = ""         # empty when the outcome is right


@dataclass
class Report:
    minutes: float
    concurrency: int
    requests: int = 0
    by_kind_status: dict[str, dict[str, int]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    leaks: dict[str, float] = field(default_factory=dict)
    backend_accounting: dict[str, float] = field(default_factory=dict)
    windows: list[dict[str, float]] = field(default_factory=list)
    last_over_first_throughput: float = 0.0
    last_over_first_p50_latency: float = 0.0


def body(kind: str, rng: random.Random) -> dict:
    messages = [{"role": "user", "content": rng.choice(PROMPTS)}]
    base = {"model": SERVED, "messages": messages, "max_tokens": rng.choice((16, 48, 96)), "temperature": 0.7}
    if kind in ("stream", "cancel", "disconnect"):
        base["stream"] = True
    if kind == "stop_string":
        base["stop"] = [",", " the"]
    if kind == "tools":
        base["messages"] = [{"role": "user", "content": "What is the weather in Paris?"}]
        base["tools"] = TOOLS
    if kind == "invalid":
        base["temperature"] = rng.choice(["hot", 9, -1])
    return base


def check_stream(lines: list[str]) -> tuple[int, str]:
    """(tokens, problem) of a complete SSE body."""
    data = [line[6:] for line in lines if line.startswith("data: ")]
    if not data:
        return 0, "a stream without events"
    terminals = [i for i, d in enumerate(data) if d == "[DONE]" or '"error"' in d[:20]]
    if len(terminals) != 1 or terminals[0] != len(data) - 1:
        return 0, f"a stream with {len(terminals)} terminal events (last at {terminals[-1] if terminals else None} of {len(data)})"
    if data[-1] != "[DONE]":
        return 0, f"a stream ended by an error event: {data[-1][:200]}"
    return len(data) - 1, ""


async def one(client: httpx.AsyncClient, kind: str, rng: random.Random, body_bound: int) -> Outcome:
    started = time.monotonic()
    try:
        if kind == "oversized":
            content = b'{"model": "x", "messages": [{"role": "user", "content": "' + b"a" * (body_bound + 1) + b'"}]}'
            r = await client.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"})
            return _judge(kind, r.status_code, r.headers, started, problem="" if r.json()["error"]["code"] else "no code")
        if kind == "disconnect":
            try:
                async with asyncio.timeout(rng.uniform(0.01, 0.3)):
                    async with client.stream("POST", "/v1/chat/completions", json=body(kind, rng)) as r:
                        async for _ in r.aiter_lines():
                            pass
                        return _judge(kind, r.status_code, r.headers, started)
            except TimeoutError:
                return Outcome(kind, 0, started, time.monotonic())
        if kind in ("stream", "cancel"):
            async with client.stream("POST", "/v1/chat/completions", json=body(kind, rng)) as r:
                if r.status_code != 200:
                    await r.aread()
                    return _judge(kind, r.status_code, r.headers, started)
                lines = []
                async for line in r.aiter_lines():
                    lines.append(line)
                    if kind == "cancel" and '"content":"' in line and '"content":""' not in line:
                        return Outcome(kind, 200, started, time.monotonic(), tokens=1)   # leave mid-stream
                tokens, problem = check_stream(lines)
                return _judge(kind, 200, r.headers, started, tokens, problem)
        r = await client.post("/v1/chat/completions", json=body(kind, rng))
        problem = ""
        if r.status_code >= 400 and not r.json().get("error", {}).get("code"):
            problem = "an error body without a code"
        tokens = r.json()["usage"]["completion_tokens"] if r.status_code == 200 else 0
        return _judge(kind, r.status_code, r.headers, started, tokens, problem)
    except httpx.HTTPError as exc:
        return Outcome(kind, -1, started, time.monotonic(), problem=f"transport error {type(exc).__name__}: {exc}")


def _judge(kind: str, status: int, headers: httpx.Headers, started: float, tokens: int = 0,
           problem: str = "") -> Outcome:
    if status == 429:
        problem = problem or ("" if headers.get("retry-after") else "a 429 without Retry-After")
    elif status not in EXPECTED[kind]:
        problem = problem or f"status {status} for a {kind} request"
    return Outcome(kind, status, started, time.monotonic(), tokens, problem)


async def derived_body_bound(grpc: str) -> int:
    """The body bound the gateway derives from the served model (oversized requests exceed it)."""
    backend = TritonBackend(grpc)
    try:
        return ServedModel.from_assets(await backend.fetch_assets(timeout_s=30)).default_body_bytes
    finally:
        await backend.close()


async def load(url: str, seconds: float, concurrency: int, seed: int, body_bound: int) -> list[Outcome]:
    outcomes: list[Outcome] = []
    kinds, weights = zip(*KINDS.items())
    stop_at = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        async def client_loop(index: int) -> None:
            rng = random.Random(seed * 1000 + index)
            while time.monotonic() < stop_at:
                outcome = await one(client, rng.choices(kinds, weights)[0], rng, body_bound)
                outcomes.append(outcome)
                if outcome.status == 429:
                    await asyncio.sleep(rng.uniform(0.05, 0.3))
        await asyncio.gather(*(client_loop(i) for i in range(concurrency)))
    return outcomes


def settle(url: str, backend_metrics: str, timeout_s: float = 60) -> tuple[str, str]:
    """The gateway's and the backend's metrics once both are idle (or at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        gateway, backend = httpx.get(url + "/metrics").text, httpx.get(backend_metrics).text
        busy = (metric(gateway, "helios_gateway_admission_permits_in_use")
                + metric(gateway, "helios_gateway_backend_streams_open")
                + metric(backend, "flare_requests_running") + metric(backend, "flare_requests_waiting"))
        if busy == 0 or time.monotonic() > deadline:
            return gateway, backend
        time.sleep(1.0)


def summarize(report: Report, outcomes: list[Outcome], gateway: str, backend: str, windows: int = 5) -> None:
    report.requests = len(outcomes)
    table: dict[str, Counter[str]] = defaultdict(Counter)
    for o in outcomes:
        table[o.kind][str(o.status)] += 1
        if o.problem:
            report.problems.append(f"{o.kind}: {o.problem}")
    report.by_kind_status = {k: dict(v) for k, v in sorted(table.items())}
    report.leaks = {
        "gateway_permits_in_use": metric(gateway, "helios_gateway_admission_permits_in_use"),
        "gateway_backend_streams_open": metric(gateway, "helios_gateway_backend_streams_open"),
        "backend_requests_running": metric(backend, "flare_requests_running"),
        "backend_requests_waiting": metric(backend, "flare_requests_waiting"),
        "backend_request_pages": metric(backend, "flare_cache_pages", state="used"),
    }
    admitted = metric(backend, "flare_requests_admitted_total")
    ended = metric(backend, "flare_requests_finished_total") + metric(backend, "flare_requests_failed_total")
    report.backend_accounting = {"admitted": admitted, "finished_or_failed": ended,
                                 "rejected": metric(backend, "flare_requests_rejected_total"),
                                 "restarts": metric(gateway, "helios_serve_restarts_total"),
                                 "backend_lost": metric(gateway, "helios_gateway_backend_lost_total")}
    if admitted != ended:
        report.problems.append(f"backend: {admitted} admitted but {ended} ended")
    for name, value in report.leaks.items():
        if value:
            report.problems.append(f"leak: {name} = {value}")
    if report.backend_accounting["restarts"]:
        report.problems.append("helios-serve restarted a process during the soak")
    if report.backend_accounting["backend_lost"]:
        report.problems.append("the gateway's backend watch ended open requests during the soak")
    start = min(o.started for o in outcomes)
    span = (max(o.ended for o in outcomes) - start) / windows
    for w in range(windows):
        inside = [o for o in outcomes if start + w * span <= o.ended < start + (w + 1) * span]
        served = sorted(o.ended - o.started for o in inside if o.status == 200 and o.kind == "non_stream")
        report.windows.append({"tokens_per_s": sum(o.tokens for o in inside) / span,
                               "answers_per_s": len(inside) / span,
                               "p50_non_stream_s": served[len(served) // 2] if served else 0.0})
    first, last = report.windows[0], report.windows[-1]
    report.last_over_first_throughput = last["tokens_per_s"] / first["tokens_per_s"] if first["tokens_per_s"] else 0
    report.last_over_first_p50_latency = (last["p50_non_stream_s"] / first["p50_non_stream_s"]
                                          if first["p50_non_stream_s"] else 0)


def render(report: Report) -> str:
    lines = [f"soak: {report.minutes:.1f} min, {report.concurrency} clients, {report.requests} requests",
             "outcomes (kind: status -> count):"]
    lines += [f"  {kind:12s} " + ", ".join(f"{s}: {n}" for s, n in sorted(v.items())) for kind, v in
              report.by_kind_status.items()]
    lines.append("after the load (all must be 0): " + ", ".join(f"{k} {v:g}" for k, v in report.leaks.items()))
    lines.append("backend: " + ", ".join(f"{k} {v:g}" for k, v in report.backend_accounting.items()))
    for i, w in enumerate(report.windows):
        lines.append(f"  window {i}: {w['tokens_per_s']:.1f} tokens/s, {w['answers_per_s']:.2f} answers/s, "
                     f"p50 non-stream {w['p50_non_stream_s']:.2f}s")
    lines.append(f"last/first window: throughput x{report.last_over_first_throughput:.2f}, "
                 f"p50 latency x{report.last_over_first_p50_latency:.2f}")
    lines.append(f"problems: {len(report.problems)}" + "".join(f"\n  {p}" for p in report.problems[:30]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.soak", description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--core", type=Path)
    source.add_argument("--from-bundle", action="store_true",
                        help="write the core from the device's model bundle (tests/gpu/model_bundle.py; "
                             "HELIOS_RANDOM_WEIGHTS=1: random weights of the real layout), served under its namespace")
    p.add_argument("--executor", default="numpy")
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--concurrency", type=int, default=0, help="clients (default: the gateway's permits + 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-arg", action="append", default=[], help="an extra helios-serve argument")
    add_output_arguments(p)
    p.add_argument("--log", type=Path, default=None, help="the stack's log (default: soak.serve.log beside the results)")
    args = p.parse_args(argv)
    # the device measured: the GPU for the cuda executor, else this machine's CPU
    out = output_dir(args.out, args.results, "gpu" if args.executor == "cuda" else "cpu")
    log = args.log or out / "soak.serve.log"
    with contextlib.ExitStack() as stack:
        core, extra = args.core, list(args.serve_arg)
        if args.from_bundle:
            core = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "soak.core"
            write_bundle_core(core)
            extra += ["--acceptance", BUNDLE_NAMESPACE]
        outcomes, concurrency, gateway_text, backend_text = run(core, args, extra, log)
    report = Report(args.minutes, concurrency)
    summarize(report, outcomes, gateway_text, backend_text)
    text = render(report)
    print(text)
    (out / "soak.txt").write_text(text + "\n")
    (out / "soak.json").write_text(json.dumps(asdict(report), indent=1) + "\n")
    print(f"wrote {out / 'soak.txt'} and soak.json")
    return 1 if report.problems else 0


def run(core: Path, args: argparse.Namespace, extra: list[str], log: Path
        ) -> tuple[list[Outcome], int, str, str]:
    with serving(core, args.executor, extra, log) as stack:
        permits = int(metric(httpx.get(stack.url + "/metrics").text, "helios_gateway_admission_permits"))
        concurrency = args.concurrency or permits + 8
        body_bound = asyncio.run(derived_body_bound(stack.grpc))
        outcomes = asyncio.run(load(stack.url, args.minutes * 60, concurrency, args.seed, body_bound))
        gateway_text, backend_text = settle(stack.url, stack.metrics)
    return outcomes, concurrency, gateway_text, backend_text


if __name__ == "__main__":
    sys.exit(main())
