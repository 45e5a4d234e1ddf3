"""The host's mirror of one executor's submission count (BND-20, CACHE-16)."""
from __future__ import annotations


class SubmissionSequence:
    """The executor numbers every submission from 0 and writes the number into its completion
    (BND-20); the host counts the same way to check each completion's sequence (CACHE-16). The
    model owns one (NativeModel.submissions) and every driver of it takes the numbers there, the
    serving runner and the lockstep generators alike, so that drivers sharing a model agree with
    its executor. Code that launches on the executor directly takes one too."""

    def __init__(self) -> None:
        self._next = 0

    def take(self) -> int:
        """The number of the submission about to be launched (counted)."""
        sequence = self._next
        self._next += 1
        return sequence

    def advance(self, launches: int) -> None:
        """Count `launches` made on the executor directly, after the fact (a benchmark's timing
        loop, where taking each number would be measured too)."""
        self._next += launches
