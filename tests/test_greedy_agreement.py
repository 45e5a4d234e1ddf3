"""The near-tie comparison of greedy runs under different batch compositions fails where it must."""
from __future__ import annotations

import pytest

from tests.greedy_agreement import Divergence, first_divergence

TOP = [[5, 7, 9]] * 3


def test_identical_runs_agree() -> None:
    assert first_divergence([5, 5, 5], [5, 5, 5], TOP, [[-0.1, -2.0, -3.0]] * 3, TOP, [[-0.1, -2.0, -3.0]] * 3) is None


def test_a_near_tie_is_where_they_part() -> None:
    near = [[-0.70, -0.71, -3.0]] * 3
    assert first_divergence([5, 5, 9], [5, 7, 1], TOP, near, TOP, near) == Divergence(1, 5, 7)


@pytest.mark.parametrize("right_tokens, logprobs, message", [
    ([5, 9, 5], [[-0.1, -2.0, -3.0]] * 3, "further apart"),            # a clear winner lost
    ([5, 42, 5], [[-0.70, -0.71, -3.0]] * 3, "not both among"),         # a token outside the top: a mixed-up lane
])
def test_anything_but_a_near_tie_fails(right_tokens: list[int], logprobs: list[list[float]], message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        first_divergence([5, 5, 5], right_tokens, TOP, logprobs, TOP, logprobs)


def test_a_run_that_stops_early_fails() -> None:
    with pytest.raises(AssertionError, match="stops early"):
        first_divergence([5, 5, 5], [5, 5], TOP, [[-0.1, -2.0, -3.0]] * 3, TOP, [[-0.1, -2.0, -3.0]] * 3)
