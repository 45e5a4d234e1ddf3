"""CaptureVariant cores: an already-prepared core with other frontend syntax data, without re-preparing.

    derive_variant_core(base_core, out, variant_frontend(variant), signing_key, served_id=...)

Preparing a core from the GGUF is slow; a syntax variant (ignition/recipes/syntax_variants.py)
differs from its base only in the contract's frontend syntax data. `resign_core` does the work:
it verifies the base completely (every chunk digest, frame and the signature), lets us replace
the signed contract's syntax fields, signs the new header and copies the data section byte for
byte (resource offsets count from the data section, so every resource, its commitments and
location stay valid).

What is replaced (FrontendContract): tool_parser, reasoning_parser, tool_syntax,
reasoning_syntax, prefix_rules; optionally the served id (and its aliases). Everything else of
the frontend (tokenizer and chat-template resource ids, template tokens, image settings) is the
base core's, so the variant can only name resources the core holds.
"""
from __future__ import annotations

import functools
import os
import pathlib
from collections.abc import Sequence
from typing import Literal

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from helios_backend.core import resign_core
from helios_proto import contract_pb2

# The syntax data of a FrontendContract: the fields a syntax variant may change.
SYNTAX_FIELDS: tuple[Literal["tool_parser", "reasoning_parser", "tool_syntax", "reasoning_syntax", "prefix_rules"], ...] = (
    "tool_parser", "reasoning_parser", "tool_syntax", "reasoning_syntax", "prefix_rules")


def replace_frontend_syntax(contract: contract_pb2.ServingContract, frontend: contract_pb2.FrontendContract, *,
                            served_id: str | None = None, aliases: Sequence[str] = ()) -> None:
    """Copy `frontend`'s syntax fields into `contract` (in place); the rest stays the base's."""
    target = contract.model.frontend
    for field in SYNTAX_FIELDS:
        target.ClearField(field)
    target.tool_parser = frontend.tool_parser
    target.reasoning_parser = frontend.reasoning_parser
    if frontend.HasField("tool_syntax"):
        target.tool_syntax.CopyFrom(frontend.tool_syntax)
    if frontend.HasField("reasoning_syntax"):
        target.reasoning_syntax.CopyFrom(frontend.reasoning_syntax)
    target.prefix_rules.extend(frontend.prefix_rules)
    if served_id is not None:
        contract.served_id = served_id
        del contract.aliases[:]
        contract.aliases.extend(aliases)


def derive_variant_core(base_core_path: str | os.PathLike[str], out_path: str | os.PathLike[str],
                        frontend: contract_pb2.FrontendContract, signing_key: Ed25519PrivateKey, *,
                        served_id: str | None = None, aliases: Sequence[str] = (),
                        content_key: bytes | None = None) -> pathlib.Path:
    """Write `out_path`: the verified base core with `frontend`'s syntax data, newly signed.

    The base is verified before anything is written (a corrupt or tampered base raises the
    reader's CoreError and no target appears); every resource is byte-for-byte the base's and
    the namespace is kept. Returns `out_path`.
    """
    resign_core(base_core_path, out_path, signing_key=signing_key, content_key=content_key,
                edit_contract=functools.partial(replace_frontend_syntax, frontend=frontend, served_id=served_id,
                                                aliases=aliases))
    return pathlib.Path(out_path)
