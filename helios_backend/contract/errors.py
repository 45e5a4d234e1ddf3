"""The one error type of contract decoding."""
from __future__ import annotations


class ContractError(ValueError):
    """A prepared contract is malformed or inconsistent.

    `field` is a path into the ServingContract / ExecutionManifest (for example
    "model.graphs[2].bindings[0].destination"); `reason` says what is wrong.
    The message always starts with the field, so logs name it.
    """

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason
