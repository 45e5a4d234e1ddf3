"""A peer rank's process: join rank 0, load this rank of the core, replay every frame rank 0 sends.

    code = run_rank(RankProcessOptions(core, rank=1, store=("host0", 29400)))

Startup: Bootstrap.load (verify, authorize, validate: the same checks as rank 0), join the
store with this rank's identity (a core or contract other than rank 0's is refused there,
with the field that differs), then build this rank's executor with the factory rank 0 uses
(executors/factory.py EXECUTORS) from the session's programs and options, and send rank 0 the
geometry it produced.

Serving: the main thread reads LAUNCH (the staging frame lands straight in this rank's
frame), checks its sequence, launches; a reply thread waits for each launched frame in
order and sends its completion words back (a CUDA rank launches frame f+1 while f runs).
READ answers a buffer copy (diagnostics). CLOSE ends with exit 0; rank 0 going away ends
with RANK_LOST; an executor error is sent to rank 0 as FAILED and ends with STEP_FAILED.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from helios_backend.engine.bootstrap import Bootstrap
from helios_backend.executors.base import Executor, RankPlacement
from helios_backend.executors.factory import EXECUTORS, ModelOptions
from helios_backend.ranks.rank_zero import Runs, session_options
from helios_backend.ranks.reduce import StarReduceLeaf, leaf_page_agreement
from helios_backend.ranks.rendezvous import RankIdentity, RendezvousError, join
from helios_backend.ranks.wire import Kind, Link, RankLostError

log = logging.getLogger("helios.rank")

EXIT_OK = 0
EXIT_STARTUP = 3          # the core, the rendezvous (a refusal included) or the executor failed to start
EXIT_RANK_LOST = 4        # rank 0 went away or broke the protocol
EXIT_STEP_FAILED = 5      # this rank's executor failed a step


@dataclass(frozen=True)
class RankProcessOptions:
    core_path: Path
    rank: int
    store: tuple[str, int]
    acceptance: str
    executor: str = "cpu"
    device: Optional[int] = None          # cuda: the device ordinal (default: the rank)
    join_timeout_s: float = 600.0


def load_rank(options: RankProcessOptions) -> tuple[Bootstrap, Link, Executor, list[str], list[Runs]]:
    """Bootstrap, rendezvous and this rank's executor; (bootstrap, link, executor, programs, the
    frame runs a LAUNCH of each program carries)."""
    bootstrap = Bootstrap.load(options.core_path, options.acceptance)
    try:
        contract, manifest = bootstrap.contract, bootstrap.manifest
        identity = RankIdentity.of(contract, manifest.world_size, bootstrap.core.content_digest(), options.executor)
        link, session = join(options.store, options.rank, identity, options.join_timeout_s)
    except BaseException:
        bootstrap.close()
        raise
    try:
        programs = list(session["programs"])
        runs = [tuple((int(start), int(nbytes)) for start, nbytes in session["runs"][name]) for name in programs]
        model_options = ModelOptions(rank=options.rank, **session_options(session))
        uid = session.get("nccl_unique_id")
        placement = RankPlacement(rank=options.rank, reduce=StarReduceLeaf(link),
                                  nccl_unique_id=bytes.fromhex(uid) if uid else None,
                                  agree_pages=leaf_page_agreement(link), device=options.device)
        graphs = [g for g in contract.model.graphs if g.program in set(programs)]
        executor = EXECUTORS[options.executor](contract, manifest, bootstrap.read_resource, model_options,
                                               graphs, placement)
        link.send(Kind.GEOMETRY, payload=json.dumps({
            "cache_pages": executor.cache_pages, "buffer_offsets": executor.buffer_offsets(options.rank),
            "arena_nbytes": executor.arena_nbytes(options.rank)}).encode())
    except BaseException as exc:
        try:
            link.send(Kind.FAILED, payload=f"startup failed: {type(exc).__name__}: {exc}".encode())
        except RankLostError:
            pass
        link.close()
        bootstrap.close()
        raise
    return bootstrap, link, executor, programs, runs


def serve_rank(executor: Executor, link: Link, rank: int, programs: list[str], runs: list[Runs]) -> int:
    """Replay rank 0's frames until CLOSE; the exit code (module docstring)."""
    launched: "queue.SimpleQueue[tuple[int, int] | None]" = queue.SimpleQueue()
    failure: list[str] = []

    def reply() -> None:
        executor.bind_thread()
        while (item := launched.get()) is not None:
            frame, sequence = item
            try:
                words = executor.wait(frame)
            except Exception as exc:   # noqa: BLE001 - sent to rank 0, then this rank exits
                failure.append(f"rank {rank}: {type(exc).__name__}: {exc}")
                _send_failure(link, failure[0])
                return
            try:
                link.send(Kind.COMPLETION, frame=frame, value=sequence, payload=words.data)
            except RankLostError:
                return

    replier = threading.Thread(target=reply, name=f"rank{rank}-completions", daemon=True)
    replier.start()
    sequence = 0
    try:
        while not failure:
            kind, frame, item, value, nbytes = link.read_header()
            if kind == Kind.LAUNCH:
                staging = executor.staging(frame)
                expected = sum(n for _, n in runs[item]) if 0 <= item < len(programs) else -1
                if nbytes != expected or value != sequence:
                    raise RankLostError(0, f"a launch this rank cannot follow (sequence {value}, expected "
                                           f"{sequence}; {nbytes} frame bytes, {expected} here)")
                for start, length in runs[item]:       # the frame bytes the program reads, in place
                    link.read_exact(staging[start:start + length].data)
                try:
                    executor.launch(programs[item], frame)
                except RankLostError:
                    raise
                except Exception as exc:   # noqa: BLE001 - sent to rank 0
                    failure.append(f"rank {rank}: {programs[item]}: {type(exc).__name__}: {exc}")
                    _send_failure(link, failure[0])
                    break
                sequence += 1
                launched.put((frame, value))
            elif kind == Kind.READ:
                name = link.read_payload(nbytes).decode()
                try:
                    data = executor.read_buffer(name, rank)
                    link.send(Kind.BUFFER, payload=data.data)
                except KeyError:
                    link.send(Kind.BUFFER, value=-1)
            elif kind == Kind.CLOSE:
                return EXIT_OK
            else:
                raise RankLostError(0, f"sent an unexpected {Kind(kind).name}")
        log.error("%s", failure[0])
        return EXIT_STEP_FAILED
    except RankLostError as exc:
        log.error("rank %d: %s; exiting", rank, exc)
        executor.abort()              # a CUDA step waiting for rank 0's all-reduce ends now
        return EXIT_RANK_LOST
    finally:
        launched.put(None)
        replier.join(timeout=5)


def _send_failure(link: Link, message: str) -> None:
    try:
        link.send(Kind.FAILED, payload=message.encode())
    except RankLostError:
        pass


def run_rank(options: RankProcessOptions) -> int:
    """helios-rank's body: load, serve, release; the exit code."""
    try:
        bootstrap, link, executor, programs, runs = load_rank(options)
    except RendezvousError as exc:
        log.error("helios-rank %d: %s", options.rank, exc)
        return EXIT_STARTUP
    except Exception as exc:   # noqa: BLE001 - a startup failure names its cause and exits non-zero
        log.error("helios-rank %d: startup failed: %s: %s", options.rank, type(exc).__name__, exc)
        return EXIT_STARTUP
    log.info("helios-rank %d: serving %d programs for rank 0 at %s:%d", options.rank, len(programs), *options.store)
    try:
        return serve_rank(executor, link, options.rank, programs, runs)
    finally:
        link.close()
        executor.close()
        bootstrap.close()


__all__ = ["RankProcessOptions", "run_rank", "serve_rank", "load_rank"]
