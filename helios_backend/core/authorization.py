"""authorize(acceptance): exact equality with the signed publisher namespace.

No normalisation of any kind (case, whitespace, prefixes, Unicode forms): the
acceptance string records which publisher's trust and license terms the operator
accepted, and only the byte-identical namespace matches.
"""
from __future__ import annotations

from .errors import AuthorizationError


def authorize_namespace(signed_namespace: str, acceptance: str) -> None:
    """Raise AuthorizationError unless `acceptance` equals `signed_namespace` exactly."""
    if not isinstance(acceptance, str):
        raise AuthorizationError(f"acceptance must be a string, got {type(acceptance).__name__}")
    if acceptance != signed_namespace:
        raise AuthorizationError(
            f"acceptance {acceptance!r} does not equal the signed publisher namespace {signed_namespace!r}"
        )
