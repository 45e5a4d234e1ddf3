"""Hugging Face checkpoint folders as they ship: f32 / f16 / bf16 safetensors, sharded or not;
padded vocabularies; generation_config.json; a required chat template; the served name; the
context default; rope_scaling.

The tests write the folders themselves (tests/tiny_checkpoints.py: numpy and the published
safetensors layout, no torch) and check the prepared cores against values computed here
independently (bf16 rounding, the RoPE scaling formulas written out per frequency).
"""
from __future__ import annotations

import json
import math
import pathlib

import numpy as np
import pytest
from helios_proto import contract_pb2 as C

from helios_backend.engine.model import ModelOptions, NativeModel
from helios_backend.lockstep.generator import GenerationRequest, LockstepGenerator
from helios_backend.sampling_parameters import SamplingParameters
from ignition.preparation.prepare import prepare
from ignition.preparation.vocabulary import MASK_IDS
from ignition.recipes.hf_checkpoint import CONTEXT_CEILING, recipe_for
from ignition.sources.hf_checkpoint import CheckpointError, HFCheckpoint
from tests.engine_fixtures import resource_reader
from tests.test_hf_checkpoint import TOLERANCE
from tests.test_hf_checkpoint import _logits as hf_logits
from tests.reference.llama_numpy import ReferenceLlama, RopePairing
from tests.test_numpy_executor import prefill_logits
from tests.test_recipe_qwen2 import PROMPT
from tests.tiny_checkpoints import (NO_TEMPLATE, TinyShape, bf16_values, tiny_vocabulary, tiny_weights,
                                    write_tiny_gguf, write_tiny_hf_checkpoint)

TOKENIZER_IDS = len(tiny_vocabulary()[0])      # 271


def _options(recipe, **overrides):
    base = dict(context_tokens=256, decode_rows=(1, 2), prefill_variants=((1, 8), (1, 32)), mixed_variants=((2, 9),),
                admission_rows=(1, 2), resume_rows=(1,), scored_prefill_variants=((1, 8),), snapshot_rows=2,
                restoration_rows=(1,), prepared_pages=48, top_logprobs=4, speculative_widths=())
    return recipe.RecipeOptions(**(base | overrides))


def _model(prepared, executor: str = "numpy") -> NativeModel:
    return NativeModel.load(prepared.contract, prepared.manifest, resource_reader(prepared),
                            ModelOptions(cache_pages=32, concurrency=2, executor=executor))


def _weights(vocab: int = TOKENIZER_IDS, seed: int = 3, family: str = "llama") -> dict[str, np.ndarray]:
    return tiny_weights(TinyShape(), vocab, seed=seed, biases=family == "qwen2", tied=False)


def _weight_buffer(prepared, name: str) -> np.ndarray:
    [declared] = [b for b in prepared.manifest.buffers if b.name == name]
    data = {r.id: r.data for r in prepared.resources}[declared.weight.resource]
    dtype = {C.DTYPE_F32: np.float32, C.DTYPE_I32: np.int32}[declared.dtype]
    count = math.prod(declared.shape)
    return np.frombuffer(data, dtype, count=count, offset=declared.weight.byte_offset).reshape(tuple(declared.shape))


# ---- stored dtypes, shards -------------------------------------------------------------------------

@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_every_shipped_dtype_reads_as_the_values_it_stores(tmp_path: pathlib.Path, dtype: str, shards: int) -> None:
    weights = _weights()
    directory = write_tiny_hf_checkpoint(tmp_path / "tiny", "llama", weights, dtype=dtype, shards=shards)
    stored = {"float32": lambda a: a, "float16": lambda a: a.astype(np.float16).astype(np.float32),
              "bfloat16": bf16_values}[dtype]
    checkpoint = HFCheckpoint.open(directory)
    for name, array in weights.items():
        got = checkpoint.tensor(name)
        assert got.dtype == np.float32 and got.shape == array.shape
        np.testing.assert_array_equal(got, stored(array), err_msg=name)
    if dtype == "bfloat16":     # the rounding really lost bits: a reader ignoring bf16 cannot pass
        assert not np.array_equal(stored(weights["token_embd.weight"]), weights["token_embd.weight"])


def test_bf16_words_decode_to_their_published_values(tmp_path: pathlib.Path) -> None:
    """0x3F80 = 1.0, 0xC020 = -2.5, 0x4049 = 3.140625, 0x0000 = 0 (exactly representable values)."""
    from ignition.sources.safetensors_file import bf16_to_f32

    words = np.array([0x3F80, 0xC020, 0x4049, 0x0000, 0x7F80], dtype=np.uint16)
    np.testing.assert_array_equal(bf16_to_f32(words), np.array([1.0, -2.5, 3.140625, 0.0, np.inf], np.float32))


def test_unreadable_weight_files_name_the_file_and_tensor(tmp_path: pathlib.Path) -> None:
    directory = write_tiny_hf_checkpoint(tmp_path / "odd", "llama", _weights())
    blob = (directory / "model.safetensors").read_bytes()
    length = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + length])
    header["model.norm.weight"]["dtype"] = "F8_E4M3"     # a dtype with no float reading here
    encoded = json.dumps(header).encode().ljust(length)
    (directory / "model.safetensors").write_bytes(blob[:8] + encoded + blob[8 + length:])
    with pytest.raises(CheckpointError, match="'model.norm.weight' has dtype F8_E4M3"):
        HFCheckpoint.open(directory).tensor("output_norm.weight")
    (directory / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="model.safetensors: not a safetensors file"):
        HFCheckpoint.open(directory)


# spec: OWN-4, OWN-5
def test_a_sharded_bf16_checkpoint_prepares_a_core_matching_the_oracle(tmp_path: pathlib.Path) -> None:
    weights = _weights(family="qwen2")
    directory = write_tiny_hf_checkpoint(tmp_path / "bf16", "qwen2", weights, dtype="bfloat16", shards=2)
    twin = write_tiny_gguf(tmp_path / "twin.gguf", arch="qwen2", weights={k: bf16_values(v) for k, v in weights.items()})
    recipe = recipe_for(directory)
    prepared = prepare(recipe, _options(recipe))
    oracle = ReferenceLlama.load(twin, RopePairing.HALF_SPLIT, max_context=256).with_weights_rounded(np.float16)
    expected = oracle.forward(PROMPT, 0)
    for position, logits in hf_logits(prepared).items():
        assert np.abs(logits - expected[position]).max() <= TOLERANCE, position


# ---- padded vocabularies ---------------------------------------------------------------------------

PADDED_VOCAB = 300     # config.json vocab_size: 29 rows past the tokenizer's 271 ids, not a multiple of 16


def _padded_checkpoint(root: pathlib.Path) -> tuple[pathlib.Path, dict[str, np.ndarray]]:
    """A checkpoint whose head rows past the tokenizer are 30x copies of the first rows: their
    logits are 30x those rows', so without the mask a padded id would win every greedy step."""
    weights = _weights(PADDED_VOCAB)
    extra = PADDED_VOCAB - TOKENIZER_IDS
    weights["output.weight"][TOKENIZER_IDS:] = 30 * weights["output.weight"][:extra]
    return write_tiny_hf_checkpoint(root / "padded", "llama", weights), weights


def _generated(prepared, executor: str = "numpy") -> list[int]:
    model = _model(prepared, executor)
    try:
        requests = [GenerationRequest(PROMPT, 12)] + [
            GenerationRequest(PROMPT, 12, SamplingParameters(temperature=1.5, top_p=1.0, top_k=0), seed=seed,
                              eos_ids=[TOKENIZER_IDS - 1]) for seed in range(4)]
        # 2 slots; the requests of one generate() call share their EOS ids: the greedy one alone
        groups = [requests[:1]] + [requests[i:i + 2] for i in range(1, len(requests), 2)]
        results = [result for group in groups for result in LockstepGenerator(model).generate(group)]
        first = prefill_logits(model, PROMPT, chunk=8, vocab=prepared.contract.model.vocabulary.sampled_tokens)
    finally:
        model.close()
    extra = PADDED_VOCAB - TOKENIZER_IDS
    for logits in first.values():
        assert np.all(np.isneginf(logits[TOKENIZER_IDS:])) and np.all(np.isfinite(logits[:TOKENIZER_IDS]))
        # what an unmasked head would have produced there: a padded id above every spelled one
        assert 30 * logits[:extra].max() > logits[:TOKENIZER_IDS].max()
    return [token for result in results for token in result.tokens]


# spec: CON-3
@pytest.mark.parametrize("executor", ["numpy", "cpu"])
def test_ids_past_the_tokenizer_are_never_sampled_or_emitted(tmp_path: pathlib.Path, executor: str) -> None:
    directory, _ = _padded_checkpoint(tmp_path)
    assert HFCheckpoint.open(directory).shape.tokenizer_tokens == TOKENIZER_IDS
    recipe = recipe_for(directory)
    prepared = prepare(recipe, _options(recipe))
    assert prepared.contract.model.vocabulary.sampled_tokens == PADDED_VOCAB   # no kernels: the exact width
    masks = [n for p in prepared.manifest.programs for n in p.nodes if n.label == "logits.vocabulary_mask"]
    assert len(masks) == sum(1 for p in prepared.manifest.programs if any(n.kernel.startswith("logits.norm_head")
                                                                           for n in p.nodes))
    np.testing.assert_array_equal(_weight_buffer(prepared, MASK_IDS)[0], np.arange(TOKENIZER_IDS, PADDED_VOCAB))
    tokens = _generated(prepared, executor)
    assert tokens and max(tokens) < TOKENIZER_IDS


# spec: CON-3
def test_speculative_programs_mask_the_padded_ids_too(tmp_path: pathlib.Path) -> None:
    """SPECULATIVE programs score every packed token's logits: the mask covers their rows."""
    from helios_backend.lockstep.speculative import SpeculativeLockstepGenerator
    from helios_backend.scheduler.speculative import SpeculativeOptions

    directory, _ = _padded_checkpoint(tmp_path)
    recipe = recipe_for(directory)
    prepared = prepare(recipe, _options(recipe, speculative_variants=((2, 4, 3, 8),)))
    assert _weight_buffer(prepared, MASK_IDS).shape == (8, PADDED_VOCAB - TOKENIZER_IDS)   # P = 8 logit rows
    model = _model(prepared)
    try:
        run = SpeculativeLockstepGenerator(model, SpeculativeOptions(enabled=True, history_drafting=True)).generate(
            [GenerationRequest(PROMPT * 3, 12, SamplingParameters(temperature=1.5), seed=7, eos_ids=[TOKENIZER_IDS - 1])])
    finally:
        model.close()
    tokens = run.results[0].tokens
    assert tokens and max(tokens) < TOKENIZER_IDS


# spec: CON-3
@pytest.mark.slow
def test_a_core_with_kernels_pads_the_sampling_geometry_to_the_kernels_multiple(tmp_path: pathlib.Path) -> None:
    """vocab_size 300 is no multiple of 16: with the kernel library the core's vocabulary is 304
    (zero rows appended, every node's geometry checked against the tiles), ids 271..303 masked."""
    pytest.importorskip("triton")
    from ignition.gpu_kernels.library import KernelLibrary

    directory, _ = _padded_checkpoint(tmp_path)
    recipe = recipe_for(directory)
    prepared = prepare(recipe, _options(recipe), kernel_library=KernelLibrary(archs=["sm_90a"]))
    vocabulary = prepared.contract.model.vocabulary
    assert vocabulary.sampled_tokens == 304 and vocabulary.histogram_bins == 304
    np.testing.assert_array_equal(_weight_buffer(prepared, MASK_IDS)[0], np.arange(TOKENIZER_IDS, 304))
    tokens = _generated(prepared)
    assert tokens and max(tokens) < TOKENIZER_IDS


# spec: CON-3, OWN-4
@pytest.mark.slow
def test_a_gguf_of_an_odd_vocabulary_pads_with_kernels_too(tmp_path: pathlib.Path) -> None:
    """The padding is the preparation's, not the checkpoint reader's: a quantized GGUF of 271
    tokens prepares with the kernel library as a 272-wide vocabulary whose id 271 is masked."""
    pytest.importorskip("triton")
    from ignition.gpu_kernels.library import KernelLibrary
    from ignition.recipes.qwen2_5_coder_instruct import CODER_0_5B as gguf_recipe
    from tests.test_recipe_qwen2 import tiny_options

    gguf = write_tiny_gguf(tmp_path / "odd.gguf", quantized=True)
    prepared = prepare(gguf_recipe, tiny_options(gguf), kernel_library=KernelLibrary(archs=["sm_90a"]))
    assert prepared.contract.model.vocabulary.sampled_tokens == 272
    np.testing.assert_array_equal(_weight_buffer(prepared, MASK_IDS)[0], [TOKENIZER_IDS])
    model = _model(prepared)
    try:
        [result] = LockstepGenerator(model).generate([GenerationRequest(PROMPT, 6)])
        logits = prefill_logits(model, PROMPT, chunk=8, vocab=272)
    finally:
        model.close()
    assert result.tokens and max(result.tokens) < TOKENIZER_IDS
    assert all(np.isneginf(row[TOKENIZER_IDS]) for row in logits.values())


def test_the_served_name_flag_renames_a_named_recipe() -> None:
    from ignition.cli import UnknownRecipeError, recipe_module

    renamed = recipe_module("smollm2-135m-instruct", served_name="house-model")
    original = recipe_module("smollm2-135m-instruct")
    assert renamed.SERVED_ID == "house-model" and original.SERVED_ID != "house-model"
    assert renamed.forward is original.forward and renamed.NAME == original.NAME
    with pytest.raises(UnknownRecipeError, match="--chat-template"):
        recipe_module("smollm2-135m-instruct", chat_template=pathlib.Path("t.jinja"))


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path: pathlib.Path) -> None:
    directory = write_tiny_hf_checkpoint(tmp_path / "small", "llama", _weights(), config={"vocab_size": 200})
    with pytest.raises(CheckpointError, match="vocab_size 200"):
        HFCheckpoint.open(directory)


# ---- generation_config.json -------------------------------------------------------------------------

def test_generation_config_gives_the_sampling_defaults_and_eos_ids(tmp_path: pathlib.Path) -> None:
    generation = {"eos_token_id": [268, 266], "temperature": 0.7, "top_p": 0.8, "top_k": 20,
                  "repetition_penalty": 1.05, "min_p": 0.05, "do_sample": True}
    recipe = recipe_for(write_tiny_hf_checkpoint(tmp_path / "g", "llama", _weights(), generation=generation))
    sampling = recipe.SAMPLING_DEFAULTS
    assert tuple(recipe.EOS_TOKEN_IDS) == (268, 266)
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p, sampling.repetition_penalty) == \
        pytest.approx((0.7, 0.8, 20, 0.05, 1.05))
    single = recipe_for(write_tiny_hf_checkpoint(tmp_path / "one", "llama", _weights(),
                                                 generation={"eos_token_id": 266}))
    assert tuple(single.EOS_TOKEN_IDS) == (266,) and single.SAMPLING_DEFAULTS.temperature == 1.0
    fallback = recipe_for(write_tiny_hf_checkpoint(tmp_path / "none", "llama", _weights(), generation={}))
    assert tuple(fallback.EOS_TOKEN_IDS) == (268,)        # config.json's eos_token_id


@pytest.mark.parametrize("generation, field", [
    ({"eos_token_id": 999}, "eos_token_id"), ({"eos_token_id": [268, "x"]}, "eos_token_id"),
    ({"eos_token_id": 268, "top_p": 1.5}, "top_p"), ({"eos_token_id": 268, "temperature": -1}, "temperature"),
    ({"eos_token_id": 268, "top_k": 2.5}, "top_k"), ({"eos_token_id": 268, "repetition_penalty": 0}, "repetition_penalty"),
])
def test_bad_generation_config_values_name_the_field(tmp_path: pathlib.Path, generation, field) -> None:
    directory = write_tiny_hf_checkpoint(tmp_path / "bad", "llama", _weights(), generation=generation)
    with pytest.raises(CheckpointError, match=f"generation_config.json: {field}"):
        recipe_for(directory)


# ---- chat template, served name, context --------------------------------------------------------------

def test_a_missing_chat_template_is_a_preparation_error_unless_one_is_given(tmp_path: pathlib.Path, capsys) -> None:
    from ignition.cli import prepare_main

    directory = write_tiny_hf_checkpoint(tmp_path / "bare", "llama", _weights(), chat_template=NO_TEMPLATE)
    with pytest.raises(CheckpointError, match="tokenizer_config.json: no chat_template.*--chat-template"):
        recipe_for(directory)
    out = tmp_path / "bare.core"
    assert prepare_main([str(directory), "--out", str(out), "--no-kernels", "--key", str(tmp_path / "k.pem")]) == 2
    assert "--chat-template" in capsys.readouterr().err and not out.exists()
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")
    recipe = recipe_for(directory, chat_template=template)
    prepared = prepare(recipe, _options(recipe))
    assert {r.id: r.data for r in prepared.resources}["chat_template.jinja"].decode() == template.read_text()


def test_the_served_name_is_chosen_or_derived(tmp_path: pathlib.Path) -> None:
    snapshot = tmp_path / "hub" / "models--Org--Tiny-Model" / "snapshots" / "3f2a9c1e0b"
    assert recipe_for(write_tiny_hf_checkpoint(snapshot, "llama", _weights())).SERVED_ID == "Org/Tiny-Model"
    named = write_tiny_hf_checkpoint(tmp_path / "local", "llama", _weights(), config={"_name_or_path": "Org/Other"})
    assert recipe_for(named).SERVED_ID == "Org/Other"
    trained = write_tiny_hf_checkpoint(tmp_path / "run-7", "llama", _weights(), config={"_name_or_path": "/fsx/run/7"})
    assert recipe_for(trained).SERVED_ID == "run-7"
    chosen = recipe_for(snapshot, served_name="my-model")
    prepared = prepare(chosen, _options(chosen))
    assert prepared.contract.served_id == "my-model"


def test_the_served_name_flag_reaches_the_core(tmp_path: pathlib.Path) -> None:
    from helios_backend.core import open_core
    from ignition.cli import prepare_main

    directory = write_tiny_hf_checkpoint(tmp_path / "snapshots" / "abc", "llama", _weights())
    out = tmp_path / "named.core"
    assert prepare_main([str(directory), "--out", str(out), "--no-kernels", "--context-tokens", "256",
                         "--served-model-name", "team/tiny", "--key", str(tmp_path / "k.pem")]) == 0
    with open_core(out) as core:
        assert core.contract.served_id == "team/tiny"


@pytest.mark.parametrize("positions, expected", [(4096, 4096), (131072, CONTEXT_CEILING), (None, 2048)])
def test_the_context_default_follows_max_position_embeddings(tmp_path: pathlib.Path, positions, expected) -> None:
    directory = write_tiny_hf_checkpoint(tmp_path / "c", "llama", _weights())
    config = json.loads((directory / "config.json").read_text())
    if positions is None:
        del config["max_position_embeddings"]
    else:
        config["max_position_embeddings"] = positions
    (directory / "config.json").write_text(json.dumps(config))
    assert recipe_for(directory).RecipeOptions().context_tokens == expected


# ---- rope_scaling ----------------------------------------------------------------------------------

def _published_frequencies(scaling: dict, head_dim: int, theta: float, context: int, max_positions: int) -> np.ndarray:
    """The inverse frequencies each published formula gives, one frequency at a time."""
    out = []
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = scaling["factor"]
    base = theta
    if kind == "dynamic":
        original = scaling.get("original_max_position_embeddings", max_positions)
        if context > original:
            base = theta * ((factor * context / original) - (factor - 1)) ** (head_dim / (head_dim - 2))
    for i in range(0, head_dim, 2):
        frequency = 1.0 / base ** (i / head_dim)
        if kind == "linear":
            frequency /= factor
        elif kind == "llama3":
            original = scaling["original_max_position_embeddings"]
            low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
            wavelength = 2 * math.pi / frequency
            if wavelength > original / low:
                frequency /= factor
            elif wavelength >= original / high:
                smooth = (original / wavelength - low) / (high - low)
                frequency = (1 - smooth) * frequency / factor + smooth * frequency
        out.append(frequency)
    return np.array(out)


SCALINGS = {
    # Llama 3.1's values, with a short original context so the tiny head's 8 frequencies span all three bands
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "linear": {"type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_rope_scaling_is_applied_to_the_prepared_rope_table(tmp_path: pathlib.Path, kind: str) -> None:
    shape = TinyShape()
    directory = write_tiny_hf_checkpoint(tmp_path / kind, "llama", _weights(), shape=shape,
                                         config={"rope_scaling": SCALINGS[kind], "max_position_embeddings": 128})
    recipe = recipe_for(directory)
    prepared = prepare(recipe, _options(recipe, context_tokens=256))
    frequencies = _published_frequencies(SCALINGS[kind], shape.head_dim, shape.rope_theta, 256, 128)
    unscaled = _published_frequencies({"type": "linear", "factor": 1.0}, shape.head_dim, shape.rope_theta, 256, 128)
    assert not np.allclose(frequencies, unscaled)       # the scaling changes this table
    if kind == "llama3":   # the three bands are all present: scaled, blended and kept frequencies
        ratio = frequencies / unscaled
        assert np.isclose(ratio, 1 / 8).any() and np.isclose(ratio, 1).any() and ((ratio > 1 / 8) & (ratio < 1)).any()
    angle = np.arange(256)[:, None] * frequencies[None, :]
    expected = np.stack([np.cos(angle), np.sin(angle)], axis=-1).astype(np.float32)
    np.testing.assert_allclose(_weight_buffer(prepared, "weights.rope_table"), expected, atol=1e-6)


def test_dynamic_scaling_within_the_original_context_changes_nothing(tmp_path: pathlib.Path) -> None:
    from ignition.sources.rope_scaling import RopeScaling

    scaling = RopeScaling.from_config({"rope_scaling": SCALINGS["dynamic"], "max_position_embeddings": 4096})
    assert scaling is not None
    np.testing.assert_allclose(scaling.inverse_frequencies(16, 1e6, 2048),
                               _published_frequencies({"type": "linear", "factor": 1.0}, 16, 1e6, 2048, 4096))


@pytest.mark.parametrize("declared, message", [
    ({"rope_type": "yarn", "factor": 4.0}, "rope_scaling.rope_type 'yarn'"),
    ({"type": "linear"}, "rope_scaling.factor"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}, "rope_scaling.high_freq_factor"),
    ("linear", "rope_scaling must be an object"),
])
def test_a_rope_scaling_that_cannot_be_applied_is_a_clear_error(tmp_path: pathlib.Path, declared, message) -> None:
    directory = write_tiny_hf_checkpoint(tmp_path / "r", "llama", _weights(), config={"rope_scaling": declared})
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(")):
        HFCheckpoint.open(directory)
