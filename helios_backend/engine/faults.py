"""Fault injection for the recovery tests: a crash no handler expects, at a thread's boundary.

Off unless the serving process starts with HELIOS_FAULT_TRIGGER naming a file: the server's
environment, never a request, turns it on. While on, the worker's round collection (site
"worker") and the response thread's sends (site "responses") look at that file on each call;
when it holds a site's name, the file is removed and that call raises InjectedFault. It is a
BaseException, so it passes every `except Exception` of the serving code as a real crash of the
thread would (an interpreter error, a bug outside a round's own handling), and the thread dies.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from helios_backend.scheduler.completion import CompletionRows
from helios_backend.scheduler.plan import RoundPlan

ENVIRONMENT = "HELIOS_FAULT_TRIGGER"
SITES = ("worker", "responses")


class InjectedFault(BaseException):
    """The injected crash (a BaseException: no `except Exception` handles it)."""


@dataclass(frozen=True)
class FaultTrigger:
    path: Path

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> "FaultTrigger | None":
        value = environ.get(ENVIRONMENT, "")
        return cls(Path(value)) if value else None

    def check(self, site: str) -> None:
        try:
            armed = self.path.read_text().strip()
        except OSError:
            return
        if armed == site:
            self.path.unlink(missing_ok=True)
            raise InjectedFault(f"injected fault in the {site} thread")


class FaultyRunner:
    """A RoundRunner whose collect() may raise the injected fault (the worker thread dies)."""

    def __init__(self, inner: Any, trigger: FaultTrigger) -> None:
        self._inner, self._trigger = inner, trigger

    def launch(self, plan: RoundPlan, frame: int) -> None:
        self._inner.launch(plan, frame)

    def collect(self, plan: RoundPlan) -> CompletionRows:
        self._trigger.check("worker")
        return self._inner.collect(plan)


class FaultySink:
    """A Sender or ChannelSink whose sends may raise the injected fault (the response thread dies)."""

    def __init__(self, inner: Any, trigger: FaultTrigger) -> None:
        self._inner, self._trigger = inner, trigger

    def send(self, arrays: dict[str, np.ndarray], final: bool) -> None:
        self._trigger.check("responses")
        self._inner.send(arrays, final)

    def send_batch(self, payload: bytes) -> None:
        self._trigger.check("responses")
        self._inner.send_batch(payload)

    def close(self) -> None:
        self._inner.close()

    def is_cancelled(self) -> bool:
        return bool(self._inner.is_cancelled())
