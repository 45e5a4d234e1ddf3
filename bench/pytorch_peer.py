"""The PyTorch peer: plain PyTorch of the same layouts, what a user gets from PyTorch done well.

    python -m bench.pytorch_peer --out $OUT/peer.json [--layout qwen2.5-0.5b ...]

A benchmark only (PyTorch is on the GPU machine for benchmarks; nothing that serves imports this).
For each layout of bench/layouts/ (read with ignition/sources/hf_layout.py): random fp16 weights
on the GPU, fused q/k/v and gate/up weights through cuBLAS (`F.linear`), RMSNorm
(`F.rms_norm`), half-split RoPE, scaled-dot-product attention (`F.scaled_dot_product_attention`),
a static KV cache, SiLU-gated MLP, the LM head at each row's last token and a greedy argmax.

  * decode: one step for `batch` rows, each attending over CONTEXT positions (the same as
    bench/kernels.py), captured as a CUDA graph per batch; the query heads of a KV head ride as
    that head's query rows (GQA without copying K/V); device time of graph replays back to back;
  * prefill: one row of 512 / 4,096 tokens from position 0, eager, causal SDPA with GQA; device
    time with events around the forward.

Also measures the two roofline ceilings of the run: the device-to-device copy bandwidth (bytes
read + written) and the fp16 tensor-core peak (cuBLAS 8192^3 on random data); bench/kernels.py
reads them from this file.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
from typing import Any

import torch  # type: ignore[import-not-found]
import torch.nn.functional as F  # type: ignore[import-not-found]

from bench.kernels import CONTEXT, DECODE_BATCHES, LAYOUT_DIR, LAYOUTS, PREFILL_TOKENS, gemm_tflops
from ignition.sources.hf_layout import HFLayout

REPLAYS = 50


def copy_gbps(nbytes: int = 1 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(1)
    dst = torch.empty_like(src)
    samples = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    del src, dst
    return 2 * nbytes / (statistics.median(samples[2:]) * 1e-3) / 1e9


class Decoder:
    """A Llama-family decoder of `shape` with random fp16 weights and a static KV cache."""

    def __init__(self, shape: Any, max_batch: int, max_tokens: int) -> None:
        self.s = s = shape
        self.eps = float(s.rms_eps)
        g = torch.Generator(device="cuda").manual_seed(0)

        def weight(*dims: int) -> torch.Tensor:
            return torch.randn(*dims, generator=g, device="cuda", dtype=torch.float16) * 0.02

        qkv = s.q_dim + 2 * s.kv_dim
        self.embedding = weight(s.vocab, s.hidden)
        self.head = self.embedding if s.tied_embeddings else weight(s.vocab, s.hidden)
        self.final_norm = torch.ones(s.hidden, device="cuda", dtype=torch.float16)
        self.layers = [dict(attn_norm=torch.ones(s.hidden, device="cuda", dtype=torch.float16),
                            qkv=weight(qkv, s.hidden), qkv_bias=weight(qkv) if s.qkv_bias else None,
                            o=weight(s.hidden, s.q_dim), ffn_norm=torch.ones(s.hidden, device="cuda",
                                                                             dtype=torch.float16),
                            gate_up=weight(2 * s.ffn, s.hidden), down=weight(s.hidden, s.ffn))
                       for _ in range(s.n_layers)]
        positions = max(CONTEXT, max_tokens)
        inv = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2, device="cuda", dtype=torch.float32)
                                      / s.head_dim))
        angles = torch.outer(torch.arange(positions, device="cuda", dtype=torch.float32), inv)
        self.cos, self.sin = angles.cos().half(), angles.sin().half()
        # decode rows attend over CONTEXT positions; the prefill row's cache holds its chunk
        self.caches = {rows: tuple(torch.empty((s.n_layers, rows, s.n_kv_heads, length, s.head_dim), device="cuda",
                                               dtype=torch.float16).normal_(generator=g) for _ in range(2))
                       for rows, length in ((max_batch, CONTEXT), (1, max_tokens))}

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, heads, T, D]; half-split pairs (NEOX), positions [T]."""
        cos, sin = self.cos[positions], self.sin[positions]
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """ids [B, T] at positions start.. start+T-1 (static); greedy next tokens [B]."""
        s = self.s
        B, T = ids.shape
        positions = torch.arange(start, start + T, device="cuda")
        end = start + T
        group = s.n_heads // s.n_kv_heads
        h = F.embedding(ids, self.embedding)
        for i, w in enumerate(self.layers):
            x = F.rms_norm(h, (s.hidden,), w["attn_norm"], self.eps)
            qkv = F.linear(x, w["qkv"], w["qkv_bias"])
            q, k, v = qkv.split((s.q_dim, s.kv_dim, s.kv_dim), dim=-1)
            q = self._rope(q.view(B, T, s.n_heads, s.head_dim).transpose(1, 2), positions)
            k = self._rope(k.view(B, T, s.n_kv_heads, s.head_dim).transpose(1, 2), positions)
            v = v.view(B, T, s.n_kv_heads, s.head_dim).transpose(1, 2)
            k_all, v_all = self.caches[1 if T > 1 else max(self.caches)]
            k_cache, v_cache = k_all[i, :B], v_all[i, :B]
            k_cache[:, :, start:end] = k
            v_cache[:, :, start:end] = v
            if T == 1:      # decode: a KV head's query heads as its query rows, every position valid
                out = F.scaled_dot_product_attention(q.reshape(B, s.n_kv_heads, group, s.head_dim),
                                                     k_cache[:, :, :end], v_cache[:, :, :end])
                out = out.reshape(B, 1, s.q_dim)
            else:           # prefill from position 0: causal over the chunk
                out = F.scaled_dot_product_attention(q, k_cache[:, :, :end], v_cache[:, :, :end], is_causal=True,
                                                     enable_gqa=True)
                out = out.transpose(1, 2).reshape(B, T, s.q_dim)
            h = h + F.linear(out, w["o"])
            x = F.rms_norm(h, (s.hidden,), w["ffn_norm"], self.eps)
            gate, up = F.linear(x, w["gate_up"]).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, w["down"])
        last = F.rms_norm(h[:, -1], (s.hidden,), self.final_norm, self.eps)
        return torch.argmax(F.linear(last, self.head), dim=-1)


def decode_us(model: Decoder, batch: int) -> float:
    ids = torch.randint(0, model.s.vocab, (batch, 1), device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            model.forward(ids, CONTEXT - 1)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model.forward(ids, CONTEXT - 1)
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    end.synchronize()
    del graph
    return start.elapsed_time(end) * 1e3 / REPLAYS


def prefill_us(model: Decoder, tokens: int) -> float:
    ids = torch.randint(0, model.s.vocab, (1, tokens), device="cuda")
    for _ in range(2):
        model.forward(ids, 0)
    samples = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        model.forward(ids, 0)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--layout", action="append", default=None)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = True
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "copy_GBps": round(copy_gbps(), 1), "fp16_tflops": round(gemm_tflops(), 1),
                              "context": CONTEXT, "rows": []}
    print(f"{report['device']}: copy {report['copy_GBps']} GB/s, fp16 {report['fp16_tflops']} TFLOP/s", flush=True)
    for layout in args.layout or LAYOUTS:
        shape = HFLayout.open(LAYOUT_DIR / f"{layout}.json", seed=None).shape
        model = Decoder(shape, max(DECODE_BATCHES), max(PREFILL_TOKENS))
        with torch.inference_mode():
            for batch in DECODE_BATCHES:
                us = decode_us(model, batch)
                report["rows"].append({"layout": layout, "phase": "decode", "batch": batch, "us": round(us, 2),
                                       "tokens_per_s": round(batch / (us * 1e-6), 1)})
                print(json.dumps(report["rows"][-1]), flush=True)
            for tokens in PREFILL_TOKENS:
                us = prefill_us(model, tokens)
                report["rows"].append({"layout": layout, "phase": "prefill", "tokens": tokens, "us": round(us, 2),
                                       "tokens_per_s": round(tokens / (us * 1e-6), 1)})
                print(json.dumps(report["rows"][-1]), flush=True)
        del model
        torch.cuda.empty_cache()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
