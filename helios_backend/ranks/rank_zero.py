"""Rank 0 of rank processes: the Executor protocol over rank 0's own executor and one link per peer.

    executor = start_rank_zero(factory, contract, manifest, read_resource, options, graphs)

Startup: open the store, gather every peer (rendezvous.py; the session names the programs,
the model options and, for CUDA, the NCCL unique id), build rank 0's own executor with the
same factory the threads mode uses (its placement: rank 0, the star reduce or NCCL, the
page agreement), then read every peer's geometry.

A step, for every peer and then rank 0:

    launch(program, f):  LAUNCH(f, program index, sequence) + the frame's runs it reads -> every peer;
                         rank 0's own launch (numpy: runs now, summing through the links)
    wait(f):             rank 0's completion words; every peer's COMPLETION of f; validation
                         agreement: the words of every rank must be rank 0's, else the round
                         fails on every rank (CompletionMismatch, SPEC-31) and nothing commits

Only rank 0's process publishes: the peers hold no requests, only their rank's device state.
A peer that dies, fails or stops answering within the link bound makes this executor lost
(ExecutorLostError): every link is closed (the other peers exit), every later launch fails
at once, and the engine fails every request (engine/loop.py).
"""
from __future__ import annotations

import json
import logging
from typing import Any, Callable, Sequence

import numpy as np
from helios_proto import contract_pb2 as C
from helios_proto import manifest_pb2 as M

from helios_backend.executors.base import (
    Executor, ExecutorLostError, FrameStateError, RankPlacement, ResourceReader, UnknownProgramError)
from helios_backend.executors.factory import ModelOptions
from helios_backend.ranks.reduce import StarReduceRoot, root_page_agreement
from helios_backend.ranks.rendezvous import RankIdentity, RankStore, RendezvousError, parse_address
from helios_backend.ranks.wire import Kind, Link, RankLostError
from helios_backend.scheduler.errors import CompletionMismatch

log = logging.getLogger("helios.ranks")
Runs = tuple[tuple[int, int], ...]

# ModelOptions fields a peer needs (the rest say how rank 0 meets its peers)
SESSION_OPTIONS = ("cache_pages", "cache_memory_share", "widen_f16_cache", "executor", "kernel_arch", "threads",
                   "vendor_products", "activations")
LocalFactory = Callable[[RankPlacement], Executor]


class ProcessRanksExecutor:
    """Executor protocol on rank 0: its own rank here, every other rank in its own process."""

    def __init__(self, local: Executor, links: Sequence[Link], programs: Sequence[str],
                 geometry: Sequence[dict[str, Any]], world_size: int, runs: dict[str, Runs]) -> None:
        self.local = local
        self.links = tuple(links)
        self.world_size = world_size
        self._index = {name: i for i, name in enumerate(programs)}
        self._runs = runs                           # program -> the frame bytes a LAUNCH carries
        self._geometry = tuple(geometry)            # ranks 1.. (what their loading produced)
        self._in_flight = [False] * local.frames
        self._sequence = 0
        self.lost: RankLostError | None = None
        for rank, g in enumerate(self._geometry, start=1):
            if g["cache_pages"] != local.cache_pages:
                raise RendezvousError(f"rank {rank} backs {g['cache_pages']} cache pages, rank 0 {local.cache_pages}")

    # ---- the protocol ----------------------------------------------------------------------
    @property
    def frames(self) -> int:
        return self.local.frames

    @property
    def auxiliary_frames(self) -> int:
        return 0                       # a launch is one message to every rank: one frame pair

    @property
    def cache_pages(self) -> int:
        return self.local.cache_pages

    @property
    def programs(self) -> frozenset[str]:
        return frozenset(self._index)

    def staging(self, frame: int) -> np.ndarray:
        return self.local.staging(frame)

    def launch(self, program: str, frame: int) -> None:
        self._check_alive()
        index = self._index.get(program)
        if index is None:
            raise UnknownProgramError(program)
        if self._in_flight[frame]:
            raise FrameStateError(f"frame {frame} still holds an unread completion")
        staging = self.local.staging(frame)
        payload = b"".join(staging[start:start + nbytes].data for start, nbytes in self._runs[program])
        try:
            for link in self.links:
                link.send(Kind.LAUNCH, frame=frame, item=index, value=self._sequence, payload=payload)
            self._sequence += 1
            self._in_flight[frame] = True
            self.local.launch(program, frame)
        except RankLostError as exc:
            raise self._lose(exc) from None
        except BaseException as exc:   # the peers run this step: the ranks are out of step now
            raise self._lose(RankLostError(0, f"rank 0's launch failed ({type(exc).__name__}: {exc})")) from exc

    def wait(self, frame: int) -> np.ndarray:
        self._check_alive()
        if not self._in_flight[frame]:
            raise FrameStateError(f"nothing submitted on frame {frame}")
        self._in_flight[frame] = False
        try:
            # the peers' words first: a CUDA step of a lost peer never ends on rank 0's device
            # (its all-reduces wait for it), while the link says so within the bound
            peers = []
            for link in self.links:
                message = link.receive(Kind.COMPLETION)
                if message.frame != frame:
                    raise RankLostError(link.rank, f"completed frame {message.frame} while rank 0 waits for {frame}")
                peers.append((link.rank, message.payload))
            words = self.local.wait(frame)
        except RankLostError as exc:
            raise self._lose(exc) from None
        mine = words.tobytes()
        disagreeing = [rank for rank, payload in peers if payload != mine]
        if disagreeing:     # validation agreement (SPEC-31): one rank's rejection, no rank commits
            raise CompletionMismatch(f"ranks {disagreeing} completed the step differently from rank 0; "
                                     "no rank commits")
        return words

    def node_count(self, program: str) -> int:
        return self.local.node_count(program)

    def buffer_offsets(self, rank: int = 0) -> dict[str, int]:
        return self.local.buffer_offsets(0) if rank == 0 else dict(self._geometry[rank - 1]["buffer_offsets"])

    def arena_nbytes(self, rank: int = 0) -> int:
        return self.local.arena_nbytes(0) if rank == 0 else int(self._geometry[rank - 1]["arena_nbytes"])

    def read_buffer(self, name: str, rank: int = 0) -> np.ndarray:
        """A copy of a rank's buffer; another rank's comes over its link (diagnostics, between steps)."""
        if rank == 0:
            return self.local.read_buffer(name, 0)
        self._check_alive()
        link = self.links[rank - 1]
        try:
            link.send(Kind.READ, payload=name.encode())
            message = link.receive(Kind.BUFFER)
        except RankLostError as exc:
            raise self._lose(exc) from None
        if message.value < 0:
            raise KeyError(name)
        return np.frombuffer(message.payload, dtype=np.uint8).copy()

    def bind_thread(self) -> None:
        self.local.bind_thread()

    def close(self) -> None:
        """Every peer is told to stop (a lost executor's links are closed already), then rank 0's own."""
        for link in self.links:
            if self.lost is None:
                try:
                    link.send(Kind.CLOSE)
                except RankLostError:
                    pass
            link.close()
        self.local.close()

    # ---- loss ------------------------------------------------------------------------------
    def _lose(self, cause: RankLostError) -> ExecutorLostError:
        if self.lost is None:
            self.lost = cause
            log.error("tensor-parallel ranks lost: %s; closing every rank link", cause)
            for link in self.links:
                link.close()
            try:
                self.local.abort()
            except Exception as exc:   # noqa: BLE001 - the loss is reported either way
                log.error("aborting rank 0's collectives failed: %s", exc)
        return ExecutorLostError(str(self.lost))

    def abort(self) -> None:
        self.local.abort()

    def _check_alive(self) -> None:
        if self.lost is not None:
            raise ExecutorLostError(str(self.lost))


def start_rank_zero(local_factory: LocalFactory, contract: C.ServingContract, manifest: M.ExecutionManifest,
                    options: ModelOptions, graphs: Sequence[C.GraphContract]) -> ProcessRanksExecutor:
    """Meet every peer at `options.rank_store`, then load rank 0 (see the module docstring).
    `options` is the engine's ModelOptions (its rank_* fields, core_digest and the SESSION_OPTIONS)."""
    world = max(1, manifest.world_size)
    identity = RankIdentity.of(contract, world, options.core_digest, options.executor)
    try:
        address = parse_address(options.rank_store)
    except ValueError as exc:
        raise RendezvousError(str(exc)) from None
    programs = sorted({g.program for g in graphs})
    from helios_backend.executors.cuda.staging_copy import launch_runs   # plain host code: no driver needed

    runs = launch_runs(manifest, graphs, programs)
    session: dict[str, Any] = {"programs": programs, "runs": {name: list(map(list, r)) for name, r in runs.items()},
                               "options": {name: getattr(options, name) for name in SESSION_OPTIONS}}
    uid = None
    if options.executor == "cuda":
        from helios_backend.executors.cuda.nccl import Nccl   # GPU builds only

        uid = Nccl().unique_id_bytes()
        session["nccl_unique_id"] = uid.hex()
    store = RankStore.open(address, identity, options.rank_join_timeout_s)
    log.info("rank 0 waits for ranks 1..%d at %s:%d", world - 1, *store.address)
    try:
        links = store.gather(session, options.rank_join_timeout_s)
    finally:
        store.close()
    try:
        placement = RankPlacement(rank=0, reduce=StarReduceRoot(links), nccl_unique_id=uid,
                                  agree_pages=root_page_agreement(links))
        local = local_factory(placement)
        try:
            geometry = [json.loads(link.receive(Kind.GEOMETRY).payload) for link in links]
            for link in links:      # loading is bounded by the join timeout, every step by this
                link.set_timeout(options.rank_timeout_s)
            return ProcessRanksExecutor(local, links, programs, geometry, world, runs)
        except BaseException:
            local.close()
            raise
    except BaseException:
        for link in links:
            link.close()
        raise


def session_options(session: dict[str, Any]) -> dict[str, Any]:
    """The ModelOptions fields a peer takes from rank 0's session."""
    return {name: session["options"][name] for name in SESSION_OPTIONS}


__all__ = ["ProcessRanksExecutor", "start_rank_zero", "session_options"]
