"""Slot generations: which assignment of a physical request slot a lane belongs to."""
from __future__ import annotations


class SlotGenerations:
    """A fresh generation each time a physical slot is (re)assigned: packing then forgets the
    page-table entries it remembers for the slot (BND-34), and completion records name the
    assignment they answer (CACHE-15). The model owns one (NativeModel.generations) and every
    driver of it takes generations there, the scheduler and lockstep generators alike, so that
    drivers sharing a model never reuse a (slot, generation) pair."""

    def __init__(self, slots: int) -> None:
        self._last = [0] * slots

    def next(self, slot: int) -> int:
        self._last[slot] += 1
        return self._last[slot]
