"""Tensor-parallel ranks as processes (RankPeers::Processes, OWN-15), on the numpy executor.

Rank 0 is this test process (NativeModel.load / Engine.start with rank_peers=processes); rank 1
is a real `helios-rank` process on the same TP=2 core, joined through rank 0's TCP store. The
all-reduce between the processes goes over the rank link (ranks/reduce.py), so the TP=2
process pair gives the TP=1 core's greedy tokens for 64 steps and the thread mode's logits
bit for bit. Startup, a rank refused at rendezvous, a killed rank and a rank that stops
answering each have a test.
"""
from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
from typing import Iterator

import numpy as np
import pytest

from helios_backend.engine.bootstrap import Bootstrap
from helios_backend.engine.model import ModelOptions, NativeModel
from helios_backend.ranks.rendezvous import RendezvousError
from tests.engine_fixtures import ACCEPTANCE, cached_core, engine_test_options
from tests.gpu.tensor_parallel import RANK_STATE, greedy_with_logits, rank_disagreements

DEGREE = 2
STEPS = 64
PROMPTS = [[1, 9690, 198, 504, 3575, 282], [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198]]
LOGIT_TOLERANCE = 1e-3       # TP=2 against TP=1: f32 rounding of the split projections (test_tensor_parallel)
PEER_EXIT_S = 60             # a bound for waits that only end when something went wrong


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RankProcess:
    """`helios-rank` for one peer rank, killed at exit if it still runs."""

    def __init__(self, core: pathlib.Path, port: int, rank: int = 1, executor: str = "numpy") -> None:
        self.argv = [sys.executable, "-m", "helios_backend.cli.rank", "--core", str(core), "--rank", str(rank),
                     "--store", f"127.0.0.1:{port}", "--executor", executor, "--acceptance", ACCEPTANCE,
                     "--join-timeout", "120"]
        self.process = subprocess.Popen(self.argv, stderr=subprocess.PIPE, text=True)
        self.stderr = ""

    def wait(self, timeout: float = PEER_EXIT_S) -> int:
        _, self.stderr = self.process.communicate(timeout=timeout)
        return self.process.returncode

    def __enter__(self) -> "RankProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.wait()


@pytest.fixture(scope="module")
def tp_core(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return cached_core(f"smollm2-tp{DEGREE}-test", engine_test_options(tensor_parallel=DEGREE), tmp_path_factory)


@pytest.fixture(scope="module")
def tp_bootstrap(tp_core: pathlib.Path) -> Iterator[Bootstrap]:
    bootstrap = Bootstrap.load(tp_core, ACCEPTANCE)
    yield bootstrap
    bootstrap.close()


def process_options(bootstrap: Bootstrap, port: int) -> ModelOptions:
    return ModelOptions(cache_pages=128, executor="numpy", rank_peers="processes", rank_store=f"127.0.0.1:{port}",
                        core_digest=bootstrap.core.content_digest(), rank_join_timeout_s=120)


@pytest.fixture(scope="module")
def process_model(tp_core: pathlib.Path, tp_bootstrap: Bootstrap) -> Iterator[tuple[NativeModel, RankProcess]]:
    port = free_port()
    with RankProcess(tp_core, port) as peer:
        model = NativeModel.load(tp_bootstrap.contract, tp_bootstrap.manifest, tp_bootstrap.read_resource,
                                 process_options(tp_bootstrap, port))
        try:
            yield model, peer
        finally:
            model.close()


def test_a_rank_process_joins_and_loads_its_own_rank(process_model, tp_bootstrap):
    # spec: OWN-10, OWN-11, OWN-15
    model, peer = process_model
    executor = model.executor
    assert executor.world_size == DEGREE and len(executor.links) == 1 and peer.process.poll() is None
    # each rank's geometry comes from its own loading: rank 1 holds 1 of the 3 KV heads
    assert [g.rank for g in model.manifests] == [0, 1]
    assert model.manifests[0].arena_nbytes > model.manifests[1].arena_nbytes
    assert model.manifests[1].cache_pages == model.manifests[0].cache_pages == 128
    thread = NativeModel.load(tp_bootstrap.contract, tp_bootstrap.manifest, tp_bootstrap.read_resource,
                              ModelOptions(cache_pages=128))
    try:
        assert [dict(g.buffer_offsets) for g in model.manifests] == [dict(g.buffer_offsets) for g in thread.manifests]
        assert [g.arena_nbytes for g in model.manifests] == [g.arena_nbytes for g in thread.manifests]
    finally:
        thread.close()
    # rank 1's weights are rank 1's shard (read over its link), not rank 0's
    name = "weights.layers.0.attn_output"
    assert executor.read_buffer(name, rank=1).nbytes * 2 == executor.read_buffer(name, rank=0).nbytes


def test_two_rank_processes_equal_tp1_for_64_greedy_steps(process_model, smollm2_model, tp_bootstrap):
    # spec: OWN-15, OWN-14
    model, _ = process_model
    tokens, logits = greedy_with_logits(model, PROMPTS, STEPS)
    tp1_tokens, tp1_logits = greedy_with_logits(smollm2_model, PROMPTS, STEPS)
    assert all(len(t) == STEPS for t in tokens)
    assert tokens == tp1_tokens
    assert np.abs(logits - tp1_logits).max() <= LOGIT_TOLERANCE
    # every rank drew the same token: rank 1's state, read over its link, is rank 0's
    assert rank_disagreements(model, RANK_STATE + ("scratch.logits",)) == []
    # the star all-reduce sums in the lockstep's order: the thread mode, bit for bit
    thread = NativeModel.load(tp_bootstrap.contract, tp_bootstrap.manifest, tp_bootstrap.read_resource,
                              ModelOptions(cache_pages=128))
    try:
        thread_tokens, thread_logits = greedy_with_logits(thread, PROMPTS, STEPS)
    finally:
        thread.close()
    assert thread_tokens == tokens and np.array_equal(thread_logits, logits)


def test_a_rank_whose_completion_differs_fails_the_round_on_every_rank(process_model):
    # spec: SPEC-31: validation agreement: one rank's different completion, no rank commits
    from helios_backend.lockstep.generator import GenerationRequest, LockstepGenerator
    from helios_backend.ranks.wire import Kind
    from helios_backend.scheduler.errors import CompletionMismatch

    model, peer = process_model
    executor = model.executor
    link = executor.links[0]
    receive = link.receive

    def tampered(kind):  # type: ignore[no-untyped-def]
        message = receive(kind)
        if kind != Kind.COMPLETION:
            return message
        words = bytearray(message.payload)
        words[-4:] = b"\xff\xff\xff\x7f"
        return message._replace(payload=bytes(words))

    link.receive = tampered   # type: ignore[method-assign]
    try:
        with pytest.raises(CompletionMismatch, match=r"ranks \[1\] completed the step differently.*no rank commits"):
            LockstepGenerator(model).generate([GenerationRequest(PROMPTS[0], 2)])
    finally:
        del link.receive
    assert executor.lost is None and peer.process.poll() is None     # the ranks stay in step


def test_the_cuda_executor_of_one_rank_process_joins_nccl_from_rank_zeros_id(tp_bootstrap, monkeypatch):
    """Each process's CudaExecutor owns one rank: its own graphs and communicator from the id
    rank 0 sent, and the cache pages agreed over both (fake driver and NCCL, no GPU)."""
    # spec: OWN-15
    from helios_backend.executors import cuda_executor
    from tests.test_tensor_parallel import _FakeNccl, _StreamCaptureDriver, with_stand_in_module

    manifest = with_stand_in_module(tp_bootstrap.manifest)
    fake = _StreamCaptureDriver()
    ids: list[bytes] = []

    class Nccl(_FakeNccl):
        def unique_id_from(self, data: bytes) -> bytes:
            ids.append(data)
            return data

    monkeypatch.setattr(cuda_executor, "Nccl", lambda: Nccl(fake))
    offers: dict[int, int] = {}
    both = threading.Barrier(DEGREE)

    def agree(rank: int):  # type: ignore[no-untyped-def]
        def pages(mine: int) -> int:
            offers[rank] = mine                     # rank 0 (2 of 3 KV heads) fits fewer pages
            both.wait()
            return min(offers.values())
        return pages

    def read(resource: str) -> bytes:
        return b"\0" * 64 if resource == "fake.cubin" else tp_bootstrap.read_resource(resource)

    executors: dict[int, object] = {}
    uid = bytes(range(128))

    def start(rank: int) -> None:
        executors[rank] = cuda_executor.CudaExecutor(manifest, read, cuda_executor.CudaExecutorOptions(
            programs=frozenset({"decode.r1.t1"}), local_ranks=(rank,), devices=(rank,)), driver=fake,
            nccl_unique_id=uid, agree_pages=agree(rank))

    threads = [threading.Thread(target=start, args=(rank,)) for rank in range(DEGREE)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    try:
        assert sorted(executors) == [0, 1] and ids == [uid, uid]
        pages = {rank: e.cache_pages for rank, e in executors.items()}       # type: ignore[attr-defined]
        assert pages[0] == pages[1] == min(offers.values()) and offers[0] < offers[1]
        for rank, executor in executors.items():
            [own] = executor._ranks                                          # type: ignore[attr-defined]
            assert own.rank == rank and own.comm == 100 + rank
            assert executor.buffer_offsets(rank)                             # type: ignore[attr-defined]
            with pytest.raises(KeyError, match="not one of this process's ranks"):
                executor.buffer_offsets(1 - rank)                            # type: ignore[attr-defined]
        assert len(fake.graphs) == DEGREE * manifest.transport.frames        # one rank's graphs per process
    finally:
        for executor in executors.values():
            executor.close()                                                 # type: ignore[attr-defined]


def test_closing_rank_zero_ends_the_rank_process_cleanly(tp_core, tp_bootstrap):
    port = free_port()
    with RankProcess(tp_core, port) as peer:
        model = NativeModel.load(tp_bootstrap.contract, tp_bootstrap.manifest, tp_bootstrap.read_resource,
                                 process_options(tp_bootstrap, port))
        model.close()
        assert peer.wait() == 0, peer.stderr[-2000:]


@pytest.mark.parametrize("case", ["another core", "another executor"])
def test_a_rank_with_another_core_or_executor_is_refused_at_rendezvous(tp_core, tp_bootstrap, smollm2_core, case):
    # spec: OWN-15
    port = free_port()
    core, executor, field = (smollm2_core, "numpy", "world_size") if case == "another core" else \
        (tp_core, "cpu", "executor")
    with RankProcess(core, port, executor=executor) as peer:
        with pytest.raises(RendezvousError) as error:
            NativeModel.load(tp_bootstrap.contract, tp_bootstrap.manifest, tp_bootstrap.read_resource,
                             process_options(tp_bootstrap, port))
        code = peer.wait()
    message = f"rank 1 refused at rendezvous: {field} differs"
    assert message in str(error.value)
    assert code == 3 and message in peer.stderr, peer.stderr[-2000:]


def test_a_rank_whose_contract_differs_is_refused():
    # spec: OWN-15
    from helios_backend.ranks.rendezvous import RankIdentity

    mine = RankIdentity(world_size=2, core="a" * 64, contract="b" * 64, executor="numpy")
    other = RankIdentity(world_size=2, core="a" * 64, contract="c" * 64, executor="numpy")
    assert mine.mismatch(mine) is None
    assert mine.mismatch(other) == "contract differs: rank 0 has bbbbbbbbbbbbbbbb, the joining rank cccccccccccccccc"


# ---- failure: the serving runtime with a rank process that dies or stops answering -------------

class Collect:
    """A response sender: tokens, the final event, and an event once the first token came."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.final: object = None
        self.first = threading.Event()
        self.done = threading.Event()

    def send(self, arrays, final):  # type: ignore[no-untyped-def]
        from helios_backend.exchange import OUT_EVENT, OUT_TOKENS, decode_event
        self.tokens.extend(arrays[OUT_TOKENS].tolist())
        if self.tokens:
            self.first.set()
        if final:
            self.final = decode_event(arrays[OUT_EVENT])
            self.done.set()

    def is_cancelled(self) -> bool:
        return False


def _serve_and_lose_the_rank(tp_core: pathlib.Path, lose: signal.Signals, rank_timeout: float) -> tuple[list, object]:
    from helios_backend.engine.engine import Engine
    from helios_backend.engine.responses import Stream
    from helios_backend.engine.settings import StartupOptions
    from helios_backend.scheduler.request import RequestSpec, SamplingSettings

    port = free_port()
    with RankProcess(tp_core, port) as peer:
        runtime = Engine.start(StartupOptions(tp_core, ACCEPTANCE, executor="numpy", rank_peers="processes",
                                              rank_store=f"127.0.0.1:{port}", rank_timeout=rank_timeout,
                                              page_capacity=128))
        try:
            assert runtime.healthy
            senders = [Collect() for _ in PROMPTS]
            for serial, (prompt, sender) in enumerate(zip(PROMPTS, senders), start=1):
                runtime.add_request(RequestSpec(tuple(prompt), 400, SamplingSettings(temperature=0.0), ignore_eos=True),
                                    Stream(serial, sender))
            assert all(s.first.wait(PEER_EXIT_S) for s in senders)     # both are generating
            os.kill(peer.process.pid, lose)
            assert all(s.done.wait(PEER_EXIT_S) for s in senders)
            late = Collect()
            runtime.add_request(RequestSpec(tuple(PROMPTS[0]), 4, SamplingSettings()), Stream(9, late))
            assert late.done.wait(PEER_EXIT_S)
            healthy = runtime.healthy
        finally:
            runtime.stop(drain=False)
            if lose == signal.SIGSTOP:
                os.kill(peer.process.pid, signal.SIGKILL)
    assert not healthy                                   # the model turned unhealthy (the stub reports it red)
    finals = [s.final for s in senders]
    for sender, final in zip(senders, finals):
        assert final.terminal.WhichOneof("outcome") == "failed", final      # type: ignore[attr-defined]
        assert len(sender.tokens) < 400
    assert late.final.terminal.WhichOneof("outcome") == "rejected"         # type: ignore[attr-defined]
    return finals, late.final


@pytest.mark.slow
def test_a_killed_rank_fails_every_request_and_turns_the_model_unhealthy(tp_core):
    # spec: OWN-15
    finals, _ = _serve_and_lose_the_rank(tp_core, signal.SIGKILL, rank_timeout=30)
    for final in finals:
        message = final.terminal.failed.message          # type: ignore[attr-defined]
        assert "rank 1 lost" in message and ("closed its connection" in message or "broke" in message), message


@pytest.mark.slow
def test_a_rank_that_stops_answering_fails_every_request_within_the_bound(tp_core):
    # spec: OWN-15
    finals, _ = _serve_and_lose_the_rank(tp_core, signal.SIGSTOP, rank_timeout=3)
    for final in finals:
        message = final.terminal.failed.message          # type: ignore[attr-defined]
        assert "rank 1 lost: did not answer within 3.0s" in message, message
