"""Ed25519 signatures over domain-tagged messages."""
from __future__ import annotations

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .errors import SignatureError
from .keys import public_key_bytes

PUBLIC_KEY_NBYTES = 32
SIGNATURE_NBYTES = 64


def sign(key: Ed25519PrivateKey, tag: bytes, message: bytes) -> tuple[bytes, bytes]:
    """Sign tag || message; returns (signature, raw public key)."""
    return key.sign(tag + message), public_key_bytes(key)


def verify_signature(public_key: bytes, signature: bytes, tag: bytes, message: bytes) -> None:
    """Raise SignatureError unless `signature` is public_key's signature of tag || message."""
    if len(public_key) != PUBLIC_KEY_NBYTES:
        raise SignatureError(f"public key is {len(public_key)} bytes, expected {PUBLIC_KEY_NBYTES}")
    if len(signature) != SIGNATURE_NBYTES:
        raise SignatureError(f"signature is {len(signature)} bytes, expected {SIGNATURE_NBYTES}")
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, tag + message)
    except (InvalidSignature, ValueError) as exc:
        raise SignatureError("signature does not verify over the signed envelope") from exc
