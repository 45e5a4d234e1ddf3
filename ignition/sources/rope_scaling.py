"""RoPE scaling as a Hugging Face config.json declares it (`rope_scaling`), applied at preparation.

The prepared core stores the cos/sin table (helios_backend/kernel_abi/rope.py), so a scaling
is nothing but other inverse frequencies in that table; no kernel knows about it.

  * `linear`: positions divided by `factor`, i.e. every inverse frequency divided by it;
  * `llama3` (Llama 3.1 / 3.2 / 3.3): with wavelength 2 pi / f and L =
    `original_max_position_embeddings`, frequencies of wavelength above L / low_freq_factor are
    divided by `factor`, those below L / high_freq_factor stay, and the band between blends the
    two with s = (L / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor):
    f' = (1 - s) f / factor + s f;
  * `dynamic` (NTK-aware): for a sequence of length n > L the base becomes
    theta * ((factor n / L) - (factor - 1))^(d / (d - 2)). Hugging Face recomputes it as the
    sequence grows; a prepared core has one fixed table, so it is resolved once at the core's
    context capacity n = context_tokens (no change when that is at most L). A core prepared
    with a context beyond L therefore rotates short prompts by the frequencies of its full
    capacity, as a Hugging Face model does once its sequence has reached that length.
    L is `original_max_position_embeddings` when given, else `max_position_embeddings`.

`rope_scaling` absent, null or of type `default` means no scaling; any other type is a
preparation error naming the field (never silently ignored: its positions would be wrong).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from helios_backend.kernel_abi.rope import inverse_frequencies

KINDS = ("dynamic", "linear", "llama3")


class RopeScalingError(ValueError):
    """A rope_scaling declaration this preparation cannot apply (the message names the field)."""


@dataclass(frozen=True)
class RopeScaling:
    kind: str                       # one of KINDS
    factor: float
    original_context: int           # L: the context the checkpoint was trained for
    low_freq_factor: float = 1.0    # llama3
    high_freq_factor: float = 4.0   # llama3

    @classmethod
    def from_config(cls, config: Mapping[str, Any], where: str = "config.json") -> "RopeScaling | None":
        """The scaling `config["rope_scaling"]` declares, None for none; RopeScalingError names
        the field (`where`: the file, for the message) when it cannot be applied."""
        declared = config.get("rope_scaling")
        if declared is None:
            return None
        if not isinstance(declared, Mapping):
            raise RopeScalingError(f"{where}: rope_scaling must be an object, not {declared!r}")
        kind = declared.get("rope_type", declared.get("type"))
        if kind in (None, "default"):
            return None
        if kind not in KINDS:
            raise RopeScalingError(f"{where}: rope_scaling.rope_type {kind!r} is not supported; "
                                   f"supported: {', '.join(KINDS)} (or no rope_scaling)")

        def number(key: str, default: float | None = None) -> float:
            value = declared.get(key, default)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise RopeScalingError(f"{where}: rope_scaling.{key} must be a positive number for "
                                       f"rope_type {kind!r}, not {value!r}")
            return float(value)

        factor = number("factor")
        if kind == "llama3":
            low, high = number("low_freq_factor"), number("high_freq_factor")
            if high <= low:
                raise RopeScalingError(f"{where}: rope_scaling.high_freq_factor must exceed low_freq_factor")
            return cls(kind, factor, int(number("original_max_position_embeddings")), low, high)
        original = declared.get("original_max_position_embeddings", config.get("max_position_embeddings"))
        if kind == "dynamic" and original is None:
            raise RopeScalingError(f"{where}: rope_scaling of rope_type 'dynamic' needs "
                                   "original_max_position_embeddings or max_position_embeddings")
        return cls(kind, factor, int(original or 0))

    def inverse_frequencies(self, head_dim: int, theta: float, context_tokens: int) -> np.ndarray:
        """The scaled inverse frequencies [head_dim / 2] (float64) of a core of `context_tokens`."""
        if self.kind == "dynamic":
            if context_tokens <= self.original_context:
                return inverse_frequencies(head_dim, theta)
            growth = self.factor * context_tokens / self.original_context - (self.factor - 1)
            return inverse_frequencies(head_dim, theta * growth ** (head_dim / (head_dim - 2)))
        base = inverse_frequencies(head_dim, theta)
        if self.kind == "linear":
            return base / self.factor
        wavelength = 2 * np.pi / base
        blend = (self.original_context / wavelength - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor)
        low = wavelength > self.original_context / self.low_freq_factor     # long waves: scaled
        high = wavelength < self.original_context / self.high_freq_factor   # short waves: kept
        blended = (1 - blend) * base / self.factor + blend * base
        return np.where(low, base / self.factor, np.where(high, base, blended))
