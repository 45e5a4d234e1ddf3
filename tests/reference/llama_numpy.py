"""An independent plain-numpy float32 Llama forward, read straight from a GGUF: the logits oracle.

Deliberately shares no code with the engine or with `ignition.sources`: it opens the file with the
`gguf` package itself, dequantizes, and runs the textbook Llama block (RMSNorm, GQA attention with
RoPE, SwiGLU, tied or separate output). If the engine and this file agree, two separate readings
of the GGUF agree.

Q/K/V biases are read when the file has them (`blk.N.attn_q.bias`, the Qwen2 family's published
layout) and added right after the projections, before RoPE.

RoPE pairing: GGUF stores q/k rows permuted by llama.cpp's converter so that RoPE rotates
ADJACENT pairs (2i, 2i+1) of each head (`RopePairing.ADJACENT`, the correct choice here).
`RopePairing.HALF_SPLIT` rotates (i, i + head_dim/2) ("rotate_half", HF layout) on the same
weights; that is the classic bug, kept selectable so tests can show it changes the answer.

Shapes: ids [T] int; activations [T, hidden]; q [H, T, hd]; KV cache [L, KV, max_context, hd].
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from threadpoolctl import threadpool_limits


class RopePairing(enum.Enum):
    ADJACENT = "adjacent"  # (2i, 2i+1): llama.cpp NORM rope, matches GGUF's permuted q/k
    HALF_SPLIT = "half_split"  # (i, i+hd/2): HF rotate_half; wrong for GGUF weights as stored


@dataclass(frozen=True)
class _Config:
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    rope_theta: float
    eps: float


@dataclass(frozen=True)
class _Layer:
    attn_norm: np.ndarray  # [hidden]
    wq_t: np.ndarray  # [hidden, H*hd]   (transposed so that x @ w)
    wk_t: np.ndarray  # [hidden, KV*hd]
    wv_t: np.ndarray  # [hidden, KV*hd]
    wo_t: np.ndarray  # [H*hd, hidden]
    ffn_norm: np.ndarray  # [hidden]
    w_gate_t: np.ndarray  # [hidden, ffn]
    w_up_t: np.ndarray  # [hidden, ffn]
    w_down_t: np.ndarray  # [ffn, hidden]
    bq: np.ndarray | None = None  # [H*hd] q/k/v biases (Qwen2 family: added after the projection)
    bk: np.ndarray | None = None
    bv: np.ndarray | None = None


@dataclass(frozen=True)
class _Weights:
    embed: np.ndarray  # [V, hidden]
    output_t: np.ndarray  # [hidden, V] (the embedding transposed when tied)
    output_norm: np.ndarray  # [hidden]
    layers: tuple[_Layer, ...]


_BIASES = ("bq", "bk", "bv")   # kept f32 by engines too (key biases reach |145|)


def _scalar(reader: GGUFReader, key: str) -> float:
    return reader.fields[key].contents()


def _read(path: Path) -> tuple[_Config, _Weights]:
    r = GGUFReader(path)
    arch = r.fields["general.architecture"].contents()
    hidden = int(_scalar(r, f"{arch}.embedding_length"))
    n_heads = int(_scalar(r, f"{arch}.attention.head_count"))
    cfg = _Config(
        n_layers=int(_scalar(r, f"{arch}.block_count")),
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=int(_scalar(r, f"{arch}.attention.head_count_kv")),
        head_dim=hidden // n_heads,
        vocab=len(r.fields["tokenizer.ggml.tokens"].data),
        rope_theta=float(_scalar(r, f"{arch}.rope.freq_base")),
        eps=float(_scalar(r, f"{arch}.attention.layer_norm_rms_epsilon")),
    )
    raw = {t.name: t for t in r.tensors}

    def w(name: str) -> np.ndarray:
        t = raw[name]
        shape = tuple(int(d) for d in reversed(t.shape))  # (out, in)
        return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)

    def wt(name: str) -> np.ndarray:
        return np.ascontiguousarray(w(name).T)

    layers = tuple(
        _Layer(
            attn_norm=w(f"blk.{i}.attn_norm.weight"),
            wq_t=wt(f"blk.{i}.attn_q.weight"),
            wk_t=wt(f"blk.{i}.attn_k.weight"),
            wv_t=wt(f"blk.{i}.attn_v.weight"),
            wo_t=wt(f"blk.{i}.attn_output.weight"),
            ffn_norm=w(f"blk.{i}.ffn_norm.weight"),
            w_gate_t=wt(f"blk.{i}.ffn_gate.weight"),
            w_up_t=wt(f"blk.{i}.ffn_up.weight"),
            w_down_t=wt(f"blk.{i}.ffn_down.weight"),
            **{name: w(f"blk.{i}.attn_{name[1]}.bias") for name in ("bq", "bk", "bv")
               if f"blk.{i}.attn_{name[1]}.bias" in raw},
        )
        for i in range(cfg.n_layers)
    )
    embed = w("token_embd.weight")
    output_t = wt("output.weight") if "output.weight" in raw else np.ascontiguousarray(embed.T)
    return cfg, _Weights(embed, output_t, w("output_norm.weight"), layers)


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight


def _rope(x: np.ndarray, positions: np.ndarray, theta: float, pairing: RopePairing) -> np.ndarray:
    """x: [heads, T, hd]; positions: [T]."""
    hd = x.shape[-1]
    inv_freq = theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)  # [hd/2]
    angle = positions[:, None].astype(np.float64) * inv_freq[None, :]  # [T, hd/2]
    cos, sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
    out = np.empty_like(x)
    if pairing is RopePairing.ADJACENT:
        a, b = x[..., 0::2], x[..., 1::2]
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = a * sin + b * cos
    else:
        a, b = x[..., : hd // 2], x[..., hd // 2 :]
        out[..., : hd // 2] = a * cos - b * sin
        out[..., hd // 2 :] = a * sin + b * cos
    return out


class ReferenceLlama:
    """Plain-numpy Llama with a per-instance KV cache. `forward` appends to the cache."""

    def __init__(self, cfg: _Config, weights: _Weights, rope_pairing: RopePairing, max_context: int) -> None:
        self.cfg = cfg
        self._w = weights
        self.rope_pairing = rope_pairing
        self.max_context = max_context
        kv_shape = (cfg.n_layers, cfg.n_kv_heads, max_context, cfg.head_dim)
        self._k_cache = np.zeros(kv_shape, dtype=np.float32)
        self._v_cache = np.zeros(kv_shape, dtype=np.float32)

    @classmethod
    def load(
        cls,
        path: str | Path,
        rope_pairing: RopePairing = RopePairing.ADJACENT,
        max_context: int = 1024,
    ) -> "ReferenceLlama":
        cfg, weights = _read(Path(path))
        return cls(cfg, weights, rope_pairing, max_context)

    def with_rope_pairing(self, rope_pairing: RopePairing) -> "ReferenceLlama":
        """Another oracle sharing these weights (not the cache), with a different pairing."""
        return ReferenceLlama(self.cfg, self._w, rope_pairing, self.max_context)

    def with_weights_rounded(self, dtype: type = np.float16) -> "ReferenceLlama":
        """An oracle whose weights are rounded through `dtype` (compute stays float32).

        For comparing an engine that stores weights in fp16: the same weight values, so any
        remaining logit difference comes from the engine's arithmetic.
        """

        def rounded(a: np.ndarray) -> np.ndarray:
            return a.astype(dtype).astype(np.float32)

        layers = tuple(
            _Layer(**{name: rounded(getattr(layer, name)) if name not in _BIASES else getattr(layer, name)
                      for name in _Layer.__dataclass_fields__})
            for layer in self._w.layers
        )
        weights = _Weights(rounded(self._w.embed), rounded(self._w.output_t), rounded(self._w.output_norm), layers)
        return ReferenceLlama(self.cfg, weights, self.rope_pairing, self.max_context)

    def with_half_split_qk(self) -> "ReferenceLlama":
        """An oracle whose q/k rows are un-permuted back to HF order, using HALF_SPLIT pairing.

        If the GGUF permutation fact holds, its logits equal this (ADJACENT) oracle's.
        """
        c = self.cfg

        def unpermute(w_t: np.ndarray, n_head: int) -> np.ndarray:
            w = w_t.T  # (out, in); rows of each head are (pair i, member j) -> (member j, pair i)
            hd = c.head_dim
            w = w.reshape(n_head, hd // 2, 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)
            return np.ascontiguousarray(w.T)

        layers = tuple(
            replace(layer, wq_t=unpermute(layer.wq_t, c.n_heads), wk_t=unpermute(layer.wk_t, c.n_kv_heads))
            for layer in self._w.layers
        )
        return ReferenceLlama(c, replace(self._w, layers=layers), RopePairing.HALF_SPLIT, self.max_context)

    def forward(self, ids: Sequence[int], start_pos: int) -> np.ndarray:
        """Logits [T, V] float32 for tokens `ids` at positions start_pos..start_pos+T-1.

        Positions before start_pos must already be in the cache (from earlier calls).
        """
        with threadpool_limits(1):  # 2-thread OpenBLAS is slower and erratic on small GEMMs
            return self._forward(np.asarray(ids, dtype=np.int64), start_pos)

    def _forward(self, ids: np.ndarray, p0: int) -> np.ndarray:
        c = self.cfg
        T, H, KV, hd = len(ids), c.n_heads, c.n_kv_heads, c.head_dim
        S = p0 + T
        if S > self.max_context:
            raise ValueError(f"positions up to {S} exceed max_context {self.max_context}")
        G = H // KV
        scale = float(1.0 / np.sqrt(hd))  # Python float keeps float32 arithmetic float32
        positions = np.arange(p0, S)
        # causal mask over the visible keys [0, S): query t sees keys <= p0 + t
        mask = np.triu(np.full((T, S), -np.inf, dtype=np.float32), k=p0 + 1)
        x = self._w.embed[ids]  # [T, hidden]
        for i, layer in enumerate(self._w.layers):
            h = _rms_norm(x, layer.attn_norm, c.eps)
            q, k, v = h @ layer.wq_t, h @ layer.wk_t, h @ layer.wv_t
            if layer.bq is not None:
                q, k, v = q + layer.bq, k + layer.bk, v + layer.bv
            q = q.reshape(T, H, hd).transpose(1, 0, 2)  # [H, T, hd]
            k = k.reshape(T, KV, hd).transpose(1, 0, 2)  # [KV, T, hd]
            v = v.reshape(T, KV, hd).transpose(1, 0, 2)
            q = _rope(q, positions, c.rope_theta, self.rope_pairing)
            k = _rope(k, positions, c.rope_theta, self.rope_pairing)
            self._k_cache[i, :, p0:S] = k
            self._v_cache[i, :, p0:S] = v
            keys = self._k_cache[i, :, :S]  # [KV, S, hd]
            values = self._v_cache[i, :, :S]
            # query head j uses KV head j // G
            qg = q.reshape(KV, G, T, hd)
            scores = np.einsum("kgtd,ksd->kgts", qg, keys) * scale + mask  # [KV, G, T, S]
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            scores /= scores.sum(-1, keepdims=True)
            attn = np.einsum("kgts,ksd->kgtd", scores, values).reshape(H, T, hd)
            x = x + attn.transpose(1, 0, 2).reshape(T, H * hd) @ layer.wo_t
            h = _rms_norm(x, layer.ffn_norm, c.eps)
            gate = h @ layer.w_gate_t
            up = h @ layer.w_up_t
            x = x + (gate / (1.0 + np.exp(-gate)) * up) @ layer.w_down_t
        logits = _rms_norm(x, self._w.output_norm, c.eps) @ self._w.output_t
        if logits.dtype != np.float32:
            raise TypeError(f"reference forward drifted to {logits.dtype}")
        return logits

    def greedy(self, prompt: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = ()) -> list[int]:
        """Greedy continuation from position 0 (the cache is overwritten); stops after a stop id."""
        logits = self.forward(prompt, 0)[-1]
        pos = len(prompt)
        out: list[int] = []
        for _ in range(max_new_tokens):
            token = int(np.argmax(logits))
            out.append(token)
            if token in stop_ids:
                break
            logits = self.forward([token], pos)[-1]
            pos += 1
        return out
