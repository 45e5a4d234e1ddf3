"""A request's sampling parameters, and the per-slot vector the sampling kernels read.

INITIALIZATION copies `vector()` into the slot's sampling state (packing.SlotInitialization);
its words follow kernel_abi/state.SAMPLING_PARAMETER_FIELDS, the ABI's single statement of their
order. The scheduler's SamplingSettings adds the request's seed.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from helios_backend.kernel_abi.state import SAMPLING_PARAMETER_FIELDS


@dataclass(frozen=True)
class SamplingParameters:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # logprob records wanted for this request's tokens: the top-N alternatives (0 = only the
    # sampled token's), or -1 = none, and sampling.logprobs.v2 skips the row
    logprobs: int = 0

    def vector(self) -> np.ndarray:
        """float32 [SAMPLING_PARAMETER_WORDS]: the fields in the ABI's order."""
        return sampling_vectors((self,))[0]


def sampling_vectors(parameters: Sequence[SamplingParameters]) -> np.ndarray:
    """float32 [len(parameters), SAMPLING_PARAMETER_WORDS]: each one's vector(), built at once."""
    return np.array([[getattr(p, name) for name in SAMPLING_PARAMETER_FIELDS] for p in parameters],
                    dtype=np.float32).reshape(len(parameters), len(SAMPLING_PARAMETER_FIELDS))
