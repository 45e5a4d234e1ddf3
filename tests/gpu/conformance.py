"""Device script: the CUDA and numpy executors on the same prepared model, op by op.

For every program (operation x capacity variant) in the manifest, both executors run the
same submission sequence from fresh slots; compared are the completion records (tokens
exactly; SPECULATIVE programs also their extension records), the logits rows (fp16 tolerance)
and the state buffers. Then greedy generation for several batches must give identical tokens
for >= 64 steps; with SPECULATIVE programs in the bundle, greedy generation with history drafting
too, on both executors, equal to plain greedy output token for token. The CUDA executor's
driver is wrapped in a counting proxy while serving: no allocation, module load, graph
instantiation or capture may happen. Prints a pass/fail table; writes JSON under $OUT.

    python tests/gpu/conformance.py [--out DIR] [--steps 64] [--kernel-arch compute_80]
                                   [--greedy-first] [--max-tokens 1280]

A lease too short for every program (the numpy reference of the 4,096-token prefills takes
minutes): --greedy-first runs the greedy generations first, --max-tokens skips the programs of
more packed tokens.

--kernel-arch loads that architecture's kernel modules instead of the device's own (e.g. the
compute_80 PTX, JIT-compiled at startup: the Ampere code path on a newer GPU); the JSON is
then conformance_<arch>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
import traceback
import zlib

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "gpu"))

from executor_model import ExecutorModel  # noqa: E402
from model_bundle import load_bundle  # noqa: E402

from helios_backend.executors.cuda.driver import CountingDriver, load_driver  # noqa: E402
from helios_backend.executors.cuda_executor import CudaExecutor, CudaExecutorOptions  # noqa: E402
from helios_backend.executors.numpy_executor import NumpyExecutor, NumpyExecutorOptions  # noqa: E402
from helios_backend.packing import SlotInitialization, PackedLane  # noqa: E402
from helios_backend.lockstep.generator import LockstepGenerator, GenerationRequest  # noqa: E402
from helios_backend.lockstep.raw_lanes import RawLanes  # noqa: E402
from helios_proto import contract_pb2 as C  # noqa: E402
from helios_proto import manifest_pb2 as M  # noqa: E402

# the node writing a step's [rows, vocab] f32 logits (its first argument): logits.norm_head.v1, or
# on the product path linear.product_f32.v1
LOGITS_KERNELS = ("logits.norm_head.v1", "linear.product_f32.v1")
LOGITS_LABEL = "logits"
CACHE_PAGES = 2048
TIE_TOLERANCE = 5e-3                      # |logit gap| / max |logit| below which two tokens tie
TOKEN_WORD = 2                            # completion row word holding the sampled token
TOKEN_STATE = ("state.pending", "state.output_histogram")   # state written from sampled tokens
LOGIT_TOLERANCE = 2e-2                    # max |cuda - numpy| / max |numpy| per row (fp16 weights)


def logits_buffer(manifest: M.ExecutionManifest, program: str) -> str | None:
    for p in manifest.programs:
        if p.name == program:
            for node in p.nodes:
                if node.kernel in LOGITS_KERNELS and node.label == LOGITS_LABEL:
                    return node.args[0].pointer.buffer
    return None


class Case:
    """One program's submission sequence, run identically on each executor.

    Generations continue across cases (`first_generation`), as a scheduler's would: the
    packer remembers uploaded page-table entries per (slot, generation).
    """

    def __init__(self, model: ExecutorModel, seed: int, first_generation: int) -> None:
        self.model = model
        self.driver = RawLanes(model)
        self.rng = np.random.default_rng(seed)
        self.vocab = model.contract.model.vocabulary.sampled_tokens
        self.generation = first_generation
        self.logits_program = ""              # program whose logits buffer to compare ("" = the case's)
        self.scores: np.ndarray | None = None  # SCORED_PREFILL: the completion header's scores
        # token each preparation prefill sampled per slot: the case's input for decode-like rows.
        # An executor that breaks a near tie differently there feeds that row another token.
        self.prepared_tokens: dict[int, int] = {}
        self.slots: set[int] = set()          # slots this case admitted: the state it may compare
        # logit rows each request row filled (a speculative step packs a lane's 1 + proposals
        # target rows one after another); None: one logit row per request row
        self.logit_rows: dict[int, range] | None = None

    def admit(self, slots: list[int], prompts: list[np.ndarray]) -> None:
        bins = self.model.contract.model.vocabulary.histogram_bins
        eos = tuple(self.model.contract.defaults.eos_token_ids)
        init = self.model.program(C.OPERATION_INITIALIZATION, 1)
        self.slots.update(slots)
        for slot, prompt in zip(slots, prompts):
            self.generation += 1
            admission = SlotInitialization.for_prompt(prompt, bins, 1234 + slot, self.driver_sampling(), 4096, eos)
            self.driver.step(init, [PackedLane(slot=slot, generation=self.generation, initialization=admission)])

    @staticmethod
    def driver_sampling():
        from helios_backend.sampling_parameters import SamplingParameters
        return SamplingParameters()       # greedy

    def logit_bias(self) -> dict[str, np.ndarray]:
        """A full row of logit-bias entries (sampling.logit_bias.v1, in place on the compared
        logits): up to 300 distinct ids with biases of a few nats, enough to move logits and tokens."""
        ids = self.rng.choice(self.vocab, min(300, self.vocab), replace=False).astype(np.int32)
        return {"logit_bias_ids": ids, "logit_bias_values": self.rng.uniform(-3, 3, ids.size).astype(np.float32)}

    def pages_for(self, tokens: int) -> list[int]:
        return [self.driver.pages.take() for _ in range(-(-tokens // self.driver.page_tokens))]

    def run(self, program: M.Program) -> np.ndarray:
        """Prepare state with the smallest programs, then run `program` once; its completion rows."""
        rows, tokens = program.capacity.rows, program.capacity.tokens
        op = program.operation
        if op == C.OPERATION_INITIALIZATION:
            bins = self.model.contract.model.vocabulary.histogram_bins
            lanes = []
            self.slots.update(range(rows))
            for slot in range(rows):
                self.generation += 1
                prompt = self.rng.integers(0, self.vocab, 17)
                lanes.append(PackedLane(slot=slot, generation=self.generation, initialization=SlotInitialization.for_prompt(
                    prompt, bins, 99 + slot, self.driver_sampling(), 100, (2,))))
            return self.driver.step(program.name, lanes)
        if op in (C.OPERATION_PREFILL, C.OPERATION_SCORED_PREFILL):
            # SCORED_PREFILL: every token also scores a random target; the scores (completion
            # header words) are compared beside the logits and state
            scored = op == C.OPERATION_SCORED_PREFILL
            per_row = tokens // rows
            prompts = [self.rng.integers(0, self.vocab, per_row).astype(np.int32) for _ in range(rows)]
            self.admit(list(range(rows)), prompts)
            lanes = [PackedLane(slot=s, generation=self.generation - rows + 1 + s, start=0, tokens=p, sample=True,
                          page_table=self.pages_for(per_row),
                          scored_targets=self.rng.integers(0, self.vocab, per_row).astype(np.int32) if scored else None,
                          **(self.logit_bias() if s % 2 == 0 else {}))
                     for s, p in enumerate(prompts)]
            completed = self.driver.step(program.name, lanes)
            if scored:
                [field] = [f for f in self.model.execution_manifest.completion.header if f.name == "scores"]
                words = self.driver.last_words[field.word:field.word + tokens]
                self.scores = np.asarray(words, np.int32).view(np.float32).copy()
            return completed
        if op in (C.OPERATION_DECODE, C.OPERATION_MIXED, C.OPERATION_RESUME):
            # MIXED: up to three prompt rows beside the decode rows (select_input.v2 takes any number)
            prompt_rows = min(3, rows - 1) if op == C.OPERATION_MIXED else 0
            decode_rows = rows - prompt_rows
            history = 9
            prompts = [self.rng.integers(0, self.vocab, history).astype(np.int32) for _ in range(rows)]
            self.admit(list(range(rows)), prompts)
            first = self.generation - rows + 1
            pages = {}
            prefill = self.model.program(C.OPERATION_PREFILL, 1, history)
            for s in range(decode_rows):       # history for the decode rows, one sampled pending token each
                pages[s] = self.pages_for(history + 1)
                [row] = self.driver.step(prefill, [PackedLane(slot=s, generation=first + s, start=0,
                                                        tokens=prompts[s], sample=True, page_table=pages[s])])
                self.prepared_tokens[s] = int(row[TOKEN_WORD])
            lanes = [PackedLane(slot=s, generation=first + s, start=history,
                                page_table=pages[s]) for s in range(decode_rows)]
            if op == C.OPERATION_RESUME:      # the host feeds each row's pending token
                for lane in lanes:
                    lane.pending_token = int(self.rng.integers(0, self.vocab))
            if op == C.OPERATION_MIXED:
                spare = tokens - decode_rows
                for k, s in enumerate(range(decode_rows, rows)):
                    chunk = spare // prompt_rows + (k < spare % prompt_rows)
                    lanes.append(PackedLane(slot=s, generation=first + s, start=0,
                                      tokens=self.rng.integers(0, self.vocab, chunk).astype(np.int32), sample=True,
                                      page_table=self.pages_for(chunk)))
            return self.driver.step(program.name, lanes)
        if op == C.OPERATION_RESTORATION:
            return self._restoration(program)
        if op == C.OPERATION_SPECULATIVE:
            return self._speculative(program)
        raise ValueError(f"no conformance case for {C.Operation.Name(op)}")

    def _speculative(self, program: M.Program) -> np.ndarray:
        """Every lane gets a prefilled history and its sampled pending token, then a different
        number of copied proposals (0..D, within P), the last lane a stale copy (its consumed
        endpoint one behind: offered nothing); allocating programs get each lane's full ceiling.
        Compared are the standard records and the extension records [offers, accepted, tokens]
        (expansion, verification, commit, completion), the per-slot state (draft cursor, pending,
        histograms) and the target logits of the first rows."""
        from helios_backend.kernel_abi.speculative import extension_words

        graph = next(g for g in self.model.graphs if g.program == program.name)
        spec = graph.speculative
        rows, width, drafts, packed = (spec.batch_capacity, spec.token_capacity, spec.draft_tokens,
                                       spec.packed_token_capacity)
        allocating = any(b.source == C.VALUE_SOURCE_SPECULATIVE_PREFIX_LIMIT for b in graph.bindings)
        history = 9
        prompts = [self.rng.integers(0, self.vocab, history).astype(np.int32) for _ in range(rows)]
        self.admit(list(range(rows)), prompts)
        first = self.generation - rows + 1
        prefill = self.model.program(C.OPERATION_PREFILL, 1, history)
        budget = packed - rows                         # target rows left after every pending row
        lanes = []
        self.logit_rows = {}
        for s in range(rows):
            pages = self.pages_for(history + width)
            [row] = self.driver.step(prefill, [PackedLane(slot=s, generation=first + s, start=0,
                                                          tokens=prompts[s], sample=True, page_table=pages)])
            self.prepared_tokens[s] = int(row[TOKEN_WORD])
            count = min(drafts, width - 1, s % (drafts + 1)) if drafts else 0
            if not allocating:
                count = min(count, budget)
                budget -= count
            # the pending token first: random weights often repeat it, so some copies are accepted
            proposals = np.concatenate([[self.prepared_tokens[s]],
                                        self.rng.integers(0, self.vocab, max(count - 1, 0))])[:count].astype(np.int32)
            stale = s == rows - 1 and rows > 1
            first_row = sum(len(r) for r in self.logit_rows.values())
            self.logit_rows[s] = range(first_row, first_row + 1 + count)
            lanes.append(PackedLane(slot=s, generation=first + s, start=history, page_table=pages,
                                    proposals=proposals if drafts else None, proposal_generation=first + s,
                                    proposal_consumed=history - 1 if stale else history,
                                    prefix_limit=min(drafts + 1, width) if allocating else 0))
        body = self.driver.step(program.name, lanes)
        fmt = self.driver.format
        widest = max(g.speculative.token_capacity for g in self.model.graphs
                     if g.operation == C.OPERATION_SPECULATIVE)
        stride = extension_words(widest)
        base = fmt.header_words + fmt.capacity * fmt.row_words
        ext = np.asarray(self.driver.last_words[base:base + rows * stride], np.int32).reshape(rows, stride)
        return np.concatenate([body, ext], axis=1)

    def _restoration(self, program: M.Program) -> np.ndarray:
        """Prompts ending mid-page publish their partial page (snapshot rows); new slots reuse the
        full page, RESTORATION copies the partial payload into a private page, then a 4-token
        tail is prefilled there: its sampled token depends on the restored history."""
        rows, page = program.capacity.rows, self.driver.page_tokens
        length = page + page // 2
        prompts = [self.rng.integers(0, self.vocab, length).astype(np.int32) for _ in range(rows)]
        self.admit(list(range(rows)), prompts)
        first = self.generation - rows + 1
        prefill = self.model.program(C.OPERATION_PREFILL, 1, length)
        pages = {}
        for s in range(rows):
            pages[s] = self.pages_for(length)
            self.driver.step(prefill, [PackedLane(slot=s, generation=first + s, tokens=prompts[s], page_table=pages[s],
                                            snapshot_row=s)])
        self.admit(list(range(rows, 2 * rows)), prompts)
        second = self.generation - rows + 1
        private = {s: [pages[s][0]] + self.pages_for(1) for s in range(rows)}
        restored = self.driver.step(program.name, [
            PackedLane(slot=rows + s, generation=second + s, start=length, page_table=private[s], restore_row=s)
            for s in range(rows)])
        tail_program = self.model.program(C.OPERATION_PREFILL, 1, 4)
        tails = []
        for s in range(rows):
            tail = self.rng.integers(0, self.vocab, 4).astype(np.int32)
            tails.append(self.driver.step(tail_program, [PackedLane(slot=rows + s, generation=second + s, start=length,
                                                               tokens=tail, page_table=private[s])]))
        self.logits_program = tail_program
        return np.concatenate([restored] + tails)


def logprob_records(manifest: M.ExecutionManifest, driver, rows: int) -> dict:
    """The step's logprob extension records (sampled token's logprob, top-N logprobs) per row,
    as float "rows:" state compared within the logit tolerance (top ids are left out: ties
    may order them differently)."""
    from helios_backend.scheduler.completion import CompletionFormat
    fmt = CompletionFormat.from_layout(manifest.completion)
    words = getattr(driver, "last_words", None)
    if words is None or "logprob" not in fmt.row or not fmt.extension_words:
        return {}
    body = fmt.row_words_of(words, rows)
    out = {"rows:logprob": body[:, fmt.row["logprob"]].copy().view(np.float32)}
    if fmt.top_k and "top_logprobs" in fmt.row:
        top = fmt.row["top_logprobs"]
        out["rows:top_logprobs"] = body[:, top:top + fmt.top_k].copy().view(np.float32)
    return out


def compare(name: str, program: M.Program, outputs: dict, manifest: M.ExecutionManifest,
            prepared: dict | None = None, slots: set[int] | None = None, candidate: str = "cuda",
            tolerance: float = LOGIT_TOLERANCE, logit_rows: dict[int, range] | None = None) -> dict:
    """`outputs[candidate]` against `outputs["numpy"]` (the oracle); logits and float state within
    `tolerance` of the row's largest magnitude. `logit_rows`: the logit rows each request row
    filled (default: row r its own row r), so that a diverged request row drops its own logits."""
    (cuda_rows, cuda_logits, cuda_state), (np_rows, np_logits, np_state) = outputs[candidate], outputs["numpy"]
    result = {"program": name}
    request_rows = len(np_rows)
    if logit_rows is None:
        logit_rows = {r: range(r, r + 1) for r in range(program.capacity.rows)}
    if slots is not None and manifest is not None:
        # per-slot state of slots this case never admitted is an earlier case's (which may have
        # reported a diverged row there): compare only the case's own slots
        own = sorted(slots)
        def own_rows(states: dict) -> dict:
            return {k: (v[own] if not k.startswith("scratch:") and v.ndim and v.shape[0] == manifest.request_slots
                        else v) for k, v in states.items()}
        cuda_state, np_state = own_rows(cuda_state), own_rows(np_state)
    diverged = sorted(s for s, t in (prepared or {}).get(candidate, {}).items()
                      if prepared["numpy"].get(s) != t)
    if diverged:
        # a preparation prefill sampled another token for these rows (a near tie there), so this
        # step's input differs: they are reported, not compared; token-derived state neither
        result["diverged_inputs"] = diverged
        keep = [r for r in range(len(np_rows)) if r not in diverged]
        cuda_rows, np_rows = cuda_rows[keep], np_rows[keep]
        np_state = {k: (v[keep] if k.startswith("rows:") else v) for k, v in np_state.items()
                    if k not in TOKEN_STATE and not k.startswith("scratch:")}
        cuda_state = {k: (v[keep] if k.startswith("rows:") else v) for k, v in cuda_state.items()}
    result["tokens_equal"] = bool(np.array_equal(cuda_rows, np_rows))
    near_ties = 0
    if not result["tokens_equal"] and np_logits is not None:
        # a row whose sampled tokens differ only because numpy's top two logits are within
        # fp16 noise of each other is a tie, not a disagreement (reported as near_ties)
        token = TOKEN_WORD
        differing = [r for r in range(len(np_rows)) if not np.array_equal(cuda_rows[r], np_rows[r])]
        explained = []
        originals = [r for r in range(request_rows) if r not in diverged]
        for r in differing:
            a_tok, b_tok = int(cuda_rows[r][token]), int(np_rows[r][token])
            row = np_logits[logit_rows.get(originals[r], range(originals[r], originals[r] + 1))[0]]
            if 0 <= a_tok < row.size and abs(float(row[b_tok] - row[a_tok])) <= TIE_TOLERANCE * float(np.abs(row).max()):
                explained.append(r)
        near_ties = len(explained)
        result["near_ties"] = near_ties
        result["tokens_equal"] = near_ties == len(differing)
    dropped = {i for d in diverged for i in logit_rows.get(d, ())}
    compared = sorted(i for filled in logit_rows.values() for i in filled if i not in dropped)
    if np_logits is not None:
        a, b = cuda_logits[compared], np_logits[compared]
        scale = np.maximum(np.abs(b).max(axis=1), 1e-6)
        err = float(np.max(np.abs(a - b).max(axis=1) / scale))
        result["logit_rel_err"] = err
        result["logits_close"] = bool(err < tolerance and np.isfinite(a).all())
    states = [k for k in np_state if not k.startswith("scratch:")]
    if near_ties:   # tied rows sampled different tokens: their token-derived state differs too
        states = [k for k in states if k not in TOKEN_STATE]
    def same(k: str) -> bool:
        a, b = cuda_state[k], np_state[k]
        if a.dtype.kind == "f":   # computed state (e.g. continuation pages of KV): fp16 tolerance
            a64, b64 = a.astype(np.float64), b.astype(np.float64)
            scale = max(np.max(np.abs(b64), initial=0.0), 1e-6)
            if k.startswith("rows:") and np_logits is not None:
                # a logprob is a logit minus the row's log-sum-exp: it carries the logits' absolute
                # error, which the logits' magnitude bounds, not the (possibly small) logprobs'
                scale = max(scale, float(np.max(np.abs(np_logits), initial=0.0)))
            allowed = np.full(b64.shape, tolerance * scale)
            if a.dtype == np.float16:   # stored rounded to f16: values within the tolerance may round apart
                allowed = np.maximum(allowed, np.spacing(np.abs(b)).astype(np.float64))
            return bool(np.all(np.abs(a64 - b64) <= allowed))
        return bool(np.array_equal(a, b))

    result["state_equal"] = all(same(k) for k in states)
    if not result["state_equal"]:
        result["state_differs"] = [k for k in states if not same(k)]
    scratch = {}
    for k in (k for k in np_state if k.startswith("scratch:")):
        a, b = cuda_state[k].astype(np.float64), np_state[k].astype(np.float64)
        scratch[k[8:]] = float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-6)) if b.size else 0.0
    result["scratch_rel_err"] = {k: round(v, 4) for k, v in scratch.items()}
    # a diverged input is a near tie in the preparation; more than a few means a real difference
    few_diverged = len(diverged) <= max(1, program.capacity.rows // 8)
    result["pass"] = (result["tokens_equal"] and result.get("logits_close", True) and result["state_equal"]
                      and few_diverged)
    if not result["pass"] and np_logits is not None:
        per_row = np.abs(cuda_logits[compared] - np_logits[compared]).max(axis=1) / np.maximum(
            np.abs(np_logits[compared]).max(axis=1), 1e-6)
        result["bad_rows"] = [compared[int(r)] for r in np.nonzero(per_row >= tolerance)[0]][:32]
    return result


def first_difference(a: list[list[int]], b: list[list[int]]) -> tuple[int, int] | None:
    """(request, step) of the first token where two generations differ; None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        diff = [j for j, (p, q) in enumerate(zip(x, y)) if p != q]
        if diff:
            return (i, diff[0])
        if len(x) != len(y):
            return (i, min(len(x), len(y)))
    return None


def divergence_gap(models: dict, manifest: M.ExecutionManifest, vocab: int, prompt: list[int],
                   common: list[int], pair: dict[str, int]) -> dict:
    """Where two greedy runs part: each executor's logits at that decision point (the prompt and
    the tokens both produced, prefilled as one prompt) and the gap between the two tokens they
    chose, relative to the row's largest |logit|. A gap within TIE_TOLERANCE on both is a near
    tie: fp16 summation order decides it, not a wrong program. `pass` is not changed by it."""
    buffer = logits_buffer(manifest, "decode.r1.t1")
    a, b = pair["cuda"], pair["numpy"]
    gaps, argmax = {}, {}
    for kind, model in models.items():
        LockstepGenerator(model).generate([GenerationRequest(list(prompt) + list(common), max_tokens=1,
                                                             eos_ids=(vocab - 1,))])
        row = model.executor.read_buffer(buffer).view(np.float32)[:vocab]
        gaps[kind] = float(abs(row[a] - row[b]) / max(float(np.abs(row).max()), 1e-6))
        argmax[kind] = int(row.argmax())
    return {"tokens": pair, "relative_gap": gaps, "prefill_argmax": argmax,
            "near_tie": all(g <= TIE_TOLERANCE for g in gaps.values())}


def drafted_greedy(models: dict, prompts: list, steps: int, vocab: int, plain_cuda: list, batch: int) -> dict:
    """Greedy generation with history drafting (SPECULATIVE rounds of every captured width, copies
    from each request's own history) on both executors: CUDA equals numpy, and equals CUDA's
    plain greedy output, token for token."""
    from helios_backend.lockstep.speculative import SpeculativeLockstepGenerator
    from helios_backend.scheduler.speculative import SpeculativeOptions

    name = f"greedy.drafted.batch{batch}.steps{steps}"
    try:
        drafted, accepted = {}, {}
        for kind, model in models.items():
            requests = [GenerationRequest(p, max_tokens=steps, eos_ids=(vocab - 1,)) for p in prompts]
            run = SpeculativeLockstepGenerator(model, SpeculativeOptions(enabled=True, history_drafting=True)
                                               ).generate(requests)
            drafted[kind] = [r.tokens for r in run.results]
            accepted[kind] = run.accepted
        same = drafted["cuda"] == drafted["numpy"] and drafted["cuda"] == plain_cuda
        return {"program": name, "pass": bool(same), "steps": min(len(t) for t in drafted["cuda"]),
                "accepted_drafts": accepted,
                "first_difference": first_difference(drafted["cuda"], drafted["numpy"]),
                "first_difference_vs_plain": first_difference(drafted["cuda"], plain_cuda)}
    except Exception as error:
        return {"program": name, "pass": False, "error": repr(error), "trace": traceback.format_exc()[-800:]}


def snapshot(executor, manifest: M.ExecutionManifest, program: str, rows_vocab: tuple[int, int]):
    logits = logits_buffer(manifest, program)
    logit_rows = None
    if logits is not None:
        raw = executor.read_buffer(logits)
        logit_rows = raw.view(np.float32)[: rows_vocab[0] * rows_vocab[1]].reshape(rows_vocab)
    floats = {C.DTYPE_F32: np.float32, C.DTYPE_F16: np.float16}
    state = {}
    for b in manifest.buffers:
        if b.rank == 0 and b.kind == M.BUFFER_KIND_STATE:
            values = executor.read_buffer(b.name).view(floats.get(b.dtype, np.uint8))
            if b.shape and b.shape[0] == manifest.request_slots:     # per-slot state: one row per slot
                values = values.reshape(manifest.request_slots, -1)
            state[b.name] = values
    # float scratch (per-step intermediates): where two executors first differ localizes a kernel
    for b in manifest.buffers:
        if b.rank == 0 and b.kind == M.BUFFER_KIND_SCRATCH and b.dtype in (C.DTYPE_F32, C.DTYPE_F16):
            raw = executor.read_buffer(b.name)
            state["scratch:" + b.name] = raw.view(np.float32 if b.dtype == C.DTYPE_F32 else np.float16)
    return logit_rows, state


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--blas-threads", type=int, default=8)
    parser.add_argument("--skip", default="", help="comma-separated program names to skip")
    parser.add_argument("--transport", default="auto", choices=["auto", "kernel", "memcpy"])
    parser.add_argument("--no-pdl", action="store_true", help="launch no node with PDL (race check)")
    parser.add_argument("--greedy-only", action="store_true", help="only the greedy generation runs")
    parser.add_argument("--only", default="", help="comma-separated program names to run (no greedy runs)")
    parser.add_argument("--operations", default="",
                        help="comma-separated operations whose programs run (e.g. speculative; greedy runs "
                             "still follow); default: every operation")
    parser.add_argument("--max-tokens", type=int, default=0,
                        help="skip programs of more packed tokens (their numpy reference dominates a run: a "
                             "4,096-token prefill takes minutes); 0: every program")
    parser.add_argument("--greedy-first", action="store_true",
                        help="the greedy runs before the per-program cases (a short lease still gets them)")
    parser.add_argument("--kernel-arch", default=None,
                        help="KernelModule.arch to load (default: the device's own; e.g. compute_80)")
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    contract, manifest, read = load_bundle()
    print(f"bundle loaded in {time.time() - started:.1f} s", flush=True)
    counting = CountingDriver(load_driver())
    cuda = CudaExecutor(manifest, read, CudaExecutorOptions(cache_pages=CACHE_PAGES, pdl=not args.no_pdl,
                                                                 transport=args.transport, kernel_arch=args.kernel_arch),
                        driver=counting, graphs=[g for g in contract.model.graphs if g.rank == 0])
    numpy_ex = NumpyExecutor(manifest, read, NumpyExecutorOptions(cache_pages=CACHE_PAGES,
                                                                   blas_threads=args.blas_threads))
    print(f"executors ready in {time.time() - started:.1f} s; kernels {cuda.architecture()} "
          f"(modules loaded in {cuda.startup_seconds['modules']:.2f} s)", flush=True)
    models = {"cuda": ExecutorModel(contract, manifest, cuda), "numpy": ExecutorModel(contract, manifest, numpy_ex)}
    vocab = contract.model.vocabulary.sampled_tokens
    counting.counting = True
    results = []
    skip = set(filter(None, args.skip.split(",")))
    only = set(filter(None, args.only.split(",")))
    operations = {C.Operation.Value(f"OPERATION_{o.strip().upper()}") for o in args.operations.split(",") if o.strip()}

    def run_programs() -> None:
        for program in [p for p in manifest.programs if p.rank == 0 and p.name not in skip
                        and (not only or p.name in only) and (not operations or p.operation in operations)
                        and (not args.max_tokens or p.capacity.tokens <= args.max_tokens)
                        and not args.greedy_only]:
            outputs, prepared = {}, {}
            try:
                for kind, model in models.items():
                    case = Case(model, seed=zlib.crc32(program.name.encode()), first_generation=1_000_000 * (len(results) + 1))
                    rows = case.run(program)
                    # a speculative program's logits hold P target rows; the others' request_slots rows
                    logit_rows = (program.capacity.tokens if program.operation == C.OPERATION_SPECULATIVE
                                  else manifest.request_slots)
                    logits, state = snapshot(model.executor, manifest, case.logits_program or program.name,
                                             (logit_rows, vocab))
                    if case.scores is not None:       # float state: compared within the logit tolerance
                        state["completion:scores"] = case.scores
                    state.update(logprob_records(manifest, case.driver, len(rows)))
                    outputs[kind] = (rows.copy(), logits, state)
                    prepared[kind] = case.prepared_tokens
                results.append(compare(program.name, program, outputs, manifest, prepared, case.slots,
                                       logit_rows=case.logit_rows))
            except Exception as error:  # a failing case is a FAIL row, the others still run
                results.append({"program": program.name, "pass": False, "error": repr(error),
                                "trace": traceback.format_exc()[-800:]})
            print(json.dumps({k: v for k, v in results[-1].items() if k != "trace"}), flush=True)

    def run_greedy() -> None:
        # greedy generation: identical tokens for >= steps steps, at several batch sizes
        texts = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,",
                 "The three primary colors are", "Water boils at a temperature of", "import numpy as np\n",
                 "The largest planet in the solar system is", "To make a cup of tea, first"]
        from tokenizers import Tokenizer
        tokenizer = Tokenizer.from_str(bytes(read("tokenizer.json")).decode())
        has_speculative = any(g.operation == C.OPERATION_SPECULATIVE for g in contract.model.graphs)
        for batch in (() if only else (1, 3, 8)):
            prompts = [tokenizer.encode(t).ids for t in texts[:batch]]
            tokens = {}
            try:
                for kind, model in models.items():
                    requests = [GenerationRequest(p, max_tokens=args.steps, eos_ids=(vocab - 1,)) for p in prompts]
                    tokens[kind] = [r.tokens for r in LockstepGenerator(model).generate(requests)]
                same = tokens["cuda"] == tokens["numpy"]
                where = first_difference(tokens["cuda"], tokens["numpy"])
                results.append({"program": f"greedy.batch{batch}.steps{args.steps}", "pass": bool(same),
                                "steps": min(len(t) for t in tokens["cuda"]), "first_difference": where})
                if where is not None and where[1] < min(len(tokens["cuda"][where[0]]), len(tokens["numpy"][where[0]])):
                    r, step = where
                    results[-1]["divergence"] = divergence_gap(
                        models, manifest, vocab, prompts[r], tokens["cuda"][r][:step],
                        {kind: tokens[kind][r][step] for kind in ("cuda", "numpy")})
            except Exception as error:
                results.append({"program": f"greedy.batch{batch}", "pass": False, "error": repr(error),
                                "trace": traceback.format_exc()[-800:]})
            print(json.dumps({k: v for k, v in results[-1].items() if k != "trace"}), flush=True)
            if has_speculative and tokens.get("cuda"):
                results.append(drafted_greedy(models, prompts, args.steps, vocab, tokens["cuda"], batch))
                print(json.dumps({k: v for k, v in results[-1].items() if k != "trace"}), flush=True)

    for phase in ((run_greedy, run_programs) if args.greedy_first else (run_programs, run_greedy)):
        phase()
    counting.counting = False
    forbidden = counting.forbidden_calls()
    results.append({"program": "serving.driver_calls", "pass": not forbidden, "forbidden": forbidden,
                    "calls": dict(counting.calls)})
    node_counts = {p: cuda.node_count(p) for p in cuda.programs}
    name = "conformance" + ("_nopdl" if args.no_pdl else "") + (f"_{args.kernel_arch}" if args.kernel_arch else "")
    (out / f"{name}.json").write_text(json.dumps({"results": results, "node_counts": node_counts,
                                                  "architecture": cuda.architecture(),
                                                  "startup_seconds": cuda.startup_seconds,
                                                  "seconds": time.time() - started}, indent=1, default=str))
    print(f"\n{'case':34s} {'result':6s} detail")
    for r in results:
        detail = {k: r[k] for k in ("logit_rel_err", "steps", "first_difference", "divergence", "error", "state_differs",
                                    "bad_rows", "near_ties", "diverged_inputs")
                  if k in r}
        print(f"{r['program']:34s} {'PASS' if r['pass'] else 'FAIL':6s} {detail}")
    print(f"graph nodes per step: {node_counts}")
    cuda.close()
    numpy_ex.close()


if __name__ == "__main__":
    main()
