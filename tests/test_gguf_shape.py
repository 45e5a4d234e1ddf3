"""Shape files and the random-weight F16 GGUFs written from them (bench/gguf_shape.py), and the
llama.cpp peer bench's parsing and ratios (bench/gpu_llama_peer.py; the measuring runs on the device).

A random file must carry exactly the source's metadata (tokenizer arrays and chat template included)
and tensor table, and llama.cpp must accept it for each architecture: on tiny stand-ins here, on
the real recipes' GGUFs where they are installed (marked real_weights)."""
from __future__ import annotations

import json
import pathlib

import gguf
import numpy as np
import pytest

from bench import gguf_shape
from bench.gpu_llama_peer import format_report, parse_batched_bench, parse_llama_bench, ratios, read_ours
from tests.tiny_checkpoints import TinyShape, write_tiny_gemma_gguf, write_tiny_gguf

LAYOUTS = pathlib.Path(__file__).resolve().parents[1] / "bench" / "layouts"
FAMILIES = {"qwen2": lambda path: write_tiny_gguf(path, TinyShape(), arch="qwen2"),
            "gemma3": lambda path: write_tiny_gemma_gguf(path, vocabulary_multiple=16)}


def fields(reader: gguf.GGUFReader) -> dict:
    """Every metadata key but the file's own header fields: (types, value)."""
    return {k: (list(f.types), f.contents()) for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def assert_same_shape(source: pathlib.Path, random: pathlib.Path) -> gguf.GGUFReader:
    src, out = gguf.GGUFReader(str(source)), gguf.GGUFReader(str(random))
    want, got = fields(src), fields(out)
    assert got.pop("general.file_type")[1] == gguf_shape.F16_FILE_TYPE
    want.pop("general.file_type", None)
    assert got == want                                      # every key, value and value type
    assert [(t.name, list(t.shape)) for t in out.tensors] == [(t.name, list(t.shape)) for t in src.tensors]
    for t in out.tensors:
        vector = all(d == 1 for d in t.shape[1:])
        assert t.tensor_type == (gguf.GGMLQuantizationType.F32 if vector else gguf.GGMLQuantizationType.F16)
        values = np.asarray(t.data, dtype=np.float32)
        if gguf_shape.is_norm(t.name):
            assert (values == 1).all(), t.name
        elif values.size >= 4096:
            assert abs(values.std() - gguf_shape.STD) < 0.1 * gguf_shape.STD, t.name
            assert abs(values.mean()) < 0.1 * gguf_shape.STD, t.name
    return out


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, pathlib.Path, pathlib.Path]:
    family = request.param
    folder = tmp_path_factory.mktemp(family)
    source = FAMILIES[family](folder / "source.gguf")
    shape = gguf_shape.write_shape(source, folder / "tiny.shape.gguf.xz")
    random = gguf_shape.write_random(shape, folder / "tiny.f16.gguf")
    return family, source, random


def test_shape_file_holds_the_table_and_no_weights(tiny, tmp_path: pathlib.Path) -> None:
    family, source, _ = tiny
    shape = gguf_shape.write_shape(source, tmp_path / "plain.shape.gguf")      # not compressed
    reader = gguf.GGUFReader(str(shape))
    assert reader.tensors == [] or len(reader.tensors) == 0
    src = gguf.GGUFReader(str(source))
    assert gguf_shape.tensor_table(reader) == [(t.name, tuple(int(d) for d in t.shape)) for t in src.tensors]
    assert reader.fields[gguf_shape.TYPES].contents() == [int(t.tensor_type) for t in src.tensors]
    assert reader.fields["general.architecture"].contents() == family
    assert shape.stat().st_size < source.stat().st_size / 2


def test_random_file_has_the_source_metadata_and_tensors(tiny) -> None:
    _family, source, random = tiny
    assert_same_shape(source, random)


def test_random_file_is_seeded(tiny, tmp_path: pathlib.Path) -> None:
    _family, source, random = tiny
    shape = gguf_shape.write_shape(source, tmp_path / "s.shape.gguf.xz")
    again = gguf_shape.write_random(shape, tmp_path / "again.gguf")
    other = gguf_shape.write_random(shape, tmp_path / "other.gguf", seed=1)
    assert again.read_bytes() == random.read_bytes()
    assert other.read_bytes() != random.read_bytes()


def llama_cpp_completes(path: pathlib.Path, family: str, source: pathlib.Path) -> list[int]:
    """A few greedy tokens from llama.cpp on the CPU (llama-cpp-python, the `bench` extra); the
    model llama.cpp builds from `path` has the dimensions it builds from `source`."""
    llama_cpp = pytest.importorskip("llama_cpp")
    want = llama_cpp.Llama(str(source), n_ctx=64, n_batch=32, n_threads=2, verbose=False)
    model = llama_cpp.Llama(str(path), n_ctx=64, n_batch=32, n_threads=2, verbose=False, logits_all=True)
    assert model.metadata["general.architecture"] == family
    assert (model.n_vocab(), model.n_embd()) == (want.n_vocab(), want.n_embd())
    assert model.tokenize(b"Hello world") == want.tokenize(b"Hello world")
    tokens: list[int] = []
    rows = []
    model.eval([5, 6, 7])
    for _ in range(3):
        rows.append(np.array(model.scores[model.n_tokens - 1]))
        assert np.isfinite(rows[-1]).all() and rows[-1].std() > 0
        tokens.append(int(np.argmax(rows[-1])))
        model.eval(tokens[-1:])
    assert all(0 <= t < model.n_vocab() for t in tokens)
    # each position's logits depend on its context (a tied random head may still repeat a token)
    assert not np.allclose(rows[0], rows[1]) and not np.allclose(rows[1], rows[2])
    return tokens


def test_llama_cpp_accepts_the_random_file(tiny) -> None:
    family, source, random = tiny
    llama_cpp_completes(random, family, source)


@pytest.mark.real_weights
@pytest.mark.slow
@pytest.mark.parametrize("recipe_name, family", [("qwen2.5-coder-0.5b-instruct", "qwen2"), ("gemma-3-270m", "gemma3")])
def test_real_recipe_shape_loads_in_llama_cpp(recipe_name: str, family: str, tmp_path: pathlib.Path) -> None:
    from ignition.cli import recipe_module
    from ignition.sources.packaged import PackagedSourceError

    recipe = recipe_module(recipe_name)
    try:
        source = recipe.SOURCE.assemble()        # checks size and sha256
    except PackagedSourceError as error:
        pytest.skip(str(error))
    shape = gguf_shape.write_shape(source, tmp_path / f"{recipe_name}.shape.gguf.xz")
    assert shape.stat().st_size < 4 << 20       # travels beside the bundles in one 64 MiB call
    random = gguf_shape.write_random(shape, tmp_path / f"{recipe_name}.f16.gguf")
    assert_same_shape(source, random)
    llama_cpp_completes(random, family, source)


# ---- the peer bench's parsing (formats of llama.cpp 0c1e5709's tools) ----------------------------

LLAMA_BENCH_JSON = """[
  {"build_commit": "0c1e5709", "gpu_info": "NVIDIA H200", "model_type": "qwen2 1B F16", "model_size": 1266000000,
   "model_n_params": 630000000, "n_gpu_layers": 99, "flash_attn": 1, "n_prompt": 512, "n_gen": 0, "n_depth": 0,
   "avg_ns": 5000000, "stddev_ns": 10000, "avg_ts": 102400.5, "stddev_ts": 200.0, "samples_ts": [102400.5]},
  {"build_commit": "0c1e5709", "gpu_info": "NVIDIA H200", "model_type": "qwen2 1B F16", "model_size": 1266000000,
   "model_n_params": 630000000, "n_gpu_layers": 99, "flash_attn": 1, "n_prompt": 0, "n_gen": 128, "n_depth": 0,
   "avg_ns": 250000000, "stddev_ns": 10000, "avg_ts": 512.0, "stddev_ts": 3.0, "samples_ts": [512.0]}
]
"""
BATCHED_LINE = ('{"n_kv_max": 32768, "n_batch": 2048, "n_ubatch": 512, "flash_attn": 1, "is_pp_shared": 0, '
                '"n_gpu_layers": 99, "n_threads": 16, "n_threads_batch": 16, "pp": 128, "tg": 128, "pl": %d, '
                '"n_kv": %d, "t_pp": 0.010000, "speed_pp": %f, "t_tg": 1.000000, "speed_tg": %f, "t": 1.01, '
                '"speed": 300.0}')


def test_llama_bench_json_is_read_per_test() -> None:
    parsed = parse_llama_bench("ggml_cuda_init: found 1 CUDA devices\n" + LLAMA_BENCH_JSON)
    assert parsed["pp512"]["tokens_per_s"] == 102400.5
    assert parsed["tg128"]["tokens_per_s"] == 512.0
    assert parsed["tg128"]["gpu_info"] == "NVIDIA H200"


def test_batched_bench_lines_are_read_per_batch() -> None:
    text = "\n".join(["llama_model_loader: loaded meta data", "main: n_kv_max = 32768",
                      BATCHED_LINE % (1, 256, 12800.0, 400.0), BATCHED_LINE % (8, 2048, 90000.0, 2500.0),
                      "", BATCHED_LINE % (64, 16384, 99000.0, 9000.0), "llama_perf_context_print: done"])
    parsed = parse_batched_bench(text)
    assert sorted(parsed) == [1, 8, 64]
    assert parsed[8]["decode_tokens_per_s"] == 2500.0
    assert parsed[64]["n_kv"] == 16384


def test_ratios_are_ours_over_llama_cpp_and_the_report_prints_them() -> None:
    peer = {"llama_bench": parse_llama_bench(LLAMA_BENCH_JSON),
            "batched_bench": parse_batched_bench("\n".join(BATCHED_LINE % (b, 256 * b, 1e4, s)
                                                           for b, s in ((1, 400.0), (8, 2500.0), (64, 9000.0)))),
            "commands": ["llama-bench ...", "llama-batched-bench ..."]}
    ours = {"decode": {1: 1024.0, 8: 5000.0, 64: 27000.0}, "prefill": 51200.25, "command": "gpu_decode.py ..."}
    q = ratios(ours, peer)
    assert q == {"decode_b1_vs_tg128": 2.0, "prefill_512_vs_pp512": 0.5, "decode_b1_vs_batched": 2.56,
                 "decode_b8_vs_batched": 2.0, "decode_b64_vs_batched": 3.0}
    # a figure the peer did not give has no ratio (not a zero)
    assert ratios(ours, dict(peer, batched_bench={}))["decode_b8_vs_batched"] is None
    report = {"device": "NVIDIA H200",
              "recipes": {"qwen2.5-coder-0.5b-instruct": {"ours": ours, "llama_cpp": peer, "ratios": q},
                          "gemma-3-270m": {"llama_cpp": peer}},       # ours failed: no ratio row
              "failed": {"gemma-3-270m ours": "gpu_decode.py exited 1:\nerror"}}
    lines = format_report(report).splitlines()
    qwen = [line for line in lines if line.startswith("qwen2.5-coder-0.5b-instruct ")]
    assert [line.split()[-1] for line in qwen[:5]] == ["x2.00", "x2.56", "x2.00", "x3.00", "x0.50"]
    gemma = [line for line in lines if line.startswith("gemma-3-270m ")]
    assert len(gemma) == 6 and "FAILED" in gemma[-1]
    assert [line.split()[-3:] for line in gemma[:5]][1] == ["-", "400", "-"]   # llama.cpp's figure, no ratio
    json.dumps(report)                                       # the report is written as JSON


def test_our_figures_are_read_from_gpu_decode_json() -> None:
    # an H200 run of bench/gpu_decode.py on the gemma-3-270m bundle (batches 1, 8, 64; prefill 512)
    report = json.loads((pathlib.Path(__file__).parent / "fixtures"
                         / "gpu_decode_gemma3_h200.json").read_text())
    ours = read_ours(report)
    assert sorted(ours["decode"]) == [1, 8, 64]
    assert ours["decode"][64] == report["decode"]["64"]["tokens_per_s"] > ours["decode"][1]
    assert ours["prefill"] == report["prefill"]["512"]["tokens_per_s"]


# ---- layouts: a config.json alone (bench/layouts/) ------------------------------------------------

def test_layout_shape_lists_the_tensors_of_the_real_model(tmp_path: pathlib.Path) -> None:
    """The SmolLM2 layout's table is the real SmolLM2 GGUF's (names and dimensions), with F16
    matrices and F32 vectors, and a stand-in vocabulary of the config's size."""
    from ignition.sources.gguf import default_gguf_path

    shape = gguf_shape.write_layout_shape(LAYOUTS / "smollm2-135m.json", tmp_path / "s.shape.gguf")
    reader = gguf.GGUFReader(str(shape))
    real = gguf.GGUFReader(str(default_gguf_path()))
    assert dict(gguf_shape.tensor_table(reader)) == {t.name: tuple(int(d) for d in t.shape) for t in real.tensors}
    types = dict(zip(reader.fields[gguf_shape.NAMES].contents(), reader.fields[gguf_shape.TYPES].contents()))
    assert types["blk.0.ffn_up.weight"] == gguf_shape.GGML_F16 and types["blk.0.attn_norm.weight"] == gguf_shape.GGML_F32
    for key in ("llama.block_count", "llama.embedding_length", "llama.feed_forward_length",
                "llama.attention.head_count", "llama.attention.head_count_kv", "llama.rope.dimension_count"):
        assert reader.fields[key].contents() == real.fields[key].contents(), key
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == 49152 and tokens[:3] == ["<unk>", "<s>", "</s>"] and tokens[3 + 0x0A] == "<0x0A>"


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_a_small_layout_becomes_a_random_file_llama_cpp_runs(model_type: str, tmp_path: pathlib.Path) -> None:
    config = {"model_type": model_type, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": model_type == "qwen2"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    shape = gguf_shape.write_layout_shape(path, tmp_path / "small.shape.gguf.xz")
    random = gguf_shape.write_random(shape, tmp_path / "small.f16.gguf")
    reader = gguf.GGUFReader(str(random))
    _, table = gguf_shape.layout_table(config)
    assert [(t.name, tuple(int(d) for d in t.shape)) for t in reader.tensors] == [(n, ne) for n, ne, _ in table]
    assert reader.fields["general.architecture"].contents() == model_type
    llama_cpp = pytest.importorskip("llama_cpp")
    model = llama_cpp.Llama(str(random), n_ctx=64, n_batch=32, n_threads=2, verbose=False, logits_all=True)
    assert (model.n_vocab(), model.n_embd()) == (512, 64)
    model.eval([5, 6, 7])
    assert np.isfinite(np.array(model.scores[model.n_tokens - 1])).all()


@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "llama-3.1-8b"])
def test_layout_shapes_follow_their_config(name: str) -> None:
    config = json.loads((LAYOUTS / f"{name}.json").read_text())
    arch, table = gguf_shape.layout_table(config)
    dims = {n: ne for n, ne, _ in table}
    d, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or d // heads
    assert arch == config["model_type"]
    assert dims["token_embd.weight"] == (d, config["vocab_size"])
    assert dims[f"blk.{config['num_hidden_layers'] - 1}.attn_k.weight"] == (d, kv * head_dim)
    assert dims["blk.0.ffn_down.weight"] == (config["intermediate_size"], d)
    assert ("output.weight" in dims) == (not config["tie_word_embeddings"])
    assert ("blk.0.attn_q.bias" in dims) == (arch == "qwen2")


def test_a_family_without_a_llama_cpp_table_is_refused() -> None:
    with pytest.raises(ValueError, match="model_type 'gemma3'"):
        gguf_shape.layout_table({"model_type": "gemma3"})


def test_the_fastest_micro_batch_counts_and_kernel_shape_figures_reach_the_rows(tmp_path: pathlib.Path) -> None:
    records = json.loads(LLAMA_BENCH_JSON)
    slower = dict(records[0], n_ubatch=512, avg_ts=90000.0)
    faster = dict(records[0], n_ubatch=2048, avg_ts=120000.0)
    parsed = parse_llama_bench(json.dumps([slower, faster, records[1]]))
    assert parsed["pp512"]["tokens_per_s"] == 120000.0 and parsed["pp512"]["n_ubatch"] == 2048
    assert parse_llama_bench(json.dumps([faster, slower]))["pp512"]["n_ubatch"] == 2048
    from bench.kernels import read_llama_cpp

    path = tmp_path / "llama_cpp_layouts.json"
    path.write_text(json.dumps({"device": "NVIDIA H100", "layouts": {
        "qwen2.5-0.5b": {"decode": {"1": 900.0, "16": None}, "prefill": {"512": 50000.0}}}}))
    report, figures = read_llama_cpp(path)
    assert figures == {("qwen2.5-0.5b", "decode", 1): 900.0, ("qwen2.5-0.5b", "prefill", 512): 50000.0}
    assert report["device"] == "NVIDIA H100"
    assert read_llama_cpp(None) == ({}, {})
