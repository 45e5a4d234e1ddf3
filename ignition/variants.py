"""Variant cores: an already-prepared core with other frontend syntax data, without re-preparing.

    derive_variant_core(base_core, out, variant_frontend(variant), signing_key, served_id=...)

Preparing a core from the GGUF is slow; a syntax variant (ignition/recipes/syntax_variants.py)
differs from its base only in the contract's frontend syntax data. So the base core is opened and
verified completely (helios_backend.core.open_core / Core.verify: every chunk digest, frame and
the signature), the signed contract's syntax fields are replaced, and the header is re-signed
around the data section copied byte for byte, exactly as `resign_core` does (resource offsets
count from the data section, so every resource, its commitments and location stay valid).

What is replaced (FrontendContract): tool_parser, reasoning_parser, tool_syntax,
reasoning_syntax, prefix_rules; optionally the served id (and its aliases). Everything else of
the frontend (tokenizer and chat-template resource ids, template tokens, image settings) is the
base core's, so the variant can only name resources the core holds.
"""
from __future__ import annotations

import os
import pathlib
import shutil
from collections.abc import Sequence

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from helios_backend.core import CoreFormatError, open_core
from helios_backend.core.constants import CHUNK_NBYTES, LOGICAL_MAGIC, PAYLOAD_MAGIC, PAYLOAD_SIGNING_TAG, logical_signing_tag
from helios_backend.core.layout import read_header, write_header
from helios_backend.core.signing import sign
from helios_proto import contract_pb2, core_pb2

# The syntax data of a FrontendContract: the fields a syntax variant may change.
SYNTAX_FIELDS = ("tool_parser", "reasoning_parser", "tool_syntax", "reasoning_syntax", "prefix_rules")


def replace_frontend_syntax(contract: contract_pb2.ServingContract, frontend: contract_pb2.FrontendContract, *,
                            served_id: str | None = None, aliases: Sequence[str] = ()) -> None:
    """Copy `frontend`'s syntax fields into `contract` (in place); the rest stays the base's."""
    target = contract.model.frontend
    for field in SYNTAX_FIELDS:
        target.ClearField(field)
    for field in SYNTAX_FIELDS:
        if field == "prefix_rules":
            target.prefix_rules.extend(frontend.prefix_rules)
        elif field in ("tool_syntax", "reasoning_syntax"):
            if frontend.HasField(field):
                getattr(target, field).CopyFrom(getattr(frontend, field))
        else:
            setattr(target, field, getattr(frontend, field))
    if served_id is not None:
        contract.served_id = served_id
        del contract.aliases[:]
        contract.aliases.extend(aliases)


def derive_variant_core(base_core_path: str | os.PathLike[str], out_path: str | os.PathLike[str],
                        frontend: contract_pb2.FrontendContract, signing_key: Ed25519PrivateKey, *,
                        served_id: str | None = None, aliases: Sequence[str] = (),
                        content_key: bytes | None = None) -> pathlib.Path:
    """Write `out_path`: the verified base core with `frontend`'s syntax data, newly signed.

    The base is verified before anything is read from it (a corrupt or tampered base raises the
    reader's CoreError and nothing is written); the data section is copied verbatim, so every
    resource is byte-for-byte the base's. The namespace is kept. Returns `out_path`.
    """
    with open_core(base_core_path, content_key=content_key) as core:
        core.verify()
    fd = os.open(base_core_path, os.O_RDONLY)
    try:
        magic, header, data_offset = read_header(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    if magic == PAYLOAD_MAGIC:
        core_body = core_pb2.CoreBody.FromString(header)
        body = core_pb2.DeploymentBody.FromString(core_body.payload.body)
        replace_frontend_syntax(body.contract, frontend, served_id=served_id, aliases=aliases)
        body_bytes = body.SerializeToString(deterministic=True)
        signature, public_key = sign(signing_key, PAYLOAD_SIGNING_TAG, body_bytes)
        core_body.payload.CopyFrom(core_pb2.SignedPayload(body=body_bytes, signature=signature, public_key=public_key))
        new_header = core_body.SerializeToString(deterministic=True)
    elif magic == LOGICAL_MAGIC:
        protected = core_pb2.ProtectedIndex.FromString(header)
        index = core_pb2.ModelIndex.FromString(protected.index)
        replace_frontend_syntax(index.contract, frontend, served_id=served_id, aliases=aliases)
        index_bytes = index.SerializeToString(deterministic=True)
        signature, public_key = sign(signing_key, logical_signing_tag(protected.version), index_bytes)
        protected.index, protected.signature, protected.public_key = index_bytes, signature, public_key
        new_header = protected.SerializeToString(deterministic=True)
    else:  # the file changed since it was verified
        raise CoreFormatError("not a Helios core (unknown magic)")
    out = pathlib.Path(out_path)
    tmp = out.with_name(out.name + ".tmp")
    try:
        with open(tmp, "wb") as sink, open(base_core_path, "rb") as source:
            write_header(sink, magic, new_header)
            source.seek(data_offset)
            shutil.copyfileobj(source, sink, CHUNK_NBYTES)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out
