"""Benchmarks (not tests): figures printed as tables beside peers measured in the same run.

Each module runs as `python -m bench.NAME`; `python -m bench` (`make bench`) runs the one to run
first on this machine and `python -m bench --list` names them all. bench/harness.py holds what
they share; results go to one folder per device (bench/results/README.md indexes the kept ones).
"""
