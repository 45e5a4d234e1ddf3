"""helios-generate and Bootstrap.load on the real prepared test core."""
from __future__ import annotations

import pytest

from helios_backend.engine.bootstrap import Bootstrap
from helios_backend.cli import generate
from helios_backend.core import AuthorizationError
from helios_backend.sampling_parameters import SamplingParameters
from tests.engine_fixtures import ACCEPTANCE


def test_cli_greedy_reply_to_the_france_question_contains_paris(smollm2_core, capsys):
    # spec: OWN-12, FE-43
    assert generate.main([str(smollm2_core), "--prompt", "What is the capital of France?", "--max-tokens", "16",
                          "--accept", ACCEPTANCE]) == 0
    reply = capsys.readouterr().out
    assert "Paris" in reply
    assert "<|im_end|>" not in reply


def test_bootstrap_loads_frontend_assets_and_defaults(smollm2_bootstrap):
    # spec: OWN-12, FE-44, SRV-15
    ids = smollm2_bootstrap.tokenizer.encode_template("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    text = smollm2_bootstrap.chat_template.render([{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>assistant\n")
    assert smollm2_bootstrap.eos_token_ids == (2, 0)


def test_bootstrap_refuses_a_wrong_acceptance(smollm2_core):
    # spec: FMT-21
    with pytest.raises(AuthorizationError):
        Bootstrap.load(smollm2_core, ACCEPTANCE + " ")


def test_explicit_sampling_flags_win_over_core_defaults(smollm2_bootstrap):
    # spec: SRV-17
    parser = generate._parser()
    greedy = generate.sampling_from_args(parser.parse_args(["c", "--prompt", "x"]), smollm2_bootstrap)
    assert greedy == SamplingParameters()
    tuned = generate.sampling_from_args(parser.parse_args(["c", "--prompt", "x", "--temperature", "0.7"]),
                                        smollm2_bootstrap)
    assert tuned.temperature == pytest.approx(0.7) and tuned.top_p == pytest.approx(0.9)   # core default fills


def test_seeded_sampling_through_the_cli_path_repeats(smollm2_bootstrap, smollm2_model):
    sampling = SamplingParameters(temperature=0.8, top_p=0.9)
    first, _ = generate.generate_reply(smollm2_bootstrap, smollm2_model, "Name a color.", 10, sampling, seed=99)
    again, _ = generate.generate_reply(smollm2_bootstrap, smollm2_model, "Name a color.", 10, sampling, seed=99)
    assert first == again and first
