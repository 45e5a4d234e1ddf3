"""An independent plain-numpy float32 Gemma 3 (text) forward, read straight from a GGUF: the oracle.

Written from the published model description (the Gemma 3 technical report and the reference
implementation's configuration), not from the recipe or the runtime: it opens the file with the
`gguf` package, dequantizes, and computes a whole sequence at once (no cache):

    x = embed[ids] * sqrt(d_model)
    per layer l:  local = (l + 1) % 6 != 0  (5 local layers : 1 global)
        h = rmsnorm(x) * attn_norm
        q, k, v = h Wq, h Wk, h Wv;  q, k = rmsnorm_per_head(q) * q_norm, rmsnorm_per_head(k) * k_norm
        q, k = rope(q, k; base 10,000 if local else the file's 1e6; rotate_half pairing)
        scores = q k^T / sqrt(query_pre_attn_scalar = head_dim), causal, and for local layers only
                 keys at most sliding_window - 1 positions back
        x = x + rmsnorm(softmax(scores) v Wo) * post_attention_norm
        h = rmsnorm(x) * ffn_norm
        x = x + rmsnorm((gelu_tanh(h Wgate) * (h Wup)) Wdown) * post_ffw_norm
    logits = (rmsnorm(x) * output_norm) embed^T

Norm weights are used as stored: the GGUF converter has already added Gemma's 1 to them.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

LOCAL_PERIOD = 6           # every 6th layer is global (Gemma 3)
LOCAL_BASE = 10_000.0      # RoPE base of the local layers


@dataclass(frozen=True)
class _Config:
    layers: int
    d_model: int
    heads: int
    kv_heads: int
    head_dim: int
    global_base: float
    window: int
    eps: float


class ReferenceGemma:
    def __init__(self, config: _Config, tensors: dict[str, np.ndarray], window_override: int | None = None) -> None:
        self.config = config
        self.t = tensors
        self.window = window_override if window_override is not None else config.window

    @classmethod
    def load(cls, path: str | Path) -> "ReferenceGemma":
        reader = GGUFReader(Path(path))

        def scalar(key: str):
            return reader.fields[key].contents()

        arch = scalar("general.architecture")
        config = _Config(layers=int(scalar(f"{arch}.block_count")), d_model=int(scalar(f"{arch}.embedding_length")),
                         heads=int(scalar(f"{arch}.attention.head_count")),
                         kv_heads=int(scalar(f"{arch}.attention.head_count_kv")),
                         head_dim=int(scalar(f"{arch}.attention.key_length")),
                         global_base=float(scalar(f"{arch}.rope.freq_base")),
                         window=int(scalar(f"{arch}.attention.sliding_window")),
                         eps=float(scalar(f"{arch}.attention.layer_norm_rms_epsilon")))
        tensors = {}
        for t in reader.tensors:
            shape = tuple(int(d) for d in reversed(t.shape))
            tensors[t.name] = np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(shape)
        return cls(config, tensors)

    def _norm(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.config.eps) * weight

    @staticmethod
    def _rope(x: np.ndarray, positions: np.ndarray, base: float) -> np.ndarray:
        """x [T, heads, hd], rotate_half pairs (i, i + hd/2)."""
        hd = x.shape[-1]
        inverse = base ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
        angle = positions[:, None].astype(np.float64) * inverse[None, :]
        cos = np.cos(angle).astype(np.float32)[:, None, :]
        sin = np.sin(angle).astype(np.float32)[:, None, :]
        a, b = x[..., :hd // 2], x[..., hd // 2:]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)

    @staticmethod
    def _gelu_tanh(x: np.ndarray) -> np.ndarray:
        return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """[T, vocab] logits of every position of `ids` (positions 0 .. T-1)."""
        c, t = self.config, self.t
        ids = np.asarray(ids, np.int64)
        T = len(ids)
        positions = np.arange(T)
        x = t["token_embd.weight"][ids] * np.float32(np.sqrt(c.d_model))
        group = c.heads // c.kv_heads
        back = positions[:, None] - positions[None, :]          # query - key
        for layer in range(c.layers):
            p = f"blk.{layer}."
            local = (layer + 1) % LOCAL_PERIOD != 0
            h = self._norm(x, t[p + "attn_norm.weight"])
            q = (h @ t[p + "attn_q.weight"].T).reshape(T, c.heads, c.head_dim)
            k = (h @ t[p + "attn_k.weight"].T).reshape(T, c.kv_heads, c.head_dim)
            v = (h @ t[p + "attn_v.weight"].T).reshape(T, c.kv_heads, c.head_dim)
            q = self._norm(q, t[p + "attn_q_norm.weight"])
            k = self._norm(k, t[p + "attn_k_norm.weight"])
            base = LOCAL_BASE if local else c.global_base
            q, k = self._rope(q, positions, base), self._rope(k, positions, base)
            hidden_keys = back < 0
            if local:
                hidden_keys |= back >= self.window
            out = np.empty((T, c.heads, c.head_dim), np.float32)
            for head in range(c.heads):
                kv = head // group
                scores = (q[:, head] @ k[:, kv].T) / np.float32(np.sqrt(c.head_dim))
                scores[hidden_keys] = -np.inf
                scores = np.exp(scores - scores.max(-1, keepdims=True))
                out[:, head] = (scores / scores.sum(-1, keepdims=True)) @ v[:, kv]
            attended = out.reshape(T, -1) @ t[p + "attn_output.weight"].T
            x = x + self._norm(attended, t[p + "post_attention_norm.weight"])
            h = self._norm(x, t[p + "ffn_norm.weight"])
            ffn = (self._gelu_tanh(h @ t[p + "ffn_gate.weight"].T) * (h @ t[p + "ffn_up.weight"].T))
            x = x + self._norm(ffn @ t[p + "ffn_down.weight"].T, t[p + "post_ffw_norm.weight"])
        return self._norm(x, t["output_norm.weight"]) @ t["token_embd.weight"].T
