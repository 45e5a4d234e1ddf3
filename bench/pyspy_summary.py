"""Where a process's time goes, from a py-spy raw profile (`py-spy record -f raw`, as
bench/served.py writes with --profile): the share of samples per thread and per function
(inclusive), the functions that were on top of the stack (exclusive), each as a percentage of
all samples in the file.

    python -m bench.pyspy_summary pyspy_stub.txt [--top 25] [--json OUT.json]

With `--gil` profiles (bench/served.py records those) the samples are the moments a thread held
the GIL, so the shares are of the work that serializes the process.
"""
from __future__ import annotations

import argparse
import collections
import json
import pathlib


_PLUMBING = ("Thread.", "_bootstrap", "BaseProcess.", "<module>", "spawn_main", "_main (")


def summarize(path: pathlib.Path, top: int) -> dict:
    total = 0
    threads: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    exclusive: collections.Counter[str] = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [frame.split(" (")[0] for frame in stack.split(";")]
        # the thread's entry: the first frame below threading's bootstrap
        entry = next((f for f in frames if not f.startswith(_PLUMBING)), frames[0])
        threads[entry] += n
        for name in set(frames):
            if not name.startswith(_PLUMBING):
                inclusive[name] += n
        exclusive[frames[-1]] += n

    def shares(counter: collections.Counter[str]) -> list[tuple[str, float]]:
        return [(name, round(100 * n / total, 1)) for name, n in counter.most_common(top)] if total else []

    return {"samples": total, "threads": shares(threads), "inclusive": shares(inclusive),
            "exclusive": shares(exclusive)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("profile", type=pathlib.Path)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    report = summarize(args.profile, args.top)
    print(f"{args.profile}: {report['samples']} samples")
    for part in ("threads", "inclusive", "exclusive"):
        print(f"\n{part} (% of samples)")
        for name, share in report[part]:
            print(f"  {share:5.1f}  {name}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
