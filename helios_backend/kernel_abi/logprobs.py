"""Reference kernel for sampled-token log-probabilities and the top-N alternatives.

`sampling.logprobs.v1` runs after `sampling.draw.v1` and writes one logprob extension record
per row into the completion buffer, after the standard records:

    completion = header | rows x standard record | record_base ... rows x logprob record
    logprob record r = [ logprob f32 | top_ids i32[top_n] | top_logprobs f32[top_n] ]

(f32 values as raw 32-bit words). The manifest's CompletionLayout declares the fields as row
fields whose word index is past `row_words` (the extension record; the scheduler's
CompletionFormat resolves them). For a row that sampled:

    logprob        = log_softmax(logits[r])[sampled[r]]
    top_ids        = the top_n token ids by logit descending, id ascending (the draw's order)
    top_logprobs   = log_softmax(logits[r])[top_ids]

Rows that sampled nothing (slot -1, a non-final prefill chunk) get logprob 0.0, ids -1 and
top logprobs 0.0. `logits` are the raw model logits: `sampling.adjust.v1` rewrites the step's
logits in place (penalties, grammar mask), so `sampling.keep_logits.v1` copies the sampling
rows before it, and the logprobs read that copy. This is what vLLM returns by default
(logprobs_mode "raw_logprobs": before penalties, temperature, top-k / top-p and masks), so a
token the grammar or a penalty made impossible still shows its model probability, and
temperature never changes reported logprobs. docs/programs.md discusses the choice.
"""
from __future__ import annotations

import numpy as np

from helios_backend.kernel_abi.linear import _matrix
from helios_backend.kernel_abi.state import LOGPROBS_WORD, SAMPLING_PARAMETER_WORDS


def logprob_record_words(top_n: int) -> int:
    return 1 + 2 * int(top_n)


def log_softmax_row(x: np.ndarray) -> np.ndarray:
    """log_softmax in float64 (masked -inf entries stay -inf)."""
    x = x.astype(np.float64)
    best = np.max(x)
    if not np.isfinite(best):
        return np.full_like(x, -np.inf)
    return x - (best + np.log(np.sum(np.exp(x - best))))


def top_ids_row(x: np.ndarray, top_n: int) -> np.ndarray:
    """The top_n ids by value descending, id ascending on ties (no full sort)."""
    vocab = x.size
    n = min(int(top_n), vocab)
    if n <= 0:
        return np.zeros(0, dtype=np.int64)
    boundary = x[np.argpartition(-x, n - 1)[n - 1]]
    candidates = np.nonzero(x >= boundary)[0]
    ordered = candidates[np.lexsort((candidates, -x[candidates]))]
    return ordered[:n]


def keep_logits(raw_logits: np.ndarray, logits: np.ndarray, row_slot: np.ndarray, sample_flag: np.ndarray,
                live_rows: np.ndarray, rows: int, vocab: int) -> None:
    """raw_logits[r] = logits[r] for the live rows that sample (the others are left as they are)."""
    src, dst = _matrix(logits, rows, vocab), _matrix(raw_logits, rows, vocab)
    for r in range(min(int(live_rows[0]), rows)):
        if int(row_slot[r]) >= 0 and sample_flag[r]:
            dst[r] = src[r]


def sampled_logprobs(completion: np.ndarray, logits: np.ndarray, sampled: np.ndarray,
                     row_slot: np.ndarray, sample_flag: np.ndarray, live_rows: np.ndarray,
                     rows: int, vocab: int, top_n: int, record_base: int) -> None:
    """Logprob extension records [rows, 1 + 2 top_n] at completion[record_base:]."""
    table = _matrix(logits, rows, vocab)
    width = logprob_record_words(top_n)
    records = np.zeros((rows, width), dtype=np.int32)
    records[:, 1:1 + top_n] = -1
    floats = records.view(np.float32)
    live = min(int(live_rows[0]), rows)
    for r in range(live):
        token = int(sampled[r])
        if int(row_slot[r]) < 0 or not sample_flag[r] or not 0 <= token < vocab:
            continue
        row = table[r]
        logp = log_softmax_row(row)
        floats[r, 0] = np.float32(logp[token])
        ids = top_ids_row(row, top_n)
        records[r, 1:1 + ids.size] = ids
        floats[r, 1 + top_n:1 + top_n + ids.size] = logp[ids].astype(np.float32)
    completion[record_base:record_base + rows * width] = records.ravel()


def score_targets(completion: np.ndarray, hidden: np.ndarray, norm_weight: np.ndarray, head: np.ndarray,
                  targets: np.ndarray, geometry: np.ndarray, tokens: int, dim: int, vocab: int, eps: float,
                  record_base: int) -> None:
    """SCORED_PREFILL: completion[record_base + t] = log_softmax(logits of packed token t)[targets[t]].

    logits = rms_norm(hidden[t]) @ head.T (the model's raw logits at that position, as
    `logits.norm_head.v1` computes them for a row's last token). One f32 word per packed token
    (`tokens` words); tokens past the step's live count and targets outside [0, vocab) read 0.0.
    """
    from helios_backend.kernel_abi.linear import rms_norm
    from helios_backend.kernel_abi.state import live_tokens

    scores = np.zeros(tokens, dtype=np.float32)
    n = min(live_tokens(geometry), tokens)
    wanted = np.asarray(targets[:n], dtype=np.int64)
    live = np.nonzero((wanted >= 0) & (wanted < vocab))[0]
    if live.size:
        normed = rms_norm(_matrix(hidden, tokens, dim)[live], norm_weight[:dim], eps)
        logits = normed @ _matrix(head, vocab, dim).T
        for i, t in enumerate(live):
            scores[t] = np.float32(log_softmax_row(logits[i])[wanted[t]])
    completion[record_base:record_base + tokens] = scores.view(np.int32)


def requested_logprobs(completion: np.ndarray, logits: np.ndarray, sampled: np.ndarray, sampling: np.ndarray,
                       row_slot: np.ndarray, sample_flag: np.ndarray, live_rows: np.ndarray,
                       partials: np.ndarray, arrivals: np.ndarray, rows: int, vocab: int, top_n: int,
                       record_base: int) -> None:
    """sampling.logprobs.v2: sampled_logprobs for the rows whose request wants logprobs
    (sampling word LOGPROBS_WORD of the slot not negative); the others get the record of a row
    that sampled nothing. `partials` / `arrivals` are the GPU's scratch (as sampling.draw.v2's),
    untouched here."""
    flags = np.array(sample_flag[:rows], copy=True)
    for r in range(min(int(live_rows[0]), rows)):
        slot = int(row_slot[r])
        if slot >= 0 and sampling[slot * SAMPLING_PARAMETER_WORDS + LOGPROBS_WORD] < 0:
            flags[r] = 0
    sampled_logprobs(completion, logits, sampled, row_slot, flags, live_rows, rows, vocab, top_n, record_base)
