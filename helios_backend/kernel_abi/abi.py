"""The kernel ABI: every kernel id, its ordered parameters and its numpy reference.

This table is the contract between three parts:
  * the recorder (ignition/recorder.py) emits nodes whose args follow these params;
  * the Triton AOT kernels (ignition/gpu_kernels/) implement each id with exactly these
    params in this order (pointers first as declared, then scalars; trailing scratch
    pointers are declared on the manifest's Kernel, not here);
  * the executors: numpy calls `reference(*args)`, CUDA launches the cubin symbol.

Argument conventions (both executors):
  POINTER  a device address = buffer start + byte offset. numpy passes a flat 1-D
           array of `dtype` from that address to the end of the buffer. A pointer
           declared F16 into a WEIGHT buffer may arrive as an f32 shadow in numpy.
  I32/I64  Python int (sizes, strides in elements, enum-like immediates)
  F32      Python float
Access is what the kernel does to the pointed memory; the numpy executor and the
contract's state accesses are checked against it.

Ids are versioned (`.v1`): a changed signature gets a new id, old ids stay.
Layouts the kernels share (step geometry, completion records, cache pages) are
drawn in state.py and attention.py and docs/programs.md.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Mapping

from helios_proto import contract_pb2, manifest_pb2

from helios_backend.kernel_abi import attention, cache, linear, logprobs, products, sampling, speculative, state

POINTER = manifest_pb2.PARAM_KIND_POINTER
I32 = manifest_pb2.PARAM_KIND_I32
I64 = manifest_pb2.PARAM_KIND_I64
F32 = manifest_pb2.PARAM_KIND_F32

F16_T = contract_pb2.DTYPE_F16
F32_T = contract_pb2.DTYPE_F32
I32_T = contract_pb2.DTYPE_I32
U32_T = contract_pb2.DTYPE_U32


class Access(enum.Enum):
    READ = "r"
    WRITE = "w"
    READ_WRITE = "rw"


@dataclass(frozen=True)
class Param:
    name: str
    kind: manifest_pb2.ParamKind.ValueType
    dtype: contract_pb2.DType.ValueType = contract_pb2.DTYPE_UNSPECIFIED  # pointed elements (POINTER only)
    access: Access = Access.READ

    @property
    def is_pointer(self) -> bool:
        return self.kind == POINTER


@dataclass(frozen=True)
class KernelSpec:
    id: str
    params: tuple[Param, ...]
    reference: Callable[..., None]
    summary: str

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(f"{self.id} has no parameter {name!r}")


def _ptr(name: str, dtype: contract_pb2.DType.ValueType, access: Access = Access.READ) -> Param:
    return Param(name, POINTER, dtype, access)


def _i32(name: str) -> Param:
    return Param(name, I32)


def _i64(name: str) -> Param:
    return Param(name, I64)


def _f32(name: str) -> Param:
    return Param(name, F32)


W, RW = Access.WRITE, Access.READ_WRITE

_SPECS: tuple[KernelSpec, ...] = (
    KernelSpec("step.geometry.v1", (
        _ptr("geometry", I32_T, W), _ptr("query_length", I32_T), _i32("rows"), _i32("tokens"),
    ), state.step_geometry, "live token count, token -> row map and row starts; first node of a step"),
    KernelSpec("tokens.select_input.v1", (
        _ptr("ids", I32_T, W), _ptr("prompt_tokens", I32_T), _ptr("pending", I32_T),
        _ptr("row_slot", I32_T), _ptr("prefill_row", I32_T), _ptr("geometry", I32_T),
        _i32("rows"), _i32("tokens"),
    ), state.select_input_ids, "host prompt tokens for the prefill row, device pending tokens for the others"),
    KernelSpec("tokens.select_input.v2", (
        _ptr("ids", I32_T, W), _ptr("prompt_tokens", I32_T), _ptr("pending", I32_T),
        _ptr("row_slot", I32_T), _ptr("geometry", I32_T), _i32("rows"), _i32("tokens"),
    ), state.select_input_ids_by_token, "host prompt tokens where fed (>= 0), device pending tokens elsewhere"),
    KernelSpec("embedding.gather.v1", (
        _ptr("hidden", F32_T, W), _ptr("table", F16_T), _ptr("ids", I32_T), _ptr("geometry", I32_T),
        _i32("tokens"), _i32("dim"),
    ), linear.embed_tokens, "hidden[t] = table[ids[t]]"),
    KernelSpec("attention.qkv_rope_store.v1", (
        _ptr("q_out", F32_T, W), _ptr("k_cache", F16_T, W), _ptr("v_cache", F16_T, W),
        _ptr("hidden", F32_T), _ptr("norm_weight", F16_T), _ptr("qkv_weight", F16_T),
        _ptr("rope_table", F32_T), _ptr("positions", I32_T), _ptr("page_table", I32_T),
        _ptr("row_slot", I32_T), _ptr("geometry", I32_T),
        _i32("tokens"), _i32("dim"), _i32("q_heads"), _i32("kv_heads"), _i32("head_dim"),
        _i32("page_tokens"), _i32("pages_per_row"), _i64("page_stride"), _f32("eps"), _i32("rope_pairing"),
    ), attention.qkv_rope_store, "rms_norm + fused qkv projection + RoPE + paged cache write"),
    KernelSpec("attention.qkv_bias_rope_store.v1", (
        _ptr("q_out", F32_T, W), _ptr("k_cache", F16_T, W), _ptr("v_cache", F16_T, W),
        _ptr("hidden", F32_T), _ptr("norm_weight", F16_T), _ptr("qkv_weight", F16_T), _ptr("qkv_bias", F32_T),
        _ptr("rope_table", F32_T), _ptr("positions", I32_T), _ptr("page_table", I32_T),
        _ptr("row_slot", I32_T), _ptr("geometry", I32_T),
        _i32("tokens"), _i32("dim"), _i32("q_heads"), _i32("kv_heads"), _i32("head_dim"),
        _i32("page_tokens"), _i32("pages_per_row"), _i64("page_stride"), _f32("eps"), _i32("rope_pairing"),
    ), attention.qkv_bias_rope_store, "qkv_rope_store plus an f32 q/k/v bias added before RoPE"),
    KernelSpec("attention.qkv_norm_rope_store.v1", (
        _ptr("q_out", F32_T, W), _ptr("k_cache", F16_T, W), _ptr("v_cache", F16_T, W),
        _ptr("hidden", F32_T), _ptr("norm_weight", F16_T), _ptr("qkv_weight", F16_T),
        _ptr("q_norm", F16_T), _ptr("k_norm", F16_T),
        _ptr("rope_table", F32_T), _ptr("positions", I32_T), _ptr("page_table", I32_T),
        _ptr("row_slot", I32_T), _ptr("geometry", I32_T),
        _i32("tokens"), _i32("dim"), _i32("q_heads"), _i32("kv_heads"), _i32("head_dim"),
        _i32("page_tokens"), _i32("pages_per_row"), _i64("page_stride"), _f32("eps"), _i32("rope_pairing"),
    ), attention.qkv_norm_rope_store, "qkv_rope_store plus an RMSNorm of each q and k head before RoPE"),
    KernelSpec("attention.paged.v1", (
        _ptr("out", F32_T, W), _ptr("q", F32_T), _ptr("k_cache", F16_T), _ptr("v_cache", F16_T),
        _ptr("positions", I32_T), _ptr("page_table", I32_T), _ptr("row_slot", I32_T),
        _ptr("geometry", I32_T),
        _i32("rows"), _i32("tokens"), _i32("q_heads"), _i32("kv_heads"), _i32("head_dim"),
        _i32("page_tokens"), _i32("pages_per_row"), _i64("page_stride"), _f32("scale"),
    ), attention.paged_attention, "causal grouped-query attention over paged history"),
    KernelSpec("attention.paged_split.v1", (
        _ptr("out", F32_T, W), _ptr("q", F32_T), _ptr("k_cache", F16_T), _ptr("v_cache", F16_T),
        _ptr("positions", I32_T), _ptr("page_table", I32_T), _ptr("row_slot", I32_T),
        _ptr("geometry", I32_T), _ptr("partials", F32_T, RW), _ptr("arrivals", I32_T, RW),
        _i32("rows"), _i32("tokens"), _i32("q_heads"), _i32("kv_heads"), _i32("head_dim"),
        _i32("page_tokens"), _i32("pages_per_row"), _i64("page_stride"), _f32("scale"), _i32("splits"),
    ), attention.paged_attention_split, "split-KV attention for decode: partials merged by the last split"),
    KernelSpec("attention.paged_window.v1", (
        _ptr("out", F32_T, W), _ptr("q", F32_T), _ptr("k_cache", F16_T), _ptr("v_cache", F16_T),
        _ptr("positions", I32_T), _ptr("page_table", I32_T), _ptr("row_slot", I32_T),
        _ptr("geometry", I32_T),
        _i32("rows"), _i32("tokens"), _i32("q_heads"), _i32("kv_heads"), _i32("head_dim"),
        _i32("page_tokens"), _i32("pages_per_row"), _i64("page_stride"), _f32("scale"), _i32("window"),
    ), attention.paged_window_attention, "causal attention over the last `window` positions (sliding window)"),
    KernelSpec("linear.residual.v1", (
        _ptr("hidden", F32_T, RW), _ptr("x", F32_T), _ptr("weight", F16_T), _ptr("geometry", I32_T),
        _i32("tokens"), _i32("in_dim"), _i32("out_dim"),
    ), linear.linear_residual, "hidden += x @ weight.T (output / down projection + residual)"),
    KernelSpec("linear.project.v1", (
        _ptr("out", F32_T, W), _ptr("x", F32_T), _ptr("weight", F16_T), _ptr("geometry", I32_T),
        _i32("tokens"), _i32("in_dim"), _i32("out_dim"),
    ), linear.linear_project, "out = x @ weight.T, rows past the live count 0 (a rank's partial before an all-reduce)"),
    KernelSpec("mlp.norm_gate_up_silu.v1", (
        _ptr("out", F32_T, W), _ptr("hidden", F32_T), _ptr("norm_weight", F16_T),
        _ptr("gate_up", F16_T), _ptr("geometry", I32_T),
        _i32("tokens"), _i32("dim"), _i32("ffn_dim"), _f32("eps"),
    ), linear.norm_gate_up_silu, "rms_norm + fused gate/up projection + SiLU(gate) * up"),
    KernelSpec("linear.norm_residual.v1", (
        _ptr("hidden", F32_T, RW), _ptr("x", F32_T), _ptr("weight", F16_T), _ptr("norm_weight", F16_T),
        _ptr("geometry", I32_T),
        _i32("tokens"), _i32("in_dim"), _i32("out_dim"), _f32("eps"),
    ), linear.linear_norm_residual, "hidden += rms_norm(x @ weight.T) * norm_weight (post-norm + residual)"),
    # a post-normed projection as two nodes: linear.residual.v1 into a zero accumulator (its
    # parallel GEMV / split-K grids), then this norm over whole rows, which re-zeroes it
    KernelSpec("norm.residual.v1", (
        _ptr("hidden", F32_T, RW), _ptr("accumulator", F32_T, RW), _ptr("norm_weight", F16_T),
        _ptr("geometry", I32_T),
        _i32("tokens"), _i32("dim"), _f32("eps"),
    ), linear.norm_residual, "hidden += rms_norm(accumulator) * norm_weight; accumulator = 0"),
    KernelSpec("mlp.norm_gate_up_activation.v1", (
        _ptr("out", F32_T, W), _ptr("hidden", F32_T), _ptr("norm_weight", F16_T),
        _ptr("gate_up", F16_T), _ptr("geometry", I32_T),
        _i32("tokens"), _i32("dim"), _i32("ffn_dim"), _f32("eps"), _i32("activation"),
    ), linear.norm_gate_up_activation, "rms_norm + fused gate/up projection + act(gate) * up (SiLU or tanh-GELU)"),
    # the product path (products.py): plain f16 products, which a vendor library may serve, and
    # the pointwise nodes that feed them f16 activations with zero rows past the live count
    KernelSpec("norm.rms_f16.v1", (
        _ptr("out", F16_T, W), _ptr("hidden", F32_T), _ptr("norm_weight", F16_T), _ptr("geometry", I32_T),
        _i32("tokens"), _i32("dim"), _f32("eps"),
    ), products.rms_norm_f16, "out = f16(rms_norm(hidden) * norm_weight), rows past the live count 0"),
    KernelSpec("activation.to_f16.v1", (
        _ptr("out", F16_T, W), _ptr("x", F32_T), _ptr("geometry", I32_T), _i32("tokens"), _i32("dim"),
    ), products.to_f16, "out = f16(x), rows past the live count 0"),
    KernelSpec("mlp.gate_activation_f16.v1", (
        _ptr("out", F16_T, W), _ptr("projected", F16_T), _ptr("geometry", I32_T),
        _i32("tokens"), _i32("ffn_dim"), _i32("activation"),
    ), products.gate_activation_f16, "out = f16(act(gate) * up) of a gate/up product, rows past the live count 0"),
    KernelSpec("attention.rope_store.v1", (
        _ptr("q_out", F32_T, W), _ptr("k_cache", F16_T, W), _ptr("v_cache", F16_T, W), _ptr("projected", F32_T),
        _ptr("rope_table", F32_T), _ptr("positions", I32_T), _ptr("page_table", I32_T),
        _ptr("row_slot", I32_T), _ptr("geometry", I32_T),
        _i32("tokens"), _i32("q_heads"), _i32("kv_heads"), _i32("head_dim"),
        _i32("page_tokens"), _i32("pages_per_row"), _i64("page_stride"), _i32("rope_pairing"),
    ), attention.rope_store, "RoPE on q, k of an f32 q/k/v projection -> q_out and the paged cache"),
    KernelSpec("attention.bias_rope_store.v1", (
        _ptr("q_out", F32_T, W), _ptr("k_cache", F16_T, W), _ptr("v_cache", F16_T, W), _ptr("projected", F32_T),
        _ptr("qkv_bias", F32_T), _ptr("rope_table", F32_T), _ptr("positions", I32_T), _ptr("page_table", I32_T),
        _ptr("row_slot", I32_T), _ptr("geometry", I32_T),
        _i32("tokens"), _i32("q_heads"), _i32("kv_heads"), _i32("head_dim"),
        _i32("page_tokens"), _i32("pages_per_row"), _i64("page_stride"), _i32("rope_pairing"),
    ), attention.bias_rope_store, "rope_store with an f32 q/k/v bias added to the projection first"),
    KernelSpec("linear.product_f16.v1", (
        _ptr("out", F16_T, W), _ptr("x", F16_T), _ptr("weight", F16_T), _ptr("geometry", I32_T),
        _i32("tokens"), _i32("in_dim"), _i32("out_dim"),
    ), products.product_f16, "out = f16(x @ weight.T): f16 activations, f32 accumulation"),
    KernelSpec("linear.product_f32.v1", (
        _ptr("out", F32_T, W), _ptr("x", F16_T), _ptr("weight", F16_T), _ptr("geometry", I32_T),
        _i32("tokens"), _i32("in_dim"), _i32("out_dim"),
    ), products.product_f32, "out = x @ weight.T in f32 (a decode step's logits)"),
    KernelSpec("linear.residual_f16.v1", (
        _ptr("hidden", F32_T, RW), _ptr("x", F16_T), _ptr("weight", F16_T), _ptr("geometry", I32_T),
        _i32("tokens"), _i32("in_dim"), _i32("out_dim"),
    ), products.residual_f16, "hidden += x @ weight.T with f16 activations"),
    KernelSpec("logits.norm_head.v1", (
        _ptr("logits", F32_T, W), _ptr("hidden", F32_T), _ptr("norm_weight", F16_T),
        _ptr("head", F16_T), _ptr("geometry", I32_T),
        _i32("rows"), _i32("tokens"), _i32("dim"), _i32("vocab"), _f32("eps"),
    ), linear.norm_logits, "final rms_norm + LM head on each row's last token"),
    KernelSpec("sampling.adjust.v1", (
        _ptr("logits", F32_T, RW), _ptr("sampling", F32_T), _ptr("prompt_histogram", I32_T),
        _ptr("output_histogram", I32_T), _ptr("grammar_mask", U32_T), _ptr("row_slot", I32_T),
        _ptr("sample_flag", I32_T),
        _i32("rows"), _i32("vocab"), _i32("histogram_bins"), _i32("mask_words"),
    ), sampling.adjust_logits, "repetition / frequency / presence penalties, grammar mask"),
    KernelSpec("sampling.draw.v1", (
        _ptr("sampled", I32_T, W), _ptr("logits", F32_T), _ptr("sampling", F32_T),
        _ptr("seeds", U32_T), _ptr("generated", I32_T), _ptr("row_slot", I32_T),
        _ptr("sample_flag", I32_T),
        _i32("rows"), _i32("vocab"),
    ), sampling.draw_tokens, "temperature / top-k / top-p / min-p draw with Philox4x32-10"),
    KernelSpec("sampling.keep_logits.v1", (
        _ptr("raw_logits", F32_T, W), _ptr("logits", F32_T), _ptr("row_slot", I32_T),
        _ptr("sample_flag", I32_T), _ptr("live_rows", I32_T),
        _i32("rows"), _i32("vocab"),
    ), logprobs.keep_logits, "copy the sampling rows' raw logits before sampling.adjust (for the logprobs)"),
    KernelSpec("sampling.logprobs.v1", (
        _ptr("completion", I32_T, W), _ptr("logits", F32_T), _ptr("sampled", I32_T),
        _ptr("row_slot", I32_T), _ptr("sample_flag", I32_T), _ptr("live_rows", I32_T),
        _i32("rows"), _i32("vocab"), _i32("top_n"), _i32("record_base"),
    ), logprobs.sampled_logprobs, "sampled token's log-softmax + top-N alternatives -> logprob extension records"),
    # v2 of the draw and the logprobs: many programs per row over one scratch `partials`
    # (i32 [rows, sampling.partial_words(vocab)]) and `arrivals` (i32 [rows], zero between
    # steps); the draw applies the penalties and grammar mask itself (logits stay raw, no
    # sampling.adjust / sampling.keep_logits nodes), the logprobs skip rows that did not ask
    KernelSpec("sampling.draw.v2", (
        _ptr("sampled", I32_T, W), _ptr("logits", F32_T), _ptr("sampling", F32_T),
        _ptr("seeds", U32_T), _ptr("generated", I32_T), _ptr("prompt_histogram", I32_T),
        _ptr("output_histogram", I32_T), _ptr("grammar_mask", U32_T), _ptr("row_slot", I32_T),
        _ptr("sample_flag", I32_T), _ptr("partials", I32_T, RW), _ptr("arrivals", I32_T, RW),
        _i32("rows"), _i32("vocab"), _i32("histogram_bins"), _i32("mask_words"),
    ), sampling.draw_adjusted_tokens, "penalties + grammar mask + draw, the vocabulary spread over programs"),
    KernelSpec("sampling.logprobs.v2", (
        _ptr("completion", I32_T, W), _ptr("logits", F32_T), _ptr("sampled", I32_T),
        _ptr("sampling", F32_T), _ptr("row_slot", I32_T), _ptr("sample_flag", I32_T),
        _ptr("live_rows", I32_T), _ptr("partials", I32_T, RW), _ptr("arrivals", I32_T, RW),
        _i32("rows"), _i32("vocab"), _i32("top_n"), _i32("record_base"),
    ), logprobs.requested_logprobs, "logprob records of the rows that asked, the vocabulary spread over programs"),
    # the request's logit bias, in place on the raw logits before the draw and the logprobs
    # (both then see it, as OpenAI's logprobs do); a row's ids are distinct
    KernelSpec("sampling.logit_bias.v1", (
        _ptr("logits", F32_T, RW), _ptr("bias_ids", I32_T), _ptr("bias_values", F32_T),
        _i32("rows"), _i32("vocab"), _i32("bias_capacity"),
    ), sampling.add_logit_bias, "logits[r, bias_ids[r, k]] += bias_values[r, k] (OpenAI logit_bias)"),
    KernelSpec("logits.score_targets.v1", (
        _ptr("completion", I32_T, W), _ptr("hidden", F32_T), _ptr("norm_weight", F16_T), _ptr("head", F16_T),
        _ptr("targets", I32_T), _ptr("geometry", I32_T),
        _i32("tokens"), _i32("dim"), _i32("vocab"), _f32("eps"), _i32("record_base"),
    ), logprobs.score_targets, "SCORED_PREFILL: log_softmax(norm + LM head of each packed token)[target] -> scores"),
    KernelSpec("state.commit.v1", (
        _ptr("completion", I32_T, W), _ptr("pending", I32_T, RW), _ptr("generated", I32_T, RW),
        _ptr("output_histogram", I32_T, RW), _ptr("sampled", I32_T), _ptr("eos_ids", I32_T),
        _ptr("output_limit", I32_T), _ptr("row_slot", I32_T), _ptr("row_generation", I32_T),
        _ptr("query_length", I32_T), _ptr("consumed", I32_T), _ptr("sample_flag", I32_T),
        _ptr("transport_header", I32_T), _ptr("live_rows", I32_T),
        _i32("rows"), _i32("eos_capacity"), _i32("histogram_bins"), _i32("operation"),
    ), state.commit_samples, "publish sampled tokens to slot state; write completion records"),
    KernelSpec("state.admit.v1", (
        _ptr("seeds", U32_T, W), _ptr("sampling", F32_T, W), _ptr("output_limit", I32_T, W),
        _ptr("eos_ids", I32_T, W), _ptr("prompt_histogram", I32_T, W),
        _ptr("output_histogram", I32_T, W), _ptr("generated", I32_T, W), _ptr("pending", I32_T, W),
        _ptr("completion", I32_T, W),
        _ptr("in_seeds", U32_T), _ptr("in_sampling", F32_T), _ptr("in_output_limit", I32_T),
        _ptr("in_eos_ids", I32_T), _ptr("in_histogram", I32_T), _ptr("row_slot", I32_T),
        _ptr("row_generation", I32_T), _ptr("transport_header", I32_T), _ptr("live_rows", I32_T),
        _i32("rows"), _i32("eos_capacity"), _i32("histogram_bins"), _i32("operation"),
    ), state.admit_requests, "initialization: admission sampling state into the slot"),
    KernelSpec("cache.snapshot_partial.v1", (
        _ptr("k_continuation", F16_T, W), _ptr("v_continuation", F16_T, W), _ptr("k_cache", F16_T),
        _ptr("v_cache", F16_T), _ptr("page_table", I32_T), _ptr("row_slot", I32_T), _ptr("snapshot_row", I32_T),
        _ptr("consumed", I32_T), _ptr("query_length", I32_T), _ptr("live_rows", I32_T),
        _i32("rows"), _i32("page_tokens"), _i32("pages_per_row"), _i64("page_stride"), _i64("row_stride"),
    ), cache.snapshot_partial_pages, "partial page at each snapshot endpoint -> continuation row"),
    KernelSpec("cache.restore_partial.v1", (
        _ptr("k_cache", F16_T, W), _ptr("v_cache", F16_T, W), _ptr("completion", I32_T, W),
        _ptr("k_continuation", F16_T), _ptr("v_continuation", F16_T), _ptr("page_table", I32_T),
        _ptr("row_slot", I32_T), _ptr("row_generation", I32_T), _ptr("restore_row", I32_T),
        _ptr("consumed", I32_T), _ptr("transport_header", I32_T), _ptr("live_rows", I32_T),
        _i32("rows"), _i32("page_tokens"), _i32("pages_per_row"), _i64("page_stride"), _i64("row_stride"),
        _i32("operation"),
    ), cache.restore_partial_pages, "RESTORATION: continuation row -> private page at the endpoint"),
    # SPECULATIVE (kernel_abi/speculative.py): allocation, verify-block layout, verification + commit
    KernelSpec("speculative.allocate.v1", (
        _ptr("lengths", I32_T, W), _ptr("confidence", F32_T), _ptr("prefix_limit", I32_T),
        _ptr("row_slot", I32_T), _ptr("transport_header", I32_T), _ptr("live_rows", I32_T),
        _i32("rows"), _i32("request_slots"), _i32("draft_capacity"), _i32("confidence_width"),
        _i32("packed_capacity"),
    ), speculative.allocate_prefixes, "causal prefix allocation by FP64 survival within P; no draws"),
    KernelSpec("speculative.copy_confidence.v1", (
        _ptr("confidence", F32_T, W), _ptr("proposal_count", I32_T), _ptr("proposal_generation", I32_T),
        _ptr("proposal_consumed", I32_T), _ptr("row_generation", I32_T), _ptr("consumed", I32_T),
        _ptr("row_slot", I32_T), _ptr("transport_header", I32_T), _ptr("live_rows", I32_T),
        _i32("rows"), _i32("request_slots"), _i32("draft_capacity"), _i32("draft_tokens"),
    ), speculative.copy_confidence, "framed confidence of copied proposals (1 per usable copy)"),
    KernelSpec("speculative.expand.v1", (
        _ptr("ids", I32_T, W), _ptr("positions", I32_T, W), _ptr("token_slot", I32_T, W),
        _ptr("token_length", I32_T, W), _ptr("lengths", I32_T, W), _ptr("requested", I32_T),
        _ptr("pending", I32_T), _ptr("proposal_ids", I32_T), _ptr("proposal_count", I32_T),
        _ptr("proposal_generation", I32_T), _ptr("proposal_consumed", I32_T), _ptr("row_slot", I32_T),
        _ptr("row_generation", I32_T), _ptr("consumed", I32_T), _ptr("live_rows", I32_T),
        _i32("rows"), _i32("tokens"), _i32("draft_stride"), _i32("draft_tokens"), _i32("width"),
    ), speculative.expand_block, "pending + copied proposals -> one-token target rows"),
    KernelSpec("speculative.verify_commit.v1", (
        _ptr("completion", I32_T, W), _ptr("pending", I32_T, RW), _ptr("generated", I32_T, RW),
        _ptr("output_histogram", I32_T, RW), _ptr("draft_cursor", I32_T, W), _ptr("logits", F32_T),
        _ptr("sampling", F32_T), _ptr("seeds", U32_T), _ptr("prompt_histogram", I32_T),
        _ptr("grammar_mask", U32_T), _ptr("eos_ids", I32_T), _ptr("output_limit", I32_T), _ptr("ids", I32_T),
        _ptr("lengths", I32_T), _ptr("row_slot", I32_T), _ptr("row_generation", I32_T), _ptr("consumed", I32_T),
        _ptr("transport_header", I32_T), _ptr("live_rows", I32_T),
        _i32("rows"), _i32("tokens"), _i32("vocab"), _i32("histogram_bins"), _i32("mask_words"),
        _i32("eos_capacity"), _i32("lag_tokens"), _i32("completion_rows"), _i32("ext_width"), _i32("operation"),
    ), speculative.verify_commit, "sample the target per position, accept the longest match, commit, one completion"),
)

KERNELS: Mapping[str, KernelSpec] = {spec.id: spec for spec in _SPECS}


class UnknownKernelError(KeyError):
    """A program names a kernel id that this ABI table does not define."""


def kernel(kernel_id: str) -> KernelSpec:
    try:
        return KERNELS[kernel_id]
    except KeyError:
        raise UnknownKernelError(kernel_id) from None
