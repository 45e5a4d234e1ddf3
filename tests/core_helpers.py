"""Helpers shared by the core tests: a fixed signing key, sample cores, header surgery."""
from __future__ import annotations

import pathlib
from typing import Callable, Sequence

import zstandard
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from helios_backend.core import PreEncodedFrame, ResourceInput, ResourceKind, write_payload_core, write_payload_core_from_frames
from helios_backend.core.constants import PAYLOAD_SIGNING_TAG
from helios_backend.core.frames import new_compressor
from helios_backend.core.signing import sign
from helios_proto import core_pb2

from tests.contract_samples import sample_contract, sample_manifest

NAMESPACE = "example.org/helios-tests"
SIGNING_KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
OTHER_KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(1, 33)))


def sample_resources(weights: bytes | None = None) -> list[ResourceInput]:
    """The four resources the sample contract references."""
    return [
        ResourceInput("weights", ResourceKind.RESOURCE_KIND_WEIGHTS, weights if weights is not None else bytes(range(256)) * 64),
        ResourceInput("kernels", ResourceKind.RESOURCE_KIND_KERNEL_MODULE, b"\x7fELF fake cubin " * 16),
        ResourceInput("tokenizer", ResourceKind.RESOURCE_KIND_TOKENIZER, b'{"model": {"vocab": {}}}'),
        ResourceInput("chat_template", ResourceKind.RESOURCE_KIND_CHAT_TEMPLATE, b"{{ messages }}"),
    ]


def write_sample_core(path: pathlib.Path, resources: Sequence[ResourceInput] | None = None, version: int = 3) -> pathlib.Path:
    write_payload_core(
        path,
        contract=sample_contract(version),
        manifest=sample_manifest(version),
        resources=resources if resources is not None else sample_resources(),
        namespace=NAMESPACE,
        signing_key=SIGNING_KEY,
    )
    return path


def frame_of(data: bytes) -> bytes:
    return new_compressor().compress(data)


def big_window_frame(data: bytes) -> bytes:
    """A frame whose header asks for a 16 MiB window (content size left out)."""
    params = zstandard.ZstdCompressionParameters(window_log=24, compression_level=3)
    cobj = zstandard.ZstdCompressor(compression_params=params).compressobj()
    return cobj.compress(data) + cobj.flush()


def write_frames_core(path: pathlib.Path, frames: Sequence[PreEncodedFrame]) -> pathlib.Path:
    write_payload_core_from_frames(
        path, contract=sample_contract(3), manifest=sample_manifest(3), frames=frames,
        namespace=NAMESPACE, signing_key=SIGNING_KEY,
    )
    return path


def read_layout(path: pathlib.Path) -> tuple[bytes, core_pb2.CoreBody, bytes]:
    """(magic, CoreBody, data section) of a payload core."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[12:16], "little")
    return raw[:12], core_pb2.CoreBody.FromString(raw[16 : 16 + length]), raw[16 + length :]


def rewrite_header(path: pathlib.Path, mutate: Callable[[core_pb2.CoreBody], None]) -> None:
    """Apply `mutate` to the CoreBody and write the core back (data section unchanged)."""
    magic, body, data = read_layout(path)
    mutate(body)
    header = body.SerializeToString()
    path.write_bytes(magic + len(header).to_bytes(4, "little") + header + data)


def mutate_signed_body(
    path: pathlib.Path, mutate: Callable[[core_pb2.DeploymentBody], None], resign_with: Ed25519PrivateKey | None = None
) -> None:
    """Change the signed DeploymentBody; re-sign only when `resign_with` is given."""

    def apply(core_body: core_pb2.CoreBody) -> None:
        body = core_pb2.DeploymentBody.FromString(core_body.payload.body)
        mutate(body)
        core_body.payload.body = body.SerializeToString()
        if resign_with is not None:
            signature, public = sign(resign_with, PAYLOAD_SIGNING_TAG, core_body.payload.body)
            core_body.payload.signature = signature
            core_body.payload.public_key = public

    rewrite_header(path, apply)


def flip_byte(path: pathlib.Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


def data_offset(path: pathlib.Path) -> int:
    raw = path.read_bytes()[:16]
    return 16 + int.from_bytes(raw[12:16], "little")


def random_bytes(nbytes: int, seed: int = 0) -> bytes:
    import random

    return random.Random(seed).randbytes(nbytes)




def tampered_copy(core: pathlib.Path, target: pathlib.Path) -> pathlib.Path:
    """A copy of `core` with one byte flipped inside a resource frame (its middle)."""
    import shutil
    shutil.copy(core, target)
    with open(target, "r+b") as f:
        f.seek(target.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    return target
