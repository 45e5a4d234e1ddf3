"""helios-rank: one tensor-parallel rank of a core, as a process of its own (RankPeers::Processes).

    helios-rank --core CORE --rank R --store HOST:PORT [--executor cpu|numpy|cuda] [--device N]

It joins the rendezvous store of rank 0 (the process that serves the model: helios-serve
--rank-peers processes, which also starts the local ranks itself), loads rank R of the same
core and replays every frame rank 0 sends until rank 0 closes it. Exit codes: 0 closed by
rank 0; 3 startup failed (the core, a refusal at rendezvous naming the field that differs,
the executor); 4 rank 0 went away; 5 a step failed on this rank.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from helios_backend.engine.settings import DEFAULT_ACCEPTANCE
from helios_backend.executors.factory import EXECUTOR_NAMES
from helios_backend.ranks.rank_process import EXIT_STARTUP, RankProcessOptions, run_rank
from helios_backend.ranks.rendezvous import parse_address


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="helios-rank", description=__doc__.split("\n\n")[0])
    p.add_argument("--core", required=True, type=Path, help="the prepared core, the same one rank 0 serves (required)")
    p.add_argument("--rank", required=True, type=int, help="this process's rank, 1..world_size-1 (required)")
    p.add_argument("--store", required=True, help="HOST:PORT of rank 0's rendezvous store (required)")
    p.add_argument("--acceptance", default=DEFAULT_ACCEPTANCE, help="the publisher namespace you accept (default: %(default)s)")
    p.add_argument("--executor", choices=EXECUTOR_NAMES, default="cpu", help="the executor, which must be rank 0's (default: %(default)s)")
    p.add_argument("--device", type=int, default=None, help="cuda: device ordinal (default: the rank)")
    p.add_argument("--join-timeout", type=float, default=600.0, help="seconds to wait for rank 0's store (default: %(default)s)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    try:
        store = parse_address(args.store, "--store")
    except ValueError as exc:
        print(f"helios-rank: {exc}", file=sys.stderr)
        return 2
    if args.rank < 1:
        print(f"helios-rank: --rank {args.rank}: rank 0 is the serving process; peers are 1..world_size-1",
              file=sys.stderr)
        return 2
    if not args.core.is_file():
        print(f"helios-rank: no core at {args.core}", file=sys.stderr)
        return EXIT_STARTUP
    return run_rank(RankProcessOptions(core_path=args.core.resolve(), rank=args.rank, store=store,
                                       acceptance=args.acceptance, executor=args.executor, device=args.device,
                                       join_timeout_s=args.join_timeout))


if __name__ == "__main__":
    sys.exit(main())
