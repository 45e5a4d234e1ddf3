"""Condense `ncu --csv --page details` output to one line per kernel launch.

    python3 -m bench.ncu_summary ncu.csv
"""
from __future__ import annotations

import csv
import sys
from collections import OrderedDict

WANTED = ("Duration", "DRAM Throughput", "Memory Throughput", "Compute (SM) Throughput", "Grid Size",
          "Block Size", "Registers Per Thread", "Dynamic Shared Memory Per Block", "Achieved Occupancy",
          "Waves Per SM")


def main(path: str) -> None:
    rows = list(csv.reader(line for line in open(path) if line.startswith('"')))
    header, body = rows[0], rows[1:]
    col = {name: i for i, name in enumerate(header)}
    launches: "OrderedDict[tuple[str, str], dict[str, str]]" = OrderedDict()
    for row in body:
        key = (row[col["ID"]], row[col["Kernel Name"]][:40])
        if row[col["Metric Name"]] in WANTED:
            launches.setdefault(key, {})[row[col["Metric Name"]]] = f"{row[col['Metric Value']]} {row[col['Metric Unit']]}".strip()
    for (launch, kernel), metrics in launches.items():
        print(launch, kernel, "; ".join(f"{k}={metrics[k]}" for k in WANTED if k in metrics))


if __name__ == "__main__":
    main(sys.argv[1])
