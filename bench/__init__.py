"""Benchmarks (not tests): throughput figures printed as tables."""
