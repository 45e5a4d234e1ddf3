"""Logprob records of a padded vocabulary: ids past the tokenizer never appear among a token's
top alternatives, on the numpy and CPU executors.

The checkpoint (tests/test_hf_checkpoint_folders.py `_padded_checkpoint`) makes each padded id's
head row 30x a spelled row, so an unmasked padded logit would top every step: without the
vocabulary mask before `sampling.logprobs.v2` they would fill the top alternatives. Prompt
logprobs are not served (a completions request with `echo` and `logprobs` is 400 naming `echo`:
tests/test_gateway_api_surface.py), so generated tokens are the only place alternatives appear.
"""
from __future__ import annotations

import pathlib

import numpy as np
import pytest
from helios_proto import contract_pb2 as C

from helios_backend.lockstep.generator import GenerationRequest
from helios_backend.lockstep.raw_lanes import RawLanes
from helios_backend.packing import PackedLane
from helios_backend.sampling_parameters import SamplingParameters
from helios_backend.scheduler.completion import CompletionFormat
from ignition.preparation.prepare import prepare
from ignition.recipes.hf_checkpoint import recipe_for
from tests.test_hf_checkpoint_folders import PADDED_VOCAB, TOKENIZER_IDS, _model, _options, _padded_checkpoint
from tests.test_recipe_qwen2 import PROMPT


# spec: CON-3
@pytest.mark.parametrize("executor", ["numpy", "cpu"])
def test_top_logprobs_never_name_an_id_past_the_tokenizer(tmp_path: pathlib.Path, executor: str) -> None:
    directory, _ = _padded_checkpoint(tmp_path)
    recipe = recipe_for(directory)
    prepared = prepare(recipe, _options(recipe))
    model = _model(prepared, executor)
    try:
        fmt = CompletionFormat.from_layout(model.execution_manifest.completion)
        top = fmt.top_k
        assert top == 4
        driver = RawLanes(model)
        request = GenerationRequest(PROMPT, 4, SamplingParameters(temperature=1.0, logprobs=top), seed=5)
        [active] = driver.admit([request], [0])
        driver.ensure_pages(active, len(PROMPT) + 4)
        lanes = [PackedLane(slot=0, generation=active.generation, tokens=np.asarray(PROMPT, np.int32),
                            page_table=list(active.pages))]
        programs = [model.program(C.OPERATION_PREFILL, 1, len(PROMPT))] + [model.program(C.OPERATION_DECODE, 1, 1)] * 3
        for step, program in enumerate(programs):
            driver.step(program, lanes)
            row = fmt.row_words_of(driver.last_words, 1)[0]          # the one lane's record
            logits = model.executor.read_buffer("scratch.logits").view(np.float32)[:PADDED_VOCAB]
            assert np.all(np.isneginf(logits[TOKENIZER_IDS:]))              # masked before the records
            top_ids = row[fmt.row["top_ids"]:fmt.row["top_ids"] + top]
            top_lps = row[fmt.row["top_logprobs"]:fmt.row["top_logprobs"] + top].view(np.float32)
            assert int(row[fmt.row["token"]]) < TOKENIZER_IDS and top_ids.max() < TOKENIZER_IDS, (step, top_ids)
            assert np.all(np.isfinite(top_lps)) and list(top_lps) == sorted(top_lps, reverse=True)
            lanes = [PackedLane(slot=0, generation=active.generation, start=len(PROMPT) + step, tokens=None,
                                page_table=list(active.pages))]
    finally:
        model.close()
