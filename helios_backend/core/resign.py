"""Re-signing: a publisher signs an existing core under its own key (and namespace).

The source is verified completely first (a publisher signs only what it checked);
then the signed envelope is rebuilt around the same resources and the data section
is copied byte for byte: resource offsets count from the data section, so they hold.
"""
from __future__ import annotations

import os
import pathlib
import shutil
from collections.abc import Callable

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from helios_proto import contract_pb2, core_pb2

from .constants import CHUNK_NBYTES, LOGICAL_MAGIC, PAYLOAD_MAGIC, PAYLOAD_SIGNING_TAG, logical_signing_tag
from .errors import CoreFormatError
from .layout import read_header, write_header
from .reader import open_core
from .signing import sign


def resign_core(
    source: str | os.PathLike[str],
    target: str | os.PathLike[str],
    *,
    signing_key: Ed25519PrivateKey,
    namespace: str | None = None,
    content_key: bytes | None = None,
    edit_contract: Callable[[contract_pb2.ServingContract], None] | None = None,
) -> None:
    """Verify `source`, then write `target` signed by `signing_key` (namespace kept unless given).

    `edit_contract` may change the signed contract in place before signing (derived cores,
    ignition/variants.py); resources are never touched."""
    with open_core(source, content_key=content_key) as core:
        core.verify()
    fd = os.open(source, os.O_RDONLY)
    try:
        magic, header, data_offset = read_header(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    if magic == PAYLOAD_MAGIC:
        core_body = core_pb2.CoreBody.FromString(header)
        body = core_pb2.DeploymentBody.FromString(core_body.payload.body)
        if namespace is not None:
            body.publisher_namespace = namespace
        if edit_contract is not None:
            edit_contract(body.contract)
        body_bytes = body.SerializeToString(deterministic=True)
        signature, public_key = sign(signing_key, PAYLOAD_SIGNING_TAG, body_bytes)
        core_body.payload.CopyFrom(core_pb2.SignedPayload(body=body_bytes, signature=signature, public_key=public_key))
        new_header = core_body.SerializeToString(deterministic=True)
    elif magic == LOGICAL_MAGIC:
        protected = core_pb2.ProtectedIndex.FromString(header)
        index = core_pb2.ModelIndex.FromString(protected.index)
        if namespace is not None:
            index.publisher_namespace = namespace
        if edit_contract is not None:
            edit_contract(index.contract)
        index_bytes = index.SerializeToString(deterministic=True)
        signature, public_key = sign(signing_key, logical_signing_tag(protected.version), index_bytes)
        protected.index, protected.signature, protected.public_key = index_bytes, signature, public_key
        new_header = protected.SerializeToString(deterministic=True)
    else:  # the file changed since it was verified
        raise CoreFormatError("not a Helios core (unknown magic)")
    out_path = pathlib.Path(target)
    tmp = out_path.with_name(out_path.name + ".tmp")
    try:
        with open(tmp, "wb") as out, open(source, "rb") as data:
            write_header(out, magic, new_header)
            data.seek(data_offset)
            shutil.copyfileobj(data, out, CHUNK_NBYTES)
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
