"""Numpy executor throughput beside llama.cpp on the same GGUF and the same prompt ids.

Run:  OPENBLAS_NUM_THREADS=1 python -m bench.numpy_executor [--peer-threads 1] [--no-peer]

What is measured (recorded programs replayed by the numpy executor, one BLAS thread):
- prefill b=1: one sequence of `prefill_tokens` ids (default 512) in one PREFILL step (program
  r1.t512), logits for the last position and one draw. Median of `repeats` runs.
- prefill b=8 / b=32: B sequences of `batch_prefill_tokens` (default 64) in one multi-row PREFILL
  step. Reported as extra rows (llama.cpp's peer measures batch-1 prefill only).
- decode b=1/8/32: B lanes each prefilled (untimed) with the same `decode_prompt_tokens` ids (the
  prompt's whole cache pages shared, bench/timed_lanes.py), then `new_tokens` greedy DECODE steps of
  B rows; tokens/s = B * steps / seconds, median of repeats.
Ratios are numpy / llama.cpp from the same process run (bench/cpu_peer.py). The programs are
prepared in memory (no core file) with only the variants the bench uses.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
from typing import Sequence

from helios_proto import contract_pb2 as C

from bench.cpu_peer import DecodeFigure, PeerFigures, bench_prompt_ids, format_ratios, format_table, measure_llama_cpp
from bench.timed_lanes import timed_decode, timed_prefill
from helios_backend.engine.model import ModelOptions, NativeModel
from ignition.preparation.prepare import prepare
from ignition.recipes import smollm2_135m_instruct as recipe


def _options(prefill_tokens: int, batch_prefill_tokens: int, batches: Sequence[int]) -> recipe.RecipeOptions:
    prefill = [(1, prefill_tokens)] + [(b, b * batch_prefill_tokens) for b in batches if b > 1]
    return dataclasses.replace(recipe.RecipeOptions(), context_tokens=1024, decode_rows=tuple(batches),
                               prefill_variants=tuple(prefill), mixed_variants=(), admission_rows=(1,))


def measure_numpy(prefill_ids: Sequence[int], batch_prefill_ids: Sequence[int], decode_prompt_ids: Sequence[int],
                  batches: Sequence[int] = (1, 8, 32), new_tokens: int = 32, repeats: int = 3
                  ) -> tuple[PeerFigures, dict[int, float]]:
    """(figures in the peer's type, prefill tokens/s of multi-row prefill by batch)."""
    options = _options(len(prefill_ids), len(batch_prefill_ids), batches)
    prepared = prepare(recipe, options)
    data = {r.id: r.data for r in prepared.resources}
    needed = max(batches) * (-(-(len(decode_prompt_ids) + new_tokens + 1) // options.page_tokens)) + 64
    model = NativeModel.load(prepared.contract, prepared.manifest, data.__getitem__,
                             ModelOptions(cache_pages=max(needed, 2 * max(batches) * len(batch_prefill_ids) // 16)))
    try:
        timed_prefill(model, [prefill_ids])                                   # warm-up
        prefill_runs = tuple(timed_prefill(model, [prefill_ids]) for _ in range(repeats))
        batch_prefill = {}
        for b in (b for b in batches if b > 1):
            runs = [timed_prefill(model, [batch_prefill_ids] * b) for _ in range(max(1, repeats - 1))]
            batch_prefill[b] = b * len(batch_prefill_ids) / statistics.median(runs)
        decode = []
        for b in batches:
            decode_runs = tuple(timed_decode(model, decode_prompt_ids, b, new_tokens) for _ in range(repeats))
            decode.append(DecodeFigure(batch=b, steps=new_tokens, seconds=statistics.median(decode_runs),
                                       runs=decode_runs))
        node_count = len(next(p for p in prepared.manifest.programs if p.operation == C.OPERATION_DECODE).nodes)
        print(f"numpy executor: {node_count} nodes per decode step")
    finally:
        model.close()
    figures = PeerFigures(engine="helios numpy", threads=1, prefill_tokens=len(prefill_ids),
                          prefill_seconds=statistics.median(prefill_runs), decode=tuple(decode),
                          prefill_runs=prefill_runs)
    return figures, batch_prefill


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--batch-prefill-tokens", type=int, default=64)
    parser.add_argument("--decode-prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peer-threads", type=int, default=1, help="llama.cpp threads (numpy uses 1 BLAS thread)")
    parser.add_argument("--no-peer", action="store_true", help="skip llama.cpp")
    args = parser.parse_args(argv)
    prefill_ids = bench_prompt_ids(args.prefill_tokens)
    decode_ids = bench_prompt_ids(args.decode_prompt_tokens)
    ours, batch_prefill = measure_numpy(prefill_ids, bench_prompt_ids(args.batch_prefill_tokens), decode_ids,
                                        args.batches, args.new_tokens, args.repeats)
    figures = [ours]
    peer = None
    if not args.no_peer:
        peer = measure_llama_cpp(prefill_ids=prefill_ids, decode_prompt_ids=decode_ids, batches=args.batches,
                                 new_tokens=args.new_tokens, threads=args.peer_threads, repeats=args.repeats)
        figures.append(peer)
    print(format_table(figures))
    for b, tokens_per_s in batch_prefill.items():
        print(f"helios numpy prefill b={b}: {tokens_per_s:,.0f} tok/s ({b} x {args.batch_prefill_tokens} tokens)")
    if peer is not None:
        print(format_ratios(ours, peer))


if __name__ == "__main__":
    main()
