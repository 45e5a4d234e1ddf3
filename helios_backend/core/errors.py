"""Typed errors of the core reader and writer.

Every rejection the core format names is one subclass of CoreError, so callers can
tell a tampered file from a wrong namespace without reading message text.
CoreError is a ValueError: a bad core is bad input, never a programming error.
"""
from __future__ import annotations


class CoreError(ValueError):
    """Base class of every core format, integrity and authorization failure."""


class CoreFormatError(CoreError):
    """The file is not a core of a supported carrier, or its layout is inconsistent."""


class UnsupportedFormatError(CoreFormatError):
    """A payload format or ProtectedIndex version this reader does not know."""


class IntegrityError(CoreError):
    """Stored bytes do not match their signed commitments (chunk digest, length)."""


class FrameError(IntegrityError):
    """A resource's stored bytes are not exactly one acceptable zstd frame."""


class TruncatedFrameError(FrameError):
    """The zstd frame ends before its last block (or checksum)."""


class ExtraFrameError(FrameError):
    """Another (zstd or skippable) frame follows the one resource frame."""


class TrailingBytesError(FrameError):
    """Bytes that are not a frame follow the one resource frame."""


class WindowTooLargeError(FrameError):
    """The frame needs a decoder window larger than the 8 MiB cap."""


class DecodedLengthError(FrameError):
    """The decoded length differs from the signed decoded length."""


class SignatureError(CoreError):
    """The Ed25519 signature over the signed envelope does not verify."""


class AuthorizationError(CoreError):
    """The acceptance string is not exactly the signed publisher namespace."""


class ResourceNotFoundError(CoreError, KeyError):
    """No resource with that id is in the core."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class ContentKeyError(CoreError):
    """A ProtectedIndex v4 resource needs a content key, or the key is the wrong one."""
