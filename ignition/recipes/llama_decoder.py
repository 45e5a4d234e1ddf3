"""The Llama-family decoder shared by recipes: weights, tensor parallelism, scratch, forward pass.

Recipes whose checkpoints are Llama-shaped (RMSNorm, GQA attention with RoPE, SwiGLU MLP, tied
or separate head) declare their source, frontend and capacities and take these functions as
they are. What differs between such checkpoints is data on the `LlamaShape` (read from the
source) and the recipe's options, never a branch on a model:

  * `shape.qkv_bias`: the q/k/v projections carry biases; the fused projection then runs
    attention.qkv_bias_rope_store.v1 with the f32 bias buffer `weights.layers.N.qkv_bias`;
  * `shape.tied_embeddings`: the logits read the embedding table, else `weights.output`;
  * `options.rope_pairing`: which dimensions RoPE rotates together, as the weights are stored
    (adjacent pairs for llama.cpp's permuted Llama q/k, half-split pairs for NEOX checkpoints);
  * `shape.rope_theta`, head counts, widths and the vocabulary size;
  * `shape.rope_scaling`: the checkpoint's RoPE scaling (llama3, linear, dynamic), applied to
    the frequencies of the stored rope table (ignition/sources/rope_scaling.py);
  * `shape.qk_norm`: an RMSNorm of every q and k head before RoPE (attention.qkv_norm_rope_store.v1
    with `weights.layers.N.attn_q_norm` / `attn_k_norm`);
  * `shape.post_norms`: the attention and FFN outputs are normed before their residual adds
    (linear.residual.v1 into `scratch.post_norm_accumulator`, then norm.residual.v1 with
    `post_attention_norm` / `post_ffw_norm`: four norms per block);
  * `shape.sliding_window` with `options.full_attention_period`: layers whose index is not
    period - 1 mod period attend over the last `sliding_window` positions only
    (attention.paged_window.v1, the cache contract's SLIDING_WINDOW region), with RoPE base
    `options.local_rope_theta` (table `weights.rope_table_local`);
  * `options.activation`: the FFN gate's activation (SiLU, or tanh-GELU through
    mlp.norm_gate_up_activation.v1);
  * `options.attention_scalar`: attention scores scaled by its inverse square root instead of
    head_dim's (Gemma's query_pre_attn_scalar);
  * `options.embedding_scale`: embeddings multiplied by sqrt(hidden), folded into the stored
    table (and, for a tied head, its inverse into the final norm's weight, so the logits are
    unchanged: rms_norm(h) * (w / s) @ (s E)^T = rms_norm(h) * w @ E^T).

Decode steps use split-KV attention (attention.paged_split.v1); prefill and mixed steps the
unsplit kernel. Node count per step: 5 per layer (norm+qkv+rope+cache write, attention, output
projection + residual, norm+gate/up+SiLU, down projection + residual; 7 with post norms: each
projection's norm.residual.v1), plus embedding, final norm+logits, the step prologue (geometry,
input ids) and the sampling epilogue.

Tensor parallelism (options.tensor_parallel ranks): the decoder declares which dimensions
ranks divide (KV-head groups, unevenly; ffn columns, evenly), the Split of each weight it cuts,
and the per-rank shape; ignition/preparation/tensor_parallel.py does the rest.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterator, Mapping

import numpy as np
from helios_proto import contract_pb2 as C
from helios_proto import manifest_pb2 as M

from helios_backend.kernel_abi.blocks import BlockMatrix, stack_rows
from helios_backend.kernel_abi.linear import ACTIVATION_SILU
from helios_backend.kernel_abi.rope import ROPE_ADJACENT_PAIRS, rope_table
from helios_backend.kernel_abi.sampling import LOGIT_BIAS_CAPACITY
from ignition.preparation.contract import PagedKV, StepIO, buffer
from ignition.preparation.tensor_parallel import PartitionedDimension, Split, TensorParallelError, add_to_residual
from ignition.recorder import ForwardRecorder, Recorder, Ref
from ignition.sources.gguf import LlamaShape


# ---- the serving variants a core records by default --------------------------------------------
# One table for every shipped recipe, checkpoint folder and the device benchmark bundles
# (tests/gpu/model_bundle.py bench_options adds long prompts and context on top): a GPU server's
# rows. The CUDA executor serves every captured row; the CPU and numpy executors load the variants
# of at most 32 rows (helios_backend/executors/factory.py DEFAULT_CONCURRENCY): the programs these
# cores recorded before the GPU's rows were added, and INITIALIZATION of 16 rows.
DECODE_ROWS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# (decode rows, packed tokens): decode lanes plus one prompt chunk. The small chunks keep
# short-prompt rounds short; the 1,024-token chunks let a long prompt join decode lanes whole
# instead of 127-255 tokens a round (served 1,024-token prompts were prefill-bound behind them)
MIXED_VARIANTS: tuple[tuple[int, int], ...] = ((8, 135), (32, 159), (64, 191), (128, 255), (256, 383),
                                               (64, 1088), (128, 1152), (256, 1280))
# INITIALIZATION rows: at 16 and 64, a burst of new requests (closed-loop clients finish and
# return together) is admitted in one or two rounds, not 4 a round (bench/scheduler_round.py
# --wide-admission: first tokens 6.1 -> 1.0 rounds after arrival at 64 clients, 10.4 -> 1.8 at 128)
ADMISSION_ROWS: tuple[int, ...] = (1, 4, 16, 64)
# SPECULATIVE widths derived for each decode row count up to 64 (ignition/preparation/speculative.py:
# D = W - 1, P = B x W <= 256, so width 4 to 64 rows, width 8 to 32); 1 = width one (no proposals)
SPECULATIVE_WIDTHS: tuple[int, ...] = (1, 4, 8)


@dataclass(frozen=True)
class DecoderOptions:
    """Capacity variants, paging and the RoPE pairing; tests restrict variants to keep preparation small.

    `gguf_path` overrides where the recipe finds its source file."""

    page_tokens: int = 16
    context_tokens: int = 2048
    decode_rows: tuple[int, ...] = DECODE_ROWS
    prefill_variants: tuple[tuple[int, int], ...] = ((1, 32), (1, 128), (1, 512), (4, 512))  # (rows, tokens)
    mixed_variants: tuple[tuple[int, int], ...] = MIXED_VARIANTS
    admission_rows: tuple[int, ...] = ADMISSION_ROWS
    resume_rows: tuple[int, ...] = (1, 4)   # RESUME (host-fed pending token, one token per row)
    # SCORED_PREFILL (rows, tokens): prefill chunks that also score target tokens; small t keeps it cheap
    scored_prefill_variants: tuple[tuple[int, int], ...] = ((1, 64),)
    # exact-endpoint snapshots: continuation rows (one cache page each) + RESTORATION programs; 0 = off
    snapshot_rows: int = 16
    restoration_rows: tuple[int, ...] = (1, 4)
    # SPECULATIVE programs with copied (history) proposals (SPECULATIVE_WIDTHS above); () = none
    # recorded (lean test cores). History drafting picks 4 or 8 per round from observed acceptance
    # and falls back to DECODE (docs/speculative.md).
    speculative_widths: tuple[int, ...] = SPECULATIVE_WIDTHS
    # explicit (B, W, D, P[, 1 = device allocation]) programs instead of the derived ones
    speculative_variants: tuple[tuple[int, ...], ...] = ()
    # top-N alternatives recorded per sampled token (sampling.logprobs.v1; 20 = OpenAI's maximum)
    top_logprobs: int = 20
    # OpenAI logit_bias entries per request (sampling.logit_bias.v1); 0 records no logit-bias
    # input, the shape of cores prepared before it (those refuse logit_bias)
    logit_bias_capacity: int = LOGIT_BIAS_CAPACITY
    prepared_pages: int = 512
    max_output_tokens: int = 512
    rope_pairing: int = ROPE_ADJACENT_PAIRS
    gguf_path: str | None = None
    tensor_parallel: int = 1    # ranks the model is divided among (KV-head groups, ffn columns)
    # with shape.sliding_window: every `full_attention_period`-th layer (index period - 1 mod period)
    # attends to the whole context, the others slide (0: every layer slides)
    full_attention_period: int = 0
    local_rope_theta: float = 0.0       # RoPE base of the sliding layers (0: the file's theta and scaling)
    activation: int = ACTIVATION_SILU   # FFN gate activation (helios_backend.kernel_abi.linear.ACTIVATION_*)
    embedding_scale: bool = False       # embeddings times sqrt(hidden)
    attention_scalar: float = 0.0       # attention scores times attention_scalar ** -0.5 (0: head_dim)
    # keep a source matrix's own blocks (a GGUF's Q8_0 / Q4_1 tensors, helios_backend/kernel_abi/blocks.py)
    # instead of dequantizing it to f16: lossless against the source, 2.7x fewer weight bytes per
    # decode step on the CPU executor; the CUDA executor expands them to f16 at load (docs/core-format.md)
    source_blocks: bool = True
    # steps of at least this many packed tokens run the layer projections (output, gate/up, down)
    # and a decode step's logits as plain f16 products (the product path: norm.rms_f16.v1,
    # linear.product_f16.v1, mlp.gate_activation_f16.v1, linear.residual_f16.v1, linear.product_f32.v1),
    # which the CUDA executor serves through cuBLASLt where it loads; smaller steps keep the fused
    # norm+GEMM kernels. 0: never (docs/kernels.md, "The product path": measured from 64 tokens on an
    # H100, every layout from SmolLM2-135M to Llama-3.1-8B ran faster on it)
    product_path_tokens: int = 64


# ---- weights ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class WeightTensor:
    buffer: str
    array: np.ndarray | BlockMatrix   # already in its stored dtype (or the source's blocks)
    sources: tuple[str, ...]    # GGUF tensor names it came from
    split: Split | None = None  # how tensor parallelism cuts it; None: replicated on every rank


# ---- tensor parallelism: the divided dimensions and the per-rank shape --------------------------

KV_GROUPS = "kv_groups"   # a KV head with the query heads that read it (the attention unit)
FFN = "ffn"               # one MLP column: a gate row, an up row, a down column


def tensor_parallel_dimensions(shape: LlamaShape) -> tuple[PartitionedDimension, ...]:
    # heads may split unevenly (each launch takes its own q_heads / kv_heads); ffn columns evenly,
    # so every rank's MLP width keeps the kernels' 16-element alignment
    return (PartitionedDimension(KV_GROUPS, shape.n_kv_heads, uneven=True),
            PartitionedDimension(FFN, shape.ffn, uneven=False))


def rank_shape(shape: LlamaShape, units: Mapping[str, int]) -> LlamaShape:
    """What one rank computes with: its KV heads and their query heads, its ffn columns."""
    return replace(shape, n_heads=units[KV_GROUPS] * shape.gqa_group, n_kv_heads=units[KV_GROUPS], ffn=units[FFN])


def _splits(shape: LlamaShape) -> dict[str, Split]:
    """Cut weights by name: output rows of q/k/v and gate/up, input columns of the output and down projections."""
    hd, group = shape.head_dim, shape.gqa_group
    return {"qkv": Split(0, KV_GROUPS, (group * hd, hd, hd)), "attn_output": Split(1, KV_GROUPS, (group * hd,)),
            "gate_up": Split(0, FFN, (1, 1)), "ffn_down": Split(1, FFN, (1,))}


def _layer(i: int, name: str) -> str:
    return f"weights.layers.{i}.{name}"


def layer_window(i: int, shape: LlamaShape, options: Any) -> int:
    """The attention window of layer i: 0 (the whole context) or shape.sliding_window."""
    period = options.full_attention_period
    if not shape.sliding_window or (period and i % period == period - 1):
        return 0
    return shape.sliding_window


def embedding_scale(shape: LlamaShape, options: Any) -> float:
    return float(np.sqrt(shape.hidden)) if options.embedding_scale else 1.0


def _matrix(source: Any, options: Any, names: tuple[str, ...]) -> np.ndarray | BlockMatrix:
    """The source matrices `names` stacked by rows: their own blocks when options.source_blocks
    asks and all are blocks of one layout, else dequantized to f16."""
    blocks = getattr(source, "blocks", None) if options.source_blocks else None
    if blocks is not None:
        stacked = stack_rows([blocks(name) for name in names])
        if stacked is not None:
            return stacked
    return np.concatenate([source.tensor(name).astype(np.float16) for name in names])


def weight_tensors(source: Any, options: Any) -> Iterator[WeightTensor]:
    """Model weights fused where one kernel reads them together: matrices as the source's blocks
    (options.source_blocks) or f16, norms and biases dequantized (f16 / f32)."""
    shape = source.shape
    split = _splits(shape)
    f16 = lambda name: source.tensor(name).astype(np.float16)  # noqa: E731
    scale = embedding_scale(shape, options)
    embedding = (_matrix(source, options, ("token_embd.weight",)) if scale == 1.0
                 else (source.tensor("token_embd.weight") * scale).astype(np.float16))
    yield WeightTensor("weights.token_embedding", embedding, ("token_embd.weight",))
    for i in range(shape.n_layers):
        b = f"blk.{i}."
        qkv = _matrix(source, options, (b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"))
        yield WeightTensor(_layer(i, "attn_norm"), f16(b + "attn_norm.weight"), (b + "attn_norm.weight",))
        yield WeightTensor(_layer(i, "qkv"), qkv, (b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"),
                           split["qkv"])
        for name in ("attn_q_norm", "attn_k_norm") if shape.qk_norm else ():
            yield WeightTensor(_layer(i, name), f16(b + name + ".weight"), (b + name + ".weight",))
        for name in ("post_attention_norm", "post_ffw_norm") if shape.post_norms else ():
            yield WeightTensor(_layer(i, name), f16(b + name + ".weight"), (b + name + ".weight",))
        if shape.qkv_bias:   # f32: key biases reach |145| (Qwen2 family), beyond f16's fine steps
            names = (b + "attn_q.bias", b + "attn_k.bias", b + "attn_v.bias")
            bias = np.concatenate([source.tensor(n).astype(np.float32) for n in names])
            yield WeightTensor(_layer(i, "qkv_bias"), bias, names, split["qkv"])
        yield WeightTensor(_layer(i, "attn_output"), _matrix(source, options, (b + "attn_output.weight",)),
                           (b + "attn_output.weight",),
                           split["attn_output"])
        yield WeightTensor(_layer(i, "ffn_norm"), f16(b + "ffn_norm.weight"), (b + "ffn_norm.weight",))
        gate_up = _matrix(source, options, (b + "ffn_gate.weight", b + "ffn_up.weight"))
        yield WeightTensor(_layer(i, "gate_up"), gate_up, (b + "ffn_gate.weight", b + "ffn_up.weight"),
                           split["gate_up"])
        yield WeightTensor(_layer(i, "ffn_down"), _matrix(source, options, (b + "ffn_down.weight",)),
                           (b + "ffn_down.weight",),
                           split["ffn_down"])
    # a tied head reads the scaled table: the final norm carries the inverse scale
    head_scale = scale if shape.tied_embeddings else 1.0
    yield WeightTensor("weights.output_norm", (source.tensor("output_norm.weight") / head_scale).astype(np.float16),
                       ("output_norm.weight",))
    if not shape.tied_embeddings:
        yield WeightTensor("weights.output", _matrix(source, options, ("output.weight",)), ("output.weight",))
    scaled = None if shape.rope_scaling is None else shape.rope_scaling.inverse_frequencies(
        shape.head_dim, shape.rope_theta, options.context_tokens)
    yield WeightTensor("weights.rope_table", rope_table(options.context_tokens, shape.head_dim, shape.rope_theta,
                                                        scaled), ())
    if shape.sliding_window:   # a base of their own is unscaled (Gemma 3); else the global table's frequencies
        yield WeightTensor("weights.rope_table_local", rope_table(
            options.context_tokens, shape.head_dim, options.local_rope_theta or shape.rope_theta,
            None if options.local_rope_theta else scaled), ())


def weight_tensor_count(shape: LlamaShape) -> int:
    per_layer = 6 + int(shape.qkv_bias) + 2 * int(shape.qk_norm) + 2 * int(shape.post_norms)
    return per_layer * shape.n_layers + 3 + (0 if shape.tied_embeddings else 1) + int(bool(shape.sliding_window))


# ---- forward pass ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Scratch:
    hidden: str = "scratch.hidden"        # f32 [tokens, hidden]  residual stream
    q: str = "scratch.q"                  # f32 [tokens, heads * head_dim]
    attention: str = "scratch.attention"  # f32 [tokens, heads * head_dim]
    mlp: str = "scratch.mlp"              # f32 [tokens, ffn]
    partials: str = "scratch.attention_partials"   # f32 [MAX_SPLITS, decode tokens, heads, head_dim + 2]
    arrivals: str = "scratch.attention_arrivals"   # i32 [decode tokens, kv_heads], zero between steps
    # f32 [tokens, hidden]: a post-normed projection's product (shape.post_norms); zero between
    # its two nodes' uses (norm.residual.v1 stores zeros back after reading a row)
    post_norm_accumulator: str = "scratch.post_norm_accumulator"
    # the product path's f16 activations (rows past the live count zero) and its gate/up product
    activations_f16: str = "scratch.activations_f16"   # f16 [tokens, max(hidden, heads * head_dim, ffn)]
    gate_up_f16: str = "scratch.gate_up_f16"           # f16 [tokens, 2 * ffn]
    qkv_f32: str = "scratch.qkv_f32"                   # f32 [tokens, (heads + 2 kv_heads) * head_dim]


SCRATCH = Scratch()


def paged_kv(shape: LlamaShape, options: Any) -> PagedKV:
    windows = {layer_window(i, shape, options) for i in range(shape.n_layers)} - {0}
    return PagedKV(layers=shape.n_layers, kv_heads=shape.n_kv_heads, head_dim=shape.head_dim,
                   page_tokens=options.page_tokens, window_tokens=max(windows, default=0))


# Split-KV decode attention: aim for about this many programs per layer (one per SM of an H200),
# never more than MAX_SPLITS splits of one row's context; prefill and mixed steps do not split.
TARGET_ATTENTION_PROGRAMS = 132
MAX_SPLITS = 16


def decode_splits(rows: int, shape: LlamaShape) -> int:
    return max(1, min(MAX_SPLITS, TARGET_ATTENTION_PROGRAMS // (rows * shape.n_kv_heads)))


def declare_scratch(rec: Recorder, shape: LlamaShape, max_tokens: int, options: Any) -> None:
    f32 = C.DTYPE_F32
    decode_tokens = max(options.decode_rows)
    rec.declare(buffer(SCRATCH.partials, M.BUFFER_KIND_SCRATCH, f32,
                       [MAX_SPLITS, decode_tokens, shape.n_heads, shape.head_dim + 2]))
    rec.declare(buffer(SCRATCH.arrivals, M.BUFFER_KIND_SCRATCH, C.DTYPE_I32, [decode_tokens, shape.n_kv_heads]))
    rec.declare(buffer(SCRATCH.hidden, M.BUFFER_KIND_SCRATCH, f32, [max_tokens, shape.hidden]))
    rec.declare(buffer(SCRATCH.q, M.BUFFER_KIND_SCRATCH, f32, [max_tokens, shape.q_dim]))
    rec.declare(buffer(SCRATCH.attention, M.BUFFER_KIND_SCRATCH, f32, [max_tokens, shape.q_dim]))
    rec.declare(buffer(SCRATCH.mlp, M.BUFFER_KIND_SCRATCH, f32, [max_tokens, shape.ffn]))
    if shape.post_norms:
        rec.declare(buffer(SCRATCH.post_norm_accumulator, M.BUFFER_KIND_SCRATCH, f32, [max_tokens, shape.hidden]))
    if uses_product_path(max_tokens, shape, options):
        f16 = C.DTYPE_F16
        rec.declare(buffer(SCRATCH.activations_f16, M.BUFFER_KIND_SCRATCH, f16,
                           [max_tokens, max(shape.hidden, shape.q_dim, shape.ffn)]))
        rec.declare(buffer(SCRATCH.gate_up_f16, M.BUFFER_KIND_SCRATCH, f16, [max_tokens, 2 * shape.ffn]))
        rec.declare(buffer(SCRATCH.qkv_f32, M.BUFFER_KIND_SCRATCH, f32,
                           [max_tokens, (shape.n_heads + 2 * shape.n_kv_heads) * shape.head_dim]))


def uses_product_path(tokens: int, shape: LlamaShape, options: DecoderOptions) -> bool:
    """Whether a step of `tokens` packed tokens runs the product path (DecoderOptions.product_path_tokens).
    One rank without post norms: a rank's partials and the sandwich norms keep the fused kernels."""
    threshold = options.product_path_tokens
    return 0 < threshold <= tokens and not shape.post_norms and options.tensor_parallel == 1


def forward(rec: ForwardRecorder, io: StepIO, shape: LlamaShape, cache: PagedKV, options: Any) -> None:
    """One step of the Llama forward pass over io.tokens packed tokens; logits of each row's last token.

    `shape` is the rank's (tensor_parallel.rank_shape): its heads and ffn columns; the hidden size,
    vocabulary and everything after the final norm are whole on every rank."""
    T, D = io.tokens, shape.hidden
    eps = float(shape.rms_eps)
    paging = dict(page_tokens=io.page_tokens, pages_per_row=io.pages_per_row, page_stride=cache.page_stride)
    heads = dict(q_heads=shape.n_heads, kv_heads=shape.n_kv_heads, head_dim=shape.head_dim)
    rec.launch("embedding.gather.v1", "embedding", hidden=SCRATCH.hidden, table="weights.token_embedding",
               ids=io.ids, geometry=io.geometry, tokens=T, dim=D)
    if shape.qkv_bias and shape.qk_norm:
        raise ValueError("q/k/v biases together with q/k norms have no fused kernel")
    if shape.post_norms and rec.world_size > 1:
        raise TensorParallelError(rec.world_size, "post-projection norms need each whole product (one rank)")
    # SPECULATIVE programs verify with the kernels plain decode of their rows uses (the fused ones up
    # to 32 rows), so greedy output is the same with history drafting on and off
    products = uses_product_path(T, shape, options) and io.operation != C.OPERATION_SPECULATIVE
    for i in range(shape.n_layers):
        k_cache, v_cache = cache.layer_refs(i)
        window = layer_window(i, shape, options)
        rope = dict(rope_table="weights.rope_table_local" if window else "weights.rope_table",
                    positions=io.positions, page_table=io.page_table, row_slot=io.row_slot, geometry=io.geometry,
                    tokens=T, rope_pairing=options.rope_pairing, **heads, **paging)
        if products and not shape.qk_norm:
            _product_path_qkv(rec, i, shape, eps, k_cache, v_cache, rope)
        else:
            if shape.qk_norm:
                qkv_kernel = "attention.qkv_norm_rope_store.v1"
                extra = dict(q_norm=_layer(i, "attn_q_norm"), k_norm=_layer(i, "attn_k_norm"))
            elif shape.qkv_bias:
                qkv_kernel, extra = "attention.qkv_bias_rope_store.v1", dict(qkv_bias=_layer(i, "qkv_bias"))
            else:
                qkv_kernel, extra = "attention.qkv_rope_store.v1", {}
            rec.launch(qkv_kernel, f"layer{i}.qkv", q_out=SCRATCH.q, k_cache=k_cache, v_cache=v_cache,
                       hidden=SCRATCH.hidden, norm_weight=_layer(i, "attn_norm"), qkv_weight=_layer(i, "qkv"),
                       **extra, dim=D, eps=eps, **rope)
        attention = dict(out=SCRATCH.attention, q=SCRATCH.q, k_cache=k_cache, v_cache=v_cache,
                         positions=io.positions, page_table=io.page_table, row_slot=io.row_slot,
                         geometry=io.geometry, rows=io.rows, tokens=T,
                         scale=float(1.0 / np.sqrt(options.attention_scalar or shape.head_dim)),
                         **heads, **paging)
        if window:
            rec.launch("attention.paged_window.v1", f"layer{i}.attention", window=window, **attention)
        elif io.operation == C.OPERATION_DECODE:
            rec.launch("attention.paged_split.v1", f"layer{i}.attention", partials=SCRATCH.partials,
                       arrivals=SCRATCH.arrivals, splits=decode_splits(io.rows, shape), **attention)
        else:
            rec.launch("attention.paged.v1", f"layer{i}.attention", **attention)
        if products:
            _product_path_layer(rec, i, shape, io, eps, options.activation)
            continue
        _output_to_residual(rec, i, "attn_output", "post_attention_norm", shape, io, x=SCRATCH.attention,
                            in_dim=shape.q_dim)
        gate_up = dict(out=SCRATCH.mlp, hidden=SCRATCH.hidden, norm_weight=_layer(i, "ffn_norm"),
                       gate_up=_layer(i, "gate_up"), geometry=io.geometry, tokens=T, dim=D, ffn_dim=shape.ffn, eps=eps)
        if options.activation == ACTIVATION_SILU:
            rec.launch("mlp.norm_gate_up_silu.v1", f"layer{i}.gate_up", **gate_up)
        else:
            rec.launch("mlp.norm_gate_up_activation.v1", f"layer{i}.gate_up", activation=options.activation,
                       **gate_up)
        _output_to_residual(rec, i, "ffn_down", "post_ffw_norm", shape, io, x=SCRATCH.mlp, in_dim=shape.ffn)
    head = "weights.token_embedding" if shape.tied_embeddings else "weights.output"
    if products and io.operation == C.OPERATION_DECODE and io.rows == T:
        # one token per row: the logits are the product of every normed token
        rec.launch("norm.rms_f16.v1", "logits.norm", out=SCRATCH.activations_f16, hidden=SCRATCH.hidden,
                   norm_weight="weights.output_norm", geometry=io.geometry, tokens=T, dim=D, eps=eps)
        rec.launch("linear.product_f32.v1", "logits", out=io.logits, x=SCRATCH.activations_f16, weight=head,
                   geometry=io.geometry, tokens=T, in_dim=D, out_dim=shape.vocab)
        return
    rec.launch("logits.norm_head.v1", "logits", logits=io.logits, hidden=SCRATCH.hidden,
               norm_weight="weights.output_norm", head=head, geometry=io.geometry, rows=io.rows, tokens=T,
               dim=D, vocab=shape.vocab, eps=eps)


def _product_path_qkv(rec: ForwardRecorder, i: int, shape: LlamaShape, eps: float, k_cache: Ref, v_cache: Ref,
                      rope: dict[str, Any]) -> None:
    """A layer's q/k/v on the product path: the normed hidden in f16, its f32 q/k/v product, then
    RoPE and the cache write (with the q/k/v bias where the shape has one)."""
    step = dict(geometry=rope["geometry"], tokens=rope["tokens"])
    width = (shape.n_heads + 2 * shape.n_kv_heads) * shape.head_dim
    rec.launch("norm.rms_f16.v1", f"layer{i}.attn_norm", out=SCRATCH.activations_f16, hidden=SCRATCH.hidden,
               norm_weight=_layer(i, "attn_norm"), dim=shape.hidden, eps=eps, **step)
    rec.launch("linear.product_f32.v1", f"layer{i}.qkv", out=SCRATCH.qkv_f32, x=SCRATCH.activations_f16,
               weight=_layer(i, "qkv"), in_dim=shape.hidden, out_dim=width, **step)
    if shape.qkv_bias:
        rec.launch("attention.bias_rope_store.v1", f"layer{i}.rope_store", q_out=SCRATCH.q, k_cache=k_cache,
                   v_cache=v_cache, projected=SCRATCH.qkv_f32, qkv_bias=_layer(i, "qkv_bias"), **rope)
    else:
        rec.launch("attention.rope_store.v1", f"layer{i}.rope_store", q_out=SCRATCH.q, k_cache=k_cache,
                   v_cache=v_cache, projected=SCRATCH.qkv_f32, **rope)


def _product_path_layer(rec: ForwardRecorder, i: int, shape: LlamaShape, io: StepIO, eps: float,
                        activation: int) -> None:
    """A layer's output projection and MLP as plain f16 products (after its fused qkv and attention):
    attention output to f16, hidden += it @ W_o^T; the normed hidden in f16, its gate/up product,
    act(gate) * up in f16, hidden += that @ W_down^T."""
    T, D, x16 = io.tokens, shape.hidden, SCRATCH.activations_f16
    step = dict(geometry=io.geometry, tokens=T)
    rec.launch("activation.to_f16.v1", f"layer{i}.attn_output.f16", out=x16, x=SCRATCH.attention, dim=shape.q_dim,
               **step)
    rec.launch("linear.residual_f16.v1", f"layer{i}.attn_output", hidden=SCRATCH.hidden, x=x16,
               weight=_layer(i, "attn_output"), in_dim=shape.q_dim, out_dim=D, **step)
    rec.launch("norm.rms_f16.v1", f"layer{i}.ffn_norm", out=x16, hidden=SCRATCH.hidden,
               norm_weight=_layer(i, "ffn_norm"), dim=D, eps=eps, **step)
    rec.launch("linear.product_f16.v1", f"layer{i}.gate_up", out=SCRATCH.gate_up_f16, x=x16,
               weight=_layer(i, "gate_up"), in_dim=D, out_dim=2 * shape.ffn, **step)
    rec.launch("mlp.gate_activation_f16.v1", f"layer{i}.activation", out=x16, projected=SCRATCH.gate_up_f16,
               ffn_dim=shape.ffn, activation=activation, **step)
    rec.launch("linear.residual_f16.v1", f"layer{i}.down", hidden=SCRATCH.hidden, x=x16,
               weight=_layer(i, "ffn_down"), in_dim=shape.ffn, out_dim=D, **step)


def _output_to_residual(rec: ForwardRecorder, i: int, weight: str, post_norm: str, shape: LlamaShape, io: StepIO,
                        *, x: str, in_dim: int) -> None:
    """hidden += x @ W^T, or with shape.post_norms hidden += rms_norm(x @ W^T) * post_norm.

    The post-normed form is two nodes: the product added into the zero post-norm accumulator by
    the column-parallel linear.residual.v1, then norm.residual.v1 over whole rows, which zeroes
    the accumulator again (one node owning whole rows, linear.norm_residual.v1, left one program
    streaming the weight at decode: docs/kernels.md)."""
    label = f"layer{i}.{'down' if weight == 'ffn_down' else weight}"
    product = SCRATCH.post_norm_accumulator if shape.post_norms else SCRATCH.hidden
    add_to_residual(rec, label, hidden=product, x=x, weight=_layer(i, weight), geometry=io.geometry,
                    tokens=io.tokens, in_dim=in_dim, out_dim=shape.hidden)
    if shape.post_norms:
        rec.launch("norm.residual.v1", f"{label}.post_norm", hidden=SCRATCH.hidden, accumulator=product,
                   norm_weight=_layer(i, post_norm), geometry=io.geometry, tokens=io.tokens, dim=shape.hidden,
                   eps=float(shape.rms_eps))
