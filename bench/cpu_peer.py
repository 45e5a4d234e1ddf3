"""CPU peer figures: llama.cpp (through llama-cpp-python) on the same GGUF and prompt ids.

Run:  OPENBLAS_NUM_THREADS=1 python -m bench.cpu_peer [--threads 2] [--new-tokens 64]

What is measured (all through llama.cpp's low-level C API, one `llama_context`):
- prefill: one sequence of `prefill_tokens` ids (default 512) decoded as a single batch, logits
  for the last position only (like `llama-bench -p 512`). The median of `repeats` runs, after a
  warm-up, with the cache cleared before each.
- decode at batch B: B sequences share one `decode_prompt_tokens` prefix (prefilled once on
  sequence 0, then `llama_memory_seq_cp` to the others, so prefill time stays out of the figure),
  then `new_tokens` steps (default 32); each step is one `llama_decode` of B tokens (one per sequence, all
  with logits) plus a greedy argmax per sequence. tokens/s = B * steps / seconds, median of
  `repeats` runs (the machine is shared; every run is kept in `runs`).
  The KV cache is unified (`kv_unified`), as llama-server runs with parallel slots.

Prompt ids come from this project's tokenizer (`bench_prompt_ids`), so the numpy executor's bench
can feed the identical ids and print ratios in the same run:

    from bench.cpu_peer import bench_prompt_ids, measure_llama_cpp, format_table, format_ratios
    peer = measure_llama_cpp(prefill_ids=bench_prompt_ids(512), decode_prompt_ids=bench_prompt_ids(128))
    ours = PeerFigures(...)   # filled by the numpy executor bench
    print(format_table([peer, ours])); print(format_ratios(ours, peer))

llama-cpp-python must be built from source (the `bench` extra pins 0.3.36):
    pip install --no-binary llama-cpp-python 'llama-cpp-python==0.3.36'
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

import numpy as np

from helios_backend.frontend.tokenizer import FrontendTokenizer
from ignition.sources.gguf import GGUFModel, default_gguf_path
from ignition.sources.tokenizer import tokenizer_json_from_gguf

# Deterministic English prose; repeated until the requested token count is reached.
_BENCH_TEXT = (
    "The history of astronomy is a long conversation between careful observers and bold "
    "theorists. Ancient watchers of the sky tracked the wandering planets, predicted eclipses, "
    "and built calendars around the return of the seasons. Later, telescopes revealed moons "
    "circling Jupiter, phases of Venus, and countless faint stars in the Milky Way. Each new "
    "instrument widened the view: spectrographs split starlight into colours that revealed "
    "chemical elements, photographic plates recorded galaxies far beyond our own, and radio "
    "dishes heard the faint hiss left over from the early universe. "
)


@dataclass(frozen=True)
class DecodeFigure:
    batch: int  # concurrent sequences per step
    steps: int  # decode steps timed (tokens per sequence)
    seconds: float  # wall time of all steps, median over runs
    runs: tuple[float, ...] = ()  # every run's seconds (the machine is shared: look at the spread)

    @property
    def tokens_per_s(self) -> float:
        return self.batch * self.steps / self.seconds

    @property
    def ms_per_step(self) -> float:
        return 1000.0 * self.seconds / self.steps

    @property
    def best_tokens_per_s(self) -> float:
        """From the fastest run: the least disturbed by other work on a shared machine."""
        return self.batch * self.steps / min(self.runs or (self.seconds,))


@dataclass(frozen=True)
class PeerFigures:
    """Throughput of one engine; the numpy executor bench fills the same type."""

    engine: str
    threads: int
    prefill_tokens: int
    prefill_seconds: float  # median over repeats
    decode: tuple[DecodeFigure, ...]
    prefill_runs: tuple[float, ...] = ()  # every run's seconds
    resident: Optional[Mapping[str, int]] = None  # memory figures with the engine loaded, where measured

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_seconds

    def decode_at(self, batch: int) -> DecodeFigure | None:
        return next((d for d in self.decode if d.batch == batch), None)


def bench_prompt_ids(n_tokens: int, tokenizer: FrontendTokenizer | None = None) -> list[int]:
    """Exactly `n_tokens` ids of plain prose (no control tokens), identical for every engine."""
    if tokenizer is None:
        tokenizer = FrontendTokenizer.from_json(tokenizer_json_from_gguf(GGUFModel.open(default_gguf_path())))
    unit = tokenizer.encode_untrusted(_BENCH_TEXT)
    repeats = n_tokens // len(unit) + 1
    return (unit * repeats)[:n_tokens]


class _LlamaCppSession:
    """One llama.cpp model + context + batch, freed on close. Low-level API only."""

    def __init__(self, gguf_path: Path, n_ctx: int, n_batch: int, n_seq: int, threads: int) -> None:
        import llama_cpp as lc  # optional dependency: the `bench` extra

        self._lc = lc
        # Keep llama.cpp quiet; the callback object must outlive the process's logging use.
        self._log_sink = lc.llama_log_callback(lambda level, text, user: None)
        lc.llama_log_set(self._log_sink, ctypes.c_void_p(0))
        lc.llama_backend_init()
        model_params = lc.llama_model_default_params()
        model_params.n_gpu_layers = 0
        self._model = lc.llama_model_load_from_file(str(gguf_path).encode(), model_params)
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load {gguf_path}")
        params = lc.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = n_batch
        params.n_seq_max = n_seq
        params.n_threads = threads
        params.n_threads_batch = threads
        params.kv_unified = True
        params.no_perf = True
        self._ctx = lc.llama_init_from_model(self._model, params)
        if not self._ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self._model))
        self._batch = lc.llama_batch_init(n_batch, 0, 1)
        self._memory = lc.llama_get_memory(self._ctx)

    def clear(self) -> None:
        self._lc.llama_memory_clear(self._memory, True)

    def copy_sequence(self, src: int, dst: int) -> None:
        self._lc.llama_memory_seq_cp(self._memory, src, dst, -1, -1)

    def decode(self, tokens: Sequence[int], positions: Sequence[int], seqs: Sequence[int], logits: Sequence[bool]) -> None:
        b = self._batch
        b.n_tokens = len(tokens)
        for i, (tok, pos, seq, out) in enumerate(zip(tokens, positions, seqs, logits)):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = out
        rc = self._lc.llama_decode(self._ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        self._lc.llama_synchronize(self._ctx)

    def argmax(self, output_index: int) -> int:
        ptr = self._lc.llama_get_logits_ith(self._ctx, output_index)
        return int(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax())

    def close(self) -> None:
        self._lc.llama_batch_free(self._batch)
        self._lc.llama_free(self._ctx)
        self._lc.llama_model_free(self._model)


def _time_prefill(session: _LlamaCppSession, ids: Sequence[int]) -> float:
    session.clear()
    n = len(ids)
    start = time.perf_counter()
    session.decode(ids, range(n), [0] * n, [i == n - 1 for i in range(n)])
    return time.perf_counter() - start


def _time_decode(session: _LlamaCppSession, prompt: Sequence[int], batch: int, steps: int) -> float:
    session.clear()
    n = len(prompt)
    session.decode(prompt, range(n), [0] * n, [i == n - 1 for i in range(n)])
    first = session.argmax(n - 1)
    for seq in range(1, batch):
        session.copy_sequence(0, seq)
    tokens = [first] * batch
    seqs = list(range(batch))
    start = time.perf_counter()
    for step in range(steps):
        session.decode(tokens, [n + step] * batch, seqs, [True] * batch)
        tokens = [session.argmax(i) for i in range(batch)]
    return time.perf_counter() - start


def _median_decode(session: _LlamaCppSession, prompt: Sequence[int], batch: int, steps: int, repeats: int) -> DecodeFigure:
    runs = tuple(_time_decode(session, prompt, batch, steps) for _ in range(repeats))
    return DecodeFigure(batch, steps, statistics.median(runs), runs)


def measure_llama_cpp(
    prefill_ids: Sequence[int],
    decode_prompt_ids: Sequence[int],
    gguf_path: Path | None = None,
    batches: Sequence[int] = (1, 8, 32),
    new_tokens: int = 32,
    threads: int = 2,
    repeats: int = 3,
    memory: Callable[[], Mapping[str, int]] | None = None,
) -> PeerFigures:
    """Prefill and decode throughput of llama.cpp on the GGUF (default: the packaged SmolLM2).
    `memory` is called after the last measurement with the model and context still loaded (after
    `close` llama.cpp has freed its weights and cache); its answer is the figures' `resident`."""
    path = gguf_path or default_gguf_path()
    max_batch = max(batches)
    decode_cells = max_batch * new_tokens + len(decode_prompt_ids)
    n_ctx = max(len(prefill_ids), decode_cells) + 256
    n_batch = max(len(prefill_ids), len(decode_prompt_ids), max_batch)
    session = _LlamaCppSession(path, n_ctx=n_ctx, n_batch=n_batch, n_seq=max_batch, threads=threads)
    try:
        _time_prefill(session, prefill_ids)  # warm-up: first-use allocations
        prefill_runs = tuple(_time_prefill(session, prefill_ids) for _ in range(repeats))
        _time_decode(session, decode_prompt_ids, 1, 4)  # warm-up
        decode = tuple(_median_decode(session, decode_prompt_ids, b, new_tokens, repeats) for b in batches)
        resident = dict(memory()) if memory is not None else None
    finally:
        session.close()
    return PeerFigures(
        "llama.cpp (llama-cpp-python 0.3.36)", threads, len(prefill_ids), statistics.median(prefill_runs), decode, prefill_runs,
        resident,
    )


def format_table(figures: Sequence[PeerFigures]) -> str:
    batches = sorted({d.batch for f in figures for d in f.decode})
    header = ["engine", "threads", "prefill tok/s"] + [f"decode b={b} tok/s (ms/step)" for b in batches]
    rows = []
    for f in figures:
        cells = [f.engine, str(f.threads), f"{f.prefill_tokens_per_s:,.0f} ({f.prefill_tokens} tok)"]
        for b in batches:
            d = f.decode_at(b)
            cells.append("-" if d is None else f"{d.tokens_per_s:,.1f} ({d.ms_per_step:.1f})")
        rows.append(cells)
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in [header] + rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def format_ratios(candidate: PeerFigures, reference: PeerFigures) -> str:
    """candidate / reference throughput for prefill and each shared decode batch."""
    parts = [f"prefill x{candidate.prefill_tokens_per_s / reference.prefill_tokens_per_s:.2f}"]
    for d in candidate.decode:
        r = reference.decode_at(d.batch)
        if r is not None:
            parts.append(f"decode b={d.batch} x{d.tokens_per_s / r.tokens_per_s:.2f}")
    return f"{candidate.engine} vs {reference.engine}: " + ", ".join(parts)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--decode-prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    tokenizer = FrontendTokenizer.from_json(tokenizer_json_from_gguf(GGUFModel.open(default_gguf_path())))
    peer = measure_llama_cpp(
        prefill_ids=bench_prompt_ids(args.prefill_tokens, tokenizer),
        decode_prompt_ids=bench_prompt_ids(args.decode_prompt_tokens, tokenizer),
        batches=args.batches,
        new_tokens=args.new_tokens,
        threads=args.threads,
        repeats=args.repeats,
    )
    print(format_table([peer]))
    print(format_spread(peer))


def format_spread(figures: PeerFigures) -> str:
    """Best-run throughput and the run-time spread; flags a disturbed measurement."""
    best = [f"prefill {figures.prefill_tokens / min(figures.prefill_runs or (figures.prefill_seconds,)):,.0f}"]
    best += [f"b={d.batch} {d.best_tokens_per_s:,.1f}" for d in figures.decode]
    runs = [figures.prefill_runs] + [d.runs for d in figures.decode]
    noisy = any(r and max(r) > 1.5 * min(r) for r in runs)
    line = f"{figures.engine} best runs, tok/s: " + ", ".join(best)
    if noisy:
        line += "\n  warning: runs differ by more than 1.5x; the machine is busy, figures are unreliable"
    return line


if __name__ == "__main__":
    main()
