"""The CPU peer bench's shared pieces: identical prompt ids and ratio arithmetic (no timing)."""

from __future__ import annotations

import pytest

from bench.cpu_peer import DecodeFigure, PeerFigures, bench_prompt_ids, format_ratios, format_table
from helios_backend.frontend.tokenizer import FrontendTokenizer
from ignition.sources.gguf import GGUFModel, default_gguf_path
from ignition.sources.tokenizer import tokenizer_json_from_gguf


@pytest.fixture(scope="module")
def tokenizer() -> FrontendTokenizer:
    return FrontendTokenizer.from_json(tokenizer_json_from_gguf(GGUFModel.open(default_gguf_path())))


@pytest.mark.parametrize("n", [1, 128, 512])
def test_bench_prompts_have_exact_length_and_no_control_ids(tokenizer: FrontendTokenizer, n: int) -> None:
    ids = bench_prompt_ids(n, tokenizer)
    assert len(ids) == n
    assert not set(ids) & tokenizer.special_ids
    assert bench_prompt_ids(n, tokenizer) == ids  # deterministic: every engine gets the same ids


def _figures(engine: str, prefill_s: float, decode_s: dict[int, float]) -> PeerFigures:
    decode = tuple(DecodeFigure(b, 10, s, (s, 2 * s)) for b, s in decode_s.items())
    return PeerFigures(engine, 2, 512, prefill_s, decode, (prefill_s,))


def test_ratios_and_table() -> None:
    peer = _figures("peer", 2.0, {1: 1.0, 8: 2.0})
    ours = _figures("ours", 1.0, {1: 4.0, 32: 1.0})
    assert peer.prefill_tokens_per_s == 256.0
    assert peer.decode_at(8).tokens_per_s == 40.0  # 8 sequences * 10 steps / 2 s
    assert peer.decode_at(8).ms_per_step == 200.0
    assert peer.decode_at(32) is None
    # prefill twice as fast, decode b=1 four times slower, b=32 has no peer figure
    assert format_ratios(ours, peer) == "ours vs peer: prefill x2.00, decode b=1 x0.25"
    table = format_table([peer, ours]).splitlines()
    assert len(table) == 4
    assert "decode b=32" in table[0] and table[2].rstrip().endswith("-")
