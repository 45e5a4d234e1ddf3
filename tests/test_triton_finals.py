"""The flag-only FINAL sender (helios_backend/triton/finals.py): every queued sender gets its
FINAL, in order, off the calling thread, and stop() flushes what is queued."""
from __future__ import annotations

import threading

from helios_backend.triton.finals import FinalSender

FINAL = 1


class RecordingSender:
    def __init__(self, log: list[tuple[int, int, str]], index: int, fail: bool = False) -> None:
        self._log, self._index, self._fail = log, index, fail

    def send(self, flags: int) -> None:
        if self._fail:
            raise RuntimeError("the client is gone")
        self._log.append((self._index, flags, threading.current_thread().name))


def test_every_sender_gets_its_final_in_order_after_stop() -> None:
    log: list[tuple[int, int, str]] = []
    finals = FinalSender(FINAL)
    for i in range(50):
        finals.close(RecordingSender(log, i, fail=i == 7))   # a failed send does not stop the others
    finals.stop()
    assert [i for i, _, _ in log] == [i for i in range(50) if i != 7]
    assert {flags for _, flags, _ in log} == {FINAL}
    assert {thread for _, _, thread in log} == {"helios-finals"}   # never on execute()'s thread
