"""Typed scheduler errors. Each names the cause; none is raised with assert."""
from __future__ import annotations

from helios_proto import exchange_pb2 as ep


class SchedulerError(Exception):
    """Base class of scheduler errors."""


class AdmissionRejected(SchedulerError):
    """A request is outside the prepared capacities (or the queue is full).

    It becomes the distinct admission-rejection event; other requests go on.
    """

    def __init__(self, reason: "ep.RejectionReason.ValueType", message: str, *, limit: int = 0,
                 requested: int = 0) -> None:
        super().__init__(message)
        self.reason = reason
        self.limit = limit
        self.requested = requested


class InvalidSpecError(SchedulerError):
    """A malformed request (a field the gateway should have refused)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class CompletionMismatch(SchedulerError):
    """A completion record disagrees with what was submitted (CACHE-13..18).

    The round's lanes fail with an execution failure; nothing is published.
    """


class ConfigurationError(SchedulerError):
    """The prepared contract cannot be scheduled (missing variant, bad geometry)."""
