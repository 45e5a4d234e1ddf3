"""Prepared cores: the signed carriers, their integrity rules and authorization.

Public API (docs/core-format.md has the byte layout):
    ResourceInput, ResourceInfo, ResourceKind
    write_payload_core(path, *, contract, manifest, resources, namespace, signing_key, progress=None)
    write_logical_core(path, *, version, contract, manifest, resources, namespace, signing_key,
                       content_key=None, progress=None)
    open_core(path, *, content_key=None) -> Core
        Core.format, .payload_format, .namespace, .contract, .manifest, .versions, .resources,
        .verify(), .authorize(acceptance), .read_resource(id), .iter_resource(id), .close()
    load_or_create_publisher_key(path=None), public_key_bytes(key)
Errors: CoreError and its subclasses (helios_backend.core.errors).
"""
from .errors import (
    AuthorizationError,
    ContentKeyError,
    CoreError,
    CoreFormatError,
    DecodedLengthError,
    ExtraFrameError,
    FrameError,
    IntegrityError,
    ResourceNotFoundError,
    SignatureError,
    TrailingBytesError,
    TruncatedFrameError,
    UnsupportedFormatError,
    WindowTooLargeError,
)
from .keys import PublisherKeyError, default_key_path, load_or_create_publisher_key, load_private_key, public_key_bytes
from .reader import Core, open_core
from .resign import resign_core
from .resources import ResourceInfo, ResourceInput, ResourceKind
from .writer import PreEncodedFrame, write_logical_core, write_payload_core, write_payload_core_from_frames

__all__ = [
    "AuthorizationError", "ContentKeyError", "Core", "CoreError", "CoreFormatError", "DecodedLengthError",
    "ExtraFrameError", "FrameError", "IntegrityError", "PreEncodedFrame", "PublisherKeyError",
    "ResourceInfo", "ResourceInput", "ResourceKind", "ResourceNotFoundError", "SignatureError",
    "TrailingBytesError", "TruncatedFrameError", "UnsupportedFormatError", "WindowTooLargeError",
    "default_key_path", "load_or_create_publisher_key", "load_private_key", "open_core", "public_key_bytes", "resign_core",
    "write_logical_core", "write_payload_core", "write_payload_core_from_frames",
]
