"""Greedy outputs of the same prompt run under different batch compositions, compared as the field does.

A step's packed token count chooses its program: a lone 14-token prompt runs the fused kernels,
32 of them packed together (448 tokens) run the product path (f16 activations between the
layer's products; docs/kernels.md). Both are exact to their own references, but their logits
differ in the last bits, so where the two best tokens of a step are within that difference,
greedy picks may differ, and every later token with them. The comparison (vLLM's
check_logprobs_close): the two sequences agree token for token up to their first difference;
there each one's token is among the other's top alternatives with logprobs within `tolerance`
nats, and nothing after it is compared. A lane that read another lane's state would emit
tokens far outside the top alternatives, so the check still fails on mixed-up lanes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class Divergence:
    """Where two greedy runs of one prompt part: the position and both tokens."""

    position: int
    left: int
    right: int


def first_divergence(left_tokens: Sequence[int], right_tokens: Sequence[int],
                     left_top: Sequence[Sequence[int]], left_top_logprobs: Sequence[Sequence[float]],
                     right_top: Sequence[Sequence[int]], right_top_logprobs: Sequence[Sequence[float]],
                     tolerance: float = 0.05) -> Optional[Divergence]:
    """None where the runs agree token for token; else their first difference, asserted to be a
    near-tie in both runs' distributions (module docstring)."""
    for i, (a, b) in enumerate(zip(left_tokens, right_tokens)):
        if a == b:
            continue
        for name, ids, logprobs in (("left", left_top[i], left_top_logprobs[i]),
                                    ("right", right_top[i], right_top_logprobs[i])):
            ranked = dict(zip(ids, logprobs))
            assert a in ranked and b in ranked, (
                f"position {i}: tokens {a} and {b} are not both among the {name} run's top "
                f"alternatives {list(ids)}: not a near-tie")
            assert abs(ranked[a] - ranked[b]) <= tolerance, (
                f"position {i}: the {name} run ranks {a} at {ranked[a]:.4f} and {b} at {ranked[b]:.4f}, "
                f"further apart than {tolerance} nats")
        return Divergence(i, a, b)
    assert len(left_tokens) == len(right_tokens), (
        f"the runs agree on {min(len(left_tokens), len(right_tokens))} tokens, then one stops early")
    return None
