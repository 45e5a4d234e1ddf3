"""Publisher keys: Ed25519 private keys stored as unencrypted PKCS#8 PEM (mode 0600).

Default location: $HELIOS_HOME/keys/publisher.ed25519.pem, or
~/.local/share/helios/keys/publisher.ed25519.pem when HELIOS_HOME is unset.
"""
from __future__ import annotations

import os
import pathlib

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .errors import CoreError

KEY_FILENAME = "publisher.ed25519.pem"


class PublisherKeyError(CoreError):
    """A publisher key file exists but is not an Ed25519 private key."""


def default_key_path() -> pathlib.Path:
    """Where the publisher key lives when no path is given."""
    home = os.environ.get("HELIOS_HOME")
    base = pathlib.Path(home) if home else pathlib.Path.home() / ".local" / "share" / "helios"
    return base / "keys" / KEY_FILENAME


def load_private_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    """Load an Ed25519 private key from a PEM file."""
    data = pathlib.Path(path).read_bytes()
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise PublisherKeyError(f"{path}: not an unencrypted PEM private key: {exc}") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise PublisherKeyError(f"{path}: not an Ed25519 key")
    return key


def create_publisher_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    """Create a new key at `path` (refusing to overwrite one)."""
    target = pathlib.Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(pem)
    return key


def load_or_create_publisher_key(path: str | os.PathLike[str] | None = None) -> Ed25519PrivateKey:
    """The publisher's signing key at `path` (default: default_key_path()), created on first use."""
    target = pathlib.Path(path) if path is not None else default_key_path()
    if target.exists():
        return load_private_key(target)
    try:
        return create_publisher_key(target)
    except FileExistsError:  # another process created it meanwhile
        return load_private_key(target)


def public_key_bytes(key: Ed25519PrivateKey | Ed25519PublicKey) -> bytes:
    """The raw 32-byte Ed25519 public key of a private or public key."""
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
