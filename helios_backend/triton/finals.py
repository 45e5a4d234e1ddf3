"""Flag-only FINAL responses, sent off Triton's execute() thread.

A generate request on a channel and a cancel are answered with a FINAL that carries nothing
(the output goes by the channel; a cancel has none). Each send is a synchronous IPC round
trip to the Triton process (~0.25 ms), and Triton calls execute() of an instance one call at
a time: sent inline, a wave of arriving requests queued behind one round trip each (on the
H200 at 64 clients, 8 ms mean wait for execute()). One thread sends them instead, in arrival
order, and execute() returns as soon as the request is with the engine.

Invariant: every sender handed to `close` gets its FINAL, also when `stop` is called (it
sends what is queued before it returns). A send that fails (the client is gone) is logged;
the request has nothing left to deliver.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Any

log = logging.getLogger("helios.triton")


class FinalSender:
    def __init__(self, final_flag: int) -> None:
        self._flag = final_flag
        self._queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="helios-finals", daemon=True)
        self._thread.start()

    def close(self, sender: Any) -> None:
        """Queue the flag-only FINAL of `sender`'s request."""
        self._queue.put(sender)

    def stop(self, timeout: float = 10.0) -> None:
        """Send every queued FINAL, then end the thread."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            sender = self._queue.get()
            if sender is None:
                return
            try:
                sender.send(flags=self._flag)
            except Exception as exc:   # the request's client is gone: nothing more to deliver
                log.warning("a flag-only FINAL was not delivered: %s", exc)
