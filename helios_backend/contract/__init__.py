"""The prepared model contract: decoding, validation and the typed view.

Public API:
    PreparedContract.decode(contract, manifest, *, resource_ids=None) -> PreparedContract
    ContractError(field, reason)        a ValueError whose message starts with the field
    contract_from_json(text) -> ServingContract   (unknown fields rejected, naming them)
    contract_to_json(contract) -> str
    SUPPORTED_VERSIONS, CURRENT_VERSION
docs/contract.md says what versions 1, 2 and 3 carry and every cross-check.
"""
from . import views
from .errors import ContractError
from .json_codec import contract_from_json, contract_to_json
from .prepared import PreparedContract
from .versions import CURRENT_VERSION, SUPPORTED_VERSIONS

__all__ = [
    "CURRENT_VERSION", "ContractError", "PreparedContract", "SUPPORTED_VERSIONS",
    "contract_from_json", "contract_to_json", "views",
]
