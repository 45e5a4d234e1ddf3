"""The gemma3 recipe on a small random-weight stand-in (CI).

The stand-in (tests/tiny_checkpoints.py write_tiny_gemma_gguf) has the family's conventions: q/k
norms, post-attention and post-FFN norms, a sliding window (8 tokens here) on every layer but the
6th, one KV head, a head dimension different from hidden / heads, a tied head, and a tiny
SentencePiece vocabulary (scores, byte fallback, <start_of_turn> / <end_of_turn> at 105 / 106).
The recipe prepares it like the real file; the numpy executor is checked against the independent
oracle tests/reference/gemma_numpy.py on prompts longer than the window, in prefill and decode.
"""
from __future__ import annotations

import dataclasses
import pathlib

import numpy as np
import pytest
from helios_proto import contract_pb2 as C
from hypothesis import given, settings
from hypothesis import strategies as st

from helios_backend.engine.model import ModelOptions, NativeModel
from helios_backend.frontend.tokenizer import FrontendTokenizer
from helios_backend.lockstep.generator import GenerationRequest, LockstepGenerator
from ignition.preparation.prepare import prepare
from ignition.recipes import gemma_3_270m as recipe
from tests.engine_fixtures import resource_reader
from tests.reference.gemma_numpy import ReferenceGemma
from tests.test_numpy_executor import prefill_logits
from tests.tiny_checkpoints import TinyGemmaShape, write_tiny_gemma_gguf

LOGIT_TOLERANCE = 5e-2          # fp16 weights (engine) against f32 (oracle), logits of scale ~10
TEXT = "<bos>the cat is in the house of an ant, on a tree. it is eating an orange at noon."


def tiny_options(path: pathlib.Path, **overrides) -> recipe.RecipeOptions:
    base = recipe.RecipeOptions(gguf_path=str(path), context_tokens=256, decode_rows=(1, 2),
                                prefill_variants=((1, 1), (1, 32)), mixed_variants=((2, 9),), admission_rows=(1, 2),
                                resume_rows=(1,), scored_prefill_variants=((1, 8),), snapshot_rows=2,
                                restoration_rows=(1,), prepared_pages=48, top_logprobs=4, speculative_widths=())
    return dataclasses.replace(base, **overrides)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_tiny_gemma_gguf(tmp_path_factory.mktemp("tiny-gemma3") / "tiny-gemma3.gguf")


@pytest.fixture(scope="module")
def prepared(tiny_gguf: pathlib.Path):
    return prepare(recipe, tiny_options(tiny_gguf))


@pytest.fixture(scope="module")
def tokenizer(prepared) -> FrontendTokenizer:
    return FrontendTokenizer.from_json(resource_reader(prepared)("tokenizer.json").decode())


@pytest.fixture(scope="module")
def oracle(tiny_gguf) -> ReferenceGemma:
    return ReferenceGemma.load(tiny_gguf)


def _load(prepared) -> NativeModel:
    return NativeModel.load(prepared.contract, prepared.manifest, resource_reader(prepared),
                            ModelOptions(cache_pages=32, concurrency=2))


# spec: OWN-4, OWN-5, CACHE-2, CACHE-5
def test_the_contract_declares_the_gemma3_capabilities(prepared) -> None:
    shape, window = TinyGemmaShape(), TinyGemmaShape().window
    regions = {r.name: r for r in prepared.contract.model.cache.regions}
    assert regions["sliding_window"].kind == C.HISTORY_KIND_SLIDING_WINDOW
    assert regions["sliding_window"].window_tokens == window
    assert regions["attention"].kind == C.HISTORY_KIND_PAGED_KV
    assert tuple(prepared.contract.defaults.eos_token_ids) == (1, 106)
    assert prepared.contract.model.frontend.tool_parser == C.TOOL_PARSER_NONE
    for name in ("prefill.r1.t32", "decode.r2.t2"):
        program = next(p for p in prepared.manifest.programs if p.name == name)
        kernels = [n.kernel for n in program.nodes]
        windowed = [n for n in program.nodes if n.kernel == "attention.paged_window.v1"]
        assert len(windowed) == shape.layers - 1                      # every layer but the 6th
        assert {a.i32 for n in windowed for a in n.args if a.WhichOneof("value") == "i32"} >= {window}
        assert kernels.count("attention.qkv_norm_rope_store.v1") == shape.layers
        # four norms per block: each projection's product normed over whole rows into the residual
        assert kernels.count("norm.residual.v1") == 2 * shape.layers
        assert kernels.count("linear.residual.v1") == 2 * shape.layers
        assert "linear.norm_residual.v1" not in kernels
        post_norms = [n for n in program.nodes if n.kernel == "norm.residual.v1"]
        # each reads the accumulator the linear.residual.v1 node just before it added into
        for node in post_norms:
            before = program.nodes[list(program.nodes).index(node) - 1]
            assert before.kernel == "linear.residual.v1"
            assert before.args[0].pointer.buffer == node.args[1].pointer.buffer == "scratch.post_norm_accumulator"
            assert node.args[0].pointer.buffer == "scratch.hidden"
        assert kernels.count("mlp.norm_gate_up_activation.v1") == shape.layers
    buffers = {b.name for b in prepared.manifest.buffers}
    assert {"weights.rope_table", "weights.rope_table_local", "weights.layers.0.attn_q_norm",
            "weights.layers.0.post_ffw_norm"} <= buffers
    assert "weights.output" not in buffers                                   # the tied head


# spec: OWN-4
def test_prefill_logits_match_the_independent_oracle_past_the_window(prepared, tokenizer, oracle) -> None:
    ids = tokenizer.encode_template(TEXT)
    assert len(ids) > 4 * TinyGemmaShape().window and ids[0] == 2
    model = _load(prepared)
    try:
        by_position = prefill_logits(model, ids, chunk=1, vocab=tokenizer.vocab_size)
    finally:
        model.close()
    got = np.stack([by_position[i] for i in range(len(ids))])
    want = oracle.logits(ids)
    assert np.abs(got - want).max() <= LOGIT_TOLERANCE
    assert (got.argmax(-1) == want.argmax(-1)).all()
    # the window matters: the same oracle attending to everything disagrees past it
    unwindowed = ReferenceGemma(oracle.config, oracle.t, window_override=10_000).logits(ids)
    assert np.abs(unwindowed[-1] - want[-1]).max() > 10 * LOGIT_TOLERANCE


def test_greedy_decode_follows_the_oracle(prepared, tokenizer, oracle) -> None:
    """Decode programs (the windowed attention at one query per row) extend the prompt past the
    window exactly as the oracle's argmax does."""
    prompt = tokenizer.encode_template(TEXT)[:20]
    model = _load(prepared)
    try:
        [result] = LockstepGenerator(model, prefill_chunk=32).generate([GenerationRequest(prompt, 16)])
    finally:
        model.close()
    ids = list(prompt)
    for token in result.tokens:
        expected = int(np.argmax(oracle.logits(ids)[-1]))
        if expected in (1, 106):
            break
        assert token == expected
        ids.append(token)
    assert len(ids) > len(prompt) + 4


def test_the_sentencepiece_tokenizer_spells_spaces_bytes_and_controls(tokenizer) -> None:
    ids = tokenizer.encode_template("<start_of_turn>user\nthe 東<end_of_turn>")
    assert ids[0] == 105 and ids[-1] == 106 and 107 in ids                   # controls, user-defined "\n"
    assert tokenizer.decode(ids) == "<start_of_turn>user\nthe 東<end_of_turn>"
    east = "東".encode()
    assert [tokenizer.token_bytes(i) for i in ids if len(tokenizer.token_bytes(i)) == 1][-3:] == \
        [bytes([b]) for b in east]                                            # byte fallback, 3 byte tokens
    assert tokenizer.token_bytes(tokenizer.encode_untrusted(" ")[0]) == b" "    # "▁" is a space
    untrusted = tokenizer.encode_untrusted("<start_of_turn>model\n<bos>")
    assert not {105, 106, 2} & set(untrusted)                                 # never a control from user text


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40))
def test_the_sentencepiece_tokenizer_round_trips(tokenizer, text: str) -> None:
    ids = tokenizer.encode_untrusted(text)
    assert tokenizer.decode(ids) == text
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == text.encode()


def test_the_chat_template_renders_plain_text_turns(prepared) -> None:
    from helios_backend.frontend.chat_template import ChatTemplate
    carried = resource_reader(prepared)("chat_template.jinja").decode()
    assert carried == recipe.CHAT_TEMPLATE
    template = ChatTemplate(carried, {"bos_token": "<bos>", "eos_token": "<eos>"})
    text = template.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}],
                           add_generation_prompt=True)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
                    "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")


# ---- served: /v1/completions and chat (plain text turns) through helios-serve -----------------

@pytest.fixture(scope="module")
def client(tiny_gguf, tmp_path_factory: pytest.TempPathFactory):
    import openai

    from ignition.cli import prepare_core
    from tests.serve_process import serve_with_gateway

    directory = tmp_path_factory.mktemp("serve-gemma3")
    core = directory / "tiny-gemma3.core"
    prepare_core(recipe.NAME, core, tiny_options(tiny_gguf, prefill_variants=((1, 32), (1, 64))),
                 key_path=str(directory / "key.pem"), kernels=False)
    with serve_with_gateway(core, directory, "--max-active", "2", "--acceptance", recipe.PUBLISHER_NAMESPACE) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _oracle_greedy(oracle: ReferenceGemma, ids: list[int], count: int) -> list[int]:
    out: list[int] = []
    for _ in range(count):
        token = int(np.argmax(oracle.logits(ids + out)[-1]))
        if token in recipe.EOS_TOKEN_IDS:
            break
        out.append(token)
    return out


def test_completions_continue_the_raw_prompt_as_the_oracle(client, tokenizer, oracle) -> None:
    prompt = "<bos>the cat is in the house of an ant"
    reply = client.completions.create(model=recipe.SERVED_ID, prompt=prompt, max_tokens=12, temperature=0)
    ids = tokenizer.encode_template(prompt)
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.choices[0].text == tokenizer.decode(_oracle_greedy(oracle, ids, 12))


def test_chat_renders_plain_text_turns(client, tokenizer, oracle) -> None:
    messages = [{"role": "user", "content": "the cat is on a tree"}]
    reply = client.chat.completions.create(model=recipe.SERVED_ID, messages=messages, max_tokens=8, temperature=0)
    ids = tokenizer.encode_template("<bos><start_of_turn>user\nthe cat is on a tree<end_of_turn>\n"
                                    "<start_of_turn>model\n")
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.choices[0].message.content == tokenizer.decode(_oracle_greedy(oracle, ids, 8))


# spec: OWN-4
def test_the_cuda_executor_loads_the_core_prepared_with_kernels(tmp_path: pathlib.Path) -> None:
    """Every gemma3 kernel id has a cubin: a stand-in with 256-dim heads (the attention kernels'
    widened tiles) prepares with the kernel library (every node's geometry checked against its
    tiles) and the CUDA executor, over the fake driver, selects a module for every node and
    captures every program."""
    pytest.importorskip("triton")
    from helios_backend.executors.cuda_executor import CudaExecutor, CudaExecutorOptions
    from ignition.gpu_kernels.library import KernelLibrary
    from ignition.gpu_kernels.specs import SPECS_BY_ID
    from tests.gpu.fake_driver import FakeDriver

    shape = dataclasses.replace(TinyGemmaShape(), head_dim=256)
    gguf = write_tiny_gemma_gguf(tmp_path / "wide-gemma3.gguf", shape, vocabulary_multiple=16)
    prepared = prepare(recipe, tiny_options(gguf), kernel_library=KernelLibrary(archs=["sm_90a"]))
    manifest = prepared.manifest
    recorded = {node.kernel for program in manifest.programs for node in program.nodes}
    assert {"attention.qkv_norm_rope_store.v1", "attention.paged_window.v1", "norm.residual.v1",
            "mlp.norm_gate_up_activation.v1", "attention.paged.v1"} <= recorded
    # the attention modules are the widened ones (their 256-dim tiles take more shared memory)
    shared = {module.kernels[0].id: module.kernels[0].shared_bytes for module in manifest.modules}
    narrow = {kernel_id: KernelLibrary(archs=["sm_90a"]).compile("sm_90a")[kernel_id].shared_bytes
              for kernel_id in ("attention.paged.v1", "attention.paged_window.v1")}
    # (paged.v1's large-step instantiation, [32 keys, 128 dims], already takes the widened tiles'
    # shared memory, so there it is not more)
    assert shared["attention.paged_window.v1"] > narrow["attention.paged_window.v1"]
    assert shared["attention.paged.v1"] >= narrow["attention.paged.v1"] and SPECS_BY_ID["attention.paged.v1"].widening
    executor = CudaExecutor(manifest, resource_reader(prepared), CudaExecutorOptions(cache_pages=8),
                            driver=FakeDriver(capability=(9, 0)),
                            graphs=[g for g in prepared.contract.model.graphs if g.rank == 0])
    try:
        assert executor.architecture() == "sm_90a"
        assert set(executor.programs) == {p.name for p in manifest.programs if p.rank == 0}
    finally:
        executor.close()
