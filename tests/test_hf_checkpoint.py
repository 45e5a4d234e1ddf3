"""Local Hugging Face checkpoint directories as a preparation source (llama and qwen2 families; the
other families: tests/test_hf_families.py).

The tests write tiny random checkpoints with `safetensors` (tests/tiny_checkpoints.py) and a GGUF
twin holding the same weights; the core prepared from the directory is checked against the
independent oracle reading the twin (Hugging Face stores q/k in rotate-half order, so the oracle
rotates half-split pairs), and against the core the GGUF recipe prepares from the same weights:
same core format, same runtime, same logits.
"""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
from helios_proto import contract_pb2 as C

pytest.importorskip("safetensors")

from helios_backend.engine.model import ModelOptions, NativeModel  # noqa: E402
from ignition.preparation.prepare import prepare  # noqa: E402
from ignition.recipes.hf_checkpoint import recipe_for  # noqa: E402
from ignition.sources.hf_checkpoint import CheckpointError, HFCheckpoint  # noqa: E402
from tests.engine_fixtures import resource_reader  # noqa: E402
from tests.reference.llama_numpy import ReferenceLlama, RopePairing  # noqa: E402
from tests.test_numpy_executor import prefill_logits  # noqa: E402
from tests.test_recipe_qwen2 import PROMPT, tiny_options  # noqa: E402
from tests.tiny_checkpoints import (TinyShape, tiny_vocabulary, tiny_weights, write_tiny_gguf,  # noqa: E402
                                    write_tiny_hf_checkpoint)

FAMILIES = {"llama": dict(biases=False, tied=True), "qwen2": dict(biases=True, tied=False)}
TOLERANCE = 2e-2


def _logits(prepared, prompt=PROMPT, chunk=8) -> dict[int, np.ndarray]:
    model = NativeModel.load(prepared.contract, prepared.manifest, resource_reader(prepared),
                             ModelOptions(cache_pages=32, concurrency=2))
    try:
        return prefill_logits(model, prompt, chunk=chunk, vocab=prepared.contract.model.vocabulary.sampled_tokens)
    finally:
        model.close()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory: pytest.TempPathFactory):
    family = request.param
    root = tmp_path_factory.mktemp(f"hf-{family}")
    weights = tiny_weights(TinyShape(), len(tiny_vocabulary()[0]), seed=3, **FAMILIES[family])
    directory = write_tiny_hf_checkpoint(root / f"tiny-{family}", family, weights, shards=2 if family == "qwen2" else 1)
    twin = write_tiny_gguf(root / "twin.gguf", arch=family, weights=weights)
    return family, directory, twin


# spec: OWN-4, OWN-5
def test_a_checkpoint_directory_prepares_a_core_matching_the_oracle(checkpoint) -> None:
    family, directory, twin = checkpoint
    recipe = recipe_for(directory)
    options = tiny_options(twin)
    prepared = prepare(recipe, recipe.RecipeOptions(**{f: getattr(options, f) for f in (
        "context_tokens", "decode_rows", "prefill_variants", "mixed_variants", "admission_rows", "resume_rows",
        "scored_prefill_variants", "snapshot_rows", "restoration_rows", "prepared_pages", "top_logprobs",
        "speculative_widths")}))
    contract = prepared.contract
    assert contract.served_id == f"tiny-{family}"
    assert tuple(contract.defaults.eos_token_ids) == (268, 266)
    assert contract.defaults.sampling.temperature == pytest.approx(0.6)
    assert contract.model.frontend.tool_parser == C.TOOL_PARSER_JSON_CALL_TAGS      # its template writes calls
    tokenizer = {r.id: r.data for r in prepared.resources}["tokenizer.json"]
    assert tokenizer.decode() == (directory / "tokenizer.json").read_text()         # carried verbatim
    kernels = {n.kernel for p in prepared.manifest.programs for n in p.nodes}
    assert ("attention.qkv_bias_rope_store.v1" in kernels) == (family == "qwen2")
    oracle = ReferenceLlama.load(twin, RopePairing.HALF_SPLIT, max_context=256).with_weights_rounded(np.float16)
    expected = oracle.forward(PROMPT, 0)
    for position, logits in _logits(prepared).items():
        assert np.abs(logits - expected[position]).max() <= TOLERANCE, (family, position)
        assert int(np.argmax(logits)) == int(np.argmax(expected[position]))
    if family == "qwen2":   # the GGUF recipe on the same weights: the same runtime numbers
        from ignition.recipes.qwen2_5_coder_instruct import CODER_0_5B as gguf_recipe

        from_gguf = _logits(prepare(gguf_recipe, options))
        for position, logits in _logits(prepared).items():
            assert np.abs(logits - from_gguf[position]).max() <= 1e-4, position


def test_unsupported_or_incomplete_directories_name_the_problem(checkpoint, tmp_path) -> None:
    family, directory, _ = checkpoint
    broken = tmp_path / "broken"
    broken.mkdir()
    with pytest.raises(CheckpointError, match="config.json"):
        HFCheckpoint.open(broken)
    (broken / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    with pytest.raises(CheckpointError, match="model_type 'mamba'"):
        HFCheckpoint.open(broken)
    (broken / "config.json").write_text((directory / "config.json").read_text())
    with pytest.raises(CheckpointError, match="safetensors"):
        HFCheckpoint.open(broken)


def test_helios_prepare_takes_a_directory(checkpoint, tmp_path: pathlib.Path, capsys) -> None:
    from ignition.cli import prepare_main

    family, directory, _ = checkpoint
    if family != "llama":
        pytest.skip("one family is enough for the command line")
    out = tmp_path / "tiny.core"
    assert prepare_main([str(directory), "--out", str(out), "--no-kernels", "--context-tokens", "512",
                         "--key", str(tmp_path / "key.pem")]) == 0
    assert out.stat().st_size > 0
    assert prepare_main([str(tmp_path / "missing-dir"), "--out", str(tmp_path / "x.core")]) == 2
    assert "unknown recipe" in capsys.readouterr().err
