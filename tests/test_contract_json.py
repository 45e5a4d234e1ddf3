"""The JSON form of a ServingContract: unknown semantic fields are rejected by name."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helios_backend.contract import ContractError, PreparedContract, contract_from_json, contract_to_json
from tests.contract_samples import sample_contract, sample_manifest


def _document() -> dict:
    return json.loads(contract_to_json(sample_contract(3)))


def test_json_round_trip():
    # spec: CON-14
    contract = contract_from_json(contract_to_json(sample_contract(3)))
    assert contract == sample_contract(3)
    PreparedContract.decode(contract, sample_manifest(3))


def test_camel_case_names_are_accepted():
    # spec: CON-14
    from google.protobuf import json_format

    text = json_format.MessageToJson(sample_contract(3))  # lowerCamelCase keys
    assert contract_from_json(text) == sample_contract(3)


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda d: d.update(servedd_id="x"), "servedd_id"),
        (lambda d: d["model"]["graphs"][0].update(bindngs=[]), "model.graphs[0].bindngs"),
        (lambda d: d["model"]["cache"]["regions"][0].update(planes_count=1), "model.cache.regions[0].planes_count"),
        (lambda d: d["model"]["frontend"]["tool_syntax"].update(opener="<x>"), "model.frontend.tool_syntax.opener"),
    ],
)
def test_unknown_semantic_fields_are_rejected_by_name(edit, field):
    # spec: CON-14
    document = _document()
    edit(document)
    with pytest.raises(ContractError) as info:
        contract_from_json(json.dumps(document))
    assert info.value.field == field


def test_unknown_enum_identifier_is_rejected_by_name():
    # spec: CON-12
    document = _document()
    document["model"]["frontend"]["tool_parser"] = "TOOL_PARSER_MODEL_X"
    with pytest.raises(ContractError) as info:
        contract_from_json(json.dumps(document))
    assert info.value.field == "model.frontend.tool_parser"


def test_duplicate_keys_are_rejected():
    # spec: CON-14
    text = contract_to_json(sample_contract(3))
    text = text.replace('"served_id": "sample-model"', '"served_id": "sample-model", "served_id": "other"')
    with pytest.raises(ContractError, match="duplicate"):
        contract_from_json(text)


def test_wrong_json_types_are_typed_errors():
    # spec: CON-14
    document = _document()
    document["model"]["graphs"] = {"not": "a list"}
    with pytest.raises(ContractError) as info:
        contract_from_json(json.dumps(document))
    assert info.value.field == "model.graphs"
    with pytest.raises(ContractError):
        contract_from_json("{not json")
    document = _document()
    document["context_tokens"] = "many"
    with pytest.raises(ContractError):
        contract_from_json(json.dumps(document))


def test_unknown_fields_inside_the_rebuild_manifest_are_ignored():
    # spec: SRV-18, SRV-20: a newer catalog version may carry fields this runtime does not know
    document = _document()
    document["rebuild"] = {"catalog_version": 42, "future_field": {"x": 1}, "weight_catalogs": [{"rank": 0, "new": 1}]}
    contract = contract_from_json(json.dumps(document))
    assert contract.rebuild.catalog_version == 42
    PreparedContract.decode(contract, sample_manifest(3))

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=12), children, max_size=3),
    max_leaves=12,
)


def _perturbed_documents():
    """The sample contract's JSON with one subtree replaced by arbitrary JSON."""
    base = _document()
    paths = []

    def collect(node, path):
        paths.append(path)
        if isinstance(node, dict):
            for key, value in node.items():
                collect(value, path + (key,))
        elif isinstance(node, list):
            for index, value in enumerate(node):
                collect(value, path + (index,))

    collect(base, ())
    return st.tuples(st.sampled_from(paths[1:]), _json_values)


@settings(max_examples=300, deadline=None)
@given(_perturbed_documents())
def test_arbitrary_json_raises_only_contract_errors(case):
    # spec: CON-12, CON-14 (never a crash on malformed JSON)
    path, replacement = case
    document = _document()
    node = document
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = replacement
    try:
        contract_from_json(json.dumps(document))
    except ContractError:
        pass
